"""The engine: ``open_engine``, the client API, running runs, recovery (DESIGN §2, §5, §6)."""

from __future__ import annotations

import collections
import contextlib
import enum
import heapq
import math
import sys
import traceback
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, final

import attrs
import trio

from . import _children as children
from ._activities import (
    ActivityDispatcher,
    ActivityDriver,
    ActivityRequest,
    DelegatingDispatcher,
    InProcessDispatcher,
)
from ._clock import EngineClock, TrioClock
from ._cluster import ClusterServices, LeaseGatedDispatcher, outcome_error, query_answer
from ._commands import (
    CancelCommand,
    Command,
    CommandOutcome,
    QueryCommand,
    ReopenCommand,
    SignalCommand,
    TerminateCommand,
)
from ._completion import (
    CompletionRetryConfig,
    TerminalIntent,
    forget_retired,
    handle_run_exit,
    reconcile_registry,
    teardown_bodies,
)
from ._contain import is_structural
from ._context import (
    ContinueAsNew,
    RunAborted,
    WorkflowContext,
    _PendingActivity,
    _PendingChild,
    _PendingTimer,
    _PendingTimerCancel,
)
from ._definitions import ActivityDefinition, ActivityLoop, WorkflowDefinition, index_definitions
from ._epoch import EngineEpoch, EpochStatistics
from ._errors import (
    AionInternalError,
    BackendUnavailable,
    CannotReopen,
    EngineEpochClosed,
    NonDeterminismError,
    NotOwner,
    NotRunning,
    PayloadError,
    QueryUnavailable,
    SequenceConflict,
    StoreError,
    UnknownActivityType,
    UnknownWorkflowType,
    WorkflowAlreadyStarted,
    WorkflowCancelled,
    WorkflowFailure,
    WorkflowNotFound,
    epoch_closed,
)
from ._events import (
    SCOPE_TIMEOUT_TYPE,
    ActivityCancelled,
    ActivityError,
    ActivityFailed,
    ActivityScheduled,
    ActivityStarted,
    ChildWorkflowStarted,
    ErrorInfo,
    Event,
    EventBody,
    FailureCause,
    MarkerRecorded,
    SignalReceived,
    TimeoutKind,
    TimerCancelCause,
    TimerCancelled,
    TimerFired,
    TimerStarted,
    WorkflowCancelled as CancelledEvent,
    WorkflowCancelRequested,
    WorkflowCompleted,
    WorkflowContinuedAsNew,
    WorkflowFailed,
    WorkflowReopened,
    WorkflowStarted,
    WorkflowStatus,
    WorkflowTimedOut,
    input_digest,
    validate_search_attributes,
)
from ._ids import (
    check_text,
    deadline_timer_id,
    new_run_id,
    new_workflow_id,
    validate_caller_request_id,
    validate_request_id,
    validate_task_queue,
    validate_workflow_id,
)
from ._inbox import InboxDrainer, Ownership
from ._logs import ContextLogger
from ._observe import ObserverHub, RecoveryFinished, WorkflowRelinquished, build_hub
from ._ownership import OwnerClaim, OwnerIdentity, wall_now
from ._payload import Payload, PayloadCodec
from ._plugins import default_plugin_manager, open_store
from ._poison import RecoveryGuard, poison_reason
from ._projections import (
    RecordedRequest,
    RunState,
    current_lease_terminal,
    failure,
    failures_ending_the_run,
    is_active,
    latest_run_id,
    next_delivery_attempt,
    outstanding_timers,
    recorded_request,
    retry_trail,
    run_segment,
    scheduled_activities,
    search_attributes,
    timer_resolved,
    unsettled_activities,
    workflow_status,
)
from ._recorder import Recorder
from ._registry import Lease, Registry, Residency
from ._retry import TransientBackoff, check_layer, duration_seconds, resolve_options, until_available
from ._store import (
    ClusterStore,
    CommandInbox,
    EventStore,
    OwnedStore,
    Store,
    VisibilityFilter,
    VisibilityRow,
    VisibilityStore,
)
from ._watchdog import LoopWatchdog, register_step

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup  # type: ignore[import-not-found,unused-ignore]

logger = ContextLogger("aion_trio.engine")


class IdReusePolicy(enum.Enum):
    """What ``start`` does when the workflow id already exists.

    * ``ALLOW_DUPLICATE`` (default): refuse while a run is active; once the
      last run closed, start a new run under the same id.
    * ``ALLOW_IF_FAILED``: like the default, but only if the last run failed,
      was cancelled or timed out.
    * ``REJECT_DUPLICATE``: refuse if the id was ever used.
    * ``USE_EXISTING``: return the existing latest run (idempotent start).
    """

    ALLOW_DUPLICATE = "allow_duplicate"
    ALLOW_IF_FAILED = "allow_if_failed"
    REJECT_DUPLICATE = "reject_duplicate"
    USE_EXISTING = "use_existing"


def _defaults_layer(layer: Mapping[str, Any]) -> dict[str, Any]:
    return check_layer(layer, "EngineConfig.activity_defaults")


def _check_setting_types(config: EngineConfig) -> None:
    """Each setting's type, from its declared annotation, before any range check compares it.

    Seconds (``float``) take an int or a float, finite, never a bool or a str;
    counts (``int``) take an int (both ``ValueError``, as their range checks);
    the rest their class (``TypeError``).  A new field is checked by declaring it.
    """
    for field in attrs.fields(type(config)):
        value = getattr(config, field.name)
        kind = str(field.type)
        if value is None and kind.endswith("| None"):
            continue
        kind = kind.removesuffix(" | None")
        where = f"EngineConfig.{field.name}"
        if kind == "float":
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{where} must be a number of seconds (int or float), got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{where} must be a finite number of seconds, got {value!r}")
        elif kind == "int":
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{where} must be an int, got {value!r}")
        elif kind == "str":
            if not isinstance(value, str):
                raise TypeError(f"{where} must be a str, got {value!r}")
        elif kind == "EngineClock":
            if not all(callable(getattr(value, name, None)) for name in ("now", "trio_deadline")):
                raise TypeError(
                    f"{where} must be an EngineClock (with now() and trio_deadline()), got {value!r}"
                )
        elif kind in _SETTING_CLASSES and not isinstance(value, _SETTING_CLASSES[kind]):
            raise TypeError(f"{where} must be a {kind}, got {value!r}")


_SETTING_CLASSES: Mapping[str, type] = {
    "CompletionRetryConfig": CompletionRetryConfig,
    "PayloadCodec": PayloadCodec,
}


@final
@attrs.frozen(kw_only=True)
class EngineConfig:
    """Engine settings.

    ``drain_timeout``: on graceful shutdown, seconds in-flight activity attempts
    may run to finish and record their outcome; what still runs at the deadline
    is parked (nothing recorded) and re-dispatched by the next engine.  ``None``
    or 0: no drain.  ``clock``: inject an :class:`EngineClock` (default: wall
    time advanced by Trio's clock, so ``MockClock`` drives durable time).
    """

    completion_retry: CompletionRetryConfig = attrs.field(factory=CompletionRetryConfig)
    codec: PayloadCodec = attrs.field(factory=PayloadCodec)
    drain_timeout: float | None = None
    default_task_queue: str = "default"
    clock: EngineClock | None = None
    #: Worker threads for plain-``def`` activities.
    max_activity_threads: int = 40
    #: Seconds the visibility update after a recorded terminal may run on,
    #: shielded from the shutdown's cancellation.
    bookkeeping_timeout: float = 5.0
    #: Engine-wide activity option defaults (``retry``, ``timeout``, ...), the
    #: lowest layer under per-activity and per-call options.
    activity_defaults: Mapping[str, Any] = attrs.field(factory=dict, converter=_defaults_layer)
    #: Stores with the ownership capability (SQLite, memory): seconds of wall-clock
    #: time between the engine's heartbeats on its claim.
    owner_heartbeat: float = 5.0
    #: How long the claim stays live without a heartbeat: after that another engine
    #: may take the store over (at once if the owner's pid is gone on this host).
    owner_stale_after: float = 30.0
    #: Stores with a command inbox: seconds of wall-clock time between polls of the
    #: inbox (commands from the CLI and other processes); ``None`` polls only at
    #: open and on :meth:`Engine.drain_inbox`.
    inbox_poll_interval: float | None = 1.0
    #: Commands read from the inbox per store call while draining.
    inbox_batch: int = 100
    #: Cluster stores (:class:`~aion_trio.plugin.ClusterStore`): seconds of wall-clock
    #: time between orphan sweeps, inbox polls and outcome polls of remote commands
    #: (a store notification wakes them sooner).
    sweep_interval: float = 1.0
    #: Cluster stores: at most this many orphaned workflows claimed per sweep.
    sweep_batch: int = 100
    #: Cluster stores: seconds of wall-clock time a command sent to the node owning a
    #: workflow may wait for its outcome (:class:`~aion_trio.CommandNotAnswered` then).
    remote_command_timeout: float = 30.0
    #: Seconds a just-scheduled activity's first records (``ActivityScheduled`` and
    #: ``ActivityStarted``) may wait to share one append with its outcome.  An activity
    #: that settles sooner costs one durable write instead of two; one still running
    #: when the window closes is recorded then.  A crash inside the window leaves no
    #: trace of the attempt, and replay schedules it again (activities run at least
    #: once in any case).  ``None`` or 0: record the schedule before dispatching.
    activity_schedule_window: float | None = 0.02
    #: Seconds the Trio loop may stay blocked (an ``async def`` activity or workflow code
    #: that does not yield, e.g. a ``time.sleep``) before a watchdog thread logs a
    #: warning naming the activity or workflow and where it is blocked, and again how
    #: long it lasted once the loop runs again.  ``None``: no watchdog.
    loop_stall_warning: float | None = 1.0
    #: Stores with :class:`~aion_trio.RecoveryCounts`: a run whose recovery began this
    #: many times in a row without finishing (the process died while replaying it or
    #: re-running its in-flight activities) is marked stuck instead of run again.
    #: ``None``: no counting.
    max_recovery_attempts: int | None = 5

    def __attrs_post_init__(self) -> None:
        _check_setting_types(self)
        if self.max_recovery_attempts is not None and self.max_recovery_attempts < 1:
            raise ValueError(
                f"max_recovery_attempts must be an int >= 1 or None (no counting), got {self.max_recovery_attempts!r}"
            )
        validate_task_queue(self.default_task_queue, "EngineConfig.default_task_queue")
        if self.loop_stall_warning is not None and not self.loop_stall_warning > 0:
            raise ValueError(
                f"loop_stall_warning must be > 0 seconds or None (no watchdog), got {self.loop_stall_warning!r}"
            )
        if self.drain_timeout is not None and (self.drain_timeout < 0):
            raise ValueError(f"drain_timeout must be >= 0 seconds, got {self.drain_timeout!r}")
        if self.max_activity_threads < 1:
            raise ValueError(f"max_activity_threads must be >= 1, got {self.max_activity_threads!r}")
        if not self.owner_heartbeat > 0:
            raise ValueError(f"owner_heartbeat must be > 0 seconds, got {self.owner_heartbeat!r}")
        if not self.owner_stale_after >= 2 * self.owner_heartbeat:
            raise ValueError(
                f"owner_stale_after ({self.owner_stale_after!r}s) must be at least twice owner_heartbeat "
                f"({self.owner_heartbeat!r}s), or a live owner could be taken for dead between two heartbeats"
            )
        if self.inbox_poll_interval is not None and not self.inbox_poll_interval > 0:
            raise ValueError(
                f"inbox_poll_interval must be > 0 seconds or None, got {self.inbox_poll_interval!r}"
            )
        window = self.activity_schedule_window
        if window is not None and not (
            isinstance(window, (int, float)) and not isinstance(window, bool) and 0 <= window < math.inf
        ):
            raise ValueError(
                f"activity_schedule_window must be a finite number >= 0 seconds or None, got {window!r}"
            )
        if self.inbox_batch < 1:
            raise ValueError(f"inbox_batch must be >= 1, got {self.inbox_batch!r}")
        if not (isinstance(self.sweep_interval, (int, float)) and 0 < self.sweep_interval < math.inf):
            raise ValueError(
                f"sweep_interval must be a finite number > 0 seconds, got {self.sweep_interval!r}"
            )
        if (
            isinstance(self.sweep_batch, bool)
            or not isinstance(self.sweep_batch, int)
            or self.sweep_batch < 1
        ):
            raise ValueError(f"sweep_batch must be an int >= 1, got {self.sweep_batch!r}")
        if not (
            isinstance(self.remote_command_timeout, (int, float))
            and 0 < self.remote_command_timeout < math.inf
        ):
            raise ValueError(
                f"remote_command_timeout must be a finite number > 0 seconds, got {self.remote_command_timeout!r}"
            )


@final
@attrs.frozen(kw_only=True)
class PendingActivity:
    activity_id: int
    activity_type: str
    attempt: int
    scheduled_at: datetime
    task_queue: str


@final
@attrs.frozen(kw_only=True)
class WorkflowDescription:
    """A workflow's current state, projected from its history."""

    workflow_id: str
    run_id: str
    workflow_type: str
    status: WorkflowStatus
    start_time: datetime
    close_time: datetime | None
    task_queue: str
    search_attributes: Mapping[str, Any]
    result: Any = None
    error: ErrorInfo | None = None
    failed_step: str | None = None
    pending_activities: tuple[PendingActivity, ...] = ()
    stuck_reason: str | None = None
    history_length: int = 0
    run_ids: tuple[str, ...] = ()


@final
@attrs.frozen(kw_only=True)
class EngineStatistics:
    registered_leases: int
    resident_runs: int
    stuck_runs: int
    loaded_recorders: int
    epoch: EpochStatistics
    #: Plain ``def`` activity threads the engine stopped waiting for (cancel, terminate, a
    #: timeout) that have not returned yet: each holds a ``max_activity_threads`` slot.
    abandoned_activity_threads: int = 0


def _schedule_bodies(p: _PendingActivity) -> tuple[ActivityScheduled, ActivityStarted]:
    """A newly started activity's first records: scheduled, and its first attempt started."""
    return (
        ActivityScheduled(
            activity_id=p.ordinal,
            activity_type=p.definition.name,
            input=p.input,
            task_queue=p.task_queue,
            options=p.options,
            input_digest=input_digest(p.input),
        ),
        ActivityStarted(activity_id=p.ordinal, attempt=1),
    )


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
        self._recorders: dict[str, Recorder] = {}
        self.inflight: dict[tuple[str, str, int], trio.CancelScope] = {}
        self._timers: list[tuple[datetime, int, str, str, str]] = []
        self._timer_seq = 0
        self._timers_changed = trio.Event()
        self._loading: dict[str, trio.Event] = {}
        #: Workflows a :meth:`resume_idle` is looking at now (one at a time: no second run).
        self._resuming: set[str] = set()
        self._default_options: dict[str, tuple[str, Payload]] = {}
        #: Cluster mode: the waker, sweeper and remote commands (set by ``open_engine``).
        self.cluster_services: ClusterServices | None = None
        #: Owned stores: told when the store's fence refused a write (the claim was taken over).
        self.on_store_fenced: Callable[[NotOwner], None] | None = None
        # Background visibility refreshes in flight, by workflow id.
        self._visibility_owed: dict[str, _Refresh] = {}
        #: Cluster mode: the store's node capability (``None``: a single-owner store).
        self.cluster = cluster
        #: Threads for wall-clock waits of the engine's services.
        self.service_threads = service_threads or trio.CapacityLimiter(2)
        #: Cluster mode: workflows this engine stopped because another node claimed them.
        self.relinquished = 0
        #: Recorders holding deferred schedule records, with the Trio time by which they
        #: must be written (FIFO: one window for all), served by :meth:`deferral_service`.
        self._owed: collections.deque[tuple[float, Recorder]] = collections.deque()
        self._owed_lot = trio.lowlevel.ParkingLot()

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

    # -- recorders ---------------------------------------------------------

    async def recorder_for(self, workflow_id: str) -> Recorder:
        """This engine's one recorder for ``workflow_id`` (loaded from the store once)."""
        while True:
            found = self._recorders.get(workflow_id)
            if found is not None:
                await trio.lowlevel.checkpoint()
                return found
            loading = self._loading.get(workflow_id)
            if loading is None:
                break
            await loading.wait()
        # An id no store can hold (a lone surrogate): say so instead of asking the
        # store, whose encoder would fail on it.
        if not isinstance(workflow_id, str):
            raise TypeError(f"workflow_id must be str, got {type(workflow_id).__name__}")
        check_text(workflow_id, "workflow_id")
        done = trio.Event()
        self._loading[workflow_id] = done
        try:
            recorder = await Recorder.load(
                workflow_id,
                self.events,
                self.epoch,
                self.clock,
                observers=self.observers,
                on_fenced=self._on_fenced,
                on_stale=self._on_stale,
            )
            self._recorders[workflow_id] = recorder
            return recorder
        finally:
            del self._loading[workflow_id]
            done.set()

    @property
    def _on_fenced(self) -> Callable[[Recorder, NotOwner], None] | None:
        if self.cluster is not None:
            return self.relinquish
        return self._store_fenced if self.on_store_fenced is not None else None

    @property
    def _on_stale(self) -> Callable[[Recorder, SequenceConflict], None] | None:
        return self.relinquish_stale if self.cluster is not None else None

    def _store_fenced(self, recorder: Recorder, error: NotOwner) -> None:
        # An owned store refused a write: the engine lost the store, not one workflow.
        assert self.on_store_fenced is not None
        self.on_store_fenced(error)

    def relinquish(self, recorder: Recorder, error: NotOwner) -> None:
        """Cluster mode's one choke point for a fenced workflow: stop it on this node.

        Called by the recorder when the store refuses an append with
        ``NotOwner`` (another node claimed the workflow).  No checkpoint: the
        run's task and in-flight activity attempts are cancelled (parked, they
        record nothing), its timers leave the heap, its recorder and leases
        leave the registry, and it is logged once and reported to observers.
        Never retried here: the new owner's recovery carries the workflow on.
        """
        if not self._stop_locally(recorder):
            return  # a recorder already dropped (another of its tasks was fenced first)
        self._report_relinquished(
            recorder.workflow_id,
            "workflow relinquished: another node claimed it, so this node stopped it (nothing retried "
            "here): %s",
            error,
        )

    def _report_relinquished(self, workflow_id: str, message: str, error: StoreError) -> None:
        """Count a workflow this node stopped running, log ``message`` (``%s``: ``error``) and
        tell the observers."""
        self.relinquished += 1
        node = self.cluster.node_id if self.cluster is not None else ""
        logger.warning(message, error, extra={"workflow_id": workflow_id, "node": node, "reason": str(error)})
        if self.observers is not None:
            self.observers.emit(
                WorkflowRelinquished(workflow_id=workflow_id, node_id=node, reason=str(error))
            )

    def relinquish_stale(self, recorder: Recorder, error: SequenceConflict) -> None:
        """Cluster mode: an append found another head than this node's copy holds (another
        node appended meanwhile, e.g. while this one was fenced and before it claimed the
        workflow back).  Not a reason to mark the run stuck: the stale copy is dropped like
        a fenced workflow's, and if this node owns the workflow it recovers it from the store."""
        if not self._stop_locally(recorder):
            return
        workflow_id = recorder.workflow_id
        self._report_relinquished(
            workflow_id,
            "workflow relinquished: this node's copy of its history was stale (%s); it is recovered "
            "from the store by its owner",
            error,
        )
        try:
            self.epoch.spawn(self._recover_if_owned, workflow_id, name=f"recover-stale:{workflow_id}")
        except EngineEpochClosed:
            pass  # shutting down: the next engine recovers it

    async def _recover_if_owned(self, workflow_id: str) -> None:
        assert self.cluster is not None
        if await self.cluster.command_target(workflow_id) is not None:
            return  # another node owns it (its recovery carries it on)
        if workflow_id in self._recorders or workflow_id in self._loading:
            return  # recovered meanwhile (a sweep claimed it back): that copy is fresh
        await self.recover_one(workflow_id)

    async def take_fresh(self, workflow_id: str) -> None:
        """Cluster mode, before recovering a workflow this node has just claimed: forget
        what this node held of it.

        A node that was stopped (or cut off) past its lease can claim back a
        workflow another node owned meanwhile; its in-memory run and recorder
        are then stale, and its recovery must start from the store.  The old
        run and its attempts are cancelled (recording nothing) and an append
        already in flight under the recorder's lock is waited out."""
        recorder = self._recorders.get(workflow_id)
        if recorder is None:
            return
        if self._stop_locally(recorder):
            logger.info(
                "re-claimed a workflow this node was running: its run restarts from the store",
                extra={"workflow_id": workflow_id},
            )
        async with recorder.lock:
            pass

    def _stop_locally(self, recorder: Recorder) -> bool:
        """Drop ``recorder``'s workflow from this node: cancel its runs and attempts, drop
        its timers, leases and recorder.  ``False``: it was already dropped."""
        workflow_id = recorder.workflow_id
        if self._recorders.get(workflow_id) is not recorder:
            return False
        del self._recorders[workflow_id]
        for lease in self.registry.leases_of(workflow_id):
            self.registry.remove(workflow_id, lease.run_id)
            if lease.cancel_scope is not None:
                lease.cancel_scope.cancel()
        for key, scope in list(self.inflight.items()):
            if key[0] == workflow_id:
                scope.cancel()
        kept = [t for t in self._timers if t[2] != workflow_id]
        if len(kept) != len(self._timers):
            heapq.heapify(kept)
            self._timers = kept
            self._timers_changed.set()
        self.stuck.pop(workflow_id, None)
        recorder.notify()
        return True

    def loaded_recorder(self, workflow_id: str) -> Recorder | None:
        return self._recorders.get(workflow_id)

    def drives(self, workflow_id: str) -> bool:
        """Whether a run of ``workflow_id`` is registered here (this engine drives it)."""
        return bool(self.registry.leases_of(workflow_id))

    def claim_unloaded(self, workflow_id: str) -> Recorder | None:
        """An empty recorder for an id this engine has neither loaded nor is loading, or ``None``.

        For a start that expects a brand-new id: it appends at expected seq 0
        instead of reading a history that is almost always empty.  Until
        :meth:`release_unloaded`, :meth:`recorder_for` callers wait as for a load.
        """
        if workflow_id in self._recorders or workflow_id in self._loading:
            return None
        self._loading[workflow_id] = trio.Event()
        return Recorder(
            workflow_id,
            self.events,
            self.epoch,
            self.clock,
            observers=self.observers,
            on_fenced=self._on_fenced,
            # A conflict before release_unloaded (the id has history) drops nothing: not installed.
            on_stale=self._on_stale,
        )

    def release_unloaded(self, recorder: Recorder, *, adopt: bool) -> None:
        """End a :meth:`claim_unloaded`: install the recorder (its append landed) or drop it.

        Dropped, the next :meth:`recorder_for` loads the stored history.
        """
        if adopt:
            self._recorders[recorder.workflow_id] = recorder
        self._loading.pop(recorder.workflow_id).set()

    # -- appends of unknown outcome ------------------------------------------

    def resume_idle_soon(self, workflow_id: str) -> None:
        """After an append of unknown outcome that makes a run current (a start, a
        reopen): once the store answers, :meth:`resume_idle` looks at
        what landed and runs it.  Retried in the epoch while the store is unavailable."""
        try:
            self.epoch.spawn(
                children.guarded,
                self,
                "resume a run recorded by an append of unknown outcome",
                {"workflow_id": workflow_id},
                self.resume_idle,
                workflow_id,
                name=f"resume-idle:{workflow_id}",
            )
        except EngineEpochClosed:
            pass  # shutting down: the next engine's recovery resumes it

    async def resume_idle(self, workflow_id: str) -> None:
        """Resume ``workflow_id``'s latest run if history records it active but no live lease
        here drives it, as the recovery sweep would.

        The one mechanism for a run recorded by an append whose acknowledgement was lost
        (a start, a reopen, a continue-as-new successor): the history is re-read first if
        the recorder is stale, so what actually landed decides.  Idempotent; raises
        ``BackendUnavailable`` while the store cannot be read."""
        if workflow_id in self._resuming:
            return  # another call is resuming it now
        self._resuming.add(workflow_id)
        try:
            recorder = await self.recorder_for(workflow_id)
            async with recorder.lock:
                history = await recorder.current_history()
                run_id = latest_run_id(history)
                if run_id is None or not is_active(history):
                    return
                lease = self.registry.get(workflow_id, run_id)
                if lease is not None and not lease.completion.is_set:
                    return
            await self.recover_one(workflow_id)
        finally:
            self._resuming.discard(workflow_id)

    # -- runs --------------------------------------------------------------

    async def reopen_locked(
        self,
        recorder: Recorder,
        run_id: str,
        workflow_type: str,
        activity_ids: Sequence[int] = (),
        request_id: str | None = None,
    ) -> Lease:
        """Append ``WorkflowReopened`` and install the run's new lease in the same critical
        section (hold the recorder lock), so no check made under the lock ever sees the
        reopen recorded without its lease, or the lease without its reopen."""
        try:
            await recorder.append(
                [
                    WorkflowReopened(
                        run_id=run_id,
                        reopened_activity_ids=tuple(int(a) for a in activity_ids),
                        request_id=request_id,
                    )
                ],
                action="reopen the run",
                run_id=run_id,
            )
        except Exception:
            if recorder.stale:  # the reopen may have landed: run it if it did
                self.resume_idle_soon(recorder.workflow_id)
            raise
        return self.new_lease(recorder, run_id, workflow_type)

    def new_lease(self, recorder: Recorder, run_id: str, workflow_type: str) -> Lease:
        """Create and install a lease.  Call inside the recorder critical section
        that appended the event making it current."""
        lease = Lease(
            workflow_id=recorder.workflow_id,
            run_id=run_id,
            workflow_type=workflow_type,
            recorder=recorder,
            start_head=recorder.head,
        )
        self.registry.install(lease)
        return lease

    def spawn_run(self, lease: Lease) -> None:
        self.epoch.spawn(
            self._run_workflow,
            lease,
            name=f"workflow:{lease.workflow_id}",
            workflow_id=lease.workflow_id,
            run_id=lease.run_id,
        )

    async def _run_workflow(self, lease: Lease) -> None:
        """A run's task: execute (or replay) the code, then record its terminal."""
        fields = {"workflow_id": lease.workflow_id, "run_id": lease.run_id, "lease": lease.lease_id}
        definition = self.workflows.get(lease.workflow_type)
        if definition is None:
            await self.mark_stuck(
                lease,
                f"workflow type {lease.workflow_type!r} is not registered with this engine; register it "
                "and restart, or terminate the run",
            )
            return
        ctx = WorkflowContext(self, lease)
        ctx._bind_task()
        lease.task = trio.lowlevel.current_task()
        lease.context = ctx
        start = ctx._state.start
        assert start is not None
        assert isinstance(start.body, WorkflowStarted)
        raw_args = self.codec.decode(start.body.input)
        args = raw_args if isinstance(raw_args, list) else [raw_args]
        intent: TerminalIntent
        try:
            try:
                with trio.CancelScope() as scope:
                    lease.cancel_scope = scope
                    value = await definition.fn(ctx, *args)
                    await ctx._flush()
                if scope.cancelled_caught:
                    # Ended from outside (terminate, deadline teardown): that path
                    # recorded the terminal and does the bookkeeping.
                    return
            except RunAborted:
                return
            except NonDeterminismError as exc:
                await self.mark_stuck(lease, str(exc))
                return
            except WorkflowCancelled as cancelled:
                if await self._stuck_at_exit(lease, ctx, "the workflow to end cancelled", CancelledEvent):
                    return
                intent = TerminalIntent.cancelled(cancelled.reason, self.clock.now())
            except ContinueAsNew as request:
                if await self._stuck_at_exit(
                    lease, ctx, "the workflow to continue as new", WorkflowContinuedAsNew
                ):
                    return
                exit_time = self.clock.now()
                try:
                    payload = self.codec.encode(list(request.args_), what="continue-as-new input")
                    intent = TerminalIntent.continued_as_new(payload, request.workflow_type, exit_time)
                except PayloadError as exc:
                    intent = TerminalIntent.failed(error_info(exc), exit_time)
            except BaseException as exc:
                # SystemExit or any other BaseException of the code's own fails the
                # run; only the engine's cancellation and a Ctrl-C pass (see _contain).
                if is_structural(exc):
                    raise
                failing = f"the workflow to fail ({type(exc).__name__})"
                if await self._stuck_at_exit(lease, ctx, failing, WorkflowFailed):
                    return
                intent = TerminalIntent.failed(error_info(exc), self.clock.now())
            else:
                if await self._stuck_at_exit(lease, ctx, "the workflow to return", WorkflowCompleted):
                    return
                exit_time = self.clock.now()
                try:
                    payload = self.codec.encode(value, what=f"result of workflow {lease.workflow_type!r}")
                    intent = TerminalIntent.completed(payload, exit_time)
                except PayloadError as exc:
                    intent = TerminalIntent.failed(error_info(exc), exit_time)
        finally:
            lease.task = None
            lease.cancel_scope = None
            ctx._detach()
        try:
            await handle_run_exit(self, lease, intent)
        except EngineEpochClosed as exc:
            logger.warning("workflow terminal not recorded: %s", exc, extra=fields)
        except Exception as exc:
            logger.error(
                "workflow completion hit an unretryable failure; the run stays as history shows it: %s: %s",
                type(exc).__name__,
                exc,
                extra=fields,
            )

    async def _stuck_at_exit(
        self, lease: Lease, ctx: WorkflowContext, exit: str, terminal: type[EventBody]
    ) -> bool:
        """The code ended: mark the run stuck (``True``) if it diverged from history — a
        command of its own failed to match, history holds a command it never issued, or
        (replaying a finished run) the recorded end is of another kind than this exit."""
        if ctx._poisoned is not None:
            await self.mark_stuck(lease, str(ctx._poisoned))
            return True
        leftover = ctx.unissued_recorded_command(terminal)
        if leftover is None:
            return False
        family, ordinal, recorded = leftover
        error = NonDeterminismError(lease.workflow_id, lease.run_id, family, ordinal, recorded, exit)
        await self.mark_stuck(lease, str(error))
        return True

    async def mark_stuck(self, lease: Lease, reason: str) -> None:
        """Leave the run Running, marked stuck (visibility ``stuck_reason``), others unaffected."""
        lease.residency = Residency.STUCK
        lease.stuck_reason = reason
        self.stuck[lease.workflow_id] = reason
        logger.error(
            "workflow run is stuck and stays Running: %s",
            reason,
            extra={"workflow_id": lease.workflow_id, "run_id": lease.run_id, "lease": lease.lease_id},
        )
        lease.recorder.notify()
        await self.upsert_visibility_quietly(lease.workflow_id)

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
                if self.cluster is not None:
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
        pending: Sequence[_PendingActivity | _PendingTimer | _PendingTimerCancel | _PendingChild],
    ) -> None:
        """Record a run's pending commands as one batch, then start what they start."""

        def build(history: Sequence[Event]) -> list[Any]:
            state.sync()
            bodies: list[Any] = []
            started_now: set[str] = set()
            for p in pending:
                if isinstance(p, _PendingActivity):
                    if p.ordinal in state.scheduled:
                        continue
                    bodies.extend(_schedule_bodies(p))
                elif isinstance(p, _PendingTimer):
                    if p.timer_id not in state.timers:
                        bodies.append(TimerStarted(timer_id=p.timer_id, fire_at=p.fire_at))
                        started_now.add(p.timer_id)
                elif isinstance(p, _PendingChild):
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
                            MarkerRecorded(
                                name=children.child_marker_name(p.ordinal), value=p.options.to_payload()
                            )
                        )
                elif (p.timer_id in state.timers or p.timer_id in started_now) and (
                    p.timer_id not in state.timer_resolutions
                ):
                    bodies.append(TimerCancelled(timer_id=p.timer_id, cause=TimerCancelCause.WORKFLOW_INTENT))
            return bodies

        window = self.config.activity_schedule_window
        if window and all(isinstance(p, _PendingActivity) for p in pending):
            at = await self._defer_schedules(lease, state, pending)
            if at is not None:
                self._owe(lease.recorder, window)
                for p in pending:
                    assert isinstance(p, _PendingActivity)
                    self.dispatch(lease.recorder, self._first_request(lease, p, at))
                return
        await self._append_with_retry(lease, "record workflow commands", build, keep_deferred=True)
        state.sync()
        for p in pending:
            if isinstance(p, _PendingTimer):
                await self.arm_timer(lease.workflow_id, lease.run_id, p.timer_id, p.fire_at)
            elif isinstance(p, _PendingTimerCancel):
                await self.forget_timer(lease.workflow_id, p.timer_id)
            elif isinstance(p, _PendingChild):
                await self.start_recorded_child(lease, p.ordinal)
            else:
                scheduled = state.scheduled.get(p.ordinal)
                at = scheduled.recorded_at if scheduled is not None else None
                self.dispatch(lease.recorder, self._first_request(lease, p, at))

    @staticmethod
    def _first_request(lease: Lease, p: _PendingActivity, scheduled_at: datetime | None) -> ActivityRequest:
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

    async def _defer_schedules(
        self, lease: Lease, state: RunState, pending: Sequence[Any]
    ) -> datetime | None:
        """Hold back the schedule records of freshly started activities (they are written
        with the first outcome, or by :meth:`deferral_service` when the window closes).

        Returns the schedule time, or ``None`` when the ordinary path must record them
        (a stale history to re-read first).  Nothing here writes or fails transiently.
        """
        self._park_if_closing(lease, "record workflow commands")
        recorder = lease.recorder
        async with recorder.hold():
            if recorder.stale:
                return None
            state.sync()
            if state.ended is not None:
                raise RunAborted()  # ended elsewhere (terminate, deadline): record nothing more
            bodies = [body for p in pending for body in _schedule_bodies(p)]
            at = self.clock.now()
            recorder.defer(bodies, at=at)
        return at

    def _owe(self, recorder: Recorder, window: float) -> None:
        self._owed.append((trio.current_time() + window, recorder))
        if len(self._owed) == 1:
            self._owed_lot.unpark_all()

    async def deferral_service(self) -> None:
        """Write deferred schedule records whose window closed while their activity still runs.

        Wakes at most about four times per window: whatever came due meanwhile is
        handled in one pass (a record may so wait up to 1.25 windows, longer only
        while an append on its recorder is in progress, which writes it).
        """
        window = self.config.activity_schedule_window or 0.0
        owed = self._owed
        while True:
            if not owed:
                await self._owed_lot.park()
                continue
            await trio.sleep_until(owed[0][0] + window / 4)
            now = trio.current_time()
            while owed and owed[0][0] <= now:
                _, recorder = owed.popleft()
                if recorder.deferred and recorder.busy:
                    # The holder's append writes them (or the holder decides, which writes
                    # them first): look again a window later rather than queue behind it.
                    owed.append((now + window, recorder))
                elif recorder.deferred:
                    try:
                        self.epoch.spawn(
                            self._write_deferred,
                            recorder,
                            name=f"deferred-records:{recorder.workflow_id}",
                            workflow_id=recorder.workflow_id,
                        )
                    except EngineEpochClosed:
                        return

    async def write_all_deferred(self) -> None:
        """Graceful shutdown: write every deferred schedule record (concurrently, so a
        group-committing store takes them in one transaction), so that history shows
        the attempts that were in flight."""
        owing = {id(r): r for _, r in self._owed if r.deferred}
        self._owed.clear()
        if owing:
            async with trio.open_nursery() as nursery:
                for recorder in owing.values():
                    nursery.start_soon(self._write_deferred, recorder)

    async def _write_deferred(self, recorder: Recorder) -> None:
        fields = {"workflow_id": recorder.workflow_id}
        try:
            async with recorder.lock:
                await recorder.flush_deferred()
        except EngineEpochClosed:
            pass  # replay schedules the activity again
        except BackendUnavailable as exc:
            logger.warning(
                "could not write deferred schedule records (retried with the next record): %s",
                exc,
                extra=fields,
            )
            self._owe(recorder, self.config.completion_retry.initial)
        except NotOwner as exc:
            if self.cluster is None:
                logger.error("could not write deferred schedule records: %s", exc, extra=fields)
        except StoreError as exc:
            logger.error("could not write deferred schedule records: %s", exc, extra=fields)

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

    # -- the timer service ----------------------------------------------------

    async def arm_timer(self, workflow_id: str, run_id: str, timer_id: str, fire_at: datetime) -> None:
        """Make the timer service fire this timer at ``fire_at`` (and note it in the store's index)."""
        self._timer_seq += 1
        heapq.heappush(self._timers, (fire_at, self._timer_seq, workflow_id, run_id, timer_id))
        self._timers_changed.set()
        try:
            await self.events.schedule_timer(workflow_id, timer_id, fire_at)
        except StoreError as exc:
            logger.warning(
                "not written to the timer index (it fires anyway): %s",
                exc,
                extra={"workflow_id": workflow_id, "run_id": run_id, "timer": timer_id},
            )

    async def timer_service(self) -> None:
        """Fire due timers by appending ``TimerFired`` (history decides; the heap is a schedule)."""
        while True:
            self._timers_changed = trio.Event()
            if not self._timers:
                await self._timers_changed.wait()
                continue
            fire_at = self._timers[0][0]
            with trio.move_on_at(self.clock.trio_deadline(fire_at)):
                await self._timers_changed.wait()
                continue
            now = self.clock.now()
            while self._timers and self._timers[0][0] <= now:
                _, _, workflow_id, run_id, timer_id = heapq.heappop(self._timers)
                await self.fire_timer(workflow_id, run_id, timer_id)

    async def fire_timer(self, workflow_id: str, run_id: str, timer_id: str) -> bool:
        """Append ``TimerFired`` unless the timer fired, was cancelled or its run ended."""
        fields = {"workflow_id": workflow_id, "run_id": run_id, "timer": timer_id}
        try:
            recorder = await self.recorder_for(workflow_id)
            if timer_id == deadline_timer_id(run_id):
                return await self.deadline_teardown(recorder, run_id)
            async with recorder.lock:
                self.epoch.gate(workflow_id, run_id, f"fire timer {timer_id}")
                history = await recorder.current_history()
                segment = run_segment(history, run_id)
                if (
                    current_lease_terminal(segment) is not None
                    or timer_resolved(segment, timer_id) is not None
                ) or not any(t.timer_id == timer_id for t in outstanding_timers(segment)):
                    fired = False
                else:
                    await recorder.append(
                        [TimerFired(timer_id=timer_id)], action=f"fire timer {timer_id}", run_id=run_id
                    )
                    fired = True
        except EngineEpochClosed:
            return False
        except NotOwner as exc:
            if self.cluster is None:
                logger.error("could not fire timer: %s", exc, extra=fields)
            return False  # cluster mode: the workflow was relinquished (logged there)
        except BackendUnavailable as exc:
            logger.warning("could not fire timer (retrying): %s", exc, extra=fields)
            retry_at = self.clock.now() + timedelta(seconds=self.config.completion_retry.initial)
            self._timer_seq += 1
            heapq.heappush(self._timers, (retry_at, self._timer_seq, workflow_id, run_id, timer_id))
            return False
        except StoreError as exc:
            logger.error("could not fire timer: %s", exc, extra=fields)
            return False
        await self.forget_timer(workflow_id, timer_id)
        return fired

    async def record_marker(self, lease: Lease, name: str, value: Payload) -> None:
        def build(history: Sequence[Event]) -> list[Any]:
            segment = run_segment(history, lease.run_id)
            if any(isinstance(e.body, MarkerRecorded) and e.body.name == name for e in segment):
                return []
            return [MarkerRecorded(name=name, value=value)]

        await self._append_with_retry(lease, f"record marker {name}", build)

    # -- activities --------------------------------------------------------

    def dispatch(self, recorder: Recorder, request: ActivityRequest, *, resume: bool = False) -> None:
        if self.recovery_guard is not None and self.recovery_guard.hold(recorder, request, resume):
            return  # the sweep dispatches it once its replays caught up
        try:
            self.epoch.spawn(
                self._drive_activity,
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

    async def _drive_activity(self, recorder: Recorder, request: ActivityRequest, resume: bool) -> None:
        key = (request.workflow_id, request.run_id, request.activity_id)
        backoff = (self.config.completion_retry.initial, self.config.completion_retry.ceiling)
        driver = ActivityDriver(recorder, self.dispatcher, request, clock=self.clock, record_backoff=backoff)
        with trio.CancelScope() as scope:
            self.inflight[key] = scope
            try:
                await driver.run(resume=resume)
            except StoreError as exc:
                # Not transient (those are retried until they land): the run cannot go on.
                if isinstance(exc, (NotOwner, SequenceConflict)) and self.cluster is not None:
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
                if self.inflight.get(key) is scope:
                    del self.inflight[key]

    def cancel_inflight(self, workflow_id: str, run_id: str) -> int:
        """Cancel the running dispatches of a run (its terminal already settled them)."""
        keys = [k for k in self.inflight if k[0] == workflow_id and k[1] == run_id]
        for key in keys:
            self.inflight[key].cancel()
        return len(keys)

    async def redispatch_unsettled(self, recorder: Recorder, run_id: str) -> int:
        """Recovery: drive every scheduled, unsettled activity of the run from its recorded trail."""
        segment = run_segment(recorder.history, run_id)
        scheduled = scheduled_activities(segment)
        scheduled_at: dict[int, datetime] = {}
        for e in segment:
            if isinstance(e.body, ActivityScheduled):
                scheduled_at[e.body.activity_id] = e.recorded_at
            elif isinstance(e.body, WorkflowReopened):
                # A reopened activity's schedule_to_close counts from the reopen (a fresh budget).
                for activity_id in e.body.reopened_activity_ids:
                    scheduled_at[activity_id] = e.recorded_at
        count = 0
        for activity_id in unsettled_activities(segment):
            trail = retry_trail(segment, activity_id)
            sched = scheduled[activity_id]
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
                    scheduled_at=scheduled_at[activity_id],
                ),
                resume=True,
            )
            count += 1
        return count

    # -- timers (the index is a hint; history decides) ----------------------

    async def forget_timer(self, workflow_id: str, timer_id: str) -> None:
        try:
            await self.events.remove_timer(workflow_id, timer_id)
        except StoreError as exc:
            logger.warning(
                "could not remove it from the timer index (harmless): %s",
                exc,
                extra={"workflow_id": workflow_id, "timer": timer_id},
            )

    # -- visibility --------------------------------------------------------

    def visibility_row(self, workflow_id: str, history: Sequence[Event]) -> VisibilityRow | None:
        run_id = latest_run_id(history)
        if run_id is None:
            return None
        segment = run_segment(history, run_id)
        start = segment[0]
        assert isinstance(start.body, WorkflowStarted)
        status = workflow_status(history) or WorkflowStatus.RUNNING
        terminal = current_lease_terminal(segment)
        failed = failure(segment)
        return VisibilityRow(
            workflow_id=workflow_id,
            run_id=run_id,
            workflow_type=start.body.workflow_type,
            status=status,
            start_time=start.recorded_at,
            close_time=terminal.recorded_at if terminal is not None else None,
            task_queue=start.body.task_queue,
            failed_step=failed.failed_step if failed else None,
            failure_reason=failed.reason if failed else None,
            search_attributes=search_attributes(history, run_id),
            stuck_reason=self.stuck.get(workflow_id) if status is WorkflowStatus.RUNNING else None,
        )

    async def upsert_visibility(self, workflow_id: str) -> None:
        recorder = await self.recorder_for(workflow_id)
        row = self.visibility_row(workflow_id, recorder.history)
        if row is not None:
            await self.visibility.upsert(row)

    async def upsert_visibility_quietly(self, workflow_id: str) -> None:
        try:
            await self.upsert_visibility(workflow_id)
        except StoreError as exc:
            logger.warning(
                "visibility not updated (it is reconciled from history later): %s",
                exc,
                extra={"workflow_id": workflow_id},
            )

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

    async def refresh_visibility_soon(self, workflow_id: str) -> None:
        """Refresh the workflow's visibility row in a background task instead of waiting for it.

        One refresh task per workflow at a time (a request while one runs makes
        it go round again, building the row from the history of that moment),
        shielded and bounded like the terminal's bookkeeping, so a closing
        engine still writes it.  The engine's own visibility queries first wait
        for the refreshes owed when they are called (:meth:`visibility_settled`).
        If no task can be spawned (the epoch is closing), the refresh runs here.
        """
        owed = self._visibility_owed.get(workflow_id)
        if owed is not None:
            owed.again = True
            return
        try:
            self.epoch.spawn(
                self._refresh_visibility,
                workflow_id,
                name=f"visibility:{workflow_id}",
                workflow_id=workflow_id,
            )
        except EngineEpochClosed:
            await self.upsert_visibility_quietly(workflow_id)
            return
        self._visibility_owed[workflow_id] = _Refresh()

    async def _refresh_visibility(self, workflow_id: str) -> None:
        owed = self._visibility_owed[workflow_id]
        try:
            with trio.CancelScope(shield=True), trio.move_on_after(self.config.bookkeeping_timeout):
                while owed.again:
                    owed.again = False
                    await self.upsert_visibility_quietly(workflow_id)
        finally:
            del self._visibility_owed[workflow_id]
            owed.done.set()

    async def visibility_settled(self) -> None:
        """Wait for the background visibility refreshes owed now (read-your-writes for queries)."""
        for owed in list(self._visibility_owed.values()):
            await owed.done.wait()

    # -- continue-as-new -----------------------------------------------------

    async def start_successor(self, lease: Lease, terminal: WorkflowContinuedAsNew) -> Lease | None:
        """Start the successor of a continued run through the same recorder.

        Behind its own epoch gate (it spawns a run).  A successor already recorded
        appends nothing and returns ``None``; if no live lease drives it here (the
        append that recorded it lost its acknowledgement), it is resumed
        (:meth:`resume_idle`).
        """
        self.epoch.gate(lease.workflow_id, lease.run_id, "start the continue-as-new successor")
        recorder = lease.recorder
        async with recorder.lock:
            history = await recorder.current_history()
            recorded = any(
                isinstance(e.body, WorkflowStarted) and e.body.parent_run_id == lease.run_id for e in history
            )
            if not recorded:
                start = run_segment(history, lease.run_id)[0].body
                assert isinstance(start, WorkflowStarted)
                run_id = new_run_id()
                workflow_type = terminal.workflow_type or lease.workflow_type
                await recorder.append(
                    [
                        WorkflowStarted(
                            workflow_type=workflow_type,
                            input=terminal.input,
                            run_id=run_id,
                            parent_run_id=lease.run_id,
                            parent_workflow_id=start.parent_workflow_id,
                            task_queue=start.task_queue,
                            search_attributes=start.search_attributes,
                            timeout=start.timeout,
                        )
                    ],
                    action="start the continue-as-new successor",
                    run_id=run_id,
                )
                successor = self.new_lease(recorder, run_id, workflow_type)
                self.spawn_run(successor)
        if recorded:
            logger.debug(
                "continue-as-new successor already recorded; nothing appended",
                extra={"workflow_id": lease.workflow_id, "run_id": lease.run_id},
            )
            await self.resume_idle(lease.workflow_id)
            return None
        await self.upsert_visibility_quietly(lease.workflow_id)
        return successor

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
            self._timer_seq += 1
            heapq.heappush(
                self._timers, (entry.fire_at, self._timer_seq, entry.workflow_id, run_id, entry.timer_id)
            )
        self._timers_changed.set()

    async def reconcile_visibility(self, active: set[str]) -> None:
        """Rows that still say Running for workflows history says are not active are rewritten
        (an engine killed between a terminal and its index update leaves one)."""
        try:
            rows = await self.visibility.list(VisibilityFilter(status=WorkflowStatus.RUNNING))
        except StoreError as exc:
            logger.warning("visibility reconciliation skipped: %s", exc)
            return
        for row in rows:
            if row.workflow_id not in active:
                if (
                    self.cluster is not None
                    and await self.cluster.command_target(row.workflow_id) is not None
                ):
                    continue  # another node owns it: its rows are that node's to write
                await self.upsert_visibility_quietly(row.workflow_id)

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


def _stepped_run(frame_locals: dict[str, Any]) -> str | None:
    lease = frame_locals.get("lease")
    if not isinstance(lease, Lease):
        return None
    return f"workflow {lease.workflow_id!r} run {lease.run_id} ({lease.workflow_type}), its workflow code"


# A blocked Trio loop names the run whose code is on its stack (see _watchdog).
register_step(EngineCore._run_workflow, _stepped_run)


def error_info(exc: BaseException) -> ErrorInfo:
    return ErrorInfo(
        type=type(exc).__qualname__,
        message=str(exc),
        traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
    )


@final
class RunHandle:
    """A started run: ``await handle.result()``.

    ``created`` is true when the call that returned the handle recorded the run's
    start (a retry with the same ``request_id`` returns the first call's handle,
    so it is true there too); false when it attached to a run that existed
    (``IdReusePolicy.USE_EXISTING``) or reopened one.
    """

    def __init__(self, engine: Engine, workflow_id: str, run_id: str, *, created: bool = False) -> None:
        self._engine = engine
        self.workflow_id = workflow_id
        self.run_id = run_id
        self.created = created

    async def result(self, *, follow_continue_as_new: bool = True) -> Any:
        return await self._engine.result(
            self.workflow_id, run_id=self.run_id, follow_continue_as_new=follow_continue_as_new
        )

    async def describe(self) -> WorkflowDescription:
        return await self._engine.describe(self.workflow_id)

    def __repr__(self) -> str:
        return f"<RunHandle {self.workflow_id!r} run {self.run_id}{'' if self.created else ' (existing)'}>"


@final
class Engine:
    """A running engine.  Obtain one with :func:`open_engine`."""

    def __init__(self, core: EngineCore) -> None:
        self._core = core
        self._ownership: Ownership | None = None
        self._threads: InProcessDispatcher | None = None
        self._inbox: InboxDrainer | None = None
        #: Cluster mode's services (``None``: a single-owner store): every client built
        #: on this core routes commands for workflows other nodes own the same way.
        self._cluster: ClusterServices | None = core.cluster_services

    @property
    def epoch(self) -> EngineEpoch:
        return self._core.epoch

    @property
    def owner_claim(self) -> OwnerClaim | None:
        """This engine's claim on its store (``None``: the store has no ownership capability)."""
        return self._ownership.claim if self._ownership is not None else None

    async def drain_inbox(self) -> int:
        """Apply the store inbox's pending commands now, in order; returns how many were acked.

        The engine also drains at open and every ``EngineConfig.inbox_poll_interval``
        seconds.  Each command goes through the matching client method
        (``start``, ``signal``, ``cancel``, ``terminate``, ``reopen``) and is acked
        with its outcome: ok, or the typed error's one-line message.  A store
        without an inbox: 0.
        """
        if self._inbox is None:
            await trio.lowlevel.checkpoint()
            return 0
        return await self._inbox.drain()

    @property
    def store(self) -> Store:
        return self._core.store

    def statistics(self) -> EngineStatistics:
        leases = self._core.registry.leases()
        return EngineStatistics(
            registered_leases=len(leases),
            resident_runs=sum(1 for lease in leases if lease.task is not None),
            stuck_runs=sum(1 for lease in leases if lease.residency is Residency.STUCK),
            loaded_recorders=len(self._core._recorders),
            epoch=self._core.epoch.statistics(),
            abandoned_activity_threads=0 if self._threads is None else self._threads.abandoned_threads(),
        )

    async def start(
        self,
        workflow: WorkflowDefinition[Any] | str,
        *args: Any,
        workflow_id: str | None = None,
        id_reuse: IdReusePolicy = IdReusePolicy.ALLOW_DUPLICATE,
        search_attributes: Mapping[str, Any] | None = None,
        task_queue: str | None = None,
        timeout: timedelta | float | None = None,  # noqa: ASYNC109 - a durable workflow deadline
        request_id: str | None = None,
    ) -> RunHandle:
        """Start a workflow run; returns once ``WorkflowStarted`` is durable.

        ``request_id``: an idempotency key (needs ``workflow_id``).  A start whose
        key is already recorded in the workflow's history records nothing and
        returns the first start's handle, whatever ``id_reuse`` says, so a call
        that failed with :class:`BackendUnavailable` can be retried safely.

        ``timeout`` is the run's deadline (a durable timer from its start): when it
        passes, the run is stopped and ends ``TimedOut``, its activities cancelled.

        Bad input (unknown workflow, unserialisable or oversized arguments,
        bad search attributes) raises before anything is recorded.
        """
        if request_id is not None:
            validate_caller_request_id(request_id)
        return await self._start(
            workflow,
            *args,
            workflow_id=workflow_id,
            id_reuse=id_reuse,
            search_attributes=search_attributes,
            task_queue=task_queue,
            timeout=timeout,
            request_id=request_id,
        )

    async def _start(
        self,
        workflow: WorkflowDefinition[Any] | str,
        *args: Any,
        workflow_id: str | None = None,
        id_reuse: IdReusePolicy = IdReusePolicy.ALLOW_DUPLICATE,
        search_attributes: Mapping[str, Any] | None = None,
        task_queue: str | None = None,
        timeout: timedelta | float | None = None,  # noqa: ASYNC109 - a durable workflow deadline
        request_id: str | None = None,
    ) -> RunHandle:
        """``start`` for a key already vetted: the caller's, or the inbox's ``inbox:N``."""
        core = self._core
        definition = core.workflow_definition(workflow)
        definition.check_arguments(args)
        wid = validate_workflow_id(workflow_id) if workflow_id is not None else new_workflow_id()
        payload = core.codec.encode(list(args), what=f"input of workflow {definition.name!r}")
        attributes = validate_search_attributes({} if search_attributes is None else search_attributes)
        queue = validate_task_queue(core.config.default_task_queue if task_queue is None else task_queue)
        if not isinstance(id_reuse, IdReusePolicy):
            raise TypeError(f"id_reuse must be an IdReusePolicy, got {id_reuse!r}")
        deadline_after = _deadline(timeout)
        if request_id is not None:
            validate_request_id(request_id)
            if workflow_id is None:
                raise ValueError(
                    "a start with a request_id needs an explicit workflow_id: a retry must name the same workflow"
                )
        if not core.epoch.admitting:
            raise epoch_closed(wid, None, "start a workflow")

        def started(run_id: str, now: datetime) -> list[Any]:
            bodies: list[Any] = [
                WorkflowStarted(
                    workflow_type=definition.name,
                    input=payload,
                    run_id=run_id,
                    task_queue=queue,
                    search_attributes=attributes,
                    timeout=deadline_after,
                    request_id=request_id,
                )
            ]
            if deadline_after is not None:
                bodies.append(TimerStarted(timer_id=deadline_timer_id(run_id), fire_at=now + deadline_after))
            return bodies

        fresh = core.claim_unloaded(wid)
        if fresh is not None:
            # Most starts name a new id: append at expected seq 0 without reading
            # first.  A conflict means the id has history: load it and decide below.
            adopted = False
            try:
                async with fresh.lock:
                    run_id = new_run_id()
                    now = core.clock.now()
                    try:
                        await fresh.append(
                            started(run_id, now), action="start a workflow", run_id=run_id, at=now
                        )
                    except SequenceConflict:
                        pass
                    except Exception:
                        if fresh.stale:  # the start may have landed: run it if it did
                            core.resume_idle_soon(wid)
                        raise
                    else:
                        core.release_unloaded(fresh, adopt=True)
                        adopted = True
                        lease = core.new_lease(fresh, run_id, definition.name)
                        core.spawn_run(lease)
            finally:
                if not adopted:
                    core.release_unloaded(fresh, adopt=False)
            if adopted:
                if deadline_after is not None:
                    await core.arm_timer(wid, run_id, deadline_timer_id(run_id), now + deadline_after)
                await core.refresh_visibility_soon(wid)
                return RunHandle(self, wid, run_id, created=True)
        recorder = await core.recorder_for(wid)
        if request_id is not None:
            async with recorder.lock:
                found = _recorded(await recorder.current_history(), wid, request_id, WorkflowStarted, "start")
            if found is not None:
                await core.resume_idle(wid)
                return RunHandle(self, wid, found.run_id, created=True)
        async with recorder.lock:
            history = await recorder.current_history()
            found = _recorded(history, wid, request_id, WorkflowStarted, "start")
            if found is not None:  # a concurrent call with the same key started it meanwhile
                return RunHandle(self, wid, found.run_id, created=True)
            existing_run = latest_run_id(history)
            if existing_run is not None:
                status = workflow_status(history)
                assert status is not None
                reuse = _reuse_allowed(id_reuse, status)
                if reuse is None:
                    return RunHandle(self, wid, existing_run)
                if not reuse:
                    raise WorkflowAlreadyStarted(wid, existing_run, status.value, id_reuse.value)
            run_id = new_run_id()
            now = core.clock.now()
            try:
                await recorder.append(started(run_id, now), action="start a workflow", run_id=run_id, at=now)
            except Exception:
                if recorder.stale:  # the start may have landed: run it if it did
                    core.resume_idle_soon(wid)
                raise
            lease = core.new_lease(recorder, run_id, definition.name)
            core.spawn_run(lease)
            if deadline_after is not None:
                await core.arm_timer(wid, run_id, deadline_timer_id(run_id), now + deadline_after)
        await core.refresh_visibility_soon(wid)
        return RunHandle(self, wid, run_id, created=True)

    async def _await_lifecycle(self, workflow_id: str, recorder: Recorder) -> list[Event] | None:
        """Wait until ``workflow_id``'s history may hold a new lifecycle event.

        ``None``: look at ``recorder`` (this engine drives the workflow).  In
        cluster mode, for a workflow driven elsewhere (or relinquished while
        waiting), the history freshly read from the store."""
        cluster = self._cluster
        core = self._core
        if cluster is None or (core.loaded_recorder(workflow_id) is recorder and core.drives(workflow_id)):
            await recorder.wait_lifecycle()
            if cluster is None or core.loaded_recorder(workflow_id) is recorder:
                return None
        else:
            await cluster.woken()
        return await core.events.read_history(workflow_id)

    async def _existing_recorder(self, workflow_id: str) -> Recorder:
        recorder = await self._core.recorder_for(workflow_id)
        if not recorder.history:
            raise WorkflowNotFound(workflow_id)
        return recorder

    async def result(
        self, workflow_id: str, *, run_id: str | None = None, follow_continue_as_new: bool = True
    ) -> Any:
        """Wait for the run's terminal and return its result (following continue-as-new).

        Raises :class:`WorkflowFailure` if the run failed, was cancelled or timed out.
        """
        recorder = await self._existing_recorder(workflow_id)
        current = run_id or latest_run_id(recorder.history)
        assert current is not None
        checked = 0
        # Cluster mode: a workflow another node drives grows in the store, not in
        # this node's recorder; it is re-read after each wake-up of the cluster
        # waker (a notification, or every sweep_interval).
        fresh: list[Event] | None = None
        while True:
            history = recorder.history if fresh is None else fresh
            if checked and not any(_ends_or_starts(e) for e in history[checked:]):
                # Nothing that could end (or continue) the run was appended: keep waiting.
                checked = len(history)
                fresh = await self._await_lifecycle(workflow_id, recorder)
                continue
            checked = len(history)
            segment = run_segment(history, current)
            if not segment:
                raise WorkflowNotFound(workflow_id, current)
            terminal = current_lease_terminal(segment)
            if terminal is not None:
                body = terminal.body
                if isinstance(body, WorkflowCompleted):
                    return self._core.codec.decode(body.result)
                if isinstance(body, WorkflowContinuedAsNew):
                    if not follow_continue_as_new:
                        raise WorkflowFailure(workflow_id, current, "continued_as_new")
                    successor = next(
                        (
                            e.body.run_id
                            for e in history
                            if isinstance(e.body, WorkflowStarted) and e.body.parent_run_id == current
                        ),
                        None,
                    )
                    if successor is not None:
                        current = successor
                        checked = 0  # look at the successor's segment now, not at new events
                        continue
                elif isinstance(body, WorkflowFailed):
                    raise WorkflowFailure(workflow_id, current, "failed", error=body.error)
                else:
                    status = workflow_status(segment)
                    raise WorkflowFailure(
                        workflow_id,
                        current,
                        status.value if status else "closed",
                        reason=getattr(body, "reason", ""),
                    )
            fresh = await self._await_lifecycle(workflow_id, recorder)

    async def signal(
        self, workflow_id: str, name: str, payload: Any = None, *, request_id: str | None = None
    ) -> None:
        """Record a signal for the workflow's running run and wake it.

        Refused with a typed error, recording nothing, if the workflow does not
        exist (:class:`WorkflowNotFound`) or is not running (:class:`NotRunning`);
        an unserialisable or oversized payload is refused before anything is recorded.
        ``request_id``: an idempotency key; a signal whose key is already recorded
        is not recorded again (and not refused, even if the run ended since).
        """
        core = self._core
        if not isinstance(name, str) or not name:
            raise ValueError(f"signal name must be a non-empty str, got {name!r}")
        check_text(name, "signal name")
        if request_id is not None:
            validate_caller_request_id(request_id)
        encoded = core.codec.encode(payload, what=f"payload of signal {name!r}")
        if not core.epoch.admitting:
            raise epoch_closed(workflow_id, None, "record a signal")
        await self._here_or_owner(
            workflow_id,
            lambda: self._signal_here(workflow_id, name, encoded, request_id),
            lambda: SignalCommand(workflow_id=workflow_id, name=name, payload=encoded, request_id=request_id),
        )

    async def _signal_here(
        self, workflow_id: str, name: str, encoded: Payload, request_id: str | None = None
    ) -> None:
        """Record the signal through this engine's recorder, unless ``request_id`` is recorded."""
        if not self._core.epoch.admitting:
            raise epoch_closed(workflow_id, None, "record a signal")
        recorder = await self._existing_recorder(workflow_id)
        async with recorder.lock:
            history = await recorder.current_history()
            if _recorded(history, workflow_id, request_id, SignalReceived, f"signal {name!r}") is not None:
                return
            status = workflow_status(history)
            run_id = latest_run_id(history)
            if status is not WorkflowStatus.RUNNING or run_id is None:
                raise NotRunning(workflow_id, status.value if status else "unknown", f"signal {name!r} to")
            await recorder.append(
                [SignalReceived(name=name, payload=encoded, request_id=request_id)],
                action=f"record signal {name!r}",
                run_id=run_id,
            )

    # -- cluster mode: commands for workflows another node owns ------------------

    async def _here_or_owner(
        self, workflow_id: str, here: Callable[[], Any], command: Callable[[], Command]
    ) -> Any:
        """Apply locally (``await here()``), or, in cluster mode for a workflow another
        node owns, send ``command()`` through the inbox and return its outcome
        (a refusal is raised as the owner raised it).  A local attempt fenced by the
        store (the workflow was claimed meanwhile) is sent to the owner instead."""
        cluster = self._cluster
        if cluster is None:
            return await here()
        if await cluster.cluster.command_target(workflow_id) is None:
            try:
                return await here()
            except NotOwner:
                pass  # claimed by another node meanwhile (relinquished here): ask the owner
        outcome: CommandOutcome = await cluster.send(command())
        if not outcome.ok:
            raise outcome_error(outcome, workflow_id)
        return outcome

    async def _running_run(self, recorder: Recorder, operation: str) -> tuple[str, list[Event]]:
        """Under the lock: the running run's id and segment, or :class:`NotRunning`."""
        history = await recorder.current_history()
        status = workflow_status(history)
        run_id = latest_run_id(history)
        if status is not WorkflowStatus.RUNNING or run_id is None:
            raise NotRunning(recorder.workflow_id, status.value if status else "unknown", operation)
        return run_id, run_segment(history, run_id)

    async def cancel(self, workflow_id: str, reason: str = "", *, request_id: str | None = None) -> None:
        """Ask the running run to cancel: records ``WorkflowCancelRequested`` and wakes it.

        The workflow sees :class:`aion_trio.WorkflowCancelled` at its next await
        (outside ``ctx.cleanup()``); it may compensate, and ends ``Cancelled`` when
        the exception leaves it.  A second request while one is pending records
        nothing.  Unknown or terminal workflows are refused with a typed error.
        ``request_id``: an idempotency key; a cancel whose key is recorded records
        nothing and is not refused.
        """
        if not isinstance(reason, str):
            raise TypeError(f"reason must be a str, got {reason!r}")
        check_text(reason, "reason")
        if request_id is not None:
            validate_caller_request_id(request_id)
        if not self._core.epoch.admitting:
            raise epoch_closed(workflow_id, None, "cancel a workflow")
        await self._here_or_owner(
            workflow_id,
            lambda: self._cancel_here(workflow_id, reason, request_id),
            lambda: CancelCommand(workflow_id=workflow_id, reason=reason, request_id=request_id),
        )

    async def _cancel_here(self, workflow_id: str, reason: str, request_id: str | None = None) -> None:
        if not self._core.epoch.admitting:
            raise epoch_closed(workflow_id, None, "cancel a workflow")
        recorder = await self._existing_recorder(workflow_id)
        async with recorder.lock:
            history = await recorder.current_history()
            if _recorded(history, workflow_id, request_id, WorkflowCancelRequested, "cancel") is not None:
                return
            run_id, segment = await self._running_run(recorder, "cancel")
            state = RunState(run_id, segment)
            state.sync()
            if state.cancel_request is not None:
                logger.info(
                    "cancel already requested; nothing recorded",
                    extra={"workflow_id": workflow_id, "run_id": run_id},
                )
                return
            await recorder.append(
                [WorkflowCancelRequested(reason=reason, request_id=request_id)],
                action="request cancellation",
                run_id=run_id,
            )

    async def terminate(self, workflow_id: str, reason: str = "", *, request_id: str | None = None) -> None:
        """End the running run at once, without running its code: records
        ``WorkflowCancelled(terminated=True)`` with its in-flight activities cancelled
        and its timers retired in the same batch, then stops the run's task.
        ``request_id``: an idempotency key; a terminate whose key is recorded records
        nothing and is not refused."""
        if not isinstance(reason, str):
            raise TypeError(f"reason must be a str, got {reason!r}")
        check_text(reason, "reason")
        if request_id is not None:
            validate_caller_request_id(request_id)
        if not self._core.epoch.admitting:
            raise epoch_closed(workflow_id, None, "terminate a workflow")
        await self._here_or_owner(
            workflow_id,
            lambda: self._terminate_here(workflow_id, reason, request_id),
            lambda: TerminateCommand(workflow_id=workflow_id, reason=reason, request_id=request_id),
        )

    async def _terminate_here(self, workflow_id: str, reason: str, request_id: str | None = None) -> None:
        core = self._core
        if not core.epoch.admitting:
            raise epoch_closed(workflow_id, None, "terminate a workflow")
        recorder = await self._existing_recorder(workflow_id)
        async with recorder.lock:
            history = await recorder.current_history()
            found = _recorded(history, workflow_id, request_id, CancelledEvent, "terminate")
            if found is not None:
                # Recorded by a first attempt whose acknowledgement was lost: finish what it
                # left undone, unless the run was reopened since.
                run_id = found.run_id
                if current_lease_terminal(run_segment(history, run_id)) != found.event:
                    return
                core.stop_run_locally(workflow_id, run_id, found.event)
            else:
                run_id, segment = await self._running_run(recorder, "terminate")
                bodies: list[Any] = [
                    CancelledEvent(reason=reason, terminated=True, request_id=request_id),
                    *teardown_bodies(segment, run_id, retire_timers=True),
                ]
                events = await recorder.append(bodies, action="terminate the workflow", run_id=run_id)
                core.stop_run_locally(workflow_id, run_id, events[0])
                await forget_retired(core, workflow_id, bodies)
        logger.warning(
            "workflow run terminated: %s",
            reason or "(no reason given)",
            extra={"workflow_id": workflow_id, "run_id": run_id},
        )
        with trio.CancelScope(shield=True), trio.move_on_after(core.config.bookkeeping_timeout):
            await core.upsert_visibility(workflow_id)
        await core.run_closed(workflow_id, run_id)

    async def reopen(self, workflow_id: str, *, request_id: str | None = None) -> RunHandle:
        """Reopen a Failed or Cancelled run: ``WorkflowReopened`` supersedes its terminal and
        a new lease replays it (fixed code can now pass where the old failed); activities
        and timers the teardown cancelled are re-dispatched and re-armed.

        Refused with :class:`CannotReopen` for other statuses, and for a cancelled run whose
        code reacted to the cancellation (it recorded commands after the request: replaying
        without the cancellation would take another path).

        ``request_id``: an idempotency key; a reopen whose key is recorded records
        nothing and returns the first reopen's handle.
        """
        if request_id is not None:
            validate_caller_request_id(request_id)
        if not self._core.epoch.admitting:
            raise epoch_closed(workflow_id, None, "reopen a workflow")
        found = await self._here_or_owner(
            workflow_id,
            lambda: self._reopen_here(workflow_id, request_id),
            lambda: ReopenCommand(workflow_id=workflow_id, request_id=request_id),
        )
        if isinstance(found, CommandOutcome):
            assert found.run_id is not None
            return RunHandle(self, workflow_id, found.run_id)
        assert isinstance(found, RunHandle)
        return found

    async def _reopen_here(self, workflow_id: str, request_id: str | None = None) -> RunHandle:
        core = self._core
        if not core.epoch.admitting:
            raise epoch_closed(workflow_id, None, "reopen a workflow")
        recorder = await self._existing_recorder(workflow_id)
        async with recorder.lock:
            history = await recorder.current_history()
            found = _recorded(history, workflow_id, request_id, WorkflowReopened, "reopen")
        if found is not None:
            await core.resume_idle(workflow_id)
            return RunHandle(self, workflow_id, found.run_id)
        async with recorder.lock:
            history = await recorder.current_history()
            found = _recorded(history, workflow_id, request_id, WorkflowReopened, "reopen")
            if found is not None:  # a concurrent call with the same key reopened it meanwhile
                return RunHandle(self, workflow_id, found.run_id)
            run_id = latest_run_id(history)
            assert run_id is not None
            segment = run_segment(history, run_id)
            terminal = current_lease_terminal(segment)
            if terminal is None:
                raise CannotReopen(workflow_id, run_id, "it is running")
            body = terminal.body
            if not isinstance(body, (WorkflowFailed, CancelledEvent)):
                status = workflow_status(segment)
                raise CannotReopen(
                    workflow_id,
                    run_id,
                    f"it is {status.value if status else 'closed'}; only failed or cancelled runs can be reopened",
                )
            if isinstance(body, CancelledEvent) and not body.terminated:
                reacted = _commands_after_cancel(segment, terminal.seq)
                if reacted:
                    raise CannotReopen(
                        workflow_id,
                        run_id,
                        f"its code reacted to the cancellation ({reacted} command(s) recorded after the "
                        "request); replaying it without the cancellation would take another path — "
                        "start a new run instead",
                    )
            start = segment[0].body
            assert isinstance(start, WorkflowStarted)
            # Activities the teardown cancelled are re-dispatched; so are those whose final
            # failure ended a failed run (the fix is deployed: a fresh attempt, not the
            # recorded failure replayed).
            reopened = sorted(
                {
                    e.body.activity_id
                    for e in segment
                    if isinstance(e.body, ActivityCancelled) and e.seq > terminal.seq
                }
                | set(failures_ending_the_run(segment, terminal) if isinstance(body, WorkflowFailed) else ())
            )
            lease = await core.reopen_locked(recorder, run_id, start.workflow_type, reopened, request_id)
            core.spawn_run(lease)
            await core.redispatch_unsettled(recorder, run_id)
            for timer in outstanding_timers(run_segment(recorder.history, run_id)):
                await core.arm_timer(workflow_id, run_id, timer.timer_id, timer.fire_at)
        logger.info("workflow run reopened", extra={"workflow_id": workflow_id, "run_id": run_id})
        # Children that ended while the run was closed (their outcome stood down) are delivered now.
        await children.repair_children(core, recorder, run_id)
        await core.upsert_visibility_quietly(workflow_id)
        return RunHandle(self, workflow_id, run_id)

    async def query(self, workflow_id: str, name: str, *args: Any) -> Any:
        """Ask the workflow's running run a question: its handler ``name`` answers from its state.

        The handler (registered by the workflow code with
        ``ctx.set_query_handler``) runs while the run is parked between
        steps; a run that is replaying history or in the middle of a step is
        waited for.  Nothing is ever recorded.  ``args`` and the result pass
        through the payload codec, so they must be JSON-serialisable
        (:class:`PayloadNotSerializable` / :class:`PayloadTooLarge` otherwise).

        The query goes to the workflow's latest run (a run that continued as
        new is answered by its successor).

        Raises :class:`WorkflowNotFound` (no such workflow), :class:`NotRunning`
        (the latest run ended), :class:`UnknownQuery` (no handler of that
        name), :class:`QueryFailed` (the handler raised; original in
        ``__cause__``), :class:`QueryReadOnly` (the handler issued a command),
        :class:`QueryUnavailable` (Running, but stuck or not resident in this
        engine: nothing here can answer, so it fails at once rather than
        waiting), :class:`EngineEpochClosed` (the engine is shutting down).
        The run is unaffected by every failure.  Cancellation simply abandons
        the wait.
        """
        core = self._core
        if not isinstance(name, str) or not name:
            raise ValueError(f"query name must be a non-empty str, got {name!r}")
        arguments = core.codec.encode(list(args), what=f"arguments of query {name!r}")
        found = await self._here_or_owner(
            workflow_id,
            lambda: self._query_here(workflow_id, name, arguments),
            lambda: QueryCommand(workflow_id=workflow_id, name=name, args=arguments),
        )
        return query_answer(found) if isinstance(found, CommandOutcome) else found

    async def _query_here(self, workflow_id: str, name: str, arguments: Payload) -> Any:
        core = self._core
        recorder = await self._existing_recorder(workflow_id)
        while True:
            history = recorder.history
            status = workflow_status(history)
            run_id = latest_run_id(history)
            lease = core.registry.get(workflow_id, run_id) if run_id is not None else None
            if status is WorkflowStatus.CONTINUED_AS_NEW and lease is not None and core.epoch.admitting:
                # This engine is starting the successor right now: the query goes to it.
                await recorder.wait_changed()
                continue
            if status is not WorkflowStatus.RUNNING or run_id is None:
                raise NotRunning(
                    workflow_id, status.value if status else "unknown", f"query {name!r}", writes=False
                )
            if lease is None or lease.residency is Residency.SUSPENDED:
                reason = core.stuck.get(workflow_id)
                raise QueryUnavailable(
                    workflow_id,
                    run_id,
                    f"this engine could not resume it ({reason}); fix the cause and restart the engine"
                    if reason
                    else "it is not resident in this engine (another engine started it after this one "
                    "opened the store); query it through the engine that runs it, or restart this one "
                    "to resume it",
                )
            if lease.residency is Residency.STUCK:
                raise QueryUnavailable(
                    workflow_id,
                    run_id,
                    f"it is stuck, its code is not executing ({lease.stuck_reason}); deploy compatible "
                    "code and restart the engine, or terminate the run",
                )
            ctx = lease.context
            if ctx is not None and ctx._answerable:
                # Synchronous from here to the return: the run cannot take a step meanwhile.
                value = ctx._answer_query(name, core.codec.decode(arguments))
                return core.codec.decode(core.codec.encode(value, what=f"result of query {name!r}"))
            if not core.epoch.admitting:
                raise epoch_closed(workflow_id, run_id, f"answer query {name!r}")
            # Starting, replaying, mid-step or ending: wait for it to park (the context
            # wakes us) or for history to change (a terminal, a stuck mark, a reopen).
            lease.query_waiters += 1
            try:
                await recorder.wait_changed()
            finally:
                lease.query_waiters -= 1

    async def history(self, workflow_id: str) -> list[Event]:
        """The workflow's full event history, read from the store."""
        events = await self._core.events.read_history(workflow_id)
        if not events:
            raise WorkflowNotFound(workflow_id)
        return events

    async def describe(self, workflow_id: str) -> WorkflowDescription:
        core = self._core
        if self._cluster is not None and not core.drives(workflow_id):
            # Another node drives it (cluster mode): what the store holds now.
            history: Sequence[Event] = await self.history(workflow_id)
        else:
            history = (await self._existing_recorder(workflow_id)).history
        return describe_history(
            workflow_id, history, codec=core.codec, stuck_reason=core.stuck.get(workflow_id)
        )

    async def list(self, filter: VisibilityFilter | None = None, **criteria: Any) -> list[VisibilityRow]:
        """Visibility rows matching ``filter`` (or ``VisibilityFilter(**criteria)``).

        Rows this engine owes (a start's row is written in the background) are
        written first, so a run this engine started is always listed.
        """
        query = _filter(filter, criteria)
        await self._core.visibility_settled()
        return await self._core.visibility.list(query)

    async def count(self, filter: VisibilityFilter | None = None, **criteria: Any) -> int:
        """How many visibility rows match (after the rows this engine owes are written)."""
        query = _filter(filter, criteria)
        await self._core.visibility_settled()
        return await self._core.visibility.count(query)


@attrs.define(eq=False)
class _Refresh:
    """A background visibility refresh of one workflow."""

    again: bool = True
    done: trio.Event = attrs.field(factory=trio.Event)


def _lease_fields(lease: Lease) -> dict[str, Any]:
    """A lease's log fields."""
    return {"workflow_id": lease.workflow_id, "run_id": lease.run_id, "lease": lease.lease_id}


def _commands_after_cancel(segment: Sequence[Event], terminal_seq: int) -> int:
    """Commands the run's code recorded between its last cancel request and its terminal."""
    request = None
    for event in segment:
        if isinstance(event.body, WorkflowReopened):
            request = None
        elif isinstance(event.body, WorkflowCancelRequested) and request is None:
            request = event.seq
    if request is None:
        return 0
    return sum(
        1
        for e in segment
        if request < e.seq < terminal_seq
        and (
            isinstance(e.body, (ActivityScheduled, MarkerRecorded))
            or (isinstance(e.body, TimerStarted) and not e.body.timer_id.startswith("deadline:"))
        )
    )


def _deadline(timeout: timedelta | float | None) -> timedelta | None:
    if timeout is None:
        return None
    return timedelta(seconds=duration_seconds(timeout, "timeout", allow_zero=False))


def describe_history(
    workflow_id: str, history: Sequence[Event], *, codec: PayloadCodec, stuck_reason: str | None = None
) -> WorkflowDescription:
    """Project a workflow's description from its (non-empty) history.

    ``stuck_reason`` is what the engine serving it knows (or a visibility row
    says); it is reported only while the workflow is Running.
    """
    run_id = latest_run_id(history)
    assert run_id is not None
    segment = run_segment(history, run_id)
    start = segment[0]
    assert isinstance(start.body, WorkflowStarted)
    status = workflow_status(history) or WorkflowStatus.RUNNING
    terminal = current_lease_terminal(segment)
    result = None
    error = None
    if terminal is not None and isinstance(terminal.body, WorkflowCompleted):
        result = codec.decode(terminal.body.result)
    if terminal is not None and isinstance(terminal.body, WorkflowFailed):
        error = terminal.body.error
    scheduled = scheduled_activities(segment)
    scheduled_at = {
        e.body.activity_id: e.recorded_at for e in segment if isinstance(e.body, ActivityScheduled)
    }
    pending = tuple(
        PendingActivity(
            activity_id=a,
            activity_type=scheduled[a].activity_type,
            attempt=next_delivery_attempt(segment, a) or 1,
            scheduled_at=scheduled_at[a],
            task_queue=scheduled[a].task_queue,
        )
        for a in unsettled_activities(segment)
    )
    failed = failure(segment)
    return WorkflowDescription(
        workflow_id=workflow_id,
        run_id=run_id,
        workflow_type=start.body.workflow_type,
        status=status,
        start_time=start.recorded_at,
        close_time=terminal.recorded_at if terminal is not None else None,
        task_queue=start.body.task_queue,
        search_attributes=search_attributes(history, run_id),
        result=result,
        error=error,
        failed_step=failed.failed_step if failed else None,
        pending_activities=pending,
        stuck_reason=stuck_reason if status is WorkflowStatus.RUNNING else None,
        history_length=len(history),
        run_ids=tuple(e.body.run_id for e in history if isinstance(e.body, WorkflowStarted)),
    )


def _ends_or_starts(event: Event) -> bool:
    body = event.body
    return body.TERMINAL or isinstance(body, (WorkflowStarted, WorkflowReopened))


def _filter(filter: VisibilityFilter | None, criteria: Mapping[str, Any]) -> VisibilityFilter:
    if filter is not None and criteria:
        raise TypeError("pass either a VisibilityFilter or keyword criteria, not both")
    return filter if filter is not None else VisibilityFilter(**criteria)


def _recorded(
    history: Sequence[Event], workflow_id: str, request_id: str | None, kind: type[EventBody], what: str
) -> RecordedRequest | None:
    """The event ``request_id`` already recorded (a retried call: record nothing), or ``None``.

    A key already spent on another kind of call is refused: one key names one call."""
    if request_id is None:
        return None
    found = recorded_request(history, request_id)
    if found is None:
        return None
    body = found.event.body
    if not isinstance(body, kind) or (isinstance(body, CancelledEvent) and not body.terminated):
        raise ValueError(
            f"request_id {request_id!r} was already used on workflow {workflow_id!r} for a "
            f"{type(body).__name__} (seq {found.event.seq}); give each distinct call its own request_id"
        )
    logger.info(
        "%s with request id %r is already recorded (seq %d); nothing recorded again",
        what,
        request_id,
        found.event.seq,
        extra={"workflow_id": workflow_id, "run_id": found.run_id, "request_id": request_id},
    )
    return found


def _reuse_allowed(policy: IdReusePolicy, status: WorkflowStatus) -> bool | None:
    """True: start a new run; False: refuse; None: return the existing run."""
    if policy is IdReusePolicy.USE_EXISTING:
        return None
    if policy is IdReusePolicy.REJECT_DUPLICATE:
        return False
    if status in (WorkflowStatus.RUNNING, WorkflowStatus.CONTINUED_AS_NEW):
        return False
    if policy is IdReusePolicy.ALLOW_IF_FAILED:
        return status in (WorkflowStatus.FAILED, WorkflowStatus.CANCELLED, WorkflowStatus.TIMED_OUT)
    return True


@contextlib.asynccontextmanager
async def open_engine(
    store: str | Store,
    *,
    workflows: Iterable[WorkflowDefinition[Any]] = (),
    activities: Iterable[ActivityDefinition[Any]] = (),
    config: EngineConfig | None = None,
    dispatcher: ActivityDispatcher | None = None,
    drain_timeout: float | None = None,
    observers: Iterable[object] = (),
) -> AsyncIterator[Engine]:
    """Open an engine over ``store`` (a URL such as ``sqlite:///orders.db`` or an opened store).

    The engine's epoch lives exactly as long as the ``async with`` block: every
    background task runs in its nursery, so leaving the block cancels and
    joins them all.  On normal exit the shutdown is graceful (stop admitting,
    optional drain, close the latch, cancel, join, close the store); on an
    exception the latch closes first.  A store given as an object is not
    closed (its opener owns it).  ``drain_timeout`` overrides the config's:
    seconds in-flight activity attempts may run on to record their outcome;
    what still runs then is parked (nothing recorded) and re-dispatched by the
    next engine on the store.

    A store with the :class:`~aion_trio.OwnedStore` capability (SQLite,
    memory) is claimed first: if another live engine owns it,
    :class:`~aion_trio.StoreOwned` names it and nothing is written.  The claim
    is renewed every ``config.owner_heartbeat`` seconds of wall-clock time and
    released on exit; should another process take it over (this engine was
    taken for dead), the engine stops and :class:`~aion_trio.NotOwner` is
    raised.  A store with a :class:`~aion_trio.CommandInbox` is drained after
    recovery and then every ``config.inbox_poll_interval`` seconds
    (:meth:`Engine.drain_inbox` drains at once).
    ``dispatcher``: runs activity attempts instead of this process (default:
    the registered activities run here); one that is a
    :class:`~aion_trio.DelegatingDispatcher` is handed the in-process
    dispatcher for the work it keeps local.
    ``observers``: callables ``observer(event)`` (or plugin objects implementing
    ``aion_trio_observe``) handed each :class:`ObserverEvent`, after the
    observers plugins registered through the ``aion_trio`` entry points.
    """
    if config is None:
        config = EngineConfig()
    elif not isinstance(config, EngineConfig):
        raise TypeError(f"open_engine(config=...) takes an EngineConfig, got {config!r}")
    if not isinstance(store, (str, Store)):
        raise TypeError(f"open_engine's store is a URL (str) or an opened store, got {store!r}")
    if drain_timeout is not None:
        config = attrs.evolve(config, drain_timeout=drain_timeout)
    workflow_map, activity_map = index_definitions(workflows, activities)
    hub = build_hub(observers, default_plugin_manager())
    clock = config.clock
    async with contextlib.AsyncExitStack() as stack:
        if config.loop_stall_warning is not None:
            watchdog = LoopWatchdog(config.loop_stall_warning)
            watchdog.start()
            stack.callback(watchdog.stop)
        if isinstance(store, str):
            opened: Store = await stack.enter_async_context(open_store(store))
        else:
            opened = store
        # One owner per store (DESIGN §4.5): claim it before anything is written;
        # StoreOwned names the live owner.  Released after the epoch has joined.
        service_threads = trio.CapacityLimiter(2)
        ownership: Ownership | None = None
        if isinstance(opened, OwnedStore):
            claim = await opened.claim_owner(
                OwnerIdentity.current(),
                now=wall_now(),
                stale_after=timedelta(seconds=config.owner_stale_after),
            )
            if claim.replaced is not None:
                logger.warning(
                    "took the store over from a dead owner: %s (its pid is gone or its heartbeat stopped)",
                    claim.replaced.describe(),
                )
            ownership = Ownership(store=opened, claim=claim, heartbeat=config.owner_heartbeat)
            stack.push_async_callback(ownership.release)
        asyncio_loop = None
        if any(a.loop is ActivityLoop.ASYNCIO for a in activity_map.values()):
            import trio_asyncio

            asyncio_loop = await stack.enter_async_context(trio_asyncio.open_loop())
        limiter = trio.CapacityLimiter(config.max_activity_threads)
        in_process = InProcessDispatcher(activity_map, config.codec, asyncio_loop, limiter)
        # After the epoch has joined: name the activity threads still running.
        stack.callback(in_process.log_unaccounted_threads)
        delegating: object = dispatcher
        if isinstance(delegating, DelegatingDispatcher):
            delegating.use_in_process(in_process)
        # Cluster mode (DESIGN §10): per-workflow ownership fenced by the store.
        cluster = opened if isinstance(opened, ClusterStore) else None
        chosen: ActivityDispatcher = dispatcher or in_process
        if cluster is not None:
            chosen = LeaseGatedDispatcher(chosen, cluster, service_threads)
        try:
            async with trio.open_nursery() as nursery:
                epoch = EngineEpoch(nursery)
                core = EngineCore(
                    store=opened,
                    epoch=epoch,
                    workflows=workflow_map,
                    activities=activity_map,
                    config=config,
                    clock=clock or TrioClock.start(),
                    dispatcher=chosen,
                    observers=hub,
                    cluster=cluster,
                    service_threads=service_threads,
                )
                services: ClusterServices | None = None
                if cluster is not None:
                    services = ClusterServices(
                        core, cluster, opened if isinstance(opened, CommandInbox) else None
                    )
                    core.cluster_services = services
                engine = Engine(core)
                engine._ownership = ownership
                engine._threads = in_process
                if ownership is not None:
                    core.on_store_fenced = ownership.fenced
                try:
                    if ownership is not None:
                        # Not epoch.spawn: losing the claim must end the engine, not be logged.
                        nursery.start_soon(ownership.keep_alive, epoch, name="owner-heartbeat")
                    epoch.spawn(core.timer_service, name="timer-service")
                    if config.activity_schedule_window:
                        epoch.spawn(core.deferral_service, name="deferral-service")
                    if services is not None:
                        epoch.spawn(services.waker, name="cluster-waker")
                        # Not epoch.spawn: a node fenced out of everything must end the engine.
                        nursery.start_soon(services.until_fenced_out, name="cluster-fence-watch")
                    await core.recover()
                    if isinstance(opened, CommandInbox):
                        drainer = InboxDrainer(
                            engine=engine, inbox=opened, config=config, limiter=service_threads
                        )
                        engine._inbox = drainer
                        await drainer.drain()
                        if services is not None:
                            services.drain = drainer.drain  # on every wake-up, after the sweep
                        elif config.inbox_poll_interval is not None:
                            epoch.spawn(drainer.poll_forever, name="inbox-poller")
                    if services is not None:
                        epoch.spawn(services.sweeper, name="cluster-sweeper")
                    yield engine
                except BaseException:
                    epoch.begin_close()
                    raise
                else:
                    epoch.stop_admitting()
                    if config.drain_timeout:
                        with trio.move_on_after(config.drain_timeout):
                            await epoch.wait_attempts_idle()
                    await core.write_all_deferred()
                    if core.recovery_guard is not None:
                        await core.recovery_guard.close()
                    epoch.begin_close()
                finally:
                    nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            # Background tasks never raise (their failures are logged), so a
            # group here carries the body's own exception: re-raise it alone.
            if len(group.exceptions) == 1:
                raise group.exceptions[0] from None
            if group.split(trio.Cancelled)[1] is None:
                # Only cancellation (the caller's scope cancelled the engine, e.g. during
                # the drain): let the cancel scope that owns it catch it.
                raise
            raise AionInternalError(
                f"several errors escaped the engine epoch; please report this: {group!r}"
            ) from group
