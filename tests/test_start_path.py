"""The one start path (issue 16).

Every run's start (a client start, a child, a continue-as-new successor) is
recorded by one primitive, ``Runner.start_run_locked``.
"""

from __future__ import annotations

from typing import Any

import pytest

import aion_trio as aion
from aion_trio._engine.runner import Runner


@aion.workflow
async def little(ctx: aion.WorkflowContext, n: int) -> int:
    return n


@aion.workflow
async def parent_then_continue(ctx: aion.WorkflowContext, left: int) -> int:
    value = await ctx.child(little, left, timeout=60)
    if left:
        raise ctx.continue_as_new(left - 1)
    return value


async def test_every_start_goes_through_the_one_start_primitive(
    store_url: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    actions: list[tuple[str, bool]] = []
    original = Runner.start_run_locked

    async def spy(self: Runner, recorder: Any, started: Any, **kwargs: Any) -> Any:
        actions.append((kwargs["action"], started.timeout is not None))
        return await original(self, recorder, started, **kwargs)

    monkeypatch.setattr(Runner, "start_run_locked", spy)
    async with aion.open_engine(store_url(), workflows=[little, parent_then_continue]) as engine:
        run = await engine.start(parent_then_continue, 1, workflow_id="chain", timeout=3600)
        assert await run.result() == 0
        history = await engine.history("chain")
    assert actions == [
        ("start a workflow", True),
        ("start a child workflow", True),
        ("start the continue-as-new successor", True),
        ("start a child workflow", True),
    ]
    # The client start recorded its deadline with the start; the successor carries the
    # chain's timeout but no deadline timer of its own (as before the one start path).
    names = [type(e.body).__name__ for e in history]
    assert names[:2] == ["WorkflowStarted", "TimerStarted"]
    successor = [i for i, e in enumerate(history) if type(e.body).__name__ == "WorkflowStarted"][1]
    assert names[successor + 1] != "TimerStarted"
