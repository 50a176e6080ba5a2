"""Replay compares the whole command sequence, of every kind and in order
(docs/architecture.md, "Replay reproduces the command sequence").

Each scenario runs a first version of a workflow until it parks (the engine
closes, leaving history as a crash would), then opens an engine with a second
version: a divergence of any kind — an activity where a timer was recorded, a
deleted sleep, a dropped cancel, a signal wait that lost its timeout — stops
the run at that command with ``NonDeterminismError``: it stays Running, marked
stuck, nothing more is recorded and nothing is executed.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from typing import Any

import attrs
import pytest
import trio
from _replay import assert_replays_cleanly, replay

import aion_trio as aion
from aion_trio import events as ev
from aion_trio._projections import command_key

CHARGED: list[str] = []
LIMIT = 20  # seconds: every wait below is bounded by this
#: These scenarios check that a changed workflow is caught when an engine opens: eager
#: recovery (tests/test_lazy_recovery.py has the lazy twins: caught when the run wakes).
EAGER = aion.EngineConfig(lazy_recovery=False)


@pytest.fixture(autouse=True)
def _reset() -> None:
    CHARGED.clear()


@aion.activity
async def charge(order: str) -> str:
    CHARGED.append(order)
    return f"charged {order}"


async def _history_until(
    engine: aion.Engine, workflow_id: str, done: Callable[[list[aion.Event]], bool]
) -> list[aion.Event]:
    with trio.fail_after(LIMIT):
        while True:
            history = await engine.history(workflow_id)
            if done(history):
                return history
            await trio.sleep(0.005)


async def _stuck_reason(engine: aion.Engine, workflow_id: str) -> str:
    with trio.fail_after(LIMIT):
        while True:
            description = await engine.describe(workflow_id)
            if description.stuck_reason:
                assert description.status is aion.WorkflowStatus.RUNNING
                return description.stuck_reason
            await trio.sleep(0.005)


def _types(history: Sequence[aion.Event]) -> list[str]:
    return [type(e.body).__name__ for e in history]


# -- the two examples from the issue -------------------------------------------------


@aion.workflow(name="sleeper")
async def sleeper_v1(ctx: aion.WorkflowContext) -> str:
    await ctx.sleep(86400)
    return "woke"


@aion.workflow(name="sleeper")
async def sleeper_charges_first(ctx: aion.WorkflowContext) -> str:
    await ctx.run(charge, "o-1")  # new, not gated by ctx.patched
    await ctx.sleep(86400)
    return "woke"


@aion.workflow(name="sleeper")
async def sleeper_without_the_sleep(ctx: aion.WorkflowContext) -> str:
    return "woke"


async def _park_sleeper(url: str) -> list[aion.Event]:
    async with aion.open_engine(url, workflows=[sleeper_v1]) as engine:
        await engine.start(sleeper_v1, workflow_id="s")
        history = await _history_until(engine, "s", lambda h: _types(h)[-1:] == ["TimerStarted"])
    assert _types(history) == ["WorkflowStarted", "TimerStarted"], "control: the recorded history"
    return history


async def test_an_activity_inserted_before_a_recorded_sleep_is_non_determinism_and_never_runs(
    store_url: Callable[[], str],
) -> None:
    url = store_url()
    recorded = await _park_sleeper(url)
    async with aion.open_engine(
        url, workflows=[sleeper_charges_first], activities=[charge], config=EAGER
    ) as engine:
        reason = await _stuck_reason(engine, "s")
        history = await engine.history("s")
    assert "timer command #0 was recorded as timer 'anonymous:0'" in reason, reason
    assert "now requests activity 'charge'" in reason, reason
    assert CHARGED == [], "the inserted activity must not be executed (nobody is charged)"
    assert history == recorded, "nothing is recorded for the divergent command"


async def test_a_deleted_sleep_is_non_determinism_and_the_run_does_not_complete(
    store_url: Callable[[], str],
) -> None:
    url = store_url()
    recorded = await _park_sleeper(url)
    async with aion.open_engine(url, workflows=[sleeper_without_the_sleep], config=EAGER) as engine:
        reason = await _stuck_reason(engine, "s")
        history = await engine.history("s")
    assert "timer command #0 was recorded as timer 'anonymous:0'" in reason, reason
    assert "now requests the workflow to return" in reason, reason
    assert history == recorded, "no terminal is recorded"


# -- other kinds: cancels, signal-wait timeouts, children, patches ----------------------


@aion.workflow(name="reminder")
async def reminder_v1(ctx: aion.WorkflowContext) -> str:
    timer = ctx.start_timer("nag", 86400)
    await ctx.wait_signal("paid")
    await timer.cancel()
    await ctx.wait_signal("shipped")
    return "done"


@aion.workflow(name="reminder")
async def reminder_keeps_the_timer(ctx: aion.WorkflowContext) -> str:
    ctx.start_timer("nag", 86400)
    await ctx.wait_signal("paid")
    await ctx.wait_signal("shipped")
    return "done"


async def test_a_dropped_timer_cancel_is_non_determinism(store_url: Callable[[], str]) -> None:
    url = store_url()
    async with aion.open_engine(url, workflows=[reminder_v1]) as engine:
        await engine.start(reminder_v1, workflow_id="r")
        await _history_until(engine, "r", lambda h: "TimerStarted" in _types(h))
        await engine.signal("r", "paid")
        await _history_until(engine, "r", lambda h: "TimerCancelled" in _types(h))
    async with aion.open_engine(url, workflows=[reminder_keeps_the_timer]) as engine:
        await engine.signal("r", "shipped")
        reason = await _stuck_reason(engine, "r")
        history = await engine.history("r")
    assert "timer cancel command #1 was recorded as cancel of timer 'named:nag'" in reason, reason
    assert "now requests the workflow to return" in reason, reason
    assert not any(e.is_terminal for e in history)


@aion.workflow(name="waiter")
async def waiter_v1(ctx: aion.WorkflowContext) -> str:
    try:
        return str(await ctx.wait_signal("go", timeout=86400))
    except aion.Timeout:
        return "late"


@aion.workflow(name="waiter")
async def waiter_without_timeout(ctx: aion.WorkflowContext) -> str:
    return str(await ctx.wait_signal("go"))


async def test_a_signal_wait_that_lost_its_timeout_is_non_determinism(store_url: Callable[[], str]) -> None:
    url = store_url()
    async with aion.open_engine(url, workflows=[waiter_v1]) as engine:
        await engine.start(waiter_v1, workflow_id="w")
        await _history_until(engine, "w", lambda h: "TimerStarted" in _types(h))
    async with aion.open_engine(url, workflows=[waiter_without_timeout]) as engine:
        await engine.signal("w", "go", "now")
        reason = await _stuck_reason(engine, "w")
        history = await engine.history("w")
    assert "timer command #0 was recorded as timer 'anonymous:0'" in reason, reason
    assert not any(e.is_terminal for e in history)


@aion.workflow
async def kid(ctx: aion.WorkflowContext) -> str:
    await ctx.wait_signal("never")
    return "kid"


@aion.workflow(name="parent")
async def parent_v1(ctx: aion.WorkflowContext) -> str:
    await ctx.sleep(86400)
    return "parent"


@aion.workflow(name="parent")
async def parent_starts_a_child_first(ctx: aion.WorkflowContext) -> str:
    ctx.start_child(kid)
    await ctx.sleep(86400)
    return "parent"


async def test_a_child_inserted_before_a_recorded_timer_is_non_determinism_and_never_starts(
    store_url: Callable[[], str],
) -> None:
    url = store_url()
    async with aion.open_engine(url, workflows=[parent_v1]) as engine:
        await engine.start(parent_v1, workflow_id="p")
        recorded = await _history_until(engine, "p", lambda h: "TimerStarted" in _types(h))
    async with aion.open_engine(url, workflows=[parent_starts_a_child_first, kid], config=EAGER) as engine:
        reason = await _stuck_reason(engine, "p")
        history = await engine.history("p")
        children = await engine.list(workflow_type="kid")
    assert "timer command #0 was recorded as timer 'anonymous:0'" in reason, reason
    assert "now requests child 'kid'" in reason, reason
    assert history == recorded
    assert children == [], "the inserted child is never started"


@aion.workflow(name="gated")
async def gated_v1(ctx: aion.WorkflowContext) -> str:
    ctx.start_timer("reminder", 86400)
    await ctx.wait_signal("go")
    return "done"


@aion.workflow(name="gated")
async def gated_v2(ctx: aion.WorkflowContext) -> str:
    if await ctx.patched("charge-first"):
        await ctx.run(charge, ctx.workflow_id)
    ctx.start_timer("reminder", 86400)
    await ctx.wait_signal("go")
    return "done"


async def test_patched_takes_the_old_path_where_a_timer_was_recorded_and_the_new_one_live(
    store_url: Callable[[], str],
) -> None:
    url = store_url()
    async with aion.open_engine(url, workflows=[gated_v1]) as engine:
        await engine.start(gated_v1, workflow_id="old")
        await _history_until(engine, "old", lambda h: "TimerStarted" in _types(h))
    async with aion.open_engine(url, workflows=[gated_v2], activities=[charge]) as engine:
        await engine.start(gated_v2, workflow_id="new")
        with trio.fail_after(LIMIT):
            for workflow_id in ("old", "new"):
                await engine.signal(workflow_id, "go")
                assert await engine.result(workflow_id) == "done"
        old_history = await engine.history("old")
        new_history = await engine.history("new")
    assert CHARGED == ["new"], "the old run kept its old path; the new one charged"
    assert not any(isinstance(e.body, ev.MarkerRecorded) for e in old_history)
    assert [e.body.name for e in new_history if isinstance(e.body, ev.MarkerRecorded)] == [
        "patch:charge-first"
    ]


# -- arguments (a digest recorded with the command) -----------------------------------

STEPS: list[int] = []


@aion.activity
async def step(n: int) -> int:
    STEPS.append(n)
    return n * 10


@aion.workflow(name="stepper")
async def stepper_v1(ctx: aion.WorkflowContext) -> int:
    result = int(await ctx.run(step, 1))
    await ctx.wait_signal("go")
    return result


@aion.workflow(name="stepper")
async def stepper_v2(ctx: aion.WorkflowContext) -> int:
    result = int(await ctx.run(step, 2))  # the argument changed
    await ctx.wait_signal("go")
    return result


async def _park_stepper(url: str) -> list[aion.Event]:
    STEPS.clear()
    async with aion.open_engine(url, workflows=[stepper_v1], activities=[step]) as engine:
        await engine.start(stepper_v1, workflow_id="st")
        history = await _history_until(engine, "st", lambda h: "ActivityCompleted" in _types(h))
    assert STEPS == [1]
    return history


async def test_a_changed_activity_argument_is_non_determinism_naming_the_argument(
    store_url: Callable[[], str],
) -> None:
    url = store_url()
    recorded = await _park_stepper(url)
    scheduled = next(e.body for e in recorded if isinstance(e.body, ev.ActivityScheduled))
    assert scheduled.input_digest is not None, "control: the digest is recorded with the schedule"
    async with aion.open_engine(url, workflows=[stepper_v2], activities=[step]) as engine:
        await engine.signal("st", "go")
        reason = await _stuck_reason(engine, "st")
        history = await engine.history("st")
    assert "activity command #0 was recorded as activity 'step'" in reason, reason
    assert "now requests activity 'step' with other arguments (argument 0 changed)" in reason, reason
    assert STEPS == [1], "step(2) never ran"
    assert not any(e.is_terminal for e in history), "the result of step(1) was not handed to step(2)"


@aion.activity
async def other_step(n: int) -> int:
    STEPS.append(-n)
    return 10 * n


@aion.workflow(name="stepper")
async def stepper_calls_another_activity(ctx: aion.WorkflowContext) -> int:
    result = int(await ctx.run(other_step, 1))  # same argument text, another activity
    await ctx.wait_signal("go")
    return result


async def test_another_activity_with_the_same_arguments_is_non_determinism(
    store_url: Callable[[], str],
) -> None:
    """Replay matches a recorded schedule by its argument text without a digest: the
    activity's name must still be the recorded one."""
    url = store_url()
    recorded = await _park_stepper(url)
    async with aion.open_engine(
        url, workflows=[stepper_calls_another_activity], activities=[step, other_step]
    ) as engine:
        await engine.signal("st", "go")
        reason = await _stuck_reason(engine, "st")
        history = await engine.history("st")
    assert "activity command #0 was recorded as activity 'step'" in reason, reason
    assert "now requests activity 'other_step'" in reason, reason
    assert STEPS == [1], "other_step(1) never ran"
    assert not any(e.is_terminal for e in history), "the result of step(1) was not handed to other_step(1)"
    assert len(history) == len(recorded) + 1, "only the signal was recorded"


async def test_a_history_recorded_without_digests_still_replays(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Histories written before the digest existed carry none: replay does not compare arguments.

    (The replays run on memory stores: a stuck one is reported after an hour of mock time.)"""
    url = f"memory://nd-{uuid.uuid4().hex}"
    recorded = await _park_stepper(url)
    async with aion.open_engine(url, workflows=[stepper_v1], activities=[step]) as engine:
        await engine.signal("st", "go")
        with trio.fail_after(LIMIT):
            assert await engine.result("st") == 10
        finished = await engine.history("st")
    assert len(finished) > len(recorded)
    old_style = [
        attrs.evolve(e, body=attrs.evolve(e.body, input_digest=None))
        if isinstance(e.body, (ev.ActivityScheduled, ev.ChildWorkflowStarted))
        else e
        for e in finished
    ]
    assert old_style != finished, "control: the digests were taken out"
    await assert_replays_cleanly(old_style, workflows=[stepper_v1], activities=[step])
    # Without a recorded digest a changed argument is not noticed (nothing to compare).
    await assert_replays_cleanly(old_style, workflows=[stepper_v2], activities=[step])
    with pytest.raises(AssertionError, match="other arguments"):
        await assert_replays_cleanly(finished, workflows=[stepper_v2], activities=[step])


@aion.workflow(name="family")
async def family_v1(ctx: aion.WorkflowContext) -> str:
    ctx.start_child(kid, workflow_id="kid-1")
    await ctx.wait_signal("go")
    return "family"


async def test_a_changed_child_input_is_non_determinism(store_url: Callable[[], str]) -> None:
    url = store_url()

    @aion.workflow(name="kid")
    async def kid_with_input(ctx: aion.WorkflowContext, name: str = "") -> str:
        await ctx.wait_signal("never")
        return name

    @aion.workflow(name="family")
    async def family_v2(ctx: aion.WorkflowContext) -> str:
        ctx.start_child(kid_with_input, "ann", workflow_id="kid-1")  # input added
        await ctx.wait_signal("go")
        return "family"

    async with aion.open_engine(url, workflows=[family_v1, kid]) as engine:
        await engine.start(family_v1, workflow_id="f")
        await _history_until(engine, "f", lambda h: "ChildWorkflowStarted" in _types(h))
    async with aion.open_engine(url, workflows=[family_v2, kid_with_input]) as engine:
        reason = await _stuck_reason(engine, "f")
    assert "child workflow command #0 was recorded as child 'kid' with id 'kid-1'" in reason, reason
    assert "with other arguments (1 argument(s) where 0 were recorded)" in reason, reason


# -- a finished history: nothing past its recorded end -----------------------------------


@aion.workflow(name="once")
async def once_v1(ctx: aion.WorkflowContext) -> int:
    return int(await ctx.run(step, 1))


@aion.workflow(name="once")
async def once_does_more(ctx: aion.WorkflowContext) -> int:
    await ctx.run(step, 1)
    return int(await ctx.run(step, 2))  # added after the recorded end


@aion.workflow(name="once")
async def once_fails_now(ctx: aion.WorkflowContext) -> int:
    await ctx.run(step, 1)
    raise RuntimeError("the new code fails where the old one returned")


@aion.workflow(name="once")
async def once_waits_now(ctx: aion.WorkflowContext) -> int:
    await ctx.run(step, 1)
    return int(await ctx.wait_signal("never-sent"))


async def test_replaying_a_finished_history_reports_code_that_goes_past_its_end(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with aion.open_engine(
        f"memory://nd-{uuid.uuid4().hex}", workflows=[once_v1], activities=[step]
    ) as e:
        await (await e.start(once_v1, workflow_id="once")).result()
        history = await e.history("once")
    clean = await replay(history, workflows=[once_v1], activities=[step])
    assert (clean.stuck_reason, clean.refused, clean.completed) == (None, [], True), "control"
    for changed, requested in [
        (once_does_more, "now requests activity 'step'"),
        (once_fails_now, "now requests the workflow to fail (RuntimeError)"),
        (once_waits_now, "now requests a wait that history does not resolve"),
    ]:
        outcome = await replay(history, workflows=[changed], activities=[step])
        reason = outcome.stuck_reason or ""
        assert "run end command #1 was recorded as the run's end (WorkflowCompleted" in reason, reason
        assert requested in reason, reason
        assert outcome.refused == []
        assert outcome.history == history


# -- the one classification --------------------------------------------------------


AT = datetime(2026, 1, 2, tzinfo=timezone.utc)
RUN = "3f1c2a9e-5b7d-4c1e-8f20-6a9b0c1d2e3f"
ERROR = ev.ActivityError(cause=ev.FailureCause.RETRYABLE, type="E", message="m")


@pytest.mark.parametrize(
    ("body", "command"),
    [
        (ev.ActivityScheduled(activity_id=0, activity_type="a", input=aion.Payload.of([])), "activity 'a'"),
        (ev.TimerStarted(timer_id="anonymous:0", fire_at=AT), "timer 'anonymous:0'"),
        (ev.TimerStarted(timer_id="named:x", fire_at=AT), "timer 'named:x'"),
        (ev.TimerStarted(timer_id="scope:0", fire_at=AT), "timer 'scope:0'"),
        (ev.TimerStarted(timer_id=f"deadline:{RUN}", fire_at=AT), None),
        (
            ev.TimerCancelled(timer_id="named:x", cause=ev.TimerCancelCause.WORKFLOW_INTENT),
            "cancel of timer 'named:x'",
        ),
        (ev.TimerCancelled(timer_id="named:x", cause=ev.TimerCancelCause.CANCEL_TEARDOWN), None),
        (ev.TimerCancelled(timer_id=f"deadline:{RUN}", cause=ev.TimerCancelCause.WORKFLOW_INTENT), None),
        (
            ev.ChildWorkflowStarted(child_workflow_id="c", workflow_type="k", input=aion.Payload.of([])),
            "child 'k' with id 'c'",
        ),
        (ev.MarkerRecorded(name="patch:p", value=aion.Payload.of(True)), "patch 'p'"),
        (ev.MarkerRecorded(name="child:0", value=aion.Payload.of({})), None),
        (ev.SearchAttributesUpserted(attributes={"k": 1}), "search-attribute upsert"),
        (ev.ActivityStarted(activity_id=0, attempt=1), None),
        (ev.ActivityCompleted(activity_id=0, result=aion.Payload.of(1), attempt=1), None),
        (ev.ActivityFailed(activity_id=0, error=ERROR, attempt=1, final=False), None),
        (ev.ActivityFailed(activity_id=0, error=ERROR, attempt=1, final=True), None),
        (ev.ActivityCancelled(activity_id=0, attempt=1), None),
        (ev.ActivityCancelled(activity_id=3, attempt=1, by_workflow=True), "cancel of activity:3"),
        (ev.MarkerRecorded(name="cancel-child:2", value=aion.Payload.of(True)), "cancel of child #2"),
        (ev.TimerFired(timer_id="anonymous:0"), None),
        (ev.SignalReceived(name="s", payload=aion.Payload.of(1)), None),
        (ev.WorkflowCancelRequested(reason="r"), None),
        (ev.WorkflowReopened(run_id=RUN, reopened_activity_ids=()), None),
        (ev.WorkflowCompleted(result=aion.Payload.of(1)), None),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, ev.EventBody) else str(value),
)
def test_events_are_classified_as_commands_in_one_place(body: ev.EventBody, command: Any) -> None:
    key = command_key(body)
    assert (key.describe() if key is not None else None) == command


# -- the same divergences under lazy recovery: caught when the sleeping run wakes ---------
#
# The eager scenarios above catch a changed sleeper at open.  With lazy recovery (the
# default) a run parked on its timer is left evicted at open, unreplayed; the change is
# caught when the timer wakes it, and reported exactly as at open: the same stuck reason,
# a RunStuck observer event, the same error logged, nothing recorded and nothing executed.

LAZY_SCENARIOS = {
    "an inserted activity": (
        [sleeper_charges_first],
        "now requests activity 'charge'",
    ),
    "a deleted sleep": ([sleeper_without_the_sleep], "now requests the workflow to return"),
    "an inserted child": ([parent_starts_a_child_first, kid], "now requests child 'kid'"),
}


async def _park(url: str, scenario: str) -> list[aion.Event]:
    if scenario != "an inserted child":
        return await _park_sleeper(url)
    async with aion.open_engine(url, workflows=[parent_v1]) as engine:
        await engine.start(parent_v1, workflow_id="s")
        return await _history_until(engine, "s", lambda h: _types(h)[-1:] == ["TimerStarted"])


async def _diverged_report(
    url: str, scenario: str, config: aion.EngineConfig, clock: trio.testing.MockClock, caplog: Any
) -> tuple[str, list[aion.RunStuck], list[str], list[aion.Event], list[str]]:
    """Open ``scenario``'s changed code on its parked run, wake the run (its day-long timer is
    due), and return what reported the divergence: the stuck reason, the observer events, the
    error logs; then the history and the kids started."""
    workflows, _ = LAZY_SCENARIOS[scenario]
    seen: list[aion.ObserverEvent] = []
    caplog.clear()
    async with aion.open_engine(
        url, workflows=workflows, activities=[charge], config=config, observers=[seen.append]
    ) as engine:
        if config.lazy_recovery:
            # Open returned without replaying the sleeper: nothing is noticed yet.
            description = await engine.describe("s")
            assert (description.stuck_reason, description.residency) == (None, "evicted")
            assert not [e for e in seen if isinstance(e, aion.RunStuck)]
        clock.jump(86400 + 1)  # the sleeper's timer is due: it wakes
        reason = await _stuck_reason(engine, "s")
        history = await engine.history("s")
        kids = [row.workflow_id for row in await engine.list(workflow_type="kid")]
    stuck = [e for e in seen if isinstance(e, aion.RunStuck)]
    logged = [
        r.getMessage()
        for r in caplog.records
        if r.levelname == "ERROR" and getattr(r, "workflow_id", None) == "s"
    ]
    return reason, stuck, logged, history, kids


@pytest.mark.parametrize("scenario", list(LAZY_SCENARIOS))
async def test_lazy_recovery_catches_a_changed_sleeping_workflow_when_it_wakes_as_eager_does_at_open(
    tmp_path: Any, mock_clock: trio.testing.MockClock, caplog: Any, scenario: str
) -> None:
    mock_clock.rate = 1.0  # real time passes; jump() makes the day-long timer due
    _, expected = LAZY_SCENARIOS[scenario]
    reports = {}
    for lazy in (False, True):
        url = f"sqlite:///{tmp_path}/{'lazy' if lazy else 'eager'}.db"
        recorded = await _park(url, scenario)
        reason, stuck, logged, history, kids = await _diverged_report(
            url, scenario, aion.EngineConfig(lazy_recovery=lazy), mock_clock, caplog
        )
        assert "timer command #0 was recorded as timer 'anonymous:0'" in reason, reason
        assert expected in reason, reason
        assert [(e.workflow_id, e.workflow_type, e.reason) for e in stuck] == [
            ("s", "parent" if scenario == "an inserted child" else "sleeper", reason)
        ]
        run_id = recorded[0].body.run_id  # type: ignore[union-attr]
        assert logged == [f"workflow 's' run {run_id}: workflow run is stuck and stays Running: {reason}"]
        assert history[: len(recorded)] == recorded
        assert _types(history)[len(recorded) :] in ([], ["TimerFired"]), "nothing of the new code recorded"
        assert CHARGED == [], "the inserted activity is not executed"
        assert kids == [], "the inserted child is not started"
        reports[lazy] = reason.replace(run_id, "RUN")
    assert reports[True] == reports[False], "the same divergence, reported the same way"


async def test_lazy_recovery_marks_a_sleeper_of_an_unregistered_type_stuck_at_open(
    store_url: Callable[[], str],
) -> None:
    """What needs no replay to be found is found at open, lazy or not: a run whose workflow
    type the engine lacks is marked stuck by the startup sweep, not left evicted."""
    url = store_url()
    recorded = await _park_sleeper(url)
    seen: list[aion.ObserverEvent] = []
    async with aion.open_engine(url, workflows=[parent_v1], observers=[seen.append]) as engine:
        assert engine.statistics().evicted_runs == 0
        description = await engine.describe("s")
        history = await engine.history("s")
    assert description.stuck_reason is not None
    assert description.stuck_reason.startswith("workflow type 'sleeper' is not registered with this engine")
    assert [(e.workflow_id, e.reason) for e in seen if isinstance(e, aion.RunStuck)] == [
        ("s", description.stuck_reason)
    ]
    assert history == recorded
