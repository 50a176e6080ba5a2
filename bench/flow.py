"""Flow control: what a limit costs per activity attempt, and dispatch throughput under one (issue 18).

Usage::

    python bench/flow.py [--dir DIR] [--seconds S] [--store memory|sqlite] [--attempts N]

Two kinds of JSON line:

- ``overhead``: one workflow runs ``--attempts`` activity steps one after the
  other (an async no-op activity), with no limit (``none``), under an
  activity-type limit that never fills (``concurrency``: the admission pool's
  bookkeeping alone) and under a rate limit that never refuses (``rate``: one
  permit asked of the store per attempt).  Figures: microseconds per attempt and
  the difference from ``none``.
- ``throughput``: one workflow starts ``--attempts`` attempts at once of an
  activity that sleeps 1 ms, under ``FlowLimit(concurrency=L)`` for L in 1, 10,
  100.  Figures: attempts/s and the peak running at once (never above L).

A tiny budget (``--seconds 0.2``, CI's bench smoke) runs 40 attempts per line.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import emitter, run_in_scratch

emit = emitter("flow")


def run(args: argparse.Namespace, directory: str) -> None:
    import trio

    import aion_trio as aion

    attempts = args.attempts if args.seconds >= 10 else min(args.attempts, 40)
    running = [0, 0]  # now, peak

    @aion.activity(name="noop")
    async def noop(i: int) -> int:
        return i

    @aion.activity(name="nap")
    async def nap(i: int) -> int:
        running[0] += 1
        running[1] = max(running[1], running[0])
        try:
            await trio.sleep(0.001)
        finally:
            running[0] -= 1
        return i

    @aion.workflow(name="steps")
    async def steps(ctx: aion.WorkflowContext, n: int) -> int:
        for i in range(n):
            await ctx.run(noop, i)
        return n

    @aion.workflow(name="fan")
    async def fan(ctx: aion.WorkflowContext, n: int) -> int:
        handles = [ctx.start(nap, i) for i in range(n)]
        return sum([await h for h in handles])

    counter = iter(range(10**6))

    def url() -> str:
        if args.store == "sqlite":
            return f"sqlite:///{directory}/flow-{next(counter)}.db"
        return "memory://"

    async def timed(workflow: Any, n: int, config: aion.EngineConfig) -> float:
        async with aion.open_engine(
            url(), workflows=[steps, fan], activities=[noop, nap], config=config
        ) as engine:
            await (await engine.start(workflow, 2)).result()  # warm up
            began = time.perf_counter()
            await (await engine.start(workflow, n)).result()
            return time.perf_counter() - began

    async def main() -> None:
        base = {"loop_stall_warning": None}
        modes = {
            "none": aion.EngineConfig(**base),
            "concurrency": aion.EngineConfig(
                activity_limits={"noop": aion.FlowLimit(concurrency=10**6)}, **base
            ),
            "rate": aion.EngineConfig(
                activity_limits={"noop": aion.FlowLimit(rate=10**9, period=1.0)}, **base
            ),
        }
        per: dict[str, float] = {}
        for mode, config in modes.items():
            seconds = await timed(steps, attempts, config)
            per[mode] = seconds / attempts * 1e6
            emit(
                {
                    "kind": "overhead",
                    "mode": mode,
                    "store": args.store,
                    "attempts": attempts,
                    "us_per_attempt": round(per[mode], 1),
                    "us_over_none": round(per[mode] - per["none"], 1),
                }
            )
        for limit in (1, 10, 100):
            running[:] = [0, 0]
            config = aion.EngineConfig(activity_limits={"nap": aion.FlowLimit(concurrency=limit)}, **base)
            seconds = await timed(fan, attempts, config)
            emit(
                {
                    "kind": "throughput",
                    "limit": limit,
                    "store": args.store,
                    "attempts": attempts,
                    "attempts_per_s": round(attempts / seconds, 1),
                    "peak_running": running[1],
                }
            )

    trio.run(main)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dir", default=None)
    parser.add_argument("--seconds", type=float, default=30.0, help="budget; below 10 runs the tiny sizes")
    parser.add_argument("--store", choices=("memory", "sqlite"), default="memory")
    parser.add_argument("--attempts", type=int, default=2000)
    args = parser.parse_args()
    run_in_scratch("aion-flow-", args.dir, lambda directory: run(args, directory), emit)


if __name__ == "__main__":
    main()
