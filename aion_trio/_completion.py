"""Recording a run's terminal, and retrying it durably (docs/architecture.md, "Terminals").

When a run's coroutine returns or raises, its exit is normalised once into a
:class:`TerminalIntent` whose ``exit_time`` is captured once and reused by
every retry, so a terminal that lands after an outage still says when the run
finished.  One attempt runs under the recorder lock; a transient failure arms
a retry in the engine epoch and returns at once.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, final

import attrs
import trio

from ._epoch import ArmOutcome, RetryKey, RetrySlot
from ._errors import EngineEpochClosed
from ._events import (
    ActivityCancelled,
    ErrorInfo,
    Event,
    EventBody,
    TimerCancelCause,
    TimerCancelled,
    WorkflowCancelled,
    WorkflowCompleted,
    WorkflowContinuedAsNew,
    WorkflowFailed,
    WorkflowStatus,
    WorkflowTimedOut,
)
from ._ids import deadline_timer_id
from ._logs import ContextLogger
from ._payload import Payload
from ._projections import (
    outstanding_timers,
    retry_trail,
    run_segment,
    unsettled_activities,
)
from ._registry import Lease, Residency
from ._transient import (
    Ladder,
    RetryAbandoned,
    Transient,
    failure_discriminant,
    is_transient,
)

if TYPE_CHECKING:
    from ._hub import CompletionHub

logger = ContextLogger("aion_trio.completion")


class TerminalKind(enum.Enum):
    COMPLETED = "completed"
    FAILED = "failed"
    CONTINUED_AS_NEW = "continued_as_new"
    CANCELLED = "cancelled"


@final
@attrs.frozen(kw_only=True)
class TerminalIntent:
    """What terminal a run's exit means; ``exit_time`` captured once, reused by every retry."""

    kind: TerminalKind
    exit_time: datetime
    result: Payload | None = None
    error: ErrorInfo | None = None
    continue_input: Payload | None = None
    continue_type: str | None = None
    reason: str = ""

    @classmethod
    def completed(cls, result: Payload, exit_time: datetime) -> TerminalIntent:
        return cls(kind=TerminalKind.COMPLETED, exit_time=exit_time, result=result)

    @classmethod
    def failed(cls, error: ErrorInfo, exit_time: datetime) -> TerminalIntent:
        return cls(kind=TerminalKind.FAILED, exit_time=exit_time, error=error)

    @classmethod
    def cancelled(cls, reason: str, exit_time: datetime) -> TerminalIntent:
        return cls(kind=TerminalKind.CANCELLED, exit_time=exit_time, reason=reason)

    @classmethod
    def continued_as_new(
        cls, input: Payload, workflow_type: str | None, exit_time: datetime
    ) -> TerminalIntent:
        return cls(
            kind=TerminalKind.CONTINUED_AS_NEW,
            exit_time=exit_time,
            continue_input=input,
            continue_type=workflow_type,
        )

    def body(self, run_id: str) -> EventBody:
        if self.kind is TerminalKind.COMPLETED:
            assert self.result is not None
            return WorkflowCompleted(result=self.result)
        if self.kind is TerminalKind.FAILED:
            assert self.error is not None
            return WorkflowFailed(error=self.error)
        if self.kind is TerminalKind.CANCELLED:
            return WorkflowCancelled(reason=self.reason)
        assert self.continue_input is not None
        return WorkflowContinuedAsNew(
            input=self.continue_input, workflow_type=self.continue_type, parent_run_id=run_id
        )


class TerminalProgress(enum.Enum):
    """Whether a terminal for the run was observed durable (own append, or found present)."""

    NOT_RECORDED = "not_recorded"
    RECORDED = "recorded"

    def operator_summary(self) -> str:
        if self is TerminalProgress.RECORDED:
            return "was recorded, but the bookkeeping that follows it did not complete"
        return "could not be recorded"


@final
class CompletionFailure(Exception):
    """An attempt's failure, carrying the progress made before it."""

    def __init__(self, error: BaseException, progress: TerminalProgress, retryable: bool) -> None:
        super().__init__(str(error))
        self.error = error
        self.progress = progress
        self.retryable = retryable


def _log_fields(lease: Lease, **more: Any) -> dict[str, Any]:
    return {"workflow_id": lease.workflow_id, "run_id": lease.run_id, "lease": lease.lease_id, **more}


def stands_down(core: CompletionHub, lease: Lease, progress: TerminalProgress) -> bool:
    """Exactly two disjuncts: this completion already recorded a terminal, or the
    registry positively holds a *different* lease for the run.  An absent entry
    does not stand down (absence of evidence is not a reopen)."""
    current = core.registry.get(lease.workflow_id, lease.run_id)
    superseded = current is not None and current.lease_id != lease.lease_id
    if progress is TerminalProgress.RECORDED or superseded:
        logger.info(
            "completion stands down without writing: this run's terminal is no longer this lease's "
            "to write (it already recorded one, or a newer lease holds the run)",
            extra=_log_fields(lease, superseded_by_newer_lease=superseded),
        )
        return True
    return False


async def retire_deadline(core: CompletionHub, lease: Lease, history: Any) -> None:
    """Append ``TimerCancelled`` for the run's outstanding deadline, if any.  Hold the lock."""
    deadline = deadline_timer_id(lease.run_id)
    segment = run_segment(history, lease.run_id)
    if any(t.timer_id == deadline for t in outstanding_timers(segment)):
        await lease.recorder.append(
            [TimerCancelled(timer_id=deadline, cause=TimerCancelCause.WORKFLOW_INTENT)],
            action="retire the workflow deadline",
            run_id=lease.run_id,
        )
        await core.forget_timer(lease.workflow_id, deadline)


def teardown_bodies(segment: Sequence[Event], run_id: str, *, retire_timers: bool) -> list[EventBody]:
    """What ending a run settles in the terminal's own batch: its unsettled activities
    (``ActivityCancelled``), its deadline (retired for good) and, for a cancel, terminate
    or deadline teardown (``retire_timers``), its other outstanding timers — retired with
    cause ``cancel_teardown``, which a reopen re-arms."""
    bodies: list[EventBody] = []
    for activity_id in unsettled_activities(segment):
        trail = retry_trail(segment, activity_id)
        bodies.append(ActivityCancelled(activity_id=activity_id, attempt=trail[-1].attempt if trail else 1))
    deadline = deadline_timer_id(run_id)
    for timer in outstanding_timers(segment):
        if timer.timer_id == deadline:
            bodies.append(TimerCancelled(timer_id=deadline, cause=TimerCancelCause.WORKFLOW_INTENT))
        elif retire_timers:
            bodies.append(TimerCancelled(timer_id=timer.timer_id, cause=TimerCancelCause.CANCEL_TEARDOWN))
    return bodies


async def forget_retired(core: CompletionHub, lease_or_wid: Lease | str, bodies: Sequence[EventBody]) -> None:
    """After a teardown batch landed: drop its timers from the index and cancel its dispatches."""
    workflow_id = lease_or_wid if isinstance(lease_or_wid, str) else lease_or_wid.workflow_id
    for body in bodies:
        if isinstance(body, TimerCancelled):
            await core.forget_timer(workflow_id, body.timer_id)


@attrs.define
class _Progress:
    value: TerminalProgress


async def run_exit_attempt(
    core: CompletionHub, lease: Lease, intent: TerminalIntent, progress: _Progress
) -> None:
    """One attempt.  ``progress`` is set at the two instants a terminal is known durable."""
    recorder = lease.recorder
    resumed: Event | None = None
    recorded: Event
    async with recorder.lock:
        # The epoch gate sits before the branch: the resume arm appends too.
        core.epoch.gate(lease.workflow_id, lease.run_id, "record the workflow terminal")
        history = await recorder.current_history()
        existing = recorder.run_state(lease.run_id).ended
        if existing is not None:
            # Durable point 1: a terminal is already in history.
            progress.value = TerminalProgress.RECORDED
            # A TimedOut deadline belongs to the deadline teardown (its resume anchor).
            if not isinstance(existing.body, WorkflowTimedOut):
                await retire_deadline(core, lease, history)
            resumed = existing
            recorded = existing
        else:
            if stands_down(core, lease, progress.value):
                return
            body = intent.body(lease.run_id)
            segment = run_segment(history, lease.run_id)
            # Activities still running when the run ends are cancelled, in the same batch.
            bodies: list[EventBody] = [
                body,
                *teardown_bodies(segment, lease.run_id, retire_timers=intent.kind is TerminalKind.CANCELLED),
            ]
            events = await recorder.append(
                bodies, action="record the workflow terminal", run_id=lease.run_id, at=intent.exit_time
            )
            # Durable point 2: this attempt's own append returned.
            progress.value = TerminalProgress.RECORDED
            recorded = events[0]
            status = recorder.run_state(lease.run_id).status
            if status is not None:
                lease.cached_status = status
            await forget_retired(core, lease, bodies)
            if any(isinstance(b, ActivityCancelled) for b in bodies):
                core.cancel_inflight(lease.workflow_id, lease.run_id)

    # Notify as soon as the terminal is decided: bookkeeping failures below
    # must never strand a waiter.
    lease.completion.notify(recorded)
    # Children of the run (parent-close policy) and, for a child, its parent (its outcome).
    await core.run_closed(lease.workflow_id, lease.run_id)

    if resumed is not None and isinstance(resumed.body, WorkflowTimedOut):
        # The teardown owns a timed-out run's visibility and deadline.
        reconcile_registry(core, lease)
        return
    # Shielded (and bounded): an engine shutting down right after a run ended
    # still lets the index catch up, so a finished run never lists as Running.
    with trio.CancelScope(shield=True), trio.move_on_after(core.config.bookkeeping_timeout):
        await core.upsert_visibility(lease.workflow_id)
    reconcile_registry(core, lease)
    if isinstance(recorded.body, WorkflowContinuedAsNew) and recorded.body.parent_run_id == lease.run_id:
        await core.start_successor(lease, recorded.body)


def reconcile_registry(core: CompletionHub, lease: Lease) -> None:
    """Status from history; residency Suspended; the entry is kept until the closed
    workflow is released (``EngineConfig.release_closed_after``)."""
    status = lease.recorder.run_state(lease.run_id).status
    if status is not None:
        lease.cached_status = status
    if lease.residency is Residency.RESIDENT:
        lease.residency = Residency.SUSPENDED
    if status is not None and status not in (WorkflowStatus.RUNNING, WorkflowStatus.CONTINUED_AS_NEW):
        core.workflow_closed(lease.workflow_id)


async def complete_run_exit(
    core: CompletionHub, lease: Lease, intent: TerminalIntent, prior: TerminalProgress
) -> TerminalProgress:
    """One attempt, seeded with earlier attempts' progress; raises :class:`CompletionFailure`."""
    progress = _Progress(prior)
    try:
        await run_exit_attempt(core, lease, intent, progress)
    except (trio.Cancelled, KeyboardInterrupt):
        raise
    except Exception as exc:
        raise CompletionFailure(exc, progress.value, is_transient(exc)) from exc
    return progress.value


async def handle_run_exit(core: CompletionHub, lease: Lease, intent: TerminalIntent) -> None:
    """Record the run's terminal.  A transient failure arms a retry and returns at once;
    anything else is raised to the caller."""
    try:
        await complete_run_exit(core, lease, intent, TerminalProgress.NOT_RECORDED)
    except CompletionFailure as failure:
        if failure.retryable:
            arm_completion_retry(core, lease, intent, failure.error, failure.progress)
            return
        raise failure.error from None


def arm_completion_retry(
    core: CompletionHub,
    lease: Lease,
    intent: TerminalIntent,
    cause: BaseException,
    progress: TerminalProgress,
) -> ArmOutcome:
    key = RetryKey(lease.workflow_id, lease.run_id, lease.lease_id)
    config = core.config.completion_retry

    async def body(slot: RetrySlot) -> None:
        await retry_run_exit(core, lease, intent, config, progress, cause)

    outcome = core.epoch.arm_completion_retry(key, body)
    fields = _log_fields(lease, error=repr(cause), terminal_recorded=progress is TerminalProgress.RECORDED)
    summary = progress.operator_summary()
    if outcome is ArmOutcome.ARMED:
        logger.warning(
            "workflow completion %s; retrying durably in the background: %s", summary, cause, extra=fields
        )
    elif outcome is ArmOutcome.ALREADY_ARMED:
        logger.debug(
            "workflow completion %s; a retry for this lease is already in flight and owns the terminal, "
            "so this exit arms nothing",
            summary,
            extra=fields,
        )
    elif progress is TerminalProgress.NOT_RECORDED:
        logger.warning(
            "workflow completion could not be recorded and no retry was armed (the engine is shutting "
            "down); the run stays Running until the next engine's recovery: %s",
            cause,
            extra=fields,
        )
    else:
        logger.warning(
            "workflow completion was recorded and no retry was armed (the engine is shutting down); the "
            "run is terminal, but its bookkeeping (visibility, registry) did not complete and may lag "
            "until recovery: %s",
            cause,
            extra=fields,
        )
    return outcome


async def retry_run_exit(
    core: CompletionHub,
    lease: Lease,
    intent: TerminalIntent,
    config: Ladder,
    arming_progress: TerminalProgress,
    cause: BaseException,
) -> None:
    """Retry until the terminal lands, the run is seen terminal or superseded, the epoch
    closes, the workflow is relinquished, or an unretryable failure is hit.  No attempt
    budget: its price is loudness (the arming failure was stated by the arm)."""
    progress = _Progress(arming_progress)
    fields = _log_fields(lease, terminal_recorded=arming_progress is TerminalProgress.RECORDED)

    async def attempt() -> None:
        try:
            await run_exit_attempt(core, lease, intent, progress)
        finally:
            fields["terminal_recorded"] = progress.value is TerminalProgress.RECORDED

    def relinquished() -> str | None:
        if core.loaded_recorder(lease.workflow_id) is lease.recorder:
            return None
        return "the workflow was relinquished here; its owner's recovery records the terminal"

    retry = Transient(config, core.epoch, core.observers).retrying(
        "record the workflow terminal", logger, fields
    )
    try:
        await retry.run(attempt, after=cause, reported=True, stop=relinquished)
    except (EngineEpochClosed, RetryAbandoned):
        return
    except Exception as exc:
        fields = {
            **fields,
            "attempts": retry.attempts,
            "elapsed_seconds": round(retry.elapsed, 3),
            "error": repr(exc),
            "fault": failure_discriminant(exc),
        }
        if progress.value is TerminalProgress.RECORDED:
            logger.error(
                "workflow completion hit an unretryable failure AFTER its terminal was durably "
                "recorded; the run is terminal, but the bookkeeping that follows did not complete: %s",
                exc,
                extra=fields,
            )
        else:
            logger.error(
                "workflow completion hit an unretryable failure; the run stays Running until the "
                "next engine's recovery or an operator acts: %s",
                exc,
                extra=fields,
            )
        return
    if progress.value is TerminalProgress.RECORDED:
        logger.info(
            "workflow completion is durable after a transient failure: the terminal is in history "
            "(visibility is refreshed by the attempt that ran the bookkeeping; if this attempt stood "
            "down on an already-durable terminal, a visibility row may lag until the next reconcile)",
            extra=_log_fields(lease, attempts=retry.attempts),
        )
    else:
        logger.info(
            "workflow completion retry stood down without recording: the terminal is no longer this "
            "lease's to write",
            extra=_log_fields(lease, attempts=retry.attempts),
        )
