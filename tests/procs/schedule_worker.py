"""A child process for the schedule crash test: an engine firing one schedule on a SQLite file.

Usage: python -m tests.procs.schedule_worker STORE_PATH

Creates the schedule ``beat`` (every 0.2 s, every tick started, a catch-up
window of an hour) unless the store has it, prints ``READY`` and fires it
until killed.
"""

from __future__ import annotations

import sys
from datetime import timedelta

import trio

import aion_trio as aion

INTERVAL = timedelta(milliseconds=200)


@aion.workflow
async def beat(ctx: aion.WorkflowContext, label: str) -> str:
    return label


async def main(store: str) -> None:
    config = aion.EngineConfig(schedule_poll_interval=0.05, loop_stall_warning=None)
    async with aion.open_engine(f"sqlite:///{store}", workflows=[beat], config=config) as engine:
        try:
            await engine.schedules.describe("beat")
        except aion.ScheduleNotFound:
            await engine.schedules.create(
                "beat", beat, "x", interval=INTERVAL, overlap="allow_all", catchup_window=timedelta(hours=1)
            )
        print("READY", flush=True)
        await trio.sleep_forever()


if __name__ == "__main__":
    trio.run(main, sys.argv[1])
