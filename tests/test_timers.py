"""Durable timers and timeout scopes.

Time is ``MockClock(autojump_threshold=0)`` and the memory store: a 30-day
sleep completes in milliseconds of real time.
"""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
import trio
import trio.testing

import aion_trio as aion
import aion_trio.testing

CANCELLED: list[str] = []


def url() -> str:
    return f"memory://timers-{uuid.uuid4().hex}"


@aion.workflow
async def sleeps_a_month(ctx: aion.WorkflowContext) -> list[str]:
    before = ctx.now()
    await ctx.sleep(timedelta(days=30))
    after = ctx.now()
    return [before.isoformat(), after.isoformat()]


async def test_a_thirty_day_sleep_completes_in_mock_time(autojump_clock: trio.testing.MockClock) -> None:
    async with aion.open_engine(url(), workflows=[sleeps_a_month]) as engine:
        run = await engine.start(sleeps_a_month, workflow_id="month")
        before, after = await run.result()
        history = await engine.history("month")
    started = next(e.body for e in history if isinstance(e.body, aion.TimerStarted))
    fired = [e for e in history if isinstance(e.body, aion.TimerFired)]
    assert started.timer_id == "anonymous:0"
    assert started.fire_at - history[0].recorded_at == timedelta(days=30)
    assert len(fired) == 1
    assert fired[0].recorded_at >= started.fire_at
    assert after == fired[0].recorded_at.isoformat(), "now() advanced to the consumed fire"
    assert before == history[0].recorded_at.isoformat()


async def test_a_timer_due_while_the_engine_was_down_fires_exactly_once_at_recovery(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = url()
    async with aion.open_engine(store, workflows=[sleeps_a_month]) as engine:
        await engine.start(sleeps_a_month, workflow_id="down")
        await trio.sleep(3600)
    await trio.sleep(timedelta(days=31).total_seconds())
    async with aion.open_engine(store, workflows=[sleeps_a_month]) as engine:
        await engine.result("down")
        await trio.sleep(3600)
        history = await engine.history("down")
    assert sum(1 for e in history if isinstance(e.body, aion.TimerFired)) == 1
    assert sum(1 for e in history if isinstance(e.body, aion.TimerStarted)) == 1


@aion.activity
async def slow(seconds: float) -> str:
    try:
        await trio.sleep(seconds)
    except trio.Cancelled:
        CANCELLED.append(aion.activity_info().activity_type)
        raise
    return f"slept {seconds}"


@aion.workflow
async def races_a_deadline(ctx: aion.WorkflowContext, work: float, limit: float) -> str:
    try:
        async with ctx.timeout(limit):
            return str(await ctx.run(slow, work))
    except aion.Timeout:
        return "timed out"


async def test_a_timeout_scope_fails_the_await_records_it_and_cancels_the_attempt(
    autojump_clock: trio.testing.MockClock,
) -> None:
    CANCELLED.clear()
    store = url()
    async with aion.open_engine(store, workflows=[races_a_deadline], activities=[slow]) as engine:
        run = await engine.start(races_a_deadline, 100.0, 10.0, workflow_id="late")
        assert await run.result() == "timed out"
        await trio.sleep(1000)
        history = await engine.history("late")
    failed = [e.body for e in history if isinstance(e.body, aion.ActivityFailed)]
    assert len(failed) == 1
    assert failed[0].final
    assert failed[0].error.cause is aion.FailureCause.TIMEOUT
    assert CANCELLED == ["slow"], "the running attempt was really cancelled"
    assert not any(isinstance(e.body, aion.ActivityCompleted) for e in history)
    # Replay in a fresh engine takes the same branch and appends nothing.
    async with aion.open_store(store) as opened:
        count_before = len(await opened.events.read_history("late"))
    async with aion.open_engine(store, workflows=[races_a_deadline], activities=[slow]) as engine:
        assert await engine.result("late") == "timed out"
        assert len(await engine.history("late")) == count_before


async def test_leaving_a_scope_in_time_cancels_its_timer_and_it_never_fires(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with aion.open_engine(url(), workflows=[races_a_deadline], activities=[slow]) as engine:
        run = await engine.start(races_a_deadline, 1.0, 60.0, workflow_id="early")
        assert await run.result() == "slept 1.0"
        await trio.sleep(3600)
        history = await engine.history("early")
    cancelled = [e.body for e in history if isinstance(e.body, aion.TimerCancelled)]
    assert [(c.timer_id, c.cause) for c in cancelled] == [("scope:0", aion.TimerCancelCause.WORKFLOW_INTENT)]
    assert not any(isinstance(e.body, aion.TimerFired) for e in history)


@aion.workflow
async def nested(ctx: aion.WorkflowContext) -> str:
    try:
        async with ctx.timeout(100), ctx.timeout(5):
            await ctx.sleep(50)
    except aion.Timeout:
        return "timed out"
    return "slept"


@aion.workflow
async def nested_outer_first(ctx: aion.WorkflowContext) -> float:
    start = ctx.now()
    try:
        async with ctx.timeout(5), ctx.timeout(100):
            await ctx.sleep(50)
    except aion.Timeout:
        pass
    await ctx.sleep(0)
    return (ctx.now() - start).total_seconds()


async def test_nested_scopes_the_earliest_deadline_wins(autojump_clock: trio.testing.MockClock) -> None:
    async with aion.open_engine(url(), workflows=[nested, nested_outer_first]) as engine:
        assert (await (await engine.start(nested, workflow_id="n1")).result()).startswith("timed out")
        elapsed = await (await engine.start(nested_outer_first, workflow_id="n2")).result()
        history = await engine.history("n2")
    assert 5 <= elapsed < 50, "the 5s outer scope ended the 50s sleep"
    cancelled = {e.body.timer_id for e in history if isinstance(e.body, aion.TimerCancelled)}
    assert "anonymous:0" in cancelled, "the interrupted sleep's timer is retired"
    assert "scope:1" in cancelled, "the inner scope that did not fire is retired on the way out"


@aion.workflow
async def awaits_in_scope(ctx: aion.WorkflowContext) -> str:
    try:
        async with ctx.timeout(10):
            return str(await ctx.run(slow, 10.0))
    except aion.Timeout:
        return "timed out"


async def test_a_completion_present_in_the_snapshot_settles_ahead_of_an_expired_scope(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """History holds the scope's TimerFired and, after it, the activity's completion (both
    recorded before the workflow looked): the recorded completion is the resolution, live
    and on replay; the expiry never gets recorded."""
    store = url()
    async with aion.open_store(store) as opened:
        from datetime import datetime, timezone

        t0 = datetime(2030, 1, 1, tzinfo=timezone.utc)
        run_id = str(uuid.uuid4())
        bodies = [
            aion.WorkflowStarted(workflow_type="awaits_in_scope", input=aion.Payload.of([]), run_id=run_id),
            aion.TimerStarted(timer_id="scope:0", fire_at=t0 + timedelta(seconds=10)),
            aion.ActivityScheduled(activity_id=0, activity_type="slow", input=aion.Payload.of([10.0])),
            aion.ActivityStarted(activity_id=0, attempt=1),
            aion.TimerFired(timer_id="scope:0"),
            aion.ActivityCompleted(activity_id=0, result=aion.Payload.of("slept 10.0"), attempt=1),
        ]
        events = [
            aion.Event(workflow_id="snap", seq=i + 1, recorded_at=t0, body=b) for i, b in enumerate(bodies)
        ]
        await opened.events.append("snap", events, 0)
    async with aion.open_engine(store, workflows=[awaits_in_scope], activities=[slow]) as engine:
        assert await engine.result("snap") == "slept 10.0"
        history = await engine.history("snap")
    # Only the terminal was appended: no timeout failure, and the fired scope needs no retiring.
    assert [type(e.body).__name__ for e in history[len(bodies) :]] == ["WorkflowCompleted"]


def test_timeout_and_sleep_arguments_are_validated() -> None:
    # The context's timeouts and sleeps go through the one duration check of the leaf helpers.
    from aion_trio._retry import duration_seconds

    with pytest.raises(ValueError, match="> 0"):
        duration_seconds(0, "timeout", allow_zero=False)
    with pytest.raises(ValueError, match="finite"):
        duration_seconds(float("inf"), "sleep duration", allow_zero=True)
    with pytest.raises(TypeError):
        duration_seconds(True, "sleep duration", allow_zero=True)


# --------------------------------------------------------------------------
# Named timers with cancel
# --------------------------------------------------------------------------


@aion.workflow
async def named_timers(ctx: aion.WorkflowContext, mode: str) -> list[object]:
    out: list[object] = []
    if mode == "fire":
        reminder = ctx.start_timer("reminder", 3600)
        out.append(await reminder)
    elif mode == "cancel-before":
        reminder = ctx.start_timer("reminder", timedelta(hours=1))
        await ctx.sleep(60)
        out.append(await reminder.cancel())
        out.append(await reminder)
        await ctx.sleep(7200)  # the cancelled timer must not fire meanwhile
    elif mode == "cancel-after":
        reminder = ctx.start_timer("reminder", 10)
        await ctx.sleep(60)
        out.append(await reminder.cancel())
        out.append(await reminder)
    elif mode == "cancel-at-once":
        reminder = ctx.start_timer("reminder", at=ctx.now() + timedelta(days=1))
        out.append(await reminder.cancel())
    elif mode == "scope":
        reminder = ctx.start_timer("reminder", 3600)
        try:
            async with ctx.timeout(60):
                await reminder
        except aion.Timeout:
            out.append("timed out")
    out.append(ctx.now().isoformat())
    return out


@pytest.mark.parametrize(
    ("mode", "expected", "resolution"),
    [
        ("fire", [True], "TimerFired"),
        ("cancel-before", [True, False], "TimerCancelled"),
        ("cancel-after", [False, True], "TimerFired"),
        ("cancel-at-once", [True], "TimerCancelled"),
        ("scope", ["timed out"], "TimerCancelled"),
    ],
)
async def test_named_timers_fire_or_are_cancelled_durably_and_replay_alike(
    autojump_clock: trio.testing.MockClock, mode: str, expected: list[object], resolution: str
) -> None:
    from _replay import assert_replays_cleanly

    with trio.fail_after(10 * 86400):
        async with aion.open_engine(url(), workflows=[named_timers]) as engine:
            run = await engine.start(named_timers, mode, workflow_id=mode)
            result = await run.result()
            await trio.sleep(2 * 86400)  # nothing fires after the run ended
            history = await engine.history(mode)
    assert result[:-1] == expected
    named = [e for e in history if getattr(e.body, "timer_id", None) == "named:reminder"]
    kinds = [type(e.body).__name__ for e in named]
    assert kinds == ["TimerStarted", resolution]
    if resolution == "TimerCancelled":
        assert named[1].body.cause is aion.TimerCancelCause.WORKFLOW_INTENT  # type: ignore[union-attr]
    started = named[0].body
    assert isinstance(started, aion.TimerStarted)
    if mode == "fire":
        assert (started.fire_at - history[0].recorded_at).total_seconds() == 3600
        assert (named[1].recorded_at - history[0].recorded_at).total_seconds() == pytest.approx(3600, abs=1)
    await assert_replays_cleanly(history, workflows=[named_timers])


@aion.workflow
async def reuses_a_name(ctx: aion.WorkflowContext) -> str:
    ctx.start_timer("once", 1)
    try:
        ctx.start_timer("once", 1)
    except ValueError as exc:
        return str(exc)
    return "accepted"


async def test_timer_names_are_unique_per_run_and_arguments_are_checked(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with aion.open_engine(url(), workflows=[reuses_a_name]) as engine:
        assert "already used in this run" in await (await engine.start(reuses_a_name)).result()


@aion.workflow
async def waits_on_a_named_timer(ctx: aion.WorkflowContext) -> str:
    await ctx.start_timer("wake", 3600)
    return ctx.now().isoformat()


async def test_a_named_timer_due_while_the_engine_was_down_fires_at_recovery(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = url()
    async with aion.open_engine(store, workflows=[waits_on_a_named_timer]) as engine:
        await engine.start(waits_on_a_named_timer, workflow_id="down")
        await trio.sleep(60)
    await trio.sleep(7200)  # the engine is down when the timer comes due
    async with aion.open_engine(store, workflows=[waits_on_a_named_timer]) as engine:
        with trio.fail_after(60):
            await engine.result("down")
        history = await engine.history("down")
    fired = [e for e in history if isinstance(e.body, aion.TimerFired)]
    assert [e.body.timer_id for e in fired] == ["named:wake"]


@aion.workflow
async def sleeps_ten_seconds(ctx: aion.WorkflowContext) -> str:
    await ctx.sleep(10)
    return "woke"


async def test_a_fire_that_fails_transiently_is_retried_along_the_ladder(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The fire's appends fail three times: it is retried in the background after 1, 2 and
    4 s (the completion_retry ladder, doubling) and lands once."""
    config = aion.EngineConfig(completion_retry=aion.CompletionRetryConfig(initial=1.0, ceiling=8.0))
    async with aion.open_store(url()) as inner:
        flaky = aion.testing.FlakyStoreBundle(inner)
        async with aion.open_engine(flaky, workflows=[sleeps_ten_seconds], config=config) as engine:
            start = trio.current_time()
            slow_run = await engine.start(sleeps_ten_seconds, workflow_id="flaky-fire")
            await trio.sleep(9)
            flaky.events.fail_next_appends(3)
            with trio.fail_after(60):
                assert await slow_run.result() == "woke"
                woke_at = trio.current_time() - start
            history = await engine.history("flaky-fire")
    assert flaky.events.faults["append"] == 3, "control: the fire's appends really failed"
    # Fired at 10 s (failed), retried at 11, 13 and 17 s (1, 2, 4 s of backoff): lands at 17 s.
    assert 17 <= woke_at < 18
    assert sum(1 for e in history if isinstance(e.body, aion.TimerFired)) == 1
