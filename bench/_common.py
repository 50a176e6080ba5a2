"""What the benchmark scripts share: JSON lines, percentiles, a scratch directory."""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any


def emitter(bench: str) -> Callable[[dict[str, Any]], None]:
    """``emit(record)``: print ``record`` as one JSON line tagged with the bench's name."""

    def emit(record: dict[str, Any]) -> None:
        print(json.dumps({"bench": bench, **record}), flush=True)

    return emit


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


def run_in_scratch(
    prefix: str, parent: str | None, body: Callable[[str], None], emit: Callable[[dict[str, Any]], None]
) -> None:
    """Run ``body(directory)`` in a fresh directory under ``parent`` (created if missing),
    emit the ``done`` line with the load average, and remove the directory."""
    if parent:
        os.makedirs(parent, exist_ok=True)
    directory = tempfile.mkdtemp(prefix=prefix, dir=parent or None)
    began = time.perf_counter()
    try:
        body(directory)
        # Other processes on the machine skew every number: the load shows how much.
        emit(
            {
                "kind": "done",
                "total_seconds": round(time.perf_counter() - began, 1),
                "loadavg_1m": round(os.getloadavg()[0], 2),
            }
        )
    finally:
        shutil.rmtree(directory, ignore_errors=True)
