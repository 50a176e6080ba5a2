"""The workflow's side of a run: the context its code is given, and the engine's activation.

A run is a Trio task executing the user's coroutine with a
:class:`WorkflowContext`.  The context turns each call into a command resolved
against the run's history (:mod:`aion_trio._replay`), returns handles
(:mod:`aion_trio._handles`) and registers query handlers
(:mod:`aion_trio._queries`); it reaches the engine only through a
:class:`~aion_trio._ports.WorkflowPort`.  The engine drives one execution
through a :class:`RunActivation`: it builds one per run with a port, runs the
code with its context, and asks it what the code left behind.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import random
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping, Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar, final, overload

from ._childspec import ChildOptions, ParentClosePolicy, derive_child_workflow_id
from ._definitions import ActivityDefinition, WorkflowDefinition
from ._errors import NotRunning, Timeout, WorkflowNotFound
from ._events import (
    Event,
    EventBody,
    MarkerRecorded,
    SearchValue,
    SignalReceived,
    TimerCancelled,
    TimerFired,
    TimerStarted,
    WorkflowStarted,
    input_digest,
    validate_search_attributes,
)
from ._handles import (
    ActivityHandle,
    ChildHandle,
    Handle,
    TimeoutScope,
    TimerHandle,
    awaited_activities,
    handle_failed,
    handle_resolution,
    handle_value,
    own_handles,
)
from ._ids import (
    EVENT_MARKER_PREFIX,
    EVENT_READ_MARKER_PREFIX,
    EVENT_READ_RESULT_MARKER_PREFIX,
    EXTERNAL_MARKER_PREFIX,
    EXTERNAL_OUTCOME_MARKER_PREFIX,
    PATCH_MARKER_PREFIX,
    anonymous_timer,
    check_text,
    named_timer,
    validate_task_queue,
    validate_workflow_id,
)
from ._payload import Payload
from ._ports import (
    CancelTimer,
    ExternalMessage,
    ScheduleActivity,
    StartChild,
    UpsertSearchAttributes,
    WorkflowPort,
)
from ._projections import (
    COMMAND_CANCEL_EXTERNAL,
    COMMAND_CHILD,
    COMMAND_GET_EVENT,
    COMMAND_PATCH,
    COMMAND_SEARCH_ATTRIBUTES,
    COMMAND_SET_EVENT,
    COMMAND_SIGNAL_EXTERNAL,
    CommandKey,
    event_value_digest,
    search_attributes_digest,
)
from ._queries import QueryHandlers
from ._replay import Replay, Satisfied, SignalHandlers
from ._retry import UNSET, RetryPolicy, check_layer, duration_seconds, explicit

if TYPE_CHECKING:
    from typing_extensions import TypeVarTuple, Unpack

    #: A function's parameters (an activity's, or a workflow's after ``ctx``): what a
    #: call's arguments are checked against.
    Ts = TypeVarTuple("Ts")

T = TypeVar("T")
R = TypeVar("R")
H = TypeVar("H", ActivityHandle[Any], ChildHandle[Any], TimerHandle)
P = ParamSpec("P")
F = TypeVar("F", bound=Callable[..., Any])


_EXTERNAL_KINDS = (COMMAND_SIGNAL_EXTERNAL, COMMAND_CANCEL_EXTERNAL)


@final
class ContinueAsNew(Exception):
    """Raise ``ctx.continue_as_new(...)`` to end this run and start a fresh one."""

    def __init__(self, args: tuple[Any, ...], workflow_type: str | None) -> None:
        super().__init__("continue as new")
        self.args_ = args
        self.workflow_type = workflow_type


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
            self._replay.refuse_in_query(what)
            return fn(self, *args, **kwargs)

        return command

    return decorate


class _ReplayAwareLogger(logging.LoggerAdapter):  # type: ignore[type-arg]
    """``ctx.logger``: silent while the run replays, with workflow fields attached."""

    def __init__(self, logger: logging.Logger, replay: Replay) -> None:
        super().__init__(logger, {})
        # The replay, not the context: the context holds this adapter, and a cycle
        # between the two would leave every finished run to the cycle collector.
        self._replay = replay

    def isEnabledFor(self, level: int) -> bool:
        return self._replay.caught_up and self.logger.isEnabledFor(level)

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        extra = dict(kwargs.get("extra") or {})
        extra.setdefault("workflow_id", self._replay.workflow_id)
        extra.setdefault("run_id", self._replay.run_id)
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

    def __init__(self, replay: Replay, queries: QueryHandlers) -> None:
        self._replay = replay
        self._port = replay.port
        self._queries = queries
        #: Patch ids this execution already answered ``True`` for.
        self._patches: set[str] = set()
        self._signals_taken: dict[str, int] = {}
        self._named_timers: set[str] = set()
        #: The run's search attributes as its code has set them so far (built on first use).
        self._search: dict[str, SearchValue] | None = None
        # Built on first use (most runs never ask): the same seed, so the same sequence.
        self._rng: random.Random | None = None
        self.logger: logging.LoggerAdapter = _ReplayAwareLogger(  # type: ignore[type-arg]
            logging.getLogger(f"aion_trio.workflow.{self._port.workflow_type}"), replay
        )

    # -- identity ----------------------------------------------------------

    @property
    def workflow_id(self) -> str:
        """The id of the workflow this code runs for."""
        return self._replay.workflow_id

    @property
    def run_id(self) -> str:
        """The id of the current run (a continue-as-new or a reset starts a new one)."""
        return self._replay.run_id

    @property
    def workflow_type(self) -> str:
        """The registered name of the workflow (its definition's ``name``)."""
        return self._port.workflow_type

    @property
    def is_replaying(self) -> bool:
        """True until the run first does something not already in history."""
        return not self._replay.caught_up

    def now(self) -> datetime:
        """The replay position: the run's start time, advanced by each resolution consumed.

        Identical live and on replay; never reads a clock.
        """
        return self._replay.now

    def _generator(self) -> random.Random:
        rng = self._rng
        if rng is None:
            rng = self._rng = random.Random(_seed(self._replay.workflow_id, self._replay.run_id))
        return rng

    def random(self) -> random.Random:
        """A generator seeded by (workflow_id, run_id): same sequence on replay."""
        self._replay.refuse_in_query("ctx.random()")
        return self._generator()

    def uuid4(self) -> uuid.UUID:
        """A deterministic version-4 UUID from :meth:`random`."""
        self._replay.refuse_in_query("ctx.uuid4()")
        return uuid.UUID(int=self._generator().getrandbits(128), version=4)

    # -- activities --------------------------------------------------------

    @overload
    def start(
        self,
        activity: ActivityDefinition[Callable[[Unpack[Ts]], Awaitable[R]]],
        *args: Unpack[Ts],
        retry: RetryPolicy | None = UNSET,
        timeout: timedelta | float | None = UNSET,
        schedule_to_close: timedelta | float | None = UNSET,
        heartbeat_timeout: timedelta | float | None = UNSET,
        task_queue: str | None = UNSET,
        fallback_queues: Sequence[str] | None = UNSET,
        advisory: bool = UNSET,
        priority: int = UNSET,
    ) -> ActivityHandle[R]: ...

    @overload
    def start(
        self,
        activity: ActivityDefinition[Callable[[Unpack[Ts]], R]],
        *args: Unpack[Ts],
        retry: RetryPolicy | None = UNSET,
        timeout: timedelta | float | None = UNSET,
        schedule_to_close: timedelta | float | None = UNSET,
        heartbeat_timeout: timedelta | float | None = UNSET,
        task_queue: str | None = UNSET,
        fallback_queues: Sequence[str] | None = UNSET,
        advisory: bool = UNSET,
        priority: int = UNSET,
    ) -> ActivityHandle[R]: ...

    @overload
    def start(
        self,
        activity: str,
        *args: Any,
        retry: RetryPolicy | None = UNSET,
        timeout: timedelta | float | None = UNSET,
        schedule_to_close: timedelta | float | None = UNSET,
        heartbeat_timeout: timedelta | float | None = UNSET,
        task_queue: str | None = UNSET,
        fallback_queues: Sequence[str] | None = UNSET,
        advisory: bool = UNSET,
        priority: int = UNSET,
    ) -> ActivityHandle[Any]: ...

    def start(
        self,
        activity: ActivityDefinition[Any] | str,
        *args: Unpack[Ts],
        retry: RetryPolicy | None = UNSET,
        timeout: timedelta | float | None = UNSET,
        schedule_to_close: timedelta | float | None = UNSET,
        heartbeat_timeout: timedelta | float | None = UNSET,
        task_queue: str | None = UNSET,
        fallback_queues: Sequence[str] | None = UNSET,
        advisory: bool = UNSET,
        priority: int = UNSET,
    ) -> ActivityHandle[Any]:
        """Schedule an activity; returns a handle at once (await it later).

        Keyword options override the activity's own, which override the
        engine's defaults; the resolved options are recorded with the command.
        ``priority`` orders this attempt among those waiting for a flow-control
        slot (lower first, then in order of arrival; docs/flow-control.md).  Replay
        compares an activity's type and arguments, never its options: history
        recorded under other options (another ``timeout``, ``priority``...) replays
        unchanged, and its attempts keep the options recorded with them.
        Type checkers check ``args`` against the activity's parameters and give
        the handle its result type (an ``async def``'s awaited value).
        """
        replay = self._replay
        replay.require_own_task("ctx.start()")
        definition = self._port.activity_definition(activity)
        # Decided alike live and on replay (code and arguments only): a call that
        # does not fit raises here, and the run fails like on any exception.
        definition.check_arguments(args)
        call_layer: dict[str, Any] = {}
        passed = (
            retry,
            timeout,
            schedule_to_close,
            heartbeat_timeout,
            task_queue,
            fallback_queues,
            advisory,
            priority,
        )
        if any(option is not UNSET for option in passed):
            call_layer = explicit(
                retry=retry,
                timeout=timeout,
                schedule_to_close=schedule_to_close,
                heartbeat_timeout=heartbeat_timeout,
                task_queue=task_queue,
                fallback_queues=fallback_queues,
                advisory=advisory,
                priority=priority,
            )
            if call_layer:
                call_layer = check_layer(call_layer, f"ctx.start({definition.name})")
        ordinal = replay.next_activity
        # Encoded live and on replay alike: compared with the recorded input (its text, or its digest).
        payload = self._port.codec.encode(list(args), what=f"input of activity {definition.name!r}")
        replay.state.sync()
        recorded = replay.resolve_activity(definition.name, payload)
        if recorded is not None:
            replay.next_activity += 1
            return ActivityHandle(replay, ordinal, definition.name, hints=definition.hints)
        # ResumeLive: validate the options before anything is recorded.
        try:
            queue, recorded_options = self._port.resolved_activity_options(definition, call_layer)
        except BaseException:
            replay.next_command -= 1  # nothing was issued
            raise
        replay.next_activity += 1
        replay.pending.append(
            ScheduleActivity(
                ordinal=ordinal,
                definition=definition,
                input=payload,
                task_queue=queue,
                options=recorded_options,
            )
        )
        return ActivityHandle(replay, ordinal, definition.name, hints=definition.hints)

    @overload
    async def run(
        self,
        activity: ActivityDefinition[Callable[[Unpack[Ts]], Awaitable[R]]],
        *args: Unpack[Ts],
        **options: Any,
    ) -> R: ...

    @overload
    async def run(
        self, activity: ActivityDefinition[Callable[[Unpack[Ts]], R]], *args: Unpack[Ts], **options: Any
    ) -> R: ...

    @overload
    async def run(self, activity: str, *args: Any, **options: Any) -> Any: ...

    # mypy cannot match the ParamSpec decorator's signature with the overloads' *Ts.
    @_command("ctx.run()")  # type: ignore[misc]
    async def run(self, /, activity: ActivityDefinition[Any] | str, *args: Unpack[Ts], **options: Any) -> Any:
        """Schedule an activity and wait for its result (options as for :meth:`start`)."""
        return await self.start(activity, *args, **options)

    # -- cancellation --------------------------------------------------------

    @property
    def cancel_requested(self) -> bool:
        """True once a cancel of this run is recorded (and not withdrawn by a reopen)."""
        state = self._replay.state
        state.sync()
        return state.cancel_request is not None

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
        replay = self._replay
        replay.require_own_task("ctx.cleanup()")
        replay.cleanup_depth += 1
        try:
            yield
        finally:
            replay.cleanup_depth -= 1

    # -- any handle (gather, wait_first) -----------------------------------------

    @_command("ctx.gather()")
    async def gather(self, *handles: Handle) -> list[Any]:
        """Wait for every handle (activity, child workflow or timer); results in argument order.

        A timer gives ``True`` if it fired, ``False`` if it was cancelled.  If any
        failed, raises the failure recorded first (lowest seq) as soon as it is in
        history — the same one live and on replay.
        """
        replay = self._replay
        own = own_handles(replay, handles, "ctx.gather()")

        def check() -> list[Event] | tuple[Handle, Event] | None:
            resolved = [handle_resolution(h) for h in own]
            failures = [
                (h, e) for h, e in zip(own, resolved, strict=True) if e is not None and handle_failed(e)
            ]
            if failures:
                return min(failures, key=lambda pair: pair[1].seq)
            if all(e is not None for e in resolved):
                return [e for e in resolved if e is not None]
            return None

        outcome = await replay.wait_until(check, awaited_activities=awaited_activities(own))
        if isinstance(outcome, tuple):
            handle, event = outcome
            replay.consume(event)
            handle_value(handle, event)  # raises the recorded failure
            raise AssertionError("unreachable: a gather failure resolved to a success")
        assert isinstance(outcome, list)
        for event in outcome:
            replay.consume(event)
        return [handle_value(h, e) for h, e in zip(own, outcome, strict=True)]

    @_command("ctx.wait_first()")
    async def wait_first(self, *handles: H) -> H:
        """Wait until one handle (activity, child workflow or timer) resolves; returns the
        one recorded first (lowest seq).  Await it for its value."""
        if not handles:
            raise ValueError("wait_first() needs at least one handle")
        replay = self._replay
        own = own_handles(replay, handles, "ctx.wait_first()")

        def check() -> tuple[Handle, Event] | None:
            present = [(h, e) for h in own if (e := handle_resolution(h)) is not None]
            return min(present, key=lambda pair: pair[1].seq) if present else None

        handle, event = await replay.wait_until(check, awaited_activities=awaited_activities(own))
        replay.consume(event)
        return handle  # type: ignore[return-value]

    # -- child workflows -----------------------------------------------------

    @overload
    def start_child(
        self,
        workflow: WorkflowDefinition[Callable[[WorkflowContext, Unpack[Ts]], Awaitable[R]]],
        *args: Unpack[Ts],
        workflow_id: str | None = None,
        parent_close_policy: ParentClosePolicy = ParentClosePolicy.CANCEL,
        timeout: timedelta | float | None = None,
        task_queue: str | None = None,
    ) -> ChildHandle[R]: ...

    @overload
    def start_child(
        self,
        workflow: str,
        *args: Any,
        workflow_id: str | None = None,
        parent_close_policy: ParentClosePolicy = ParentClosePolicy.CANCEL,
        timeout: timedelta | float | None = None,
        task_queue: str | None = None,
    ) -> ChildHandle[Any]: ...

    def start_child(
        self,
        workflow: WorkflowDefinition[Any] | str,
        *args: Unpack[Ts],
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
        replay = self._replay
        replay.require_own_task("ctx.start_child()")
        definition = self._port.workflow_definition(workflow)
        definition.check_arguments(args, "child workflow")
        if workflow_id is not None:
            validate_workflow_id(workflow_id, "child workflow_id")
        if not isinstance(parent_close_policy, ParentClosePolicy):
            raise TypeError(f"parent_close_policy must be a ParentClosePolicy, got {parent_close_policy!r}")
        seconds = _duration(timeout, "child timeout", allow_zero=False) if timeout is not None else None
        if task_queue is not None:
            validate_task_queue(task_queue)
        ordinal = replay.next_child
        child_id = workflow_id or derive_child_workflow_id(self.workflow_id, self.run_id, ordinal)
        # Every check below decides alike live and on replay (it reads nothing that grows).
        if child_id == self.workflow_id:
            raise ValueError(f"a workflow cannot be its own child (child workflow_id {child_id!r})")
        if child_id in replay.unobserved_children:
            raise ValueError(
                f"child workflow_id {child_id!r} is already used by a child of this run whose outcome "
                "the workflow has not awaited; await it first, or give each child its own id"
            )
        payload = self._port.codec.encode(list(args), what=f"input of child workflow {definition.name!r}")
        replay.state.sync()
        recorded = replay.resolve_command(
            CommandKey(COMMAND_CHILD, definition.name, child_id, input_digest(payload)), payload
        )
        if recorded is not None:
            replay.next_child += 1
            replay.unobserved_children.add(child_id)
            return ChildHandle(replay, ordinal, child_id, definition.name, hints=definition.hints)
        start = replay.state.start
        assert start is not None
        assert isinstance(start.body, WorkflowStarted)
        options = ChildOptions(
            parent_close_policy=parent_close_policy,
            task_queue=task_queue or start.body.task_queue,
            timeout=seconds,
        )
        replay.next_child += 1
        replay.unobserved_children.add(child_id)
        replay.pending.append(
            StartChild(
                ordinal=ordinal,
                child_workflow_id=child_id,
                workflow_type=definition.name,
                input=payload,
                options=options,
            )
        )
        return ChildHandle(replay, ordinal, child_id, definition.name, hints=definition.hints)

    @overload
    async def child(
        self,
        workflow: WorkflowDefinition[Callable[[WorkflowContext, Unpack[Ts]], Awaitable[R]]],
        *args: Unpack[Ts],
        **options: Any,
    ) -> R: ...

    @overload
    async def child(self, workflow: str, *args: Any, **options: Any) -> Any: ...

    async def child(self, workflow: WorkflowDefinition[Any] | str, *args: Unpack[Ts], **options: Any) -> Any:
        """Start a child workflow and wait for its result (options as for :meth:`start_child`)."""
        return await self.start_child(workflow, *args, **options)

    # -- timers --------------------------------------------------------------

    def start_timer(
        self, name: str, duration: timedelta | float | None = None, *, at: datetime | None = None
    ) -> TimerHandle:
        """Start a named durable timer firing after ``duration`` (or at ``at``); returns its handle.

        Names are unique within a run.  The timer is recorded with the run's next
        await (like :meth:`start`); await the handle to wait for it, or cancel it.
        """
        replay = self._replay
        replay.require_own_task("ctx.start_timer()")
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
            fire_at = replay.now + timedelta(seconds=_duration(duration, "timer duration", allow_zero=True))
        if name in self._named_timers:
            raise ValueError(f"timer name {name!r} was already used in this run; names are unique per run")
        self._named_timers.add(name)
        timer_id = named_timer(name)
        replay.state.sync()
        recorded = replay.issue_timer(timer_id, fire_at)
        if recorded is not None and isinstance(recorded.body, TimerStarted):
            fire_at = recorded.body.fire_at  # replay: the recorded time wins
        return TimerHandle(replay, name, timer_id, fire_at)

    @_command("ctx.sleep()")
    async def sleep(self, duration: timedelta | float) -> None:
        """A durable timer: survives restarts; fires once ``ctx.now() + duration`` is reached."""
        self._replay.require_own_task("ctx.sleep()")
        seconds = _duration(duration, "sleep duration", allow_zero=True)
        await self._sleep_until(self._replay.now + timedelta(seconds=seconds))

    @_command("ctx.sleep_until()")
    async def sleep_until(self, when: datetime) -> None:
        """A durable timer firing at ``when`` (timezone-aware)."""
        self._replay.require_own_task("ctx.sleep_until()")
        if when.tzinfo is None or when.utcoffset() is None:
            raise ValueError(f"sleep_until needs a timezone-aware datetime, got {when!r}")
        await self._sleep_until(when)

    async def _sleep_until(self, when: datetime) -> None:
        replay = self._replay
        replay.state.sync()
        timer_id = anonymous_timer(replay.next_timer)
        replay.next_timer += 1
        replay.issue_timer(timer_id, when)
        event = await replay.await_timer_or_scope(timer_id)
        replay.consume(event)
        if isinstance(event.body, TimerCancelled):
            raise Timeout(f"a timeout scope expired while sleeping ({timer_id})")

    # -- signals and timeout scopes --------------------------------------------

    # A durable, recorded timeout: trio.fail_after would not survive replay.
    @_command("ctx.wait_signal()")
    async def wait_signal(self, name: str, *, timeout: timedelta | float | None = None) -> Any:
        """Wait for the next signal called ``name`` and return its payload.

        Signals of one name are consumed in the order they were recorded.
        With ``timeout`` (or inside ``ctx.timeout``), whichever was recorded
        first wins — the signal or the expiry — so replay decides the same
        way; an expiry raises :class:`Timeout`.
        """
        replay = self._replay
        replay.require_own_task("ctx.wait_signal()")
        if not isinstance(name, str) or not name:
            raise ValueError(f"signal name must be a non-empty str, got {name!r}")
        state = replay.state
        state.sync()
        index = self._signals_taken.get(name, 0)
        timer_id: str | None = None
        if timeout is not None:
            seconds = _duration(timeout, "signal timeout", allow_zero=True)
            timer_id = anonymous_timer(replay.next_timer)
            replay.next_timer += 1
            replay.issue_timer(timer_id, replay.now + timedelta(seconds=seconds))

        def check() -> Event | None:
            received = state.signals.get(name, [])
            candidates = [received[index]] if index < len(received) else []
            candidates.extend(replay.fired_scopes(timer_id))
            return min(candidates, key=lambda e: e.seq) if candidates else None

        event = await replay.wait_until(check)
        replay.consume(event)
        if timer_id is not None and replay.resolve_timer_cancel(timer_id):
            replay.pending.append(CancelTimer(timer_id=timer_id))
        if isinstance(event.body, TimerFired):
            raise Timeout(f"no {name!r} signal arrived in time")
        assert isinstance(event.body, SignalReceived)
        self._signals_taken[name] = index + 1
        return self._port.codec.decode(event.body.payload)

    def set_signal_handler(self, name: str, handler: Callable[[Any], object]) -> None:
        """Give every signal called ``name`` to ``handler(payload)``, in the order recorded.

        A plain (``def``) handler updates the workflow's state and must not
        issue commands; the workflow waits for that state with
        :meth:`wait_condition`.  An ``async def`` handler runs as a branch of
        the run beside the workflow function and may issue commands
        (activities, timers, children, ``wait_condition``); the branches take
        turns in an order history decides, so replay resumes each as the live
        run did (see :meth:`set_update_handler`).  Signals are delivered at the
        run's awaits: each one recorded before what resolves an await is handed
        over before that await returns, so replay delivers it at the same
        point.  Signals recorded before the handler was registered are
        delivered at the next await; an exception from a handler is raised in
        the workflow function (at that await, or, from an async handler, at the
        await the workflow function is suspended in).  Registering a name again
        replaces its handler.
        """
        self._replay.require_own_task("ctx.set_signal_handler()")
        self._signal_handlers().register(name, handler)

    @overload
    def signal_handler(self, name: str, /) -> Callable[[F], F]: ...

    @overload
    def signal_handler(self, handler: F, /) -> F: ...

    def signal_handler(self, name_or_handler: str | F, /) -> Callable[[F], F] | F:
        """Decorator form of :meth:`set_signal_handler`.

        ``@ctx.signal_handler("approve")`` registers under the given name;
        bare ``@ctx.signal_handler`` under the function's ``__name__``.
        """
        return _handler_decorator("signal", name_or_handler, self.set_signal_handler)

    # -- updates -----------------------------------------------------------------

    def set_update_handler(
        self,
        name: str,
        handler: Callable[..., Any],
        *,
        validator: Callable[..., object] | None = None,
    ) -> None:
        """Answer ``engine.update(workflow_id, name, *args)`` with ``handler(*args)``.

        ``validator(*args)``, if given, runs first against the live run's state
        while its code is parked: if it raises, the caller gets
        :class:`UpdateRejected` and nothing is recorded.  An accepted update is
        recorded (``UpdateAccepted``) and delivered at the run's next await in
        the order recorded, like a signal; the handler's return value (or its
        exception, as :class:`UpdateFailed`) is recorded (``UpdateCompleted``)
        and given to the caller.  Arguments are decoded to the types the
        handler (and the validator) annotate, as a signal handler's are; the
        result is encoded like any payload (dataclasses and attrs classes too).

        The validator is a plain (sync) function.  A plain handler reads and
        updates the workflow's state and must not issue commands.  An
        ``async def`` handler runs as a branch of the run beside the workflow
        function and may issue commands (``ctx.run``, timers, children,
        ``ctx.wait_condition``): one branch runs at a time, and the turn goes to
        the branch whose await history resolves first, so a replay (after a
        crash mid-handler too) resumes each branch exactly as the live run did.
        Before returning, the workflow can wait for such handlers with
        ``await ctx.wait_condition(ctx.all_handlers_finished)``; handlers still
        running when the workflow function exits are cancelled (their callers
        get :class:`UpdateUnavailable`).  Registering a name again replaces both.
        """
        self._replay.require_own_task("ctx.set_update_handler()")
        self._signal_handlers().register_update(name, handler, validator)

    def update_handler(
        self, name: str, /, *, validator: Callable[..., object] | None = None
    ) -> Callable[[F], F]:
        """Decorator form of :meth:`set_update_handler`: ``@ctx.update_handler("add")``."""

        def register(handler: F) -> F:
            self.set_update_handler(name, handler, validator=validator)
            return handler

        return register

    def all_handlers_finished(self) -> bool:
        """True when no async signal or update handler is running: wait for it before the
        workflow returns, ``await ctx.wait_condition(ctx.all_handlers_finished)``.

        A workflow function that exits while handlers run ends the run anyway:
        those handlers are cancelled and record nothing more, their updates get
        no outcome (a waiting caller gets :class:`UpdateUnavailable`), and a
        warning names them.
        """
        return not self._replay.running_handlers()

    def _signal_handlers(self) -> SignalHandlers:
        replay = self._replay
        if replay.signal_handlers is None:
            replay.signal_handlers = SignalHandlers()
        return replay.signal_handlers

    @_command("ctx.wait_condition()")
    async def wait_condition(
        self, predicate: Callable[[], bool], *, timeout: timedelta | float | None = None
    ) -> None:
        """Wait until ``predicate()`` is true; it reads state the signal handlers set.

        Returns at once if it is already true (nothing is recorded).  Otherwise
        the predicate is checked again after each signal is handed to its
        handler, in the order the signals were recorded, so replay returns at
        the same signal the live run did.  With ``timeout`` (a durable, recorded
        timer, as for :meth:`wait_signal`) or inside ``ctx.timeout``, an expiry
        recorded before the condition held raises :class:`Timeout`.
        The predicate is a plain function: it must not issue commands.
        """
        replay = self._replay
        replay.require_own_task("ctx.wait_condition()")
        if not callable(predicate):
            raise TypeError(f"wait_condition needs a callable predicate, got {predicate!r}")
        handlers = self._signal_handlers()
        what = "the wait_condition predicate"
        if handlers.call(what, predicate):
            return
        replay.state.sync()
        timer_id: str | None = None
        if timeout is not None:
            seconds = _duration(timeout, "wait_condition timeout", allow_zero=True)
            timer_id = anonymous_timer(replay.next_timer)
            replay.next_timer += 1
            replay.issue_timer(timer_id, replay.now + timedelta(seconds=seconds))

        def check() -> Satisfied | Event | None:
            if handlers.call(what, predicate):
                return Satisfied(replay.position)
            fired = replay.fired_scopes(timer_id)
            return min(fired, key=lambda e: e.seq) if fired else None

        outcome = await replay.wait_until(check)
        if isinstance(outcome, Event):
            replay.consume(outcome)
        if timer_id is not None and replay.resolve_timer_cancel(timer_id):
            replay.pending.append(CancelTimer(timer_id=timer_id))
        if isinstance(outcome, Event):
            raise Timeout("the condition did not hold in time")

    def timeout(self, duration: timedelta | float) -> TimeoutScope:
        """``async with ctx.timeout(d):`` — awaits inside raise :class:`Timeout` once ``d`` passed.

        Durable: the scope is a recorded timer, and the expiry decision is
        recorded, so replay takes the same branch.  Nested scopes: the
        earliest deadline wins.  Leaving in time records ``TimerCancelled``.
        """
        self._replay.require_own_task("ctx.timeout()")
        seconds = _duration(duration, "timeout", allow_zero=False)
        return TimeoutScope(self._replay, seconds)

    # -- search attributes -----------------------------------------------------

    @property
    def search_attributes(self) -> Mapping[str, SearchValue]:
        """The run's search attributes: those it was started with, updated by each
        :meth:`upsert_search_attributes` the code made so far (a copy; same on replay)."""
        return dict(self._search_values())

    @_command("ctx.upsert_search_attributes()")
    async def upsert_search_attributes(self, attributes: Mapping[str, Any]) -> None:
        """Set search attributes of this run (added, or replacing the values of the same names).

        A recorded command: it returns once the upsert is recorded (with any
        command issued before it), and the run's visibility row then lists the
        new values (``engine.list(search=[...])``); a continue-as-new successor
        starts with them.  On replay the recorded upsert is found instead;
        other values than those recorded at this point are a
        :class:`NonDeterminismError`.  Values are str, int, float, bool or a
        list of str; a bad name or value raises ``ValueError`` here, before
        anything is recorded.
        """
        replay = self._replay
        replay.require_own_task("ctx.upsert_search_attributes()")
        values = validate_search_attributes(attributes)
        search = self._search_values()
        state = replay.state
        state.sync()
        key = CommandKey(COMMAND_SEARCH_ATTRIBUTES, "", digest=search_attributes_digest(values))
        if replay.resolve_command(key) is None:
            recorded = sum(1 for k, _ in state.commands if k.kind == COMMAND_SEARCH_ATTRIBUTES)
            queued = sum(1 for p in replay.pending if isinstance(p, UpsertSearchAttributes))
            replay.pending.append(UpsertSearchAttributes(ordinal=recorded + queued, attributes=values))
            await replay.flush()
            state.sync()
        search.update(values)

    def _search_values(self) -> dict[str, SearchValue]:
        if self._search is None:
            start = self._replay.state.start
            assert start is not None
            assert isinstance(start.body, WorkflowStarted)
            self._search = dict(start.body.search_attributes)
        return self._search

    # -- messages to other workflows ---------------------------------------------

    @_command("ctx.signal_external()")
    async def signal_external(self, workflow_id: str, name: str, payload: Any = None) -> None:
        """Signal another workflow's running run (as ``engine.signal`` would), exactly once.

        The intent is recorded in this run's history first (a command: on replay
        it is found, and another target, name or payload at this point is a
        :class:`NonDeterminismError`), then delivered with a request id derived
        from this run and the message's ordinal, so a redelivery after a crash
        in between is recorded once by the target; how it was received is
        recorded too, so replay answers the same.  In cluster mode the signal
        reaches the node owning the target through the inbox.

        Raises :class:`WorkflowNotFound` if no workflow ``workflow_id`` exists and
        :class:`NotRunning` if it is closed (recorded: a replay raises it again).
        A bad name or payload raises ``ValueError``/``TypeError`` before anything
        is recorded.
        """
        validate_workflow_id(workflow_id)
        if not isinstance(name, str) or not name:
            raise ValueError(f"signal name must be a non-empty str, got {name!r}")
        check_text(name, "signal name")
        encoded = self._port.codec.encode(payload, what=f"payload of signal {name!r}")
        digest = input_digest(encoded)
        key = CommandKey(COMMAND_SIGNAL_EXTERNAL, name, workflow_id, digest)
        intent = {"kind": "signal", "workflow_id": workflow_id, "name": name, "digest": digest}
        message = ExternalMessage(kind="signal", workflow_id=workflow_id, name=name, payload=payload)
        await self._message_external("ctx.signal_external()", key, intent, message)

    @_command("ctx.cancel_external()")
    async def cancel_external(self, workflow_id: str, reason: str = "") -> None:
        """Ask another workflow's running run to cancel (as ``engine.cancel`` would), exactly once.

        Recorded, delivered and answered as :meth:`signal_external` is: the
        target sees :class:`WorkflowCancelled` at its next await.  Raises
        :class:`WorkflowNotFound` or :class:`NotRunning` (recorded) if there is
        no such workflow or it is closed.
        """
        validate_workflow_id(workflow_id)
        if not isinstance(reason, str):
            raise TypeError(f"reason must be a str, got {reason!r}")
        check_text(reason, "reason")
        key = CommandKey(COMMAND_CANCEL_EXTERNAL, "", workflow_id)
        intent = {"kind": "cancel", "workflow_id": workflow_id, "name": ""}
        message = ExternalMessage(kind="cancel", workflow_id=workflow_id, reason=reason)
        await self._message_external("ctx.cancel_external()", key, intent, message)

    async def _message_external(
        self, what: str, key: CommandKey, intent: dict[str, str], message: ExternalMessage
    ) -> None:
        replay = self._replay
        replay.require_own_task(what)
        await replay.flush()  # commands issued before it are recorded first
        state = replay.state
        state.sync()
        recorded = replay.resolve_command(key)
        if recorded is None:
            ordinal = sum(1 for k, _ in state.commands if k.kind in _EXTERNAL_KINDS)
            await self._port.record_marker(f"{EXTERNAL_MARKER_PREFIX}{ordinal}", Payload.of(intent))
            state.sync()
        else:
            assert isinstance(recorded.body, MarkerRecorded)
            ordinal = int(recorded.body.name[len(EXTERNAL_MARKER_PREFIX) :])
        outcome_name = f"{EXTERNAL_OUTCOME_MARKER_PREFIX}{ordinal}"
        if outcome_name not in state.markers:
            # Live, or recorded by a run that stopped before it knew the outcome: deliver
            # (again: the target records one request id once) and record the outcome.
            await self._port.deliver_external(ordinal, message)
            state.sync()
        outcome = state.markers[outcome_name].body
        assert isinstance(outcome, MarkerRecorded)
        answer = outcome.value.value()
        verb = "signal" if message.kind == "signal" else "cancel"
        if answer.get("outcome") == "not_found":
            raise WorkflowNotFound(message.workflow_id)
        if answer.get("outcome") == "closed":
            raise NotRunning(message.workflow_id, str(answer.get("status", "closed")), verb)

    # -- durable events ----------------------------------------------------------

    @_command("ctx.set_event()")
    async def set_event(self, key: str, value: Any) -> None:
        """Publish ``value`` under ``key`` for other callers to read (``engine.get_event``,
        another workflow's ``ctx.get_event``, ``aion-trio event get``); the last write wins.

        A recorded command: it returns once recorded (with the commands issued
        before it); on replay it is found instead, and another value at this
        point is a :class:`NonDeterminismError`.  A bad key or an unserialisable
        value raises here, before anything is recorded.
        """
        replay = self._replay
        replay.require_own_task("ctx.set_event()")
        if not isinstance(key, str) or not key:
            raise ValueError(f"event key must be a non-empty str, got {key!r}")
        check_text(key, "event key")
        encoded = self._port.codec.encode(value, what=f"value of event {key!r}").value()
        await replay.flush()
        state = replay.state
        state.sync()
        if (
            replay.resolve_command(CommandKey(COMMAND_SET_EVENT, key, digest=event_value_digest(encoded)))
            is None
        ):
            ordinal = sum(1 for k, _ in state.commands if k.kind == COMMAND_SET_EVENT)
            await self._port.record_marker(
                f"{EVENT_MARKER_PREFIX}{ordinal}", Payload.of({"key": key, "value": encoded})
            )
            state.sync()

    @_command("ctx.get_event()")
    async def get_event(self, workflow_id: str, key: str, *, timeout: timedelta | float = 60.0) -> Any:
        """The value workflow ``workflow_id`` published under ``key`` (``ctx.set_event``),
        waiting up to ``timeout`` for it; ``None`` if it is not published in time, or if the
        workflow is closed without it (as ``engine.get_event``).

        What the read found is recorded in this run's history (a command: replay
        returns the same, and another workflow or key at this point is a
        :class:`NonDeterminismError`); the wait's timeout is a durable timer, and
        whichever of the value and the timer's fire is recorded first wins.
        Raises :class:`WorkflowNotFound` (recorded) if no such workflow exists.
        """
        replay = self._replay
        replay.require_own_task("ctx.get_event()")
        validate_workflow_id(workflow_id)
        if not isinstance(key, str) or not key:
            raise ValueError(f"event key must be a non-empty str, got {key!r}")
        seconds = _duration(timeout, "event timeout", allow_zero=True)
        await replay.flush()
        state = replay.state
        state.sync()
        recorded = replay.resolve_command(CommandKey(COMMAND_GET_EVENT, key, workflow_id))
        if recorded is None:
            ordinal = sum(1 for k, _ in state.commands if k.kind == COMMAND_GET_EVENT)
            first = await self._port.look_up_event(workflow_id, key) or {"outcome": "waiting"}
            read = {"workflow_id": workflow_id, "key": key, "first": first}
            await self._port.record_marker(f"{EVENT_READ_MARKER_PREFIX}{ordinal}", Payload.of(read))
            state.sync()
        else:
            assert isinstance(recorded.body, MarkerRecorded)
            ordinal = int(recorded.body.name[len(EVENT_READ_MARKER_PREFIX) :])
            first = recorded.body.value.value()["first"]
        if first["outcome"] != "waiting":
            return self._event_answer(workflow_id, first)
        timer_id = anonymous_timer(replay.next_timer)
        replay.next_timer += 1
        fire_at = replay.now + timedelta(seconds=seconds)
        started = replay.issue_timer(timer_id, fire_at)
        if started is not None and isinstance(started.body, TimerStarted):
            fire_at = started.body.fire_at
        result_name = f"{EVENT_READ_RESULT_MARKER_PREFIX}{ordinal}"
        if result_name not in state.markers and not replay.fired_scopes(timer_id):
            await self._port.watch_event(ordinal, workflow_id, key, fire_at)

        def check() -> Event | None:
            state.sync()
            candidates = list(replay.fired_scopes(timer_id))
            if result_name in state.markers:
                candidates.append(state.markers[result_name])
            return min(candidates, key=lambda e: e.seq) if candidates else None

        event = await replay.wait_until(check)
        replay.consume(event)
        if replay.resolve_timer_cancel(timer_id):
            replay.pending.append(CancelTimer(timer_id=timer_id))
        if isinstance(event.body, TimerFired):
            if event.body.timer_id != timer_id:
                raise Timeout(f"a timeout scope expired while waiting for event {key!r} of {workflow_id!r}")
            return None
        assert isinstance(event.body, MarkerRecorded)
        return self._event_answer(workflow_id, event.body.value.value())

    def _event_answer(self, workflow_id: str, answer: dict[str, Any]) -> Any:
        if answer["outcome"] == "not_found":
            raise WorkflowNotFound(workflow_id)
        if answer["outcome"] == "published":
            return self._port.codec.decode(Payload.of(answer["value"]))
        return None  # closed without publishing it

    # -- versioning ----------------------------------------------------------

    @_command("ctx.patched()")
    async def patched(self, patch_id: str) -> bool:
        """True if this run executes the new code path for ``patch_id``.

        Runs that recorded the patch, and runs reaching this point live, take
        the new path (live runs record a marker); a run replaying history made
        by older code before the marker existed takes the old path.
        """
        replay = self._replay
        replay.require_own_task("ctx.patched()")
        if not isinstance(patch_id, str) or not patch_id:
            raise ValueError(f"patch id must be a non-empty str, got {patch_id!r}")
        if patch_id in self._patches:
            return True  # recorded (or found) once per run; later calls agree
        name = PATCH_MARKER_PREFIX + patch_id
        replay.state.sync()
        commands = replay.state.commands
        position = replay.next_command
        if position < len(commands):
            recorded, _ = commands[position]
            if not recorded.matches(CommandKey(COMMAND_PATCH, patch_id)):
                # History made by older code issued another command here, without
                # this patch: follow the old path so replay keeps matching it.
                return False
            replay.next_command = position + 1
            self._patches.add(patch_id)
            return True
        if replay.recorded_end() is not None:
            return False  # the old code ended here, without the patch
        await replay.flush()
        replay.next_command += 1
        self._patches.add(patch_id)
        replay.caught_up = True
        await self._port.record_marker(name, Payload("true"))
        replay.state.sync()
        return True

    def continue_as_new(self, *args: Any, workflow_type: str | None = None) -> ContinueAsNew:
        """``raise ctx.continue_as_new(...)``: end this run and start a fresh one with new input."""
        self._replay.require_own_task("ctx.continue_as_new()")
        successor = self._port.registered_workflow(workflow_type or self._port.workflow_type)
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
        self._replay.require_own_task("ctx.set_query_handler()")
        self._queries.register(name, handler)

    @overload
    def query_handler(self, name: str, /) -> Callable[[F], F]: ...

    @overload
    def query_handler(self, handler: F, /) -> F: ...

    def query_handler(self, name_or_handler: str | F, /) -> Callable[[F], F] | F:
        """Decorator form of :meth:`set_query_handler`.

        ``@ctx.query_handler("status")`` registers under the given name;
        bare ``@ctx.query_handler`` under the function's ``__name__``.
        """
        return _handler_decorator("query", name_or_handler, self.set_query_handler)


@final
class RunActivation:
    """One execution of a run's code, as the engine drives it.

    Built in the run's own task with the run's :class:`WorkflowPort`; the
    engine calls the code with :attr:`context`, records what the code issued
    last with :meth:`flush` once it returned, asks :meth:`exit_divergence`
    whether it diverged from history, and
    :meth:`detach`-es it when the code exits.  Meanwhile queries read it
    through :attr:`answerable` and :meth:`answer_query`.
    """

    def __init__(self, port: WorkflowPort) -> None:
        self._replay = Replay(port)
        self._queries = QueryHandlers(self._replay)
        self.context = WorkflowContext(self._replay, self._queries)

    @property
    def input(self) -> Payload:
        """The run's input, as its ``WorkflowStarted`` recorded it."""
        start = self._replay.state.start
        assert start is not None
        assert isinstance(start.body, WorkflowStarted)
        return start.body.input

    @property
    def is_replaying(self) -> bool:
        return not self._replay.caught_up

    @property
    def poisoned(self) -> BaseException | None:
        """The divergence from history that stopped the code, if any (the run is then stuck)."""
        return self._replay.poisoned

    async def run(self, fn: Callable[..., Awaitable[T]], *args: Any, guarded: bool = False) -> T:
        """Run the workflow function ``fn(self.context, *args)`` and return what it returns.

        Async signal and update handlers run as branches beside it in a nursery
        this call owns; those still running when ``fn`` exits are cancelled and
        logged (``guarded``: with the determinism guard on, for them as for ``fn``).
        """
        replay = self._replay
        try:
            return await replay.run_code(fn, self.context, *args, guarded=guarded)
        finally:
            if replay.abandoned:
                self.context.logger.warning(
                    "workflow %r exited while handlers still ran; they were cancelled (wait for them "
                    "with ctx.wait_condition(ctx.all_handlers_finished)): %s",
                    replay.workflow_id,
                    ", ".join(replay.abandoned),
                )

    async def flush(self) -> None:
        """Record the commands the code issued after its last await (it returned)."""
        await self._replay.flush()

    def unissued_recorded_command(
        self, terminal: type[EventBody] | None = None
    ) -> tuple[str, int, str] | None:
        """The first command recorded in history that this execution never issued, if any:
        ``(kind, position in the run's command sequence, description)``.  Replaying a
        finished run, a recorded end of another kind than ``terminal`` counts too."""
        return self._replay.unissued_recorded_command(terminal)

    def exit_divergence(self, exit: str, terminal: type[EventBody]) -> BaseException | None:
        """The code exited (``exit`` says how; ``terminal`` is the event that exit records):
        the divergence from history it ends with, if any (see :meth:`Replay.exit_divergence`)."""
        return self._replay.exit_divergence(exit, terminal)

    @property
    def answerable(self) -> bool:
        """Parked between steps with nothing new to consume: a query may read the state now."""
        return self._replay.answerable

    def answer_query(self, name: str, args: Sequence[Any]) -> Any:
        """Run the handler for ``name`` synchronously (the run's task is parked)."""
        return self._queries.answer(name, args)

    def validate_update(self, name: str, args: Sequence[Any]) -> None:
        """Run update ``name``'s validator synchronously (the run's task is parked)."""
        replay = self._replay
        handlers = replay.signal_handlers
        if handlers is None:
            handlers = replay.signal_handlers = SignalHandlers()
        handlers.validate_update(replay.workflow_id, name, args)

    def detach(self) -> None:
        """The run's code exited: queries can no longer use it."""
        self._replay.parked = False


def _handler_decorator(
    kind: str, name_or_handler: str | F, register: Callable[[str, F], None]
) -> Callable[[F], F] | F:
    """The decorator forms of ``ctx.set_signal_handler`` and ``ctx.set_query_handler``:
    ``@ctx.KIND_handler("name")`` registers under the name given, a bare
    ``@ctx.KIND_handler`` under the function's ``__name__``."""
    if isinstance(name_or_handler, str):
        name = name_or_handler

        def decorate(handler: F) -> F:
            register(name, handler)
            return handler

        return decorate
    handler = name_or_handler
    handler_name = getattr(handler, "__name__", None)
    if not isinstance(handler_name, str):
        raise TypeError(
            f"cannot name {kind} handler {handler!r} (no __name__); use @ctx.{kind}_handler('name')"
        )
    register(handler_name, handler)
    return handler


def _duration(value: timedelta | float, what: str, *, allow_zero: bool) -> float:
    return duration_seconds(value, what, allow_zero=allow_zero)
