"""Signal handlers and ``ctx.wait_condition``: state set by signals, waited for replay-safely.

Scenarios carried over from Temporal's ``hello_signal`` sample and its SDK's
wait-condition tests: a workflow registers signal handlers that update its
state and waits with ``ctx.wait_condition`` until that state is what it needs,
optionally with a durable timeout.  Signals are handed to their handlers in
recorded order, each one before the await whose resolution was recorded after
it -- so a replay of the history takes the branch the live run took, which
the replay tests check against histories where the signal came before and
after an activity's result.  Time is ``MockClock(autojump_threshold=0)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import trio
import trio.testing
from _replay import assert_replays_cleanly

import aion_trio as aion

LIMIT = 3600  # mock seconds: every wait below is bounded by this


def _types(history: Sequence[aion.Event]) -> list[str]:
    return [type(e.body).__name__ for e in history]


# -- hello_signal ----------------------------------------------------------------------


@aion.workflow
async def greetings(ctx: aion.WorkflowContext) -> list[str]:
    pending: list[str] = []
    done = False

    @ctx.signal_handler
    def submit_greeting(name: str) -> None:
        pending.append(name)

    @ctx.signal_handler("exit")
    def leave(_: Any) -> None:
        nonlocal done
        done = True

    said: list[str] = []
    while True:
        await ctx.wait_condition(lambda: bool(pending) or done)
        while pending:
            said.append(f"Hello, {pending.pop(0)}")
        if done:
            return said


async def test_signal_handlers_set_state_that_wait_condition_waits_for(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    async with aion.open_engine(store_url(), workflows=[greetings]) as engine:
        run = await engine.start(greetings, workflow_id="g")
        for name in ("user1", "user2", "user3"):
            await engine.signal("g", "submit_greeting", name)
        await engine.signal("g", "exit")
        with trio.fail_after(LIMIT):
            assert await run.result() == ["Hello, user1", "Hello, user2", "Hello, user3"]
        history = await engine.history("g")
    assert _types(history).count("SignalReceived") == 4
    assert "TimerStarted" not in _types(history), "no timeout: nothing but the signals is recorded"
    await assert_replays_cleanly(history, workflows=[greetings])


async def test_a_restart_mid_wait_redelivers_the_recorded_signals_and_records_nothing_twice(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    url = store_url()
    async with aion.open_engine(url, workflows=[greetings]) as engine:
        await engine.start(greetings, workflow_id="g")
        await engine.signal("g", "submit_greeting", "before")
        await trio.testing.wait_all_tasks_blocked()
        before = await engine.history("g")
    async with aion.open_engine(url, workflows=[greetings]) as engine:
        await engine.signal("g", "submit_greeting", "after")
        await engine.signal("g", "exit")
        with trio.fail_after(LIMIT):
            assert await engine.result("g") == ["Hello, before", "Hello, after"]
        history = await engine.history("g")
    assert history[: len(before)] == before
    assert _types(history[len(before) :]) == ["SignalReceived", "SignalReceived", "WorkflowCompleted"]


# -- replay takes the live run's branch ------------------------------------------------------


@aion.activity
async def slow_check(order: str) -> str:
    await trio.sleep(10)
    return f"checked {order}"


@aion.activity
async def ship(order: str) -> str:
    return f"shipped {order}"


@aion.activity
async def hold(order: str) -> str:
    return f"held {order}"


@aion.workflow
async def approval(ctx: aion.WorkflowContext, order: str) -> list[str]:
    approved = False

    @ctx.signal_handler
    def approve(_: Any) -> None:
        nonlocal approved
        approved = True

    steps = [await ctx.run(slow_check, order)]
    # The branch depends on whether the approval was recorded before the check's result.
    steps.append(await ctx.run(ship if approved else hold, order))
    await ctx.wait_condition(lambda: approved)
    steps.append("approved")
    return steps


@pytest.mark.parametrize(
    ("signal_at", "expected"),
    [(5, ["checked o", "shipped o", "approved"]), (20, ["checked o", "held o", "approved"])],
)
async def test_replay_delivers_each_signal_at_the_await_the_live_run_did(
    autojump_clock: trio.testing.MockClock, signal_at: float, expected: list[str]
) -> None:
    workflows, activities = [approval], [slow_check, ship, hold]
    async with aion.open_engine("memory://", workflows=workflows, activities=activities) as engine:
        run = await engine.start(approval, "o", workflow_id="a")
        await trio.sleep(signal_at)
        await engine.signal("a", "approve")
        with trio.fail_after(LIMIT):
            assert await run.result() == expected
        history = await engine.history("a")
    signal = next(e.seq for e in history if isinstance(e.body, aion.SignalReceived))
    checked = next(e.seq for e in history if isinstance(e.body, aion.ActivityCompleted))
    assert (signal < checked) == (signal_at < 10), "control: the recorded order"
    # A replay that handed the approval over as soon as it is in history would ship where
    # the live run held: another activity at that command, non-determinism.
    await assert_replays_cleanly(history, workflows=workflows, activities=activities)


# -- timeouts ------------------------------------------------------------------------------


@aion.workflow
async def waits_for_go(ctx: aion.WorkflowContext, seconds: float) -> str:
    go: list[Any] = []
    ctx.set_signal_handler("go", go.append)
    try:
        await ctx.wait_condition(lambda: bool(go), timeout=seconds)
    except aion.Timeout:
        return f"timed out at {ctx.now().isoformat()}"
    return f"go {go[0]}"


async def test_wait_condition_times_out_on_a_durable_timer(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    async with aion.open_engine(store_url(), workflows=[waits_for_go]) as engine:
        run = await engine.start(waits_for_go, 60, workflow_id="t")
        with trio.fail_after(LIMIT):
            result = await run.result()
        history = await engine.history("t")
    started = history[0].recorded_at
    fired = next(e for e in history if isinstance(e.body, aion.TimerFired))
    assert result == f"timed out at {fired.recorded_at.isoformat()}"
    assert (fired.recorded_at - started).total_seconds() == pytest.approx(60, abs=1)
    assert _types(history) == ["WorkflowStarted", "TimerStarted", "TimerFired", "WorkflowCompleted"]
    await assert_replays_cleanly(history, workflows=[waits_for_go])


async def test_a_condition_met_in_time_cancels_its_timer(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    async with aion.open_engine(store_url(), workflows=[waits_for_go]) as engine:
        run = await engine.start(waits_for_go, 60, workflow_id="t")
        await trio.sleep(30)
        await engine.signal("t", "go", "now")
        with trio.fail_after(LIMIT):
            assert await run.result() == "go now"
        history = await engine.history("t")
    assert _types(history) == [
        "WorkflowStarted",
        "TimerStarted",
        "SignalReceived",
        "TimerCancelled",
        "WorkflowCompleted",
    ]
    await assert_replays_cleanly(history, workflows=[waits_for_go])


async def test_the_timeout_survives_a_restart(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    url = store_url()
    async with aion.open_engine(url, workflows=[waits_for_go]) as engine:
        await engine.start(waits_for_go, 3600, workflow_id="t")
        await trio.sleep(600)
    async with aion.open_engine(url, workflows=[waits_for_go]) as engine:
        with trio.fail_after(LIMIT):
            result = await engine.result("t")
        history = await engine.history("t")
    assert result.startswith("timed out")
    assert (history[-2].recorded_at - history[0].recorded_at).total_seconds() == pytest.approx(3600, abs=1)


@aion.workflow
async def already_true(ctx: aion.WorkflowContext) -> str:
    await ctx.wait_condition(lambda: True, timeout=60)
    return "at once"


async def test_a_condition_already_true_returns_at_once_and_records_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with aion.open_engine("memory://", workflows=[already_true]) as engine:
        run = await engine.start(already_true, workflow_id="n")
        with trio.fail_after(LIMIT):
            assert await run.result() == "at once"
        assert _types(await engine.history("n")) == ["WorkflowStarted", "WorkflowCompleted"]


# -- handlers are plain functions -----------------------------------------------------------


@aion.activity
async def noop() -> None:
    return None


@aion.workflow
async def handler_runs_a_command(ctx: aion.WorkflowContext) -> str:
    ctx.set_signal_handler("bad", lambda _: ctx.start(noop))
    try:
        await ctx.wait_condition(lambda: False, timeout=60)
    except aion.WorkflowCommandError as exc:
        return str(exc)
    return "no error"


async def test_a_command_from_a_signal_handler_is_refused_at_the_await(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with aion.open_engine("memory://", workflows=[handler_runs_a_command], activities=[noop]) as engine:
        run = await engine.start(handler_runs_a_command, workflow_id="h")
        await engine.signal("h", "bad")
        with trio.fail_after(LIMIT):
            message = await run.result()
        history = await engine.history("h")
    assert "ctx.start() was called from signal handler 'bad'" in message, message
    assert "ActivityScheduled" not in _types(history)


@aion.workflow
async def late_handler(ctx: aion.WorkflowContext) -> list[Any]:
    await ctx.wait_signal("ready")
    seen: list[Any] = []
    ctx.set_signal_handler("item", seen.append)
    await ctx.wait_condition(lambda: len(seen) >= 2)
    return seen


async def test_signals_recorded_before_the_handler_was_registered_are_delivered(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with aion.open_engine("memory://", workflows=[late_handler]) as engine:
        run = await engine.start(late_handler, workflow_id="l")
        await engine.signal("l", "item", 1)
        await engine.signal("l", "ready")
        await trio.testing.wait_all_tasks_blocked()
        await engine.signal("l", "item", 2)
        with trio.fail_after(LIMIT):
            assert await run.result() == [1, 2]
        history = await engine.history("l")
    await assert_replays_cleanly(history, workflows=[late_handler])
