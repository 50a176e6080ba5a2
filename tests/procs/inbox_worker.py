"""A worker process for the inbox crash test (tests/test_request_ids.py).

Usage: python -m tests.procs.inbox_worker STORE_PATH LEDGER_PATH [die-before-ack]

Opens an engine on the SQLite store, which applies the store's queued
commands at open, and exits once the inbox is empty and nothing is running.
The one activity, ``charge``, appends a line to the ledger file per call: a
workflow run twice charges twice.

With ``die-before-ack`` the store's ``ack_command`` is replaced by a fault
hook: once the run the command started has completed (it charged), the
process SIGKILLs itself, so the command is applied but never acked.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import trio

import aion_trio as aion
from aion_trio import projections

LEDGER = Path()


@aion.activity
def charge(order: str) -> str:
    with LEDGER.open("a", encoding="utf-8") as ledger:
        ledger.write(f"{order}\n")
        ledger.flush()
        os.fsync(ledger.fileno())
    return f"charged {order}"


@aion.workflow
async def checkout(ctx: aion.WorkflowContext, order: str) -> str:
    return str(await ctx.run(charge, order))


async def _die_before_ack(store: aion.Store, command_id: int, outcome: aion.CommandOutcome) -> None:
    assert isinstance(store, aion.CommandInbox)
    pending = {p.command_id: p.command for p in await store.pending_commands()}
    workflow_id = pending[command_id].workflow_id
    with trio.fail_after(30):
        history = await store.events.read_history(workflow_id)
        while projections.workflow_status(history) is not aion.WorkflowStatus.COMPLETED:
            await trio.sleep(0.01)
            history = await store.events.read_history(workflow_id)
    print(f"APPLIED {outcome.message}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


async def main(path: str, die: bool) -> None:
    async with aion.open_store(f"sqlite:///{path}") as store:
        if die:

            async def ack_command(self: aion.Store, command_id: int, outcome: aion.CommandOutcome) -> None:
                await _die_before_ack(self, command_id, outcome)

            # The fault hook: this process's store class (this process dies with it).
            type(store).ack_command = ack_command  # type: ignore[attr-defined]
        async with aion.open_engine(store, workflows=[checkout], activities=[charge]) as engine:
            assert isinstance(store, aion.CommandInbox)
            with trio.fail_after(30):
                while await store.pending_commands() or await store.events.list_active():
                    await engine.drain_inbox()
                    await trio.sleep(0.01)
    print("DONE", flush=True)


if __name__ == "__main__":
    LEDGER = Path(sys.argv[2])
    trio.run(main, sys.argv[1], sys.argv[3:] == ["die-before-ack"])
