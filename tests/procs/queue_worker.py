"""A child process for the workflow-queue crash test: an engine admitting runs from one queue.

Usage: python -m tests.procs.queue_worker STORE_PATH

Enqueues the runs ``q-0`` ... ``q-{RUNS-1}`` into the queue ``pair`` (two at a time)
that are neither started nor queued yet (a kill may come mid-way through), prints
``READY`` and admits and runs them until killed.  Each run takes ``STEPS`` activity steps.
"""

from __future__ import annotations

import sys

import trio

import aion_trio as aion

RUNS = 8
STEPS = 3


@aion.activity
async def pause(i: int) -> int:
    await trio.sleep(0.1)
    return i


@aion.workflow
async def job(ctx: aion.WorkflowContext, n: int) -> int:
    for i in range(STEPS):
        await ctx.run(pause, i)
    return n


async def main(store: str) -> None:
    config = aion.EngineConfig(
        workflow_queues={"pair": aion.FlowLimit(concurrency=2)},
        queue_poll_interval=0.05,
        loop_stall_warning=None,
    )
    async with aion.open_engine(
        f"sqlite:///{store}", workflows=[job], activities=[pause], config=config
    ) as engine:
        for n in range(RUNS):
            try:
                await engine.describe(f"q-{n}")
                continue  # started already
            except aion.WorkflowNotFound:
                pass
            try:
                await engine.enqueue(job, n, queue="pair", workflow_id=f"q-{n}")
            except aion.QueueDeduplicated:
                pass  # queued already
        print("READY", flush=True)
        await trio.sleep_forever()


if __name__ == "__main__":
    trio.run(main, sys.argv[1])
