"""A fresh process's first ``open_engine("sqlite:///...")``: the time the installed plugins cost it.

Usage::

    python bench/first_open.py [--old CHECKOUT] [--rounds R] [--dir DIR] [--seconds S]

Each measurement is a new interpreter (this file, ``--measure``) that imports
``aion_trio`` and opens an engine over a new SQLite file, closing it at once:
``open_seconds`` is the time from before the import until ``open_engine``
returned (the entry points are loaded then, every installed store plugin
imported); ``process_seconds`` is the subprocess's whole wall time, seen by
the driver (interpreter start and exit included); ``psycopg_loaded`` says
whether the PostgreSQL driver was imported along the way.

``--old CHECKOUT`` measures two checkouts side by side in one run: this tree
(``new``) and ``CHECKOUT`` (e.g. ``git archive main | tar -x -C /tmp/old``),
each with ``PYTHONPATH`` pointing at the tree measured (``plugins/`` and
``contrib/*`` included), ``--rounds`` rounds (default 5), the order flipping
each round; then a ``summary`` line with each side's medians.  Without
``--old`` only this tree is measured.  ``--seconds S`` (tox's bench smoke)
does one round.  Prints one JSON line (``figures``) per measurement and the
``done`` line.
"""

from __future__ import annotations

import time

BEGAN = time.perf_counter()

import argparse  # noqa: E402 - the clock starts before any import
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emitter, run_in_scratch  # noqa: E402

emit = emitter("first_open")
HERE = str(Path(__file__).resolve().parent.parent)


def measure(path: str) -> None:
    """In this process: import aion_trio, open and close an engine over ``path``; print the figures."""
    import trio

    import aion_trio

    async def body() -> None:
        async with aion_trio.open_engine(f"sqlite:///{path}"):
            pass

    trio.run(body)
    opened = time.perf_counter() - BEGAN
    plugin = sys.modules.get("aion_trio_postgres")
    emit(
        {
            "kind": "figures",
            "open_seconds": round(opened, 4),
            "psycopg_loaded": "psycopg" in sys.modules,
            "code": os.path.dirname(aion_trio.__file__ or ""),
            "postgres_plugin": getattr(plugin, "__file__", None),
        }
    )


def tree_path(tree: str) -> list[str]:
    contrib = Path(tree, "contrib")
    return [tree, os.path.join(tree, "plugins"), *sorted(str(p) for p in contrib.iterdir() if p.is_dir())]


def measure_side(directory: str, side: str, tree: str, n: int) -> dict[str, Any]:
    """One measurement of ``tree``'s code in a fresh subprocess."""
    env = dict(os.environ)
    paths = tree_path(tree)
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    db = os.path.join(directory, f"{side}-{n}.db")
    began = time.perf_counter()
    done = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--measure", db],
        env=env,
        capture_output=True,
        text=True,
        cwd=directory,
        check=False,
    )
    process = time.perf_counter() - began
    if done.returncode != 0:
        raise RuntimeError(f"{side} measurement failed:\n{done.stderr[-3000:]}")
    for line in done.stdout.splitlines():
        record: dict[str, Any] = json.loads(line)
        if record.get("kind") == "figures":
            if not record["code"].startswith(os.path.abspath(tree)):
                raise RuntimeError(f"{side} measured {record['code']}, not the code of {tree}")
            plugin = record["postgres_plugin"]
            if plugin is not None and not plugin.startswith(os.path.abspath(tree)):
                raise RuntimeError(f"{side} loaded the postgres plugin from {plugin}, not {tree}")
            return {**record, "side": side, "process_seconds": round(process, 4)}
    raise RuntimeError(f"{side} measurement printed no figures:\n{done.stdout[-3000:]}")


def run(args: argparse.Namespace, directory: str) -> None:
    sides = [("new", HERE)] + ([("old", os.path.abspath(args.old))] if args.old else [])
    results: dict[str, list[dict[str, Any]]] = {side: [] for side, _ in sides}
    for r in range(args.rounds):
        for side, tree in sides if r % 2 == 0 else sides[::-1]:
            record = measure_side(directory, side, tree, r)
            record["round"] = r
            emit(record)
            results[side].append(record)
    summary: dict[str, Any] = {"kind": "summary", "rounds": args.rounds}
    for side, _ in sides:
        for key in ("open_seconds", "process_seconds"):
            summary[f"{side}_{key}_median"] = round(statistics.median(row[key] for row in results[side]), 4)
    if args.old:
        summary["open_old_over_new"] = round(
            summary["old_open_seconds_median"] / max(summary["new_open_seconds_median"], 1e-9), 2
        )
    emit(summary)


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--old", help="another checkout to measure beside this one")
    parser.add_argument("--rounds", type=int, default=5, help="measurements per side (default 5)")
    parser.add_argument("--dir", help="parent of the scratch directory")
    parser.add_argument("--seconds", type=float, help="smoke run: one round")
    parser.add_argument("--measure", metavar="DB", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.seconds is not None:
        args.rounds = 1
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    if args.measure:
        measure(args.measure)
        return
    run_in_scratch("aion-first-open-", args.dir, lambda directory: run(args, directory), emit)


if __name__ == "__main__":
    main()
