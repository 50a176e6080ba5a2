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

import contextlib
import functools
import hashlib
import inspect
import logging
import random
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Generator, Iterator, Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, TypeVar, Union, final, overload

import attrs
import trio

from ._children import (
    STATUS_NOT_STARTED,
    STATUS_TIMED_OUT,
    ChildOptions,
    ParentClosePolicy,
    derive_child_workflow_id,
)
from ._contain import is_structural
from ._definitions import ActivityDefinition, WorkflowDefinition
from ._errors import (
    ActivityFailure,
    ChildWorkflowFailure,
    NonDeterminismError,
    QueryFailed,
    QueryReadOnly,
    Timeout,
    UnknownQuery,
    WorkflowCancelled,
    WorkflowCommandError,
)
from ._events import (
    SCOPE_TIMEOUT_TYPE,
    ActivityCancelled,
    ActivityCompleted,
    ActivityError,
    ActivityFailed,
    ChildWorkflowCancelled,
    ChildWorkflowCompleted,
    ChildWorkflowFailed,
    Event,
    EventBody,
    FailureCause,
    SignalReceived,
    TimerCancelCause,
    TimerCancelled,
    TimerFired,
    TimerStarted,
    WorkflowCancelRequested,
    WorkflowStarted,
    input_digest,
)
from ._ids import (
    CHILD_CANCEL_MARKER_PREFIX,
    PATCH_MARKER_PREFIX,
    anonymous_timer,
    named_timer,
    scope_timer_id,
    validate_task_queue,
    validate_workflow_id,
)
from ._payload import Payload
from ._projections import (
    COMMAND_ACTIVITY,
    COMMAND_ACTIVITY_CANCEL,
    COMMAND_CHILD,
    COMMAND_CHILD_CANCEL,
    COMMAND_PATCH,
    COMMAND_TIMER,
    COMMAND_TIMER_CANCEL,
    CommandKey,
    command_key,
)
from ._retry import UNSET, RetryPolicy, check_layer, duration_seconds, explicit

if TYPE_CHECKING:
    from ._engine import EngineCore
    from ._registry import Lease

T = TypeVar("T")
H = TypeVar("H", "ActivityHandle[Any]", "ChildHandle[Any]", "TimerHandle")
P = ParamSpec("P")
F = TypeVar("F", bound=Callable[..., Any])


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


@attrs.define(eq=False)
class _PendingChild:
    ordinal: int
    child_workflow_id: str
    workflow_type: str
    input: Payload
    options: ChildOptions


def _seed(workflow_id: str, run_id: str) -> int:
    digest = hashlib.sha256(f"{workflow_id}\x00{run_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def _command(
    what: str,
) -> Callable[
    [Callable[Concatenate[WorkflowContext, P], Coroutine[Any, Any, T]]],
    Callable[Concatenate[WorkflowContext, P], Coroutine[Any, Any, T]],
]:
    """Refuse an async command from a query handler when it is *called*.

    A sync handler never awaits, so a check inside the coroutine would never
    run: the call would silently build an unawaited coroutine.
    """

    def decorate(
        fn: Callable[Concatenate[WorkflowContext, P], Coroutine[Any, Any, T]],
    ) -> Callable[Concatenate[WorkflowContext, P], Coroutine[Any, Any, T]]:
        @functools.wraps(fn)
        def command(self: WorkflowContext, /, *args: P.args, **kwargs: P.kwargs) -> Coroutine[Any, Any, T]:
            self._refuse_in_query(what)
            return fn(self, *args, **kwargs)

        return command

    return decorate


@final
class ActivityHandle(Generic[T]):
    """A scheduled activity.  ``await handle`` gives its result or raises ``ActivityFailure``."""

    def __init__(self, ctx: WorkflowContext, activity_id: int, activity_type: str) -> None:
        self._ctx = ctx
        self.activity_id = activity_id
        self.activity_type = activity_type

    def __await__(self) -> Generator[Any, None, T]:
        return self._ctx._await_activity(self).__await__()

    async def cancel(self) -> bool:
        """Cancel the activity: ``ActivityCancelled`` is recorded, its running attempt is
        stopped (an async activity's task is cancelled, a thread activity is told through
        ``heartbeat()`` / ``activity_cancelled()``), and ``await handle`` raises
        :class:`aion_trio.ActivityFailure` (cause ``cancelled``).  ``True`` if this call
        cancelled it, ``False`` if it had already settled (its outcome stands)."""
        return await self._ctx._cancel_activity(self)

    def __repr__(self) -> str:
        return f"<ActivityHandle activity:{self.activity_id} {self.activity_type}>"


@final
class TimerHandle:
    """A named durable timer from ``ctx.start_timer``.

    ``await timer`` waits until it fires and returns ``True``, or returns
    ``False`` if the workflow cancelled it first; ``await timer.cancel()``
    retires it (``TimerCancelled``) unless it already fired.
    """

    def __init__(self, ctx: WorkflowContext, name: str, timer_id: str, fire_at: datetime) -> None:
        self._ctx = ctx
        self.name = name
        self.timer_id = timer_id
        self.fire_at = fire_at
        self._cancel_requested = False

    def __await__(self) -> Generator[Any, None, bool]:
        return self._ctx._await_timer(self).__await__()

    async def cancel(self) -> bool:
        """Cancel the timer; ``True`` if this cancelled it, ``False`` if it had already fired."""
        return await self._ctx._cancel_timer(self)

    def __repr__(self) -> str:
        return f"<TimerHandle {self.name!r} fires at {self.fire_at.isoformat()}>"


@final
class ChildHandle(Generic[T]):
    """A started child workflow.  ``await handle`` gives its result or raises
    :class:`aion_trio.ChildWorkflowFailure`; ``workflow_id`` is the child's id."""

    def __init__(self, ctx: WorkflowContext, ordinal: int, workflow_id: str, workflow_type: str) -> None:
        self._ctx = ctx
        self.ordinal = ordinal
        self.workflow_id = workflow_id
        self.workflow_type = workflow_type

    def __await__(self) -> Generator[Any, None, T]:
        return self._ctx._await_child(self).__await__()

    async def cancel(self) -> bool:
        """Ask the child to cancel (recorded in this run's history, delivered to the child
        as ``engine.cancel`` would); ``await handle`` then gives its outcome, normally a
        :class:`aion_trio.ChildWorkflowFailure` with status ``cancelled``.  ``True`` if
        this call asked, ``False`` if the child's outcome was already recorded."""
        return await self._ctx._cancel_child(self)

    def __repr__(self) -> str:
        return f"<ChildHandle child:{self.ordinal} {self.workflow_type} {self.workflow_id!r}>"


Handle = Union[ActivityHandle[Any], ChildHandle[Any], TimerHandle]
"""Any handle a workflow context returns (``ctx.gather`` / ``ctx.wait_first`` take them all)."""


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
        self._state = lease.recorder.run_state(lease.run_id)
        if self._state.start is None:
            raise WorkflowCommandError(f"run {lease.run_id} has no WorkflowStarted in history")
        self._now: datetime = self._state.start.recorded_at
        self._position = self._state.start.seq
        # A run whose lease began with nothing after its start has nothing to replay.
        self._caught_up = lease.start_head <= self._state.start.seq
        self._next_activity = 0
        self._next_timer = 0
        self._next_scope = 0
        self._next_child = 0
        #: Position in the run's recorded command sequence (``RunState.commands``): the
        #: code's next command must match the one recorded there, of whatever kind.
        self._next_command = 0
        #: Timers whose cancel this execution issued (or found recorded as its own).
        self._timers_retired: set[str] = set()
        #: Patch ids this execution already answered ``True`` for.
        self._patches: set[str] = set()
        #: Ids of children this execution started and whose outcome it has not consumed.
        self._unobserved_children: set[str] = set()
        self._scopes: list[str] = []
        self._signals_taken: dict[str, int] = {}
        self._pending: list[_PendingActivity | _PendingTimer | _PendingTimerCancel | _PendingChild] = []
        self._poisoned: BaseException | None = None
        self._cleanup_depth = 0
        self._named_timers: set[str] = set()
        self._rng = random.Random(_seed(lease.workflow_id, lease.run_id))
        self._task: trio.lowlevel.Task | None = None
        self._query_handlers: dict[str, Callable[..., Any]] = {}
        # True only while the run's task is parked between steps, caught up with history;
        # _parked_at is the history length it parked at (longer: it has something to consume).
        self._parked = False
        self._parked_at = 0
        self._answering: str | None = None
        self._query_violation: QueryReadOnly | None = None
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
        self._refuse_in_query("ctx.random()")
        return self._rng

    def uuid4(self) -> uuid.UUID:
        """A deterministic version-4 UUID from :meth:`random`."""
        self._refuse_in_query("ctx.uuid4()")
        return uuid.UUID(int=self._rng.getrandbits(128), version=4)

    # -- internals ---------------------------------------------------------

    def _bind_task(self) -> None:
        self._task = trio.lowlevel.current_task()

    def _refuse_in_query(self, what: str) -> None:
        if self._answering is not None:
            error = QueryReadOnly(self.workflow_id, self.run_id, self._answering, what)
            self._query_violation = error
            raise error

    def _require_own_task(self, what: str) -> None:
        self._refuse_in_query(what)
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

    def _divergence(self, position: int, recorded: CommandKey, requested: str) -> BaseException:
        return self._poison(
            NonDeterminismError(
                self.workflow_id, self.run_id, recorded.kind, position, recorded.describe(), requested
            )
        )

    def _recorded_end(self) -> Event | None:
        """The run's terminal if it was recorded before this execution began: the code
        replays a finished history, so going past its recorded commands is a divergence."""
        ended = self._state.ended
        return ended if ended is not None and ended.seq <= self._lease.start_head else None

    def _past_the_end(self, requested: str) -> BaseException:
        ended = self._state.ended
        assert ended is not None
        return self._poison(
            NonDeterminismError(
                self.workflow_id,
                self.run_id,
                "run end",
                self._next_command,
                f"the run's end ({type(ended.body).__name__}, seq {ended.seq})",
                requested,
            )
        )

    def _resolve_command(self, requested: CommandKey, arguments: Payload | None = None) -> Event | None:
        """Resolve the code's next command against the run's recorded command sequence.

        Returns the recorded event (*Recorded*: replay, append nothing) or ``None``
        (*ResumeLive*: the caller records it).  A recorded command of another kind,
        name or arguments at this position is *NonDeterminism* (DESIGN §6.4).  One
        list index per command: no scan of the history.
        """
        commands = self._state.commands
        position = self._next_command
        self._next_command = position + 1
        if position < len(commands):
            recorded, event = commands[position]
            if not recorded.matches(requested):
                self._next_command = position
                wanted = requested.describe()
                if attrs.evolve(recorded, digest=None) == attrs.evolve(requested, digest=None):
                    wanted += f" with other arguments ({_argument_change(event, arguments)})"
                raise self._divergence(position, recorded, wanted)
            return event
        if self._recorded_end() is not None:
            self._next_command = position
            raise self._past_the_end(requested.describe())
        self._caught_up = True
        return None

    def _resolve_cancel(self, requested: CommandKey, resolution: Event | None) -> str:
        """The code cancels a timer, activity or child whose resolution so far is ``resolution``.

        Returns ``"recorded"`` (replay: the cancel is in history here), ``"record"``
        (live: the caller records it) or ``"none"`` (it was already resolved, so no
        cancel is written).  Live, a thing resolved first needs no cancel (one that
        resolves before the cancel is written is not cancelled either), so on replay
        a recorded resolution that is not itself a command stands for the cancel the
        live run did not write.
        """
        self._state.sync()
        commands = self._state.commands
        position = self._next_command
        if position < len(commands):
            recorded, _ = commands[position]
            if recorded.matches(requested):
                self._next_command = position + 1
                return "recorded"
            if resolution is not None and command_key(resolution.body) is None:
                return "none"
            raise self._divergence(position, recorded, requested.describe())
        if resolution is not None:
            return "none"
        if self._recorded_end() is not None:
            raise self._past_the_end(requested.describe())
        self._next_command = position + 1
        self._caught_up = True
        return "record"

    def _resolve_timer_cancel(self, timer_id: str) -> bool:
        """The code retires timer ``timer_id``: ``True`` if the caller must record the cancel."""
        self._state.sync()
        verdict = self._resolve_cancel(
            CommandKey(COMMAND_TIMER_CANCEL, timer_id), self._state.timer_resolutions.get(timer_id)
        )
        if verdict != "none":
            self._timers_retired.add(timer_id)
        return verdict == "record"

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
        # Decided alike live and on replay (code and arguments only): a call that
        # does not fit raises here, and the run fails like on any exception.
        definition.check_arguments(args)
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
        # Encoded live and on replay alike: its digest is compared with the recorded one.
        payload = self._core.codec.encode(list(args), what=f"input of activity {definition.name!r}")
        self._state.sync()
        key = CommandKey(COMMAND_ACTIVITY, definition.name, digest=input_digest(payload))
        recorded = self._resolve_command(key, payload)
        if recorded is not None:
            self._next_activity += 1
            return ActivityHandle(self, ordinal, definition.name)
        # ResumeLive: validate the options before anything is recorded.
        try:
            queue, recorded_options = self._core.resolved_activity_options(definition, call_layer)
        except BaseException:
            self._next_command -= 1  # nothing was issued
            raise
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

    @_command("ctx.run()")
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
        awaited_activities: Sequence[int] = (),
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
            ended = self._state.ended
            if ended is not None and ended.seq > self._lease.start_head:
                # Ended from outside while this code ran (a finished history being
                # replayed holds its own terminal at or below the lease's start head).
                raise RunAborted()
            found = check()
            cancel = self._cancel_in_force()
            if found is not None and (cancel is None or _resolution_seq(found) < cancel.seq):
                return found
            expired = self._expired_scope()
            if cancel is not None:
                fired = self._state.timer_resolutions.get(expired) if expired is not None else None
                if fired is None or cancel.seq < fired.seq:
                    # Recorded before whatever would have resolved this await: replay decides alike.
                    body = cancel.body
                    assert isinstance(body, WorkflowCancelRequested)
                    if awaited_activities:
                        # The workflow stops waiting: the awaited attempts stop too.
                        await self._core.record_activities_cancelled(
                            self._lease, self._state, awaited_activities
                        )
                    raise WorkflowCancelled(body.reason)
            if expired is not None:
                if on_expiry is None:
                    raise Timeout(expired)
                return await on_expiry(expired)
            if self._recorded_end() is not None:
                # Nothing is appended to a finished run: this wait would never resolve.
                raise self._past_the_end("a wait that history does not resolve")
            self._caught_up = True
            self._parked = True
            self._parked_at = len(self._recorder.history)
            if self._lease.query_waiters:
                self._recorder.notify()  # queries wait for this moment (DESIGN §9)
            try:
                await self._recorder.wait_changed()
            finally:
                self._parked = False
            if self._poisoned is not None:
                raise self._poisoned

    def _cancel_in_force(self) -> Event | None:
        """The cancel request this await must honour (none inside ``ctx.cleanup()``)."""
        if self._cleanup_depth:
            return None
        return self._state.cancel_request

    @property
    def cancel_requested(self) -> bool:
        """True once a cancel of this run is recorded (and not withdrawn by a reopen)."""
        self._state.sync()
        return self._state.cancel_request is not None

    @contextlib.contextmanager
    def cleanup(self) -> Iterator[None]:
        """``with ctx.cleanup():`` — awaits inside are not interrupted by a cancellation.

        Use it for compensation after catching :class:`aion_trio.WorkflowCancelled`::

            try:
                await ctx.run(charge, order)
            except aion_trio.WorkflowCancelled:
                with ctx.cleanup():
                    await ctx.run(refund, order)
                raise
        """
        self._require_own_task("ctx.cleanup()")
        self._cleanup_depth += 1
        try:
            yield
        finally:
            self._cleanup_depth -= 1

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

        event = await self._wait_until(
            lambda: self._activity_resolution(handle.activity_id), expire, (handle.activity_id,)
        )
        self._consume(event)
        return self._activity_value(handle, event)

    # -- any handle (gather, wait_first) -----------------------------------------

    def _own_handles(self, handles: Sequence[Any], what: str) -> list[Handle]:
        for h in handles:
            if not isinstance(h, (ActivityHandle, ChildHandle, TimerHandle)):
                raise TypeError(
                    f"{what} takes handles from ctx.start(), ctx.start_child() or ctx.start_timer(), "
                    f"got {h!r}"
                )
            if h._ctx is not self:
                raise ValueError(f"{what}: {h!r} belongs to another workflow run")
        return list(handles)

    def _handle_resolution(self, handle: Handle) -> Event | None:
        if isinstance(handle, ActivityHandle):
            return self._state.settled.get(handle.activity_id)
        if isinstance(handle, ChildHandle):
            return self._state.child_resolutions.get(handle.ordinal)
        return self._state.timer_resolutions.get(handle.timer_id)

    def _handle_value(self, handle: Handle, event: Event) -> Any:
        """What ``await handle`` gives for this recorded resolution (a failure is raised)."""
        if isinstance(handle, ActivityHandle):
            return self._activity_value(handle, event)
        if isinstance(handle, ChildHandle):
            return self._child_value(handle, event)
        return isinstance(event.body, TimerFired)

    @staticmethod
    def _handle_failed(event: Event) -> bool:
        return isinstance(
            event.body, (ActivityFailed, ActivityCancelled, ChildWorkflowFailed, ChildWorkflowCancelled)
        )

    @staticmethod
    def _awaited_activities(handles: Sequence[Handle]) -> list[int]:
        return [h.activity_id for h in handles if isinstance(h, ActivityHandle)]

    @_command("ctx.gather()")
    async def gather(self, *handles: Handle) -> list[Any]:
        """Wait for every handle (activity, child workflow or timer); results in argument order.

        A timer gives ``True`` if it fired, ``False`` if it was cancelled.  If any
        failed, raises the failure recorded first (lowest seq) as soon as it is in
        history — the same one live and on replay.
        """
        own = self._own_handles(handles, "ctx.gather()")

        def check() -> list[Event] | tuple[Handle, Event] | None:
            resolved = [self._handle_resolution(h) for h in own]
            failures = [
                (h, e) for h, e in zip(own, resolved, strict=True) if e is not None and self._handle_failed(e)
            ]
            if failures:
                return min(failures, key=lambda pair: pair[1].seq)
            if all(e is not None for e in resolved):
                return [e for e in resolved if e is not None]
            return None

        outcome = await self._wait_until(check, awaited_activities=self._awaited_activities(own))
        if isinstance(outcome, tuple):
            handle, event = outcome
            self._consume(event)
            self._handle_value(handle, event)  # raises the recorded failure
            raise AssertionError("unreachable: a gather failure resolved to a success")
        assert isinstance(outcome, list)
        for event in outcome:
            self._consume(event)
        return [self._handle_value(h, e) for h, e in zip(own, outcome, strict=True)]

    @_command("ctx.wait_first()")
    async def wait_first(self, *handles: H) -> H:
        """Wait until one handle (activity, child workflow or timer) resolves; returns the
        one recorded first (lowest seq).  Await it for its value."""
        if not handles:
            raise ValueError("wait_first() needs at least one handle")
        own = self._own_handles(handles, "ctx.wait_first()")

        def check() -> tuple[Handle, Event] | None:
            present = [(h, e) for h in own if (e := self._handle_resolution(h)) is not None]
            return min(present, key=lambda pair: pair[1].seq) if present else None

        handle, event = await self._wait_until(check, awaited_activities=self._awaited_activities(own))
        self._consume(event)
        return handle  # type: ignore[return-value]

    # -- cancelling handles -------------------------------------------------------

    async def _cancel_activity(self, handle: ActivityHandle[Any]) -> bool:
        self._require_own_task("cancelling an activity")
        await self._flush()  # its schedule is recorded before its cancel (program order)
        self._state.sync()
        activity_id = handle.activity_id
        verdict = self._resolve_cancel(
            CommandKey(COMMAND_ACTIVITY_CANCEL, str(activity_id)), self._state.settled.get(activity_id)
        )
        if verdict == "record":
            await self._core.record_activities_cancelled(
                self._lease, self._state, [activity_id], by_workflow=True
            )
            self._state.sync()
            settled = self._state.settled.get(activity_id)
            return (
                settled is not None
                and isinstance(settled.body, ActivityCancelled)
                and bool(settled.body.by_workflow)
            )
        return verdict == "recorded"

    async def _cancel_child(self, handle: ChildHandle[Any]) -> bool:
        self._require_own_task("cancelling a child workflow")
        await self._flush()  # its start is recorded (and the child started) before its cancel
        self._state.sync()
        verdict = self._resolve_cancel(
            CommandKey(COMMAND_CHILD_CANCEL, str(handle.ordinal)),
            self._state.child_resolutions.get(handle.ordinal),
        )
        if verdict == "none":
            return False
        if verdict == "record":
            await self._core.record_marker(
                self._lease, f"{CHILD_CANCEL_MARKER_PREFIX}{handle.ordinal}", Payload("true")
            )
        # Delivered on replay too (idempotent): a crash may have come between the record and the request.
        await self._core.cancel_recorded_child(self._lease, handle.ordinal)
        return True

    # -- child workflows -----------------------------------------------------

    def start_child(
        self,
        workflow: WorkflowDefinition[Any] | str,
        *args: Any,
        workflow_id: str | None = None,
        parent_close_policy: ParentClosePolicy = ParentClosePolicy.CANCEL,
        timeout: timedelta | float | None = None,
        task_queue: str | None = None,
    ) -> ChildHandle[Any]:
        """Start a child workflow; returns a handle at once (``await`` it for the result).

        ``workflow_id`` defaults to one derived from this run and the command's
        ordinal (``"{workflow_id}/{run_id}/{n}"``), identical on replay.
        ``parent_close_policy`` says what happens to the child if this run ends
        first; ``timeout`` is the child's deadline; ``task_queue`` defaults to
        this run's.  An unknown workflow type or bad input raises here, before
        anything is recorded.
        """
        self._require_own_task("ctx.start_child()")
        definition = self._core.workflow_definition(workflow)
        definition.check_arguments(args, "child workflow")
        if workflow_id is not None:
            validate_workflow_id(workflow_id, "child workflow_id")
        if not isinstance(parent_close_policy, ParentClosePolicy):
            raise TypeError(f"parent_close_policy must be a ParentClosePolicy, got {parent_close_policy!r}")
        seconds = _duration(timeout, "child timeout", allow_zero=False) if timeout is not None else None
        if task_queue is not None:
            validate_task_queue(task_queue)
        ordinal = self._next_child
        child_id = workflow_id or derive_child_workflow_id(self.workflow_id, self.run_id, ordinal)
        # Every check below decides alike live and on replay (it reads nothing that grows).
        if child_id == self.workflow_id:
            raise ValueError(f"a workflow cannot be its own child (child workflow_id {child_id!r})")
        if child_id in self._unobserved_children:
            raise ValueError(
                f"child workflow_id {child_id!r} is already used by a child of this run whose outcome "
                "the workflow has not awaited; await it first, or give each child its own id"
            )
        payload = self._core.codec.encode(list(args), what=f"input of child workflow {definition.name!r}")
        self._state.sync()
        recorded = self._resolve_command(
            CommandKey(COMMAND_CHILD, definition.name, child_id, input_digest(payload)), payload
        )
        if recorded is not None:
            self._next_child += 1
            self._unobserved_children.add(child_id)
            return ChildHandle(self, ordinal, child_id, definition.name)
        start = self._state.start
        assert start is not None
        assert isinstance(start.body, WorkflowStarted)
        options = ChildOptions(
            parent_close_policy=parent_close_policy,
            task_queue=task_queue or start.body.task_queue,
            timeout=seconds,
        )
        self._next_child += 1
        self._unobserved_children.add(child_id)
        self._pending.append(
            _PendingChild(
                ordinal=ordinal,
                child_workflow_id=child_id,
                workflow_type=definition.name,
                input=payload,
                options=options,
            )
        )
        return ChildHandle(self, ordinal, child_id, definition.name)

    async def child(self, workflow: WorkflowDefinition[Any] | str, *args: Any, **options: Any) -> Any:
        """Start a child workflow and wait for its result (options as for :meth:`start_child`)."""
        return await self.start_child(workflow, *args, **options)

    async def _await_child(self, handle: ChildHandle[Any]) -> Any:
        def check() -> Event | None:
            # The child's outcome or an expired timeout scope: whichever was recorded first.
            candidates = []
            outcome = self._state.child_resolutions.get(handle.ordinal)
            if outcome is not None:
                candidates.append(outcome)
            for scope in self._scopes:
                fired = self._state.timer_resolutions.get(scope)
                if fired is not None and isinstance(fired.body, TimerFired):
                    candidates.append(fired)
            return min(candidates, key=lambda e: e.seq) if candidates else None

        event = await self._wait_until(check)
        self._consume(event)
        if isinstance(event.body, TimerFired):
            raise Timeout(f"a timeout scope expired while waiting for child workflow {handle.workflow_id!r}")
        return self._child_value(handle, event)

    def _child_value(self, handle: ChildHandle[Any], event: Event) -> Any:
        """The child's result, or its failure raised, from its recorded outcome."""
        body = event.body
        self._unobserved_children.discard(handle.workflow_id)
        if isinstance(body, ChildWorkflowCompleted):
            return self._core.codec.decode(body.result)
        if isinstance(body, ChildWorkflowFailed):
            details = body.error.details.value() if body.error.details is not None else None
            status = details.get("status") if isinstance(details, dict) else None
            if status not in (STATUS_TIMED_OUT, STATUS_NOT_STARTED):
                status = "failed"
            raise ChildWorkflowFailure(
                handle.workflow_id, handle.workflow_type, str(status), error=body.error
            )
        assert isinstance(body, ChildWorkflowCancelled)
        raise ChildWorkflowFailure(handle.workflow_id, handle.workflow_type, "cancelled", reason=body.reason)

    # -- timers --------------------------------------------------------------

    def _start_timer(self, timer_id: str, fire_at: datetime) -> Event | None:
        """Issue the command starting ``timer_id``; returns its recorded ``TimerStarted`` on replay."""
        recorded = self._resolve_command(CommandKey(COMMAND_TIMER, timer_id))
        if recorded is None:
            self._pending.append(_PendingTimer(timer_id=timer_id, fire_at=fire_at))
        return recorded

    def start_timer(
        self, name: str, duration: timedelta | float | None = None, *, at: datetime | None = None
    ) -> TimerHandle:
        """Start a named durable timer firing after ``duration`` (or at ``at``); returns its handle.

        Names are unique within a run.  The timer is recorded with the run's next
        await (like :meth:`start`); await the handle to wait for it, or cancel it.
        """
        self._require_own_task("ctx.start_timer()")
        if not isinstance(name, str) or not name:
            raise ValueError(f"timer name must be a non-empty str, got {name!r}")
        if (duration is None) == (at is None):
            raise ValueError("start_timer needs exactly one of duration= or at=")
        if at is not None:
            if at.tzinfo is None or at.utcoffset() is None:
                raise ValueError(f"start_timer needs a timezone-aware datetime, got {at!r}")
            fire_at = at
        else:
            assert duration is not None
            fire_at = self._now + timedelta(seconds=_duration(duration, "timer duration", allow_zero=True))
        if name in self._named_timers:
            raise ValueError(f"timer name {name!r} was already used in this run; names are unique per run")
        self._named_timers.add(name)
        timer_id = named_timer(name)
        self._state.sync()
        recorded = self._start_timer(timer_id, fire_at)
        if recorded is not None and isinstance(recorded.body, TimerStarted):
            fire_at = recorded.body.fire_at  # replay: the recorded time wins
        return TimerHandle(self, name, timer_id, fire_at)

    async def _await_timer(self, handle: TimerHandle) -> bool:
        self._require_own_task("awaiting a timer handle")
        timer_id = handle.timer_id
        event = await self._await_timer_or_scope(timer_id)
        self._consume(event)
        if isinstance(event.body, TimerFired):
            return True
        if handle._cancel_requested:
            return False
        raise Timeout(f"a timeout scope expired while waiting for timer {handle.name!r}")

    async def _await_timer_or_scope(self, timer_id: str) -> Event:
        """Wait for the timer's resolution; a timeout scope expiring first cancels the timer.

        That cancel is one of the code's commands: replay finds it recorded (and
        consumes it) where the live run wrote it.
        """

        async def expire(scope_timer: str) -> Event:
            if not self._resolve_timer_cancel(timer_id):
                resolution = self._state.timer_resolutions.get(timer_id)
                assert resolution is not None
                return resolution
            return await self._core.record_timer_scope_timeout(
                self._lease, self._state, timer_id, scope_timer
            )

        event = await self._wait_until(lambda: self._state.timer_resolutions.get(timer_id), expire)
        body = event.body
        if (
            isinstance(body, TimerCancelled)
            and body.cause is TimerCancelCause.WORKFLOW_INTENT
            and timer_id not in self._timers_retired
        ):
            # Replay: the live run's scope expiry recorded this cancel here.
            self._resolve_timer_cancel(timer_id)
        return event

    async def _cancel_timer(self, handle: TimerHandle) -> bool:
        self._require_own_task("cancelling a timer")
        handle._cancel_requested = True
        if handle.timer_id not in self._timers_retired and self._resolve_timer_cancel(handle.timer_id):
            self._pending.append(_PendingTimerCancel(timer_id=handle.timer_id))
        await self._flush()
        self._state.sync()
        resolution = self._state.timer_resolutions.get(handle.timer_id)
        assert resolution is not None
        self._consume(resolution)
        return isinstance(resolution.body, TimerCancelled)

    @_command("ctx.sleep()")
    async def sleep(self, duration: timedelta | float) -> None:
        """A durable timer: survives restarts; fires once ``ctx.now() + duration`` is reached."""
        self._require_own_task("ctx.sleep()")
        seconds = _duration(duration, "sleep duration", allow_zero=True)
        await self._sleep_until(self._now + timedelta(seconds=seconds))

    @_command("ctx.sleep_until()")
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
        event = await self._await_timer_or_scope(timer_id)
        self._consume(event)
        if isinstance(event.body, TimerCancelled):
            raise Timeout(f"a timeout scope expired while sleeping ({timer_id})")

    # A durable, recorded timeout (DESIGN §2's API): trio.fail_after would not survive replay.
    @_command("ctx.wait_signal()")
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
        if timer_id is not None and self._resolve_timer_cancel(timer_id):
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

    @_command("ctx.patched()")
    async def patched(self, patch_id: str) -> bool:
        """True if this run executes the new code path for ``patch_id``.

        Runs that recorded the patch, and runs reaching this point live, take
        the new path (live runs record a marker); a run replaying history made
        by older code before the marker existed takes the old path.
        """
        self._require_own_task("ctx.patched()")
        if not isinstance(patch_id, str) or not patch_id:
            raise ValueError(f"patch id must be a non-empty str, got {patch_id!r}")
        if patch_id in self._patches:
            return True  # recorded (or found) once per run; later calls agree
        name = PATCH_MARKER_PREFIX + patch_id
        self._state.sync()
        commands = self._state.commands
        position = self._next_command
        if position < len(commands):
            recorded, _ = commands[position]
            if not recorded.matches(CommandKey(COMMAND_PATCH, patch_id)):
                # History made by older code issued another command here, without
                # this patch: follow the old path so replay keeps matching it.
                return False
            self._next_command = position + 1
            self._patches.add(patch_id)
            return True
        if self._recorded_end() is not None:
            return False  # the old code ended here, without the patch
        await self._flush()
        self._next_command += 1
        self._patches.add(patch_id)
        self._caught_up = True
        await self._core.record_marker(self._lease, name, Payload("true"))
        self._state.sync()
        return True

    def continue_as_new(self, *args: Any, workflow_type: str | None = None) -> ContinueAsNew:
        """``raise ctx.continue_as_new(...)``: end this run and start a fresh one with new input."""
        self._require_own_task("ctx.continue_as_new()")
        successor = self._core.workflows.get(workflow_type or self._lease.workflow_type)
        if successor is not None:
            successor.check_arguments(args, "continue-as-new of workflow")
        return ContinueAsNew(args, workflow_type)

    # -- queries -------------------------------------------------------------

    def set_query_handler(self, name: str, handler: Callable[..., Any]) -> None:
        """Register ``handler`` to answer ``engine.query(workflow_id, name, *args)``.

        A handler is a plain (sync) function of the query's arguments that
        reads the workflow's state and returns a JSON-serialisable value.  It
        runs between the workflow's steps, never while the run replays, and
        must not issue commands (they raise :class:`QueryReadOnly`).
        Registering a name again replaces its handler.  Handlers live in
        memory: register them from workflow code, so a replay after a restart
        registers them again.
        """
        self._require_own_task("ctx.set_query_handler()")
        if not isinstance(name, str) or not name:
            raise ValueError(f"query name must be a non-empty str, got {name!r}")
        if not callable(handler):
            raise TypeError(f"query handler {name!r} must be callable, got {handler!r}")
        if inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(
            getattr(handler, "__call__", None)  # noqa: B004 -- an object with an async __call__
        ):
            raise TypeError(
                f"query handler {name!r} is an async function; handlers must be plain functions "
                "(def, not async def): a query reads the workflow's state between steps and never "
                "waits, so it cannot hold up the run"
            )
        self._query_handlers[name] = handler

    @overload
    def query_handler(self, name: str, /) -> Callable[[F], F]: ...

    @overload
    def query_handler(self, handler: F, /) -> F: ...

    def query_handler(self, name_or_handler: str | F, /) -> Callable[[F], F] | F:
        """Decorator form of :meth:`set_query_handler`.

        ``@ctx.query_handler("status")`` registers under the given name;
        bare ``@ctx.query_handler`` under the function's ``__name__``.
        """
        if isinstance(name_or_handler, str):
            name = name_or_handler

            def register(handler: F) -> F:
                self.set_query_handler(name, handler)
                return handler

            return register
        handler = name_or_handler
        handler_name = getattr(handler, "__name__", None)
        if not isinstance(handler_name, str):
            raise TypeError(
                f"cannot name query handler {handler!r} (no __name__); use @ctx.query_handler('name')"
            )
        self.set_query_handler(handler_name, handler)
        return handler

    @property
    def _answerable(self) -> bool:
        """Parked between steps with nothing new to consume: a query may read the state now.

        Once history grew past where the run parked (a signal, an activity
        result...), the run is due to take that step first, so a query asked
        after e.g. ``engine.signal`` returned sees the state after the signal.
        """
        return (
            self._parked
            and self._caught_up
            and self._poisoned is None
            and len(self._recorder.history) == self._parked_at
        )

    def _answer_query(self, name: str, args: Sequence[Any]) -> Any:
        """Run the handler for ``name`` synchronously (the run's task is parked)."""
        handler = self._query_handlers.get(name)
        if handler is None:
            raise UnknownQuery(self.workflow_id, self.run_id, name, sorted(self._query_handlers))
        self._answering = name
        self._query_violation = None
        error: BaseException | None = None
        try:
            value = handler(*args)
        except BaseException as exc:
            # SystemExit or any BaseException of the handler's own is its failure (see _contain).
            if is_structural(exc):
                raise
            error = exc
        finally:
            self._answering = None
        violation, self._query_violation = self._query_violation, None
        if violation is not None:
            raise violation  # even if the handler caught it: the query broke the read-only rule
        if error is not None:
            raise QueryFailed(self.workflow_id, self.run_id, name, error) from error
        if inspect.isawaitable(value):
            if inspect.iscoroutine(value):
                value.close()
            problem = TypeError(
                f"query handler {name!r} returned an awaitable; handlers must be plain functions"
            )
            raise QueryFailed(self.workflow_id, self.run_id, name, problem)
        return value

    def _detach(self) -> None:
        """The run's code exited: queries can no longer use this context."""
        self._parked = False
        if self._lease.context is self:
            self._lease.context = None
        if self._lease.query_waiters:
            self._recorder.notify()

    # -- checks at exit ----------------------------------------------------

    def unissued_recorded_command(
        self, terminal: type[EventBody] | None = None
    ) -> tuple[str, int, str] | None:
        """The first command recorded in history that this execution never issued, if any:
        ``(kind, position in the run's command sequence, description)``.  Replaying a
        finished run, a recorded end of another kind than ``terminal`` counts too."""
        self._state.sync()
        position = self._next_command
        if position < len(self._state.commands):
            recorded, _ = self._state.commands[position]
            return (recorded.kind, position, recorded.describe())
        ended = self._recorded_end()
        if terminal is not None and ended is not None and not isinstance(ended.body, terminal):
            return ("run end", position, f"the run's end ({type(ended.body).__name__}, seq {ended.seq})")
        return None


def _argument_change(recorded: Event, arguments: Payload | None) -> str:
    """Which argument differs between a recorded command's input and ``arguments``
    (only on a mismatch: it decodes both)."""
    before = getattr(recorded.body, "input", None)
    if not isinstance(before, Payload) or arguments is None:
        return "the arguments changed"
    old, new = before.value(), arguments.value()
    if not isinstance(old, list) or not isinstance(new, list):
        return "the arguments changed"
    if len(old) != len(new):
        return f"{len(new)} argument(s) where {len(old)} were recorded"
    changed = [str(i) for i, (a, b) in enumerate(zip(old, new, strict=True)) if a != b]
    if not changed:
        return "the arguments' encoding changed"
    return (
        f"argument {', '.join(changed)} changed"
        if len(changed) == 1
        else f"arguments {', '.join(changed)} changed"
    )


def _resolution_seq(found: Any) -> int:
    """The seq at which an await's resolution became complete in history."""
    if isinstance(found, Event):
        return found.seq
    if isinstance(found, tuple):
        return _resolution_seq(found[-1])
    return max(int(e.seq) for e in found)


def _duration(value: timedelta | float, what: str, *, allow_zero: bool) -> float:
    return duration_seconds(value, what, allow_zero=allow_zero)


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
        if self.timer_id not in ctx._timers_retired and ctx._resolve_timer_cancel(self.timer_id):
            # Left in time (or by an exception of its own): retire the scope's timer.
            ctx._pending.append(_PendingTimerCancel(timer_id=self.timer_id))
            if exc_type is None:
                await ctx._flush()
