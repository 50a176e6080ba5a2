"""Observer hooks: metrics and tracing without touching the core.

An observer is a plain callable ``observer(event)``, or a plugin implementing
the ``aion_trio_observe(event)`` hook (found through the ``aion_trio``
entry-point group, like the store plugins).  The engine hands it typed event
records (:class:`ObserverEvent` subclasses).

The rules the engine keeps:

* **Never under the recorder lock.**  What is observed while a task holds a
  recorder lock (a store append, a terminal) is queued for that task and
  delivered the moment the lock is released.
* **Never during replay.**  Workflow-level events are derived from what the
  recorder *appends*; replay appends nothing, so a resumed run reports no
  second start and no duplicated activity results.
* **An observer cannot break the engine.**  One that raises is logged (the
  first failure with its traceback, later ones at DEBUG) and skipped.
* **Zero cost when nobody listens.**  With no observer the engine holds no
  hub, builds no event object and wraps nothing.

Header hooks (``aion_trio_start_headers``) ride on the same hub: before a run's
``WorkflowStarted`` is built the engine tells them about the start
(:class:`RunStart`) and records the headers they return on top of those the run
already carries, so context (a trace's ``traceparent``) travels in history.  One
that raises or returns something that is not headers is logged and skipped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any, final

import attrs
import trio

from ._errors import PluginError
from ._events import Event, WorkflowFailed, WorkflowStarted, WorkflowStatus, freeze_headers
from ._guard import unguarded
from ._projections import status_after
from ._store import EventStore, TimerEntry, VisibilityFilter, VisibilityRow, VisibilityStore
from .plugin import make_plugin_manager

logger = logging.getLogger("aion_trio.observe")
#: Trio's clock, read without the determinism guard's check (store operations are timed on
#: every step, never by workflow code).
_trio_time = unguarded(trio.current_time)

__all__ = [
    "ActivityAttemptEnded",
    "ActivityAttemptStarted",
    "Observer",
    "ObserverEvent",
    "ObserverHub",
    "RecoveryFinished",
    "RunEvicted",
    "RunRecovered",
    "RunReloaded",
    "RunStart",
    "RunStuck",
    "StoreOperation",
    "TransientRetry",
    "WorkflowRelinquished",
    "WorkflowRunEnded",
    "WorkflowRunStarted",
    "run_headers",
]


# -- the records --------------------------------------------------------------


class ObserverEvent:
    """Base class of every record handed to an observer."""

    __slots__ = ()


@final
@attrs.frozen(kw_only=True)
class WorkflowRunStarted(ObserverEvent):
    """A run's ``WorkflowStarted`` was recorded (a start, a continue-as-new successor, a child)."""

    workflow_id: str
    run_id: str
    workflow_type: str
    #: The run this one continues (continue-as-new), else ``None``.
    continued_from: str | None = None
    #: The run's headers (``WorkflowStarted.headers``).
    headers: Mapping[str, str] = attrs.field(factory=dict, converter=freeze_headers)
    #: A child run: its parent workflow, else ``None``.
    parent_workflow_id: str | None = None
    #: A run started by a reset: the run it was reset from, else ``None``.
    reset_from: str | None = None


@final
@attrs.frozen(kw_only=True)
class WorkflowRunEnded(ObserverEvent):
    """A run's terminal was recorded.  ``status`` is what it ended as.

    ``error_type`` and ``error_message``: a failed run's error (a child's failure,
    a timeout or a cancellation give none); ``headers``: the run's.
    """

    workflow_id: str
    run_id: str
    workflow_type: str
    status: WorkflowStatus
    headers: Mapping[str, str] = attrs.field(factory=dict, converter=freeze_headers)
    error_type: str | None = None
    error_message: str | None = None


@final
@attrs.frozen(kw_only=True)
class ActivityAttemptStarted(ObserverEvent):
    """An activity attempt is handed to the dispatcher."""

    workflow_id: str
    run_id: str
    activity_id: int
    activity_type: str
    attempt: int
    task_queue: str


@final
@attrs.frozen(kw_only=True)
class ActivityAttemptEnded(ObserverEvent):
    """An activity attempt ended.

    ``outcome``: ``completed``, ``failed`` (``error_type`` names the error),
    ``timed_out`` (its per-attempt or schedule-to-close timeout),
    ``worker_lost``, ``parked`` (shutdown: nothing recorded) or ``cancelled``
    (its run ended or a timeout scope expired).  ``seconds``: how long the
    attempt ran, on Trio's clock, ``queued_seconds`` of it waiting to start
    (a plain ``def`` activity waiting for a ``max_activity_threads`` slot: the
    schedule-to-start time, which its ``timeout`` does not count).
    """

    workflow_id: str
    run_id: str
    activity_id: int
    activity_type: str
    attempt: int
    outcome: str
    seconds: float
    error_type: str | None = None
    queued_seconds: float = 0.0
    #: The error's message, with ``error_type``.
    error_message: str | None = None


@final
@attrs.frozen(kw_only=True)
class StoreOperation(ObserverEvent):
    """One call into the store (``append``, ``read_history``, ``upsert``, ...).

    ``store`` is ``events`` or ``visibility``; ``ok`` is false when it raised
    (``error_type`` names the exception).  ``seconds`` is on Trio's clock.
    """

    store: str
    operation: str
    seconds: float
    ok: bool
    error_type: str | None = None


@final
@attrs.frozen(kw_only=True)
class RecoveryFinished(ObserverEvent):
    """The startup sweep ended: ``resumed`` of ``active`` workflows were resumed."""

    active: int
    resumed: int
    seconds: float


@final
@attrs.frozen(kw_only=True)
class RunEvicted(ObserverEvent):
    """A parked run left memory (``reason``: ``"idle"`` past ``EngineConfig.evict_after``, or
    ``"capacity"`` beyond ``EngineConfig.max_resident_runs``); a wake replays it."""

    workflow_id: str
    run_id: str
    workflow_type: str
    reason: str


@final
@attrs.frozen(kw_only=True)
class RunReloaded(ObserverEvent):
    """An evicted run was made resident again (replayed from the store) because something woke it."""

    workflow_id: str
    run_id: str
    workflow_type: str
    #: The run's headers (``WorkflowStarted.headers``).
    headers: Mapping[str, str] = attrs.field(factory=dict, converter=freeze_headers)


@final
@attrs.frozen(kw_only=True)
class RunRecovered(ObserverEvent):
    """A running run recorded by an earlier engine (or another node) is run here again:
    replayed from its history, its unsettled activities re-dispatched (the startup sweep,
    or a workflow taken over in cluster mode).  No second :class:`WorkflowRunStarted` is
    reported for it."""

    workflow_id: str
    run_id: str
    workflow_type: str
    #: The run's headers (``WorkflowStarted.headers``).
    headers: Mapping[str, str] = attrs.field(factory=dict, converter=freeze_headers)


@final
@attrs.frozen(kw_only=True)
class RunStuck(ObserverEvent):
    """A run was marked stuck: it stays Running, its code stopped here, until someone fixes
    the code and restarts, or terminates it (``reason``, as in visibility's ``stuck_reason``).

    Reported wherever it is found, with the same record: a divergence from history (the
    code no longer matches what the run recorded) at the startup sweep, when an evicted
    run wakes and is replayed, or in the background replay of lazy recovery; an
    unregistered workflow type; a run that kept killing recovery (the poison-run guard).
    """

    workflow_id: str
    run_id: str
    workflow_type: str
    reason: str


@final
@attrs.frozen(kw_only=True)
class RunStart:
    """A run about to be started, as a header hook (``aion_trio_start_headers``) sees it.

    ``kind``: ``start`` (a client, inbox or schedule start, a fork), ``child``,
    ``continue_as_new`` or ``reset``.  ``headers``: what the run carries so far (the
    starter's ``headers=``; a child's parent run's, a successor's or a reset run's
    predecessor's).  ``parent_*``: a child's parent run; ``previous_run_id``: the run a
    continue-as-new successor or a reset run follows.  Called in the starter's task (a
    client start: the caller's, so its context variables are visible), before anything
    is recorded.
    """

    kind: str
    workflow_id: str
    workflow_type: str
    headers: Mapping[str, str] = attrs.field(factory=dict, converter=freeze_headers)
    parent_workflow_id: str | None = None
    parent_run_id: str | None = None
    previous_run_id: str | None = None


@final
@attrs.frozen(kw_only=True)
class WorkflowRelinquished(ObserverEvent):
    """Cluster mode: another node claimed the workflow (the store fenced this node's append),
    so this engine stopped it here: its run and in-flight activity attempts were cancelled
    (recording nothing) and its timers and cached history dropped."""

    workflow_id: str
    node_id: str
    reason: str


@final
@attrs.frozen(kw_only=True)
class TransientRetry(ObserverEvent):
    """A store call failed transiently (``BackendUnavailable``) and is retried, or such a
    retry ended.

    ``what`` names the operation (``fire timer t1``).  ``outcome``: ``retrying`` (the
    call failed; the next try is in ``delay`` seconds, ``error_type`` names the
    fault), ``recovered`` (it succeeded) or ``gave_up`` (the engine shut down, or the
    work was no longer this retry's to do).  ``attempts``: retries made so far (the
    failure that began the outage is not one); ``seconds``: since that failure, on
    Trio's clock.
    """

    what: str
    outcome: str
    attempts: int
    seconds: float
    delay: float | None = None
    error_type: str | None = None
    workflow_id: str | None = None
    run_id: str | None = None


Observer = Callable[[ObserverEvent], None]
"""``observer(event)``: called synchronously; must not block."""

HeaderHook = Callable[[RunStart], "Mapping[str, str] | None"]
"""``hook(start)``: the headers to add to a run about to start (``None``: none)."""


# -- the hub -------------------------------------------------------------------


@final
class _Held:
    __slots__ = ("depth", "queued")

    def __init__(self) -> None:
        self.depth = 0
        self.queued: list[ObserverEvent] = []


@final
class ObserverHub:
    """The engine's observers and the delivery rules (outside the recorder lock, isolated)."""

    def __init__(
        self, observers: Sequence[tuple[str, Observer]], header_hooks: Sequence[tuple[str, HeaderHook]] = ()
    ) -> None:
        self._observers = list(observers)
        self._header_hooks = list(header_hooks)
        self._held: dict[trio.lowlevel.Task, _Held] = {}
        #: Observer failures so far, by observer name.
        self.failures: dict[str, int] = {}

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self._observers]

    # -- delivery --------------------------------------------------------------

    def emit(self, event: ObserverEvent) -> None:
        """Deliver ``event`` now, or when the current task releases its recorder lock."""
        try:
            task: trio.lowlevel.Task | None = trio.lowlevel.current_task()
        except RuntimeError:
            task = None
        held = self._held.get(task) if task is not None else None
        if held is not None:
            held.queued.append(event)
            return
        self._deliver(event)

    def _deliver(self, event: ObserverEvent) -> None:
        for name, observer in self._observers:
            try:
                observer(event)
            except Exception:
                self._failed(name, type(event).__name__)

    def _failed(self, name: str, what: str) -> None:
        count = self.failures.get(name, 0) + 1
        self.failures[name] = count
        if count == 1:
            logger.exception(
                "observer %s raised on %s; the engine carries on (further failures of this "
                "observer are logged at DEBUG)",
                name,
                what,
                extra={"observer": name},
            )
        else:
            logger.debug(
                "observer %s raised on %s (failure %d)",
                name,
                what,
                count,
                extra={"observer": name},
                exc_info=True,
            )

    # -- headers -----------------------------------------------------------------------

    def start_headers(self, start: RunStart) -> Mapping[str, str]:
        """The headers of a run about to start: ``start.headers`` with each hook's on top.

        Synchronous, in the caller's task.  A hook that raises, or returns something
        that is not valid headers, is logged and left out.
        """
        headers = dict(start.headers)
        for name, hook in self._header_hooks:
            try:
                added = hook(start)
                if added is None:
                    continue
                merged = freeze_headers({**headers, **added})
            except Exception:
                self._failed(name, "aion_trio_start_headers")
                continue
            headers = dict(merged)
        return headers

    def lock_taken(self) -> None:
        """The current task now holds a recorder lock: queue what it observes."""
        task = trio.lowlevel.current_task()
        held = self._held.get(task)
        if held is None:
            held = self._held[task] = _Held()
        held.depth += 1

    def lock_released(self) -> None:
        """The current task released a recorder lock: deliver its queue once it holds none."""
        task = trio.lowlevel.current_task()
        held = self._held[task]
        held.depth -= 1
        if held.depth:
            return
        del self._held[task]
        for event in held.queued:
            self._deliver(event)

    # -- what the recorder appended ------------------------------------------------

    def appended(self, history: Sequence[Event], events: Sequence[Event]) -> None:
        """Derive run starts and terminals from a batch the recorder just appended."""
        for event in events:
            body = event.body
            if isinstance(body, WorkflowStarted):
                self.emit(
                    WorkflowRunStarted(
                        workflow_id=event.workflow_id,
                        run_id=body.run_id,
                        workflow_type=body.workflow_type,
                        continued_from=body.parent_run_id,
                        headers=body.headers,
                        parent_workflow_id=body.parent_workflow_id,
                        reset_from=body.reset_from_run_id,
                    )
                )
            elif body.TERMINAL:
                start = _latest_start(history, event.seq)
                status = status_after(None, [event])
                assert status is not None
                error = getattr(body, "error", None) if isinstance(body, WorkflowFailed) else None
                self.emit(
                    WorkflowRunEnded(
                        workflow_id=event.workflow_id,
                        run_id=start.run_id if start is not None else "",
                        workflow_type=start.workflow_type if start is not None else "",
                        status=status,
                        headers=start.headers if start is not None else {},
                        error_type=error.type if error is not None else None,
                        error_message=error.message if error is not None else None,
                    )
                )

    # -- stores ----------------------------------------------------------------------

    def wrap_events(self, events: EventStore) -> EventStore:
        return _TimedEventStore(events, self)

    def wrap_visibility(self, visibility: VisibilityStore) -> VisibilityStore:
        return _TimedVisibilityStore(visibility, self)

    def lock(self, lock: trio.Lock, *, nowait: bool = False) -> ObservedLock:
        return ObservedLock(lock, self, nowait=nowait)


def run_headers(hub: ObserverHub | None, start: RunStart) -> Mapping[str, str]:
    """The headers a run starts with: ``start.headers``, and the hooks' on top if any."""
    return start.headers if hub is None else hub.start_headers(start)


def _latest_start(history: Sequence[Event], before_seq: int) -> WorkflowStarted | None:
    """The ``WorkflowStarted`` of the run a terminal at ``before_seq`` ends (the latest before it)."""
    for event in reversed(history):
        if event.seq < before_seq and isinstance(event.body, WorkflowStarted):
            return event.body
    return None


@final
class ObservedLock:
    """A recorder lock whose release delivers what the holder observed meanwhile.

    Acquires exactly as ``trio.Lock`` does (or as ``Recorder.hold()`` does,
    with ``nowait``); the release is synchronous and delivery follows it.
    """

    __slots__ = ("_hub", "_lock", "_nowait")

    def __init__(self, lock: trio.Lock, hub: ObserverHub, *, nowait: bool) -> None:
        self._lock = lock
        self._hub = hub
        self._nowait = nowait

    async def __aenter__(self) -> None:
        if self._nowait:
            await trio.lowlevel.checkpoint_if_cancelled()
            try:
                self._lock.acquire_nowait()
            except trio.WouldBlock:
                await self._lock.acquire()
        else:
            await self._lock.acquire()
        self._hub.lock_taken()

    async def __aexit__(self, *exc: object) -> None:
        self._lock.release()
        self._hub.lock_released()

    def locked(self) -> bool:
        return self._lock.locked()

    def statistics(self) -> trio.LockStatistics:
        return self._lock.statistics()


# -- timed stores ------------------------------------------------------------------


class _Timed:
    _kind = ""

    def __init__(self, inner: Any, hub: ObserverHub) -> None:
        self._inner = inner
        self._hub = hub

    def __getattr__(self, name: str) -> Any:
        # Methods beyond the protocol (a store's own extras) pass through untimed.
        return getattr(self._inner, name)

    async def _timed(self, operation: str, call: Callable[[], Any]) -> Any:
        started = _trio_time()
        try:
            result = await call()
        except BaseException as exc:
            if not isinstance(exc, trio.Cancelled):
                self._hub.emit(
                    StoreOperation(
                        store=self._kind,
                        operation=operation,
                        seconds=_trio_time() - started,
                        ok=False,
                        error_type=type(exc).__name__,
                    )
                )
            raise
        self._hub.emit(
            StoreOperation(store=self._kind, operation=operation, seconds=_trio_time() - started, ok=True)
        )
        return result


@final
class _TimedEventStore(_Timed):
    _kind = "events"

    async def append(self, workflow_id: str, events: Sequence[Event], expected_seq: int) -> None:
        await self._timed("append", lambda: self._inner.append(workflow_id, events, expected_seq))

    async def read_history(self, workflow_id: str, from_seq: int = 1) -> list[Event]:
        result: list[Event] = await self._timed(
            "read_history", lambda: self._inner.read_history(workflow_id, from_seq)
        )
        return result

    async def list_active(self) -> list[str]:
        result: list[str] = await self._timed("list_active", self._inner.list_active)
        return result

    async def list_workflow_ids(self) -> list[str]:
        result: list[str] = await self._timed("list_workflow_ids", self._inner.list_workflow_ids)
        return result

    async def schedule_timer(self, workflow_id: str, timer_id: str, fire_at: datetime) -> None:
        await self._timed(
            "schedule_timer", lambda: self._inner.schedule_timer(workflow_id, timer_id, fire_at)
        )

    async def remove_timer(self, workflow_id: str, timer_id: str) -> None:
        await self._timed("remove_timer", lambda: self._inner.remove_timer(workflow_id, timer_id))

    async def expired_timers(self, as_of: datetime) -> list[TimerEntry]:
        result: list[TimerEntry] = await self._timed(
            "expired_timers", lambda: self._inner.expired_timers(as_of)
        )
        return result

    async def aclose(self) -> None:
        await self._inner.aclose()


@final
class _TimedVisibilityStore(_Timed):
    _kind = "visibility"

    async def upsert(self, row: VisibilityRow) -> None:
        await self._timed("upsert", lambda: self._inner.upsert(row))

    async def get(self, workflow_id: str) -> VisibilityRow | None:
        result: VisibilityRow | None = await self._timed("get", lambda: self._inner.get(workflow_id))
        return result

    async def list(self, filter: VisibilityFilter | None = None) -> list[VisibilityRow]:
        result: list[VisibilityRow] = await self._timed("list", lambda: self._inner.list(filter))
        return result

    async def count(self, filter: VisibilityFilter | None = None) -> int:
        result: int = await self._timed("count", lambda: self._inner.count(filter))
        return result

    async def aclose(self) -> None:
        await self._inner.aclose()


# -- building the hub ------------------------------------------------------------------


def _describe(observer: object) -> str:
    name = getattr(observer, "__qualname__", None) or getattr(observer, "__name__", None)
    return str(name) if name else type(observer).__name__


def _header_hooks(pm: Any, names: dict[str, int]) -> list[tuple[str, HeaderHook]]:
    found: list[tuple[str, HeaderHook]] = []
    for impl in pm.hook.aion_trio_start_headers.get_hookimpls():
        name = pm.get_name(impl.plugin) or _describe(impl.plugin)
        found.append((_unique(name, names), _with_start(impl.function)))
    return found


def _with_start(function: Callable[..., Any]) -> HeaderHook:
    def hook(start: RunStart) -> Mapping[str, str] | None:
        added: Mapping[str, str] | None = function(start=start)
        return added

    return hook


def _from_hookimpls(pm: Any, names: dict[str, int]) -> list[tuple[str, Observer]]:
    found: list[tuple[str, Observer]] = []
    for impl in pm.hook.aion_trio_observe.get_hookimpls():
        name = pm.get_name(impl.plugin) or _describe(impl.plugin)
        function = impl.function
        if impl.argnames:
            observer: Observer = _with_event(function)
        else:
            observer = _no_args(function)
        found.append((_unique(name, names), observer))
    return found


def _with_event(function: Callable[..., Any]) -> Observer:
    def observe(event: ObserverEvent) -> None:
        function(event=event)

    return observe


def _no_args(function: Callable[..., Any]) -> Observer:
    def observe(event: ObserverEvent) -> None:
        function()

    return observe


def _unique(name: str, names: dict[str, int]) -> str:
    seen = names.get(name, 0)
    names[name] = seen + 1
    return name if not seen else f"{name}#{seen + 1}"


def build_hub(direct: Iterable[object], plugin_manager: Any | None) -> ObserverHub | None:
    """The engine's hub: entry-point observers (``plugin_manager``) then ``direct`` ones.

    ``direct`` items are callables ``observer(event)`` or plugin objects
    implementing ``aion_trio_observe`` and/or ``aion_trio_start_headers``.  ``None``
    when nothing observes and no hook adds headers.
    """
    names: dict[str, int] = {}
    hook_names: dict[str, int] = {}
    observers: list[tuple[str, Observer]] = []
    hooks: list[tuple[str, HeaderHook]] = []
    if plugin_manager is not None:
        observers.extend(_from_hookimpls(plugin_manager, names))
        hooks.extend(_header_hooks(plugin_manager, hook_names))
    for item in direct:
        if hasattr(item, "aion_trio_observe") or hasattr(item, "aion_trio_start_headers"):
            pm = make_plugin_manager(load_entry_points=False, plugins=[item])
            found = _from_hookimpls(pm, names)
            found_hooks = _header_hooks(pm, hook_names)
            for attribute, listed in (("aion_trio_observe", found), ("aion_trio_start_headers", found_hooks)):
                if hasattr(item, attribute) and not listed:
                    raise PluginError(
                        f"observer {_describe(item)} has an {attribute} attribute that is not marked "
                        "with aion_trio.plugin.hookimpl; mark it, or pass a plain callable observer(event)"
                    )
            observers.extend(found)
            hooks.extend(found_hooks)
        elif callable(item):
            observers.append((_unique(_describe(item), names), item))
        else:
            raise TypeError(
                f"an observer must be a callable observer(event) or a plugin implementing "
                f"aion_trio_observe, got {item!r}"
            )
    return ObserverHub(observers, hooks) if observers or hooks else None
