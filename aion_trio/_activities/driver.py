"""The activity driver: one activity ordinal to its final outcome (attempts, timeouts, retries,
fallback hops, recording outcomes)."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import attrs
import trio

from .._admission import FlowPools
from .._errors import ActivityAttemptClosed, EngineEpochClosed, StoreError, epoch_closed
from .._events import (
    ActivityAdvisoryExhausted,
    ActivityCompleted,
    ActivityError,
    ActivityFailed,
    ActivityFallbackRouted,
    ActivityStarted,
    Event,
    EventBody,
    FailureCause,
    MarkerRecorded,
    WorkflowReopened,
    trusted,
)
from .._ids import ASYNC_MARKER_PREFIX, HEARTBEAT_MARKER_PREFIX
from .._logs import ContextLogger
from .._observe import ActivityAttemptEnded, ActivityAttemptStarted
from .._payload import Payload
from .._projections import awaits_async_completion, last_heartbeat_details, retry_trail, run_segment
from .._retry import ActivityOptions
from .._transient import Transient
from .awaiting import AttemptKey, AwaitingAttempts
from .context import AttemptClock, current_attempt_clock, current_heartbeat_sink
from .protocol import ActivityDispatcher, ActivityOutcome, ActivityRequest, OutcomeKind, RemoteAttempts
from .records import RecordFailed, RecordOutcome, record_activity_event, record_outcome, record_retrying

if TYPE_CHECKING:
    from .._recorder import Recorder

logger = ContextLogger("aion_trio.activity")

HEARTBEAT_RECORD_INTERVAL = 30.0
"""Seconds between two records of an attempt's heartbeat details without a heartbeat timeout
(with one: 0.8 of it); details reported in between are kept for the next attempt."""


def _observed_outcome(outcome: ActivityOutcome) -> tuple[str, str | None, str | None]:
    """An attempt's outcome as observers see it: (outcome, error type, error message)."""
    if outcome.kind is OutcomeKind.FAILED and outcome.error is not None:
        kind = "timed_out" if outcome.error.cause is FailureCause.TIMEOUT else "failed"
        return kind, outcome.error.type, outcome.error.message
    return outcome.kind.value, None, None


@attrs.define
class _LoopState:
    attempt: int
    #: Attempts spent on the current provider (fallback hops start a new count... of the same budget).
    same_provider_attempt: int
    current_queue: str
    consumed_fallback: int
    refused_queues: list[str]


def _loop_state(segment: Sequence[Event], request: ActivityRequest, options: ActivityOptions) -> _LoopState:
    hops: list[ActivityFallbackRouted] = []
    # Attempts recorded before a reopen that re-dispatched this activity do not count
    # against its budget (nor do their fallback hops): the reopen gave it a fresh one.
    spent_before_reopen = last_started = 0
    for e in segment:
        body = e.body
        if isinstance(body, ActivityFallbackRouted) and body.activity_id == request.activity_id:
            hops.append(body)
        elif isinstance(body, ActivityStarted) and body.activity_id == request.activity_id:
            last_started = body.attempt
        elif isinstance(body, WorkflowReopened) and request.activity_id in body.reopened_activity_ids:
            spent_before_reopen = last_started
            hops.clear()
    queue = hops[-1].to_task_queue if hops else options.task_queue
    return _LoopState(
        attempt=request.attempt,
        same_provider_attempt=max(request.attempt - spent_before_reopen - len(hops), 1),
        current_queue=queue,
        consumed_fallback=(hops[-1].fallback_index + 1) if hops else 0,
        refused_queues=[options.task_queue, *(h.to_task_queue for h in hops)],
    )


class ActivityDriver:
    """Drives one activity ordinal to its final outcome.

    Every record goes through :func:`record_activity_event` (lock, epoch gate,
    settle check).  The backoff sleep is task-local: a crash mid-backoff
    recovers by replay, whose dangling non-final failure is re-dispatched at
    the next attempt.
    """

    def __init__(
        self,
        recorder: Recorder,
        dispatcher: ActivityDispatcher,
        request: ActivityRequest,
        *,
        clock: Any,
        transient: Transient,
        admission: FlowPools | None = None,
        awaiting: AwaitingAttempts | None = None,
        reacquire: Callable[[str], Awaitable[Recorder]] | None = None,
    ) -> None:
        self.recorder = recorder
        #: Where completions and heartbeats by task token reach an attempt (async completion).
        self.awaiting = awaiting if awaiting is not None else AwaitingAttempts()
        #: A resumed attempt awaiting async completion: when it started (its timeout counts from there).
        self._resumed_started_at: datetime | None = None
        #: The engine's door to a workflow's current recorder (``Recorders.recorder_for``):
        #: a record after the run was evicted (its recorder dropped) goes through it, which
        #: makes the run resident again, so the record lands in the history it replays.
        self.reacquire = reacquire
        #: Whether an attempt is in flight on a remote worker now (``RemoteAttempts``).
        self.waiting_remote = False
        #: Each attempt holds a slot of each of its pools while dispatched (``None``: unbounded).
        self.admission = admission
        self.dispatcher = dispatcher
        self.request = request
        self.options = request.resolved_options()
        self.clock = clock
        #: How a record that fails transiently is retried (until it lands or the epoch closes).
        self.transient = transient
        #: The last heartbeat details an attempt reported: given to the next attempt.
        self.heartbeat_details: Payload | None = request.heartbeat_details
        self.log = {
            "workflow_id": request.workflow_id,
            "run_id": request.run_id,
            "activity": request.activity_id,
            "activity_type": request.activity_type,
        }

    # -- records -------------------------------------------------------------

    async def current_recorder(self) -> Recorder:
        """The recorder a record goes through: the one this driver holds, or, once the
        engine dropped it (the run was evicted), the workflow's current one (the wake)."""
        if self.recorder.dropped and self.reacquire is not None:
            self.recorder = await self.reacquire(self.request.workflow_id)
        return self.recorder

    async def _required(self, body: EventBody) -> RecordOutcome:
        """A trail record the loop cannot continue without: retried on transient store
        failures like the settling record; any other store failure raises RecordFailed."""
        what = f"record {type(body).__name__}"  # the line's prefix names the activity
        try:
            recorder = await self.current_recorder()
            outcome = await record_retrying(recorder, self.request, body, self.transient, self.log, what)
        except StoreError as exc:
            raise RecordFailed(f"{type(exc).__name__}: {exc}") from exc
        self._answer_token(body, outcome)
        return outcome

    async def _final(self, attempt: int, body: EventBody) -> RecordOutcome:
        """The settling record: retried on transient store failures until it lands."""
        request = (
            self.request if self.request.attempt == attempt else attrs.evolve(self.request, attempt=attempt)
        )
        outcome = await record_outcome(await self.current_recorder(), request, body, self.transient, self.log)
        self._answer_token(body, outcome)
        return outcome

    def _key(self, attempt: int) -> AttemptKey:
        request = self.request
        return (request.workflow_id, request.run_id, request.activity_id, attempt)

    def _answer_token(self, body: EventBody, outcome: RecordOutcome) -> None:
        """An attempt's outcome record was made (or refused): answer a caller that brought
        it by task token, or refuse one whose completion came too late."""
        if not len(self.awaiting) or not isinstance(body, (ActivityCompleted, ActivityFailed)):
            return
        request = self.request
        refusal: BaseException | None = None
        if outcome is RecordOutcome.SETTLED_ELSEWHERE:
            refusal = ActivityAttemptClosed(
                request.workflow_id,
                request.activity_id,
                body.attempt,
                "the activity or its run settled meanwhile",
            )
        elif outcome is RecordOutcome.EPOCH_CLOSED:
            refusal = epoch_closed(request.workflow_id, request.run_id, "record an activity outcome")
        self.awaiting.settle(
            self._key(body.attempt),
            refusal,
            reason=f"the attempt ended without it ({type(body).__name__} recorded)",
        )

    async def _advisory(self, attempt: int, reason: str) -> None:
        if not self.options.advisory:
            return
        body = ActivityAdvisoryExhausted(
            activity_id=self.request.activity_id,
            activity_type=self.request.activity_type,
            reason=reason,
            attempt=attempt,
        )
        try:
            outcome = await record_activity_event(
                await self.current_recorder(), self.request.run_id, self.request.activity_id, body
            )
        except StoreError as exc:
            logger.warning(
                "could not record the advisory-exhaustion warning; the terminal failure still stands: %s",
                exc,
                extra={**self.log, "attempt": attempt},
            )
            return
        if outcome is RecordOutcome.EPOCH_CLOSED:
            logger.info("epoch closed before the advisory-exhaustion warning was recorded", extra=self.log)

    async def _settled_elsewhere(self) -> bool:
        recorder = await self.current_recorder()
        async with recorder.lock:
            try:
                await recorder.current_history(keep_deferred=True)
            except StoreError:
                return False  # the guarded appends still refuse a post-terminal write
            state = recorder.run_state(self.request.run_id)
            return self.request.activity_id in state.settled or state.ended is not None

    # -- the deadline ----------------------------------------------------------

    def _deadline(self) -> datetime | None:
        if self.options.schedule_to_close is None or self.request.scheduled_at is None:
            return None
        return self.request.scheduled_at + timedelta(seconds=self.options.schedule_to_close)

    def _attempt_bound(self, started_at: datetime | None = None) -> float:
        """Trio-time deadline of the next attempt (per-attempt and schedule-to-close); a
        resumed attempt's ``timeout`` counts from when it started (``started_at``)."""
        if self.options.timeout is None and self.options.schedule_to_close is None:
            return math.inf
        bounds = [math.inf]
        if self.options.timeout is not None:
            if started_at is None:
                bounds.append(trio.current_time() + self.options.timeout)
            else:
                bounds.append(self.clock.trio_deadline(started_at + timedelta(seconds=self.options.timeout)))
        deadline = self._deadline()
        if deadline is not None:
            bounds.append(self.clock.trio_deadline(deadline))
        return min(bounds)

    def _past_deadline(self, extra: float = 0.0) -> bool:
        deadline = self._deadline()
        return deadline is not None and trio.current_time() + extra >= self.clock.trio_deadline(deadline)

    # -- one attempt -------------------------------------------------------------

    async def _attempt(self, state: _LoopState, *, awaiting: bool = False) -> ActivityOutcome:
        hub = self.recorder.observers
        clock = AttemptClock(self.options.timeout)
        if hub is None:
            return await self._dispatch_attempt(state, clock, awaiting)
        request = self.request
        common: dict[str, Any] = {
            "workflow_id": request.workflow_id,
            "run_id": request.run_id,
            "activity_id": request.activity_id,
            "activity_type": request.activity_type,
            "attempt": state.attempt,
        }
        hub.emit(ActivityAttemptStarted(task_queue=state.current_queue, **common))
        began = trio.current_time()
        kind, error_type, message = "cancelled", None, None
        try:
            outcome = await self._dispatch_attempt(state, clock, awaiting)
            kind, error_type, message = _observed_outcome(outcome)
            return outcome
        except trio.Cancelled:
            raise
        except BaseException as exc:
            kind, error_type, message = "failed", type(exc).__name__, str(exc)
            raise
        finally:
            hub.emit(
                ActivityAttemptEnded(
                    outcome=kind,
                    seconds=trio.current_time() - began,
                    error_type=error_type,
                    error_message=message,
                    queued_seconds=clock.queued_seconds,
                    **common,
                )
            )

    async def _dispatch_attempt(
        self, state: _LoopState, clock: AttemptClock, awaiting: bool = False
    ) -> ActivityOutcome:
        request = self.request
        if request.attempt != state.attempt or request.task_queue != state.current_queue:
            request = attrs.evolve(request, attempt=state.attempt, task_queue=state.current_queue)
        if request.heartbeat_details is not self.heartbeat_details:
            request = attrs.evolve(request, heartbeat_details=self.heartbeat_details)
        bound = self._attempt_bound(self._resumed_started_at if awaiting else None)
        token = current_attempt_clock.set(clock)
        beats = _HeartbeatLog(self, request.attempt)
        sink = current_heartbeat_sink.set(beats.beat)
        try:
            if bound == math.inf:
                # Nothing bounds the attempt: no cancel scope to pay for.
                return await beats.finished(await self._run_attempt(request, clock, beats, awaiting))
            with trio.move_on_at(bound) as scope:
                deadline = self._deadline()
                clock.bind(scope, math.inf if deadline is None else self.clock.trio_deadline(deadline))
                return await beats.finished(await self._run_attempt(request, clock, beats, awaiting))
        finally:
            current_heartbeat_sink.reset(sink)
            current_attempt_clock.reset(token)
        assert scope.cancelled_caught
        if self._past_deadline():
            message = f"schedule_to_close of {self.options.schedule_to_close}s exceeded during attempt {state.attempt}"
            kind = "ScheduleToCloseTimeout"
        else:
            message = f"attempt {state.attempt} timed out after {self.options.timeout}s"
            kind = "ActivityTimeout"
        return ActivityOutcome(error=ActivityError(cause=FailureCause.TIMEOUT, type=kind, message=message))

    async def _run_attempt(
        self, request: ActivityRequest, clock: AttemptClock, beats: _HeartbeatLog, awaiting: bool
    ) -> ActivityOutcome:
        """The attempt: dispatched (unless it is a resumed one awaiting async completion) and,
        if the activity said it completes later, waited for through its task token."""
        if not awaiting:
            outcome = await self._admitted(request, clock)
            if outcome.kind is not OutcomeKind.ASYNC:
                return outcome
            marker = MarkerRecorded(
                name=f"{ASYNC_MARKER_PREFIX}{request.activity_id}",
                value=Payload.of({"attempt": request.attempt}),
            )
            if await self._required(marker) is not RecordOutcome.RECORDED:
                return ActivityOutcome(kind=OutcomeKind.PARKED)  # settled elsewhere, or shutting down
        return await self._await_completion(request, beats)

    async def _await_completion(self, request: ActivityRequest, beats: _HeartbeatLog) -> ActivityOutcome:
        """Wait for the outcome a task token brings (the attempt's timeouts bound the wait
        from outside; a ``heartbeat_timeout`` is watched here, fed by heartbeats by token)."""
        slot = self.awaiting.slot(self._key(request.attempt))
        slot.on_details = beats.beat
        if slot.details is not None:
            beats.beat(slot.details)
            slot.details = None
        slot.last_beat = trio.current_time()
        limit = self.options.heartbeat_timeout
        logger.debug("awaiting completion by task token", extra={**self.log, "attempt": request.attempt})
        while slot.outcome is None:
            if limit is None:
                await slot.changed()
                continue
            with trio.move_on_at(slot.last_beat + limit):
                await slot.changed()
                continue
            return ActivityOutcome(
                error=ActivityError(
                    cause=FailureCause.TIMEOUT,
                    type="HeartbeatTimeout",
                    message=f"attempt {request.attempt} (completing asynchronously) had no heartbeat for {limit}s",
                )
            )
        slot.taken = True
        return slot.outcome

    async def _admitted(self, request: ActivityRequest, clock: AttemptClock) -> ActivityOutcome:
        """Dispatch the attempt holding an admission slot; while it waits for one, its
        ``timeout`` is stopped (the clock's queue time), ``schedule_to_close`` is not."""
        if self.admission is None or not self.admission.pools(request.task_queue, request.activity_type):
            return await self._dispatch(request)
        async with self.admission.slots(
            request.task_queue,
            request.activity_type,
            clock,
            priority=self.options.priority,
            who=(request.workflow_id, request.run_id, request.activity_id),
            attempt=request.attempt,
        ):
            return await self._dispatch(request)

    async def _dispatch(self, request: ActivityRequest) -> ActivityOutcome:
        dispatcher = self.dispatcher
        if not isinstance(dispatcher, RemoteAttempts) or not dispatcher.remote(request.task_queue):
            return await dispatcher.dispatch(request)
        self.waiting_remote = True
        try:
            return await dispatcher.dispatch(request)
        finally:
            self.waiting_remote = False

    # -- the loop ----------------------------------------------------------------

    async def run(self, *, resume: bool = False) -> RecordOutcome | None:
        """Returns the final record's outcome, or ``None`` if the dispatch was parked."""
        epoch = self.recorder.epoch
        epoch.attempt_started()
        try:
            return await self._run(resume)
        except RecordFailed as exc:
            # Fail honestly rather than continue unrecorded.
            logger.warning("a required retry record failed; failing the activity: %s", exc, extra=self.log)
            error = ActivityError(
                cause=FailureCause.TERMINAL,
                type="RetryTrailNotRecorded",
                message=f"the retry trail could not be recorded ({exc}); failing instead of continuing unrecorded",
            )
            attempt = self._last_attempt
            return await self._final(
                attempt,
                ActivityFailed(
                    activity_id=self.request.activity_id, error=error, attempt=attempt, final=True
                ),
            )
        finally:
            epoch.attempt_finished()
            request = self.request
            self.awaiting.close_activity(
                request.workflow_id,
                request.run_id,
                request.activity_id,
                "the activity is no longer driven here (settled by its run, cancelled, or the engine stopped)",
            )

    _last_attempt: int = 1

    @property
    def last_attempt(self) -> int:
        """The attempt the loop is at (or ended on)."""
        return self._last_attempt

    async def _run(self, resume: bool) -> RecordOutcome | None:
        policy = self.options.retry
        if resume:
            # Continue the recorded trail (attempt numbers, fallback hops).
            async with self.recorder.lock:
                history = await self.recorder.current_history()
                segment = run_segment(history, self.request.run_id)
        else:
            segment = []  # a fresh dispatch: nothing recorded beyond its first start
        state = _loop_state(segment, self.request, self.options)
        resumed_awaiting = False
        if resume:
            recorded = last_heartbeat_details(segment, self.request.activity_id)
            if recorded is not None:
                self.heartbeat_details = recorded
        self._last_attempt = state.attempt
        pending_error: ActivityError | None = None
        #: When the recorded dangling failure said the next attempt is due.
        pending_retry_at: datetime | None = None
        if resume:
            trail = retry_trail(segment, self.request.activity_id)
            if trail and trail[-1].outcome == "failed" and not trail[-1].final:
                # Crashed between a non-final failure and the next start.
                state.attempt = trail[-1].attempt
                pending_error = trail[-1].error
                pending_retry_at = trail[-1].retry_at
            elif trail and trail[-1].outcome == "failed":
                # Re-dispatched by a reopen after its final failure: the next attempt, recorded.
                state.attempt = trail[-1].attempt + 1
                self._last_attempt = state.attempt
                rec = await self._required(
                    trusted(ActivityStarted, activity_id=self.request.activity_id, attempt=state.attempt)
                )
                if rec is not RecordOutcome.RECORDED:
                    return rec
            elif not trail:
                rec = await self._required(
                    trusted(ActivityStarted, activity_id=self.request.activity_id, attempt=state.attempt)
                )
                if rec is not RecordOutcome.RECORDED:
                    return rec
            elif trail[-1].outcome == "running" and awaits_async_completion(
                segment, self.request.activity_id, trail[-1].attempt
            ):
                # Its code said it completes later: wait for the token again, never re-run it.
                state.attempt = trail[-1].attempt
                self._last_attempt = state.attempt
                self._resumed_started_at = trail[-1].started_at
                resumed_awaiting = True
        while True:
            if pending_error is None:
                outcome = await self._attempt(state, awaiting=resumed_awaiting)
                resumed_awaiting = False
                if outcome.kind is OutcomeKind.PARKED:
                    logger.debug("dispatch parked: nothing recorded", extra=self.log)
                    return None
                if outcome.kind is OutcomeKind.COMPLETED:
                    assert outcome.result is not None
                    return await self._final(
                        state.attempt,
                        ActivityCompleted(
                            activity_id=self.request.activity_id, result=outcome.result, attempt=state.attempt
                        ),
                    )
                if outcome.kind is OutcomeKind.WORKER_LOST:
                    if await self._settled_elsewhere():
                        return RecordOutcome.SETTLED_ELSEWHERE
                    logger.warning(
                        "the worker was lost before reporting; re-dispatching the same attempt (no budget consumed)",
                        extra={**self.log, "attempt": state.attempt},
                    )
                    await trio.lowlevel.checkpoint()
                    continue
                assert outcome.error is not None
                error = outcome.error
                recorded_failure = False
            else:
                error, pending_error = pending_error, None
                recorded_failure = True
            # A failed attempt.
            if error.cause is FailureCause.POLICY_REFUSED and self.options.fallback_queues:
                if not recorded_failure:
                    outcome_ = await self._required(self._trail_failure(state.attempt, error))
                    if outcome_ is not RecordOutcome.RECORDED:
                        return outcome_
                hop = self._next_hop(state)
                if hop is None:
                    reason = f"{error.type}: {error.message}"
                    await self._advisory(state.attempt, reason)
                    final_error = attrs.evolve(
                        error,
                        message="policy_refused: declared fallback queues refused in recorded order: "
                        + ", ".join(state.refused_queues)
                        + f"; last refusal: {error.message}",
                    )
                    return await self._final(state.attempt, self._settle_failure(state.attempt, final_error))
                index, queue = hop
                outcome_ = await self._required(
                    ActivityFallbackRouted(
                        activity_id=self.request.activity_id,
                        attempt=state.attempt,
                        from_task_queue=state.current_queue,
                        to_task_queue=queue,
                        fallback_index=index,
                    )
                )
                if outcome_ is not RecordOutcome.RECORDED:
                    return outcome_
                state.consumed_fallback = index + 1
                state.current_queue = queue
                state.refused_queues.append(queue)
                state.attempt += 1
                self._last_attempt = state.attempt
                outcome_ = await self._required(
                    trusted(ActivityStarted, activity_id=self.request.activity_id, attempt=state.attempt)
                )
                if outcome_ is not RecordOutcome.RECORDED:
                    return outcome_
                continue
            eligible = error.cause in (
                FailureCause.RETRYABLE,
                FailureCause.TIMEOUT,
                FailureCause.POLICY_REFUSED,
            )
            if error.type == "ScheduleToCloseTimeout" or self._past_deadline():
                eligible = False
            if policy is None or not eligible:
                if policy is not None or error.cause is not FailureCause.TERMINAL or self.options.advisory:
                    await self._advisory(state.attempt, f"{error.type}: {error.message}")
                return await self._final(state.attempt, self._settle_failure(state.attempt, error))
            if policy.max_attempts is not None and state.same_provider_attempt >= policy.max_attempts:
                word = "policy_refused" if error.cause is FailureCause.POLICY_REFUSED else "exhausted"
                configured = " configured" if word == "policy_refused" else ""
                final_error = attrs.evolve(
                    error,
                    message=f"{word}: spent {state.same_provider_attempt} of {policy.max_attempts}{configured} attempts; "
                    f"last refusal: {error.message}",
                )
                await self._advisory(state.attempt, final_error.message)
                return await self._final(state.attempt, self._settle_failure(state.attempt, final_error))
            if recorded_failure:
                # Resumed mid-backoff: wait out what the record says is left (nothing if
                # it predates the field), never a fresh backoff.
                due = trio.current_time()
                if pending_retry_at is not None:
                    due = max(due, self.clock.trio_deadline(pending_retry_at))
            else:
                due = trio.current_time() + policy.backoff.delay_after(state.same_provider_attempt)
            delay = due - trio.current_time()
            if self._past_deadline(extra=delay):
                final_error = attrs.evolve(
                    error,
                    cause=FailureCause.TIMEOUT,
                    message=f"schedule_to_close of {self.options.schedule_to_close}s leaves no time for attempt "
                    f"{state.attempt + 1}; last failure: {error.type}: {error.message}",
                )
                await self._advisory(state.attempt, final_error.message)
                return await self._final(state.attempt, self._settle_failure(state.attempt, final_error))
            if not recorded_failure:
                retry_at = self.clock.now() + timedelta(seconds=delay)
                outcome_ = await self._required(self._trail_failure(state.attempt, error, retry_at))
                if outcome_ is not RecordOutcome.RECORDED:
                    return outcome_
                # The backoff counts from the recorded failure, not from before its append
                # (which may take a while, or be retried): the next start is never sooner.
                due = trio.current_time() + delay
            logger.warning(
                "failed (%s: %s); retrying in %.3fs",
                error.type,
                error.message,
                delay,
                extra={
                    **self.log,
                    "attempt": state.attempt,
                    "max_attempts": policy.max_attempts,
                    "retry_in": delay,
                },
            )
            await trio.sleep_until(due)
            state.same_provider_attempt += 1
            state.attempt += 1
            self._last_attempt = state.attempt
            outcome_ = await self._required(
                trusted(ActivityStarted, activity_id=self.request.activity_id, attempt=state.attempt)
            )
            if outcome_ is not RecordOutcome.RECORDED:
                return outcome_

    def _trail_failure(
        self, attempt: int, error: ActivityError, retry_at: datetime | None = None
    ) -> ActivityFailed:
        return ActivityFailed(
            activity_id=self.request.activity_id, error=error, attempt=attempt, final=False, retry_at=retry_at
        )

    def _settle_failure(self, attempt: int, error: ActivityError) -> ActivityFailed:
        return ActivityFailed(activity_id=self.request.activity_id, error=error, attempt=attempt, final=True)

    def _next_hop(self, state: _LoopState) -> tuple[int, str] | None:
        chain = self.options.fallback_queues
        for index in range(state.consumed_fallback, len(chain)):
            queue = chain[index]
            if queue != state.current_queue:
                return index, queue
        return None


class _HeartbeatLog:
    """An attempt's heartbeat details: the latest is kept for the next attempt (in this
    driver) and recorded as a ``heartbeat:N`` marker, at most once per interval while the
    attempt runs (in the background) and once more when it ends without a result, so a
    driver resumed after a crash gives the next attempt what was recorded.  The end's
    record waits for one under way and comes before the attempt's outcome is recorded: the
    last details are durable before the failure that hands them over.  Recording is best
    effort: a store error leaves the details in memory only."""

    def __init__(self, driver: ActivityDriver, attempt: int) -> None:
        self._driver = driver
        self._attempt = attempt
        timeout = driver.options.heartbeat_timeout
        self._interval = HEARTBEAT_RECORD_INTERVAL if timeout is None else 0.8 * timeout
        self._recorded_at = -math.inf
        self._unrecorded: Payload | None = None
        self._in_flight: trio.Event | None = None
        """Set when the background record under way is done (``None``: none is)."""

    def beat(self, details: Payload) -> None:
        self._driver.heartbeat_details = details
        self._unrecorded = details
        if self._in_flight is not None or trio.current_time() - self._recorded_at < self._interval:
            return
        try:
            self._driver.recorder.epoch.spawn(self._record_in_background, name="record heartbeat details")
        except EngineEpochClosed:
            return
        self._in_flight = trio.Event()

    async def finished(self, outcome: ActivityOutcome) -> ActivityOutcome:
        if outcome.result is None:
            if self._in_flight is not None:
                # Its details may be the last ones: they land (or are refused) first.
                await self._in_flight.wait()
            if self._unrecorded is not None:
                await self._record()
        return outcome

    async def _record_in_background(self) -> None:
        try:
            await self._record()
        finally:
            done, self._in_flight = self._in_flight, None
            if done is not None:
                done.set()

    async def _record(self) -> None:
        details = self._unrecorded
        if details is None:
            return
        self._unrecorded = None
        self._recorded_at = trio.current_time()
        request = self._driver.request
        body = MarkerRecorded(
            name=f"{HEARTBEAT_MARKER_PREFIX}{request.activity_id}",
            value=Payload.of({"attempt": self._attempt, "details": details.value()}),
        )
        try:
            recorder = await self._driver.current_recorder()
            await record_activity_event(recorder, request.run_id, request.activity_id, body)
        except StoreError as exc:
            logger.info("heartbeat details not recorded: %s", exc, extra=self._driver.log)
