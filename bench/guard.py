"""What the determinism guard costs per workflow step.

Usage::

    python bench/guard.py [--seconds S] [--steps N] [--concurrency C]

Runs workflows of ``--steps`` activity steps each (a trivial ``async def``
activity, so the step's own machinery is all that is measured) on
``memory://``, ``--concurrency`` at a time, on an engine with the
determinism guard (``EngineConfig(determinism_guard=True)``, the default) and
on one without, in alternating rounds until each had ``--seconds`` of work.
Prints one JSON line per setting (steps/s, wall and CPU microseconds per
step) and a ``ratio`` line: guarded steps/s over unguarded (1.0 = free) and
the guard's wall and CPU microseconds per step.  Both settings see the same
load, so the ratio moves far less than the rates on a shared machine; the
CPU time per step moves least.  ``--dir`` is accepted for uniformity with the other benches (the
memory store writes no file).  Not part of the test run.
"""

from __future__ import annotations

import argparse
import os
import time

import trio
from _common import emitter

import aion_trio as aion

emit = emitter("guard")


@aion.activity
async def noop(n: int) -> int:
    return n + 1


@aion.workflow
async def steps(ctx: aion.WorkflowContext, count: int) -> int:
    n = 0
    for _ in range(count):
        n = await ctx.run(noop, n)
    return n


async def _round(guard: bool, workflows: int, count: int, concurrency: int) -> tuple[float, float]:
    """Seconds (wall, then CPU) to run ``workflows`` workflows of ``count`` steps, ``concurrency`` at a time."""
    config = aion.EngineConfig(determinism_guard=guard, activity_schedule_window=None)
    async with aion.open_engine("memory://", workflows=[steps], activities=[noop], config=config) as engine:
        limiter = trio.CapacityLimiter(concurrency)
        began, cpu = time.perf_counter(), time.process_time()

        async def one(i: int) -> None:
            async with limiter:
                run = await engine.start(steps, count, workflow_id=f"w-{i}")
                assert await run.result() == count

        async with trio.open_nursery() as nursery:
            for i in range(workflows):
                nursery.start_soon(one, i)
        return time.perf_counter() - began, time.process_time() - cpu


async def main(args: argparse.Namespace) -> None:
    emit({"kind": "environment", "loadavg_1m": round(os.getloadavg()[0], 2), "steps": args.steps})
    spent = {True: 0.0, False: 0.0}
    cpu = {True: 0.0, False: 0.0}
    done = {True: 0, False: 0}
    per_round = max(1, args.concurrency)
    await _round(True, 2, args.steps, 2)  # warm-up: imports, the guard's installation
    while min(spent.values()) < args.seconds:
        for guard in (True, False):
            wall, used = await _round(guard, per_round, args.steps, args.concurrency)
            spent[guard] += wall
            cpu[guard] += used
            done[guard] += per_round * args.steps
    rates = {}
    for guard in (True, False):
        rates[guard] = done[guard] / spent[guard]
        emit(
            {
                "kind": "steps",
                "guard": guard,
                "steps": done[guard],
                "steps_per_s": round(rates[guard]),
                "us_per_step": round(1e6 / rates[guard], 1),
                "cpu_us_per_step": round(1e6 * cpu[guard] / done[guard], 1),
            }
        )
    emit(
        {
            "kind": "ratio",
            "guarded_over_unguarded": round(rates[True] / rates[False], 3),
            "guard_us_per_step": round(1e6 / rates[True] - 1e6 / rates[False], 2),
            "guard_cpu_us_per_step": round(1e6 * (cpu[True] / done[True] - cpu[False] / done[False]), 2),
            "loadavg_1m": round(os.getloadavg()[0], 2),
        }
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="work per setting, at least")
    parser.add_argument("--steps", type=int, default=10, help="activity steps per workflow")
    parser.add_argument("--concurrency", type=int, default=50, help="workflows per round, all in flight")
    parser.add_argument("--dir", default=None, help="unused (the memory store writes no file)")
    trio.run(main, parser.parse_args())
