"""Writes that arrive together share one worker thread, one round trip and one commit.

Each store call costs a hand-off to a worker thread and back, a pooled
connection, a round trip and a commit, whatever it writes.  With many
workflows in flight their appends (and visibility upserts) queue for the
store's worker slots anyway: a :class:`BatchQueue` lets the first of them wait
for a slot on behalf of the queue (the *leader*), and whoever holds it when the
slot comes takes every write queued by then (up to ``most``, oldest first) and
writes them in one call.  The others wait for their own outcome.  An idle
store writes at once, alone: batching adds no wait, it only fills the waits
there already are.

Cancellation keeps the store's rule: a write cancelled before its batch was
taken raised ``trio.Cancelled`` and did nothing (and hands leadership on);
once taken it is written, and the call returns its outcome normally (the
cancellation arrives at the caller's next checkpoint).
"""

from __future__ import annotations

import collections
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar, final

import attrs
import trio

from aion_trio import AionInternalError

from ._codec import EncodedBatch


@attrs.define(eq=False, kw_only=True)
class Pending:
    """One write waiting in a queue, and then its outcome."""

    workflow_id: str
    taken: bool = False
    """In a batch being written: its outcome will come, whatever happens to the caller."""
    done: bool = False
    outcome: Any = None
    """What the call returns (not ``None``), or the exception it raises."""
    wake: trio.Event = attrs.field(factory=trio.Event)
    """Set when this write is done, or when its caller is to lead the queue."""


@final
@attrs.define(eq=False, kw_only=True)
class PendingAppend(Pending):
    """An append: its outcome is the epoch its events were written under."""

    expected_seq: int
    first_seq: int
    epoch: int | None
    """The fencing epoch this store held for the workflow when the append was called."""
    status: str | None
    encoded: EncodedBatch


@final
@attrs.define(eq=False, kw_only=True)
class PendingUpsert(Pending):
    """A visibility upsert (the row's parameters and its search rows): its outcome is ``True``."""

    params: tuple[Any, ...]
    search: list[Any]


P = TypeVar("P", bound=Pending)


@final
class BatchQueue(Generic[P]):
    """The writes of one kind waiting for a worker slot, written in batches (FIFO)."""

    def __init__(
        self,
        limiter: trio.CapacityLimiter,
        write: Callable[[list[P]], Awaitable[None]],
        most: int,
    ) -> None:
        self._limiter = limiter
        # Writes a batch, setting every item's outcome; it never raises.  Called holding a
        # slot of ``limiter``.
        self._write = write
        self._most = most
        self._queue: collections.deque[P] = collections.deque()
        # The item whose caller waits for a slot for the queue: always the oldest queued,
        # ``None`` exactly when the queue is empty.
        self._leader: P | None = None
        self.batches = 0
        """Batches written (statistics, tests)."""

    def queued(self) -> int:
        """Appends waiting for a batch (statistics, tests)."""
        return len(self._queue)

    async def submit(self, item: P) -> Any:
        """Queue ``item`` and return its outcome (or raise its error)."""
        self._queue.append(item)
        if self._leader is None:
            self._leader = item
        try:
            while not item.done:
                if self._leader is item:
                    async with self._limiter:
                        batch = self._take()
                        # Taken: written whatever happens to this caller.
                        with trio.CancelScope(shield=True):
                            await self._finish(batch)
                else:
                    await item.wake.wait()
                    item.wake = trio.Event()
        except trio.Cancelled:
            if not item.taken:
                self._queue.remove(item)
                if self._leader is item:
                    self._promote()
                raise
            with trio.CancelScope(shield=True):
                while not item.done:
                    await item.wake.wait()
                    item.wake = trio.Event()
        outcome = item.outcome
        if isinstance(outcome, Exception):
            raise outcome
        assert outcome is not None
        return outcome

    def _take(self) -> list[P]:
        queue = self._queue
        batch = [queue.popleft() for _ in range(min(self._most, len(queue)))]
        for item in batch:
            item.taken = True
        self._promote()
        return batch

    def _promote(self) -> None:
        """The oldest queued append's caller leads next (it waits for a slot)."""
        self._leader = self._queue[0] if self._queue else None
        if self._leader is not None:
            self._leader.wake.set()

    async def _finish(self, batch: list[P]) -> None:
        try:
            self.batches += 1
            await self._write(batch)
        finally:
            for item in batch:
                if item.outcome is None:  # pragma: no cover - the writer sets every outcome
                    item.outcome = AionInternalError(
                        f"write for {item.workflow_id!r}: the batch ended without its outcome; please report it"
                    )
                item.done = True
                item.wake.set()
