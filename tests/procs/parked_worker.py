"""Starts parked workflows on a SQLite file, says READY, then waits to be SIGKILLed
(tests/test_residency.py).  Usage: ``python -m tests.procs.parked_worker STORE N``."""

from __future__ import annotations

import sys

import trio

import aion_trio as aion
from procs.parked_app import WORKFLOWS, nagged, parked


async def main(store: str, count: int) -> None:
    async with aion.open_engine(f"sqlite:///{store}", workflows=WORKFLOWS) as engine:
        for index in range(count):
            # Half park on a signal alone, half on a timer and a signal.
            workflow = parked if index % 2 else nagged
            await engine.start(workflow, index, workflow_id=f"wf-{index}")
        # The timer-parked ones have recorded their timer (the rest record nothing more).
        for index in range(0, count, 2):
            while len(await engine.history(f"wf-{index}")) < 2:  # noqa: ASYNC110 - written by SQLite's thread
                await trio.sleep(0.01)
        print("READY", flush=True)
        await trio.sleep_forever()


if __name__ == "__main__":
    trio.run(main, sys.argv[1], int(sys.argv[2]))
