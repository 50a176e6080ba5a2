"""The scenario machinery the suites' test methods run on.

A scenario is an async function taking a :class:`ScenarioContext`.  It opens
one fresh store through the author's factory, drives it, and reports a
contract violation with :meth:`ScenarioContext.fail` (or one of the
``expect_*`` helpers), which raises :class:`ConformanceError` naming the
scenario and what was observed versus expected.
"""

from __future__ import annotations

import contextlib
import reprlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Literal, NoReturn, cast, final

import attrs
import trio
import trio.testing

OpenStore = Callable[[], AbstractAsyncContextManager[Any]]
"""A zero-argument callable returning an async context manager that yields a fresh store."""

Kind = Literal["event", "visibility", "owner", "inbox", "recoveries", "schedules", "flow", "histories"]

OpenKeyedStore = Callable[[str], AbstractAsyncContextManager[Any]]
"""A one-argument callable: ``open_store(key)`` returns an async context manager yielding a
store; the same key opens the same store again (a second handle, or a reopen after
close), a new key a fresh, empty one."""

_EVENT_METHODS = (
    "append",
    "read_history",
    "list_active",
    "list_workflow_ids",
    "schedule_timer",
    "remove_timer",
    "expired_timers",
    "aclose",
)
_VISIBILITY_METHODS = ("upsert", "get", "list", "count", "aclose")
_OWNER_METHODS = ("claim_owner", "renew_owner", "release_owner", "current_owner")
_INBOX_METHODS = ("enqueue_command", "pending_commands", "ack_command", "command_outcome")
_RECOVERY_METHODS = ("count_recoveries", "clear_recoveries", "recovery_counts")
_SCHEDULE_METHODS = (
    "create_schedule",
    "read_schedule",
    "list_schedules",
    "write_schedule",
    "delete_schedule",
)
_FLOW_METHODS = (
    "acquire_flow_permit",
    "release_flow_permit",
    "renew_flow_permits",
    "held_flow_permits",
    "enqueue_flow_run",
    "admit_flow_runs",
    "flow_runs",
    "finish_flow_run",
)
_HISTORIES_METHODS = ("read_histories",)
_METHODS: dict[str, tuple[str, ...]] = {
    "event": _EVENT_METHODS,
    "visibility": _VISIBILITY_METHODS,
    "owner": _OWNER_METHODS,
    "inbox": _INBOX_METHODS,
    "recoveries": _RECOVERY_METHODS,
    "schedules": _SCHEDULE_METHODS,
    "flow": _FLOW_METHODS,
    "histories": _HISTORIES_METHODS,
}

_repr = reprlib.Repr()
_repr.maxstring = 120
_repr.maxother = 400
_repr.maxlist = 8
_repr.maxtuple = 8
_repr.maxdict = 8
_repr.maxlevel = 4


def short(value: object) -> str:
    """A bounded repr for error messages."""
    text = repr(value)
    if len(text) <= 400:
        return text
    return _repr.repr(value)


class ConformanceError(AssertionError):
    """A store broke the contract in one conformance scenario.

    ``scenario`` is the scenario's name (one of :data:`EVENT_STORE_SCENARIOS`,
    :data:`VISIBILITY_STORE_SCENARIOS`, ...); ``detail`` says what was observed
    and what the contract expects.  When the store raised something
    unexpected, that exception is the ``__cause__``.
    """

    def __init__(self, scenario: str, detail: str) -> None:
        self.scenario = scenario
        self.detail = detail
        super().__init__(f"store conformance scenario {scenario!r} failed: {detail}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.scenario, self.detail))


def _unwrap_store(kind: Kind, obj: object) -> Any:
    """Accept the store itself or a ``Store`` bundle (``.events`` / ``.visibility``)."""
    methods = _METHODS[kind]
    if all(callable(getattr(obj, m, None)) for m in methods):
        return obj
    if kind in ("owner", "inbox", "recoveries", "schedules", "flow", "histories"):
        missing = [m for m in methods if not callable(getattr(obj, m, None))]
        protocol = {
            "owner": "an OwnedStore",
            "inbox": "a CommandInbox",
            "schedules": "a ScheduleStore",
            "flow": "a FlowStore",
            "histories": "a BulkHistoryReads store",
        }.get(kind, "a RecoveryCounts store")
        raise TypeError(
            f"open_store(key) yielded {short(obj)}, which is not {protocol} (it lacks {', '.join(missing)})"
        )
    attr = "events" if kind == "event" else "visibility"
    inner = getattr(obj, attr, None)
    if inner is not None and all(callable(getattr(inner, m, None)) for m in methods):
        return inner
    missing = [m for m in methods if not callable(getattr(obj, m, None))]
    protocol = "an EventStore" if kind == "event" else "a VisibilityStore"
    raise TypeError(
        f"open_store() yielded {short(obj)}, which is neither {protocol} (it lacks "
        f"{', '.join(missing)}) nor a Store bundle whose .{attr} is one"
    )


@final
class ScenarioContext:
    """What a scenario gets: a way to open its store and to report violations."""

    def __init__(
        self, name: str, kind: Kind, open_store: Callable[..., AbstractAsyncContextManager[Any]]
    ) -> None:
        self.name = name
        self._kind = kind
        self._open_store = open_store
        self._prefix = f"{name}-{uuid.uuid4().hex[:12]}"

    @contextlib.asynccontextmanager
    async def open(self, key: str = "main") -> AsyncIterator[Any]:
        """Open one fresh store through the author's factory (bundles are unwrapped).

        For the keyed kinds (ownership, inbox, recoveries, schedules, histories), the same ``key`` opens the same
        store again within one scenario run.
        """
        try:
            if self._kind in ("owner", "inbox", "recoveries", "schedules", "flow", "histories"):
                manager = self._open_store(f"{self._prefix}-{key}")
            else:
                manager = self._open_store()
        except Exception as exc:
            raise ConformanceError(self.name, f"open_store() raised {type(exc).__name__}: {exc}") from exc
        if not hasattr(manager, "__aenter__"):
            raise ConformanceError(
                self.name,
                f"open_store() returned {short(manager)}, not an async context manager; it must be "
                "a zero-argument callable such as an @asynccontextmanager function",
            )
        async with manager as obj:
            try:
                store = _unwrap_store(self._kind, obj)
            except TypeError as exc:
                raise ConformanceError(self.name, str(exc)) from None
            yield store

    def fail(self, detail: str) -> NoReturn:
        raise ConformanceError(self.name, detail)

    def expect(self, condition: bool, detail: str) -> None:
        if not condition:
            self.fail(detail)

    def expect_equal(self, observed: object, expected: object, what: str) -> None:
        """Fail with ``what: observed ..., expected ...`` unless equal (and, for sequences, item by item)."""
        if strict_equal(observed, expected):
            return
        self.fail(f"{what}: {describe_difference(observed, expected)}")

    async def expect_checkpoint(
        self,
        what: str,
        call: Callable[[], Awaitable[object]],
        *,
        raises: type[BaseException] | None = None,
    ) -> None:
        """``await call()`` must be a cancel point and a schedule point (and raise ``raises`` if given)."""
        try:
            with trio.testing.assert_checkpoints():
                # assert_checkpoints checks nothing when its block raises, so
                # the expected error is caught inside the block.
                try:
                    await call()
                except Exception as exc:
                    if raises is None or not isinstance(exc, raises):
                        want = "it to succeed" if raises is None else raises.__name__
                        raise ConformanceError(
                            self.name, f"{what}: raised {type(exc).__name__}: {exc}, expected {want}"
                        ) from exc
                else:
                    if raises is not None:
                        self.fail(f"{what}: returned normally, expected {raises.__name__}")
        except AssertionError as exc:
            if isinstance(exc, ConformanceError):
                raise
            self.fail(f"{what} is not a Trio checkpoint (it must be a cancel point and a schedule point)")

    def expect_raises(self, exc_type: type[BaseException], what: str) -> _Raises:
        """Context manager: the block must raise ``exc_type``; the exception is on ``.value``."""
        return _Raises(self, exc_type, what)


def strict_equal(observed: object, expected: object) -> bool:
    """``==``, except that numbers must also keep their type all the way down.

    ``1 == True == 1.0`` in Python, but a store that hands back ``1`` for a
    stored ``True`` (or ``2.0`` for ``2``) changed the data.
    """
    return first_difference(observed, expected) is None


def first_difference(observed: object, expected: object, path: str = "") -> tuple[str, object, object] | None:
    """``(path, observed_part, expected_part)`` of the first strict difference, or ``None``."""
    if isinstance(expected, (bool, int, float)) or isinstance(observed, (bool, int, float)):
        same = type(observed) is type(expected) and observed == expected
        return None if same else (path, observed, expected)
    if attrs.has(type(expected)) and type(observed) is type(expected):
        for field in attrs.fields(cast(Any, type(expected))):
            found = first_difference(
                getattr(observed, field.name), getattr(expected, field.name), f"{path}.{field.name}"
            )
            if found is not None:
                return found
        return None
    if isinstance(expected, Mapping) and isinstance(observed, Mapping):
        if set(observed) != set(expected):
            return (f"{path} keys", sorted(observed, key=repr), sorted(expected, key=repr))
        for key, value in expected.items():
            found = first_difference(observed[key], value, f"{path}[{key!r}]")
            if found is not None:
                return found
        return None
    if isinstance(expected, (list, tuple)) and isinstance(observed, (list, tuple)):
        for index, (o, e) in enumerate(zip(observed, expected, strict=False)):
            found = first_difference(o, e, f"{path}[{index}]")
            if found is not None:
                return found
        if len(observed) != len(expected):
            return (f"{path} length", len(observed), len(expected))
        return None
    return None if observed == expected else (path, observed, expected)


def describe_difference(observed: object, expected: object) -> str:
    found = first_difference(observed, expected)
    if found is None:
        return f"observed {short(observed)}, expected the same"
    path, o, e = found
    if type(o) is not type(e) and o == e:
        detail = f"observed {short(o)} ({type(o).__name__}), expected {short(e)} ({type(e).__name__})"
    else:
        detail = f"observed {short(o)}, expected {short(e)}"
    where = path.lstrip(".")
    if isinstance(observed, (list, tuple)) and isinstance(expected, (list, tuple)):
        sizes = f"{len(observed)} items, expected {len(expected)}"
        if where.endswith("length") and where.count("[") == 0:
            return f"observed {sizes}"
        return f"observed {sizes}; first difference at {where}: {detail}"
    return f"at {where}: {detail}" if where else detail


@final
class _Raises:
    def __init__(self, ctx: ScenarioContext, exc_type: type[BaseException], what: str) -> None:
        self._ctx = ctx
        self._exc_type = exc_type
        self._what = what
        self.value: Any = None

    def __enter__(self) -> _Raises:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> bool:
        want = self._exc_type.__name__
        if exc is None:
            self._ctx.fail(f"{self._what}: returned normally, expected it to raise {want}")
        if isinstance(exc, self._exc_type):
            self.value = exc
            return True
        if isinstance(exc, Exception):
            raise ConformanceError(
                self._ctx.name,
                f"{self._what}: raised {type(exc).__name__}: {exc}, expected {want}",
            ) from exc
        return False


def _leaves(exc: BaseException) -> list[BaseException]:
    # Duck-typed so Python 3.10 needs no exceptiongroup import here.
    subs = getattr(exc, "exceptions", None)
    if isinstance(subs, tuple) and all(isinstance(sub, BaseException) for sub in subs):
        out: list[BaseException] = []
        for sub in subs:
            out.extend(_leaves(sub))
        return out
    return [exc]


Scenario = Callable[[ScenarioContext], Awaitable[None]]
"""A scenario: an async function of its :class:`ScenarioContext`, named after what it checks."""


async def run_scenario(
    kind: Kind, scenario: Scenario, open_store: Callable[..., AbstractAsyncContextManager[Any]]
) -> None:
    """Run one scenario against the author's factory; a contract violation is a :class:`ConformanceError`."""
    __tracebackhide__ = True
    name = scenario.__name__
    ctx = ScenarioContext(name, kind, open_store)
    try:
        await scenario(ctx)
    except ConformanceError:
        raise
    except Exception as exc:
        leaves = _leaves(exc)
        conformance = [leaf for leaf in leaves if isinstance(leaf, ConformanceError)]
        if conformance:
            raise conformance[0] from exc
        text = "; ".join(f"{type(leaf).__name__}: {leaf}" for leaf in leaves)
        raise ConformanceError(name, f"the store raised an unexpected exception: {text}") from exc


def select(known: Sequence[str], names: Iterable[str] | None, what: str) -> list[str]:
    """``names`` (all ``known`` ones by default), checked against ``known``."""
    if names is None:
        return list(known)
    if isinstance(names, str):
        raise TypeError(f"scenarios must be a collection of names, not the single string {names!r}")
    chosen = list(names)
    unknown = [n for n in chosen if n not in known]
    if unknown:
        raise ValueError(
            f"unknown {what} scenario(s) {', '.join(map(repr, unknown))}; known: {', '.join(known)}"
        )
    return chosen
