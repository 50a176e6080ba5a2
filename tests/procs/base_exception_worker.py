"""A child process for the BaseException-containment restart test.

Usage: python -m tests.procs.base_exception_worker STORE_PATH GATE_PATH

Workflow ``raiser`` runs one thread activity.  In the first process (no gate
file yet) the activity creates the gate and blocks, so the test can SIGKILL
the process mid-attempt; in the restarted one it raises ``SystemExit``.  The
restart also runs workflow ``other``.  Prints ``RESULT ...`` per workflow and
exits once both are done.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import trio

import aion_trio as aion

GATE = Path()


@aion.activity
def hold_then_exit() -> str:
    if not GATE.exists():
        GATE.touch()
        while True:  # the first process is killed in here
            time.sleep(0.05)
    raise SystemExit(2)


@aion.activity
async def step() -> str:
    return "done"


@aion.workflow
async def raiser(ctx: aion.WorkflowContext) -> str:
    try:
        return await ctx.run(hold_then_exit)
    except aion.ActivityFailure as exc:
        return f"failed: {exc.type}"


@aion.workflow
async def other(ctx: aion.WorkflowContext) -> str:
    return str(await ctx.run(step))


async def main(store: str) -> None:
    reuse = aion.IdReusePolicy.USE_EXISTING
    async with aion.open_engine(
        f"sqlite:///{store}", workflows=[raiser, other], activities=[hold_then_exit, step]
    ) as engine:
        first = await engine.start(raiser, workflow_id="raiser", id_reuse=reuse)
        second = await engine.start(other, workflow_id="other", id_reuse=reuse)
        print("RESULT raiser", await first.result(), flush=True)
        print("RESULT other", await second.result(), flush=True)


if __name__ == "__main__":
    GATE = Path(sys.argv[2])
    trio.run(main, sys.argv[1])
