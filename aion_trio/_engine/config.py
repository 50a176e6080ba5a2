"""The engine's configuration and the small records it reports: settings, id reuse, descriptions, statistics."""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import datetime
from typing import Any, final

import attrs

from .._admission import FlowLimit, PoolStatistics
from .._clock import EngineClock
from .._codecs import CodecChain, chain_or_none
from .._epoch import EpochStatistics
from .._events import (
    ErrorInfo,
    WorkflowStatus,
)
from .._ids import validate_task_queue
from .._payload import PayloadCodec
from .._retry import check_layer
from .._transient import CompletionRetryConfig

#: Where the engine's start-up may freeze the heap (``EngineConfig.gc_freeze``).
GC_FREEZE_POINTS: tuple[str | None, ...] = ("startup", "recovered", None)


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
        elif kind == "bool":
            if not isinstance(value, bool):
                raise TypeError(f"{where} must be a bool, got {value!r}")
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


def _queue_limits(value: object) -> dict[str, FlowLimit]:
    return _limits(value, "task_queue_limits")


def _activity_limits(value: object) -> dict[str, FlowLimit]:
    return _limits(value, "activity_limits")


def _workflow_queues(value: object) -> dict[str, FlowLimit]:
    return _limits(value, "workflow_queues")


def _limits(value: object, name: str) -> dict[str, FlowLimit]:
    if not isinstance(value, Mapping):
        raise TypeError(
            f"EngineConfig.{name} must be a mapping of names to aion_trio.FlowLimit, got {value!r}"
        )
    out: dict[str, FlowLimit] = {}
    for key, limit in value.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"EngineConfig.{name}: names must be non-empty str, got {key!r}")
        if not isinstance(limit, FlowLimit):
            raise TypeError(f"EngineConfig.{name}[{key!r}] must be an aion_trio.FlowLimit, got {limit!r}")
        if limit.partitioned and name != "workflow_queues":
            raise ValueError(f"EngineConfig.{name}[{key!r}]: only workflow queues are partitioned")
        out[key] = limit
    return out


_SETTING_CLASSES: Mapping[str, type] = {
    "CompletionRetryConfig": CompletionRetryConfig,
    "PayloadCodec": PayloadCodec,
    "CodecChain": CodecChain,
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
    #: Payload codecs (compression, encryption) applied to every stored payload after it is
    #: encoded, and reversed when it is read (docs/payloads.md): a :class:`~aion_trio.Codec`,
    #: a sequence of them (applied in order) or a :class:`~aion_trio.CodecChain`.  ``None``:
    #: payloads are stored as their JSON text.
    codecs: CodecChain | None = attrs.field(default=None, converter=chain_or_none)
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
    #: Seconds (Trio's clock) a run may stay parked on something durable (a timer, a
    #: signal, a child, a cancel) with nothing of it in flight here before it is evicted:
    #: its task, context and recorder leave memory and the next wake replays it from the
    #: store.  ``None``: never for idleness.
    evict_after: float | None = 300.0
    #: At most this many runs' code executes here: beyond it the runs parked longest are
    #: evicted first (runs that are not parked are never evicted).  ``None``: no cap.
    max_resident_runs: int | None = 10_000
    #: Seconds after a closed workflow's terminal and its bookkeeping before its leases and
    #: recorder leave memory (handles and ``result()`` then read the store).  ``None``: kept
    #: until the engine closes.
    release_closed_after: float | None = 1.0
    #: Histories the startup sweep reads at a time.
    recovery_concurrency: int = 32
    #: Lazy recovery (the default): the startup sweep leaves a run parked on a timer with
    #: nothing else outstanding evicted, unreplayed, until its timer (or a signal, a
    #: query...) wakes it, and replays the runs that only wait in the background after
    #: ``open_engine`` returned; runs that were mid-step (an activity to re-dispatch, a
    #: child) resume during the sweep.  The price: code that no longer matches a sleeping
    #: run's history is found when the run wakes or its background replay reaches it, not
    #: at open (it is reported the same way: the run marked stuck, :class:`~aion_trio.RunStuck`,
    #: an error logged); check before a deploy with ``aion-trio replay --store URL --active``.
    #: ``False``: every active run is replayed before ``open_engine`` returns.
    lazy_recovery: bool = True
    # -- admission control (docs/operating.md, "Admission control") ---------------
    #: At most this many workflow starts in flight at once (``Engine.start`` and the
    #: starts the inbox applies, each from its admission until its ``WorkflowStarted``
    #: is durable); more wait for a slot, in arrival order.  ``None``: no bound.
    max_inflight_starts: int | None = 64
    #: At most this many activity attempts in flight at once; more wait for a slot.
    #: The wait does not count against the attempt's ``timeout`` (``schedule_to_close``
    #: keeps counting).  ``None``: no bound.
    max_inflight_activities: int | None = None
    #: Seconds a start may wait for a slot before :class:`~aion_trio.AdmissionTimeout`
    #: is raised (nothing recorded); ``0``: refused at once when every slot is taken;
    #: ``None``: it waits as long as it takes.
    admission_timeout: float | None = None
    # -- flow control (docs/flow-control.md) ---------------------------------------
    #: Limits on the activity attempts of one task queue (by queue name) and of one
    #: activity type (by activity name): at most ``concurrency`` at once in this engine,
    #: ``cluster_concurrency`` across every engine on the store, ``rate`` starts per
    #: ``period``.  An attempt holds a slot of its type's limit, then its queue's, then
    #: ``max_inflight_activities``; waiting does not count against its ``timeout``.
    task_queue_limits: Mapping[str, FlowLimit] = attrs.field(factory=dict, converter=_queue_limits)
    activity_limits: Mapping[str, FlowLimit] = attrs.field(factory=dict, converter=_activity_limits)
    #: Workflow queues ``engine.enqueue(..., queue=NAME)`` admits runs from, by name, each
    #: with its limit (``concurrency``, ``rate`` per ``period``, ``partitioned``); a queue's
    #: runs are counted in the store, so ``concurrency`` (or ``cluster_concurrency``: the
    #: same bound) holds across every engine on it.
    workflow_queues: Mapping[str, FlowLimit] = attrs.field(factory=dict, converter=_workflow_queues)
    #: Seconds (engine clock) a cluster-wide slot (``FlowLimit.cluster_concurrency``) is
    #: held without renewal: the slots of an engine that died come back after this.
    flow_permit_ttl: float = 30.0
    #: Seconds between two looks at the workflow queues for runs that ended or came in
    #: elsewhere (other nodes, a crash); this engine's own enqueues and ends wake it at once.
    queue_poll_interval: float = 1.0
    #: Workflow code that reads a clock, draws random numbers, opens files or sockets or
    #: starts threads raises :class:`~aion_trio.NonDeterministicCall` naming the safe
    #: alternative (docs/concepts.md, "The determinism guard").  ``False``: no guard.
    determinism_guard: bool = True
    #: Stores with :class:`~aion_trio.ScheduleStore`: seconds of wall-clock time between
    #: looks at the stored schedules for changes other processes made (the command line,
    #: other nodes); due ticks fire on the engine clock whatever this is.  ``None``: look
    #: only when this engine changed a schedule or a tick is due.
    schedule_poll_interval: float | None = 1.0
    #: Cluster stores: seconds (engine clock) a node's claim on a schedule it works lasts;
    #: renewed at half-time, taken over by another node once expired.
    schedule_claim_ttl: float = 30.0
    # -- the cycle collector (docs/operating.md, "Garbage collection") ------------
    #: ``gc.set_threshold`` while the engine is open (Python's collector is process-wide:
    #: the thresholds the process had are restored when the last engine closes).  A step
    #: allocates a few hundred short-lived objects; with Python's default ``(700, 10, 10)``
    #: the collector takes a fifth to a half of the CPU under load.  ``None``: leave them.
    gc_thresholds: tuple[int, int, int] | None = (50_000, 20, 100)
    #: ``gc.freeze()`` the heap at a point of the engine's start-up, so that full
    #: collections no longer walk it: ``"startup"`` (after the store is open and the
    #: services built, before recovery: what is frozen lives as long as the engine),
    #: ``"recovered"`` (after recovery too: the recovered runs' objects are no longer
    #: walked either, but garbage cycles among them are kept until the last engine
    #: closes; with lazy recovery only the runs resident when ``open_engine`` returns,
    #: not those replayed later in the background or on wake), ``None``: no freezing.  The last engine to close thaws the heap.
    gc_freeze: str | None = "startup"

    def __attrs_post_init__(self) -> None:
        _check_setting_types(self)
        for name in ("max_inflight_starts", "max_inflight_activities"):
            bound = getattr(self, name)
            if bound is not None and bound < 1:
                raise ValueError(f"{name} must be an int >= 1 or None (no bound), got {bound!r}")
        if self.admission_timeout is not None and self.admission_timeout < 0:
            raise ValueError(
                f"admission_timeout must be >= 0 seconds or None (wait as long as it takes), got {self.admission_timeout!r}"
            )
        if self.max_recovery_attempts is not None and self.max_recovery_attempts < 1:
            raise ValueError(
                f"max_recovery_attempts must be an int >= 1 or None (no counting), got {self.max_recovery_attempts!r}"
            )
        validate_task_queue(self.default_task_queue, "EngineConfig.default_task_queue")
        thresholds = self.gc_thresholds
        if thresholds is not None and not (
            isinstance(thresholds, tuple)
            and len(thresholds) == 3
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in thresholds)
            and thresholds[0] >= 1
        ):
            raise ValueError(
                "gc_thresholds must be None or a tuple of three ints >= 0 (the first >= 1; "
                f"see gc.set_threshold), got {thresholds!r}"
            )
        if self.gc_freeze not in GC_FREEZE_POINTS:
            raise ValueError(f"gc_freeze must be one of {GC_FREEZE_POINTS!r}, got {self.gc_freeze!r}")
        for name in ("flow_permit_ttl", "queue_poll_interval"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)!r}")
        if self.loop_stall_warning is not None and not self.loop_stall_warning > 0:
            raise ValueError(
                f"loop_stall_warning must be > 0 seconds or None (no watchdog), got {self.loop_stall_warning!r}"
            )
        for name in ("evict_after", "release_closed_after"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise ValueError(f"{name} must be >= 0 seconds or None, got {value!r}")
        if self.max_resident_runs is not None and self.max_resident_runs < 1:
            raise ValueError(
                f"max_resident_runs must be an int >= 1 or None (no cap), got {self.max_resident_runs!r}"
            )
        if self.recovery_concurrency < 1:
            raise ValueError(f"recovery_concurrency must be >= 1, got {self.recovery_concurrency!r}")
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
    """An activity of the current run that is not settled yet (``WorkflowDescription.pending_activities``)."""

    activity_id: int
    activity_type: str
    attempt: int
    scheduled_at: datetime
    task_queue: str
    #: The flow-control pool its attempt waits for a slot of in this engine (e.g.
    #: ``"activity:charge"``, ``"task_queue:emails"``, ``"activities"``); ``None``: not waiting.
    waiting_for: str | None = None


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
    #: Where the latest run is in this engine: ``"resident"`` (its code is in memory),
    #: ``"evicted"`` (parked, replayed when woken), or ``None`` (not running here).
    residency: str | None = None


@final
@attrs.frozen(kw_only=True)
class EngineStatistics:
    """A snapshot of an engine's bookkeeping (``engine.statistics()``): runs registered, resident, stuck and
    evicted, threads, renewals.
    """

    registered_leases: int
    resident_runs: int
    stuck_runs: int
    loaded_recorders: int
    epoch: EpochStatistics
    #: Plain ``def`` activity threads the engine stopped waiting for (cancel, terminate, a
    #: timeout) that have not returned yet: each holds a ``max_activity_threads`` slot.
    abandoned_activity_threads: int = 0
    #: Heartbeats that renewed this engine's claim on an owned (embedded) store; 0 for a
    #: store without the ownership capability.
    owner_renewals: int = 0
    #: Runs parked and dropped from memory now (only their registry entry stays).
    evicted_runs: int = 0
    #: Runs evicted and runs made resident again by a wake, since the engine opened.
    evictions: int = 0
    reloads: int = 0
    #: Closed workflows whose leases and recorder left memory, since the engine opened.
    released_workflows: int = 0
    #: Cluster mode: workflows this node stopped because another node claimed them (its
    #: appends were fenced, or a rejoin found them lost), since the engine opened.
    relinquished_workflows: int = 0
    #: Cluster mode: times this node rejoined after its lease lapsed, and the workflows those
    #: rejoins found claimed by another node and dropped (counted in ``relinquished_workflows`` too).
    rejoins: int = 0
    lost_on_rejoin: int = 0
    #: The engine's activity admission pools now (``max_inflight_activities`` and one per
    #: flow limit): slots held and attempts waiting.
    flow_pools: tuple[PoolStatistics, ...] = ()
