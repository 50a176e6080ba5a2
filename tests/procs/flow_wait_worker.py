"""A child process for the slot-wait crash test: an engine whose second attempt waits for a slot.

Usage: python -m tests.procs.flow_wait_worker STORE_PATH CONCURRENCY

Starts the workflow ``fw`` (unless it is there already): two attempts of ``hold``,
which never returns, under ``activity_limits={"hold": FlowLimit(concurrency=...)}``.
With a concurrency of 1 the second attempt waits for a slot (its wait recorded in the
store).  Prints ``READY`` and runs until killed.
"""

from __future__ import annotations

import sys

import trio

import aion_trio as aion

WORKFLOW_ID = "fw"


@aion.activity
async def hold(tag: str) -> str:
    await trio.sleep_forever()
    return tag  # pragma: no cover


@aion.workflow
async def two_holds(ctx: aion.WorkflowContext) -> list[str]:
    first = ctx.start(hold, "first")
    second = ctx.start(hold, "second")
    return [await first, await second]


def config(concurrency: int) -> aion.EngineConfig:
    return aion.EngineConfig(
        activity_limits={"hold": aion.FlowLimit(concurrency=concurrency)}, loop_stall_warning=None
    )


async def main(store: str, concurrency: int) -> None:
    async with aion.open_engine(
        f"sqlite:///{store}", workflows=[two_holds], activities=[hold], config=config(concurrency)
    ) as engine:
        try:
            await engine.describe(WORKFLOW_ID)
        except aion.WorkflowNotFound:
            await engine.start(two_holds, workflow_id=WORKFLOW_ID)
        print("READY", flush=True)
        await trio.sleep_forever()


if __name__ == "__main__":
    trio.run(main, sys.argv[1], int(sys.argv[2]))
