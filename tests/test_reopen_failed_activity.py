"""Reopening a run that failed on an activity's final failure runs the activity again.

"Fix the cause and reopen" (docs/operating.md): the reopen records which
activities it re-dispatches (``WorkflowReopened.reopened_activity_ids``), so the
old final failure is superseded and the fixed activity is called with the next
attempt number and a fresh retry budget.  A failure the code caught and went
on from is not re-run.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import trio
from _replay import assert_replays_cleanly

import aion_trio as aion
from aion_trio import events as ev

LIMIT = 20
CALLS: list[tuple[str, int]] = []
FAILURES_LEFT = {"charge": 0, "notify": 0}
BUG = {"on": True}


@pytest.fixture(autouse=True)
def _reset() -> None:
    CALLS.clear()
    FAILURES_LEFT.update(charge=0, notify=0)
    BUG["on"] = True


def _fail_if_due(name: str) -> None:
    CALLS.append((name, aion.activity_info().attempt))
    if FAILURES_LEFT[name] > 0:
        FAILURES_LEFT[name] -= 1
        raise ConnectionError(f"{name} is down")


@aion.activity(retry=aion.RetryPolicy(max_attempts=2, backoff=aion.Fixed(0.001)))
async def charge(order: str) -> str:
    _fail_if_due("charge")
    return f"charged {order}"


@aion.activity
async def notify(order: str) -> str:
    _fail_if_due("notify")
    return f"notified {order}"


@aion.workflow
async def checkout(ctx: aion.WorkflowContext, order: str) -> str:
    return str(await ctx.run(charge, order))


@aion.workflow
async def tolerant(ctx: aion.WorkflowContext, order: str) -> str:
    try:
        await ctx.run(notify, order)
    except aion.ActivityFailure:
        pass  # a failure the code goes on from
    charged = str(await ctx.run(charge, order))
    if BUG["on"]:
        raise KeyError("a bug after the activities")
    return charged


def _types(history: list[aion.Event]) -> list[str]:
    return [type(e.body).__name__ for e in history]


async def test_reopen_runs_the_activity_whose_final_failure_failed_the_run_with_a_fresh_budget(
    store_url: Callable[[], str],
) -> None:
    url = store_url()
    FAILURES_LEFT["charge"] = 3  # both attempts fail; after the reopen one more, then it works
    with trio.fail_after(LIMIT):
        async with aion.open_engine(url, workflows=[checkout], activities=[charge]) as engine:
            run = await engine.start(checkout, "o-1", workflow_id="o-1")
            with pytest.raises(aion.WorkflowFailure, match="ConnectionError"):
                await run.result()
        assert CALLS == [("charge", 1), ("charge", 2)], "control: the budget of two was spent"
        async with aion.open_engine(url, workflows=[checkout], activities=[charge]) as engine:
            handle = await engine.reopen("o-1")
            assert await handle.result() == "charged o-1"
            history = await engine.history("o-1")
    # The next attempt numbers, and a fresh budget of two (attempt 3 failed, 4 passed).
    assert CALLS == [("charge", 1), ("charge", 2), ("charge", 3), ("charge", 4)]
    reopened = next(e.body for e in history if isinstance(e.body, ev.WorkflowReopened))
    assert reopened.reopened_activity_ids == (0,)
    tail = _types(history)[_types(history).index("WorkflowReopened") :]
    assert tail == [
        "WorkflowReopened",
        "ActivityStarted",
        "ActivityFailed",
        "ActivityStarted",
        "ActivityCompleted",
        "WorkflowCompleted",
    ]
    attempts = [e.body.attempt for e in history if isinstance(e.body, ev.ActivityStarted)]
    assert attempts == [1, 2, 3, 4]
    with trio.fail_after(LIMIT):
        await assert_replays_cleanly(history, workflows=[checkout], activities=[charge])


async def test_a_failure_the_code_went_on_from_is_not_run_again_by_a_reopen(
    store_url: Callable[[], str],
) -> None:
    url = store_url()
    FAILURES_LEFT["notify"] = 1
    with trio.fail_after(LIMIT):
        async with aion.open_engine(url, workflows=[tolerant], activities=[charge, notify]) as engine:
            run = await engine.start(tolerant, "o-2", workflow_id="o-2")
            with pytest.raises(aion.WorkflowFailure, match="KeyError"):
                await run.result()
        BUG["on"] = False
        async with aion.open_engine(url, workflows=[tolerant], activities=[charge, notify]) as engine:
            handle = await engine.reopen("o-2")
            assert await handle.result() == "charged o-2"
            history = await engine.history("o-2")
    assert CALLS == [("notify", 1), ("charge", 1)], "nothing ran again: the recorded steps replayed"
    reopened = next(e.body for e in history if isinstance(e.body, ev.WorkflowReopened))
    assert reopened.reopened_activity_ids == ()
