"""Signals: recorded before observed, consumed in order, raced against timeouts by seq."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone

import pytest
import trio
import trio.testing

import aion_trio as aion


def url() -> str:
    return f"memory://signals-{uuid.uuid4().hex}"


@aion.workflow
async def approvals(ctx: aion.WorkflowContext, count: int) -> list[object]:
    return [await ctx.wait_signal("approve") for _ in range(count)]


@aion.workflow
async def approval_with_deadline(ctx: aion.WorkflowContext, seconds: float) -> object:
    try:
        return await ctx.wait_signal("approve", timeout=seconds)
    except aion.Timeout:
        return "expired"


async def test_signals_wake_the_run_and_are_consumed_in_order(autojump_clock: trio.testing.MockClock) -> None:
    async with aion.open_engine(url(), workflows=[approvals]) as engine:
        run = await engine.start(approvals, 3, workflow_id="a")
        # One signal before the run waits for it, two while it waits.
        await engine.signal("a", "approve", {"by": "ann"})
        await trio.testing.wait_all_tasks_blocked()
        await engine.signal("a", "approve", {"by": "bob"})
        await engine.signal("a", "other", "ignored")
        await engine.signal("a", "approve", {"by": "cid"})
        assert await run.result() == [{"by": "ann"}, {"by": "bob"}, {"by": "cid"}]


async def test_signals_to_unknown_or_finished_workflows_are_refused_and_record_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with aion.open_engine(url(), workflows=[approvals]) as engine:
        with pytest.raises(aion.WorkflowNotFound):
            await engine.signal("nobody", "approve")
        run = await engine.start(approvals, 0, workflow_id="done")
        await run.result()
        before = len(await engine.history("done"))
        with pytest.raises(aion.NotRunning, match="completed"):
            await engine.signal("done", "approve", 1)
        with pytest.raises(aion.PayloadNotSerializable):
            await engine.signal("done", "approve", object())
        assert len(await engine.history("done")) == before


async def test_a_signal_timeout_expires_durably_and_replays_the_same_way(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = url()
    async with aion.open_engine(store, workflows=[approval_with_deadline]) as engine:
        run = await engine.start(approval_with_deadline, 3600.0, workflow_id="late")
        assert await run.result() == "expired"
        length = len(await engine.history("late"))
        with pytest.raises(aion.NotRunning):
            await engine.signal("late", "approve", "too late")
    async with aion.open_engine(store, workflows=[approval_with_deadline]) as engine:
        assert await engine.result("late") == "expired"
        assert len(await engine.history("late")) == length


async def test_a_signal_in_time_wins_and_retires_the_timeout_timer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with aion.open_engine(url(), workflows=[approval_with_deadline]) as engine:
        run = await engine.start(approval_with_deadline, 3600.0, workflow_id="ok")
        await trio.sleep(60)
        await engine.signal("ok", "approve", "yes")
        assert await run.result() == "yes"
        await trio.sleep(7200)
        history = await engine.history("ok")
    assert any(isinstance(e.body, aion.TimerCancelled) for e in history)
    assert not any(isinstance(e.body, aion.TimerFired) for e in history)


@pytest.mark.parametrize("signal_first", [True, False])
async def test_when_both_are_recorded_the_lower_seq_decides(
    autojump_clock: trio.testing.MockClock, signal_first: bool
) -> None:
    """Signals and timer fires are recorded by third parties racing each other; the
    wait takes whichever has the lower seq, so every replay agrees with the live run."""
    store = url()
    t0 = datetime(2030, 1, 1, tzinfo=timezone.utc)
    run_id = str(uuid.uuid4())
    raced = [
        aion.SignalReceived(name="approve", payload=aion.Payload.of("yes")),
        aion.TimerFired(timer_id="anonymous:0"),
    ]
    bodies = [
        aion.WorkflowStarted(
            workflow_type="approval_with_deadline", input=aion.Payload.of([10.0]), run_id=run_id
        ),
        aion.TimerStarted(timer_id="anonymous:0", fire_at=t0 + timedelta(seconds=10)),
        *(raced if signal_first else raced[::-1]),
    ]
    async with aion.open_store(store) as opened:
        events = [
            aion.Event(workflow_id="race", seq=i + 1, recorded_at=t0, body=b) for i, b in enumerate(bodies)
        ]
        await opened.events.append("race", events, 0)
    async with aion.open_engine(store, workflows=[approval_with_deadline]) as engine:
        assert await engine.result("race") == ("yes" if signal_first else "expired")


async def test_signals_survive_a_restart_and_one_sent_during_replay_is_not_lost(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = url()
    async with aion.open_engine(store, workflows=[approvals]) as engine:
        await engine.start(approvals, 2, workflow_id="r")
        await engine.signal("r", "approve", 1)
        await trio.testing.wait_all_tasks_blocked()
    async with aion.open_engine(store, workflows=[approvals]) as engine:
        # Sent as soon as the engine is open, racing the run's replay.
        await engine.signal("r", "approve", 2)
        assert await engine.result("r") == [1, 2]
