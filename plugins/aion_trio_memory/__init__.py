"""The in-memory store: the reference implementation of the store contract.

``memory://`` opens a fresh, private store.  ``memory://NAME`` opens a store
shared by every open of the same name in this process, and its data outlives
the handle: close it, open ``memory://NAME`` again and the histories are still
there (this is how tests restart an engine in-process).  :func:`forget` drops
a named store's data.

Every method awaits :func:`trio.lowlevel.checkpoint` before it touches state,
so every call is a cancel point and a schedule point, and a cancelled append
has written nothing.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncIterator, Sequence
from datetime import datetime, timezone
from typing import final

import attrs
import trio

from aion_trio import WorkflowStatus
from aion_trio.plugin import (
    Event,
    InvalidStoreUrl,
    SequenceConflict,
    StoreRegistry,
    TimerEntry,
    VisibilityFilter,
    VisibilityRow,
    hookimpl,
    is_active_status,
    status_after,
    validate_batch,
)

__all__ = ["MemoryEventStore", "MemoryStore", "MemoryVisibilityStore", "forget", "open_memory_store"]


@attrs.define(eq=False)
class _Data:
    histories: dict[str, list[Event]] = attrs.field(factory=dict)
    statuses: dict[str, WorkflowStatus | None] = attrs.field(factory=dict)
    timers: dict[tuple[str, str], datetime] = attrs.field(factory=dict)
    rows: dict[str, VisibilityRow] = attrs.field(factory=dict)


_named: dict[str, _Data] = {}
_named_lock = threading.Lock()


def forget(name: str) -> None:
    """Drop the data of the named store ``memory://NAME`` (no-op if absent)."""
    with _named_lock:
        _named.pop(name, None)


class _Closable:
    _closed: bool

    async def _enter(self) -> None:
        await trio.lowlevel.checkpoint()
        if self._closed:
            raise trio.ClosedResourceError(f"{type(self).__name__} is closed")


@final
@attrs.define(eq=False)
class MemoryEventStore(_Closable):
    _data: _Data = attrs.field(factory=_Data, alias="data")
    _closed: bool = attrs.field(default=False, init=False)

    async def append(self, workflow_id: str, events: Sequence[Event], expected_seq: int) -> None:
        await self._enter()
        validate_batch(workflow_id, events, expected_seq)
        history = self._data.histories.get(workflow_id, [])
        head = len(history)
        if head != expected_seq:
            raise SequenceConflict(workflow_id, expected_seq, head)
        self._data.histories[workflow_id] = [*history, *events]
        self._data.statuses[workflow_id] = status_after(self._data.statuses.get(workflow_id), events)

    async def read_history(self, workflow_id: str, from_seq: int = 1) -> list[Event]:
        await self._enter()
        history = self._data.histories.get(workflow_id, [])
        return list(history[max(from_seq, 1) - 1 :])

    async def list_active(self) -> list[str]:
        await self._enter()
        return sorted(w for w, s in self._data.statuses.items() if is_active_status(s))

    async def list_workflow_ids(self) -> list[str]:
        await self._enter()
        return sorted(self._data.histories)

    async def schedule_timer(self, workflow_id: str, timer_id: str, fire_at: datetime) -> None:
        await self._enter()
        if fire_at.tzinfo is None:
            raise ValueError("fire_at must be timezone-aware")
        # Returned as aware UTC whatever offset the caller used (contract).
        self._data.timers[(workflow_id, timer_id)] = fire_at.astimezone(timezone.utc)

    async def remove_timer(self, workflow_id: str, timer_id: str) -> None:
        await self._enter()
        self._data.timers.pop((workflow_id, timer_id), None)

    async def expired_timers(self, as_of: datetime) -> list[TimerEntry]:
        await self._enter()
        return sorted(
            TimerEntry(fire_at=at, workflow_id=w, timer_id=t)
            for (w, t), at in self._data.timers.items()
            if at <= as_of
        )

    async def aclose(self) -> None:
        self._closed = True
        await trio.lowlevel.checkpoint()


@final
@attrs.define(eq=False)
class MemoryVisibilityStore(_Closable):
    _data: _Data = attrs.field(factory=_Data, alias="data")
    _closed: bool = attrs.field(default=False, init=False)

    async def upsert(self, row: VisibilityRow) -> None:
        await self._enter()
        # Datetimes come back as aware UTC whatever offset the caller used (contract).
        close = row.close_time
        self._data.rows[row.workflow_id] = attrs.evolve(
            row,
            start_time=row.start_time.astimezone(timezone.utc),
            close_time=None if close is None else close.astimezone(timezone.utc),
        )

    async def get(self, workflow_id: str) -> VisibilityRow | None:
        await self._enter()
        return self._data.rows.get(workflow_id)

    async def list(self, filter: VisibilityFilter | None = None) -> list[VisibilityRow]:
        await self._enter()
        return (filter or VisibilityFilter()).apply(self._data.rows.values())

    async def count(self, filter: VisibilityFilter | None = None) -> int:
        await self._enter()
        f = filter or VisibilityFilter()
        return sum(1 for r in self._data.rows.values() if f.matches(r))

    async def aclose(self) -> None:
        self._closed = True
        await trio.lowlevel.checkpoint()


@final
@attrs.define(eq=False)
class MemoryStore:
    """An opened memory store: ``events`` and ``visibility`` over one data set."""

    events: MemoryEventStore
    visibility: MemoryVisibilityStore
    name: str | None = None

    @classmethod
    def fresh(cls) -> MemoryStore:
        data = _Data()
        return cls(events=MemoryEventStore(data=data), visibility=MemoryVisibilityStore(data=data))

    async def aclose(self) -> None:
        await self.events.aclose()
        await self.visibility.aclose()


def _parse(url: str) -> str | None:
    prefix = "memory://"
    if not url.lower().startswith(prefix):
        raise InvalidStoreUrl(f"{url!r} is not a memory:// URL")
    name = url[len(prefix) :]
    if "/" in name or "?" in name or "#" in name:
        raise InvalidStoreUrl(
            f"{url!r}: a memory store URL is memory:// (private) or memory://NAME (shared in "
            "this process); NAME may not contain '/', '?' or '#'"
        )
    return name or None


@contextlib.asynccontextmanager
async def open_memory_store(url: str = "memory://") -> AsyncIterator[MemoryStore]:
    name = _parse(url)
    if name is None:
        data = _Data()
    else:
        with _named_lock:
            data = _named.setdefault(name, _Data())
    store = MemoryStore(
        events=MemoryEventStore(data=data), visibility=MemoryVisibilityStore(data=data), name=name
    )
    try:
        yield store
    finally:
        with trio.CancelScope(shield=True):
            await store.aclose()


@hookimpl
def aion_trio_register_stores(registry: StoreRegistry) -> None:
    registry.add(
        "memory",
        open_memory_store,
        description="in-process memory (memory:// private, memory://NAME shared); nothing survives the process",
    )
