"""``EngineCore``: the engine's internals, shared by the run tasks, dispatchers and completion path."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

import trio

from .. import _children as children
from .._activities import (
    ActivityDispatcher,
    ActivityRequest,
)
from .._childspec import child_marker_name
from .._clock import EngineClock
from .._cluster import ClusterServices
from .._completion import (
    TerminalIntent,
    forget_retired,
    handle_run_exit,
    reconcile_registry,
    teardown_bodies,
)
from .._definitions import ActivityDefinition, WorkflowDefinition
from .._epoch import EngineEpoch
from .._errors import (
    BackendUnavailable,
    EngineEpochClosed,
    NotOwner,
    SequenceConflict,
    StoreError,
    UnknownActivityType,
    UnknownWorkflowType,
    WorkflowFenced,
)
from .._events import (
    SCOPE_TIMEOUT_TYPE,
    ActivityCancelled,
    ActivityError,
    ActivityFailed,
    ChildWorkflowStarted,
    Event,
    FailureCause,
    MarkerRecorded,
    TimeoutKind,
    TimerCancelCause,
    TimerCancelled,
    TimerFired,
    TimerStarted,
    WorkflowContinuedAsNew,
    WorkflowStarted,
    WorkflowStatus,
    WorkflowTimedOut,
    input_digest,
)
from .._hub import ClientCommands
from .._ids import (
    deadline_timer_id,
)
from .._observe import ObserverHub, RecoveryFinished
from .._payload import Payload
from .._poison import RecoveryGuard, poison_reason
from .._ports import (
    CancelTimer,
    RunAborted,
    ScheduleActivity,
    StartChild,
    StartTimer,
    WorkflowCommand,
    WorkflowPort,
)
from .._projections import (
    RunState,
    current_lease_terminal,
    latest_run_id,
    outstanding_timers,
    retry_trail,
    run_segment,
    workflow_status,
)
from .._recorder import Recorder
from .._registry import Lease, Registry, Residency
from .._retry import TransientBackoff, until_available
from .._run_port import LeasePort
from .._store import (
    ClusterStore,
    EventStore,
    Store,
    VisibilityRow,
    VisibilityStore,
)
from .._transient import Transient
from .config import EngineConfig
from .dispatch import ActivityDispatch
from .log import logger
from .recorders import Recorders
from .runner import Runner
from .timers import Timers
from .visibility import VisibilityRows
from .window import ScheduleWindow, schedule_bodies


def _lease_fields(lease: Lease) -> dict[str, Any]:
    """A lease's log fields."""
    return {"workflow_id": lease.workflow_id, "run_id": lease.run_id, "lease": lease.lease_id}


class EngineCore:
    """The engine's internals, shared by the run tasks, dispatchers and completion path."""

    def __init__(
        self,
        *,
        store: Store,
        epoch: EngineEpoch,
        workflows: Mapping[str, WorkflowDefinition[Any]],
        activities: Mapping[str, ActivityDefinition[Any]],
        config: EngineConfig,
        clock: EngineClock,
        dispatcher: ActivityDispatcher,
        observers: ObserverHub | None = None,
        cluster: ClusterStore | None = None,
        service_threads: trio.CapacityLimiter | None = None,
    ) -> None:
        self.store = store
        #: The engine's observers; ``None`` (nobody observes) costs nothing.
        self.observers = observers
        self.events: EventStore = store.events
        self.visibility: VisibilityStore = store.visibility
        if observers is not None:
            self.events = observers.wrap_events(self.events)
            self.visibility = observers.wrap_visibility(self.visibility)
        self.epoch = epoch
        self.workflows = workflows
        self.activities = activities
        self.config = config
        self.codec = config.codec
        self.clock = clock
        self.dispatcher = dispatcher
        self.registry = Registry()
        self.stuck: dict[str, str] = {}
        #: The startup sweep's poison-run bookkeeping (``None``: the store cannot count).
        self.recovery_guard: RecoveryGuard | None = None
        #: Cluster mode: the waker, sweeper and remote commands (set by ``open_engine``).
        self.cluster_services: ClusterServices | None = None
        #: Cluster mode: the store's node capability (``None``: a single-owner store).
        self.cluster = cluster
        #: Commands as a client sends them (set by ``open_engine``): children cancel and
        #: terminate a child through them, so in cluster mode they reach its owner.
        self.client_commands: ClientCommands | None = None
        #: How every path of this engine retries a transient store fault.
        self.transient = Transient(config.completion_retry, epoch, observers)
        self.timers = Timers(
            events=self.events,
            clock=clock,
            epoch=epoch,
            transient=self.transient,
            cluster_mode=cluster is not None,
            recorder_for=self.recorder_for,
            deadline_teardown=self.deadline_teardown,
        )
        #: Threads for wall-clock waits of the engine's services.
        self.service_threads = service_threads or trio.CapacityLimiter(2)
        #: The recorder cache and its fencing.
        self.recorders = Recorders(
            events=self.events,
            epoch=epoch,
            clock=clock,
            registry=self.registry,
            forget=self._forget_workflow,
            recover=self.recover_one,
            observers=observers,
            cluster=cluster,
        )
        #: Runs: their leases and tasks.
        self.runner = Runner(
            recorders=self.recorders,
            registry=self.registry,
            epoch=epoch,
            clock=clock,
            codec=self.codec,
            workflows=workflows,
            stuck=self.stuck,
            port_for=self._port_for,
            run_exit=self._run_exit,
            upsert_visibility=self.upsert_visibility_quietly,
            recover=self.recover_one,
            guard=self._guarded,
            arm_timer=self.timers.arm,
        )
        self.activity_dispatch = ActivityDispatch(
            epoch=epoch,
            config=config,
            clock=clock,
            dispatcher=dispatcher,
            transient=self.transient,
            registry=self.registry,
            cluster_mode=cluster is not None,
            held=self._held_for_recovery,
            mark_stuck=self.mark_stuck,
        )
        #: The running activity attempts' cancel scopes (the dispatch service's).
        self.inflight = self.activity_dispatch.inflight
        self.visibility_rows = VisibilityRows(
            visibility=self.visibility,
            epoch=epoch,
            config=config,
            cluster=cluster,
            recorder_for=self.recorder_for,
            stuck_reason=lambda workflow_id: self.stuck.get(workflow_id),
        )
        self.window = ScheduleWindow(
            clock=clock,
            epoch=epoch,
            config=config,
            cluster_mode=cluster is not None,
            park_if_closing=self._park_if_closing,
        )

    # -- definitions -------------------------------------------------------

    def workflow_definition(self, workflow: WorkflowDefinition[Any] | str) -> WorkflowDefinition[Any]:
        name = workflow if isinstance(workflow, str) else getattr(workflow, "name", None)
        found = self.workflows.get(name) if isinstance(name, str) else None
        if found is None:
            raise UnknownWorkflowType(str(name if name is not None else workflow), sorted(self.workflows))
        return found

    def activity_definition(self, activity: ActivityDefinition[Any] | str) -> ActivityDefinition[Any]:
        name = activity if isinstance(activity, str) else getattr(activity, "name", None)
        found = self.activities.get(name) if isinstance(name, str) else None
        if found is None:
            raise UnknownActivityType(str(name if name is not None else activity), sorted(self.activities))
        return found

    def resolved_activity_options(
        self, definition: ActivityDefinition[Any], call_layer: Mapping[str, Any]
    ) -> tuple[str, Payload]:
        return self.activity_dispatch.resolved_options(definition, call_layer)

    # -- recorders (aion_trio/_engine/recorders.py) ---------------------------

    async def recorder_for(self, workflow_id: str) -> Recorder:
        return await self.recorders.recorder_for(workflow_id)

    async def take_fresh(self, workflow_id: str) -> None:
        await self.recorders.take_fresh(workflow_id)

    def loaded_recorder(self, workflow_id: str) -> Recorder | None:
        return self.recorders.loaded_recorder(workflow_id)

    def drives(self, workflow_id: str) -> bool:
        return self.recorders.drives(workflow_id)

    def claim_unloaded(self, workflow_id: str) -> Recorder | None:
        return self.recorders.claim_unloaded(workflow_id)

    def release_unloaded(self, recorder: Recorder, *, adopt: bool) -> None:
        self.recorders.release_unloaded(recorder, adopt=adopt)

    @property
    def relinquished(self) -> int:
        """Cluster mode: workflows this engine stopped because another node claimed them."""
        return self.recorders.relinquished

    def _forget_workflow(self, workflow_id: str) -> None:
        """A workflow's recorder was dropped: cancel its runs and attempts, drop its timers,
        leases and stuck mark.  No checkpoint."""
        for lease in self.registry.leases_of(workflow_id):
            self.registry.remove(workflow_id, lease.run_id)
            if lease.cancel_scope is not None:
                lease.cancel_scope.cancel()
        for key, scope in list(self.inflight.items()):
            if key[0] == workflow_id:
                scope.cancel()
        self.timers.drop_workflow(workflow_id)
        self.stuck.pop(workflow_id, None)

    # -- runs (aion_trio/_engine/runner.py) ----------------------------------

    def resume_idle_soon(self, workflow_id: str) -> None:
        self.runner.resume_idle_soon(workflow_id)

    async def resume_idle(self, workflow_id: str) -> None:
        await self.runner.resume_idle(workflow_id)

    async def reopen_locked(
        self,
        recorder: Recorder,
        run_id: str,
        workflow_type: str,
        activity_ids: Sequence[int] = (),
        request_id: str | None = None,
    ) -> Lease:
        return await self.runner.reopen_locked(recorder, run_id, workflow_type, activity_ids, request_id)

    def new_lease(self, recorder: Recorder, run_id: str, workflow_type: str) -> Lease:
        return self.runner.new_lease(recorder, run_id, workflow_type)

    def spawn_run(self, lease: Lease) -> None:
        self.runner.spawn_run(lease)

    async def mark_stuck(self, lease: Lease, reason: str) -> None:
        await self.runner.mark_stuck(lease, reason)

    async def start_successor(self, lease: Lease, terminal: WorkflowContinuedAsNew) -> Lease | None:
        return await self.runner.start_successor(lease, terminal)

    def _port_for(self, lease: Lease) -> WorkflowPort:
        return LeasePort(self, lease)

    async def _run_exit(self, lease: Lease, intent: TerminalIntent) -> None:
        await handle_run_exit(self, lease, intent)

    async def _guarded(
        self, what: str, fields: Mapping[str, Any], fn: Callable[..., Awaitable[Any]], *args: Any
    ) -> None:
        await children.guarded(self, what, fields, fn, *args)

    # -- commands from workflow code ---------------------------------------

    def _park_if_closing(self, lease: Lease, what: str) -> None:
        """A closing engine records no more of a run's steps: unwind it (replay resumes it)."""
        if not self.epoch.admitting:
            logger.info(
                "run parked: the engine is shutting down (%s not recorded)", what, extra=_lease_fields(lease)
            )
            raise RunAborted()

    async def _append_with_retry(
        self, lease: Lease, what: str, build: Any, *, keep_deferred: bool = False
    ) -> None:
        """Append what ``build(history)`` returns (re-evaluated per attempt), retrying transient
        failures.  Unrecoverable failures unwind the run without a terminal.  ``keep_deferred``:
        ``build`` does not depend on deferred records, which then share this append."""
        recorder = lease.recorder
        backoff: TransientBackoff | None = None  # built on the first transient failure
        while True:
            self._park_if_closing(lease, what)
            try:
                async with recorder.hold():
                    history = await recorder.current_history(keep_deferred=keep_deferred)
                    bodies = build(history)
                    if bodies and recorder.run_state(lease.run_id).ended is not None:
                        # The run was ended elsewhere (terminate, deadline): record nothing more.
                        raise RunAborted()
                    if bodies:
                        await recorder.append(bodies, action=what, run_id=lease.run_id)
                return
            except BackendUnavailable as exc:
                if backoff is None:
                    ladder = self.config.completion_retry
                    backoff = TransientBackoff(ladder.initial, ladder.ceiling, logger, _lease_fields(lease))
                await backoff.failed(what, exc)
            except EngineEpochClosed:
                raise RunAborted() from None
            except NotOwner as exc:
                if isinstance(exc, WorkflowFenced) and self.cluster is not None:
                    raise RunAborted() from exc  # relinquished by the recorder's fence hook
                await self.mark_stuck(lease, f"could not {what}: {exc}")
                raise RunAborted() from exc
            except SequenceConflict as exc:
                if self.cluster is not None:
                    raise RunAborted() from exc  # a stale copy, relinquished by the recorder's hook
                await self.mark_stuck(lease, f"could not {what}: {exc}")
                raise RunAborted() from exc
            except StoreError as exc:
                await self.mark_stuck(lease, f"could not {what}: {type(exc).__name__}: {exc}")
                raise RunAborted() from exc

    async def record_commands(
        self,
        lease: Lease,
        state: RunState,
        pending: Sequence[WorkflowCommand],
    ) -> None:
        """Record a run's pending commands as one batch, then start what they start."""

        def build(history: Sequence[Event]) -> list[Any]:
            state.sync()
            bodies: list[Any] = []
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
                elif (p.timer_id in state.timers or p.timer_id in started_now) and (
                    p.timer_id not in state.timer_resolutions
                ):
                    bodies.append(TimerCancelled(timer_id=p.timer_id, cause=TimerCancelCause.WORKFLOW_INTENT))
            return bodies

        window = self.config.activity_schedule_window
        if window and all(isinstance(p, ScheduleActivity) for p in pending):
            at = await self._defer_schedules(lease, state, pending)
            if at is not None:
                self._owe(lease.recorder, window)
                for p in pending:
                    assert isinstance(p, ScheduleActivity)
                    self.dispatch(lease.recorder, self._first_request(lease, p, at))
                return
        await self._append_with_retry(lease, "record workflow commands", build, keep_deferred=True)
        state.sync()
        for p in pending:
            if isinstance(p, StartTimer):
                await self.arm_timer(lease.workflow_id, lease.run_id, p.timer_id, p.fire_at)
            elif isinstance(p, CancelTimer):
                await self.forget_timer(lease.workflow_id, p.timer_id)
            elif isinstance(p, StartChild):
                await self.start_recorded_child(lease, p.ordinal)
            else:
                scheduled = state.scheduled.get(p.ordinal)
                at = scheduled.recorded_at if scheduled is not None else None
                self.dispatch(lease.recorder, self._first_request(lease, p, at))

    @staticmethod
    def _first_request(lease: Lease, p: ScheduleActivity, scheduled_at: datetime | None) -> ActivityRequest:
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

    # -- the schedule window (moved to ``window``; these delegate) -------------

    async def _defer_schedules(
        self, lease: Lease, state: RunState, pending: Sequence[Any]
    ) -> datetime | None:
        return await self.window.defer(lease, state, pending)

    def _owe(self, recorder: Recorder, window: float) -> None:
        self.window.owe(recorder, window)

    async def deferral_service(self) -> None:
        await self.window.serve()

    async def write_all_deferred(self) -> None:
        await self.window.write_all()

    async def _decide_under_lock(self, lease: Lease, what: str, decide: Any) -> Event:
        """Run ``decide(history) -> (existing_event | None, body_to_append)`` under the lock,
        retrying transient failures; returns the event that settles the await."""
        result: list[Event] = []

        def build(history: Sequence[Event]) -> list[Any]:
            result.clear()
            existing, body = decide(history)
            if existing is not None:
                result.append(existing)
                return []
            return [body]

        await self._append_with_retry(lease, what, build)
        if result:
            return result[0]
        return lease.recorder.history[-1]

    async def record_activity_scope_timeout(
        self, lease: Lease, state: RunState, activity_id: int, scope_timer: str
    ) -> Event:
        """A timeout scope expired while awaiting an activity: record the activity's final
        failure (unless it settled first, under the lock) and stop its running attempt."""

        def decide(history: Sequence[Event]) -> tuple[Event | None, Any]:
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

        event = await self._decide_under_lock(lease, f"record the timeout of activity:{activity_id}", decide)
        state.sync()
        scope = self.inflight.get((lease.workflow_id, lease.run_id, activity_id))
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

        def build(history: Sequence[Event]) -> list[Any]:
            state.sync()
            cancelled.clear()
            segment = run_segment(history, lease.run_id)
            bodies: list[Any] = []
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

        await self._append_with_retry(lease, "cancel the awaited activities", build)
        state.sync()
        for activity_id in cancelled:
            scope = self.inflight.get((lease.workflow_id, lease.run_id, activity_id))
            if scope is not None:
                scope.cancel()

    async def record_timer_scope_timeout(
        self, lease: Lease, state: RunState, timer_id: str, scope_timer: str
    ) -> Event:
        """A timeout scope expired during a sleep: cancel the sleep's timer (unless it fired first)."""

        def decide(history: Sequence[Event]) -> tuple[Event | None, Any]:
            state.sync()
            resolved = state.timer_resolutions.get(timer_id)
            if resolved is not None:
                return resolved, None
            return None, TimerCancelled(timer_id=timer_id, cause=TimerCancelCause.WORKFLOW_INTENT)

        event = await self._decide_under_lock(lease, f"cancel timer {timer_id} on timeout", decide)
        state.sync()
        if isinstance(event.body, TimerCancelled):
            await self.forget_timer(lease.workflow_id, timer_id)
        return event

    # -- child workflows (aion_trio/_children.py) ---------------------------------

    async def start_recorded_child(self, lease: Lease, ordinal: int) -> None:
        """Start the child whose ``ChildWorkflowStarted`` (ordinal ``ordinal``) the run just recorded."""
        child = next(
            (
                c
                for c in children.open_children(lease.recorder.history, lease.workflow_id, lease.run_id)
                if c.ordinal == ordinal
            ),
            None,
        )
        if child is None:
            return  # settled already (it cannot be, short of a second writer): nothing to start
        await children.guarded(
            self,
            "start a child workflow",
            {
                "workflow_id": lease.workflow_id,
                "run_id": lease.run_id,
                "child_workflow_id": child.workflow_id,
            },
            children.start_child_run,
            self,
            lease.workflow_id,
            lease.run_id,
            child,
        )

    async def cancel_recorded_child(self, lease: Lease, ordinal: int) -> None:
        """Deliver the cancel request the run recorded for its child ``ordinal`` (idempotent:
        a child already asked, or already closed, is left as it is)."""
        child = next(
            (
                c
                for c in children.open_children(lease.recorder.history, lease.workflow_id, lease.run_id)
                if c.ordinal == ordinal
            ),
            None,
        )
        if child is None:
            return  # its outcome is recorded: nothing to cancel
        await children.guarded(
            self,
            "cancel a child workflow",
            {
                "workflow_id": lease.workflow_id,
                "run_id": lease.run_id,
                "child_workflow_id": child.workflow_id,
            },
            children.cancel_child,
            self,
            lease.workflow_id,
            child,
        )

    async def run_closed(self, workflow_id: str, run_id: str) -> None:
        """Hook: the run's terminal is durable.  Applies its children's parent-close policy
        and delivers a child's final outcome to its parent.  Idempotent; never raises."""
        await children.run_closed(self, workflow_id, run_id)

    # -- the timer service (moved to ``timers``; these delegate) ---------------

    async def arm_timer(self, workflow_id: str, run_id: str, timer_id: str, fire_at: datetime) -> None:
        await self.timers.arm(workflow_id, run_id, timer_id, fire_at)

    async def timer_service(self) -> None:
        await self.timers.serve()

    async def fire_timer(self, workflow_id: str, run_id: str, timer_id: str) -> bool:
        return await self.timers.fire(workflow_id, run_id, timer_id)

    async def record_marker(self, lease: Lease, name: str, value: Payload) -> None:
        def build(history: Sequence[Event]) -> list[Any]:
            segment = run_segment(history, lease.run_id)
            if any(isinstance(e.body, MarkerRecorded) and e.body.name == name for e in segment):
                return []
            return [MarkerRecorded(name=name, value=value)]

        await self._append_with_retry(lease, f"record marker {name}", build)

    # -- activities --------------------------------------------------------

    def _held_for_recovery(self, recorder: Recorder, request: ActivityRequest, resume: bool) -> bool:
        return self.recovery_guard is not None and self.recovery_guard.hold(recorder, request, resume)

    def dispatch(self, recorder: Recorder, request: ActivityRequest, *, resume: bool = False) -> None:
        self.activity_dispatch.dispatch(recorder, request, resume=resume)

    def cancel_inflight(self, workflow_id: str, run_id: str) -> int:
        return self.activity_dispatch.cancel_inflight(workflow_id, run_id)

    async def redispatch_unsettled(self, recorder: Recorder, run_id: str) -> int:
        return await self.activity_dispatch.redispatch_unsettled(recorder, run_id)

    async def forget_timer(self, workflow_id: str, timer_id: str) -> None:
        await self.timers.forget(workflow_id, timer_id)

    # -- visibility (moved to ``visibility``; these delegate) -------------------

    def visibility_row(self, workflow_id: str, history: Sequence[Event]) -> VisibilityRow | None:
        return self.visibility_rows.row(workflow_id, history)

    async def upsert_visibility(self, workflow_id: str) -> None:
        await self.visibility_rows.upsert(workflow_id)

    async def upsert_visibility_quietly(self, workflow_id: str) -> None:
        await self.visibility_rows.upsert_quietly(workflow_id)

    async def refresh_visibility_soon(self, workflow_id: str) -> None:
        await self.visibility_rows.refresh_soon(workflow_id)

    async def visibility_settled(self) -> None:
        await self.visibility_rows.settled()

    async def reconcile_visibility(self, active: set[str]) -> None:
        await self.visibility_rows.reconcile(active)

    # -- ending a run from outside (terminate, deadline) ----------------------

    def stop_run_locally(self, workflow_id: str, run_id: str, terminal: Event) -> None:
        """After a terminal recorded from outside the run's task: wake waiters, stop the
        run's code and its in-flight dispatches.  No checkpoint: call it right after the
        append, so the run's code never observes the teardown batch."""
        lease = self.registry.get(workflow_id, run_id)
        if lease is not None:
            if lease.cancel_scope is not None:
                lease.cancel_scope.cancel()
            lease.completion.notify(terminal)
            reconcile_registry(self, lease)
        self.cancel_inflight(workflow_id, run_id)

    async def deadline_teardown(self, recorder: Recorder, run_id: str) -> bool:
        """The workflow deadline fired: record ``WorkflowTimedOut`` if no terminal exists,
        stop the run, upsert visibility, and retire the deadline **last** (it is the
        teardown's resume anchor: a teardown interrupted midway is redone by recovery)."""
        workflow_id = recorder.workflow_id
        deadline = deadline_timer_id(run_id)
        timed_out = False
        async with recorder.lock:
            self.epoch.gate(workflow_id, run_id, "time out the workflow")
            history = await recorder.current_history()
            segment = run_segment(history, run_id)
            if not any(t.timer_id == deadline for t in outstanding_timers(segment)):
                return False  # already retired
            if current_lease_terminal(segment) is None:
                bodies: list[Any] = [
                    WorkflowTimedOut(timeout_kind=TimeoutKind.DEADLINE),
                    *(
                        b
                        for b in teardown_bodies(segment, run_id, retire_timers=True)
                        if getattr(b, "timer_id", None) != deadline
                    ),
                ]
                events = await recorder.append(bodies, action="time out the workflow", run_id=run_id)
                self.stop_run_locally(workflow_id, run_id, events[0])
                timed_out = True
                await forget_retired(self, workflow_id, bodies)
        if timed_out:
            logger.warning(
                "workflow run timed out (its deadline passed); the run was stopped",
                extra={"workflow_id": workflow_id, "run_id": run_id},
            )
        await self.run_closed(workflow_id, run_id)
        with trio.CancelScope(shield=True), trio.move_on_after(self.config.bookkeeping_timeout):
            await self.upsert_visibility(workflow_id)
        async with recorder.lock:
            self.epoch.gate(workflow_id, run_id, "retire the workflow deadline")
            history = await recorder.current_history()
            segment = run_segment(history, run_id)
            if any(t.timer_id == deadline for t in outstanding_timers(segment)):
                await recorder.append(
                    [TimerFired(timer_id=deadline)], action="retire the deadline", run_id=run_id
                )
        await self.forget_timer(workflow_id, deadline)
        return timed_out

    # -- recovery -----------------------------------------------------------

    async def recover(self) -> None:
        """The startup sweep: resume every active workflow; one failure does not stop the others.

        Cluster mode: the active workflows this node owns (re-claimed) and the
        orphans it can claim now, not every active workflow of the store.
        """
        began = trio.current_time()
        active = await self._list_recoverable()
        guard = self.recovery_guard = RecoveryGuard.for_core(self)
        if guard is not None:
            await guard.count(active)
        resumed = 0
        try:
            for workflow_id in active:
                if await self.recover_one(workflow_id):
                    resumed += 1
        finally:
            if guard is not None:
                await guard.release()
        if active:
            logger.info(
                "recovery resumed %d of %d active workflows",
                resumed,
                len(active),
                extra={"active": len(active), "resumed": resumed},
            )
        await self.resume_teardowns(set(active))
        await self.reconcile_visibility(set(active))
        if self.observers is not None:
            self.observers.emit(
                RecoveryFinished(active=len(active), resumed=resumed, seconds=trio.current_time() - began)
            )

    async def _list_recoverable(self) -> list[str]:
        """The workflows the sweep resumes.  A transient read fault is retried with
        backoff (logged loudly) until the store answers: recovery needs the list."""

        async def listing() -> list[str]:
            if self.cluster is None:
                return await self.events.list_active()
            active = await self.cluster.owned_active()
            return active + await self.cluster.claim_orphans(self.config.sweep_batch)

        ladder = self.config.completion_retry
        return await until_available(
            "list the active workflows for recovery", listing, (ladder.initial, ladder.ceiling), logger
        )

    async def recover_one(self, workflow_id: str) -> bool:
        """Recover one workflow; returns whether it was resumed now.

        A transient fault loading its history (nothing has been done for it yet) is
        retried in the epoch with backoff until it loads or the epoch closes, while
        the sweep goes on; any other failure is logged and marks it stuck.
        """
        resumed: list[bool] = []
        await children.guarded(
            self,
            "load a workflow's history for recovery",
            {"workflow_id": workflow_id},
            self._recover_loaded,
            workflow_id,
            resumed,
        )
        return bool(resumed)

    async def _recover_loaded(self, workflow_id: str, resumed: list[bool]) -> None:
        """Raises only ``BackendUnavailable``, and only before anything was done."""
        try:
            recorder = await self.recorder_for(workflow_id)
        except BackendUnavailable:
            raise
        except Exception as exc:
            self._recovery_failed(workflow_id, exc)
            return
        try:
            await self.recover_workflow(recorder)
        except Exception as exc:
            self._recovery_failed(workflow_id, exc)
            return
        resumed.append(True)

    def _recovery_failed(self, workflow_id: str, exc: Exception) -> None:
        if isinstance(exc, NotOwner):
            return  # claimed by another node meanwhile: relinquished (logged there)
        reason = f"recovery failed: {type(exc).__name__}: {exc}"
        self.stuck[workflow_id] = reason
        logger.error("could not recover workflow: %s", reason, extra={"workflow_id": workflow_id})

    async def resume_teardowns(self, active: set[str]) -> None:
        """Deadline teardowns interrupted by a crash (``WorkflowTimedOut`` recorded, deadline
        not yet retired) are finished; the store's timer index finds them."""
        try:
            due = await self.events.expired_timers(self.clock.now())
        except StoreError as exc:
            logger.warning("could not read the timer index to resume teardowns: %s", exc)
            return
        resumed: list[tuple[datetime, str, str, str]] = []
        for entry in due:
            if entry.workflow_id in active or not entry.timer_id.startswith("deadline:"):
                continue
            if self.cluster is not None:
                # Cluster mode: a teardown another live node owns is that node's to finish.
                try:
                    if await self.cluster.command_target(entry.workflow_id) is not None:
                        continue
                except StoreError as exc:
                    logger.warning("could not tell who finishes a deadline teardown: %s", exc)
                    continue
            run_id = entry.timer_id.removeprefix("deadline:")
            resumed.append((entry.fire_at, entry.workflow_id, run_id, entry.timer_id))
        self.timers.schedule_indexed(resumed)

    async def recover_workflow(self, recorder: Recorder) -> None:
        workflow_id = recorder.workflow_id
        history = recorder.history
        run_id = latest_run_id(history)
        status = workflow_status(history)
        if run_id is None or status is None:
            return
        segment = run_segment(history, run_id)
        start = segment[0].body
        assert isinstance(start, WorkflowStarted)
        if status is WorkflowStatus.RUNNING:
            lease = self.new_lease(recorder, run_id, start.workflow_type)
            guard = self.recovery_guard
            unfinished = guard.poisoned(lease) if guard is not None else None
            if unfinished is not None:
                await self.mark_stuck(lease, poison_reason(unfinished))
                return
            if guard is not None:
                guard.watch(lease)
            if start.workflow_type not in self.workflows:
                await self.mark_stuck(
                    lease,
                    f"workflow type {start.workflow_type!r} is not registered with this engine; register it "
                    "and restart, or terminate the run",
                )
                return
            self.spawn_run(lease)
            await self.redispatch_unsettled(recorder, run_id)
            for timer in outstanding_timers(segment):
                await self.arm_timer(workflow_id, run_id, timer.timer_id, timer.fire_at)
            await children.repair_children(self, recorder, run_id)
            await children.close_if_orphaned(self, recorder, run_id)
        elif status is WorkflowStatus.CONTINUED_AS_NEW:
            terminal = current_lease_terminal(segment)
            if terminal is not None and isinstance(terminal.body, WorkflowContinuedAsNew):
                lease = self.new_lease(recorder, run_id, start.workflow_type)
                lease.residency = Residency.SUSPENDED
                lease.cached_status = WorkflowStatus.CONTINUED_AS_NEW
                await self.start_successor(lease, terminal.body)
        await self.upsert_visibility_quietly(workflow_id)
