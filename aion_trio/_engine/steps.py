"""Steps: recording a run's own workflow commands, then starting what they start.

:class:`StepRecorder` is what a run's port (``LeasePort``) hands its writes to:
the batch of commands a workflow flushes (activities, timers, children, timer
cancels), markers, the settling of activities and timers a timeout scope or a
cancellation ended, and the cancel request for a child.  Each is one append
under the run's recorder lock, its bodies built from the recorder's history on
every attempt, so a retry after an append of unknown outcome finds what landed
and records nothing twice.  A transient failure is retried through the
engine's one retry primitive (:class:`~aion_trio._transient.Transient`) until
it lands, the engine stops admitting, or the workflow is relinquished.  What
it needs of the rest of the engine (dispatch, timers, the schedule window,
children, marking a run stuck) it is given.
"""

from __future__ import annotations

import collections
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from typing import Any, final

import trio

from .. import _children as children
from .._activities import ActivityRequest
from .._childspec import child_marker_name
from .._epoch import EngineEpoch
from .._errors import (
    AionInternalError,
    BackendUnavailable,
    EngineEpochClosed,
    NotOwner,
    NotRunning,
    SequenceConflict,
    StoreError,
    WorkflowFenced,
    WorkflowNotFound,
)
from .._events import (
    SCOPE_TIMEOUT_TYPE,
    ActivityCancelled,
    ActivityError,
    ActivityFailed,
    ChildWorkflowStarted,
    Event,
    EventBody,
    FailureCause,
    MarkerRecorded,
    SearchAttributesUpserted,
    TimerCancelCause,
    TimerCancelled,
    TimerStarted,
    UpdateCompleted,
    input_digest,
)
from .._hub import ChildrenHub
from .._ids import EVENT_READ_RESULT_MARKER_PREFIX, EXTERNAL_OUTCOME_MARKER_PREFIX, external_request_id
from .._payload import Payload
from .._ports import (
    CancelTimer,
    CompleteUpdate,
    ExternalMessage,
    RunAborted,
    ScheduleActivity,
    StartChild,
    StartTimer,
    UpsertSearchAttributes,
    WorkflowCommand,
)
from .._projections import (
    COMMAND_SEARCH_ATTRIBUTES,
    RunState,
    event_answer,
    retry_trail,
    run_segment,
    workflow_status,
)
from .._recorder import Recorder
from .._registry import Lease, Residency
from .._transient import RetryAbandoned, Transient
from .config import EngineConfig
from .dispatch import InflightAttempts
from .log import logger
from .window import ScheduleWindow, schedule_bodies

#: Builds the bodies to append from the recorder's history (re-evaluated per attempt).
Build = Callable[[Sequence[Event]], list[EventBody]]


def lease_fields(lease: Lease) -> dict[str, Any]:
    """A lease's log fields."""
    return {"workflow_id": lease.workflow_id, "run_id": lease.run_id, "lease": lease.lease_id}


def park_if_closing(epoch: EngineEpoch, lease: Lease, what: str) -> None:
    """A closing engine records no more of a run's steps: unwind it (replay resumes it)."""
    if not epoch.admitting:
        logger.info(
            "run parked: the engine is shutting down (%s not recorded)", what, extra=lease_fields(lease)
        )
        raise RunAborted()


def first_request(lease: Lease, p: ScheduleActivity, scheduled_at: datetime | None) -> ActivityRequest:
    """The request of a newly scheduled activity's first attempt."""
    return ActivityRequest(
        workflow_id=lease.workflow_id,
        run_id=lease.run_id,
        activity_id=p.ordinal,
        activity_type=p.definition.name,
        input=p.input,
        attempt=1,
        task_queue=p.task_queue,
        options=p.options,
        scheduled_at=scheduled_at,
    )


@final
class StepRecorder:
    """Records a run's own commands and starts what they start."""

    def __init__(
        self,
        *,
        epoch: EngineEpoch,
        config: EngineConfig,
        transient: Transient,
        cluster_mode: bool,
        window: ScheduleWindow,
        inflight: InflightAttempts,
        children_hub: ChildrenHub,
        loaded_recorder: Callable[[str], Recorder | None],
        dispatch: Callable[[Recorder, ActivityRequest], None],
        arm_timer: Callable[[str, str, str, datetime], Awaitable[None]],
        forget_timer: Callable[[str, str], Awaitable[None]],
        mark_stuck: Callable[[Lease, str], Awaitable[None]],
        refresh_visibility: Callable[[str], Awaitable[None]],
    ) -> None:
        self._epoch = epoch
        self._config = config
        self._transient = transient
        self._cluster_mode = cluster_mode
        self._window = window
        self._inflight = inflight
        self._children_hub = children_hub
        self._loaded_recorder = loaded_recorder
        self._dispatch = dispatch
        self._arm_timer = arm_timer
        self._forget_timer = forget_timer
        self._mark_stuck = mark_stuck
        self._refresh_visibility = refresh_visibility
        #: Event watches in flight (``ctx.get_event`` waiting for another workflow), by the
        #: reading workflow's id: such a run has something in flight here and is not evicted
        #: (the watch records its answer through the run's lease).
        self.watching: collections.Counter[str] = collections.Counter()

    # -- the one append ------------------------------------------------------

    async def append(self, lease: Lease, what: str, build: Build, *, keep_deferred: bool = False) -> None:
        """Append what ``build(history)`` returns under the recorder's lock, retrying a
        transient failure (the engine's one retry) until it lands, the engine stops
        admitting or the workflow is relinquished here.  An append that finds the run
        ended records nothing.  Unrecoverable failures unwind the run without a terminal.
        ``keep_deferred``: ``build`` does not depend on deferred records, which then share
        this append."""
        recorder = lease.recorder

        async def attempt() -> None:
            async with recorder.hold():
                history = await recorder.current_history(keep_deferred=keep_deferred)
                bodies = build(history)
                if bodies and recorder.run_state(lease.run_id).ended is not None:
                    # The run was ended elsewhere (terminate, deadline): record nothing more.
                    raise RunAborted()
                if bodies:
                    await recorder.append(bodies, action=what, run_id=lease.run_id)

        def stop() -> str | None:
            if not self._epoch.admitting:
                return "the engine is shutting down; replay resumes the run"
            if self._loaded_recorder(lease.workflow_id) is not recorder:
                return "the workflow was relinquished here"
            return None

        park_if_closing(self._epoch, lease, what)
        if lease.residency is Residency.EVICTED:
            raise RunAborted()  # evicted: its replay takes the step (cleanup code records nothing)
        try:
            try:
                await attempt()
            except BackendUnavailable as exc:  # the retry is built only when it is needed
                await self._transient.call(what, attempt, logger, lease_fields(lease), after=exc, stop=stop)
        except (EngineEpochClosed, RetryAbandoned):
            raise RunAborted() from None
        except NotOwner as exc:
            if isinstance(exc, WorkflowFenced) and self._cluster_mode:
                raise RunAborted() from exc  # relinquished by the recorder's fence hook
            await self._mark_stuck(lease, f"could not {what}: {exc}")
            raise RunAborted() from exc
        except SequenceConflict as exc:
            if self._cluster_mode:
                raise RunAborted() from exc  # a stale copy, relinquished by the recorder's hook
            await self._mark_stuck(lease, f"could not {what}: {exc}")
            raise RunAborted() from exc
        except StoreError as exc:
            await self._mark_stuck(lease, f"could not {what}: {type(exc).__name__}: {exc}")
            raise RunAborted() from exc

    async def _decide(
        self,
        lease: Lease,
        what: str,
        decide: Callable[[Sequence[Event]], tuple[Event | None, EventBody | None]],
    ) -> Event:
        """Run ``decide(history) -> (existing_event | None, body_to_append)`` under the lock,
        retrying transient failures; returns the event that settles the await."""
        result: list[Event] = []

        def build(history: Sequence[Event]) -> list[EventBody]:
            result.clear()
            existing, body = decide(history)
            if existing is not None:
                result.append(existing)
                return []
            assert body is not None, "a decision appends a body when no event settles it"
            return [body]

        await self.append(lease, what, build)
        if result:
            return result[0]
        return lease.recorder.history[-1]

    # -- the steps -----------------------------------------------------------

    async def record_commands(
        self, lease: Lease, state: RunState, pending: Sequence[WorkflowCommand]
    ) -> None:
        """Record a run's pending commands as one batch, then start what they start."""

        def build(history: Sequence[Event]) -> list[EventBody]:
            state.sync()
            bodies: list[EventBody] = []
            started_now: set[str] = set()
            for p in pending:
                if isinstance(p, ScheduleActivity):
                    if p.ordinal in state.scheduled:
                        continue
                    bodies.extend(schedule_bodies(p))
                elif isinstance(p, StartTimer):
                    if p.timer_id not in state.timers:
                        bodies.append(TimerStarted(timer_id=p.timer_id, fire_at=p.fire_at))
                        started_now.add(p.timer_id)
                elif isinstance(p, StartChild):
                    if p.ordinal not in state.children:
                        bodies.append(
                            ChildWorkflowStarted(
                                child_workflow_id=p.child_workflow_id,
                                workflow_type=p.workflow_type,
                                input=p.input,
                                input_digest=input_digest(p.input),
                            )
                        )
                        bodies.append(
                            MarkerRecorded(name=child_marker_name(p.ordinal), value=p.options.to_payload())
                        )
                elif isinstance(p, UpsertSearchAttributes):
                    if p.ordinal >= _upserts_recorded(state):
                        bodies.append(SearchAttributesUpserted(attributes=p.attributes))
                elif isinstance(p, CompleteUpdate):
                    if p.update_id not in state.update_outcomes:
                        bodies.append(UpdateCompleted(update_id=p.update_id, result=p.result, error=p.error))
                elif (p.timer_id in state.timers or p.timer_id in started_now) and (
                    p.timer_id not in state.timer_resolutions
                ):
                    bodies.append(TimerCancelled(timer_id=p.timer_id, cause=TimerCancelCause.WORKFLOW_INTENT))
            return bodies

        window = self._config.activity_schedule_window
        if window and all(isinstance(p, ScheduleActivity) for p in pending):
            at = await self._window.defer(lease, state, pending)
            if at is not None:
                self._window.owe(lease.recorder, window)
                for p in pending:
                    assert isinstance(p, ScheduleActivity)
                    self._dispatch(lease.recorder, first_request(lease, p, at))
                return
        await self.append(lease, "record workflow commands", build, keep_deferred=True)
        state.sync()
        upserted = False
        for p in pending:
            if isinstance(p, StartTimer):
                await self._arm_timer(lease.workflow_id, lease.run_id, p.timer_id, p.fire_at)
            elif isinstance(p, CancelTimer):
                await self._forget_timer(lease.workflow_id, p.timer_id)
            elif isinstance(p, StartChild):
                await self.start_recorded_child(lease, p.ordinal)
            elif isinstance(p, UpsertSearchAttributes):
                upserted = True
            elif isinstance(p, CompleteUpdate):
                pass  # recorded: the caller waiting in engine.update reads it from history
            else:
                scheduled = state.scheduled.get(p.ordinal)
                at = scheduled.recorded_at if scheduled is not None else None
                self._dispatch(lease.recorder, first_request(lease, p, at))
        if upserted:
            # Visibility follows the new values (rewritten from history after a crash).
            await self._refresh_visibility(lease.workflow_id)

    async def record_marker(self, lease: Lease, name: str, value: Payload) -> None:
        def build(history: Sequence[Event]) -> list[EventBody]:
            segment = run_segment(history, lease.run_id)
            if any(isinstance(e.body, MarkerRecorded) and e.body.name == name for e in segment):
                return []
            return [MarkerRecorded(name=name, value=value)]

        await self.append(lease, f"record marker {name}", build)

    async def record_activity_scope_timeout(
        self, lease: Lease, state: RunState, activity_id: int, scope_timer: str
    ) -> Event:
        """A timeout scope expired while awaiting an activity: record the activity's final
        failure (unless it settled first, under the lock) and stop its running attempt."""

        def decide(history: Sequence[Event]) -> tuple[Event | None, EventBody | None]:
            state.sync()
            settled = state.settled.get(activity_id)
            if settled is not None:
                return settled, None
            trail = retry_trail(run_segment(history, lease.run_id), activity_id)
            error = ActivityError(
                cause=FailureCause.TIMEOUT,
                type=SCOPE_TIMEOUT_TYPE,
                message=f"the timeout scope {scope_timer} expired before activity:{activity_id} finished",
            )
            return None, ActivityFailed(
                activity_id=activity_id, error=error, attempt=trail[-1].attempt if trail else 1, final=True
            )

        event = await self._decide(lease, f"record the timeout of activity:{activity_id}", decide)
        state.sync()
        scope = self._inflight.get((lease.workflow_id, lease.run_id, activity_id))
        if (
            scope is not None
            and isinstance(event.body, ActivityFailed)
            and event.body.error.type == SCOPE_TIMEOUT_TYPE
        ):
            scope.cancel()
        return event

    async def record_activities_cancelled(
        self, lease: Lease, state: RunState, activity_ids: Sequence[int], *, by_workflow: bool = False
    ) -> None:
        """The workflow stopped awaiting these activities because it was cancelled (or, with
        ``by_workflow``, its code cancelled their handles): settle the unsettled ones with
        ``ActivityCancelled`` (one batch, under the lock) and stop their running attempts
        (an async activity's task is cancelled; a thread activity is told).  Idempotent:
        replay finds them settled and records nothing."""
        cancelled: list[int] = []

        def build(history: Sequence[Event]) -> list[EventBody]:
            state.sync()
            cancelled.clear()
            segment = run_segment(history, lease.run_id)
            bodies: list[EventBody] = []
            for activity_id in activity_ids:
                if activity_id in state.settled or activity_id not in state.scheduled:
                    continue
                trail = retry_trail(segment, activity_id)
                bodies.append(
                    ActivityCancelled(
                        activity_id=activity_id,
                        attempt=trail[-1].attempt if trail else 1,
                        by_workflow=True if by_workflow else None,
                    )
                )
                cancelled.append(activity_id)
            return bodies

        await self.append(lease, "cancel the awaited activities", build)
        state.sync()
        for activity_id in cancelled:
            scope = self._inflight.get((lease.workflow_id, lease.run_id, activity_id))
            if scope is not None:
                scope.cancel()

    async def record_timer_scope_timeout(
        self, lease: Lease, state: RunState, timer_id: str, scope_timer: str
    ) -> Event:
        """A timeout scope expired during a sleep: cancel the sleep's timer (unless it fired first)."""

        def decide(history: Sequence[Event]) -> tuple[Event | None, EventBody | None]:
            state.sync()
            resolved = state.timer_resolutions.get(timer_id)
            if resolved is not None:
                return resolved, None
            return None, TimerCancelled(timer_id=timer_id, cause=TimerCancelCause.WORKFLOW_INTENT)

        event = await self._decide(lease, f"cancel timer {timer_id} on timeout", decide)
        state.sync()
        if isinstance(event.body, TimerCancelled):
            await self._forget_timer(lease.workflow_id, timer_id)
        return event

    # -- child workflows (aion_trio/_children.py) -------------------------------

    async def start_recorded_child(self, lease: Lease, ordinal: int) -> None:
        """Start the child whose ``ChildWorkflowStarted`` (ordinal ``ordinal``) the run just recorded."""
        child = _open_child(lease, ordinal)
        if child is None:
            return  # settled already (it cannot be, short of a second writer): nothing to start
        hub = self._children_hub
        await children.guarded(
            hub,
            "start a child workflow",
            _child_fields(lease, child),
            children.start_child_run,
            hub,
            lease.workflow_id,
            lease.run_id,
            child,
        )

    async def cancel_recorded_child(self, lease: Lease, ordinal: int) -> None:
        """Deliver the cancel request the run recorded for its child ``ordinal`` (idempotent:
        a child already asked, or already closed, is left as it is)."""
        child = _open_child(lease, ordinal)
        if child is None:
            return  # its outcome is recorded: nothing to cancel
        hub = self._children_hub
        await children.guarded(
            hub,
            "cancel a child workflow",
            _child_fields(lease, child),
            children.cancel_child,
            hub,
            lease.workflow_id,
            child,
        )

    # -- messages to other workflows (ctx.signal_external / ctx.cancel_external) ------------

    async def deliver_external(self, lease: Lease, ordinal: int, message: ExternalMessage) -> None:
        """Deliver the run's recorded message ``ordinal`` as any client would (in cluster mode
        through the inbox to the node owning the target), then record its outcome marker.
        The request id is derived from the sender's run and the ordinal, so a redelivery
        after a crash between the two is recorded once by the target.  A transient store
        fault is retried; the engine closing unwinds the run (recovery delivers again)."""
        client = self._children_hub.client_commands
        if client is None:
            raise AionInternalError("no client commands were wired into the engine; please report this")
        request_id = external_request_id(lease.workflow_id, lease.run_id, ordinal)
        what = f"deliver message {ordinal} to workflow {message.workflow_id!r}"

        async def attempt() -> dict[str, str]:
            try:
                if message.kind == "signal":
                    await client.signal(
                        message.workflow_id, message.name, message.payload, request_id=request_id
                    )
                else:
                    await client.cancel(message.workflow_id, message.reason, request_id=request_id)
            except WorkflowNotFound:
                return {"outcome": "not_found"}
            except NotRunning as exc:
                # Refused by another node, the error carries no status: read it from history.
                status = getattr(exc, "status", None) or await self._closed_status(message.workflow_id)
                return {"outcome": "closed", "status": status}
            return {"outcome": "delivered"}

        def stop() -> str | None:
            if not self._epoch.admitting:
                return "the engine is shutting down; replay delivers the message again"
            return None

        park_if_closing(self._epoch, lease, what)
        try:
            outcome = await self._transient.call(what, attempt, logger, lease_fields(lease), stop=stop)
        except (EngineEpochClosed, RetryAbandoned):
            raise RunAborted() from None
        await self.record_marker(lease, f"{EXTERNAL_OUTCOME_MARKER_PREFIX}{ordinal}", Payload.of(outcome))

    # -- reading another workflow's durable events (ctx.get_event) ---------------------

    async def look_up_event(self, workflow_id: str, key: str) -> dict[str, Any] | None:
        """What ``workflow_id`` published under ``key`` now: from its recorder if this engine
        drives it, else from the store (``event_answer``)."""
        history, _ = await self._target_history(workflow_id)
        return event_answer(history, key)

    async def _target_history(self, workflow_id: str) -> tuple[Sequence[Event], Recorder | None]:
        hub = self._children_hub
        recorder = hub.loaded_recorder(workflow_id)
        if recorder is not None and (hub.cluster is None or hub.drives(workflow_id)):
            return recorder.history, recorder
        return await hub.events.read_history(workflow_id), None

    def watch_event(self, lease: Lease, ordinal: int, workflow_id: str, key: str, until: datetime) -> None:
        """Wait in the epoch, until ``until`` (the read's timer), for ``workflow_id`` to publish
        ``key`` or close, then record read ``ordinal``'s result.  Woken by the target's appends
        when this engine drives it, else it re-reads the store every sweep interval.  Whichever
        of the result and the timer's fire is recorded first is what the code (and its replay)
        takes; a restart watches again from the replay."""
        name = f"{EVENT_READ_RESULT_MARKER_PREFIX}{ordinal}"
        deadline = self._children_hub.clock.trio_deadline(until)

        async def watch() -> None:
            self.watching[lease.workflow_id] += 1
            try:
                await watching()
            finally:
                self.watching[lease.workflow_id] -= 1
                if not self.watching[lease.workflow_id]:
                    del self.watching[lease.workflow_id]

        async def watching() -> None:
            with trio.move_on_at(deadline):
                while True:
                    history, recorder = await self._target_history(workflow_id)
                    answer = event_answer(history, key)
                    if answer is not None:
                        try:
                            await self.record_marker(lease, name, Payload.of(answer))
                        except RunAborted:
                            pass  # the run ended or moved: its next execution watches again
                        return
                    with trio.move_on_after(self._config.sweep_interval):
                        if recorder is not None:
                            await recorder.wait_changed()
                        else:
                            await trio.sleep_forever()

        try:
            self._epoch.spawn(
                watch, name=f"watch event {key!r} of {workflow_id!r}", workflow_id=lease.workflow_id
            )
        except EngineEpochClosed:
            raise RunAborted() from None

    async def _closed_status(self, workflow_id: str) -> str:
        status = workflow_status(await self._children_hub.events.read_history(workflow_id))
        return status.value if status is not None else "closed"


def _upserts_recorded(state: RunState) -> int:
    """How many search-attribute upserts the run's code has recorded."""
    return sum(1 for key, _ in state.commands if key.kind == COMMAND_SEARCH_ATTRIBUTES)


def _open_child(lease: Lease, ordinal: int) -> children.OpenChild | None:
    return next(
        (
            c
            for c in children.open_children(lease.recorder.history, lease.workflow_id, lease.run_id)
            if c.ordinal == ordinal
        ),
        None,
    )


def _child_fields(lease: Lease, child: children.OpenChild) -> dict[str, Any]:
    return {"workflow_id": lease.workflow_id, "run_id": lease.run_id, "child_workflow_id": child.workflow_id}
