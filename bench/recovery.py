"""Recovery after ``kill -9``: time for ``open_engine`` to return, and until the last parked run answers.

Usage::

    python bench/recovery.py [--runs N] [--concurrency C] [--lazy | --eager] [--old CHECKOUT] [--rounds R]
                             [--dir DIR] [--seconds S]

An engine subprocess (this file, ``--engine-process``) starts ``--runs``
workflows on one SQLite file (FULL), each parked on a signal, and prints
``READY`` once every start is durable; the driver SIGKILLs it.  Then, in this
process, an engine opens the same file: ``open_seconds`` is the time until
``open_engine`` returns; then every workflow is signalled (``--concurrency``
at a time) and its result awaited: ``all_answered_seconds`` is the time from
the start of opening until the last one completed with the right result (and
``signal_p50_ms`` / ``signal_p99_ms`` the time of one signal and its result).
The engine opens with its default ``EngineConfig`` (lazy recovery where the
tree makes it the default: the runs are replayed in the background after
``open_engine`` returns, or when signalled); ``--lazy`` opens with
``EngineConfig(lazy_recovery=True)``, ``--eager`` with ``lazy_recovery=False``
(every run replayed before ``open_engine`` returns).

``--old CHECKOUT`` measures two checkouts side by side in one run: this tree
(``new``) and ``CHECKOUT`` (e.g. ``git archive main | tar -x -C /tmp/old``),
each measurement a fresh subprocess with ``PYTHONPATH`` pointing at the tree
measured (``plugins/`` included), ``--rounds`` rounds, the order flipping each
round so both see the same machine drift; then a ``summary`` line with each
side's median ``open_seconds`` and ``all_answered_seconds`` and the old/new
ratio of ``open_seconds``.  Without ``--old``, this process measures the code
it imports.  ``--seconds S`` (tox's bench smoke) caps the runs at about ``S``
seconds' worth (20 runs per 0.1 s, at least 20) and does one round.
Prints one JSON line (``figures``) per measurement and the ``done`` line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import trio
from _common import emitter, percentile, run_in_scratch

import aion_trio as aion

emit = emitter("recovery")


@aion.workflow(name="parked")
async def parked(ctx: aion.WorkflowContext, index: int) -> int:
    value = await ctx.wait_signal("go")
    return int(value) + index


async def engine_process(url: str, runs: int) -> None:
    """Start ``runs`` parked workflows, say READY, then wait to be killed."""
    async with aion.open_engine(url, workflows=[parked]) as engine:
        limiter = trio.CapacityLimiter(200)

        async def start(index: int) -> None:
            async with limiter:
                await engine.start(parked, index, workflow_id=f"wf-{index}")

        async with trio.open_nursery() as nursery:
            for index in range(runs):
                nursery.start_soon(start, index)
        print("READY", flush=True)
        await trio.sleep_forever()


async def measure(url: str, runs: int, concurrency: int, lazy: bool | None) -> dict[str, Any]:
    began = time.perf_counter()
    latencies: list[float] = []
    wrong: list[str] = []
    config = aion.EngineConfig() if lazy is None else aion.EngineConfig(lazy_recovery=lazy)
    async with aion.open_engine(url, workflows=[parked], config=config) as engine:
        opened = time.perf_counter() - began
        limiter = trio.CapacityLimiter(concurrency)

        async def answer(index: int) -> None:
            async with limiter:
                at = time.perf_counter()
                await engine.signal(f"wf-{index}", "go", 1000)
                result = await engine.result(f"wf-{index}")
                latencies.append(time.perf_counter() - at)
                if result != 1000 + index:
                    wrong.append(f"wf-{index}: {result!r}")

        async with trio.open_nursery() as nursery:
            for index in range(runs):
                nursery.start_soon(answer, index)
        answered = time.perf_counter() - began
        statistics = engine.statistics()
    latencies.sort()
    return {
        "kind": "figures",
        "runs": runs,
        "open_seconds": round(opened, 3),
        "all_answered_seconds": round(answered, 3),
        "signal_p50_ms": round(percentile(latencies, 0.5) * 1000, 1),
        "signal_p99_ms": round(percentile(latencies, 0.99) * 1000, 1),
        "wrong_results": len(wrong),
        "evictions": getattr(statistics, "evictions", None),
        "reloads": getattr(statistics, "reloads", None),
        "max_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def run(args: argparse.Namespace, directory: str) -> None:
    url = f"sqlite:///{Path(directory, 'recovery.db')}"
    child = subprocess.Popen(
        [sys.executable, __file__, "--engine-process", "--url", url, "--runs", str(args.runs)],
        stdout=subprocess.PIPE,
        env=os.environ.copy(),
    )
    assert child.stdout is not None
    began = time.perf_counter()
    line = child.stdout.readline()
    if line.strip() != b"READY":
        child.kill()
        raise SystemExit(f"the engine process did not start its workflows: {line!r}")
    started = time.perf_counter() - began
    child.send_signal(signal.SIGKILL)
    child.wait()
    figures = trio.run(measure, url, args.runs, args.concurrency, _lazy(args))
    emit(
        {
            **figures,
            "lazy_recovery": _lazy(args),
            "start_seconds": round(started, 3),
            "code": os.path.dirname(aion.__file__),
        }
    )


HERE = str(Path(__file__).resolve().parent.parent)


def measure_side(args: argparse.Namespace, directory: str, side: str, tree: str) -> dict[str, Any]:
    """One measurement of ``tree``'s code in a fresh subprocess (this file, without ``--old``)."""
    env = dict(os.environ)
    paths = [tree, os.path.join(tree, "plugins"), os.path.join(tree, "contrib", "aion-trio-postgres")]
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--runs",
        str(args.runs),
        "--concurrency",
        str(args.concurrency),
        "--dir",
        directory,
        *(["--lazy"] if args.lazy else []),
        *(["--eager"] if args.eager else []),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=directory)
    if done.returncode != 0:
        raise RuntimeError(f"{side} measurement failed:\n{done.stderr[-3000:]}")
    for line in done.stdout.splitlines():
        record: dict[str, Any] = json.loads(line)
        if record.get("kind") == "figures":
            if not record["code"].startswith(os.path.abspath(tree)):
                raise RuntimeError(f"{side} measured {record['code']}, not the code of {tree}")
            return {**record, "side": side}
    raise RuntimeError(f"{side} measurement printed no figures:\n{done.stdout[-3000:]}")


def compare(args: argparse.Namespace, directory: str) -> None:
    sides = [("new", HERE), ("old", os.path.abspath(args.old))]
    results: dict[str, list[dict[str, Any]]] = {"new": [], "old": []}
    for r in range(args.rounds):
        for side, tree in sides if r % 2 == 0 else sides[::-1]:
            record = measure_side(args, directory, side, tree)
            record["round"] = r
            emit(record)
            results[side].append(record)
    summary: dict[str, Any] = {"kind": "summary", "runs": args.runs, "lazy_recovery": _lazy(args)}
    for side, _ in sides:
        for key in ("open_seconds", "all_answered_seconds", "signal_p50_ms", "signal_p99_ms", "max_rss_mib"):
            summary[f"{side}_{key}"] = round(statistics.median(row[key] for row in results[side]), 3)
    summary["open_old_over_new"] = round(
        summary["old_open_seconds"] / max(summary["new_open_seconds"], 1e-9), 2
    )
    emit(summary)


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10_000, help="parked workflows (default 10,000)")
    parser.add_argument("--concurrency", type=int, default=100, help="signals in flight (default 100)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--lazy", action="store_true", help="EngineConfig(lazy_recovery=True) (a tree that has it)"
    )
    mode.add_argument(
        "--eager", action="store_true", help="EngineConfig(lazy_recovery=False) (a tree that has it)"
    )
    parser.add_argument("--old", help="another checkout to measure beside this one")
    parser.add_argument("--rounds", type=int, default=3, help="rounds with --old (default 3)")
    parser.add_argument("--dir", help="parent of the scratch directory")
    parser.add_argument("--seconds", type=float, help="smoke run: about this many seconds' worth of runs")
    parser.add_argument("--engine-process", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.seconds is not None:
        args.runs = min(args.runs, max(20, int(args.seconds * 200)))
        args.rounds = 1
    return args


def _lazy(args: argparse.Namespace) -> bool | None:
    """``lazy_recovery`` as asked (``None``: the tree's default)."""
    return True if args.lazy else False if args.eager else None


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    if args.engine_process:
        trio.run(engine_process, args.url, args.runs)
        return
    if args.old:
        run_in_scratch("aion-recovery-", args.dir, lambda directory: compare(args, directory), emit)
        return
    run_in_scratch("aion-recovery-", args.dir, lambda directory: run(args, directory), emit)


if __name__ == "__main__":
    main()
