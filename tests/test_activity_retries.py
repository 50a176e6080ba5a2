"""Activity retry policies, timeouts, fallback queues and the guarded retry trail.

Time is ``MockClock(autojump_threshold=0)``: a 10-minute backoff costs
milliseconds.  Scripted dispatchers stand in for workers where a test needs a
precise sequence of outcomes; real in-process activities where it needs real
cancellation.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing

import aion_trio as aion
import aion_trio.testing
from aion_trio import Exponential, Fixed, Linear, RetryPolicy
from aion_trio._activities import OutcomeKind, RecordOutcome, record_activity_event
from aion_trio._clock import TrioClock
from aion_trio._epoch import EngineEpoch
from aion_trio._recorder import Recorder

# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------


def fail(cause: aion.FailureCause, message: str, type_: str = "ConnectionError") -> aion.ActivityOutcome:
    return aion.ActivityOutcome(error=aion.ActivityError(cause=cause, type=type_, message=message))


def ok(value: Any) -> aion.ActivityOutcome:
    return aion.ActivityOutcome(result=aion.Payload.of(value))


class Scripted:
    """Answers attempts from a script; records what it saw.  ``None`` in the script blocks forever."""

    def __init__(self, script: Sequence[aion.ActivityOutcome | None]) -> None:
        self.script = list(script)
        self.seen: list[aion.ActivityRequest] = []

    async def dispatch(self, request: aion.ActivityRequest) -> aion.ActivityOutcome:
        self.seen.append(request)
        await trio.lowlevel.checkpoint()
        step = self.script.pop(0) if self.script else ok("default")
        if step is None:
            await trio.sleep_forever()
        assert step is not None
        return step

    @property
    def attempts(self) -> list[int]:
        return [r.attempt for r in self.seen]

    @property
    def queues(self) -> list[str]:
        return [r.task_queue for r in self.seen]


@aion.activity
async def charge(order: str) -> str:
    return f"charged {order}"


@aion.workflow
async def one_charge(ctx: aion.WorkflowContext, options: dict[str, Any]) -> Any:
    kwargs = dict(options)
    if "retry" in kwargs:
        kwargs["retry"] = RetryPolicy(
            max_attempts=kwargs["retry"], backoff=Fixed(600), non_retryable=kwargs.pop("non_retryable", ())
        )
    try:
        return await ctx.run(charge, "o-1", **kwargs)
    except aion.ActivityFailure as exc:
        return {"failed": exc.type, "cause": exc.error.cause.value, "message": exc.message}


def url() -> str:
    return f"memory://retries-{uuid.uuid4().hex}"


async def run_one(
    dispatcher: Any, options: dict[str, Any], *, store: str | None = None
) -> tuple[Any, list[aion.Event]]:
    async with aion.open_engine(
        store or url(), workflows=[one_charge], activities=[charge], dispatcher=dispatcher
    ) as engine:
        run = await engine.start(one_charge, options, workflow_id="w")
        result = await run.result()
        return result, await engine.history("w")


@attrs.define
class FlakyOneCharge:
    """An engine running ``one_charge`` on a memory store behind a FlakyStore (faults
    armed by the test); ``history`` is workflow ``w``'s, read once the engine closed."""

    flaky: aion.testing.FlakyStoreBundle
    engine: aion.Engine
    history: list[aion.Event] = attrs.Factory(list)


@contextlib.asynccontextmanager
async def flaky_one_charge(dispatcher: Any) -> AsyncIterator[FlakyOneCharge]:
    async with aion.open_store(url()) as inner:
        flaky = aion.testing.FlakyStoreBundle(inner)
        async with aion.open_engine(
            flaky, workflows=[one_charge], activities=[charge], dispatcher=dispatcher
        ) as engine:
            opened = FlakyOneCharge(flaky=flaky, engine=engine)
            yield opened
        opened.history = await inner.events.read_history("w")


def trail(history: Sequence[aion.Event]) -> list[tuple[str, int, bool | None]]:
    out: list[tuple[str, int, bool | None]] = []
    for e in history:
        body = e.body
        if isinstance(body, aion.ActivityStarted):
            out.append(("started", body.attempt, None))
        elif isinstance(body, aion.ActivityFailed):
            out.append(("failed", body.attempt, body.final))
        elif isinstance(body, aion.ActivityCompleted):
            out.append(("completed", body.attempt, None))
        elif isinstance(body, aion.ActivityFallbackRouted):
            out.append(
                (
                    f"hop {body.from_task_queue}->{body.to_task_queue} #{body.fallback_index}",
                    body.attempt,
                    None,
                )
            )
        elif isinstance(body, aion.ActivityAdvisoryExhausted):
            out.append(("advisory", body.attempt, None))
        elif isinstance(body, aion.ActivityCancelled):
            out.append(("cancelled", body.attempt, None))
    return out


# --------------------------------------------------------------------------
# Policies and backoffs: validated at construction
# --------------------------------------------------------------------------


def test_invalid_policies_and_backoffs_are_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="max_attempts"):
        RetryPolicy(max_attempts=0)
    with pytest.raises(ValueError, match=">= 0"):
        Fixed(-1)
    with pytest.raises(ValueError, match="at least the initial"):
        Exponential(initial=10, multiplier=2, maximum=5)
    with pytest.raises(ValueError, match="multiplier"):
        Exponential(initial=1, multiplier=0.5, maximum=5)
    with pytest.raises(ValueError, match="at least the initial"):
        Linear(initial=10, increment=1, maximum=5)
    with pytest.raises(TypeError, match="non_retryable"):
        RetryPolicy(max_attempts=2, non_retryable=[42])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="unknown activity option"):
        aion.EngineConfig(activity_defaults={"retrys": 3})
    with pytest.raises(ValueError, match="timeout"):
        aion.activity(timeout=-1)(charge.fn)


def test_backoff_ladders() -> None:
    assert [Fixed(3).delay_after(a) for a in (1, 2, 5)] == [3, 3, 3]
    assert [Exponential(initial=1, multiplier=2, maximum=5).delay_after(a) for a in (1, 2, 3, 4)] == [
        1,
        2,
        4,
        5,
    ]
    assert [Linear(initial=1, increment=2, maximum=6).delay_after(a) for a in (1, 2, 3, 4)] == [1, 3, 5, 6]
    assert Exponential(initial=1, multiplier=10, maximum=7).delay_after(10_000) == 7


# --------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------


async def test_a_retryable_failure_redispatches_with_the_incremented_recorded_attempt(
    autojump_clock: trio.testing.MockClock,
) -> None:
    dispatcher = Scripted(
        [fail(aion.FailureCause.RETRYABLE, "reset"), fail(aion.FailureCause.TIMEOUT, "slow"), ok("yes")]
    )
    result, history = await run_one(dispatcher, {"retry": 5})
    assert result == "yes"
    assert dispatcher.attempts == [1, 2, 3], "the attempt on the wire"
    assert trail(history) == [
        ("started", 1, None),
        ("failed", 1, False),
        ("started", 2, None),
        ("failed", 2, False),
        ("started", 3, None),
        ("completed", 3, None),
    ], "equals the attempt in history"


async def test_an_exhausted_budget_fails_with_the_last_reason_and_the_attempt_count(
    autojump_clock: trio.testing.MockClock,
) -> None:
    dispatcher = Scripted(
        [fail(aion.FailureCause.RETRYABLE, f"refused #{n}", "RateLimited") for n in (1, 2, 3)]
    )
    start = trio.current_time()
    result, history = await run_one(dispatcher, {"retry": 3})
    assert result["failed"] == "RateLimited", "the original error type is kept"
    assert result["message"] == "exhausted: spent 3 of 3 attempts; last refusal: refused #3"
    assert trail(history)[-1] == ("failed", 3, True), "the final record carries the final attempt"
    assert trio.current_time() - start >= 2 * 600, "two 10-minute backoffs were slept (in mock time)"


async def test_a_non_retryable_failure_fails_at_once_without_a_trail(
    autojump_clock: trio.testing.MockClock,
) -> None:
    dispatcher = Scripted([fail(aion.FailureCause.TERMINAL, "card stolen", "CardStolen")])
    result, history = await run_one(dispatcher, {"retry": 5})
    assert result == {"failed": "CardStolen", "cause": "terminal", "message": "card stolen"}
    assert trail(history) == [("started", 1, None), ("failed", 1, True)]
    assert dispatcher.attempts == [1]


@aion.activity
async def flaky_charge(order: str) -> str:
    raise LookupError(f"no account for {order}")


@aion.workflow
async def listed_non_retryable(ctx: aion.WorkflowContext) -> str:
    try:
        await ctx.run(
            flaky_charge,
            "o",
            retry=RetryPolicy(max_attempts=4, backoff=Fixed(1), non_retryable=[LookupError]),
        )
    except aion.ActivityFailure as exc:
        return f"{exc.error.cause.value}:{exc.type}"
    return "no failure"


async def test_listed_non_retryable_types_and_terminal_errors_are_not_retried(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with aion.open_engine(url(), workflows=[listed_non_retryable], activities=[flaky_charge]) as engine:
        run = await engine.start(listed_non_retryable, workflow_id="nr")
        assert await run.result() == "terminal:LookupError"
        assert trail(await engine.history("nr")) == [("started", 1, None), ("failed", 1, True)]


async def test_without_a_policy_an_activity_runs_exactly_once(autojump_clock: trio.testing.MockClock) -> None:
    dispatcher = Scripted([fail(aion.FailureCause.RETRYABLE, "reset")])
    result, history = await run_one(dispatcher, {})
    assert result["message"] == "reset"
    assert dispatcher.attempts == [1]
    assert trail(history) == [("started", 1, None), ("failed", 1, True)]


async def test_park_beats_retry_and_records_and_delivers_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    dispatcher = Scripted([aion.ActivityOutcome(kind=OutcomeKind.PARKED)])
    async with aion.open_engine(
        url(), workflows=[one_charge], activities=[charge], dispatcher=dispatcher
    ) as engine:
        await engine.start(one_charge, {"retry": 5}, workflow_id="w")
        await trio.sleep(3600)
        history = await engine.history("w")
        description = await engine.describe("w")
    assert dispatcher.attempts == [1], "no retry after a park, despite the budget"
    assert trail(history) == [("started", 1, None)], "nothing recorded"
    assert description.status is aion.WorkflowStatus.RUNNING, "nothing delivered"


async def test_worker_loss_redispatches_the_same_attempt_without_consuming_budget(
    autojump_clock: trio.testing.MockClock,
) -> None:
    lost = aion.ActivityOutcome(
        error=aion.ActivityError(cause=aion.FailureCause.RETRYABLE, type="WorkerLost", message="gone"),
        kind=OutcomeKind.WORKER_LOST,
    )
    dispatcher = Scripted([lost, lost, ok("finally")])
    result, history = await run_one(dispatcher, {"retry": 1})
    assert result == "finally", "a budget of one attempt survived two worker losses"
    assert dispatcher.attempts == [1, 1, 1]
    assert trail(history) == [("started", 1, None), ("completed", 1, None)], "worker loss records nothing"


# --------------------------------------------------------------------------
# Settlement races and the epoch gate
# --------------------------------------------------------------------------


@aion.workflow
async def ends_without_waiting(ctx: aion.WorkflowContext) -> str:
    ctx.start(charge, "o", retry=RetryPolicy(max_attempts=5, backoff=Fixed(600)))
    fast = ctx.start(quick)
    return str(await fast)


@aion.activity
async def quick() -> str:
    return "quick"


async def test_the_loop_records_nothing_once_the_activity_settled_elsewhere(
    autojump_clock: trio.testing.MockClock,
) -> None:
    class FailsThenWatches(Scripted):
        async def dispatch(self, request: aion.ActivityRequest) -> aion.ActivityOutcome:
            if request.activity_type == "quick":
                await trio.sleep(1)
                return ok("quick")
            return await super().dispatch(request)

    dispatcher = FailsThenWatches([fail(aion.FailureCause.RETRYABLE, "reset")])
    async with aion.open_engine(
        url(), workflows=[ends_without_waiting], activities=[charge, quick], dispatcher=dispatcher
    ) as engine:
        run = await engine.start(ends_without_waiting, workflow_id="race")
        assert await run.result() == "quick"
        # The charge's loop is in its 10-minute backoff when the run ends; let it wake.
        await trio.sleep(3600)
        history = await engine.history("race")
    charge_events = [e.body for e in history if getattr(e.body, "activity_id", None) == 0]
    kinds = [type(b).__name__ for b in charge_events]
    # The run's terminal cancelled the activity; the woken loop wrote nothing after it.
    assert kinds == ["ActivityScheduled", "ActivityStarted", "ActivityFailed", "ActivityCancelled"]
    assert [r.activity_type for r in dispatcher.seen] == ["charge"]


@contextlib.asynccontextmanager
async def recorder_of(store_url: str, epoch: EngineEpoch | None = None) -> AsyncIterator[Recorder]:
    """The workflow ``w``'s recorder resumed from ``store_url`` (the runtime seam), after
    the engine that wrote it closed: ``record_activity_event`` takes a recorder."""
    async with aion.open_store(store_url) as store, trio.open_nursery() as nursery:
        yield await Recorder.load("w", store.events, epoch or EngineEpoch(nursery), TrioClock.start())


async def test_the_epoch_gate_refuses_every_record_site_and_says_so(
    autojump_clock: trio.testing.MockClock,
) -> None:
    dispatcher = Scripted([None])
    store_url = url()
    async with aion.open_engine(
        store_url, workflows=[one_charge], activities=[charge], dispatcher=dispatcher
    ) as engine:
        await engine.start(one_charge, {"retry": 3}, workflow_id="w")
        await trio.testing.wait_all_tasks_blocked()
        run_id = (await engine.describe("w")).run_id
    # The activity is unsettled in history (its attempt was parked at shutdown).
    async with trio.open_nursery() as nursery:
        epoch = EngineEpoch(nursery)
        async with recorder_of(store_url, epoch) as recorder:
            before = len(recorder.history)
            assert isinstance(recorder.history[-1].body, aion.ActivityStarted), "control: unsettled"
            epoch.begin_close()
            error = aion.ActivityError(cause=aion.FailureCause.RETRYABLE, type="E", message="m")
            sites = [
                aion.ActivityFailed(activity_id=0, error=error, attempt=1, final=False),
                aion.ActivityStarted(activity_id=0, attempt=2),
                aion.ActivityFallbackRouted(
                    activity_id=0, attempt=1, from_task_queue="a", to_task_queue="b", fallback_index=0
                ),
                aion.ActivityAdvisoryExhausted(activity_id=0, activity_type="charge", reason="r", attempt=1),
                aion.ActivityFailed(activity_id=0, error=error, attempt=1, final=True),
                aion.ActivityCompleted(activity_id=0, result=aion.Payload.of(1), attempt=1),
            ]
            for body in sites:
                assert await record_activity_event(recorder, run_id, 0, body) is RecordOutcome.EPOCH_CLOSED
    async with aion.open_store(store_url) as store:
        assert len(await store.events.read_history("w")) == before


async def test_a_settled_activity_refuses_further_trail_records(
    autojump_clock: trio.testing.MockClock,
) -> None:
    dispatcher = Scripted([ok("done")])
    store_url = url()
    async with aion.open_engine(
        store_url, workflows=[one_charge], activities=[charge], dispatcher=dispatcher
    ) as engine:
        run = await engine.start(one_charge, {}, workflow_id="w")
        await run.result()
        before = len(await engine.history("w"))
    async with recorder_of(store_url) as recorder:
        outcome = await record_activity_event(
            recorder, run.run_id, 0, aion.ActivityStarted(activity_id=0, attempt=2)
        )
        assert outcome is RecordOutcome.SETTLED_ELSEWHERE
        assert len(recorder.history) == before
    async with aion.open_store(store_url) as store:
        assert len(await store.events.read_history("w")) == before


# --------------------------------------------------------------------------
# Policy refusals and fallback queues
# --------------------------------------------------------------------------


class RefusesQueues(Scripted):
    def __init__(self, refusing: set[str]) -> None:
        super().__init__([])
        self.refusing = refusing

    async def dispatch(self, request: aion.ActivityRequest) -> aion.ActivityOutcome:
        self.seen.append(request)
        await trio.lowlevel.checkpoint()
        if request.task_queue in self.refusing:
            return fail(aion.FailureCause.POLICY_REFUSED, f"{request.task_queue} over quota", "QuotaExceeded")
        return ok(f"ran on {request.task_queue}")


async def test_policy_refusals_hop_to_the_fallback_queues_in_order(
    autojump_clock: trio.testing.MockClock,
) -> None:
    dispatcher = RefusesQueues({"primary", "backup"})
    options = {"task_queue": "primary", "fallback_queues": ["backup", "last-resort"]}
    result, history = await run_one(dispatcher, options)
    assert result == "ran on last-resort"
    assert dispatcher.queues == ["primary", "backup", "last-resort"]
    assert dispatcher.attempts == [1, 2, 3]
    assert trail(history) == [
        ("started", 1, None),
        ("failed", 1, False),
        ("hop primary->backup #0", 1, None),
        ("started", 2, None),
        ("failed", 2, False),
        ("hop backup->last-resort #1", 2, None),
        ("started", 3, None),
        ("completed", 3, None),
    ]


async def test_exhausted_fallbacks_fail_with_the_queues_in_recorded_order(
    autojump_clock: trio.testing.MockClock,
) -> None:
    dispatcher = RefusesQueues({"primary", "backup", "last-resort"})
    options = {"task_queue": "primary", "fallback_queues": ["backup", "last-resort"], "advisory": True}
    result, history = await run_one(dispatcher, options)
    assert result["cause"] == "policy_refused"
    assert result["message"].startswith(
        "policy_refused: declared fallback queues refused in recorded order: primary, backup, last-resort"
    )
    steps = trail(history)
    assert steps[-2:] == [("advisory", 3, None), ("failed", 3, True)], (
        "the advisory warning precedes the failure"
    )


async def test_policy_refusals_without_fallbacks_retry_within_the_budget(
    autojump_clock: trio.testing.MockClock,
) -> None:
    dispatcher = RefusesQueues({"default"})
    result, _ = await run_one(dispatcher, {"retry": 2})
    assert (
        result["message"]
        == "policy_refused: spent 2 of 2 configured attempts; last refusal: default over quota"
    )
    assert dispatcher.attempts == [1, 2]


# --------------------------------------------------------------------------
# Advisory activities
# --------------------------------------------------------------------------


async def test_advisory_exhaustion_is_recorded_before_the_terminal_failure(
    autojump_clock: trio.testing.MockClock,
) -> None:
    dispatcher = Scripted([fail(aion.FailureCause.RETRYABLE, "down")] * 2)
    result, history = await run_one(dispatcher, {"retry": 2, "advisory": True})
    assert result["message"].startswith("exhausted: spent 2 of 2")
    advisory = [e.body for e in history if isinstance(e.body, aion.ActivityAdvisoryExhausted)]
    assert len(advisory) == 1
    assert advisory[0].activity_type == "charge"
    assert trail(history)[-2:] == [("advisory", 2, None), ("failed", 2, True)]


async def test_losing_the_advisory_record_never_changes_the_outcome(
    autojump_clock: trio.testing.MockClock,
) -> None:
    dispatcher = Scripted([fail(aion.FailureCause.RETRYABLE, "down")])
    async with flaky_one_charge(dispatcher) as opened:
        flaky, engine = opened.flaky, opened.engine
        # Appends: 1 WorkflowStarted, 2 the advisory note (refused; it carried the deferred
        # Scheduled+Started, which stay owed), 3 Scheduled+Started+the failure.
        flaky.events.fail_appends_after(1, 1, aion.NotFound("injected: advisory lost"))
        run = await engine.start(one_charge, {"advisory": True}, workflow_id="w")
        result = await run.result()
    history = opened.history
    assert flaky.events.faults["append"] == 1, "control: the advisory append really failed"
    assert result == {"failed": "ConnectionError", "cause": "retryable", "message": "down"}
    assert not any(isinstance(e.body, aion.ActivityAdvisoryExhausted) for e in history)
    # The schedule records the refused append carried were written once, with the failure.
    assert trail(history) == [("started", 1, None), ("failed", 1, True)]
    assert sum(isinstance(e.body, aion.ActivityScheduled) for e in history) == 1


async def test_a_transiently_failing_outcome_record_is_retried_until_it_lands_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The settling record (ActivityCompleted) survives BackendUnavailable: two plain
    failures, then one that commits and reports failure, then it is seen as landed."""
    dispatcher = Scripted([ok("charged once")])
    async with flaky_one_charge(dispatcher) as opened:
        flaky, engine = opened.flaky, opened.engine
        injected: list[str] = []

        def busy() -> aion.BackendUnavailable:
            injected.append("busy")
            if len(injected) == 2:
                # The third try commits, and its acknowledgement is lost.
                flaky.events.commit_then_fail_next_appends(1, aion.BackendUnavailable("injected: ack lost"))
            return aion.BackendUnavailable("injected: database is busy")

        # Appends: 1 WorkflowStarted, then the outcome record (carrying the deferred
        # Scheduled+Started).
        flaky.events.fail_appends_after(1, 2, busy)
        run = await engine.start(one_charge, {}, workflow_id="w")
        result = await run.result()
    history = opened.history
    assert flaky.events.faults["append"] == 3
    assert result == "charged once"
    assert dispatcher.attempts == [1], "the attempt ran once: only its record was retried"
    assert trail(history) == [("started", 1, None), ("completed", 1, None)]


async def test_an_outcome_record_refused_for_good_leaves_the_run_stuck_not_hung(
    autojump_clock: trio.testing.MockClock,
) -> None:
    dispatcher = Scripted([ok("charged")])
    async with flaky_one_charge(dispatcher) as opened:
        flaky, engine = opened.flaky, opened.engine
        # Appends: 1 WorkflowStarted, 2 the outcome record, refused (not a transient error).
        flaky.events.fail_appends_after(1, 1, aion.NotFound("injected: outcome refused"))
        await engine.start(one_charge, {}, workflow_id="w")
        await trio.testing.wait_all_tasks_blocked()
        description = await engine.describe("w")
    assert flaky.events.faults["append"] == 1, "control: the outcome append really failed"
    assert description.status is aion.WorkflowStatus.RUNNING
    assert description.stuck_reason == (
        "could not record the outcome of activity:0 charge (attempt 1): NotFound: injected: outcome refused"
    )


async def test_a_failed_trail_record_fails_the_activity_honestly(
    autojump_clock: trio.testing.MockClock,
) -> None:
    dispatcher = Scripted([fail(aion.FailureCause.RETRYABLE, "reset"), ok("never")])
    async with flaky_one_charge(dispatcher) as opened:
        flaky, engine = opened.flaky, opened.engine
        # The second append is the non-final ActivityFailed of attempt 1 (carrying the
        # deferred Scheduled+Started).
        flaky.events.fail_appends_after(1, 1, aion.NotFound("injected: trail record refused"))
        run = await engine.start(one_charge, {"retry": 3}, workflow_id="w")
        result = await run.result()
    assert flaky.events.faults["append"] == 1
    assert result["failed"] == "RetryTrailNotRecorded"
    assert dispatcher.attempts == [1], "no unrecorded second attempt"


@pytest.mark.parametrize("landed", [False, True], ids=["refused", "committed-unacknowledged"])
@pytest.mark.parametrize("record", [2, 3], ids=["trail-failure", "next-start"])
async def test_a_transient_fault_on_a_retry_record_is_retried_and_recorded_once(
    autojump_clock: trio.testing.MockClock, record: int, landed: bool
) -> None:
    """A BackendUnavailable on the non-final ActivityFailed (append 2, carrying the deferred
    Scheduled+Started) or on the next ActivityStarted (append 3) is retried like every
    other record: the activity fails only by its own policy, and an append whose commit
    landed unacknowledged is found on the re-read, not written twice."""
    dispatcher = Scripted([fail(aion.FailureCause.RETRYABLE, "reset"), ok("charged")])
    async with flaky_one_charge(dispatcher) as opened:
        flaky, engine = opened.flaky, opened.engine
        fault = aion.BackendUnavailable("injected: database restarting")
        if landed:
            flaky.events.commit_then_fail_appends_after(record - 1, 1, fault)
        else:
            flaky.events.fail_appends_after(record - 1, 2, fault)
        run = await engine.start(one_charge, {"retry": 3}, workflow_id="w")
        result = await run.result()
    assert flaky.events.faults["append"] == (1 if landed else 2), "control: the record's append really failed"
    assert result == "charged"
    assert dispatcher.attempts == [1, 2]
    assert trail(opened.history) == [
        ("started", 1, None),
        ("failed", 1, False),
        ("started", 2, None),
        ("completed", 2, None),
    ]
    assert [e.seq for e in opened.history] == list(range(1, len(opened.history) + 1))


# --------------------------------------------------------------------------
# Timeouts and heartbeats (real in-process activities)
# --------------------------------------------------------------------------

CANCELLED: list[int] = []


@aion.activity
async def hangs() -> str:
    try:
        await trio.sleep_forever()
    finally:
        CANCELLED.append(aion.activity_info().attempt)
    return "unreachable"


@aion.workflow
async def bounded(ctx: aion.WorkflowContext) -> str:
    try:
        return str(
            await ctx.run(
                hangs, timeout=timedelta(seconds=30), retry=RetryPolicy(max_attempts=2, backoff=Fixed(5))
            )
        )
    except aion.ActivityFailure as exc:
        return f"{exc.error.cause.value}: {exc.message}"


async def test_a_per_attempt_timeout_really_cancels_the_attempt_and_is_retry_eligible(
    autojump_clock: trio.testing.MockClock,
) -> None:
    CANCELLED.clear()
    async with aion.open_engine(url(), workflows=[bounded], activities=[hangs]) as engine:
        run = await engine.start(bounded, workflow_id="t")
        result = await run.result()
        steps = trail(await engine.history("t"))
    assert (
        result == "timeout: exhausted: spent 2 of 2 attempts; last refusal: attempt 2 timed out after 30.0s"
    )
    assert CANCELLED == [1, 2], "each attempt's task was cancelled, not left running"
    assert steps == [("started", 1, None), ("failed", 1, False), ("started", 2, None), ("failed", 2, True)]


@aion.activity
async def slow_then_fine() -> str:
    info = aion.activity_info()
    for _ in range(5):
        await trio.sleep(4)
        if info.attempt > 1:
            aion.heartbeat({"progress": _})
    return f"attempt {info.attempt}"


@aion.workflow
async def heartbeating(ctx: aion.WorkflowContext) -> str:
    return str(
        await ctx.run(
            slow_then_fine, heartbeat_timeout=10, retry=RetryPolicy(max_attempts=2, backoff=Fixed(1))
        )
    )


async def test_a_missed_heartbeat_fails_the_attempt_as_a_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with aion.open_engine(url(), workflows=[heartbeating], activities=[slow_then_fine]) as engine:
        run = await engine.start(heartbeating, workflow_id="hb")
        assert await run.result() == "attempt 2", "attempt 1 never heartbeat; attempt 2 did every 4s"
        failed = [e.body for e in await engine.history("hb") if isinstance(e.body, aion.ActivityFailed)]
    assert len(failed) == 1
    assert failed[0].error.type == "HeartbeatTimeout"
    assert failed[0].error.cause is aion.FailureCause.TIMEOUT


async def test_schedule_to_close_bounds_all_attempts_and_backoffs(
    autojump_clock: trio.testing.MockClock,
) -> None:
    dispatcher = Scripted([fail(aion.FailureCause.RETRYABLE, "reset")] * 10)
    start = trio.current_time()
    result, _ = await run_one(dispatcher, {"retry": 10, "schedule_to_close": 1000})
    assert result["cause"] == "timeout"
    assert "schedule_to_close of 1000.0s" in result["message"]
    assert len(dispatcher.seen) == 2, "600s backoffs: attempt 3 would start after the 1000s bound"
    assert trio.current_time() - start < 1000


# --------------------------------------------------------------------------
# Option resolution and recording
# --------------------------------------------------------------------------


@aion.activity(retry=RetryPolicy(max_attempts=7, backoff=Fixed(1)), timeout=50, task_queue="activity-q")
async def configured() -> str:
    return "ok"


@aion.workflow
async def uses_layers(ctx: aion.WorkflowContext) -> list[str]:
    a = await ctx.run(configured)
    b = await ctx.run(configured, timeout=5, retry=None)
    c = await ctx.run(charge, "x")
    return [a, b, c]


async def test_options_resolve_per_call_over_activity_over_engine_and_are_recorded(
    autojump_clock: trio.testing.MockClock,
) -> None:
    config = aion.EngineConfig(activity_defaults={"timeout": 99, "retry": RetryPolicy(max_attempts=2)})
    async with aion.open_engine(
        url(), workflows=[uses_layers], activities=[configured, charge], config=config
    ) as engine:
        run = await engine.start(uses_layers, workflow_id="layers")
        assert await run.result() == ["ok", "ok", "charged x"]
        scheduled = [
            e.body for e in await engine.history("layers") if isinstance(e.body, aion.ActivityScheduled)
        ]
    recorded = [s.options.value() for s in scheduled]
    assert [s.task_queue for s in scheduled] == ["activity-q", "activity-q", "default"]
    assert recorded[0]["timeout"] == 50
    assert recorded[0]["retry"]["max_attempts"] == 7
    assert recorded[1]["timeout"] == 5
    assert recorded[1]["retry"] is None
    assert recorded[2]["timeout"] == 99
    assert recorded[2]["retry"]["max_attempts"] == 2


# --------------------------------------------------------------------------
# A real crash in the middle of a backoff
# --------------------------------------------------------------------------


@pytest.mark.slow
def test_a_crash_mid_backoff_resumes_at_the_next_attempt_without_skipping_or_repeating(
    tmp_path: Path,
) -> None:
    root = Path(__file__).resolve().parent.parent
    store, side = tmp_path / "store.db", tmp_path / "attempts.txt"
    command = [sys.executable, "-m", "tests.procs.retry_worker", str(store), str(side)]
    env = {**os.environ, "PYTHONPATH": str(root)}
    first = subprocess.Popen(command, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        # The activity's first attempt has run (so the worker finished creating the store)...
        while not side.exists():
            assert first.poll() is None, "the worker exited before its first attempt"
            assert time.monotonic() < deadline, "attempt 1 never ran"
            time.sleep(0.02)
        # ...then wait until its non-final failure is durable: the loop is now in its 1-second backoff.
        while not any(
            isinstance(e.body, aion.ActivityFailed) and not e.body.final for e in trio.run(_history, store)
        ):
            assert first.poll() is None, "the worker exited before failing its first attempt"
            assert time.monotonic() < deadline, "attempt 1 never failed"
            time.sleep(0.02)
    finally:
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
    assert first.returncode == -signal.SIGKILL
    second = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=60)
    assert second.returncode == 0, second.stderr
    assert "RESULT succeeded on attempt 2" in second.stdout
    attempts = [line.split() for line in side.read_text().splitlines()]
    assert [a for a, _ in attempts] == ["1", "2"], "the attempts on the wire"
    history = trio.run(_history, store)
    (failure,) = [e.body for e in history if isinstance(e.body, aion.ActivityFailed)]
    assert failure.retry_at is not None
    assert float(attempts[1][1]) >= failure.retry_at.timestamp(), (
        "the restart waited out the recorded backoff"
    )
    assert trail(history) == [
        ("started", 1, None),
        ("failed", 1, False),
        ("started", 2, None),
        ("completed", 2, None),
    ], "history: no attempt skipped or repeated"


async def _history(store: Path) -> list[aion.Event]:
    if not await trio.Path(store).exists():
        return []
    async with aion.open_store(f"sqlite:///{store}") as opened:
        return await opened.events.read_history("retry-me")


@aion.workflow
async def leaves_an_activity_running(ctx: aion.WorkflowContext) -> str:
    ctx.start(hangs)
    return str(await ctx.run(quick))


async def test_an_activity_still_running_when_its_run_ends_is_cancelled_and_recorded(
    autojump_clock: trio.testing.MockClock,
) -> None:
    CANCELLED.clear()
    async with aion.open_engine(
        url(), workflows=[leaves_an_activity_running], activities=[hangs, quick]
    ) as engine:
        run = await engine.start(leaves_an_activity_running, workflow_id="orphan")
        assert await run.result() == "quick"
        await trio.testing.wait_all_tasks_blocked()
        history = await engine.history("orphan")
        assert engine.statistics().epoch.in_flight_attempts == 0
    assert CANCELLED == [1], "the attempt's task was really cancelled"
    terminal_index = next(i for i, e in enumerate(history) if e.is_terminal)
    cancelled = [i for i, e in enumerate(history) if isinstance(e.body, aion.ActivityCancelled)]
    assert cancelled == [terminal_index + 1], "recorded in the terminal's batch"
    assert history[cancelled[0]].body.activity_id == 0


async def test_worker_loss_respects_settlement_elsewhere(autojump_clock: trio.testing.MockClock) -> None:
    """A worker-loss re-dispatch records nothing, so it checks settlement itself: once the
    activity was settled by another path, the loop stops instead of re-dispatching."""
    engines: list[aion.Engine] = []

    class SettlesThenLoses(Scripted):
        async def dispatch(self, request: aion.ActivityRequest) -> aion.ActivityOutcome:
            self.seen.append(request)
            recorder = engines[0]._core.loaded_recorder(request.workflow_id)
            assert recorder is not None
            # Another path (say, a timeout scope) settles the activity meanwhile.
            error = aion.ActivityError(
                cause=aion.FailureCause.TIMEOUT, type="ScopeTimeout", message="settled elsewhere"
            )
            outcome = await record_activity_event(
                recorder,
                request.run_id,
                request.activity_id,
                aion.ActivityFailed(
                    activity_id=request.activity_id, error=error, attempt=request.attempt, final=True
                ),
            )
            assert outcome is RecordOutcome.RECORDED
            return aion.ActivityOutcome(
                error=aion.ActivityError(
                    cause=aion.FailureCause.RETRYABLE, type="WorkerLost", message="gone"
                ),
                kind=OutcomeKind.WORKER_LOST,
            )

    dispatcher = SettlesThenLoses([])
    async with aion.open_engine(
        url(), workflows=[one_charge], activities=[charge], dispatcher=dispatcher
    ) as engine:
        engines.append(engine)
        await engine.start(one_charge, {"retry": 3}, workflow_id="w")
        await trio.sleep(3600)
        history = await engine.history("w")
    assert len(dispatcher.seen) == 1, "no re-dispatch after the activity settled elsewhere"
    assert trail(history) == [("started", 1, None), ("failed", 1, True)]


# --------------------------------------------------------------------------
# Unlimited retries: a policy without max_attempts
# --------------------------------------------------------------------------


def test_a_policy_without_max_attempts_has_no_limit_and_records_it() -> None:
    policy = RetryPolicy(backoff=Fixed(5))
    assert policy.max_attempts is None
    assert policy.to_json()["max_attempts"] is None
    assert RetryPolicy.from_json(policy.to_json()) == policy
    assert RetryPolicy().backoff == Exponential(initial=1, multiplier=2, maximum=60), "the default backoff"


async def test_an_unlimited_policy_retries_until_the_activity_succeeds(
    autojump_clock: trio.testing.MockClock,
) -> None:
    dispatcher = Scripted([fail(aion.FailureCause.RETRYABLE, "reset")] * 150 + [ok("finally")])
    start = trio.current_time()
    result, history = await run_one(dispatcher, {"retry": None})
    assert result == "finally"
    assert dispatcher.attempts == list(range(1, 152)), "150 failures, then the 151st attempt succeeds"
    steps = trail(history)
    assert steps[-1] == ("completed", 151, None)
    assert sum(1 for kind, _, final in steps if kind == "failed" and final is False) == 150
    assert trio.current_time() - start >= 150 * 600, "every retry waited its backoff"


async def test_an_unlimited_policy_is_bounded_by_schedule_to_close(
    autojump_clock: trio.testing.MockClock,
) -> None:
    dispatcher = Scripted([fail(aion.FailureCause.RETRYABLE, "reset")] * 100)
    result, _ = await run_one(dispatcher, {"retry": None, "schedule_to_close": 6500})
    assert result["cause"] == "timeout"
    assert "schedule_to_close of 6500.0s" in result["message"]
    assert len(dispatcher.seen) == 11, "600s backoffs: attempt 12 would start after the 6500s bound"
