"""Projections: pure functions over event lists.

Status, settlement, timers and failures are always *derived* from history.
Every "is it terminal?" question goes through :func:`current_lease_terminal`, or
through its incremental form :attr:`RunState.ended` (the recorder keeps one
:class:`RunState` per run, so per-step checks do not re-scan the history; the
property tests hold the two to the same answers on every prefix).
"""

from __future__ import annotations

import enum
import hashlib
import json
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any, TypeGuard, final

import attrs

from ._events import (
    SCOPE_TIMEOUT_TYPE,
    TERMINAL_TYPES,
    ActivityCancelled,
    ActivityCompleted,
    ActivityError,
    ActivityFailed,
    ActivityScheduled,
    ActivityStarted,
    ChildWorkflowCancelled,
    ChildWorkflowCompleted,
    ChildWorkflowFailed,
    ChildWorkflowStarted,
    ErrorInfo,
    Event,
    EventBody,
    MarkerRecorded,
    SearchAttributesUpserted,
    SearchValue,
    SignalReceived,
    TimerCancelCause,
    TimerCancelled,
    TimerFired,
    TimerStarted,
    UpdateAccepted,
    UpdateCompleted,
    WorkflowCancelled,
    WorkflowCancelRequested,
    WorkflowCompleted,
    WorkflowContinuedAsNew,
    WorkflowFailed,
    WorkflowReopened,
    WorkflowReset,
    WorkflowStarted,
    WorkflowStatus,
    WorkflowTimedOut,
)
from ._ids import (
    ASYNC_MARKER_PREFIX,
    CHILD_CANCEL_MARKER_PREFIX,
    DEADLINE_TIMER_PREFIX,
    EVENT_MARKER_PREFIX,
    EVENT_READ_MARKER_PREFIX,
    EXTERNAL_MARKER_PREFIX,
    HEARTBEAT_MARKER_PREFIX,
    PATCH_MARKER_PREFIX,
    inbox_request_id,
)
from ._payload import Payload

_body_of = operator.attrgetter("body")


def _kinds(events: Sequence[Event]) -> list[type]:
    """The body types of ``events``, built at C speed (a long history's scans search this list)."""
    return list(map(type, map(_body_of, events)))


def _positions(kinds: list[type], kind: type) -> list[int]:
    """Where ``kind`` occurs in ``kinds``, ascending (each search runs in C: starts are few)."""
    out: list[int] = []
    i = -1
    while True:
        try:
            i = kinds.index(kind, i + 1)
        except ValueError:
            return out
        out.append(i)


def _first_of(kinds: list[type], wanted: Iterable[type]) -> int | None:
    """The lowest position in ``kinds`` of any type in ``wanted``, or ``None``."""
    found: int | None = None
    for kind in wanted:
        try:
            i = kinds.index(kind, 0, len(kinds) if found is None else found)
        except ValueError:
            continue
        found = i
    return found


#: Below this many events a plain loop beats building the list of body types.
_SHORT = 64


def _of_types(
    events: Sequence[Event], wanted: Iterable[type], kinds: list[type] | None = None
) -> list[Event]:
    """The events of ``events`` whose body type is one of ``wanted``, in order.

    A fold that only looks at a few rare types (timers, search attributes) finds
    them by C-speed searches of ``kinds`` (the body types of ``events``, built here
    if not given) instead of walking a long history event by event in Python.
    """
    if kinds is None:
        if len(events) <= _SHORT:
            chosen = frozenset(wanted)
            return [event for event in events if type(event.body) in chosen]
        kinds = _kinds(events)
    positions: list[int] = []
    for kind in wanted:
        positions += _positions(kinds, kind)
    positions.sort()
    return [events[i] for i in positions]


def run_segment(events: Sequence[Event], run_id: str) -> list[Event]:
    """That run's events: from its ``WorkflowStarted`` up to (not including) the next one.

    Empty if the run never started in ``events``.
    """
    # Find the starts, then slice: a long history is never walked event by event in Python.
    starts = _positions(_kinds(events), WorkflowStarted)
    for n, i in enumerate(starts):
        if events[i].body.run_id == run_id:  # type: ignore[attr-defined]
            end = starts[n + 1] if n + 1 < len(starts) else len(events)
            return list(events[i:end])
    return []


_LEASE_OPENERS = frozenset({WorkflowStarted, WorkflowReopened})


def current_lease_terminal(segment: Sequence[Event]) -> Event | None:
    """Scan backwards: the first terminal event, or ``None`` if a start/reopen comes first."""
    if len(segment) > _SHORT:
        kinds = _kinds(segment)
        kinds.reverse()
        i = _first_of(kinds, (*TERMINAL_TYPES, *_LEASE_OPENERS))
        if i is None:
            return None
        event = segment[len(segment) - 1 - i]
        return event if event.body.TERMINAL else None
    openers = _LEASE_OPENERS
    for event in reversed(segment):
        body = event.body
        if body.TERMINAL:
            return event
        if type(body) in openers:
            return None
    return None


def run_ids(events: Sequence[Event]) -> list[str]:
    """Run ids in the order their runs started."""
    return [events[i].body.run_id for i in _positions(_kinds(events), WorkflowStarted)]  # type: ignore[attr-defined]


def latest_run_id(events: Sequence[Event]) -> str | None:
    """The id of the workflow's latest run (``None`` for an empty history)."""
    ids = run_ids(events)
    return ids[-1] if ids else None


@final
@attrs.frozen
class LatestRun:
    """What recovery and the visibility row ask of a workflow's latest run, from one pass.

    Each field is what its projection gives (``run_id``: :func:`latest_run_id`,
    ``segment``: :func:`run_segment` of it, ``status``: :func:`workflow_status`,
    ``terminal``: :func:`current_lease_terminal` of the segment); ``kinds`` are the
    segment's body types, for further folds over it (:func:`search_attributes_of`,
    :func:`outstanding_timers`) without another walk of a long history.
    """

    run_id: str
    segment: list[Event]
    status: WorkflowStatus
    terminal: Event | None
    kinds: list[type] = attrs.field(repr=False, eq=False)


def latest_run(events: Sequence[Event]) -> LatestRun | None:
    """The workflow's latest run (``None`` if no run started): the body types of the
    history are listed once, and every answer is searched for in that list."""
    kinds = _kinds(events)
    starts = _positions(kinds, WorkflowStarted)
    if not starts:
        return None
    last = starts[-1]
    run_id: str = events[last].body.run_id  # type: ignore[attr-defined]
    # run_segment: the first start of that id, up to the next start.
    for n, i in enumerate(starts):
        if events[i].body.run_id == run_id:  # type: ignore[attr-defined]
            end = starts[n + 1] if n + 1 < len(starts) else len(events)
            break
    segment = list(events[i:end])
    segment_kinds = kinds[i:end]
    # The last lifecycle event is at or after the last start (a lifecycle event itself).
    tail = kinds[last:]
    tail.reverse()
    found = _first_of(tail, _STATUS_BY_LIFECYCLE)
    assert found is not None  # the start at ``last`` is one
    status = _STATUS_BY_LIFECYCLE[tail[found]]
    reverse = segment_kinds[::-1]
    opener = _first_of(reverse, (*TERMINAL_TYPES, *_LEASE_OPENERS))
    terminal = None
    if opener is not None:
        event = segment[len(segment) - 1 - opener]
        terminal = event if event.body.TERMINAL else None
    return LatestRun(run_id=run_id, segment=segment, status=status, terminal=terminal, kinds=segment_kinds)


_STATUS_BY_TERMINAL: Mapping[type, WorkflowStatus] = {
    WorkflowCompleted: WorkflowStatus.COMPLETED,
    WorkflowFailed: WorkflowStatus.FAILED,
    WorkflowCancelled: WorkflowStatus.CANCELLED,
    WorkflowTimedOut: WorkflowStatus.TIMED_OUT,
    WorkflowContinuedAsNew: WorkflowStatus.CONTINUED_AS_NEW,
    WorkflowReset: WorkflowStatus.RESET,
}


_STATUS_BY_LIFECYCLE: Mapping[type, WorkflowStatus] = {
    WorkflowStarted: WorkflowStatus.RUNNING,
    WorkflowReopened: WorkflowStatus.RUNNING,
    **_STATUS_BY_TERMINAL,
}


def status_after(previous: WorkflowStatus | None, events: Sequence[Event]) -> WorkflowStatus | None:
    """Fold ``events`` into a status: the last lifecycle event wins.

    Lets a store keep a status column up to date from each appended batch.
    ``None`` means "no lifecycle event yet".
    """
    # The last one wins: look for it from the end.
    lifecycle = _STATUS_BY_LIFECYCLE
    if len(events) > _SHORT:
        kinds = _kinds(events)
        kinds.reverse()
        i = _first_of(kinds, lifecycle)
        return previous if i is None else lifecycle[kinds[i]]
    for event in reversed(events):
        status = lifecycle.get(type(event.body))
        if status is not None:
            return status
    return previous


def workflow_status(events: Sequence[Event]) -> WorkflowStatus | None:
    """The workflow's status (its latest run's); ``None`` for an empty history."""
    return status_after(None, events)


def run_status(events: Sequence[Event], run_id: str) -> WorkflowStatus | None:
    """One run's status; ``None`` if that run never started."""
    return status_after(None, run_segment(events, run_id))


def is_active_status(status: WorkflowStatus | None) -> bool:
    """Whether a workflow with this status needs an engine's attention.

    Running workflows, and workflows whose last lifecycle event is
    ``WorkflowContinuedAsNew``: their successor's start is owed (the recovery
    sweep starts it).  This is what ``EventStore.list_active`` returns.
    """
    return status in (WorkflowStatus.RUNNING, WorkflowStatus.CONTINUED_AS_NEW)


def is_active(events: Sequence[Event]) -> bool:
    """Whether the workflow's latest run is still running (the status ``workflow_status`` projects)."""
    return is_active_status(workflow_status(events))


def _settles(body: EventBody) -> TypeGuard[ActivityCompleted | ActivityCancelled | ActivityFailed]:
    """Whether ``body`` settles its activity (a non-final failure is only a trail record)."""
    return isinstance(body, (ActivityCompleted, ActivityCancelled)) or (
        isinstance(body, ActivityFailed) and body.final
    )


def activity_settled(segment: Sequence[Event], activity_id: int) -> Event | None:
    """The event that settled the activity in this segment, or ``None``.

    Settling events: ``ActivityCompleted``, ``ActivityFailed(final=True)`` and
    ``ActivityCancelled``.  A non-final ``ActivityFailed`` is a trail record.
    A ``WorkflowReopened`` un-settles the activities it names.
    """
    settled: Event | None = None
    for event in segment:
        body = event.body
        if _settles(body) and body.activity_id == activity_id:
            settled = event
        elif isinstance(body, WorkflowReopened) and activity_id in body.reopened_activity_ids:
            settled = None
    return settled


def activity_settled_or_run_ended(events: Sequence[Event], run_id: str, activity_id: int) -> bool:
    """Whether, in ``run_id``'s segment of ``events``, the activity is settled or the current
    lease has a terminal: ``activity_settled(seg, id) is not None or current_lease_terminal(seg)
    is not None`` with ``seg = run_segment(events, run_id)``, in one backward pass that stops
    at the run's start.  (The recorder answers it per record from its incremental
    :class:`RunState` instead; the tests hold the two to the same answers.)"""
    ended: bool | None = None
    settled: bool | None = None
    for event in reversed(events):
        body = event.body
        if isinstance(body, WorkflowStarted):
            if body.run_id == run_id:
                return bool(ended) or bool(settled)
            ended = settled = None  # what was seen so far belongs to a later run
            continue
        if ended is None:
            if body.TERMINAL:
                ended = True
            elif isinstance(body, WorkflowReopened):
                ended = False
        if settled is None:
            if _settles(body) and body.activity_id == activity_id:
                settled = True
            elif isinstance(body, WorkflowReopened) and activity_id in body.reopened_activity_ids:
                settled = False
    return False


def scheduled_activities(segment: Sequence[Event]) -> dict[int, ActivityScheduled]:
    """The ``ActivityScheduled`` bodies of ``segment`` (one run's events) by activity id."""
    return {e.body.activity_id: e.body for e in segment if isinstance(e.body, ActivityScheduled)}


def unsettled_activities(segment: Sequence[Event]) -> list[int]:
    """Scheduled activity ids with no settling event, ascending (the fold of :func:`activity_settled`
    for every activity at once)."""
    scheduled: set[int] = set()
    settled: set[int] = set()
    for event in segment:
        body = event.body
        if isinstance(body, ActivityScheduled):
            scheduled.add(body.activity_id)
        elif _settles(body):
            settled.add(body.activity_id)
        elif isinstance(body, WorkflowReopened):
            settled.difference_update(body.reopened_activity_ids)
    return sorted(scheduled - settled)


def failures_ending_the_run(segment: Sequence[Event], terminal: Event) -> list[int]:
    """The activities whose final failure the run ended on (what a reopen runs again).

    Settled (still, in this lease) by a final ``ActivityFailed`` recorded after the
    code's last command and before the terminal: the code issued nothing after
    observing it.  A failure the code caught and went on from is older than its
    next command and stays settled; a timeout scope's expiry is the workflow's
    own decision, which replay makes again, not an outcome to retry.
    """
    settled: dict[int, Event] = {}
    last_command = 0
    for event in segment:
        if event.seq >= terminal.seq:
            break
        body = event.body
        if command_key(body) is not None:
            last_command = event.seq
        if _settles(body):
            settled[body.activity_id] = event
        elif isinstance(body, WorkflowReopened):
            for activity_id in body.reopened_activity_ids:
                settled.pop(activity_id, None)
    return sorted(
        activity_id
        for activity_id, event in settled.items()
        if isinstance(event.body, ActivityFailed)
        and event.seq > last_command
        and event.body.error.type != SCOPE_TIMEOUT_TYPE
    )


@attrs.frozen(kw_only=True)
class AttemptRecord:
    """One entry of an activity's recorded retry trail."""

    attempt: int
    started_at: datetime | None
    outcome: str  # "running", "completed", "failed", "cancelled"
    error: ActivityError | None = None
    final: bool = False
    #: A non-final failure: when its next attempt is due (``None``: at once).
    retry_at: datetime | None = None


def retry_trail(segment: Sequence[Event], activity_id: int) -> list[AttemptRecord]:
    """Each recorded attempt of the activity, in order, with its outcome."""
    trail: dict[int, AttemptRecord] = {}
    for event in segment:
        body = event.body
        if getattr(body, "activity_id", None) != activity_id:
            continue
        if isinstance(body, ActivityStarted):
            trail[body.attempt] = AttemptRecord(
                attempt=body.attempt, started_at=event.recorded_at, outcome="running"
            )
        elif isinstance(body, (ActivityCompleted, ActivityFailed, ActivityCancelled)):
            previous = trail.get(body.attempt)
            started = previous.started_at if previous else None
            if isinstance(body, ActivityCompleted):
                rec = AttemptRecord(attempt=body.attempt, started_at=started, outcome="completed", final=True)
            elif isinstance(body, ActivityFailed):
                rec = AttemptRecord(
                    attempt=body.attempt,
                    started_at=started,
                    outcome="failed",
                    error=body.error,
                    final=body.final,
                    retry_at=body.retry_at,
                )
            else:
                rec = AttemptRecord(attempt=body.attempt, started_at=started, outcome="cancelled", final=True)
            trail[body.attempt] = rec
    return [trail[k] for k in sorted(trail)]


def next_delivery_attempt(segment: Sequence[Event], activity_id: int) -> int | None:
    """The attempt number a re-dispatch of this activity should carry, or ``None`` if settled.

    If the last recorded attempt has started but has no outcome, it is
    re-delivered under the same number (worker lost: no budget consumed).  If
    the last attempt failed non-finally, the next number follows.
    """
    if activity_settled(segment, activity_id) is not None:
        return None
    if activity_id not in scheduled_activities(segment):
        return None
    trail = retry_trail(segment, activity_id)
    if not trail:
        return 1
    last = trail[-1]
    if last.outcome == "running":
        return last.attempt
    return last.attempt + 1


_TIMER_FOLD_TYPES = frozenset({TimerStarted, TimerFired, TimerCancelled, WorkflowReopened})


@attrs.frozen(kw_only=True)
class OutstandingTimer:
    """A timer started and neither fired nor cancelled: its id and when it is due."""

    timer_id: str
    fire_at: datetime


def outstanding_timers(segment: Sequence[Event], kinds: list[type] | None = None) -> list[OutstandingTimer]:
    """Timers started in this segment and neither fired nor cancelled, by fire time.

    A ``WorkflowReopened`` re-arms timers retired by a cancel teardown.  ``kinds``:
    the segment's body types, if the caller has them (:attr:`LatestRun.kinds`).
    """
    started: dict[str, datetime] = {}
    done: set[str] = set()
    teardown: set[str] = set()
    for event in _of_types(segment, _TIMER_FOLD_TYPES, kinds):
        body = event.body
        if isinstance(body, TimerStarted):
            started[body.timer_id] = body.fire_at
            done.discard(body.timer_id)
            teardown.discard(body.timer_id)
        elif isinstance(body, TimerFired):
            done.add(body.timer_id)
            teardown.discard(body.timer_id)
        elif isinstance(body, TimerCancelled):
            done.add(body.timer_id)
            # Only a teardown cancel is undone by a reopen; a later fire or an
            # intentional cancel retires the timer for good.
            if body.cause is TimerCancelCause.CANCEL_TEARDOWN:
                teardown.add(body.timer_id)
            else:
                teardown.discard(body.timer_id)
        elif isinstance(body, WorkflowReopened):
            done -= teardown
            teardown.clear()
    pending = [OutstandingTimer(timer_id=t, fire_at=at) for t, at in started.items() if t not in done]
    return sorted(pending, key=lambda t: (t.fire_at, t.timer_id))


def timer_resolved(segment: Sequence[Event], timer_id: str) -> Event | None:
    """The ``TimerFired``/``TimerCancelled`` that resolved the timer, or ``None``.

    A cancel-teardown retirement followed by a ``WorkflowReopened`` no longer
    resolves the timer: the reopen re-armed it (as :func:`outstanding_timers`).
    """
    reopened_since = False
    for event in reversed(segment):
        body = event.body
        if isinstance(body, WorkflowReopened):
            reopened_since = True
        elif isinstance(body, (TimerFired, TimerCancelled)) and body.timer_id == timer_id:
            if (
                reopened_since
                and isinstance(body, TimerCancelled)
                and body.cause is TimerCancelCause.CANCEL_TEARDOWN
            ):
                return None
            return event
        if isinstance(body, TimerStarted) and body.timer_id == timer_id:
            return None
    return None


_RESOLUTIONS = (
    ActivityCompleted,
    ActivityFailed,
    ActivityCancelled,
    TimerFired,
    TimerCancelled,
    SignalReceived,
)
_FAILED_RESOLUTIONS = (ActivityFailed, ActivityCancelled)


def reset_points(segment: Sequence[Event]) -> list[int]:
    """The seqs of a run's events a reset may copy its history up to, ascending.

    A point is a step boundary where the run's code decided what to do next with nothing
    in flight: the run's ``WorkflowStarted``, or the resolution of a command (an
    activity settled, a timer fired or cancelled by the code) or a signal's arrival,
    after which no activity is unsettled and no timer but the run's deadline is
    outstanding.  Only the run's first lease counts (points before a cancel request,
    a terminal or a reopen), and none after a child workflow's start (a child's derived
    id names the run that started it, so a new run could not replay it).
    """
    if not segment or not isinstance(segment[0].body, WorkflowStarted):
        return []
    run_id = segment[0].body.run_id
    deadline = f"{DEADLINE_TIMER_PREFIX}{run_id}"
    points = [segment[0].seq]
    unsettled: set[int] = set()
    timers: set[str] = set()
    for event in segment[1:]:
        body = event.body
        if body.TERMINAL or isinstance(
            body, (WorkflowCancelRequested, WorkflowReopened, ChildWorkflowStarted)
        ):
            break
        if isinstance(body, ActivityScheduled):
            unsettled.add(body.activity_id)
        elif _settles(body):
            unsettled.discard(body.activity_id)
        elif isinstance(body, TimerStarted):
            if body.timer_id != deadline:
                timers.add(body.timer_id)
        elif isinstance(body, (TimerFired, TimerCancelled)):
            timers.discard(body.timer_id)
        # (A failed attempt another follows leaves its activity unsettled.)
        if isinstance(body, _RESOLUTIONS) and not unsettled and not timers:
            points.append(event.seq)
    return points


def last_step(segment: Sequence[Event]) -> int | None:
    """The reset point of the run's last step that did not end in a failure: where a
    reset recovers a failed run (the failed step and what followed run again)."""
    by_seq = {e.seq: e for e in segment}
    for seq in reversed(reset_points(segment)):
        if not isinstance(by_seq[seq].body, _FAILED_RESOLUTIONS):
            return seq
    return None


@attrs.frozen(kw_only=True)
class FailureSummary:
    """Why a run failed, for visibility: the failed step (if any) and the reason."""

    failed_step: str | None
    reason: str
    error: ErrorInfo


def failure(segment: Sequence[Event]) -> FailureSummary | None:
    """The current lease's failure, or ``None`` if the run has not failed.

    ``failed_step`` names the activity whose final failure is the latest one
    still settling it (``"activity:N <type>"``) when there is one; an activity
    a reopen un-settled and that later succeeded is not the failed step.
    """
    terminal = current_lease_terminal(segment)
    if terminal is None or not isinstance(terminal.body, WorkflowFailed):
        return None
    error = terminal.body.error
    # Same fold as activity_settled, for every activity at once: id -> (position, settling body).
    settled: dict[int, tuple[int, EventBody]] = {}
    for position, event in enumerate(segment):
        body = event.body
        if _settles(body):
            settled[body.activity_id] = (position, body)
        elif isinstance(body, WorkflowReopened):
            for activity_id in body.reopened_activity_ids:
                settled.pop(activity_id, None)
    failed = [(pos, body) for pos, body in settled.values() if isinstance(body, ActivityFailed)]
    step: str | None = None
    if failed:
        _, last = max(failed, key=lambda item: item[0])
        sched = scheduled_activities(segment).get(last.activity_id)
        kind = f" {sched.activity_type}" if sched else ""
        step = f"activity:{last.activity_id}{kind}"
    return FailureSummary(failed_step=step, reason=f"{error.type}: {error.message}", error=error)


_SEARCH_FOLD_TYPES = frozenset({WorkflowStarted, SearchAttributesUpserted})


def search_attributes(events: Sequence[Event], run_id: str | None = None) -> dict[str, SearchValue]:
    """The run's search attributes: its start's, then each upsert in order (latest run by default)."""
    rid = run_id if run_id is not None else latest_run_id(events)
    if rid is None:
        return {}
    return search_attributes_of(run_segment(events, rid))


def search_attributes_of(segment: Sequence[Event], kinds: list[type] | None = None) -> dict[str, SearchValue]:
    """The search attributes of the run whose segment is ``segment`` (``kinds``: its body
    types, if the caller has them): its start's, then each upsert in order."""
    attrs_now: dict[str, SearchValue] = {}
    for event in _of_types(segment, _SEARCH_FOLD_TYPES, kinds):
        body = event.body
        if isinstance(body, WorkflowStarted):
            attrs_now.update(body.search_attributes)
        elif isinstance(body, SearchAttributesUpserted):
            attrs_now.update(body.attributes)
    return attrs_now


def start_event(events: Sequence[Event], run_id: str) -> Event | None:
    """The ``WorkflowStarted`` event of run ``run_id`` (``None`` if the history has no such run)."""
    seg = run_segment(events, run_id)
    return seg[0] if seg else None


@final
@attrs.frozen
class CommandKey:
    """What one workflow command is, as replay compares it
    (docs/architecture.md, "Replay reproduces the command sequence").

    ``kind`` and ``name`` must be equal; ``ident`` too (a child's workflow id).
    ``digest`` (of the encoded arguments) is compared only when both sides have
    one: a history recorded before digests existed still replays.
    """

    kind: str
    name: str
    ident: str = ""
    digest: str | None = None

    def matches(self, requested: CommandKey) -> bool:
        return (
            self.kind == requested.kind
            and self.name == requested.name
            and self.ident == requested.ident
            and (self.digest is None or requested.digest is None or self.digest == requested.digest)
        )

    def describe(self) -> str:
        if self.kind == COMMAND_CHILD:
            return f"child {self.name!r} with id {self.ident!r}"
        if self.kind == COMMAND_TIMER_CANCEL:
            return f"cancel of timer {self.name!r}"
        if self.kind == COMMAND_ACTIVITY_CANCEL:
            return f"cancel of activity:{self.name}"
        if self.kind == COMMAND_CHILD_CANCEL:
            return f"cancel of child #{self.name}"
        if self.kind == COMMAND_SEARCH_ATTRIBUTES:
            return "search-attribute upsert"
        if self.kind == COMMAND_SIGNAL_EXTERNAL:
            return f"signal {self.name!r} to workflow {self.ident!r}"
        if self.kind == COMMAND_CANCEL_EXTERNAL:
            return f"cancel of workflow {self.ident!r}"
        if self.kind == COMMAND_SET_EVENT:
            return f"set_event {self.name!r}"
        if self.kind == COMMAND_GET_EVENT:
            return f"get_event {self.name!r} of workflow {self.ident!r}"
        if self.kind == COMMAND_UPDATE:
            return f"completion of update {self.name!r}"
        return f"{self.kind} {self.name!r}"


COMMAND_ACTIVITY = "activity"
COMMAND_TIMER = "timer"
COMMAND_TIMER_CANCEL = "timer cancel"
COMMAND_CHILD = "child workflow"
COMMAND_ACTIVITY_CANCEL = "activity cancel"
COMMAND_CHILD_CANCEL = "child cancel"
COMMAND_PATCH = "patch"
COMMAND_SEARCH_ATTRIBUTES = "search attributes"
COMMAND_SIGNAL_EXTERNAL = "external signal"
COMMAND_CANCEL_EXTERNAL = "external cancel"
COMMAND_SET_EVENT = "set event"
COMMAND_GET_EVENT = "get event"
COMMAND_UPDATE = "update completion"


def _activity_command(body: ActivityScheduled) -> CommandKey:
    return CommandKey(COMMAND_ACTIVITY, body.activity_type, digest=body.input_digest)


def _activity_cancel_command(body: ActivityCancelled) -> CommandKey | None:
    if not body.by_workflow:
        return None  # the engine's (terminate, a cancellation, a deadline), not the code's
    return CommandKey(COMMAND_ACTIVITY_CANCEL, str(body.activity_id))


def _timer_command(body: TimerStarted) -> CommandKey | None:
    if body.timer_id.startswith(DEADLINE_TIMER_PREFIX):
        return None  # the engine's workflow deadline, not the code's
    return CommandKey(COMMAND_TIMER, body.timer_id)


def _timer_cancel_command(body: TimerCancelled) -> CommandKey | None:
    if body.cause is not TimerCancelCause.WORKFLOW_INTENT or body.timer_id.startswith(DEADLINE_TIMER_PREFIX):
        return None  # a teardown's retirement, or the engine retiring its deadline
    return CommandKey(COMMAND_TIMER_CANCEL, body.timer_id)


def _child_command(body: ChildWorkflowStarted) -> CommandKey:
    return CommandKey(COMMAND_CHILD, body.workflow_type, body.child_workflow_id, body.input_digest)


def _marker_command(body: MarkerRecorded) -> CommandKey | None:
    if body.name.startswith(PATCH_MARKER_PREFIX):
        return CommandKey(COMMAND_PATCH, body.name[len(PATCH_MARKER_PREFIX) :])
    if body.name.startswith(CHILD_CANCEL_MARKER_PREFIX):
        return CommandKey(COMMAND_CHILD_CANCEL, body.name[len(CHILD_CANCEL_MARKER_PREFIX) :])
    if body.name.startswith(EXTERNAL_MARKER_PREFIX):
        return external_command(body.value)
    if body.name.startswith(EVENT_READ_MARKER_PREFIX):
        read = body.value.value()
        return CommandKey(COMMAND_GET_EVENT, read["key"], read["workflow_id"])
    if body.name.startswith(EVENT_MARKER_PREFIX):
        published = body.value.value()
        return CommandKey(COMMAND_SET_EVENT, published["key"], digest=event_value_digest(published["value"]))
    # A child's options marker (CHILD_MARKER_PREFIX) is part of its ChildWorkflowStarted
    # command; other markers (an external message's outcome) are not commands.
    return None


def external_command(intent: Payload) -> CommandKey:
    """The command key of a message to another workflow, from its recorded intent
    (``{"kind": "signal"|"cancel", "workflow_id": ..., "name": ..., "digest": ...}``)."""
    fields = json.loads(intent.json)
    kind = COMMAND_SIGNAL_EXTERNAL if fields.get("kind") == "signal" else COMMAND_CANCEL_EXTERNAL
    return CommandKey(kind, fields.get("name", ""), fields.get("workflow_id", ""), fields.get("digest"))


def event_value_digest(value: Any) -> str:
    """The digest a ``ctx.set_event`` command key carries: of the encoded value's JSON."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).hexdigest()


def published_event(events: Sequence[Event], key: str) -> Payload | None:
    """The value the workflow last published for ``key`` with ``ctx.set_event`` (in any of
    its runs: the latest write wins), or ``None`` if it never did."""
    for event in reversed(events):
        body = event.body
        if isinstance(body, MarkerRecorded) and body.name.startswith(EVENT_MARKER_PREFIX):
            published = body.value.value()
            if published["key"] == key:
                return Payload.of(published["value"])
    return None


def last_heartbeat_details(segment: Sequence[Event], activity_id: int) -> Payload | None:
    """The heartbeat details last recorded for the activity's attempts in a run's segment."""
    name = f"{HEARTBEAT_MARKER_PREFIX}{activity_id}"
    for event in reversed(segment):
        body = event.body
        if isinstance(body, MarkerRecorded) and body.name == name:
            return Payload.of(body.value.value()["details"])
    return None


def awaits_async_completion(segment: Sequence[Event], activity_id: int, attempt: int) -> bool:
    """Whether the activity's ``attempt`` went over to async completion (its code returned
    saying it completes later) in a run's segment."""
    name = f"{ASYNC_MARKER_PREFIX}{activity_id}"
    for event in reversed(segment):
        body = event.body
        if isinstance(body, MarkerRecorded) and body.name == name:
            return bool(body.value.value().get("attempt") == attempt)
    return False


class AttemptStanding(enum.Enum):
    """Where one activity attempt stands in a run's segment (what a task token may do with it)."""

    #: Started, no outcome yet: it may be completed, failed or heartbeaten.
    OPEN = "open"
    #: Its outcome is recorded: a completion.
    COMPLETED = "completed"
    #: Its outcome is recorded: a failure (a retry may follow).
    FAILED = "failed"
    #: Over in another way: cancelled, a later attempt, the activity or the run settled.
    CLOSED = "closed"
    #: Never started (no such activity or attempt in this run).
    UNKNOWN = "unknown"


def attempt_standing(segment: Sequence[Event], activity_id: int, attempt: int) -> AttemptStanding:
    """Where ``attempt`` of activity ``activity_id`` stands in a run's segment."""
    if not segment:
        return AttemptStanding.UNKNOWN
    standing = AttemptStanding.UNKNOWN
    for event in segment:
        body = event.body
        if getattr(body, "activity_id", None) != activity_id:
            continue
        if isinstance(body, ActivityStarted):
            if body.attempt == attempt:
                standing = AttemptStanding.OPEN
            elif body.attempt > attempt and standing is AttemptStanding.OPEN:
                standing = AttemptStanding.CLOSED
        elif isinstance(body, ActivityCompleted) and body.attempt == attempt:
            standing = AttemptStanding.COMPLETED
        elif isinstance(body, ActivityFailed) and body.attempt == attempt:
            standing = AttemptStanding.FAILED
        elif (
            isinstance(body, (ActivityCompleted, ActivityFailed, ActivityCancelled))
            and standing is AttemptStanding.OPEN
        ):
            standing = AttemptStanding.CLOSED
    if standing is AttemptStanding.OPEN and current_lease_terminal(segment) is not None:
        return AttemptStanding.CLOSED
    return standing


def event_answer(events: Sequence[Event], key: str) -> dict[str, Any] | None:
    """What a workflow-side read of ``key`` finds in the target's ``events``: the published
    value, ``closed`` (a closed workflow that never published it), ``not_found`` (an empty
    history), or ``None`` (not published yet: keep waiting)."""
    if not events:
        return {"outcome": "not_found"}
    published = published_event(events, key)
    if published is not None:
        return {"outcome": "published", "value": published.value()}
    if not is_active(events):
        return {"outcome": "closed"}
    return None


def search_attributes_digest(attributes: Mapping[str, SearchValue]) -> str:
    """The digest an upsert's command key carries: replay compares the values, not only
    that an upsert happened (key order does not matter; value types do)."""
    items = {key: list(value) if isinstance(value, tuple) else value for key, value in attributes.items()}
    text = json.dumps(items, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).hexdigest()


def _upsert_command(body: SearchAttributesUpserted) -> CommandKey:
    return CommandKey(COMMAND_SEARCH_ATTRIBUTES, "", digest=search_attributes_digest(body.attributes))


def _update_command(body: UpdateCompleted) -> CommandKey:
    return CommandKey(COMMAND_UPDATE, body.update_id)


_COMMAND_KEYS: Mapping[type, Callable[[Any], CommandKey | None]] = {
    ActivityScheduled: _activity_command,
    ActivityCancelled: _activity_cancel_command,
    TimerStarted: _timer_command,
    TimerCancelled: _timer_cancel_command,
    ChildWorkflowStarted: _child_command,
    MarkerRecorded: _marker_command,
    SearchAttributesUpserted: _upsert_command,
    UpdateCompleted: _update_command,
}


def command_key(body: EventBody) -> CommandKey | None:
    """The command ``body`` records, or ``None`` if it is not one of the code's commands.

    The one classification of events for replay: workflow code's commands are
    activity schedules and the code's cancels of them, timer starts and
    intentional cancels (sleeps, named timers, signal-wait timeouts, ``scope:``
    timeout scopes), child starts and cancel requests (``cancel-child:`` markers),
    ``ctx.patched`` markers and search-attribute upserts.  Everything else is an
    observation or the engine's own record: activity attempts and outcomes,
    retry trails, timer fires, signals, child outcomes, cancel requests,
    teardown retirements, ``deadline:`` timers, lifecycle events.  A run's
    terminal (completion, continue-as-new) is compared at the code's exit.
    """
    maker = _COMMAND_KEYS.get(type(body))
    return maker(body) if maker is not None else None


@final
class RunState:
    """An incremental index of one run's segment of the recorder's history."""

    def __init__(self, run_id: str, history: Sequence[Event]) -> None:
        self.run_id = run_id
        self._history = history
        self._cursor = 0
        self._inside = False
        self._ended = False
        self.start: Event | None = None
        self.scheduled: dict[int, Event] = {}
        self.settled: dict[int, Event] = {}
        #: When a reopen last un-settled each activity it named.
        self.reopened_at: dict[int, datetime] = {}
        self.markers: dict[str, Event] = {}
        #: The run's commands in the order recorded (:func:`command_key`), with their events.
        self.commands: list[tuple[CommandKey, Event]] = []
        self.started_attempt: dict[int, int] = {}
        self.timers: dict[str, Event] = {}
        self.timer_resolutions: dict[str, Event] = {}
        self.signals: dict[str, list[Event]] = {}
        #: Accepted updates in the order recorded, and the recorded outcomes by update id.
        self.updates: list[Event] = []
        self.update_outcomes: dict[str, Event] = {}
        #: Child commands by ordinal, the open ones by child id, outcomes by ordinal.
        self.children: dict[int, Event] = {}
        self.open_children: dict[str, int] = {}
        self.child_resolutions: dict[int, Event] = {}
        #: The cancel request in force (a reopen withdraws earlier ones).
        self.cancel_request: Event | None = None
        #: A terminal recorded while the code still runs was written from outside
        #: (terminate, deadline): the code must not observe what came with it.
        self.ended: Event | None = None
        #: The run's status (:func:`run_status` of its segment); ``None`` until it started.
        self.status: WorkflowStatus | None = None

    def sync(self) -> None:
        """Index events appended since the last call."""
        history = self._history
        n = len(history)
        while self._cursor < n and not self._ended:
            event = history[self._cursor]
            self._cursor += 1
            body = event.body
            kind = type(body)
            # An activity step's three events first, by exact type (the bulk of a long
            # history); each does here exactly what its branch below does.
            if self._inside:
                if kind is ActivityStarted:
                    self.started_attempt[body.activity_id] = body.attempt  # type: ignore[attr-defined]
                    continue
                if kind is ActivityCompleted:
                    self.settled[body.activity_id] = event  # type: ignore[attr-defined]
                    continue
                if kind is ActivityScheduled:
                    self.commands.append((_activity_command(body), event))  # type: ignore[arg-type]
                    self.scheduled[body.activity_id] = event  # type: ignore[attr-defined]
                    continue
            if isinstance(body, WorkflowStarted):
                if self._inside:
                    self._ended = True
                    break
                if body.run_id == self.run_id:
                    self._inside = True
                    self.start = event
                    self.status = WorkflowStatus.RUNNING
                continue
            if not self._inside:
                continue
            maker = _COMMAND_KEYS.get(type(body))
            if maker is not None:
                key = maker(body)
                if key is not None:
                    self.commands.append((key, event))
            if isinstance(body, ActivityScheduled):
                self.scheduled[body.activity_id] = event
            elif isinstance(body, MarkerRecorded):
                self.markers[body.name] = event
            elif isinstance(body, ActivityStarted):
                self.started_attempt[body.activity_id] = body.attempt
            elif isinstance(body, (ActivityCompleted, ActivityCancelled)):
                self.settled[body.activity_id] = event
            elif isinstance(body, ActivityFailed):
                if body.final:
                    self.settled[body.activity_id] = event
            elif isinstance(body, WorkflowReopened):
                for activity_id in body.reopened_activity_ids:
                    self.settled.pop(activity_id, None)
                    self.reopened_at[activity_id] = event.recorded_at
                self.cancel_request = None
                self.ended = None
                self.status = WorkflowStatus.RUNNING
                # Timers a cancel teardown retired are armed again.
                for timer_id, resolution in list(self.timer_resolutions.items()):
                    resolved = resolution.body
                    if (
                        isinstance(resolved, TimerCancelled)
                        and resolved.cause is TimerCancelCause.CANCEL_TEARDOWN
                    ):
                        del self.timer_resolutions[timer_id]
            elif body.TERMINAL:
                self.ended = event
                self.status = _STATUS_BY_TERMINAL[type(body)]
            elif isinstance(body, WorkflowCancelRequested):
                if self.cancel_request is None:
                    self.cancel_request = event
            elif isinstance(body, ChildWorkflowStarted):
                ordinal = len(self.children)
                self.children[ordinal] = event
                self.open_children[body.child_workflow_id] = ordinal
            elif isinstance(body, (ChildWorkflowCompleted, ChildWorkflowFailed, ChildWorkflowCancelled)):
                settled = self.open_children.pop(body.child_workflow_id, None)
                if settled is not None:
                    self.child_resolutions[settled] = event
            elif isinstance(body, MarkerRecorded):
                self.markers.setdefault(body.name, event)
            elif isinstance(body, TimerStarted):
                self.timers[body.timer_id] = event
                self.timer_resolutions.pop(body.timer_id, None)
            elif isinstance(body, SignalReceived):
                self.signals.setdefault(body.name, []).append(event)
            elif isinstance(body, UpdateAccepted):
                self.updates.append(event)
            elif isinstance(body, UpdateCompleted):
                self.update_outcomes.setdefault(body.update_id, event)
            elif isinstance(body, (TimerFired, TimerCancelled)):
                self.timer_resolutions.setdefault(body.timer_id, event)


def accepted_update(events: Sequence[Event], update_id: str) -> RecordedRequest | None:
    """Where the ``UpdateAccepted`` of ``update_id`` was recorded (in any run), if it was."""
    run_id: str | None = None
    for event in events:
        body = event.body
        if isinstance(body, WorkflowStarted):
            run_id = body.run_id
        elif isinstance(body, UpdateAccepted) and body.update_id == update_id and run_id is not None:
            return RecordedRequest(event=event, run_id=run_id)
    return None


def update_outcome(events: Sequence[Event], update_id: str) -> Event | None:
    """The ``UpdateCompleted`` recorded for ``update_id``, if any (in any run)."""
    for event in events:
        body = event.body
        if isinstance(body, UpdateCompleted) and body.update_id == update_id:
            return event
    return None


def request_of(body: EventBody) -> str | None:
    """The request id (idempotency key) an event was recorded under, if any.

    A signal recorded before request ids existed names its inbox command by
    number; it counts as that command's default request id ``inbox:N``.
    """
    request_id: str | None = getattr(body, "request_id", None)
    if request_id is None and isinstance(body, SignalReceived) and body.command_id is not None:
        return inbox_request_id(body.command_id)
    return request_id


@final
@attrs.frozen
class RecordedRequest:
    """Where a request id was recorded: the event and the run whose segment holds it."""

    event: Event
    run_id: str


def recorded_request(events: Sequence[Event], request_id: str) -> RecordedRequest | None:
    """The event recorded under ``request_id`` anywhere in the workflow's history (every run)."""
    run_id: str | None = None
    for event in events:
        body = event.body
        if isinstance(body, WorkflowStarted):
            run_id = body.run_id
        if run_id is not None and request_of(body) == request_id:
            return RecordedRequest(event, run_id)
    return None
