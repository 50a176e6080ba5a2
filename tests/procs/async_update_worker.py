"""A process for the async update handler crash test (tests/test_async_handlers.py).

Usage: python -m tests.procs.async_update_worker STORE_PATH [die-after-first-step]

Opens an engine on the SQLite store, starts workflow ``transfer-1`` unless it
runs already, then calls ``engine.update("transfer-1", "move", 5,
update_id="move-5")`` and prints ``RETURNED <result>``.  The update's handler
is async: it runs a ``debit`` step, then a ``credit`` step.  With
``die-after-first-step`` the store's ``append`` is wrapped: once the batch
holding the debit step's ``ActivityCompleted`` is committed, the process
SIGKILLs itself -- the update is accepted, its handler is half-way and the
caller never heard.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence

import trio
import trio.lowlevel

import aion_trio as aion


@aion.activity
async def counted(kind: str, amount: int) -> str:
    await trio.lowlevel.checkpoint()
    return f"{kind}ed {amount}"


@aion.workflow
async def transfer(ctx: aion.WorkflowContext) -> list[str]:
    moved: list[str] = []
    closed = False

    @ctx.update_handler("move")
    async def move(amount: int) -> str:
        debit = await ctx.run(counted, "debit", amount)
        credit = await ctx.run(counted, "credit", amount)
        moved.append(f"{debit}, {credit}")
        return moved[-1]

    @ctx.signal_handler("close")
    def close(_: object) -> None:
        nonlocal closed
        closed = True

    await ctx.wait_condition(lambda: closed)
    await ctx.wait_condition(ctx.all_handlers_finished)
    return moved


async def main(path: str, die: bool) -> None:
    async with aion.open_store(f"sqlite:///{path}") as store:
        if die:
            real_append = store.events.append

            async def append(workflow_id: str, events: Sequence[aion.Event], expected_seq: int) -> None:
                await real_append(workflow_id, events, expected_seq)
                if any(isinstance(e.body, aion.ActivityCompleted) for e in events):
                    print("COMMITTED debit", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)

            store.events.append = append  # type: ignore[method-assign]
        async with aion.open_engine(store, workflows=[transfer], activities=[counted]) as engine:
            await engine.start(transfer, workflow_id="transfer-1", id_reuse=aion.IdReusePolicy.USE_EXISTING)
            with trio.fail_after(60):
                result = await engine.update("transfer-1", "move", 5, update_id="move-5")
            print(f"RETURNED {result}", flush=True)


if __name__ == "__main__":
    trio.run(main, sys.argv[1], sys.argv[2:] == ["die-after-first-step"])
