"""Cancel, terminate, reopen and the workflow deadline (issue 5 items 4, 9, 10).

Every finished history here is also replayed in a fresh engine that refuses
appends (tests/_replay.py): the recorded path is the path the code takes.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timezone
from typing import Any

import pytest
import trio
import trio.testing
from _replay import assert_replays_cleanly

import aion_trio as aion
from aion_trio import events as ev
from aion_trio.plugin import EventStore
from aion_trio.projections import current_lease_terminal

CALLS: dict[str, int] = {}
CANCELLED_ACTIVITIES: list[str] = []
REACHED: list[str] = []
BUGGY = {"on": True}
LIMIT = 40 * 86400


@pytest.fixture(autouse=True)
def _reset() -> None:
    CALLS.clear()
    CANCELLED_ACTIVITIES.clear()
    REACHED.clear()
    BUGGY["on"] = True


def url() -> str:
    return f"memory://lifecycle-{uuid.uuid4().hex}"


@aion.activity
async def reserve(order: str) -> str:
    CALLS["reserve"] = CALLS.get("reserve", 0) + 1
    return f"reserved {order}"


@aion.activity
async def release(order: str) -> str:
    CALLS["release"] = CALLS.get("release", 0) + 1
    return f"released {order}"


@aion.activity
async def ship(order: str) -> str:
    """Takes a day; stands for work still in flight when the run is ended."""
    CALLS["ship"] = CALLS.get("ship", 0) + 1
    try:
        await trio.sleep(86400)
    except trio.Cancelled:
        CANCELLED_ACTIVITIES.append(order)
        raise
    return f"shipped {order}"


@aion.workflow
async def saga(ctx: aion.WorkflowContext, order: str) -> str:
    await ctx.run(reserve, order)
    try:
        return await ctx.run(ship, order)
    except aion.WorkflowCancelled:
        with ctx.cleanup():
            await ctx.run(release, order)
        REACHED.append("compensated")
        raise


@aion.workflow
async def stubborn(ctx: aion.WorkflowContext) -> str:
    """Catches the cancellation and tries to go on outside a cleanup scope."""
    try:
        await ctx.sleep(3600)
    except aion.WorkflowCancelled:
        REACHED.append("first")
    try:
        await ctx.run(reserve, "x")
    except aion.WorkflowCancelled:
        REACHED.append("again")  # level-triggered: raised at every await outside cleanup
    return "ignored"


@aion.workflow
async def sleeper(ctx: aion.WorkflowContext) -> str:
    handle = ctx.start(ship, "slow")
    try:
        await ctx.sleep(7200)
    except Exception:
        REACHED.append("handler ran")  # must not: a terminated run's code does not go on
        raise
    REACHED.append("woke")
    return str(await handle)


@aion.workflow
async def buggy(ctx: aion.WorkflowContext, order: str) -> str:
    reserved = await ctx.run(reserve, order)
    if BUGGY["on"]:
        raise KeyError("a bug in the workflow")
    return str(reserved) + " and done"


def types(history: list[aion.Event]) -> list[str]:
    return [type(e.body).__name__ for e in history]


# -- cancel ------------------------------------------------------------------


async def test_cancel_interrupts_the_next_await_compensation_runs_and_the_run_ends_cancelled(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(LIMIT):  # a hang fails (mock time) instead of blocking forever
        async with aion.open_engine(url(), workflows=[saga], activities=[reserve, ship, release]) as engine:
            run = await engine.start(saga, "o-1", workflow_id="o-1")
            await trio.sleep(60)  # ship is in flight
            await engine.cancel("o-1", "customer changed their mind")
            with pytest.raises(aion.WorkflowFailure, match="cancelled") as info:
                await run.result()
            assert info.value.reason == "customer changed their mind"
            history = await engine.history("o-1")
            description = await engine.describe("o-1")
        assert description.status is aion.WorkflowStatus.CANCELLED
        assert REACHED == ["compensated"]
        assert CALLS == {"reserve": 1, "ship": 1, "release": 1}
        assert CANCELLED_ACTIVITIES == ["o-1"], "the in-flight activity was really cancelled"
        names = types(history)
        request = names.index("WorkflowCancelRequested")
        # The awaited attempt was cancelled the moment the workflow stopped waiting for
        # it, then the compensation ran, then the run ended.
        assert names[request + 1 :] == [
            "ActivityCancelled",
            "ActivityScheduled",
            "ActivityStarted",
            "ActivityCompleted",
            "WorkflowCancelled",
        ]
        terminal = history[-1].body
        assert isinstance(terminal, ev.WorkflowCancelled)
        assert (terminal.reason, terminal.terminated) == ("customer changed their mind", False)
        await assert_replays_cleanly(history, workflows=[saga], activities=[reserve, ship, release])


async def test_cancellation_is_level_triggered_and_a_run_that_swallows_it_completes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(LIMIT):  # a hang fails (mock time) instead of blocking forever
        async with aion.open_engine(url(), workflows=[stubborn], activities=[reserve]) as engine:
            run = await engine.start(stubborn, workflow_id="s")
            await trio.testing.wait_all_tasks_blocked()
            await engine.cancel("s")
            assert await run.result() == "ignored"
            history = await engine.history("s")
        assert REACHED == ["first", "again"]
        terminal = current_lease_terminal(history)
        assert terminal is not None
        assert isinstance(terminal.body, ev.WorkflowCompleted)
        await assert_replays_cleanly(history, workflows=[stubborn], activities=[reserve])


async def test_cancel_refuses_unknown_and_finished_runs_and_a_second_request_records_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(LIMIT):  # a hang fails (mock time) instead of blocking forever
        async with aion.open_engine(
            url(), workflows=[saga, buggy], activities=[reserve, ship, release]
        ) as engine:
            with pytest.raises(aion.WorkflowNotFound):
                await engine.cancel("nobody")
            with pytest.raises(aion.WorkflowNotFound):
                await engine.terminate("nobody")
            BUGGY["on"] = False
            done = await engine.start(buggy, "d", workflow_id="done")
            await done.result()
            before = await engine.history("done")
            with pytest.raises(aion.NotRunning, match="completed"):
                await engine.cancel("done")
            with pytest.raises(aion.NotRunning, match="completed"):
                await engine.terminate("done")
            assert await engine.history("done") == before

            await engine.start(saga, "o-2", workflow_id="o-2")
            await trio.sleep(60)
            async with trio.open_nursery() as nursery:
                # Two requests racing: one is recorded.
                nursery.start_soon(engine.cancel, "o-2", "first")
                nursery.start_soon(engine.cancel, "o-2", "second")
            with pytest.raises(aion.WorkflowFailure):
                await engine.result("o-2")
            requests = [
                e for e in await engine.history("o-2") if isinstance(e.body, ev.WorkflowCancelRequested)
            ]
            assert len(requests) == 1


# -- terminate -----------------------------------------------------------------


async def test_terminate_ends_the_run_at_once_cancelling_activities_and_timers(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(LIMIT):  # a hang fails (mock time) instead of blocking forever
        store = url()
        async with aion.open_engine(store, workflows=[sleeper], activities=[ship]) as engine:
            run = await engine.start(sleeper, workflow_id="t")
            await trio.sleep(600)
            await engine.terminate("t", "operator: stuck shipment")
            with pytest.raises(aion.WorkflowFailure, match="cancelled"):
                await run.result()
            await trio.testing.wait_all_tasks_blocked()
            history = await engine.history("t")
            events_store: EventStore = engine.store.events
            due = await events_store.expired_timers(datetime(2999, 1, 1, tzinfo=timezone.utc))
            description = await engine.describe("t")
            # An hour and more later nothing has changed: no timer fired, no code ran.
            await trio.sleep(86400 * 2)
            assert await engine.history("t") == history
        assert REACHED == []
        assert CANCELLED_ACTIVITIES == ["slow"]
        assert description.status is aion.WorkflowStatus.CANCELLED
        assert [t for t in due if t.workflow_id == "t"] == []
        tail = [e.body for e in history[-3:]]
        assert isinstance(tail[0], ev.WorkflowCancelled)
        assert tail[0].terminated
        assert tail[0].reason == "operator: stuck shipment"
        assert isinstance(tail[1], ev.ActivityCancelled)
        assert isinstance(tail[2], ev.TimerCancelled)
        assert tail[2].cause is ev.TimerCancelCause.CANCEL_TEARDOWN


# -- reopen --------------------------------------------------------------------


async def test_a_run_that_failed_on_a_bug_passes_once_the_code_is_fixed_and_it_is_reopened(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(LIMIT):  # a hang fails (mock time) instead of blocking forever
        store = url()
        async with aion.open_engine(store, workflows=[buggy], activities=[reserve]) as engine:
            run = await engine.start(buggy, "o-9", workflow_id="o-9")
            with pytest.raises(aion.WorkflowFailure, match="KeyError"):
                await run.result()
        BUGGY["on"] = False  # the fix is deployed; a new engine serves the workflow
        async with aion.open_engine(store, workflows=[buggy], activities=[reserve]) as engine:
            handle = await engine.reopen("o-9")
            assert handle.run_id == run.run_id
            assert await handle.result() == "reserved o-9 and done"
            history = await engine.history("o-9")
            assert (await engine.describe("o-9")).status is aion.WorkflowStatus.COMPLETED
        assert CALLS == {"reserve": 1}, "the recorded step was replayed, not re-run"
        assert types(history)[-3:] == ["WorkflowFailed", "WorkflowReopened", "WorkflowCompleted"]
        await assert_replays_cleanly(history, workflows=[buggy], activities=[reserve])


async def test_reopen_after_terminate_re_arms_the_retired_timers_and_re_dispatches_activities(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(LIMIT):  # a hang fails (mock time) instead of blocking forever
        async with aion.open_engine(url(), workflows=[sleeper], activities=[ship]) as engine:
            run = await engine.start(sleeper, workflow_id="r")
            await trio.sleep(600)
            await engine.terminate("r")
            started = trio.current_time()
            handle = await engine.reopen("r")
            assert await handle.result() == "shipped slow"
            elapsed = trio.current_time() - started
            history = await engine.history("r")
        # The sleep kept its recorded fire time (7200 s after the start, 600 s of which had passed);
        # ship was re-dispatched and took its full day.
        assert 86400 <= elapsed < 86400 + 60
        assert CALLS["ship"] == 2
        assert REACHED == ["woke"]
        reopened = next(e.body for e in history if isinstance(e.body, ev.WorkflowReopened))
        assert reopened.run_id == run.run_id
        assert reopened.reopened_activity_ids == (0,)
        fired = [e.body.timer_id for e in history if isinstance(e.body, ev.TimerFired)]
        assert fired == ["anonymous:0"]


async def test_reopen_is_refused_for_running_completed_and_compensated_runs(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(LIMIT):  # a hang fails (mock time) instead of blocking forever
        async with aion.open_engine(
            url(), workflows=[saga, buggy], activities=[reserve, ship, release]
        ) as engine:
            with pytest.raises(aion.WorkflowNotFound):
                await engine.reopen("nobody")
            await engine.start(saga, "a", workflow_id="running")
            await trio.sleep(60)
            with pytest.raises(aion.CannotReopen, match="running"):
                await engine.reopen("running")
            BUGGY["on"] = False
            await (await engine.start(buggy, "b", workflow_id="completed")).result()
            with pytest.raises(aion.CannotReopen, match="completed"):
                await engine.reopen("completed")
            await engine.cancel("running")
            with pytest.raises(aion.WorkflowFailure):
                await engine.result("running")
            before = await engine.history("running")
            with pytest.raises(aion.CannotReopen, match="reacted to the cancellation"):
                await engine.reopen("running")
            assert await engine.history("running") == before


# -- the workflow deadline -----------------------------------------------------------


async def test_the_deadline_times_the_run_out_and_retires_itself_last(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(LIMIT):  # a hang fails (mock time) instead of blocking forever
        async with aion.open_engine(url(), workflows=[sleeper], activities=[ship]) as engine:
            run = await engine.start(sleeper, workflow_id="late", timeout=300)
            t0 = trio.current_time()
            with pytest.raises(aion.WorkflowFailure, match="timed_out"):
                await run.result()
            assert trio.current_time() - t0 == pytest.approx(300, abs=1)
            await trio.testing.wait_all_tasks_blocked()
            history = await engine.history("late")
            assert (await engine.describe("late")).status is aion.WorkflowStatus.TIMED_OUT
            with pytest.raises(aion.NotRunning):
                await engine.cancel("late")
        assert CANCELLED_ACTIVITIES == ["slow"]
        assert REACHED == []
        names = types(history)
        assert names[:2] == ["WorkflowStarted", "TimerStarted"]
        assert names[names.index("WorkflowTimedOut") :] == [
            "WorkflowTimedOut",
            "ActivityCancelled",
            "TimerCancelled",
            "TimerFired",
        ]
        deadline = history[-1].body
        assert isinstance(deadline, ev.TimerFired)
        assert deadline.timer_id == f"deadline:{run.run_id}"


async def test_a_run_that_ends_in_time_retires_its_deadline_with_its_terminal(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(LIMIT):  # a hang fails (mock time) instead of blocking forever
        BUGGY["on"] = False
        async with aion.open_engine(url(), workflows=[buggy], activities=[reserve]) as engine:
            run = await engine.start(buggy, "x", workflow_id="quick", timeout=3600)
            assert await run.result() == "reserved x and done"
            await trio.sleep(7200)
            history = await engine.history("quick")
        assert types(history)[-2:] == ["WorkflowCompleted", "TimerCancelled"]
        assert not any(isinstance(e.body, (ev.WorkflowTimedOut, ev.TimerFired)) for e in history)


async def test_a_deadline_survives_a_restart(autojump_clock: trio.testing.MockClock) -> None:
    with trio.fail_after(LIMIT):  # a hang fails (mock time) instead of blocking forever
        store = url()
        async with aion.open_engine(store, workflows=[sleeper], activities=[ship]) as engine:
            run = await engine.start(sleeper, workflow_id="d", timeout=1800)
            await trio.sleep(60)
        async with aion.open_engine(store, workflows=[sleeper], activities=[ship]) as engine:
            with pytest.raises(aion.WorkflowFailure, match="timed_out"):
                await engine.result("d")
            assert run.run_id == (await engine.describe("d")).run_id


class _RetirementFails:
    """Fault injection: the teardown's last step (retiring the deadline) never lands."""

    def __init__(self, inner: aion.Store) -> None:
        self._inner = inner
        self.events = _NoRetire(inner.events)

    @property
    def visibility(self) -> Any:
        return self._inner.visibility

    async def aclose(self) -> None:
        await self._inner.aclose()


class _NoRetire:
    def __init__(self, inner: EventStore) -> None:
        self._inner = inner

    async def append(self, workflow_id: str, events: Any, expected_seq: int) -> None:
        if any(isinstance(e.body, ev.TimerFired) and e.body.timer_id.startswith("deadline:") for e in events):
            await trio.lowlevel.checkpoint()
            raise aion.NotOwner("simulated crash before the deadline was retired")
        await self._inner.append(workflow_id, events, expected_seq)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


async def test_a_teardown_interrupted_before_the_retirement_is_finished_by_the_next_recovery(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(LIMIT):  # a hang fails (mock time) instead of blocking forever
        name = url()
        async with (
            aion.open_store(name) as raw,
            aion.open_engine(_RetirementFails(raw), workflows=[sleeper], activities=[ship]) as engine,
        ):  # type: ignore[arg-type]
            run = await engine.start(sleeper, workflow_id="half", timeout=60)
            with pytest.raises(aion.WorkflowFailure, match="timed_out"):
                await run.result()
            await trio.testing.wait_all_tasks_blocked()
            half = await engine.history("half")
        assert types(half)[-1] != "TimerFired", "the fault injection must leave the deadline outstanding"
        async with aion.open_engine(name, workflows=[sleeper], activities=[ship]) as engine:
            await trio.testing.wait_all_tasks_blocked()
            await trio.sleep(1)
            history = await engine.history("half")
        assert history[: len(half)] == half
        assert types(history)[len(half) :] == ["TimerFired"]
        assert sum(isinstance(e.body, ev.WorkflowTimedOut) for e in history) == 1
        assert history[-1].body == ev.TimerFired(timer_id=f"deadline:{run.run_id}")


def test_a_cancelled_event_written_before_terminated_existed_still_decodes() -> None:
    from aion_trio.plugin import body_from_data_json

    body = body_from_data_json("WorkflowCancelled", '{"reason": "old"}')
    assert body == ev.WorkflowCancelled(reason="old", terminated=False)
