"""A process for the workflow-to-workflow message crash test (tests/test_external_messages.py).

Usage: python -m tests.procs.external_message_worker STORE_PATH (die-after-intent | die-after-delivery)

Opens an engine on the SQLite store, starts workflow ``inbox-1`` (``receiver``)
and ``s`` (``sender``, which signals ``inbox-1`` twice with
``ctx.signal_external``).  The store's ``append`` is wrapped: once the batch
holding the sender's first intent marker (``die-after-intent``), or the
receiver's first ``SignalReceived`` (``die-after-delivery``) is committed, the
process SIGKILLs itself -- the send is recorded (and maybe delivered) but its
outcome is not.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

import trio

import aion_trio as aion


@aion.workflow
async def receiver(ctx: aion.WorkflowContext) -> list[Any]:
    got: list[Any] = []
    ctx.set_signal_handler("note", got.append)
    await ctx.wait_condition(lambda: "done" in got)
    return got


@aion.workflow
async def sender(ctx: aion.WorkflowContext, target: str) -> str:
    await ctx.signal_external(target, "note", {"n": 1})
    await ctx.signal_external(target, "note", "done")
    return "sent"


def _fatal(workflow_id: str, events: Sequence[aion.Event], when: str) -> bool:
    if when == "die-after-intent":
        return any(isinstance(e.body, aion.MarkerRecorded) and e.body.name == "external:0" for e in events)
    return workflow_id == "inbox-1" and any(isinstance(e.body, aion.SignalReceived) for e in events)


async def main(path: str, when: str) -> None:
    async with aion.open_store(f"sqlite:///{path}") as store:
        real_append = store.events.append

        async def append(workflow_id: str, events: Sequence[aion.Event], expected_seq: int) -> None:
            await real_append(workflow_id, events, expected_seq)
            if _fatal(workflow_id, events, when):
                print(f"COMMITTED {workflow_id} {[e.type for e in events]}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

        store.events.append = append  # type: ignore[method-assign]
        async with aion.open_engine(store, workflows=[receiver, sender]) as engine:
            await engine.start(receiver, workflow_id="inbox-1")
            await engine.start(sender, "inbox-1", workflow_id="s")
            with trio.fail_after(60):
                await engine.result("s")
            print("RETURNED", flush=True)


if __name__ == "__main__":
    trio.run(main, sys.argv[1], sys.argv[2])
