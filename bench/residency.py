"""Residency: what a sleeping run costs (issue 17).

Usage::

    python bench/residency.py [--dir DIR] [--seconds S] [--runs 10000,100000] [--store sqlite|memory]
                              [--max-resident N|none]

For each N of ``--runs`` (each in a fresh child process, so one size's memory
does not weigh on the next), an engine on a fresh store (SQLite, the durable
default, in ``--dir``; or ``memory://``) starts N workflows that each sleep on
a 30-day durable timer, 200 starts in flight, and waits until all N are parked.
One ``runs`` line per N:

- ``rss_kib_per_run``: growth of the resident set (``/proc/self/statm``) from
  the engine open and warmed up to N parked, divided by N;
- ``gc_objects_per_run``: growth of ``len(gc.get_objects())`` (the objects the
  cycle collector tracks) over N, and ``per_run_by_type`` the types that grew
  most (coroutines, parking lots, events, sets, lists, ``random.Random``);
- ``start_rate_per_s``: N over the time from the first start to the last
  start's return; ``parked_seconds``: until every timer is armed;
- ``gc_cpu_share``: the collector's CPU time (``gc.callbacks``) over the CPU
  time of the loop's thread while starting and parking, and ``full_collect_ms``: one
  ``gc.collect()`` with all N parked (the pause a full collection costs);
- ``close_seconds``: closing the engine with the N runs parked (resident, or
  evicted beyond ``--max-resident``: ``resident`` and ``evicted`` say how many
  were which when the close began), and ``close_cpu_seconds`` the loop thread's
  CPU time for it (steadier than the wall clock on a shared machine).

``--max-resident`` sets ``EngineConfig.max_resident_runs`` (default: the
config's default; ``none``: no cap and no idle eviction, every run stays resident).

The runs sizes that would not fit in ``--seconds`` (estimated from the last
start rate) are reported as ``skipped`` lines.  A tiny budget (``--seconds
0.2``) measures one small size (500 runs) and finishes in seconds.  The script
runs unchanged on an older checkout (use that checkout's interpreter).
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import emitter, run_in_scratch

emit = emitter("residency")

SLEEP = timedelta(days=30)
IN_FLIGHT = 200
WARMUP = 100
SMALL = 500
#: The object types reported per run (the rest are summed in ``gc_objects_per_run``).
WATCHED = (
    "coroutine",
    "ParkingLot",
    "Event",
    "set",
    "list",
    "dict",
    "Random",
    "Task",
    "CancelScope",
    "Lock",
)


def rss_kib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1024


def type_counts() -> collections.Counter[str]:
    return collections.Counter(type(o).__name__ for o in gc.get_objects())


class GcTimer:
    """The cycle collector's CPU time on the loop's thread, from ``gc.callbacks``."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.collections = 0
        self._began = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._began = time.thread_time()
        else:
            self.seconds += time.thread_time() - self._began
            self.collections += 1


def child(args: argparse.Namespace) -> int:
    import trio
    import trio.testing

    import aion_trio as aion

    n = args.child
    parked = 0

    @aion.workflow(name="sleeper")
    async def sleeper(ctx: aion.WorkflowContext) -> int:
        nonlocal parked
        parked += 1
        await ctx.sleep(SLEEP)
        return 0

    url = f"sqlite:///{args.dir}/residency.db" if args.store == "sqlite" else "memory://"
    options: dict[str, Any] = {"loop_stall_warning": None}
    if args.max_resident == "none":
        # Every run stays resident: no cap, no idle eviction.
        options.update(max_resident_runs=None, evict_after=None)
    elif args.max_resident != "default":
        options["max_resident_runs"] = int(args.max_resident)
    config = aion.EngineConfig(**options)
    far = datetime.now(timezone.utc) + SLEEP + timedelta(days=1)

    async def all_armed(engine: Any, total: int) -> None:
        # Every run has recorded its timer and armed it (the store's timer index holds it).
        while len(await engine.store.events.expired_timers(far)) < total:  # noqa: ASYNC110 - polls the store
            await trio.sleep(0.2)
        await trio.testing.wait_all_tasks_blocked(cushion=0.05)

    async def start_many(engine: Any, first: int, count: int) -> None:
        ids = iter(range(first, first + count))

        async def starter() -> None:
            for i in ids:
                await engine.start(sleeper, workflow_id=f"sleeper-{i}")

        async with trio.open_nursery() as nursery:
            for _ in range(min(IN_FLIGHT, count)):
                nursery.start_soon(starter)

    async def main() -> dict[str, Any]:
        record: dict[str, Any] = {
            "kind": "runs",
            "store": args.store,
            "runs": n,
            "max_resident_runs": config.max_resident_runs,
        }
        began_close = 0.0
        async with aion.open_engine(url, workflows=[sleeper], config=config) as engine:
            await start_many(engine, 0, WARMUP)
            await all_armed(engine, WARMUP)
            gc.collect()
            rss0, objects0, types0 = rss_kib(), len(gc.get_objects()), type_counts()
            timer = GcTimer()
            gc.callbacks.append(timer)
            cpu0, t0 = time.thread_time(), time.perf_counter()
            await start_many(engine, WARMUP, n)
            t1 = time.perf_counter()
            await all_armed(engine, WARMUP + n)
            t2, cpu1 = time.perf_counter(), time.thread_time()
            gc.callbacks.remove(timer)
            collect0 = time.perf_counter()
            gc.collect()
            full_collect = time.perf_counter() - collect0
            rss1, objects1, types1 = rss_kib(), len(gc.get_objects()), type_counts()
            grown = {name: (types1[name] - types0[name]) / n for name in WATCHED}
            top = sorted(((types1[k] - types0[k]) / n, k) for k in types1)[-8:]
            record.update(
                rss_kib_per_run=round((rss1 - rss0) / n, 2),
                rss_mib_total=round(rss1 / 1024, 1),
                gc_objects_per_run=round((objects1 - objects0) / n, 1),
                per_run_by_type={k: round(v, 2) for k, v in grown.items()},
                most_grown_types={k: round(v, 2) for v, k in reversed(top)},
                start_rate_per_s=round(n / (t1 - t0), 1),
                parked_seconds=round(t2 - t0, 2),
                gc_cpu_share=round(timer.seconds / max(cpu1 - cpu0, 1e-9), 4),
                gc_collections=timer.collections,
                full_collect_ms=round(full_collect * 1000, 1),
                parked=parked,
                resident=getattr(engine.statistics(), "resident_runs", None),
                evicted=getattr(engine.statistics(), "evicted_runs", None),
            )
            began_close, began_close_cpu = time.perf_counter(), time.thread_time()
        record["close_seconds"] = round(time.perf_counter() - began_close, 2)
        record["close_cpu_seconds"] = round(time.thread_time() - began_close_cpu, 2)
        return record

    print(json.dumps(trio.run(main)), flush=True)
    return 0


def run_size(args: argparse.Namespace, directory: str, n: int) -> dict[str, Any]:
    sub = os.path.join(directory, f"n{n}")
    os.makedirs(sub, exist_ok=True)
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        str(n),
        "--dir",
        sub,
        "--store",
        args.store,
        "--max-resident",
        args.max_resident,
    ]
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def parent(args: argparse.Namespace) -> int:
    sizes = [int(s) for s in args.runs.split(",") if s.strip()]
    began = time.perf_counter()

    def body(directory: str) -> None:
        import aion_trio

        emit({"kind": "environment", "python": sys.version.split()[0], "aion_trio": aion_trio.__file__})
        rate: float | None = None
        for i, n in enumerate(sizes):
            if i == 0 and args.seconds < 10:
                n = min(n, SMALL)
            elif rate is not None:
                # Starting, parking and closing take about 2.5 times the start phase.
                estimate = n / rate * 2.5 + 2
                if time.perf_counter() - began + estimate > args.seconds:
                    emit({"kind": "skipped", "runs": n, "estimated_seconds": round(estimate, 1)})
                    continue
            record = run_size(args, directory, n)
            rate = float(record["start_rate_per_s"])
            emit(record)

    run_in_scratch("aion-residency-", args.dir, body, emit)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="parent of the scratch directory")
    parser.add_argument(
        "--seconds", type=float, default=600.0, help="time budget (sizes beyond it are skipped)"
    )
    parser.add_argument("--runs", default="10000,100000", help="comma-separated numbers of sleeping runs")
    parser.add_argument("--store", choices=("sqlite", "memory"), default="sqlite")
    parser.add_argument(
        "--max-resident",
        default="default",
        help="EngineConfig.max_resident_runs: an int, 'none' (no cap) or 'default'",
    )
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        return child(args)
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
