"""Running activities and recording their outcomes (docs/architecture.md, "Activities").

Dispatch goes through an :class:`ActivityDispatcher`; the default runs
registered activities in this process: ``async def`` as Trio tasks (really
cancellable), plain ``def`` in worker threads (so a slow synchronous activity
never blocks the engine's Trio thread), asyncio coroutine functions through
trio-asyncio.

Every record the driver makes goes through :func:`record_activity_event`:
recorder lock, epoch gate, settle check on the run's segment, append.
"""

from __future__ import annotations

import contextvars
import enum
import functools
import json
import math
import threading
import time
import traceback
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Protocol, cast, final, runtime_checkable

import attrs
import trio

from ._clock import hold_mock_time
from ._contain import being_cancelled, is_structural
from ._definitions import ActivityDefinition, ActivityLoop
from ._errors import (
    AttemptCancelled,
    EngineEpochClosed,
    PayloadError,
    PolicyRefused,
    StoreError,
    TerminalError,
    UnknownActivityType,
    WorkerLost,
)
from ._events import (
    ActivityAdvisoryExhausted,
    ActivityCompleted,
    ActivityError,
    ActivityFailed,
    ActivityFallbackRouted,
    ActivityStarted,
    Event,
    EventBody,
    FailureCause,
    WorkflowReopened,
)
from ._logs import ContextLogger
from ._observe import ActivityAttemptEnded, ActivityAttemptStarted
from ._payload import Payload, PayloadCodec
from ._projections import retry_trail, run_segment
from ._retry import ActivityOptions
from ._transient import Transient
from ._watchdog import register_step

if TYPE_CHECKING:
    from ._recorder import Recorder

logger = ContextLogger("aion_trio.activity")


@final
@attrs.frozen(kw_only=True)
class ActivityInfo:
    """What an activity can learn about the attempt it is running (``aion_trio.activity_info()``)."""

    workflow_id: str
    run_id: str
    activity_id: int
    activity_type: str
    attempt: int
    task_queue: str


_current_info: contextvars.ContextVar[ActivityInfo | None] = contextvars.ContextVar(
    "aion_trio_activity_info", default=None
)


def activity_info() -> ActivityInfo:
    """The running activity attempt's identity; raises ``RuntimeError`` outside an activity."""
    info = _current_info.get()
    if info is None:
        raise RuntimeError("aion_trio.activity_info() was called outside an activity")
    return info


@final
@attrs.frozen(kw_only=True)
class ActivityRequest:
    """One attempt of one activity, as handed to a dispatcher."""

    workflow_id: str
    run_id: str
    activity_id: int
    activity_type: str
    input: Payload
    attempt: int
    task_queue: str
    #: The resolved options as recorded in ``ActivityScheduled`` (a JSON object).
    options: Payload
    #: When the activity was scheduled (``schedule_to_close`` counts from here).
    scheduled_at: datetime | None = None

    def resolved_options(self) -> ActivityOptions:
        return _decoded_options(self.options.json, self.task_queue)


class OutcomeKind(enum.Enum):
    COMPLETED = "completed"
    FAILED = "failed"
    #: The worker vanished: re-dispatch the same attempt, consume no budget.
    WORKER_LOST = "worker_lost"
    #: The dispatch was parked for a restart: record nothing, deliver nothing.
    PARKED = "parked"


@final
@attrs.frozen(kw_only=True)
class ActivityOutcome:
    """What an attempt produced."""

    result: Payload | None = None
    error: ActivityError | None = None
    kind: OutcomeKind = attrs.field()

    @kind.default
    def _default_kind(self) -> OutcomeKind:
        return OutcomeKind.COMPLETED if self.error is None else OutcomeKind.FAILED

    @property
    def ok(self) -> bool:
        return self.kind is OutcomeKind.COMPLETED


class ActivityDispatcher(Protocol):
    """Runs one activity attempt and reports its outcome.

    The engine bounds each attempt by its ``timeout`` (cancelling
    ``dispatch``) and drives retries; a dispatcher only runs one attempt.
    Cancellation of ``dispatch`` means the attempt was stopped by the engine:
    nothing is recorded for it by the dispatcher.
    """

    async def dispatch(self, request: ActivityRequest) -> ActivityOutcome: ...


@runtime_checkable
class DelegatingDispatcher(Protocol):
    """A dispatcher that hands some requests to the engine's in-process dispatcher.

    :func:`~aion_trio.open_engine` given such a ``dispatcher=`` calls
    :meth:`use_in_process` once, before anything is dispatched, with the
    dispatcher that runs the engine's registered activities in its own
    process (threads, asyncio loop and codec as configured).  The PostgreSQL
    task dispatcher uses it for the task queues it does not send to workers.
    """

    def use_in_process(self, local: ActivityDispatcher) -> None: ...


#: Runs one attempt in this process: ``execute(request, on_heartbeat)``.
#: ``on_heartbeat(details)`` is called (in the Trio thread) on each heartbeat.
ActivityExecutor = Callable[[ActivityRequest, Callable[[Any], None] | None], Awaitable["ActivityOutcome"]]


def error_from_exception(exc: BaseException, cause: FailureCause) -> ActivityError:
    return ActivityError(
        cause=cause,
        type=type(exc).__qualname__,
        message=str(exc),
        traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
    )


@functools.lru_cache(maxsize=1024)
def _decoded_options(options_json: str, task_queue: str) -> ActivityOptions:
    """Recorded options are decoded once per distinct text, not on every attempt."""
    data = json.loads(options_json)
    return ActivityOptions.from_json(data if isinstance(data, dict) else {}, task_queue=task_queue)


@final
class _Heartbeat:
    def __init__(
        self,
        timeout: float | None,
        on_beat: Callable[[Any], None] | None = None,
        info: ActivityInfo | None = None,
    ) -> None:
        self.timeout = timeout
        self.info = info
        #: Set (in the Trio thread) once the engine stopped waiting for the attempt's thread.
        self.stopped = False
        self.last = trio.current_time()
        self.details: Any = None
        self.expired = False
        self.changed = trio.Event()
        self.on_beat = on_beat

    def beat(self, details: Any = None) -> None:
        self.last = trio.current_time()
        self.details = details
        self.changed.set()
        self.changed = trio.Event()
        if self.on_beat is not None:
            self.on_beat(details)

    async def watch(self, scope: trio.CancelScope) -> None:
        assert self.timeout is not None
        while True:
            with trio.move_on_at(self.last + self.timeout):
                await self.changed.wait()
                continue
            self.expired = True
            scope.cancel()
            return


async def _watch_heartbeat(tracker: _Heartbeat, attempt: trio.CancelScope, watch: trio.CancelScope) -> None:
    with watch:
        await tracker.watch(attempt)


_current_heartbeat: contextvars.ContextVar[_Heartbeat | None] = contextvars.ContextVar(
    "aion_trio_heartbeat", default=None
)


def heartbeat(details: Any = None) -> None:
    """Report liveness from inside an activity (any kind: Trio, thread or asyncio).

    With a ``heartbeat_timeout``, an attempt that does not heartbeat in time is
    cancelled and fails as a timeout (retry-eligible within the budget).
    In a plain ``def`` activity whose attempt was stopped (cancel, terminate,
    a timeout, a deadline, engine shutdown) this raises
    :class:`~aion_trio.AttemptCancelled`: the engine no longer waits for the
    thread.  Outside an activity this raises ``RuntimeError``.
    """
    tracker = _current_heartbeat.get()
    if tracker is None:
        raise RuntimeError("aion_trio.heartbeat() was called outside an activity")
    try:
        trio.lowlevel.current_task()
    except RuntimeError:
        _raise_if_stopped(tracker)
        try:
            trio.from_thread.run_sync(tracker.beat, details)
        except trio.RunFinishedError:
            tracker.stopped = True  # the whole Trio run is gone
        _raise_if_stopped(tracker)
    else:
        tracker.beat(details)


def _raise_if_stopped(tracker: _Heartbeat) -> None:
    if tracker.stopped:
        info = tracker.info
        assert info is not None
        raise AttemptCancelled(info.activity_type, info.activity_id, info.attempt)


def activity_cancelled() -> bool:
    """Whether the running attempt was stopped (cheap: poll it in a plain ``def`` activity's loop).

    ``True`` once the engine stopped waiting for the attempt's thread: on
    cancel, terminate, a timeout (attempt, heartbeat, schedule-to-close,
    timeout scope), a workflow deadline or engine shutdown.  Always ``False``
    in ``async def`` activities, which are really cancelled instead.  Outside
    an activity this raises ``RuntimeError``.
    """
    tracker = _current_heartbeat.get()
    if tracker is None:
        raise RuntimeError("aion_trio.activity_cancelled() was called outside an activity")
    return tracker.stopped


# -- the attempt's clock: waiting for a thread slot is not the attempt's time --------


@final
class _AttemptClock:
    """An attempt's timeout scope, which a dispatcher stops while the attempt waits in a queue.

    The per-attempt ``timeout`` counts from the moment the attempt really
    starts (a thread slot acquired); ``schedule_to_close`` keeps counting.
    ``queued_seconds`` is the schedule-to-start wait, reported to observers.
    """

    __slots__ = ("_hard", "_queued_at", "_scope", "_timeout", "queued_seconds")

    def __init__(self, timeout: float | None) -> None:
        self._scope: trio.CancelScope | None = None
        self._timeout = timeout
        self._hard = math.inf  # schedule-to-close, as a Trio deadline (inf: none)
        self._queued_at: float | None = None
        self.queued_seconds = 0.0

    def bind(self, scope: trio.CancelScope, hard: float) -> None:
        """The scope bounding the attempt, and its schedule-to-close deadline (inf: none)."""
        self._scope = scope
        self._hard = hard

    def queued(self) -> None:
        self._queued_at = trio.current_time()
        if self._scope is not None and self._timeout is not None:
            self._scope.deadline = self._hard

    def started(self) -> None:
        now = trio.current_time()
        if self._queued_at is not None:
            self.queued_seconds += now - self._queued_at
            self._queued_at = None
        if self._scope is not None and self._timeout is not None:
            self._scope.deadline = min(now + self._timeout, self._hard)


_current_attempt_clock: contextvars.ContextVar[_AttemptClock | None] = contextvars.ContextVar(
    "aion_trio_attempt_clock", default=None
)


# -- threads: slots, and the threads the engine stopped waiting for ------------------


@final
class _HeldSlot:
    """A thread-limiter slot taken before the thread starts (so its wait is not the attempt's
    time), handed to ``trio.to_thread.run_sync``, which gives it back when the thread returns."""

    __slots__ = ("_limiter", "taken")

    def __init__(self, limiter: trio.CapacityLimiter) -> None:
        self._limiter = limiter
        self.taken = False

    async def acquire_on_behalf_of(self, borrower: object) -> None:
        self.taken = True  # already held; no checkpoint, so no cancellation can lose it

    def release_on_behalf_of(self, borrower: object) -> None:
        self._limiter.release_on_behalf_of(self)


@final
@attrs.define(eq=False)
class _ActivityThread:
    info: ActivityInfo
    started: float  # time.monotonic()
    done: bool = False
    abandoned_at: float | None = None


@final
class _ThreadBook:
    """Every activity thread in flight; the ones the engine stopped waiting for are logged."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[int, _ActivityThread] = {}

    def started(self, info: ActivityInfo) -> _ActivityThread:
        thread = _ActivityThread(info=info, started=time.monotonic())
        with self._lock:
            self._running[id(thread)] = thread
        return thread

    def returned(self, thread: _ActivityThread) -> None:
        # In the activity's thread, as it returns.
        with self._lock:
            thread.done = True
            self._running.pop(id(thread), None)
        if thread.abandoned_at is not None:
            logger.info(
                "its abandoned thread returned %.3fs after it was told to stop; its thread slot is free",
                time.monotonic() - thread.abandoned_at,
                extra=_thread_fields(thread),
            )

    def abandoned(self, thread: _ActivityThread) -> None:
        with self._lock:
            if thread.done:
                return
            thread.abandoned_at = time.monotonic()
        logger.warning(
            "the attempt was stopped while running in a thread; the thread runs on (told through "
            "aion_trio.heartbeat() / activity_cancelled()) and holds one of max_activity_threads "
            "until it returns",
            extra=_thread_fields(thread),
        )

    def abandoned_count(self) -> int:
        with self._lock:
            return sum(1 for t in self._running.values() if t.abandoned_at is not None)

    def log_unaccounted(self) -> None:
        """At engine close: name every activity thread still running."""
        with self._lock:
            running = list(self._running.values())
        if not running:
            return
        now = time.monotonic()
        logger.warning(
            "the engine closed with %d activity thread(s) still running (told to stop; their results "
            "are discarded): %s",
            len(running),
            "; ".join(
                f"{t.info.workflow_id} activity:{t.info.activity_id} {t.info.activity_type} "
                f"attempt {t.info.attempt}, running {now - t.started:.1f}s"
                for t in running
            ),
            extra={"threads": len(running)},
        )


def _thread_fields(thread: _ActivityThread) -> dict[str, Any]:
    info = thread.info
    return {
        "workflow_id": info.workflow_id,
        "run_id": info.run_id,
        "activity": info.activity_id,
        "activity_type": info.activity_type,
        "attempt": info.attempt,
    }


@final
class InProcessDispatcher:
    """Runs registered activities in this process."""

    def __init__(
        self,
        activities: Mapping[str, ActivityDefinition[Any]],
        codec: PayloadCodec,
        asyncio_loop: Any = None,
        thread_limiter: trio.CapacityLimiter | None = None,
    ) -> None:
        self._activities = activities
        self._codec = codec
        self._asyncio_loop = asyncio_loop
        self._limiter = thread_limiter
        self._threads = _ThreadBook()

    def abandoned_threads(self) -> int:
        """Activity threads the engine stopped waiting for that have not returned yet
        (each holds a ``max_activity_threads`` slot until it does)."""
        return self._threads.abandoned_count()

    def log_unaccounted_threads(self) -> None:
        """Log every activity thread still running (the engine calls it when it closes)."""
        self._threads.log_unaccounted()

    async def dispatch(self, request: ActivityRequest) -> ActivityOutcome:
        return await self.execute(request)

    async def execute(
        self, request: ActivityRequest, on_heartbeat: Callable[[Any], None] | None = None
    ) -> ActivityOutcome:
        """Run one attempt here; ``on_heartbeat(details)`` hears each of its heartbeats.

        An :data:`ActivityExecutor`: remote activity workers run the attempts
        they claim through it, so every kind of activity behaves as it does in
        an engine's own process.
        """
        definition = self._activities.get(request.activity_type)
        if definition is None:
            error = UnknownActivityType(request.activity_type, sorted(self._activities))
            return ActivityOutcome(error=error_from_exception(error, FailureCause.TERMINAL))
        options = request.resolved_options()
        args = self._codec.decode(request.input)
        if not isinstance(args, list):
            args = [args]
        info = ActivityInfo(
            workflow_id=request.workflow_id,
            run_id=request.run_id,
            activity_id=request.activity_id,
            activity_type=request.activity_type,
            attempt=request.attempt,
            task_queue=request.task_queue,
        )
        tracker = _Heartbeat(options.heartbeat_timeout, on_heartbeat, info)
        info_token = _current_info.set(info)
        beat_token = _current_heartbeat.set(tracker)
        scope: trio.CancelScope | None = None
        outcome: ActivityOutcome | None = None
        value: Any = None
        try:
            if options.heartbeat_timeout is None:
                # No watchdog can cancel the attempt: no scope needed.
                value, outcome = await self._guarded_call(definition, args, options)
            else:
                scope = trio.CancelScope()
                watch = trio.CancelScope()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_watch_heartbeat, tracker, scope, watch)
                    try:
                        with scope:
                            value, outcome = await self._guarded_call(definition, args, options)
                    finally:
                        watch.cancel()
        finally:
            _current_heartbeat.reset(beat_token)
            _current_info.reset(info_token)
        if outcome is not None:
            return outcome
        if scope is not None and scope.cancelled_caught and tracker.expired:
            return ActivityOutcome(
                error=ActivityError(
                    cause=FailureCause.TIMEOUT,
                    type="HeartbeatTimeout",
                    message=f"attempt {request.attempt} sent no heartbeat for {options.heartbeat_timeout}s",
                )
            )
        try:
            payload = self._codec.encode(value, what=f"result of activity {definition.name!r}")
        except PayloadError as exc:
            return ActivityOutcome(error=error_from_exception(exc, FailureCause.TERMINAL))
        return ActivityOutcome(result=payload)

    async def _guarded_call(
        self, definition: ActivityDefinition[Any], args: list[Any], options: ActivityOptions
    ) -> tuple[Any, ActivityOutcome | None]:
        """Run the activity; an exception becomes a classified outcome."""
        try:
            return await self._call(definition, args), None
        except TerminalError as exc:
            return None, ActivityOutcome(error=error_from_exception(exc, FailureCause.TERMINAL))
        except PolicyRefused as exc:
            return None, ActivityOutcome(error=error_from_exception(exc, FailureCause.POLICY_REFUSED))
        except WorkerLost as exc:
            return None, ActivityOutcome(
                error=error_from_exception(exc, FailureCause.RETRYABLE), kind=OutcomeKind.WORKER_LOST
            )
        except BaseException as exc:
            # Any exception of the code's own (SystemExit, a custom BaseException,
            # asyncio's CancelledError...) fails the attempt; only the engine's
            # cancellation and a Ctrl-C pass (see _contain).
            if is_structural(exc):
                raise
            if being_cancelled():
                # Raised while the engine cancels the attempt: that is the cancellation.
                await trio.lowlevel.checkpoint()
            retry = options.retry
            cause = (
                FailureCause.TERMINAL
                if retry is not None and retry.is_non_retryable(exc)
                else FailureCause.RETRYABLE
            )
            return None, ActivityOutcome(error=error_from_exception(exc, cause))

    async def _call_in_thread(self, definition: ActivityDefinition[Any], args: list[Any]) -> Any:
        """Run a plain ``def`` activity in a worker thread.

        Threads cannot be interrupted: a stopped attempt abandons its thread
        (its late result is discarded), tells it (``heartbeat()`` raises,
        ``activity_cancelled()`` is true) and logs it; the thread keeps its
        slot until it really returns.  The attempt's ``timeout`` starts once a
        slot is held.
        """
        tracker = _current_heartbeat.get()
        info = _current_info.get()
        assert tracker is not None
        assert info is not None
        limiter = self._limiter or trio.to_thread.current_default_thread_limiter()
        slot = _HeldSlot(limiter)
        clock = _current_attempt_clock.get()
        if clock is not None:
            clock.queued()
        await limiter.acquire_on_behalf_of(slot)
        if clock is not None:
            clock.started()
        thread = self._threads.started(info)
        context = contextvars.copy_context()
        book = self._threads

        def work() -> Any:
            try:
                return context.run(definition.fn, *args)
            finally:
                book.returned(thread)

        try:
            with hold_mock_time():  # a MockClock's autojump waits for the thread
                return await trio.to_thread.run_sync(
                    work,
                    abandon_on_cancel=True,
                    limiter=cast("trio.CapacityLimiter", slot),  # a limiter by protocol
                    thread_name=f"aion_trio activity {definition.name}",
                )
        except BaseException:
            # Stopped while the thread runs (cancel, terminate, a timeout, shutdown): tell it.
            tracker.stopped = True
            if slot.taken:  # else the thread never started
                book.abandoned(thread)
            raise
        finally:
            if not slot.taken:  # the thread never started: the slot is still ours
                book.returned(thread)
                limiter.release_on_behalf_of(slot)

    async def _call(self, definition: ActivityDefinition[Any], args: list[Any]) -> Any:
        if definition.loop is ActivityLoop.TRIO:
            return await definition.fn(*args)
        if definition.loop is ActivityLoop.THREAD:
            return await self._call_in_thread(definition, args)
        import trio_asyncio

        if self._asyncio_loop is None:  # pragma: no cover - the engine opens one when needed
            raise RuntimeError("no asyncio loop is open for asyncio activities")
        return await trio_asyncio.aio_as_trio(definition.fn, loop=self._asyncio_loop)(*args)


def _stepped_activity(frame_locals: dict[str, Any]) -> str | None:
    request = frame_locals.get("request")
    if not isinstance(request, ActivityRequest):
        return None
    return (
        f"activity:{request.activity_id} {request.activity_type} (attempt {request.attempt}) "
        f"of workflow {request.workflow_id!r} run {request.run_id}"
    )


# A blocked Trio loop names the activity on its stack (see _watchdog).
register_step(InProcessDispatcher.execute, _stepped_activity)


def _observed_outcome(outcome: ActivityOutcome) -> tuple[str, str | None]:
    """An attempt's outcome as observers see it: (outcome, error type)."""
    if outcome.kind is OutcomeKind.FAILED and outcome.error is not None:
        kind = "timed_out" if outcome.error.cause is FailureCause.TIMEOUT else "failed"
        return kind, outcome.error.type
    return outcome.kind.value, None


class RecordOutcome(enum.Enum):
    RECORDED = "recorded"
    #: The activity or its run already has a terminal: stop, record nothing.
    SETTLED_ELSEWHERE = "settled_elsewhere"
    #: The epoch is closed: nothing may be written by this engine any more.
    EPOCH_CLOSED = "epoch_closed"


async def record_activity_event(
    recorder: Recorder, run_id: str, activity_id: int, body: EventBody, *, retried: bool = False
) -> RecordOutcome:
    """The guarded append every activity record goes through.

    Under the recorder lock: epoch gate first, then the run's segment (re-read
    if stale): if the activity or the run already has a terminal, stand down.
    ``retried``: an earlier try of this very record failed with an unknown
    outcome, so first look whether it landed (then it is not written twice).
    Store errors propagate (the caller decides whether to retry).
    """
    action = f"record {type(body).__name__}"
    async with recorder.hold():
        try:
            recorder.epoch.gate(recorder.workflow_id, run_id, action)
        except EngineEpochClosed:
            return RecordOutcome.EPOCH_CLOSED
        # The activity's own deferred schedule (if any) shares this append.
        history = await recorder.current_history(keep_deferred=True)
        if retried and _landed(history, run_id, body):
            return RecordOutcome.RECORDED
        state = recorder.run_state(run_id)
        if activity_id in state.settled or state.ended is not None:
            return RecordOutcome.SETTLED_ELSEWHERE
        try:
            await recorder.append((body,), action=action, run_id=run_id)
        except EngineEpochClosed:
            return RecordOutcome.EPOCH_CLOSED
        return RecordOutcome.RECORDED


def _record_key(body: EventBody) -> tuple[Any, ...]:
    """What tells one activity record apart from every other of its run."""
    return (
        type(body),
        getattr(body, "activity_id", None),
        getattr(body, "attempt", None),
        getattr(body, "final", None),
    )


def _landed(history: Sequence[Event], run_id: str, body: EventBody) -> bool:
    """Whether ``body`` is already in ``run_id``'s segment (an append of unknown outcome landed)."""
    key = _record_key(body)
    return any(_record_key(event.body) == key for event in run_segment(history, run_id))


class RecordFailed(Exception):
    """A required retry-trail record could not be written (the store failed)."""


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
    ) -> None:
        self.recorder = recorder
        self.dispatcher = dispatcher
        self.request = request
        self.options = request.resolved_options()
        self.clock = clock
        #: How a record that fails transiently is retried (until it lands or the epoch closes).
        self.transient = transient
        self.log = {
            "workflow_id": request.workflow_id,
            "run_id": request.run_id,
            "activity": request.activity_id,
            "activity_type": request.activity_type,
        }

    # -- records -------------------------------------------------------------

    async def _required(self, body: EventBody) -> RecordOutcome:
        """A trail record the loop cannot continue without: retried on transient store
        failures like the settling record; any other store failure raises RecordFailed."""
        what = f"record {type(body).__name__}"  # the line's prefix names the activity
        try:
            return await _record_retrying(self.recorder, self.request, body, self.transient, self.log, what)
        except StoreError as exc:
            raise RecordFailed(f"{type(exc).__name__}: {exc}") from exc

    async def _final(self, attempt: int, body: EventBody) -> RecordOutcome:
        """The settling record: retried on transient store failures until it lands."""
        request = (
            self.request if self.request.attempt == attempt else attrs.evolve(self.request, attempt=attempt)
        )
        return await _record_outcome(self.recorder, request, body, self.transient, self.log)

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
                self.recorder, self.request.run_id, self.request.activity_id, body
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
        async with self.recorder.lock:
            try:
                await self.recorder.current_history(keep_deferred=True)
            except StoreError:
                return False  # the guarded appends still refuse a post-terminal write
            state = self.recorder.run_state(self.request.run_id)
            return self.request.activity_id in state.settled or state.ended is not None

    # -- the deadline ----------------------------------------------------------

    def _deadline(self) -> datetime | None:
        if self.options.schedule_to_close is None or self.request.scheduled_at is None:
            return None
        return self.request.scheduled_at + timedelta(seconds=self.options.schedule_to_close)

    def _attempt_bound(self) -> float:
        """Trio-time deadline of the next attempt (per-attempt and schedule-to-close)."""
        if self.options.timeout is None and self.options.schedule_to_close is None:
            return math.inf
        bounds = [math.inf]
        if self.options.timeout is not None:
            bounds.append(trio.current_time() + self.options.timeout)
        deadline = self._deadline()
        if deadline is not None:
            bounds.append(self.clock.trio_deadline(deadline))
        return min(bounds)

    def _past_deadline(self, extra: float = 0.0) -> bool:
        deadline = self._deadline()
        return deadline is not None and trio.current_time() + extra >= self.clock.trio_deadline(deadline)

    # -- one attempt -------------------------------------------------------------

    async def _attempt(self, state: _LoopState) -> ActivityOutcome:
        hub = self.recorder.observers
        clock = _AttemptClock(self.options.timeout)
        if hub is None:
            return await self._dispatch_attempt(state, clock)
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
        kind, error_type = "cancelled", None
        try:
            outcome = await self._dispatch_attempt(state, clock)
            kind, error_type = _observed_outcome(outcome)
            return outcome
        except trio.Cancelled:
            raise
        except BaseException as exc:
            kind, error_type = "failed", type(exc).__name__
            raise
        finally:
            hub.emit(
                ActivityAttemptEnded(
                    outcome=kind,
                    seconds=trio.current_time() - began,
                    error_type=error_type,
                    queued_seconds=clock.queued_seconds,
                    **common,
                )
            )

    async def _dispatch_attempt(self, state: _LoopState, clock: _AttemptClock) -> ActivityOutcome:
        request = self.request
        if request.attempt != state.attempt or request.task_queue != state.current_queue:
            request = attrs.evolve(request, attempt=state.attempt, task_queue=state.current_queue)
        bound = self._attempt_bound()
        token = _current_attempt_clock.set(clock)
        try:
            if bound == math.inf:
                # Nothing bounds the attempt: no cancel scope to pay for.
                return await self.dispatcher.dispatch(request)
            with trio.move_on_at(bound) as scope:
                deadline = self._deadline()
                clock.bind(scope, math.inf if deadline is None else self.clock.trio_deadline(deadline))
                return await self.dispatcher.dispatch(request)
        finally:
            _current_attempt_clock.reset(token)
        assert scope.cancelled_caught
        if self._past_deadline():
            message = f"schedule_to_close of {self.options.schedule_to_close}s exceeded during attempt {state.attempt}"
            kind = "ScheduleToCloseTimeout"
        else:
            message = f"attempt {state.attempt} timed out after {self.options.timeout}s"
            kind = "ActivityTimeout"
        return ActivityOutcome(error=ActivityError(cause=FailureCause.TIMEOUT, type=kind, message=message))

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
                    ActivityStarted(activity_id=self.request.activity_id, attempt=state.attempt)
                )
                if rec is not RecordOutcome.RECORDED:
                    return rec
            elif not trail:
                rec = await self._required(
                    ActivityStarted(activity_id=self.request.activity_id, attempt=state.attempt)
                )
                if rec is not RecordOutcome.RECORDED:
                    return rec
        while True:
            if pending_error is None:
                outcome = await self._attempt(state)
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
                    ActivityStarted(activity_id=self.request.activity_id, attempt=state.attempt)
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
            if state.same_provider_attempt >= policy.max_attempts:
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
                ActivityStarted(activity_id=self.request.activity_id, attempt=state.attempt)
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


async def _record_retrying(
    recorder: Recorder,
    request: ActivityRequest,
    body: EventBody,
    transient: Transient,
    log_extra: dict[str, Any],
    what: str,
) -> RecordOutcome:
    """``record_activity_event``, retried on ``BackendUnavailable`` until it lands
    (a try whose commit landed unacknowledged is found, not written twice) or the
    epoch closes."""
    tries = 0

    async def record() -> RecordOutcome:
        nonlocal tries
        tries += 1
        return await record_activity_event(
            recorder, request.run_id, request.activity_id, body, retried=tries > 1
        )

    try:
        return await transient.call(what, record, logger, log_extra)
    except EngineEpochClosed:
        return RecordOutcome.EPOCH_CLOSED


async def _record_outcome(
    recorder: Recorder,
    request: ActivityRequest,
    body: EventBody,
    transient: Transient,
    log_extra: dict[str, Any],
) -> RecordOutcome:
    what = f"record the outcome of attempt {request.attempt}"  # the line's prefix names the activity
    result = await _record_retrying(recorder, request, body, transient, log_extra, what)
    if result is RecordOutcome.EPOCH_CLOSED:
        logger.info(
            "outcome not recorded: the engine is shutting down; recovery re-dispatches it",
            extra={**log_extra, "attempt": request.attempt},
        )
    elif result is RecordOutcome.SETTLED_ELSEWHERE:
        logger.debug(
            "settled elsewhere; this outcome is dropped", extra={**log_extra, "attempt": request.attempt}
        )
    return result
