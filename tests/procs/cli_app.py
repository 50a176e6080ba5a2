"""Workflows and activities the ``aion-trio`` CLI tests load as ``tests.procs.cli_app:app``
(an object with ``.workflows``/``.activities``) or ``tests.procs.cli_app`` (module-level lists).

``gated`` runs the ``gate`` activity, which creates ``PATH.started`` and then waits
until the file ``PATH`` exists: a test decides when an in-flight attempt may finish.
"""

from __future__ import annotations

import os
import types
from datetime import timedelta

import trio

import aion_trio as aion


@aion.activity
async def greet(name: str) -> str:
    return f"hello {name}"


@aion.activity(retry=aion.RetryPolicy(max_attempts=1))
async def explode(message: str) -> str:
    raise aion.TerminalError(message)


@aion.activity
async def gate(path: str) -> str:
    async with await trio.open_file(path + ".started", "a", encoding="utf-8") as marker:
        await marker.write(f"{os.getpid()}\n")
    # Polls for a file another process creates: no event to wait on across processes.
    while not await trio.Path(path).exists():  # noqa: ASYNC110
        await trio.sleep(0.01)
    return "released"


@aion.workflow
async def hello(ctx: aion.WorkflowContext, name: str) -> str:
    return await ctx.run(greet, name)


@aion.workflow
async def fails(ctx: aion.WorkflowContext, message: str) -> str:
    return await ctx.run(explode, message)


@aion.workflow
async def approval(ctx: aion.WorkflowContext, order: int) -> dict[str, object]:
    ctx.set_query_handler("pending", lambda: {"order": order, "waiting": True})
    notes: list[str] = []

    def note(text: str) -> int:
        notes.append(text)
        return len(notes)

    def not_empty(text: str) -> None:
        if not text:
            raise ValueError("a note needs text")

    ctx.set_update_handler("note", note, validator=not_empty)
    decision = await ctx.wait_signal("approve")
    return {"order": order, "decision": decision}


@aion.workflow
async def napper(ctx: aion.WorkflowContext) -> str:
    await ctx.sleep(timedelta(hours=1))
    return "rested"


@aion.workflow
async def gated(ctx: aion.WorkflowContext, path: str) -> str:
    return await ctx.run(gate, path)


workflows = [hello, fails, approval, napper, gated]
activities = [greet, explode, gate]
app = types.SimpleNamespace(workflows=workflows, activities=activities)
