"""Activity dispatch: resolving a call's options, driving attempts, cancelling them.

Each dispatched activity runs as an epoch task around an :class:`ActivityDriver`
(attempts, retries, recording outcomes); its cancel scope is kept by
``(workflow_id, run_id, activity_id)`` so the step recorder and the terminal
path can stop the attempts of what they settled.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, final

import trio

from .._activities import (
    ActivityDispatcher,
    ActivityDriver,
    ActivityOutcome,
    ActivityRequest,
    AwaitingAttempts,
    TaskToken,
)
from .._admission import AdmissionPool, FlowPools, StorePermits
from .._clock import EngineClock
from .._definitions import ActivityDefinition
from .._epoch import EngineEpoch
from .._errors import (
    ActivityAttemptClosed,
    EngineEpochClosed,
    SequenceConflict,
    StoreError,
    WorkflowFenced,
    epoch_closed,
)
from .._events import ActivityScheduled
from .._payload import Payload
from .._projections import (
    AttemptStanding,
    attempt_standing,
    retry_trail,
    run_segment,
)
from .._recorder import Recorder
from .._registry import Lease, Registry
from .._retry import resolve_options
from .._transient import Transient
from .config import EngineConfig
from .log import logger

#: ``held(recorder, request, resume)``: whether the startup sweep keeps the dispatch back
#: (it dispatches it itself once its replays caught up).
HoldForRecovery = Callable[[Recorder, ActivityRequest, bool], bool]


_NOT_OPEN = {
    AttemptStanding.COMPLETED: "its outcome is recorded: completed",
    AttemptStanding.FAILED: "its outcome is recorded: failed",
    AttemptStanding.CLOSED: "it is over (a later attempt, a cancellation, or the activity or its run settled)",
    AttemptStanding.UNKNOWN: "no such attempt started in that run",
}


@final
class InflightAttempts:
    """The running activity attempts' cancel scopes, by ``(workflow_id, run_id, activity_id)``,
    indexed by workflow: whether a workflow has one, and a run's, cost the same at any
    number of attempts in flight (a run's release and end ask for each)."""

    __slots__ = ("_by_workflow",)

    def __init__(self) -> None:
        self._by_workflow: dict[str, dict[tuple[str, int], trio.CancelScope]] = {}

    def get(self, key: tuple[str, str, int]) -> trio.CancelScope | None:
        scopes = self._by_workflow.get(key[0])
        return None if scopes is None else scopes.get((key[1], key[2]))

    def add(self, key: tuple[str, str, int], scope: trio.CancelScope) -> None:
        self._by_workflow.setdefault(key[0], {})[(key[1], key[2])] = scope

    def discard(self, key: tuple[str, str, int], scope: trio.CancelScope) -> None:
        """Forget ``key`` if ``scope`` is still the one held for it."""
        scopes = self._by_workflow.get(key[0])
        if scopes is not None and scopes.get((key[1], key[2])) is scope:
            del scopes[(key[1], key[2])]
            if not scopes:
                del self._by_workflow[key[0]]

    def holds(self, workflow_id: str) -> bool:
        """Whether an attempt of any run of ``workflow_id`` is in flight."""
        return workflow_id in self._by_workflow

    def keys_of(self, workflow_id: str) -> list[tuple[str, str, int]]:
        """The keys of the attempts in flight for ``workflow_id``."""
        scopes = self._by_workflow.get(workflow_id)
        return [] if scopes is None else [(workflow_id, run, activity) for run, activity in scopes]

    def of_workflow(self, workflow_id: str, run_id: str | None = None) -> list[trio.CancelScope]:
        """The scopes of the attempts in flight for ``workflow_id`` (only ``run_id``'s if given)."""
        scopes = self._by_workflow.get(workflow_id)
        if scopes is None:
            return []
        return [scope for (run, _), scope in scopes.items() if run_id is None or run == run_id]


@final
class ActivityDispatch:
    """Dispatches a run's activities and tracks their running attempts."""

    def __init__(
        self,
        *,
        epoch: EngineEpoch,
        config: EngineConfig,
        clock: EngineClock,
        dispatcher: ActivityDispatcher,
        transient: Transient,
        registry: Registry,
        cluster_mode: bool,
        held: HoldForRecovery,
        mark_stuck: Callable[[Lease, str], Awaitable[None]],
        permits: StorePermits | None = None,
        reacquire: Callable[[str], Awaitable[Recorder]] | None = None,
    ) -> None:
        self.epoch = epoch
        self.config = config
        self.clock = clock
        self.dispatcher = dispatcher
        self.transient = transient
        self.registry = registry
        self.cluster_mode = cluster_mode
        self.held = held
        self.mark_stuck = mark_stuck
        #: The running attempts' cancel scopes, by ``(workflow_id, run_id, activity_id)``.
        self.inflight = InflightAttempts()
        #: Their drivers, by the same key (``waiting_remote``: the attempt is on a remote worker).
        self._drivers: dict[tuple[str, str, int], ActivityDriver] = {}
        #: ``Recorders.recorder_for``: a driver whose run was evicted records through it.
        self.reacquire = reacquire
        #: The admission pool of activity attempts (``EngineConfig.max_inflight_activities``):
        #: an attempt beyond it waits for a slot, its own ``timeout`` stopped meanwhile.
        #: With the pools of the limits per activity type and per task queue
        #: (``EngineConfig.activity_limits``, ``task_queue_limits``), whose rates and
        #: cluster-wide bounds ask ``permits`` (the store's, when it has them).
        self.pools = FlowPools(
            AdmissionPool(
                "activities", config.max_inflight_activities, setting="EngineConfig.max_inflight_activities"
            ),
            task_queues=config.task_queue_limits,
            activity_types=config.activity_limits,
            permits=permits,
        )
        self._default_options: dict[str, tuple[str, Payload]] = {}
        #: Attempts that completions and heartbeats by task token reach (async completion).
        self.awaiting = AwaitingAttempts()

    def resolved_options(
        self, definition: ActivityDefinition[Any], call_layer: Mapping[str, Any]
    ) -> tuple[str, Payload]:
        """A call's resolved options: its task queue and the recorded form.

        Calls passing no options of their own resolve alike for one activity,
        so that result is computed once per activity type.
        """
        cached = None if call_layer else self._default_options.get(definition.name)
        if cached is None:
            options = resolve_options(
                call_layer,
                definition.options,
                self.config.activity_defaults,
                default_task_queue=self.config.default_task_queue,
            )
            cached = (options.task_queue, Payload.of(options.to_json()))
            if not call_layer:
                self._default_options[definition.name] = cached
        return cached

    def dispatch(self, recorder: Recorder, request: ActivityRequest, *, resume: bool = False) -> None:
        if self.held(recorder, request, resume):
            return  # the sweep dispatches it once its replays caught up
        try:
            self.epoch.spawn(
                self._drive,
                recorder,
                request,
                resume,
                name=f"activity:{request.workflow_id}:{request.activity_id}",
                workflow_id=request.workflow_id,
                run_id=request.run_id,
            )
        except EngineEpochClosed:
            logger.info(
                "not dispatched: the engine is shutting down; recovery re-dispatches it",
                extra={
                    "workflow_id": request.workflow_id,
                    "run_id": request.run_id,
                    "activity": request.activity_id,
                    "activity_type": request.activity_type,
                },
            )

    async def _drive(self, recorder: Recorder, request: ActivityRequest, resume: bool) -> None:
        key = (request.workflow_id, request.run_id, request.activity_id)
        driver = ActivityDriver(
            recorder,
            self.dispatcher,
            request,
            clock=self.clock,
            transient=self.transient,
            admission=self.pools,
            awaiting=self.awaiting,
            reacquire=None if self.cluster_mode else self.reacquire,
        )
        with trio.CancelScope() as scope:
            self.inflight.add(key, scope)
            self._drivers[key] = driver
            try:
                await driver.run(resume=resume)
            except StoreError as exc:
                # Not transient (those are retried until they land): the run cannot go on.
                if isinstance(exc, (WorkflowFenced, SequenceConflict)) and self.cluster_mode:
                    if isinstance(exc, WorkflowFenced) and recorder.on_fenced is not None:
                        # Also a fence the lease gate found before the attempt ran (a no-op
                        # when the recorder's own fence hook relinquished it already).
                        recorder.on_fenced(recorder, exc)
                    return  # relinquished by the recorder's fence or stale-copy hook
                reason = (
                    f"could not record the outcome of activity:{request.activity_id} "
                    f"{request.activity_type} (attempt {driver.last_attempt}): {type(exc).__name__}: {exc}"
                )
                lease = self.registry.get(request.workflow_id, request.run_id)
                if lease is None:
                    logger.error(
                        "%s", reason, extra={"workflow_id": request.workflow_id, "run_id": request.run_id}
                    )
                else:
                    await self.mark_stuck(lease, reason)
            finally:
                self.inflight.discard(key, scope)
                if self._drivers.get(key) is driver:
                    del self._drivers[key]

    def holds_run(self, workflow_id: str) -> bool:
        """Whether an attempt of ``workflow_id`` runs here (not merely awaits a remote worker's
        outcome): its run must stay resident.  In cluster mode every attempt holds it."""
        for key in self.inflight.keys_of(workflow_id):
            driver = self._drivers.get(key)
            if self.cluster_mode or driver is None or driver.reacquire is None or not driver.waiting_remote:
                return True
        return False

    async def by_token(
        self,
        recorder: Recorder,
        token: TaskToken,
        outcome: ActivityOutcome | None,
        details: Payload | None = None,
    ) -> None:
        """Complete or fail (``outcome``), or heartbeat (``details``), the attempt ``token`` names.

        Decided under the recorder lock from history: an attempt that is not open is refused
        with :class:`ActivityAttemptClosed`, recording nothing, except that a completion
        (failure) of an attempt whose recorded outcome is a completion (failure) returns
        quietly, so a retried call is safe.  An outcome goes to the attempt's driver, which
        records it as the attempt's own (a failure is retried per the policy); this returns
        once it is recorded, or raises the refusal if the attempt ended first.
        """
        if not self.epoch.admitting:
            raise epoch_closed(token.workflow_id, token.run_id, "settle an activity attempt by token")
        what = "heartbeat" if outcome is None else ("completion" if outcome.ok else "failure")
        async with recorder.lock:
            history = await recorder.current_history()
            standing = attempt_standing(run_segment(history, token.run_id), token.activity_id, token.attempt)
            if outcome is not None and standing is (
                AttemptStanding.COMPLETED if outcome.ok else AttemptStanding.FAILED
            ):
                return  # the same outcome is recorded: a retried call
            if standing is not AttemptStanding.OPEN:
                raise ActivityAttemptClosed(
                    token.workflow_id,
                    token.activity_id,
                    token.attempt,
                    f"{_NOT_OPEN[standing]}; refusing a {what}",
                )
            if outcome is None:
                self.awaiting.beat(token.key, details)
                return
            slot = self.awaiting.deliver(token.key, outcome)
        await slot.answered()

    def cancel_attempt(self, workflow_id: str, run_id: str, activity_id: int) -> bool:
        """Cancel the running attempt of one activity (settled by the run); whether one ran."""
        scope = self.inflight.get((workflow_id, run_id, activity_id))
        if scope is None:
            return False
        scope.cancel()
        return True

    def cancel_inflight(self, workflow_id: str, run_id: str) -> int:
        """Cancel the running dispatches of a run (its terminal already settled them)."""
        scopes = self.inflight.of_workflow(workflow_id, run_id)
        for scope in scopes:
            scope.cancel()
        return len(scopes)

    async def redispatch_unsettled(self, recorder: Recorder, run_id: str) -> int:
        """Recovery: drive every scheduled, unsettled activity of the run from its recorded trail."""
        # The run's index (built once, shared with its replay) says which are unsettled;
        # only a run with some is walked for their trails.
        state = recorder.run_state(run_id)
        unsettled = sorted(state.scheduled.keys() - state.settled.keys())
        if not unsettled:
            return 0
        segment = run_segment(recorder.history, run_id)
        count = 0
        for activity_id in unsettled:
            trail = retry_trail(segment, activity_id)
            scheduled = state.scheduled[activity_id]
            sched = scheduled.body
            assert isinstance(sched, ActivityScheduled)
            self.dispatch(
                recorder,
                ActivityRequest(
                    workflow_id=recorder.workflow_id,
                    run_id=run_id,
                    activity_id=activity_id,
                    activity_type=sched.activity_type,
                    input=sched.input,
                    attempt=trail[-1].attempt if trail else 1,
                    task_queue=sched.task_queue,
                    options=sched.options,
                    # A reopened activity's schedule_to_close counts from the reopen (a fresh budget).
                    scheduled_at=state.reopened_at.get(activity_id, scheduled.recorded_at),
                ),
                resume=True,
            )
            count += 1
        return count
