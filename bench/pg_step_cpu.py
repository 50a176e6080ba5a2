"""Client CPU per workflow step on PostgreSQL, on two checkouts side by side.

Usage::

    python bench/pg_step_cpu.py [--old CHECKOUT] [--pg-url URL] [--mode cluster|plain]
                                [--inflight 100] [--workflows 1000] [--steps 10]
                                [--rounds 3] [--new-options QUERY] [--profile FILE]
                                [--dir DIR] [--seconds S]

Workload: ``--workflows`` runs of a workflow awaiting ``--steps`` trivial async
activities in sequence, at most ``--inflight`` runs in flight, after 50
untimed warm-up runs, one engine process on a fresh schema of the database
``--pg-url`` names (default ``$AION_TRIO_TEST_PG_URL`` or
``postgresql://postgres@127.0.0.1:5432/test``; the schema is dropped at the
end).  ``--mode cluster`` (default) opens the store with ``?node=`` as
``bench/pg_cluster.py``'s engines do (fenced appends, lease, LISTEN);
``plain`` without.  Each measurement runs in a fresh subprocess with
``PYTHONPATH`` pointing at the checkout measured (``plugins/`` and
``contrib/aion-trio-postgres`` included): the tree this script sits in
(``new``) and, with ``--old``, another checkout (e.g. ``git worktree add
--detach /tmp/old main``).  The two alternate, ``--rounds`` rounds, the order
flipping each round, so both see the same machine drift.

One ``step`` line per measurement: ``cpu_us_per_step`` is
``time.process_time`` of the engine process (every thread: the Trio loop and
the store's worker threads, i.e. psycopg) over the timed runs, per step; the
server's own CPU is not in it; ``user_us_per_step`` and
``system_us_per_step`` split it (``os.times``, 10 ms ticks: coarse for short
runs); ``trio_thread_us_per_step`` is the Trio thread's share
(``time.thread_time``), the rest ran in worker threads (the store's calls).  ``steps_per_s`` is wall time, and moves with
the load of the machine far more.  ``--new-options`` adds URL query options
to the new side only (e.g. ``pool_size=8``).  ``--profile FILE`` runs the new
side once more under ``cProfile`` timed by ``time.thread_time`` (CPU, not waits; one profiler per thread, every thread
the process starts: ``threading.setprofile``; the whole process, open and
warm-up included), writes the merged stats to ``FILE`` (``python -m pstats
FILE``) and the top 30 entries by internal time, as shares of the total, on
one ``profile`` line.

A ``summary`` line gives the medians of each side and the new/old ratio of the
CPU per step, with the 1-minute load average.  ``--seconds`` below 10 is a
smoke run (200 workflows, one round).  Not part of the test run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import uuid
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import emitter, run_in_scratch

emit = emitter("pg_step_cpu")
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_PG_URL = "postgresql://postgres@127.0.0.1:5432/test"
WARMUP = 50


def worker(args: argparse.Namespace) -> int:
    """One measurement in this process: print one JSON line."""
    import threading
    import time

    import trio

    import aion_trio as aion

    @aion.activity(name="increment")
    async def increment(x: int) -> int:
        return x + 1

    @aion.workflow(name="chain")
    async def chain(ctx: aion.WorkflowContext, steps: int) -> int:
        value = 0
        for _ in range(steps):
            value = await ctx.run(increment, value)
        return int(value)

    options = [f"schema={args.schema}"]
    if args.mode == "cluster":
        options.append(f"node=bench-{os.getpid()}")
    if args.options:
        options.append(args.options)
    url = f"{args.pg_url}?{'&'.join(options)}"
    record: dict[str, Any] = {
        "kind": "step",
        "side": args.side,
        "mode": args.mode,
        "inflight": args.inflight,
        "options": args.options,
        "tree": os.path.dirname(os.path.dirname(os.path.abspath(aion.__file__))),
    }

    async def batch(engine: Any, prefix: str, n: int) -> None:
        limiter = trio.CapacityLimiter(args.inflight)

        async def one(i: int) -> None:
            async with limiter:
                run = await engine.start(chain, args.steps, workflow_id=f"{prefix}-{i}")
                if await run.result() != args.steps:
                    raise RuntimeError(f"{prefix}-{i} returned a wrong result")

        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(one, i)

    profilers: list[Any] = []
    if args.profile:
        import cProfile

        def start_profiling(*_: Any) -> None:
            # The first profile event of a new thread: give that thread its own profiler.
            profiler = cProfile.Profile(time.thread_time)
            profilers.append(profiler)
            profiler.enable()

        # Every thread started from here on (Trio's worker threads run psycopg) and this one.
        threading.setprofile(start_profiling)
        start_profiling()

    async def main() -> None:
        config = aion.EngineConfig(loop_stall_warning=None)
        async with aion.open_engine(url, workflows=[chain], activities=[increment], config=config) as engine:
            await batch(engine, "warm", WARMUP)
            steps = args.workflows * args.steps
            times0 = os.times()
            cpu0, wall0, trio0 = time.process_time(), time.perf_counter(), time.thread_time()
            await batch(engine, "timed", args.workflows)
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
            in_trio = time.thread_time() - trio0
            times = os.times()
            record.update(
                workflows=args.workflows,
                steps_per_s=round(steps / wall, 1),
                cpu_us_per_step=round(cpu / steps * 1e6, 1),
                user_us_per_step=round((times.user - times0.user) / steps * 1e6, 1),
                system_us_per_step=round((times.system - times0.system) / steps * 1e6, 1),
                trio_thread_us_per_step=round(in_trio / steps * 1e6, 1),
            )

    trio.run(main)
    if profilers:
        import pstats

        threading.setprofile(None)  # type: ignore[arg-type]
        stats = pstats.Stats(profilers[0])
        for profiler in profilers[1:]:
            stats.add(profiler)
        stats.dump_stats(args.profile)
        entries = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)  # type: ignore[attr-defined]
        total = sum(v[2] for v in stats.stats.values())  # type: ignore[attr-defined]
        record["profile_threads"] = len(profilers)
        record["profile_note"] = (
            "whole process: open, warm-up and timed runs; under cProfile, per-thread CPU time"
        )
        record["profile_top_tottime"] = [
            {
                "function": f"{os.path.basename(f)}:{line}:{name}",
                "share": round(v[2] / total, 3),
                "calls": v[1],
            }
            for (f, line, name), v in entries[:30]
        ]
    print(json.dumps(record), flush=True)
    return 0


def _schema_sql(pg_url: str, statement: str, schema: str) -> None:
    import psycopg
    from psycopg import sql

    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(sql.SQL(statement).format(sql.Identifier(schema)))


def measure(
    args: argparse.Namespace, directory: str, side: str, tree: str, profile: str | None = None
) -> dict[str, Any]:
    env = dict(os.environ)
    paths = [tree, os.path.join(tree, "plugins"), os.path.join(tree, "contrib", "aion-trio-postgres")]
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    schema = f"aion_pgcpu_{uuid.uuid4().hex[:12]}"
    command = [
        sys.executable,
        os.path.join(HERE, "bench", "pg_step_cpu.py"),
        "--worker",
        "--side",
        side,
        "--pg-url",
        args.pg_url,
        "--schema",
        schema,
        "--mode",
        args.mode,
        "--inflight",
        str(args.inflight),
        "--workflows",
        str(args.workflows),
        "--steps",
        str(args.steps),
        "--options",
        args.new_options if side == "new" else "",
    ]
    if profile:
        command += ["--profile", profile]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=directory)
    finally:
        _schema_sql(args.pg_url, "DROP SCHEMA IF EXISTS {} CASCADE", schema)
    if done.returncode != 0:
        raise RuntimeError(f"{side} worker failed:\n{done.stderr[-3000:]}")
    record: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", help="another checkout to measure beside this one")
    parser.add_argument(
        "--pg-url", default=os.environ.get("AION_TRIO_TEST_PG_URL", "").strip() or DEFAULT_PG_URL
    )
    parser.add_argument("--mode", choices=("cluster", "plain"), default="cluster")
    parser.add_argument("--inflight", type=int, default=100)
    parser.add_argument("--workflows", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-options", default="", help="URL query options of the new side only")
    parser.add_argument("--profile", help="also profile the new side once; write its stats here")
    parser.add_argument("--dir", default=None)
    parser.add_argument("--seconds", type=float, default=600.0, help="below 10: a smoke run")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--side", default="new", help=argparse.SUPPRESS)
    parser.add_argument("--schema", help=argparse.SUPPRESS)
    parser.add_argument("--options", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.seconds < 10:
        args.workflows, args.rounds = 200, 1
    sides = [("new", HERE)] + ([("old", os.path.abspath(args.old))] if args.old else [])

    def body(directory: str) -> None:
        emit({"kind": "environment", "loadavg_1m": round(os.getloadavg()[0], 2), "cpus": os.cpu_count()})
        results: dict[str, list[dict[str, Any]]] = {}
        for r in range(args.rounds):
            order = sides if r % 2 == 0 else sides[::-1]
            for side, tree in order:
                record = measure(args, directory, side, tree)
                record["round"] = r
                emit(record)
                results.setdefault(side, []).append(record)
        summary: dict[str, Any] = {"kind": "summary", "mode": args.mode, "inflight": args.inflight}
        for side, _ in sides:
            for key in ("cpu_us_per_step", "steps_per_s"):
                summary[f"{side}_{key}"] = round(statistics.median(row[key] for row in results[side]), 1)
        if args.old:
            summary["cpu_new_over_old"] = round(
                summary["new_cpu_us_per_step"] / summary["old_cpu_us_per_step"], 3
            )
        summary["loadavg_1m"] = round(os.getloadavg()[0], 2)
        emit(summary)
        if args.profile:
            record = measure(args, directory, "new", HERE, profile=os.path.abspath(args.profile))
            emit({"kind": "profile", "file": os.path.abspath(args.profile), **record})

    run_in_scratch("aion-pg-step-cpu-", args.dir, body, emit)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
