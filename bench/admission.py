"""Admission control: many starts at once, and the event loop's lag meanwhile (issue 17).

Usage::

    python bench/admission.py [--dir DIR] [--seconds S] [--starts 20000] [--store sqlite|memory]

``--starts`` tasks call ``engine.start`` at the same moment (a short workflow:
one activity), then wait for its result.  A ticker task sleeps 5 ms at a time
and records how late each wake-up is: the event loop's lag, which every
timer, heartbeat and lease renewal of the engine suffers too.  One ``lag``
line per mode:

- ``unlimited``: no admission limits (the engine before ``EngineConfig``'s
  ``max_inflight_starts`` / ``max_inflight_activities``, or both set to ``None``);
- ``limited``: ``max_inflight_starts`` and ``max_inflight_activities`` set
  (``--limit``); on a checkout without them the line says ``unsupported``.

Figures: lag p50/p99/max in ms, the time until every start returned and until
every workflow finished, starts/s, and the cycle collector's longest pause and
total time during the burst (``gc.callbacks``), the collections and longest
pause by generation, also in the collecting thread's CPU time (``thread_time``:
what the pause costs on an idle machine; wall pauses grow with the load): a full collection stops the loop
too, for longer the more objects the process holds.  Goal: p99 < 50 ms for 20,000 starts with
limits.  A tiny budget (``--seconds 0.2``) runs 500 starts.  The script runs
unchanged on an older checkout (use that checkout's interpreter).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import emitter, percentile, run_in_scratch

emit = emitter("admission")

TICK = 0.005


def measure(args: argparse.Namespace, directory: str, mode: str) -> dict[str, Any]:
    import attrs
    import trio

    import aion_trio as aion

    fields = {f.name for f in attrs.fields(aion.EngineConfig)}
    record: dict[str, Any] = {"kind": "lag", "mode": mode, "store": args.store}
    settings: dict[str, Any] = {"loop_stall_warning": None}
    if "max_inflight_starts" in fields:
        limit = args.limit if mode == "limited" else None
        settings.update(max_inflight_starts=limit, max_inflight_activities=limit)
        record["limit"] = limit
    elif mode == "limited":
        return {**record, "unsupported": "this checkout's EngineConfig has no admission limits"}

    @aion.activity(name="touch")
    async def touch(x: int) -> int:
        return x + 1

    @aion.workflow(name="short")
    async def short(ctx: aion.WorkflowContext, x: int) -> int:
        return int(await ctx.run(touch, x))

    starts = args.starts if args.seconds >= 10 else min(args.starts, 500)
    url = f"sqlite:///{directory}/admission-{mode}.db" if args.store == "sqlite" else "memory://"
    for key, value in json.loads(args.config).items():
        if key not in fields:
            return {**record, "unsupported": f"this checkout's EngineConfig has no {key}"}
        settings[key] = tuple(value) if isinstance(value, list) else value
    if args.config != "{}":
        record["config"] = json.loads(args.config)
    config = aion.EngineConfig(**settings)
    lags: list[float] = []
    pauses: list[float] = []  # the cycle collector's pauses during the burst
    gc_began = [0.0, 0.0]
    by_generation: list[list[float]] = [[], [], []]
    cpu_by_generation: list[list[float]] = [[], [], []]  # the collecting thread's CPU time

    def gc_timer(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            gc_began[:] = time.perf_counter(), time.thread_time()
        else:
            pauses.append(time.perf_counter() - gc_began[0])
            by_generation[info["generation"]].append(pauses[-1])
            cpu_by_generation[info["generation"]].append(time.thread_time() - gc_began[1])

    async def ticker(stop: trio.Event) -> None:
        while not stop.is_set():
            due = time.perf_counter() + TICK
            await trio.sleep(TICK)
            lags.append(max(0.0, time.perf_counter() - due))

    async def main() -> None:
        started_all: list[float] = []

        async with aion.open_engine(url, workflows=[short], activities=[touch], config=config) as engine:
            # Warm up the paths (imports, the first commits) before the burst.
            for i in range(20):
                await (await engine.start(short, i, workflow_id=f"warm-{i}")).result()
            stop = trio.Event()
            returned = 0
            async with trio.open_nursery() as outer:
                outer.start_soon(ticker, stop)
                await trio.sleep(TICK * 4)
                began = time.perf_counter()
                gc.callbacks.append(gc_timer)

                async def one(i: int) -> None:
                    nonlocal returned
                    handle = await engine.start(short, i, workflow_id=f"burst-{i}")
                    returned += 1
                    if returned == starts:
                        started_all.append(time.perf_counter())
                    if await handle.result() != i + 1:
                        raise RuntimeError(f"burst-{i} returned a wrong result")

                async with trio.open_nursery() as nursery:
                    for i in range(starts):
                        nursery.start_soon(one, i)
                finished = time.perf_counter()
                gc.callbacks.remove(gc_timer)
                stop.set()
        lags.sort()
        record.update(
            starts=starts,
            lag_p50_ms=round(percentile(lags, 0.50) * 1000, 1),
            lag_p99_ms=round(percentile(lags, 0.99) * 1000, 1),
            lag_max_ms=round(lags[-1] * 1000, 1),
            ticks=len(lags),
            all_started_s=round(started_all[0] - began, 2),
            all_finished_s=round(finished - began, 2),
            starts_per_s=round(starts / (started_all[0] - began), 1),
            gc_pause_max_ms=round(max(pauses, default=0.0) * 1000, 1),
            gc_seconds=round(sum(pauses), 2),
            gc_collections=[len(g) for g in by_generation],
            gc_pause_max_ms_by_generation=[round(max(g, default=0.0) * 1000, 1) for g in by_generation],
            gc_cpu_pause_max_ms_by_generation=[
                round(max(g, default=0.0) * 1000, 1) for g in cpu_by_generation
            ],
            gc_cpu_seconds=round(sum(map(sum, cpu_by_generation)), 2),
        )

    trio.run(main)
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="parent of the scratch directory")
    parser.add_argument("--seconds", type=float, default=600.0, help="a budget below 10 s runs 500 starts")
    parser.add_argument("--starts", type=int, default=20_000)
    parser.add_argument("--limit", type=int, default=64, help="the limits of the 'limited' mode")
    parser.add_argument("--store", choices=("sqlite", "memory"), default="sqlite")
    parser.add_argument("--modes", default="unlimited,limited", help="comma-separated modes to run")
    parser.add_argument(
        "--config", default="{}", help="JSON: more EngineConfig settings (e.g. the gc settings)"
    )
    args = parser.parse_args(argv)

    def body(directory: str) -> None:
        for mode in args.modes.split(","):
            emit(measure(args, directory, mode))

    run_in_scratch("aion-admission-", args.dir, body, emit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
