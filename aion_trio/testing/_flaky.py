"""Fault-injecting store wrappers for engine tests.

A wrapper passes every call to the store it wraps until a fault is armed.
Faults are armed per operation, counted in calls from now: ``fail_next(op,
n)`` faults the next ``n`` calls, ``fail_after(op, k, n)`` lets ``k`` calls
through and faults the ``n`` after them (a later arming wins where two
overlap).  An armed fault is consumed only when it is injected: a call
cancelled (or refused because the wrapper is closed) before its fault fires
leaves the fault armed for the next call.

Injected faults are raised after a Trio checkpoint, so a faulted call is
still a cancel point and a schedule point, like the real store's.  ``inner``
is the untouched wrapped store, for oracles: tests read the truth from it.
``aclose()`` closes the wrapper only; whoever opened the inner store closes
it, so it stays readable after an engine has closed the wrapper.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Generic, Literal, TypeVar, Union, final

import attrs
import trio

from .._errors import BackendUnavailable, SequenceConflict, WorkflowFenced
from .._events import Event
from .._store import EventStore, Store, TimerEntry, VisibilityFilter, VisibilityRow, VisibilityStore

ExceptionSpec = Union[BaseException, Callable[[], BaseException]]
"""An exception instance, or a zero-argument callable (an exception class works) making one."""

EVENT_OPERATIONS: tuple[str, ...] = (
    "append",
    "read_history",
    "list_active",
    "list_workflow_ids",
    "schedule_timer",
    "remove_timer",
    "expired_timers",
)
VISIBILITY_OPERATIONS: tuple[str, ...] = ("upsert", "get", "list", "count")

_FaultKind = Literal["raise", "conflict", "not_owner", "commit_then_fail"]


@attrs.frozen
class _Fault:
    kind: _FaultKind
    exc: ExceptionSpec | None = None


def _check_count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return value


def _check_exc(exc: object) -> ExceptionSpec | None:
    if exc is None or isinstance(exc, BaseException) or callable(exc):
        return exc
    raise TypeError(f"exc must be an exception instance or a callable returning one, got {exc!r}")


S = TypeVar("S")


class _Flaky(Generic[S]):
    """Shared fault plan, counters and close handling."""

    _OPERATIONS: tuple[str, ...] = ()

    def __init__(self, inner: S) -> None:
        self._inner = inner
        self._slots: dict[str, list[_Fault | None]] = {op: [] for op in self._OPERATIONS}
        self._calls: dict[str, int] = dict.fromkeys(self._OPERATIONS, 0)
        self._faults: dict[str, int] = dict.fromkeys(self._OPERATIONS, 0)
        self._closed = False

    @property
    def inner(self) -> S:
        """The wrapped store, untouched by fault injection (use it as the oracle)."""
        return self._inner

    @property
    def calls(self) -> Mapping[str, int]:
        """Calls per operation so far (faulted ones included), a snapshot."""
        return dict(self._calls)

    @property
    def faults(self) -> Mapping[str, int]:
        """Faults injected per operation so far, a snapshot."""
        return dict(self._faults)

    def pending_faults(self, operation: str | None = None) -> int:
        """How many armed faults have not been injected yet (for one operation, or all)."""
        ops = self._OPERATIONS if operation is None else (self._check_operation(operation),)
        return sum(1 for op in ops for slot in self._slots[op] if slot is not None)

    def disarm(self) -> None:
        """Forget every armed fault; counters are kept."""
        for slots in self._slots.values():
            slots.clear()

    def fail_next(self, operation: str, n: int = 1, exc: ExceptionSpec | None = None) -> None:
        """Make the next ``n`` calls of ``operation`` raise ``exc`` (default: ``BackendUnavailable``)."""
        self.fail_after(operation, 0, n, exc)

    def fail_after(self, operation: str, k: int, n: int = 1, exc: ExceptionSpec | None = None) -> None:
        """Let ``k`` calls of ``operation`` through, then make the ``n`` after them raise ``exc``."""
        self._arm(operation, k, n, _Fault("raise", _check_exc(exc)))

    def _check_operation(self, operation: str) -> str:
        if operation not in self._slots:
            raise ValueError(
                f"{type(self).__name__} cannot fault {operation!r}; operations: {', '.join(self._OPERATIONS)}"
            )
        return operation

    def _arm(self, operation: str, k: int, n: int, fault: _Fault) -> None:
        slots = self._slots[self._check_operation(operation)]
        k = _check_count("k", k)
        n = _check_count("n", n)
        if len(slots) < k + n:
            slots.extend([None] * (k + n - len(slots)))
        for index in range(k, k + n):
            slots[index] = fault

    async def _begin(self, operation: str) -> _Fault | None:
        """Count the call; return the fault to inject now (after a checkpoint), if any."""
        self._calls[operation] += 1
        if self._closed:
            await trio.lowlevel.checkpoint()
            raise trio.ClosedResourceError(f"{type(self).__name__} is closed")
        slots = self._slots[operation]
        fault = slots.pop(0) if slots else None
        if fault is None:
            return None
        try:
            await trio.lowlevel.checkpoint()
        except BaseException:
            slots.insert(0, fault)
            raise
        return fault

    def _injected(self, operation: str, fault: _Fault, default: str) -> BaseException:
        self._faults[operation] += 1
        if fault.exc is None:
            return BackendUnavailable(
                f"injected fault: {default} ({operation} call {self._calls[operation]})"
            )
        if isinstance(fault.exc, BaseException):
            return fault.exc
        made = fault.exc()
        if not isinstance(made, BaseException):
            raise TypeError(f"the exc factory for {operation} returned {made!r}, not an exception")
        return made

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._inner!r})"

    async def aclose(self) -> None:
        """Close the wrapper (idempotent); the inner store stays open."""
        self._closed = True
        await trio.lowlevel.checkpoint()


@final
class FlakyStore(_Flaky[EventStore]):
    """An :class:`~aion_trio.EventStore` wrapper that injects faults by operation and count.

    With nothing armed it behaves exactly like the wrapped store (and passes
    :func:`check_event_store`).  Operations: ``append``, ``read_history``,
    ``list_active``, ``list_workflow_ids``, ``schedule_timer``,
    ``remove_timer``, ``expired_timers``.  The default injected exception is
    ``BackendUnavailable("injected fault ...")``.  ``calls`` and ``faults``
    count per operation.  See the module notes for how arming counts calls.
    """

    _OPERATIONS = EVENT_OPERATIONS

    def fail_next_reads(self, n: int = 1, exc: ExceptionSpec | None = None) -> None:
        """The next ``n`` ``read_history`` calls raise ``exc`` (default ``BackendUnavailable``)."""
        self.fail_next("read_history", n, exc)

    def fail_reads_after(self, k: int, n: int = 1, exc: ExceptionSpec | None = None) -> None:
        """After ``k`` more successful ``read_history`` calls, the next ``n`` raise."""
        self.fail_after("read_history", k, n, exc)

    def fail_next_appends(self, n: int = 1, exc: ExceptionSpec | None = None) -> None:
        """The next ``n`` appends raise ``exc`` (default ``BackendUnavailable``) and write nothing."""
        self.fail_next("append", n, exc)

    def fail_appends_after(self, k: int, n: int = 1, exc: ExceptionSpec | None = None) -> None:
        """After ``k`` more appends pass through, the next ``n`` raise and write nothing."""
        self.fail_after("append", k, n, exc)

    def conflict_next_appends(self, n: int = 1) -> None:
        """The next ``n`` appends raise ``SequenceConflict`` carrying the real head; nothing is written."""
        self._arm("append", 0, n, _Fault("conflict"))

    def not_owner_next_appends(self, n: int = 1) -> None:
        """The next ``n`` appends raise ``WorkflowFenced`` (a ``NotOwner``; shard = the workflow id), as a
        cluster store does for a workflow another node claimed; nothing is written."""
        self._arm("append", 0, n, _Fault("not_owner"))

    def commit_then_fail_next_appends(self, n: int = 1, exc: ExceptionSpec | None = None) -> None:
        """The next ``n`` appends are committed to the inner store, then raise ``exc``.

        "The commit landed, the acknowledgement was lost": the default is
        ``BackendUnavailable``, whose outcome the contract calls unknown.  If
        the inner append itself fails (conflict, invalid batch, cancelled),
        that error propagates and the fault stays armed.
        """
        self.commit_then_fail_appends_after(0, n, exc)

    def commit_then_fail_appends_after(self, k: int, n: int = 1, exc: ExceptionSpec | None = None) -> None:
        """After ``k`` more appends pass through, the next ``n`` commit, then raise (as above)."""
        self._arm("append", k, n, _Fault("commit_then_fail", _check_exc(exc)))

    async def append(self, workflow_id: str, events: Sequence[Event], expected_seq: int) -> None:
        fault = await self._begin("append")
        if fault is None:
            return await self._inner.append(workflow_id, events, expected_seq)
        if fault.kind == "conflict":
            head = await self._head(workflow_id, expected_seq)
            self._faults["append"] += 1
            raise SequenceConflict(workflow_id, expected_seq, head)
        if fault.kind == "not_owner":
            self._faults["append"] += 1
            raise WorkflowFenced(workflow_id, "injected fault")
        if fault.kind == "commit_then_fail":
            try:
                await self._inner.append(workflow_id, events, expected_seq)
            except BaseException:
                self._slots["append"].insert(0, fault)
                raise
            raise self._injected("append", fault, "the append committed but its acknowledgement was lost")
        raise self._injected("append", fault, "append refused, nothing written")

    async def _head(self, workflow_id: str, expected_seq: int) -> int:
        tail = await self._inner.read_history(workflow_id, max(expected_seq, 1))
        if tail:
            return tail[-1].seq
        everything = await self._inner.read_history(workflow_id)
        return everything[-1].seq if everything else 0

    async def read_history(self, workflow_id: str, from_seq: int = 1) -> list[Event]:
        fault = await self._begin("read_history")
        if fault is not None:
            raise self._injected("read_history", fault, "read failed")
        return await self._inner.read_history(workflow_id, from_seq)

    async def list_active(self) -> list[str]:
        fault = await self._begin("list_active")
        if fault is not None:
            raise self._injected("list_active", fault, "read failed")
        return await self._inner.list_active()

    async def list_workflow_ids(self) -> list[str]:
        fault = await self._begin("list_workflow_ids")
        if fault is not None:
            raise self._injected("list_workflow_ids", fault, "read failed")
        return await self._inner.list_workflow_ids()

    async def schedule_timer(self, workflow_id: str, timer_id: str, fire_at: datetime) -> None:
        fault = await self._begin("schedule_timer")
        if fault is not None:
            raise self._injected("schedule_timer", fault, "timer not scheduled")
        await self._inner.schedule_timer(workflow_id, timer_id, fire_at)

    async def remove_timer(self, workflow_id: str, timer_id: str) -> None:
        fault = await self._begin("remove_timer")
        if fault is not None:
            raise self._injected("remove_timer", fault, "timer not removed")
        await self._inner.remove_timer(workflow_id, timer_id)

    async def expired_timers(self, as_of: datetime) -> list[TimerEntry]:
        fault = await self._begin("expired_timers")
        if fault is not None:
            raise self._injected("expired_timers", fault, "read failed")
        return await self._inner.expired_timers(as_of)


@final
class FlakyVisibilityStore(_Flaky[VisibilityStore]):
    """A :class:`~aion_trio.VisibilityStore` wrapper with ``fail_next``/``fail_after``.

    Operations: ``upsert``, ``get``, ``list``, ``count``.  Same rules as
    :class:`FlakyStore`.
    """

    _OPERATIONS = VISIBILITY_OPERATIONS

    async def upsert(self, row: VisibilityRow) -> None:
        fault = await self._begin("upsert")
        if fault is not None:
            raise self._injected("upsert", fault, "row not written")
        await self._inner.upsert(row)

    async def get(self, workflow_id: str) -> VisibilityRow | None:
        fault = await self._begin("get")
        if fault is not None:
            raise self._injected("get", fault, "read failed")
        return await self._inner.get(workflow_id)

    async def list(self, filter: VisibilityFilter | None = None) -> list[VisibilityRow]:
        fault = await self._begin("list")
        if fault is not None:
            raise self._injected("list", fault, "read failed")
        return await self._inner.list(filter)

    async def count(self, filter: VisibilityFilter | None = None) -> int:
        fault = await self._begin("count")
        if fault is not None:
            raise self._injected("count", fault, "read failed")
        return await self._inner.count(filter)


@final
class FlakyStoreBundle:
    """A :class:`~aion_trio.Store` whose ``events`` and ``visibility`` are flaky wrappers.

    Hand it to code that takes an opened store; arm faults on ``.events``
    (a :class:`FlakyStore`) or ``.visibility`` (a
    :class:`FlakyVisibilityStore`); read the truth from ``.inner``.
    ``aclose()`` closes the wrappers, not the inner store.
    """

    def __init__(self, inner: Store) -> None:
        self._inner = inner
        self._events = FlakyStore(inner.events)
        self._visibility = FlakyVisibilityStore(inner.visibility)

    @property
    def inner(self) -> Store:
        """The wrapped store bundle, untouched by fault injection (use it as the oracle)."""
        return self._inner

    @property
    def events(self) -> FlakyStore:
        return self._events

    @property
    def visibility(self) -> FlakyVisibilityStore:
        return self._visibility

    async def aclose(self) -> None:
        await self._events.aclose()
        await self._visibility.aclose()

    def __repr__(self) -> str:
        return f"FlakyStoreBundle({self._inner!r})"
