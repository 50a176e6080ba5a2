"""Workflow handles behave like the peers' (Temporal's ``handle.cancel()``, ``asyncio.wait``):
``ctx.gather`` / ``ctx.wait_first`` take activity, child and timer handles alike, and
workflow code can cancel an activity or a child it holds — recorded, really
cancelled, and replayed the same way.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import trio
import trio.testing
from _replay import assert_replays_cleanly, replay

import aion_trio as aion
from aion_trio import events as ev

LIMIT = 20
STOPPED: list[str] = []
CALLS: list[str] = []
STOP_SEEN: dict[str, trio.Event] = {}


@pytest.fixture(autouse=True)
def _reset() -> None:
    STOPPED.clear()
    CALLS.clear()
    STOP_SEEN["event"] = trio.Event()


@aion.activity
async def quick(n: int) -> int:
    CALLS.append(f"quick {n}")
    return n * 2


@aion.activity
async def forever(tag: str) -> str:
    CALLS.append(f"forever {tag}")
    try:
        await trio.sleep_forever()
    except trio.Cancelled:
        STOPPED.append(tag)
        STOP_SEEN["event"].set()
        raise
    raise AssertionError("unreachable")


@aion.workflow
async def child_echo(ctx: aion.WorkflowContext, n: int) -> int:
    return n + 100


@aion.workflow
async def child_waits(ctx: aion.WorkflowContext) -> str:
    try:
        await ctx.wait_signal("never")
    except aion.WorkflowCancelled:
        STOPPED.append("child")
        raise
    return "unreachable"


@aion.workflow
async def gathers_every_kind(ctx: aion.WorkflowContext) -> list[Any]:
    activity = ctx.start(quick, 1)
    child = ctx.start_child(child_echo, 2)
    timer = ctx.start_timer("t", 0.01)
    return await ctx.gather(activity, child, timer)


@aion.workflow
async def races_a_timer(ctx: aion.WorkflowContext) -> list[Any]:
    slow = ctx.start(forever, "race")
    timer = ctx.start_timer("deadline", 0.01)
    first = await ctx.wait_first(slow, timer)
    assert first is timer
    cancelled = await slow.cancel()
    again = await slow.cancel()
    try:
        await slow
    except aion.ActivityFailure as failure:
        outcome = f"{failure.error.cause.value}: {failure.error.type}"
    return [await timer, cancelled, again, outcome]


@aion.workflow
async def cancels_a_child(ctx: aion.WorkflowContext) -> list[Any]:
    child = ctx.start_child(child_waits, workflow_id="the-child")
    await ctx.sleep(0.01)
    asked = await child.cancel()
    try:
        await child
    except aion.ChildWorkflowFailure as failure:
        return [asked, failure.status]
    return [asked, "completed"]


@aion.workflow
async def cancels_too_late(ctx: aion.WorkflowContext) -> list[Any]:
    done = ctx.start(quick, 5)
    value = await done
    return [value, await done.cancel(), await done]


async def _run(
    url: str, workflow: aion.WorkflowDefinition[Any], **kwargs: Any
) -> tuple[Any, list[aion.Event]]:
    async with aion.open_engine(
        url, workflows=[workflow, child_echo, child_waits], activities=[quick, forever], **kwargs
    ) as engine:
        with trio.fail_after(LIMIT):
            result = await (await engine.start(workflow, workflow_id="w")).result()
        history = await engine.history("w")
    return result, history


async def test_gather_takes_activity_child_and_timer_handles(store_url: Callable[[], str]) -> None:
    result, history = await _run(store_url(), gathers_every_kind)
    assert result == [2, 102, True]
    with trio.fail_after(LIMIT):
        await assert_replays_cleanly(history, workflows=[gathers_every_kind, child_echo], activities=[quick])


async def test_a_cancelled_activity_handle_stops_the_attempt_and_is_recorded(
    store_url: Callable[[], str],
) -> None:
    async with aion.open_engine(store_url(), workflows=[races_a_timer], activities=[forever]) as engine:
        with trio.fail_after(LIMIT):
            result = await (await engine.start(races_a_timer, workflow_id="w")).result()
            await STOP_SEEN["event"].wait()  # while the engine runs: the handle's cancel stopped it
        history = await engine.history("w")
    assert result == [True, True, False, "cancelled: ActivityCancelled"]
    assert STOPPED == ["race"], "the activity's task was really cancelled"
    cancels = [e.body for e in history if isinstance(e.body, ev.ActivityCancelled)]
    assert cancels == [ev.ActivityCancelled(activity_id=0, attempt=1, by_workflow=True)]
    with trio.fail_after(LIMIT):
        await assert_replays_cleanly(history, workflows=[races_a_timer], activities=[forever])
    assert CALLS == ["forever race"], "replay runs nothing"


async def test_a_cancelled_child_handle_cancels_the_child(store_url: Callable[[], str]) -> None:
    url = store_url()
    result, history = await _run(url, cancels_a_child)
    assert result == [True, "cancelled"]
    assert STOPPED == ["child"], "the child saw its cancellation"
    markers = [e.body.name for e in history if isinstance(e.body, ev.MarkerRecorded)]
    assert "cancel-child:0" in markers
    async with aion.open_engine(url, workflows=[child_waits]) as engine:
        child_history = await engine.history("the-child")
        assert (await engine.describe("the-child")).status is aion.WorkflowStatus.CANCELLED
    requests = [e.body for e in child_history if isinstance(e.body, ev.WorkflowCancelRequested)]
    assert len(requests) == 1
    assert "cancelled by its parent workflow 'w'" in requests[0].reason
    with trio.fail_after(LIMIT):
        await assert_replays_cleanly(history, workflows=[cancels_a_child, child_waits])


async def test_cancelling_a_settled_activity_changes_nothing(store_url: Callable[[], str]) -> None:
    result, history = await _run(store_url(), cancels_too_late)
    assert result == [10, False, 10]
    assert not any(isinstance(e.body, ev.ActivityCancelled) for e in history)


async def test_gather_refuses_what_is_not_a_handle(store_url: Callable[[], str]) -> None:
    @aion.workflow(name="bad_gather")
    async def bad_gather(ctx: aion.WorkflowContext) -> None:
        await ctx.gather(ctx.start(quick, 1), "not a handle")  # type: ignore[arg-type]

    async with aion.open_engine(store_url(), workflows=[bad_gather], activities=[quick]) as engine:
        with (
            trio.fail_after(LIMIT),
            pytest.raises(aion.WorkflowFailure, match=r"takes handles from ctx\.start"),
        ):
            await (await engine.start(bad_gather, workflow_id="b")).result()


@aion.workflow(name="races_a_timer")
async def races_without_the_cancel(ctx: aion.WorkflowContext) -> list[Any]:
    slow = ctx.start(forever, "race")
    timer = ctx.start_timer("deadline", 0.01)
    await ctx.wait_first(slow, timer)
    return [await timer]


async def test_dropping_a_recorded_handle_cancel_is_non_determinism(
    autojump_clock: trio.testing.MockClock,
) -> None:
    _, history = await _run(f"memory://handles-{uuid.uuid4().hex}", races_a_timer)
    outcome = await replay(history, workflows=[races_without_the_cancel], activities=[forever])
    reason = outcome.stuck_reason or ""
    assert "activity cancel command #2 was recorded as cancel of activity:0" in reason, reason
    assert outcome.refused == []


THREAD_TOLD = threading.Event()


@aion.activity
def polls_for_cancellation(tag: str) -> str:
    """A plain def (a thread): it learns of the cancel through activity_cancelled()."""
    deadline = time.monotonic() + LIMIT
    while not aion.activity_cancelled():
        if time.monotonic() > deadline:
            return "never told"
        time.sleep(0.001)
    THREAD_TOLD.set()
    return "told"


@aion.workflow
async def cancels_a_thread_activity(ctx: aion.WorkflowContext) -> str:
    busy = ctx.start(polls_for_cancellation, "t")
    timer = ctx.start_timer("soon", 0.01)
    await ctx.wait_first(busy, timer)
    await busy.cancel()
    try:
        await busy
    except aion.ActivityFailure as failure:
        return failure.error.cause.value
    return "completed"


async def test_a_cancelled_thread_activity_is_told(store_url: Callable[[], str]) -> None:
    THREAD_TOLD.clear()
    async with aion.open_engine(
        store_url(), workflows=[cancels_a_thread_activity], activities=[polls_for_cancellation]
    ) as engine:
        with trio.fail_after(LIMIT):
            run = await engine.start(cancels_a_thread_activity, workflow_id="th")
            assert await run.result() == "cancelled"
            assert await trio.to_thread.run_sync(THREAD_TOLD.wait, LIMIT), "the thread was told"
