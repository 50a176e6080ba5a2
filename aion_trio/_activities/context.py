"""What a running activity sees: its identity, ``heartbeat()``, ``activity_cancelled()``, and the
attempt's clock (waiting for a thread slot is not the attempt's time)."""

from __future__ import annotations

import contextvars
import math
from collections.abc import Callable
from typing import Any, final

import attrs
import trio

from .._errors import AttemptCancelled
from .._guard import unguarded
from .._payload import Payload
from .tokens import TaskToken

#: Trio's clock without the determinism guard's check: these reads are the engine's,
#: made in tasks that inherit a workflow task's context.
_trio_time = unguarded(trio.current_time)


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
    #: The last details an earlier attempt passed to ``heartbeat(details)`` (``None``: none did),
    #: so a long job resumes its progress.
    heartbeat_details: Any = None

    @property
    def task_token(self) -> str:
        """The attempt's task token: with it any process completes, fails or heartbeats this
        attempt after the activity called :func:`~aion_trio.complete_async`."""
        return TaskToken(
            workflow_id=self.workflow_id,
            run_id=self.run_id,
            activity_id=self.activity_id,
            attempt=self.attempt,
        ).text()


current_info: contextvars.ContextVar[ActivityInfo | None] = contextvars.ContextVar(
    "aion_trio_activity_info", default=None
)


def activity_info() -> ActivityInfo:
    """The running activity attempt's identity; raises ``RuntimeError`` outside an activity."""
    info = current_info.get()
    if info is None:
        raise RuntimeError("aion_trio.activity_info() was called outside an activity")
    return info


@final
class Heartbeat:
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
        self.last = _trio_time()
        self.details: Any = None
        self.expired = False
        self.changed = trio.Event()
        self.on_beat = on_beat

    def beat(self, details: Any = None) -> None:
        self.last = _trio_time()
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


async def watch_heartbeat(tracker: Heartbeat, attempt: trio.CancelScope, watch: trio.CancelScope) -> None:
    with watch:
        await tracker.watch(attempt)


current_heartbeat: contextvars.ContextVar[Heartbeat | None] = contextvars.ContextVar(
    "aion_trio_heartbeat", default=None
)

#: Where the activity driver hears the heartbeats of the attempt it dispatches in-process
#: (set around the dispatch; called in the Trio thread with each beat's encoded details).
current_heartbeat_sink: contextvars.ContextVar[Callable[[Any], None] | None] = contextvars.ContextVar(
    "aion_trio_heartbeat_sink", default=None
)


def report_heartbeat_details(details: Payload) -> None:
    """For dispatchers: the attempt being dispatched reported heartbeat ``details`` elsewhere
    (on a remote worker).  Call it from ``dispatch``'s task; the engine keeps them for the
    next attempt (``activity_info().heartbeat_details``) and records them, throttled, as it
    does an in-process heartbeat's.  Outside a dispatch by the engine it does nothing."""
    sink = current_heartbeat_sink.get()
    if sink is not None:
        sink(details)


def heartbeat(details: Any = None) -> None:
    """Report liveness from inside an activity (any kind: Trio, thread or asyncio).

    With a ``heartbeat_timeout``, an attempt that does not heartbeat in time is
    cancelled and fails as a timeout (retry-eligible within the budget).
    In a plain ``def`` activity whose attempt was stopped (cancel, terminate,
    a timeout, a deadline, engine shutdown) this raises
    :class:`~aion_trio.AttemptCancelled`: the engine no longer waits for the
    thread.  Outside an activity this raises ``RuntimeError``.
    """
    tracker = current_heartbeat.get()
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


def _raise_if_stopped(tracker: Heartbeat) -> None:
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
    tracker = current_heartbeat.get()
    if tracker is None:
        raise RuntimeError("aion_trio.activity_cancelled() was called outside an activity")
    return tracker.stopped


@final
class AttemptClock:
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
        self._queued_at = _trio_time()
        if self._scope is not None and self._timeout is not None:
            self._scope.deadline = self._hard

    def started(self) -> None:
        now = _trio_time()
        if self._queued_at is not None:
            self.queued_seconds += now - self._queued_at
            self._queued_at = None
        if self._scope is not None and self._timeout is not None:
            self._scope.deadline = min(now + self._timeout, self._hard)


current_attempt_clock: contextvars.ContextVar[AttemptClock | None] = contextvars.ContextVar(
    "aion_trio_attempt_clock", default=None
)
