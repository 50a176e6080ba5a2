"""The DBOS Transact side of the benchmarks, shared by ``throughput.py`` and ``pg_cluster.py``.

The workload is the one the aion_trio side runs: a workflow of ``steps``
sequential steps that each add one.  DBOS is a bench-only dependency, so this
module imports it only inside the functions the DBOS subprocesses call.
"""

from __future__ import annotations

import asyncio
import math
import subprocess
import time
from collections.abc import Callable, Coroutine
from typing import Any

Chain = Callable[[int], Coroutine[Any, Any, int]]


def define_chain() -> Chain:
    """Register the chain workflow and its step with DBOS (before ``DBOS(config=...)``)."""
    from dbos import DBOS

    @DBOS.step()
    async def increment_step(x: int) -> int:
        return x + 1

    @DBOS.workflow()
    async def chain_workflow(steps: int) -> int:
        value = 0
        for _ in range(steps):
            value = await increment_step(value)
        return value

    return chain_workflow


async def run_one(chain: Chain, steps: int) -> None:
    """Start one chain workflow, wait for it and check its result."""
    from dbos import DBOS

    handle = await DBOS.start_workflow_async(chain, steps)
    if await handle.get_result() != steps:
        raise RuntimeError("DBOS workflow returned a wrong result")


async def run_chains(
    chain: Chain, workflows: int, steps: int, concurrency: int, seconds: float | None
) -> tuple[int, float]:
    """Run ``workflows`` chains, ``concurrency`` in flight, starting none after ``seconds``
    (``None``: no cap); return (completed, elapsed seconds)."""
    semaphore = asyncio.Semaphore(concurrency)
    done = 0
    start = time.perf_counter()
    deadline = math.inf if seconds is None else start + seconds

    async def one() -> None:
        nonlocal done
        async with semaphore:
            if time.perf_counter() >= deadline:
                return
            await run_one(chain, steps)
            done += 1

    await asyncio.gather(*(one() for _ in range(workflows)))
    return done, time.perf_counter() - start


def dbos_available(python: str) -> str | None:
    """``None`` if ``python`` can import dbos, else the reason."""
    probe = subprocess.run(
        [python, "-c", "import dbos"], capture_output=True, text=True, check=False, timeout=120
    )
    if probe.returncode == 0:
        return None
    lines = probe.stderr.strip().splitlines()
    return f"{python} cannot import dbos ({lines[-1] if lines else 'exit ' + str(probe.returncode)})"
