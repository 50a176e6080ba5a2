"""Executing workflow code: the context, commands, handles and replay (DESIGN §6.3).

A run is a Trio task executing the user's coroutine with a
:class:`WorkflowContext`.  Commands take per-run ordinals by family in program
order and resolve against history as *Recorded* (replay: return it, append
nothing), *ResumeLive* (history exhausted: do it for real and record it) or
*NonDeterminism*.  Observations (activity outcomes, ...) are recorded before
they are observed: the workflow only ever reads its run's segment of the
recorder's history, a prefix that only grows, and consumes resolutions from
it — so replay takes the branch the live run took.
"""

from __future__ import annotations

import hashlib
import logging
import math
import random
import uuid
from collections.abc import Awaitable, Callable, Generator, Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Generic, TypeVar, final

import attrs
import trio

from ._definitions import ActivityDefinition
from ._errors import (
    ActivityFailure,
    NonDeterminismError,
    Timeout,
    WorkflowCommandError,
)
from ._events import (
    ActivityCancelled,
    ActivityCompleted,
    ActivityError,
    ActivityFailed,
    ActivityScheduled,
    ActivityStarted,
    Event,
    FailureCause,
    MarkerRecorded,
    SignalReceived,
    TimerCancelled,
    TimerFired,
    TimerStarted,
    WorkflowReopened,
    WorkflowStarted,
)
from ._ids import anonymous_timer, scope_timer_id
from ._payload import Payload
from ._retry import UNSET, RetryPolicy, check_layer, explicit

if TYPE_CHECKING:
    from ._engine import EngineCore
    from ._registry import Lease

T = TypeVar("T")

PATCH_MARKER_PREFIX = "patch:"


class RunAborted(BaseException):
    """Unwinds workflow code without recording a terminal (epoch closed, double writer, ...).

    A ``BaseException`` so ``except Exception`` in workflow code cannot swallow
    it.  The run stays Running in the store; the next engine's recovery (or an
    operator) takes it from there.
    """


@final
class ContinueAsNew(Exception):
    """Raise ``ctx.continue_as_new(...)`` to end this run and start a fresh one."""

    def __init__(self, args: tuple[Any, ...], workflow_type: str | None) -> None:
        super().__init__("continue as new")
        self.args_ = args
        self.workflow_type = workflow_type


@attrs.define(eq=False)
class _PendingTimer:
    timer_id: str
    fire_at: datetime


@attrs.define(eq=False)
class _PendingTimerCancel:
    timer_id: str


@attrs.define(eq=False)
class _PendingActivity:
    ordinal: int
    definition: ActivityDefinition[Any]
    input: Payload
    task_queue: str
    options: Payload


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
        self.markers: dict[str, Event] = {}
        self.started_attempt: dict[int, int] = {}
        self.timers: dict[str, Event] = {}
        self.timer_resolutions: dict[str, Event] = {}
        self.signals: dict[str, list[Event]] = {}

    def sync(self) -> None:
        """Index events appended since the last call."""
        history = self._history
        n = len(history)
        while self._cursor < n and not self._ended:
            event = history[self._cursor]
            self._cursor += 1
            body = event.body
            if isinstance(body, WorkflowStarted):
                if self._inside:
                    self._ended = True
                    break
                if body.run_id == self.run_id:
                    self._inside = True
                    self.start = event
                continue
            if not self._inside:
                continue
            if isinstance(body, ActivityScheduled):
                self.scheduled[body.activity_id] = event
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
            elif isinstance(body, MarkerRecorded):
                self.markers.setdefault(body.name, event)
            elif isinstance(body, TimerStarted):
                self.timers[body.timer_id] = event
                self.timer_resolutions.pop(body.timer_id, None)
            elif isinstance(body, SignalReceived):
                self.signals.setdefault(body.name, []).append(event)
            elif isinstance(body, (TimerFired, TimerCancelled)):
                self.timer_resolutions.setdefault(body.timer_id, event)


def _seed(workflow_id: str, run_id: str) -> int:
    digest = hashlib.sha256(f"{workflow_id}\x00{run_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


@final
class ActivityHandle(Generic[T]):
    """A scheduled activity.  ``await handle`` gives its result or raises ``ActivityFailure``."""

    def __init__(self, ctx: WorkflowContext, activity_id: int, activity_type: str) -> None:
        self._ctx = ctx
        self.activity_id = activity_id
        self.activity_type = activity_type

    def __await__(self) -> Generator[Any, None, T]:
        return self._ctx._await_activity(self).__await__()

    def __repr__(self) -> str:
        return f"<ActivityHandle activity:{self.activity_id} {self.activity_type}>"


class _ReplayAwareLogger(logging.LoggerAdapter):  # type: ignore[type-arg]
    """``ctx.logger``: silent while the run replays, with workflow fields attached."""

    def __init__(self, logger: logging.Logger, ctx: WorkflowContext) -> None:
        super().__init__(logger, {})
        self._ctx = ctx

    def isEnabledFor(self, level: int) -> bool:
        return not self._ctx.is_replaying and self.logger.isEnabledFor(level)

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        extra = dict(kwargs.get("extra") or {})
        extra.setdefault("workflow_id", self._ctx.workflow_id)
        extra.setdefault("run_id", self._ctx.run_id)
        kwargs["extra"] = extra
        return msg, kwargs

    def log(self, level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
        if self.isEnabledFor(level):
            super().log(level, msg, *args, **kwargs)


@final
class WorkflowContext:
    """The workflow's only door to the world.

    Use it only from the workflow's own task: for concurrency inside a
    workflow, start activities with :meth:`start` and combine the handles with
    :meth:`gather` / :meth:`wait_first` (never a nursery).
    """

    def __init__(self, core: EngineCore, lease: Lease) -> None:
        self._core = core
        self._lease = lease
        self._recorder = lease.recorder
        self._state = RunState(lease.run_id, lease.recorder.history)
        self._state.sync()
        if self._state.start is None:
            raise WorkflowCommandError(f"run {lease.run_id} has no WorkflowStarted in history")
        self._now: datetime = self._state.start.recorded_at
        self._position = self._state.start.seq
        # A run whose lease began with nothing after its start has nothing to replay.
        self._caught_up = lease.start_head <= self._state.start.seq
        self._next_activity = 0
        self._next_timer = 0
        self._next_scope = 0
        self._scopes: list[str] = []
        self._signals_taken: dict[str, int] = {}
        self._pending: list[_PendingActivity | _PendingTimer | _PendingTimerCancel] = []
        self._poisoned: BaseException | None = None
        self._rng = random.Random(_seed(lease.workflow_id, lease.run_id))
        self._task: trio.lowlevel.Task | None = None
        self.logger: logging.LoggerAdapter = _ReplayAwareLogger(  # type: ignore[type-arg]
            logging.getLogger(f"aion_trio.workflow.{lease.workflow_type}"), self
        )

    # -- identity ----------------------------------------------------------

    @property
    def workflow_id(self) -> str:
        return self._lease.workflow_id

    @property
    def run_id(self) -> str:
        return self._lease.run_id

    @property
    def workflow_type(self) -> str:
        return self._lease.workflow_type

    @property
    def is_replaying(self) -> bool:
        """True until the run first does something not already in history."""
        return not self._caught_up

    def now(self) -> datetime:
        """The replay position: the run's start time, advanced by each resolution consumed.

        Identical live and on replay; never reads a clock.
        """
        return self._now

    def random(self) -> random.Random:
        """A generator seeded by (workflow_id, run_id): same sequence on replay."""
        return self._rng

    def uuid4(self) -> uuid.UUID:
        """A deterministic version-4 UUID from :meth:`random`."""
        return uuid.UUID(int=self._rng.getrandbits(128), version=4)

    # -- internals ---------------------------------------------------------

    def _bind_task(self) -> None:
        self._task = trio.lowlevel.current_task()

    def _require_own_task(self, what: str) -> None:
        try:
            current = trio.lowlevel.current_task()
        except RuntimeError:
            current = None
        if self._task is None or current is not self._task:
            raise WorkflowCommandError(
                f"{what} was called from a task that is not workflow {self.workflow_id!r}'s own; "
                "workflow commands must be issued by the workflow function itself — for concurrency "
                "use handles: h = ctx.start(activity, ...), then await ctx.gather(h1, h2) or "
                "ctx.wait_first(h1, h2) instead of a nursery"
            )
        if self._poisoned is not None:
            raise self._poisoned

    def _consume(self, event: Event) -> None:
        if event.seq > self._position:
            self._position = event.seq
        if event.recorded_at > self._now:
            self._now = event.recorded_at

    def _poison(self, error: BaseException) -> BaseException:
        self._poisoned = error
        return error

    # -- activities --------------------------------------------------------

    def start(
        self,
        activity: ActivityDefinition[Any] | str,
        *args: Any,
        retry: RetryPolicy | None = UNSET,
        timeout: timedelta | float | None = UNSET,
        schedule_to_close: timedelta | float | None = UNSET,
        heartbeat_timeout: timedelta | float | None = UNSET,
        task_queue: str | None = UNSET,
        fallback_queues: Sequence[str] | None = UNSET,
        advisory: bool = UNSET,
    ) -> ActivityHandle[Any]:
        """Schedule an activity; returns a handle at once (await it later).

        Keyword options override the activity's own, which override the
        engine's defaults; the resolved options are recorded with the command.
        """
        self._require_own_task("ctx.start()")
        definition = self._core.activity_definition(activity)
        call_layer = explicit(
            retry=retry,
            timeout=timeout,
            schedule_to_close=schedule_to_close,
            heartbeat_timeout=heartbeat_timeout,
            task_queue=task_queue,
            fallback_queues=fallback_queues,
            advisory=advisory,
        )
        if call_layer:
            call_layer = check_layer(call_layer, f"ctx.start({definition.name})")
        ordinal = self._next_activity
        self._state.sync()
        recorded = self._state.scheduled.get(ordinal)
        if recorded is not None:
            body = recorded.body
            assert isinstance(body, ActivityScheduled)
            if body.activity_type != definition.name:
                raise self._poison(
                    NonDeterminismError(
                        self.workflow_id,
                        self.run_id,
                        "activity",
                        ordinal,
                        f"activity {body.activity_type!r}",
                        f"activity {definition.name!r}",
                    )
                )
            self._next_activity += 1
            self._consume(recorded)
            return ActivityHandle(self, ordinal, definition.name)
        # ResumeLive: validate the input before anything is recorded.
        payload = self._core.codec.encode(list(args), what=f"input of activity {definition.name!r}")
        queue, recorded_options = self._core.resolved_activity_options(definition, call_layer)
        self._caught_up = True
        self._next_activity += 1
        self._pending.append(
            _PendingActivity(
                ordinal=ordinal,
                definition=definition,
                input=payload,
                task_queue=queue,
                options=recorded_options,
            )
        )
        return ActivityHandle(self, ordinal, definition.name)

    async def run(self, activity: ActivityDefinition[Any] | str, *args: Any, **options: Any) -> Any:
        """Schedule an activity and wait for its result (options as for :meth:`start`)."""
        return await self.start(activity, *args, **options)

    async def _flush(self) -> bool:
        """Record pending commands (one batch) and dispatch what they start.

        Returns whether there were any (recording them passed a checkpoint).
        """
        if not self._pending:
            return False
        pending, self._pending = self._pending, []
        await self._core.record_commands(self._lease, self._state, pending)
        return True

    def _activity_resolution(self, activity_id: int) -> Event | None:
        return self._state.settled.get(activity_id)

    def _activity_value(self, handle: ActivityHandle[Any], event: Event) -> Any:
        body = event.body
        if isinstance(body, ActivityCompleted):
            return self._core.codec.decode(body.result)
        if isinstance(body, ActivityFailed):
            if body.error.type == SCOPE_TIMEOUT_TYPE:
                raise Timeout(body.error.message)
            raise ActivityFailure(handle.activity_id, handle.activity_type, body.error)
        if isinstance(body, ActivityCancelled):
            raise ActivityFailure(
                handle.activity_id,
                handle.activity_type,
                ActivityError(
                    cause=FailureCause.CANCELLED,
                    type="ActivityCancelled",
                    message=f"attempt {body.attempt} was cancelled",
                ),
            )
        raise AssertionError(f"not an activity resolution: {event!r}")  # pragma: no cover

    async def _wait_until(
        self,
        check: Callable[[], T | None],
        on_expiry: Callable[[str], Awaitable[T]] | None = None,
    ) -> T:
        """Flush commands, then park until ``check()`` finds a resolution in the snapshot.

        Inside a timeout scope whose timer fired in this snapshot (and no
        resolution is present), ``on_expiry`` records the timeout durably and
        returns what was recorded (or what won the race under the lock).
        """
        self._require_own_task("awaiting a workflow handle")
        if not await self._flush():
            await trio.lowlevel.checkpoint()
        while True:
            self._state.sync()
            found = check()
            if found is not None:
                return found
            expired = self._expired_scope()
            if expired is not None:
                if on_expiry is None:
                    raise Timeout(expired)
                return await on_expiry(expired)
            self._caught_up = True
            await self._recorder.wait_changed()
            if self._poisoned is not None:
                raise self._poisoned

    def _expired_scope(self) -> str | None:
        for timer_id in self._scopes:
            resolution = self._state.timer_resolutions.get(timer_id)
            if resolution is not None and isinstance(resolution.body, TimerFired):
                return timer_id
        return None

    async def _await_activity(self, handle: ActivityHandle[Any]) -> Any:
        async def expire(scope_timer: str) -> Event:
            return await self._core.record_activity_scope_timeout(
                self._lease, self._state, handle.activity_id, scope_timer
            )

        event = await self._wait_until(lambda: self._activity_resolution(handle.activity_id), expire)
        self._consume(event)
        return self._activity_value(handle, event)

    async def gather(self, *handles: ActivityHandle[Any]) -> list[Any]:
        """Wait for every handle; results in argument order.

        If any failed, raises the failure recorded first (lowest seq) as soon
        as it is in history — the same one live and on replay.
        """

        def check() -> list[Event] | Event | None:
            resolved = [self._activity_resolution(h.activity_id) for h in handles]
            failures = [e for e in resolved if e is not None and not isinstance(e.body, ActivityCompleted)]
            if failures:
                return min(failures, key=lambda e: e.seq)
            if all(e is not None for e in resolved):
                return [e for e in resolved if e is not None]
            return None

        outcome: list[Event] | Event = await self._wait_until(check)
        if isinstance(outcome, Event):
            self._consume(outcome)
            body = outcome.body
            handle = next(h for h in handles if h.activity_id == getattr(body, "activity_id", None))
            self._activity_value(handle, outcome)  # raises the recorded failure
            raise AssertionError("unreachable: a gather failure resolved to a success")
        for event in outcome:
            self._consume(event)
        return [self._activity_value(h, e) for h, e in zip(handles, outcome, strict=False)]

    async def wait_first(self, *handles: ActivityHandle[Any]) -> ActivityHandle[Any]:
        """Wait until one handle resolves; returns the one recorded first (lowest seq)."""
        if not handles:
            raise ValueError("wait_first() needs at least one handle")

        def check() -> tuple[ActivityHandle[Any], Event] | None:
            present = [(h, e) for h in handles if (e := self._activity_resolution(h.activity_id)) is not None]
            return min(present, key=lambda pair: pair[1].seq) if present else None

        handle, event = await self._wait_until(check)
        self._consume(event)
        return handle

    # -- timers --------------------------------------------------------------

    def _start_timer(self, timer_id: str, fire_at: datetime) -> None:
        recorded = self._state.timers.get(timer_id)
        if recorded is not None:
            self._consume(recorded)
            return
        self._caught_up = True
        self._pending.append(_PendingTimer(timer_id=timer_id, fire_at=fire_at))

    async def sleep(self, duration: timedelta | float) -> None:
        """A durable timer: survives restarts; fires once ``ctx.now() + duration`` is reached."""
        self._require_own_task("ctx.sleep()")
        seconds = _duration(duration, "sleep duration", allow_zero=True)
        await self._sleep_until(self._now + timedelta(seconds=seconds))

    async def sleep_until(self, when: datetime) -> None:
        """A durable timer firing at ``when`` (timezone-aware)."""
        self._require_own_task("ctx.sleep_until()")
        if when.tzinfo is None or when.utcoffset() is None:
            raise ValueError(f"sleep_until needs a timezone-aware datetime, got {when!r}")
        await self._sleep_until(when)

    async def _sleep_until(self, when: datetime) -> None:
        self._state.sync()
        timer_id = anonymous_timer(self._next_timer)
        self._next_timer += 1
        self._start_timer(timer_id, when)

        async def expire(scope_timer: str) -> Event:
            return await self._core.record_timer_scope_timeout(
                self._lease, self._state, timer_id, scope_timer
            )

        event = await self._wait_until(lambda: self._state.timer_resolutions.get(timer_id), expire)
        self._consume(event)
        if isinstance(event.body, TimerCancelled):
            raise Timeout(f"a timeout scope expired while sleeping ({timer_id})")

    # A durable, recorded timeout (DESIGN §2's API): trio.fail_after would not survive replay.
    async def wait_signal(self, name: str, *, timeout: timedelta | float | None = None) -> Any:  # noqa: ASYNC109
        """Wait for the next signal called ``name`` and return its payload.

        Signals of one name are consumed in the order they were recorded.
        With ``timeout`` (or inside ``ctx.timeout``), whichever was recorded
        first wins — the signal or the expiry — so replay decides the same
        way; an expiry raises :class:`Timeout`.
        """
        self._require_own_task("ctx.wait_signal()")
        if not isinstance(name, str) or not name:
            raise ValueError(f"signal name must be a non-empty str, got {name!r}")
        self._state.sync()
        index = self._signals_taken.get(name, 0)
        timer_id: str | None = None
        if timeout is not None:
            seconds = _duration(timeout, "signal timeout", allow_zero=True)
            timer_id = anonymous_timer(self._next_timer)
            self._next_timer += 1
            self._start_timer(timer_id, self._now + timedelta(seconds=seconds))

        def check() -> Event | None:
            received = self._state.signals.get(name, [])
            candidates = [received[index]] if index < len(received) else []
            for scope in [*self._scopes, *([timer_id] if timer_id else [])]:
                fired = self._state.timer_resolutions.get(scope)
                if fired is not None and isinstance(fired.body, TimerFired):
                    candidates.append(fired)
            return min(candidates, key=lambda e: e.seq) if candidates else None

        event = await self._wait_until(check)
        self._consume(event)
        if timer_id is not None and timer_id not in self._state.timer_resolutions:
            self._pending.append(_PendingTimerCancel(timer_id=timer_id))
        if isinstance(event.body, TimerFired):
            raise Timeout(f"no {name!r} signal arrived in time")
        assert isinstance(event.body, SignalReceived)
        self._signals_taken[name] = index + 1
        return self._core.codec.decode(event.body.payload)

    def timeout(self, duration: timedelta | float) -> TimeoutScope:
        """``async with ctx.timeout(d):`` — awaits inside raise :class:`Timeout` once ``d`` passed.

        Durable: the scope is a recorded timer, and the expiry decision is
        recorded, so replay takes the same branch.  Nested scopes: the
        earliest deadline wins.  Leaving in time records ``TimerCancelled``.
        """
        self._require_own_task("ctx.timeout()")
        seconds = _duration(duration, "timeout", allow_zero=False)
        return TimeoutScope(self, seconds)

    # -- versioning ----------------------------------------------------------

    async def patched(self, patch_id: str) -> bool:
        """True if this run executes the new code path for ``patch_id``.

        Runs that recorded the patch, and runs reaching this point live, take
        the new path (live runs record a marker); a run replaying history made
        by older code before the marker existed takes the old path.
        """
        self._require_own_task("ctx.patched()")
        name = PATCH_MARKER_PREFIX + patch_id
        self._state.sync()
        marker = self._state.markers.get(name)
        if marker is not None:
            self._consume(marker)
            return True
        if self._has_unmatched_commands():
            # History made by older code issued further commands without this
            # patch: follow the old path so replay keeps matching it.
            return False
        await self._flush()
        await self._core.record_marker(self._lease, name, Payload("true"))
        self._state.sync()
        self._caught_up = True
        return True

    def continue_as_new(self, *args: Any, workflow_type: str | None = None) -> ContinueAsNew:
        """``raise ctx.continue_as_new(...)``: end this run and start a fresh one with new input."""
        self._require_own_task("ctx.continue_as_new()")
        return ContinueAsNew(args, workflow_type)

    # -- checks at exit ----------------------------------------------------

    def _has_unmatched_commands(self) -> bool:
        self._state.sync()
        if any(k >= self._next_activity for k in self._state.scheduled):
            return True
        issued = {anonymous_timer(n) for n in range(self._next_timer)} | {
            scope_timer_id(n) for n in range(self._next_scope)
        }
        return any(t not in issued and not t.startswith(("deadline:", "named:")) for t in self._state.timers)

    def unissued_recorded_command(self) -> tuple[str, int, str] | None:
        """A command recorded in history that this execution never issued, if any."""
        self._state.sync()
        extra = sorted(k for k in self._state.scheduled if k >= self._next_activity)
        if extra:
            body = self._state.scheduled[extra[0]].body
            assert isinstance(body, ActivityScheduled)
            return ("activity", extra[0], f"activity {body.activity_type!r}")
        return None


SCOPE_TIMEOUT_TYPE = "ScopeTimeout"


def _duration(value: timedelta | float, what: str, *, allow_zero: bool) -> float:
    if isinstance(value, bool):
        raise TypeError(f"{what} must be seconds or a timedelta, got {value!r}")
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not allow_zero):
        raise ValueError(f"{what} must be a finite duration {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return seconds


@final
class TimeoutScope:
    """What ``ctx.timeout(d)`` returns; use with ``async with``."""

    def __init__(self, ctx: WorkflowContext, seconds: float) -> None:
        self._ctx = ctx
        self._seconds = seconds
        self.timer_id = ""

    async def __aenter__(self) -> TimeoutScope:
        ctx = self._ctx
        ctx._require_own_task("entering ctx.timeout()")
        ctx._state.sync()
        self.timer_id = scope_timer_id(ctx._next_scope)
        ctx._next_scope += 1
        ctx._start_timer(self.timer_id, ctx._now + timedelta(seconds=self._seconds))
        ctx._scopes.append(self.timer_id)
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        ctx = self._ctx
        ctx._scopes.remove(self.timer_id)
        ctx._state.sync()
        if self.timer_id not in ctx._state.timer_resolutions and not any(
            isinstance(p, _PendingTimerCancel) and p.timer_id == self.timer_id for p in ctx._pending
        ):
            # Left in time (or by an exception of its own): retire the scope's timer.
            ctx._pending.append(_PendingTimerCancel(timer_id=self.timer_id))
            if exc_type is None:
                await ctx._flush()
