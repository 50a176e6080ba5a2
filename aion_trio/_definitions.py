"""``@workflow`` and ``@activity``: what users register with an engine."""

from __future__ import annotations

import enum
import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any, Generic, TypeVar, final, overload

import attrs

from ._convert import Hints
from ._errors import InvalidArguments
from ._ids import check_text
from ._retry import UNSET, RetryPolicy, check_layer, explicit

F = TypeVar("F", bound=Callable[..., Any])
#: A definition's function type: covariant, so a definition of ``(ctx, int) -> str`` is
#: one of ``(ctx, int) -> Awaitable[str]`` and calls infer argument and result types from it.
F_co = TypeVar("F_co", bound=Callable[..., Any], covariant=True)


class ActivityLoop(enum.Enum):
    """How an activity function is run."""

    TRIO = "trio"  #: ``async def``: a Trio task, truly cancellable
    THREAD = "thread"  #: plain ``def``: ``trio.to_thread.run_sync``
    ASYNCIO = "asyncio"  #: asyncio coroutine function, through trio-asyncio


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


@final
@attrs.frozen
class Arity:
    """What positional calls of a function bind, worked out once per definition.

    The engine passes arguments by position only, so a required keyword-only
    parameter can never be filled: it is reported like a missing one.
    """

    parameters: tuple[inspect.Parameter, ...]
    required: int  # positional parameters without a default (they come first)
    most: int | None  # positional parameters in all; None with ``*args``
    unfillable: inspect.Parameter | None  # the first required keyword-only parameter

    @classmethod
    def of(cls, fn: Callable[..., Any], skip: int = 0) -> Arity | None:
        """``fn``'s arity past its first ``skip`` parameters (a workflow's ``ctx``); None if it has no signature."""
        try:
            params = tuple(inspect.signature(fn).parameters.values())[skip:]
        except (TypeError, ValueError):  # some builtins and C callables have none: nothing to check
            return None
        positional = [p for p in params if p.kind in _POSITIONAL]
        return cls(
            params,
            sum(1 for p in positional if p.default is p.empty),
            None if any(p.kind is p.VAR_POSITIONAL for p in params) else len(positional),
            next((p for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty), None),
        )

    def check(self, args: Sequence[Any], *, kind: str, name: str) -> None:
        """Raise :class:`InvalidArguments` unless ``fn(*skipped, *args)`` binds (O(1) when it does)."""
        count = len(args)
        if count >= self.required and self.unfillable is None and (self.most is None or count <= self.most):
            return
        shown = str(inspect.Signature([p.replace(annotation=p.empty) for p in self.parameters]))
        if count < self.required or self.unfillable is not None:
            positional = [p for p in self.parameters if p.kind in _POSITIONAL]
            first = positional[count] if count < self.required else self.unfillable
            assert first is not None
            how = (
                " (keyword-only: positional arguments cannot fill it)"
                if first.kind is first.KEYWORD_ONLY
                else ""
            )
            raise InvalidArguments(
                kind,
                name,
                first.name,
                shown,
                f"missing the argument {first.name!r}{how}, got {count} argument(s)",
            )
        assert self.most is not None
        raise InvalidArguments(
            kind, name, None, shown, f"got {count} arguments, {count - self.most} more than it takes"
        )


def _check_name(name: object, what: str) -> str:
    if not isinstance(name, str) or not name or any(c.isspace() for c in name):
        raise ValueError(f"{what} name must be a non-empty str without whitespace, got {name!r}")
    return check_text(name, f"{what} name")


@final
@attrs.frozen(kw_only=True)
class WorkflowDefinition(Generic[F_co]):
    """A registered workflow: ``fn(ctx, *args)`` is an ``async def``."""

    name: str
    fn: F_co
    _arity: Arity | None = attrs.field(
        init=False,
        eq=False,
        repr=False,
        default=attrs.Factory(lambda self: Arity.of(self.fn, skip=1), takes_self=True),
    )
    #: Its parameter and return types, read once (typed payloads decode to them).
    hints: Hints = attrs.field(
        init=False,
        eq=False,
        repr=False,
        default=attrs.Factory(lambda self: Hints(self.fn, skip=1), takes_self=True),
    )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def check_arguments(self, args: Sequence[Any], kind: str = "workflow") -> None:
        """Raise :class:`InvalidArguments` unless ``fn(ctx, *args)`` binds."""
        if self._arity is not None:
            self._arity.check(args, kind=kind, name=self.name)


@final
@attrs.frozen(kw_only=True)
class ActivityDefinition(Generic[F_co]):
    """A registered activity and the options it sets explicitly."""

    name: str
    fn: F_co
    loop: ActivityLoop
    #: Options set on the decorator (a layer of the per call > activity > engine resolution).
    options: Mapping[str, Any] = attrs.field(factory=dict)
    _arity: Arity | None = attrs.field(
        init=False,
        eq=False,
        repr=False,
        default=attrs.Factory(lambda self: Arity.of(self.fn), takes_self=True),
    )
    #: Its parameter and return types, read once (typed payloads decode to them).
    hints: Hints = attrs.field(
        init=False,
        eq=False,
        repr=False,
        default=attrs.Factory(lambda self: Hints(self.fn), takes_self=True),
    )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the plain function (handy in unit tests of the activity itself)."""
        return self.fn(*args, **kwargs)

    def check_arguments(self, args: Sequence[Any]) -> None:
        """Raise :class:`InvalidArguments` unless ``fn(*args)`` binds."""
        if self._arity is not None:
            self._arity.check(args, kind="activity", name=self.name)


@overload
def workflow(fn: F, /) -> WorkflowDefinition[F]: ...
@overload
def workflow(*, name: str | None = None) -> Callable[[F], WorkflowDefinition[F]]: ...


def workflow(fn: F | None = None, /, *, name: str | None = None) -> Any:
    """Declare ``async def fn(ctx, *args)`` a workflow.  ``name`` defaults to the qualname.

    Workflow code must be deterministic: it talks to the world only through
    its :class:`~aion_trio.WorkflowContext` (activities, timers, signals,
    ``ctx.now()``, ``ctx.random()``), never directly.
    """

    def wrap(f: F) -> WorkflowDefinition[F]:
        if not callable(f) or not inspect.iscoroutinefunction(f):
            raise TypeError(f"@workflow needs an async def function, got {f!r}")
        definition: WorkflowDefinition[F] = WorkflowDefinition(
            name=_check_name(f.__qualname__ if name is None else name, "workflow"), fn=f
        )
        return definition

    return wrap(fn) if fn is not None else wrap


@overload
def activity(fn: F, /) -> ActivityDefinition[F]: ...
@overload
def activity(
    *,
    name: str | None = None,
    loop: str | None = None,
    retry: RetryPolicy | None = UNSET,
    timeout: timedelta | float | None = UNSET,
    schedule_to_close: timedelta | float | None = UNSET,
    heartbeat_timeout: timedelta | float | None = UNSET,
    task_queue: str | None = UNSET,
    fallback_queues: Sequence[str] | None = UNSET,
    advisory: bool = UNSET,
    priority: int = UNSET,
) -> Callable[[F], ActivityDefinition[F]]: ...


def activity(
    fn: F | None = None,
    /,
    *,
    name: str | None = None,
    loop: str | None = None,
    retry: RetryPolicy | None = UNSET,
    timeout: timedelta | float | None = UNSET,
    schedule_to_close: timedelta | float | None = UNSET,
    heartbeat_timeout: timedelta | float | None = UNSET,
    task_queue: str | None = UNSET,
    fallback_queues: Sequence[str] | None = UNSET,
    advisory: bool = UNSET,
    priority: int = UNSET,
) -> Any:
    """Declare ``fn`` an activity.

    ``async def`` activities run as Trio tasks; plain ``def`` activities run in
    a worker thread; ``loop="asyncio"`` runs an asyncio coroutine function
    through trio-asyncio.  Options (``retry``, per-attempt ``timeout``,
    ``schedule_to_close``, ``heartbeat_timeout``, ``task_queue``,
    ``fallback_queues``, ``advisory``, ``priority``: lower runs first when attempts wait
    for a flow-control slot) are defaults that a call to
    ``ctx.start``/``ctx.run`` may override; the engine's defaults fill the
    rest.  Without a retry policy an activity is attempted exactly once.
    Activities run at least once: make them idempotent.
    """

    layer = check_layer(
        explicit(
            retry=retry,
            timeout=timeout,
            schedule_to_close=schedule_to_close,
            heartbeat_timeout=heartbeat_timeout,
            task_queue=task_queue,
            fallback_queues=fallback_queues,
            advisory=advisory,
            priority=priority,
        ),
        "@activity",
    )

    def wrap(f: F) -> ActivityDefinition[F]:
        if not callable(f) or isinstance(f, (WorkflowDefinition, ActivityDefinition)):
            raise TypeError(
                f"@activity decorates a function, got {f!r}; options are keywords: @activity(name=..., retry=...)"
            )
        if loop is None:
            kind = ActivityLoop.TRIO if inspect.iscoroutinefunction(f) else ActivityLoop.THREAD
        else:
            try:
                kind = ActivityLoop(loop)
            except ValueError:
                raise ValueError(f"loop must be 'trio', 'thread' or 'asyncio', got {loop!r}") from None
        is_async = inspect.iscoroutinefunction(f)
        if kind in (ActivityLoop.TRIO, ActivityLoop.ASYNCIO) and not is_async:
            raise TypeError(f"activity {f.__qualname__}: loop={kind.value!r} needs an async def function")
        if kind is ActivityLoop.THREAD and is_async:
            raise TypeError(f"activity {f.__qualname__}: an async def function cannot run in a thread")
        definition: ActivityDefinition[F] = ActivityDefinition(
            name=_check_name(f.__qualname__ if name is None else name, "activity"),
            fn=f,
            loop=kind,
            options=layer,
        )
        return definition

    return wrap(fn) if fn is not None else wrap


def index_definitions(
    workflows: Iterable[WorkflowDefinition[Any]], activities: Iterable[ActivityDefinition[Any]]
) -> tuple[Mapping[str, WorkflowDefinition[Any]], Mapping[str, ActivityDefinition[Any]]]:
    wf: dict[str, WorkflowDefinition[Any]] = {}
    for w in workflows:
        if not isinstance(w, WorkflowDefinition):
            raise TypeError(f"workflows=[...] takes @aion_trio.workflow functions, got {w!r}")
        if w.name in wf and wf[w.name] is not w:
            raise ValueError(f"two workflows are registered under the name {w.name!r}")
        wf[w.name] = w
    act: dict[str, ActivityDefinition[Any]] = {}
    for a in activities:
        if not isinstance(a, ActivityDefinition):
            raise TypeError(f"activities=[...] takes @aion_trio.activity functions, got {a!r}")
        if a.name in act and act[a.name] is not a:
            raise ValueError(f"two activities are registered under the name {a.name!r}")
        act[a.name] = a
    return wf, act
