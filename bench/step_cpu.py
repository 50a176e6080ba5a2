"""CPU, GC share, tasks and allocations per workflow step, on two checkouts side by side.

Usage::

    python bench/step_cpu.py [--old CHECKOUT] [--store memory|sqlite-full|sqlite-normal]
                             [--inflight 100,1000] [--workflows 2000] [--steps 10]
                             [--rounds 3] [--dir DIR] [--seconds S]

Workload: ``--workflows`` runs of a workflow awaiting ``--steps`` trivial async
activities in sequence, at most ``--inflight`` runs in flight (start and
result inside one limiter slot), after 50 untimed warm-up runs.  Each
measurement runs in a fresh subprocess (a fresh heap: the cycle collector's
cost depends on everything the process holds), with ``PYTHONPATH`` pointing
at the checkout measured (``plugins/`` included): the tree this script sits
in (``new``) and, with ``--old``, another checkout (e.g. ``git worktree add
--detach /tmp/old main``).  The two alternate, ``--rounds`` rounds, the
order flipping each round, so both see the same machine drift.

One ``step`` line per measurement:

- ``cpu_us_per_step``: ``time.process_time`` (every thread of the process:
  the Trio loop and the store's writer) over the timed runs, per step;
  moves far less with the machine's load than ``steps_per_s`` does;
- ``gc_share``: the cycle collector's time (``gc.callbacks``) over the
  process CPU time, and ``gc_collections`` by generation;
- ``tasks_per_step`` / ``task_steps_per_step``: Trio tasks spawned and task
  steps run (a Trio instrument), per step;
- ``gc_collected_per_step``: objects only the cycle collector freed (garbage
  cycles), per step;
- ``calls_per_step``: Python function calls per step (``sys.setprofile``,
  a separate pass of ``--workflows // 10`` runs), and ``alloc_blocks_per_step``: memory blocks
  allocated per step and still held at the pass's busiest moment
  (``tracemalloc``'s peak over its start, per step in flight).

A ``summary`` line per in-flight level gives the medians of each side and
the new/old ratio of the CPU per step.  ``--seconds`` below 10 is a smoke run
(200 workflows, one round).  Not part of the test run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import emitter, run_in_scratch

emit = emitter("step_cpu")
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARMUP = 50


def worker(args: argparse.Namespace) -> int:
    """One measurement in this process: print one JSON line."""
    import gc
    import tracemalloc

    import attrs
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

    fields = {f.name for f in attrs.fields(aion.EngineConfig)}
    settings: dict[str, Any] = {"loop_stall_warning": None}
    if "max_inflight_starts" in fields:
        settings["max_inflight_starts"] = None
    for key, value in json.loads(args.config).items():
        settings[key] = tuple(value) if isinstance(value, list) else value
    config = aion.EngineConfig(**settings)
    if args.store == "memory":
        url = "memory://"
    else:
        sync = "FULL" if args.store == "sqlite-full" else "NORMAL"
        url = f"sqlite:///{args.dir}/step-{os.getpid()}.db?synchronous={sync}"

    class Counter(trio.abc.Instrument):
        def __init__(self) -> None:
            self.spawned = 0
            self.steps = 0

        def task_spawned(self, task: Any) -> None:
            self.spawned += 1

        def before_task_step(self, task: Any) -> None:
            self.steps += 1

    counter = Counter()
    gc_time = [0.0, 0.0]
    collections = [0, 0, 0]
    collected = [0]

    def gc_timer(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            gc_time[1] = time.process_time()
        else:
            gc_time[0] += time.process_time() - gc_time[1]
            collections[info["generation"]] += 1
            collected[0] += info["collected"]

    record: dict[str, Any] = {
        "kind": "step",
        "side": args.side,
        "store": args.store,
        "inflight": args.inflight,
        "python": sys.version.split()[0],
        "config": json.loads(args.config),
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

    async def main() -> None:
        async with aion.open_engine(url, workflows=[chain], activities=[increment], config=config) as engine:
            await batch(engine, "warm", WARMUP)
            steps = args.workflows * args.steps
            # Timed pass.
            trio.lowlevel.add_instrument(counter)
            gc.callbacks.append(gc_timer)
            cpu0, wall0 = time.process_time(), time.perf_counter()
            await batch(engine, "timed", args.workflows)
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
            gc.callbacks.remove(gc_timer)
            trio.lowlevel.remove_instrument(counter)
            record.update(
                workflows=args.workflows,
                steps_per_s=round(steps / wall, 1),
                cpu_us_per_step=round(cpu / steps * 1e6, 1),
                gc_share=round(gc_time[0] / cpu, 3),
                gc_collections=collections,
                gc_collected_per_step=round(collected[0] / steps, 2),
                tasks_per_step=round(counter.spawned / steps, 2),
                task_steps_per_step=round(counter.steps / steps, 2),
            )
            # Counting passes (slower: not timed).
            small = max(args.workflows // 10, 20)
            small_steps = small * args.steps
            gc.collect()
            calls = [0]

            def profiler(frame: Any, event: str, arg: Any) -> None:
                if event == "call":
                    calls[0] += 1

            sys.setprofile(profiler)
            await batch(engine, "calls", small)
            sys.setprofile(None)
            record["calls_per_step"] = round(calls[0] / small_steps, 1)
            tracemalloc.start()
            base = tracemalloc.get_traced_memory()[0]
            await batch(engine, "alloc", small)
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            in_flight_steps = min(args.inflight, small) * args.steps
            record["traced_peak_bytes_per_step_in_flight"] = round((peak - base) / in_flight_steps)

    trio.run(main)
    print(json.dumps(record), flush=True)
    return 0


def measure(args: argparse.Namespace, directory: str, side: str, tree: str, inflight: int) -> dict[str, Any]:
    env = dict(os.environ)
    paths = [tree, os.path.join(tree, "plugins"), os.path.join(tree, "contrib", "aion-trio-postgres")]
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    command = [
        sys.executable,
        os.path.join(HERE, "bench", "step_cpu.py"),
        "--worker",
        "--side",
        side,
        "--store",
        args.store,
        "--inflight",
        str(inflight),
        "--workflows",
        str(args.workflows),
        "--steps",
        str(args.steps),
        "--dir",
        directory,
        "--config",
        args.config if side == "new" else "{}",
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=directory)
    if done.returncode != 0:
        raise RuntimeError(f"{side} worker failed:\n{done.stderr[-3000:]}")
    record: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", help="another checkout to measure beside this one")
    parser.add_argument("--store", choices=("memory", "sqlite-full", "sqlite-normal"), default="sqlite-full")
    parser.add_argument("--inflight", default="100,1000", help="comma-separated in-flight levels")
    parser.add_argument("--workflows", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None)
    parser.add_argument(
        "--config", default="{}", help="JSON: EngineConfig settings of the new side (e.g. gc settings)"
    )
    parser.add_argument("--seconds", type=float, default=600.0, help="below 10: a smoke run")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--side", default="new", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        args.inflight = int(args.inflight)
        return worker(args)
    if args.seconds < 10:
        args.workflows, args.rounds = 200, 1
    sides = [("new", HERE)] + ([("old", os.path.abspath(args.old))] if args.old else [])
    levels = [int(x) for x in args.inflight.split(",")]

    def body(directory: str) -> None:
        results: dict[tuple[str, int], list[dict[str, Any]]] = {}
        for r in range(args.rounds):
            order = sides if r % 2 == 0 else sides[::-1]
            for inflight in levels:
                for side, tree in order:
                    record = measure(args, directory, side, tree, inflight)
                    record["round"] = r
                    emit(record)
                    results.setdefault((side, inflight), []).append(record)
        for inflight in levels:
            summary: dict[str, Any] = {"kind": "summary", "store": args.store, "inflight": inflight}
            for side, _ in sides:
                rows = results[(side, inflight)]
                for key in ("cpu_us_per_step", "steps_per_s", "gc_share", "tasks_per_step"):
                    summary[f"{side}_{key}"] = round(statistics.median(row[key] for row in rows), 3)
            if args.old:
                summary["cpu_new_over_old"] = round(
                    summary["new_cpu_us_per_step"] / summary["old_cpu_us_per_step"], 3
                )
            emit(summary)

    run_in_scratch("aion-step-cpu-", args.dir, body, emit)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
