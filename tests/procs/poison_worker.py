"""A child process for the poison-run test.

Usage: python -m tests.procs.poison_worker STORE_PATH

Two workflows on one SQLite file: ``poison`` runs an activity that kills the
process (``os._exit(1)``), every time; ``patient`` waits for a signal.  Each
run of this process starts both (an existing run is kept) and waits until
the poison run is marked stuck; then it signals ``patient``, waits for its
result and prints ``STUCK <reason>`` and ``PATIENT <result>``.  Until the
poison run is stuck the process dies in its activity (exit status 1).
"""

from __future__ import annotations

import os
import sys

import trio

import aion_trio as aion


@aion.activity
async def kills_the_process() -> str:
    await trio.sleep(0.05)  # long enough for its schedule to be recorded (the schedule window)
    os._exit(1)


@aion.workflow
async def poison(ctx: aion.WorkflowContext) -> str:
    return str(await ctx.run(kills_the_process))


@aion.workflow
async def patient(ctx: aion.WorkflowContext) -> str:
    return f"patient got {await ctx.wait_signal('go')}"


async def main(store: str) -> None:
    reuse = aion.IdReusePolicy.USE_EXISTING
    async with aion.open_engine(
        f"sqlite:///{store}", workflows=[poison, patient], activities=[kills_the_process]
    ) as engine:
        await engine.start(patient, workflow_id="patient", id_reuse=reuse)
        await engine.start(poison, workflow_id="poison", id_reuse=reuse)
        reason = (await engine.describe("poison")).stuck_reason
        if reason is None:
            with trio.fail_after(30):
                await trio.sleep_forever()  # its activity ends the process meanwhile
        print("STUCK", reason, flush=True)
        await engine.signal("patient", "go", "now")
        print("PATIENT", await engine.result("patient"), flush=True)


if __name__ == "__main__":
    trio.run(main, sys.argv[1])
