"""Async activity completion: an activity calls ``aion.complete_async()`` and whoever holds its
task token completes, fails or heartbeats the attempt later.

The scenario of Temporal's ``hello_async_activity_completion`` sample, carried over: the
activity hands its token to something else (here a task of the test) and returns saying it
completes later; that task completes it and the workflow gets the result.  Around it: the
attempt's timeouts still apply (the attempt expires and is retried), a token of an attempt
that is over is refused and records nothing, a failure by token is retried per the policy, a
second completion is idempotent, and an engine restarted while the attempt waits waits again
without running the activity's code a second time.  Every test runs on the store
``AION_TRIO_TEST_STORE`` names; the crash and command-line tests are in
``test_async_completion_procs.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import trio
import trio.testing

import aion_trio as aion

LIMIT = 3600  # mock seconds: every wait below is bounded by this
WF = "approval"
CALLS: list[tuple[str, int]] = []
TOKENS: list[str] = []
DETAILS: list[Any] = []
_arrived = trio.Event()


def _reset() -> None:
    global _arrived
    CALLS.clear()
    TOKENS.clear()
    DETAILS.clear()
    _arrived = trio.Event()


def _hand_over() -> None:
    info = aion.activity_info()
    CALLS.append((info.activity_type, info.attempt))
    DETAILS.append(info.heartbeat_details)
    TOKENS.append(info.task_token)
    try:
        trio.lowlevel.current_task()
    except RuntimeError:  # a plain def activity: in a worker thread
        trio.from_thread.run_sync(_announce)
    else:
        _announce()
    aion.complete_async()


def _announce() -> None:
    global _arrived
    arrived, _arrived = _arrived, trio.Event()
    arrived.set()


async def _next_token(engine: aion.Engine, workflow_id: str, count: int) -> str:
    """The token of the ``count``-th attempt that went over to async completion, once its
    async-completion marker is recorded."""
    with trio.fail_after(LIMIT):
        while len(TOKENS) < count:
            await _arrived.wait()
        while not any(
            isinstance(e.body, aion.MarkerRecorded)
            and e.body.name.startswith("async-completion:")
            and e.body.value.value() == {"attempt": count}
            for e in await engine.history(workflow_id)
        ):
            await trio.testing.wait_all_tasks_blocked()
    return TOKENS[count - 1]


@aion.activity
async def ask() -> Any:
    _hand_over()
    return "never"


@aion.activity
def ask_in_a_thread() -> Any:
    _hand_over()
    return "never"


@aion.activity(timeout=10, retry=aion.RetryPolicy(max_attempts=2, backoff=aion.Fixed(1)))
async def ask_with_timeout() -> Any:
    _hand_over()
    return "never"


@aion.activity(heartbeat_timeout=10, retry=aion.RetryPolicy(max_attempts=2, backoff=aion.Fixed(1)))
async def ask_with_heartbeats() -> Any:
    _hand_over()
    return "never"


@aion.activity(retry=aion.RetryPolicy(max_attempts=2, backoff=aion.Fixed(1)))
async def ask_twice() -> Any:
    _hand_over()
    return "never"


@aion.workflow
async def asking(ctx: aion.WorkflowContext, name: str) -> Any:
    try:
        return await ctx.run(name)
    except aion.ActivityFailure as exc:
        return f"failed: {exc}"


ACTIVITIES = [ask, ask_in_a_thread, ask_with_timeout, ask_with_heartbeats, ask_twice]


def _bodies(history: Sequence[aion.Event], *types: type[Any]) -> list[Any]:
    return [e.body for e in history if isinstance(e.body, types)]


@pytest.mark.parametrize("activity", ["ask", "ask_in_a_thread"])
async def test_another_task_completes_the_attempt_with_its_token(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock, activity: str
) -> None:
    _reset()
    async with aion.open_engine(store_url(), workflows=[asking], activities=ACTIVITIES) as engine:
        run = await engine.start(asking, activity, workflow_id=WF)

        async def complete_later() -> None:
            token = await _next_token(engine, WF, 1)
            await trio.sleep(5)  # the approval takes a while; the workflow waits
            await engine.complete_activity(token, {"approved": True})

        async with trio.open_nursery() as nursery:
            nursery.start_soon(complete_later)
            with trio.fail_after(LIMIT):
                assert await run.result() == {"approved": True}
        history = await engine.history(WF)
    assert [(activity, 1)] == CALLS, "the activity's code ran once"
    [marker] = [b for b in _bodies(history, aion.MarkerRecorded) if b.name.startswith("async-completion:")]
    assert marker.value.value() == {"attempt": 1}
    [completed] = _bodies(history, aion.ActivityCompleted)
    assert (completed.attempt, completed.result.value()) == (1, {"approved": True})
    assert not _bodies(history, aion.ActivityFailed)


async def test_a_token_of_an_expired_attempt_is_refused_and_records_nothing(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    _reset()
    async with aion.open_engine(store_url(), workflows=[asking], activities=ACTIVITIES) as engine:
        run = await engine.start(asking, "ask_with_timeout", workflow_id=WF)
        first = await _next_token(engine, WF, 1)
        # Nobody completes attempt 1: its timeout expires it and the policy retries.
        second = await _next_token(engine, WF, 2)
        assert first != second
        history = await engine.history(WF)
        [expired] = _bodies(history, aion.ActivityFailed)
        assert (expired.attempt, expired.error.type, expired.final) == (1, "ActivityTimeout", False)
        with pytest.raises(aion.ActivityAttemptClosed, match="not open") as refused:
            await engine.complete_activity(first, "late")
        assert (refused.value.activity_id, refused.value.attempt) == (0, 1)
        with pytest.raises(aion.ActivityAttemptClosed):
            await engine.heartbeat_activity(first, "late")
        assert await engine.history(WF) == history, "a refused token records nothing"
        await engine.complete_activity(second, "in time")
        with trio.fail_after(LIMIT):
            assert await run.result() == "in time"
    assert CALLS == [("ask_with_timeout", 1), ("ask_with_timeout", 2)]


async def test_heartbeats_by_token_keep_the_attempt_alive_and_their_details_reach_the_next_attempt(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    _reset()
    async with aion.open_engine(store_url(), workflows=[asking], activities=ACTIVITIES) as engine:
        run = await engine.start(asking, "ask_with_heartbeats", workflow_id=WF)
        first = await _next_token(engine, WF, 1)
        began = trio.current_time()
        for progress in (1, 2, 3):
            await trio.sleep(7)  # each within the 10 s heartbeat timeout
            await engine.heartbeat_activity(first, {"done": progress})
        # Then silence: the heartbeat timeout expires the attempt, and the policy retries.
        second = await _next_token(engine, WF, 2)
        assert trio.current_time() - began >= 21 + 10, "the beats kept attempt 1 alive past its timeout"
        assert DETAILS == [None, {"done": 3}], "the next attempt resumes from the last details"
        history = await engine.history(WF)
        [expired] = _bodies(history, aion.ActivityFailed)
        assert (expired.attempt, expired.error.type) == (1, "HeartbeatTimeout")
        await engine.complete_activity(second, "done")
        with trio.fail_after(LIMIT):
            assert await run.result() == "done"


async def test_a_failure_by_token_is_retried_per_the_policy_then_fails_the_activity(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    _reset()
    async with aion.open_engine(store_url(), workflows=[asking], activities=ACTIVITIES) as engine:
        run = await engine.start(asking, "ask_twice", workflow_id=WF)
        await engine.fail_activity(await _next_token(engine, WF, 1), RuntimeError("declined"))
        second = await _next_token(engine, WF, 2)  # the policy ran the activity's code again
        await engine.fail_activity(second, "declined again")
        with trio.fail_after(LIMIT):
            outcome = await run.result()
        assert outcome.startswith("failed:")
        assert "declined again" in outcome
        await engine.fail_activity(second, "declined again")  # a retried call: quiet
        with pytest.raises(aion.ActivityAttemptClosed, match="failed"):
            await engine.complete_activity(second, "too late")
        history = await engine.history(WF)
    failures = _bodies(history, aion.ActivityFailed)
    assert [(f.attempt, f.final, f.error.type) for f in failures] == [
        (1, False, "RuntimeError"),
        (2, True, "ActivityFailed"),
    ]
    assert CALLS == [("ask_twice", 1), ("ask_twice", 2)]


async def test_a_non_retryable_failure_by_token_is_final_at_once(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    _reset()
    async with aion.open_engine(store_url(), workflows=[asking], activities=ACTIVITIES) as engine:
        run = await engine.start(asking, "ask_twice", workflow_id=WF)
        await engine.fail_activity(await _next_token(engine, WF, 1), aion.TerminalError("no such order"))
        with trio.fail_after(LIMIT):
            assert "no such order" in await run.result()
    assert CALLS == [("ask_twice", 1)]


async def test_a_second_completion_is_quiet_and_bad_tokens_are_refused(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    _reset()
    async with aion.open_engine(store_url(), workflows=[asking], activities=ACTIVITIES) as engine:
        run = await engine.start(asking, "ask", workflow_id=WF)
        token = await _next_token(engine, WF, 1)
        with pytest.raises(aion.InvalidActivityToken):
            await engine.complete_activity("not-a-token", 1)
        with pytest.raises(aion.InvalidActivityToken):
            await engine.complete_activity(token[:-4], 1)
        await engine.complete_activity(token, 1)
        with trio.fail_after(LIMIT):
            assert await run.result() == 1
        history = await engine.history(WF)
        await engine.complete_activity(token, 1)  # a retried call: quiet, nothing recorded
        with pytest.raises(aion.ActivityAttemptClosed, match="completed"):
            await engine.fail_activity(token, "no")
        with pytest.raises(aion.ActivityAttemptClosed):
            await engine.heartbeat_activity(token)
        assert await engine.history(WF) == history


async def test_an_engine_restarted_while_the_attempt_waits_waits_again_without_rerunning_it(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    _reset()
    url = store_url()
    async with aion.open_engine(url, workflows=[asking], activities=ACTIVITIES) as engine:
        await engine.start(asking, "ask_with_timeout", workflow_id=WF)
        token = await _next_token(engine, WF, 1)
    async with aion.open_engine(url, workflows=[asking], activities=ACTIVITIES) as engine:
        await trio.testing.wait_all_tasks_blocked()
        await engine.complete_activity(token, "after the restart")
        with trio.fail_after(LIMIT):
            assert await engine.result(WF) == "after the restart"
        history = await engine.history(WF)
    assert CALLS == [("ask_with_timeout", 1)], "the restarted engine did not run the code again"
    assert [b.attempt for b in _bodies(history, aion.ActivityCompleted)] == [1]


async def test_a_restarted_attempt_keeps_its_timeout_from_when_it_started(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    _reset()
    url = store_url()
    async with aion.open_engine(url, workflows=[asking], activities=ACTIVITIES) as engine:
        run = await engine.start(asking, "ask_with_timeout", workflow_id=WF)
        await _next_token(engine, WF, 1)
        await trio.sleep(6)
    async with aion.open_engine(url, workflows=[asking], activities=ACTIVITIES) as engine:
        reopened = trio.current_time()
        second = await _next_token(engine, WF, 2)
        assert trio.current_time() - reopened < 10, (
            "attempt 1 expired 10 s after it started, not after the restart"
        )
        await engine.complete_activity(second, "second")
        with trio.fail_after(LIMIT):
            assert await engine.result(run.workflow_id) == "second"
