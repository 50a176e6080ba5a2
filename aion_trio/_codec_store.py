"""The codec chain at the store boundary: events encoded on append, decoded on read.

:class:`CodecEventStore` wraps an :class:`~aion_trio.EventStore`; the engine
builds one over its store when ``EngineConfig.codecs`` is set, and the command
line does over the store it reads when ``--codec`` is given.  Everything above
it (the recorder, replay, workflow code) sees plain payloads.  Without a chain
nothing is wrapped: the store's events (and their lazily decoded payload text)
reach the engine untouched.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from typing import Any, final

from ._codecs import CodecChain
from ._events import Event
from ._store import EventStore, Store, TimerEntry, VisibilityStore

#: A store's ``BulkHistoryReads.read_histories``.
BulkRead = Callable[[Sequence[str]], Awaitable[dict[str, list[Event]]]]


def decoding_bulk_reads(read: BulkRead, chain: CodecChain) -> BulkRead:
    """``read`` (a store's ``read_histories``) with every event decoded through ``chain``,
    as :meth:`CodecEventStore.read_history` decodes one history."""

    async def read_histories(workflow_ids: Sequence[str]) -> dict[str, list[Event]]:
        decoded: dict[str, list[Event]] = {}
        for workflow_id, stored in (await read(workflow_ids)).items():
            decoded[workflow_id] = [await chain.decode_event(event) for event in stored]
        return decoded

    return read_histories


@final
class CodecEventStore:
    """An event store whose payloads pass through ``chain`` on their way in and out.

    ``gate(workflow_id)``, when given, is called after the events are encoded and
    immediately before the inner append: an ``async`` codec awaits, and the
    engine's epoch may close meanwhile (its append gate must stay the last check
    before the write).  Cancellation while encoding writes nothing.
    """

    def __init__(
        self, inner: EventStore, chain: CodecChain, *, gate: Callable[[str], None] | None = None
    ) -> None:
        self._inner = inner
        self._chain = chain
        self._gate = gate

    def __getattr__(self, name: str) -> Any:
        # Methods beyond the protocol (a store's own extras) pass through.
        return getattr(self._inner, name)

    @property
    def chain(self) -> CodecChain:
        return self._chain

    async def append(self, workflow_id: str, events: Sequence[Event], expected_seq: int) -> None:
        encoded = [await self._chain.encode_event(event) for event in events]
        if self._gate is not None:
            self._gate(workflow_id)
        await self._inner.append(workflow_id, encoded, expected_seq)

    async def read_history(self, workflow_id: str, from_seq: int = 1) -> list[Event]:
        stored = await self._inner.read_history(workflow_id, from_seq)
        return [await self._chain.decode_event(event) for event in stored]

    async def list_active(self) -> list[str]:
        return await self._inner.list_active()

    async def list_workflow_ids(self) -> list[str]:
        return await self._inner.list_workflow_ids()

    async def schedule_timer(self, workflow_id: str, timer_id: str, fire_at: datetime) -> None:
        await self._inner.schedule_timer(workflow_id, timer_id, fire_at)

    async def remove_timer(self, workflow_id: str, timer_id: str) -> None:
        await self._inner.remove_timer(workflow_id, timer_id)

    async def expired_timers(self, as_of: datetime) -> list[TimerEntry]:
        return await self._inner.expired_timers(as_of)

    async def aclose(self) -> None:
        await self._inner.aclose()


@final
class CodecStoreView:
    """A store seen through a codec chain (for readers such as the command line):
    ``events`` decodes; every other attribute is the store's own."""

    def __init__(self, inner: Store, chain: CodecChain) -> None:
        self._inner = inner
        self._events = CodecEventStore(inner.events, chain)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @property
    def events(self) -> EventStore:
        return self._events

    @property
    def visibility(self) -> VisibilityStore:
        return self._inner.visibility

    async def aclose(self) -> None:
        await self._inner.aclose()
