"""Durable schedules under the engine clock: a year of a daily schedule, in wall-clock time.

Usage::

    python bench/schedules.py [--dir DIR] [--seconds S] [--days N]

Under ``trio.testing.MockClock`` durable time jumps to each tick, so what a
year of a daily schedule costs is the engine's own work per tick (the pass:
read the schedule, check the runs it started, start the tick's run through
the one start path, run it, write the schedule back).  For ``memory://`` and
SQLite (``synchronous=FULL``) it prints one JSON line per round: ticks, wall
seconds, ticks/s and milliseconds per tick; rounds repeat until ``--seconds``
have passed (at least one).  SQLite's rounds are fsync-bound (one durable
write per start and per state write); with a budget under 5 seconds (tox's
smoke run) they cover 30 days instead of ``--days``.  Not part of the test run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import datetime, timedelta, timezone

import trio
import trio.testing

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import emitter, run_in_scratch

import aion_trio as aion

START = datetime(2027, 1, 1, tzinfo=timezone.utc)
emit = emitter("schedules")


class FromStart:
    """An EngineClock whose durable time starts at START and moves with Trio's clock."""

    def now(self) -> datetime:
        return START + timedelta(seconds=trio.current_time())

    def trio_deadline(self, when: datetime) -> float:
        return (when - START).total_seconds()


@aion.workflow
async def daily(ctx: aion.WorkflowContext, n: int) -> int:
    return n


async def a_year(store: str, days: int) -> int:
    config = aion.EngineConfig(clock=FromStart(), schedule_poll_interval=None, loop_stall_warning=None)
    async with aion.open_engine(store, workflows=[daily], config=config) as engine:
        await engine.schedules.create("daily", daily, 1, cron="0 6 * * *")
        await trio.sleep(days * 86400)
        return (await engine.schedules.describe("daily")).schedule.state.started_count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--days", type=int, default=365)
    args = parser.parse_args()

    def body(directory: str) -> None:
        deadline = time.monotonic() + args.seconds
        for kind in ("memory", "sqlite"):
            days = args.days if kind == "memory" or args.seconds >= 5 else min(args.days, 30)
            round_ = 0
            while round_ == 0 or time.monotonic() < deadline:
                round_ += 1
                store = "memory://" if kind == "memory" else f"sqlite:///{directory}/year-{round_}.db"
                began = time.perf_counter()
                ticks = trio.run(a_year, store, days, clock=trio.testing.MockClock(autojump_threshold=0))
                wall = time.perf_counter() - began
                assert ticks == days, (ticks, days)
                emit(
                    {
                        "store": kind,
                        "round": round_,
                        "ticks": ticks,
                        "wall_seconds": round(wall, 3),
                        "ticks_per_s": round(ticks / wall, 1),
                        "ms_per_tick": round(wall / ticks * 1000, 3),
                    }
                )

    run_in_scratch("aion-bench-schedules-", args.dir, body, emit)


if __name__ == "__main__":
    main()
