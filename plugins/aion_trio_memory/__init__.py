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
from datetime import datetime, timedelta, timezone
from typing import final

import attrs
import trio

from aion_trio import WorkflowStatus
from aion_trio.plugin import (
    ADMITTED,
    Command,
    CommandOutcome,
    Event,
    FlowGrant,
    FlowWaiter,
    InvalidStoreUrl,
    NotFound,
    OwnerClaim,
    OwnerIdentity,
    PendingCommand,
    QueuedRun,
    ScheduleAlreadyExists,
    ScheduleConflict,
    SequenceConflict,
    StoredSchedule,
    StoreRegistry,
    TimerEntry,
    VisibilityFilter,
    VisibilityRow,
    command_data_json,
    command_from_data_json,
    decide_claim,
    decide_renew,
    hookimpl,
    is_active_status,
    rate_window,
    redact_url,
    status_after,
    validate_batch,
    validate_flow_key,
    validate_flow_waiter,
    validate_schedule_write,
    validate_workflow_ids,
)

__all__ = ["MemoryEventStore", "MemoryStore", "MemoryVisibilityStore", "forget", "open_memory_store"]


@attrs.define(eq=False)
class _Data:
    #: Each history is one list, appended to in place; never handed out (readers get copies).
    histories: dict[str, list[Event]] = attrs.field(factory=dict)
    statuses: dict[str, WorkflowStatus | None] = attrs.field(factory=dict)
    timers: dict[tuple[str, str], datetime] = attrs.field(factory=dict)
    rows: dict[str, VisibilityRow] = attrs.field(factory=dict)
    # Ownership and the inbox.  The lock makes claim's read-decide-write one
    # step even when several Trio runs (threads) share a named store.
    lock: threading.Lock = attrs.field(factory=threading.Lock)
    owner: OwnerClaim | None = None
    # command_id -> [(type, data json) as stored, outcome or None]
    commands: dict[int, tuple[tuple[str, str], CommandOutcome | None]] = attrs.field(factory=dict)
    last_command_id: int = 0
    # request id -> command_id: a command queued again under its request id is not added
    command_requests: dict[str, int] = attrs.field(factory=dict)
    # workflow id -> recoveries begun and not finished (RecoveryCounts)
    recoveries: dict[str, int] = attrs.field(factory=dict)
    # schedule id -> (version, data json) (ScheduleStore)
    schedules: dict[str, tuple[int, str]] = attrs.field(factory=dict)
    # FlowStore: key -> {permit id: (holder, expires_at)}; key -> start times, oldest first;
    # queue -> {workflow id: entry}
    permits: dict[str, dict[str, tuple[str, datetime]]] = attrs.field(factory=dict)
    starts: dict[str, list[datetime]] = attrs.field(factory=dict)
    last_permit: int = 0
    flow_runs: dict[str, dict[str, QueuedRun]] = attrs.field(factory=dict)
    last_flow_seq: int = 0
    # (workflow id, run id, activity id) -> the attempt waiting for a slot
    waiters: dict[tuple[str, str, int], FlowWaiter] = attrs.field(factory=dict)


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
    """The memory store's ``EventStore``: histories, timers, and the optional capabilities (ownership, inbox,
    recovery counts, schedules).
    """

    _data: _Data = attrs.field(factory=_Data, alias="data")
    _closed: bool = attrs.field(default=False, init=False)

    async def append(self, workflow_id: str, events: Sequence[Event], expected_seq: int) -> None:
        await self._enter()
        validate_batch(workflow_id, events, expected_seq)
        history = self._data.histories.get(workflow_id)
        head = 0 if history is None else len(history)
        if head != expected_seq:
            raise SequenceConflict(workflow_id, expected_seq, head)
        # Extended in place (amortised O(1) per event, not a copy of the whole history):
        # no reader holds this list, read_history hands out copies of its slices.
        if history is None:
            self._data.histories[workflow_id] = list(events)
        else:
            history.extend(events)
        self._data.statuses[workflow_id] = status_after(self._data.statuses.get(workflow_id), events)

    async def read_history(self, workflow_id: str, from_seq: int = 1) -> list[Event]:
        await self._enter()
        history = self._data.histories.get(workflow_id)
        # A slice is a new list: later appends never show through it.
        return [] if history is None else history[max(from_seq, 1) - 1 :]

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
    """The memory store's ``VisibilityStore``: one row per workflow, filtered and counted in memory."""

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
    """An opened memory store: ``events`` and ``visibility`` over one data set.

    It also has the optional capabilities :class:`~aion_trio.OwnedStore`,
    :class:`~aion_trio.CommandInbox` and :class:`~aion_trio.RecoveryCounts` (the
    reference semantics): they live with the data, so a named store keeps them
    across opens.
    """

    events: MemoryEventStore
    visibility: MemoryVisibilityStore
    name: str | None = None

    @classmethod
    def fresh(cls) -> MemoryStore:
        """A new private store (as ``memory://`` opens), without the context manager."""
        data = _Data()
        return cls(events=MemoryEventStore(data=data), visibility=MemoryVisibilityStore(data=data))

    @property
    def _data(self) -> _Data:
        return self.events._data

    async def _enter(self) -> None:
        await self.events._enter()

    # -- ownership ---------------------------------------------------------

    async def claim_owner(
        self, identity: OwnerIdentity, *, now: datetime, stale_after: timedelta
    ) -> OwnerClaim:
        await self._enter()
        if not isinstance(identity, OwnerIdentity):
            raise TypeError(f"claim_owner needs an OwnerIdentity, got {identity!r}")
        data = self._data
        with data.lock:
            claim = decide_claim(
                data.owner, identity, now=now, stale_after=stale_after, location=self._where()
            )
            data.owner = attrs.evolve(claim, replaced=None)
        return claim

    async def renew_owner(self, claim: OwnerClaim, *, now: datetime) -> OwnerClaim:
        await self._enter()
        return self.renew_owner_blocking(claim, now=now)

    def renew_owner_blocking(self, claim: OwnerClaim, *, now: datetime) -> OwnerClaim:
        """:meth:`renew_owner` from any thread (:class:`~aion_trio.plugin.ThreadRenewal`)."""
        data = self._data
        with data.lock:
            renewed = decide_renew(data.owner, claim, now=now)
            data.owner = renewed
        return renewed

    async def release_owner(self, claim: OwnerClaim) -> None:
        await self._enter()
        data = self._data
        with data.lock:
            if data.owner is not None and data.owner.identity.token == claim.identity.token:
                data.owner = None

    async def current_owner(self) -> OwnerClaim | None:
        await self._enter()
        return self._data.owner

    def _where(self) -> str:
        return f"memory://{self.name}" if self.name else "memory://"

    # -- the command inbox -------------------------------------------------

    async def enqueue_command(self, command: Command) -> int:
        await self._enter()
        # Kept in wire form, as a durable store would: what comes back is decoded anew.
        stored = command_data_json(command)
        data = self._data
        with data.lock:
            if command.request_id is not None and command.request_id in data.command_requests:
                return data.command_requests[command.request_id]
            data.last_command_id += 1
            data.commands[data.last_command_id] = (stored, None)
            if command.request_id is not None:
                data.command_requests[command.request_id] = data.last_command_id
            return data.last_command_id

    async def pending_commands(self, limit: int = 100) -> list[PendingCommand]:
        await self._enter()
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"limit must be an int >= 1, got {limit!r}")
        data = self._data
        with data.lock:
            waiting = [
                (cid, stored) for cid, (stored, outcome) in sorted(data.commands.items()) if outcome is None
            ]
        return [
            PendingCommand(command_id=cid, command=command_from_data_json(*stored))
            for cid, stored in waiting[:limit]
        ]

    async def ack_command(self, command_id: int, outcome: CommandOutcome) -> None:
        await self._enter()
        if not isinstance(outcome, CommandOutcome):
            raise TypeError(f"ack_command needs a CommandOutcome, got {outcome!r}")
        data = self._data
        with data.lock:
            found = data.commands.get(command_id)
            if found is None:
                raise NotFound(f"no inbox command #{command_id} in {self._where()}")
            stored, previous = found
            if previous is None:
                data.commands[command_id] = (stored, outcome)

    async def command_outcome(self, command_id: int) -> CommandOutcome | None:
        await self._enter()
        found = self._data.commands.get(command_id)
        if found is None:
            raise NotFound(f"no inbox command #{command_id} in {self._where()}")
        return found[1]

    # -- bulk history reads (BulkHistoryReads) --------------------------------

    async def read_histories(self, workflow_ids: Sequence[str]) -> dict[str, list[Event]]:
        await self._enter()
        ids = validate_workflow_ids(workflow_ids)
        histories = self._data.histories
        # Slices are new lists: later appends never show through them.
        return {workflow_id: list(histories.get(workflow_id, ())) for workflow_id in ids}

    # -- recovery counts -----------------------------------------------------

    async def count_recoveries(self, workflow_ids: Sequence[str]) -> dict[str, int]:
        await self._enter()
        ids = validate_workflow_ids(workflow_ids)
        data = self._data
        with data.lock:
            for workflow_id in ids:
                data.recoveries[workflow_id] = data.recoveries.get(workflow_id, 0) + 1
            return {workflow_id: data.recoveries[workflow_id] for workflow_id in ids}

    async def clear_recoveries(self, workflow_ids: Sequence[str]) -> None:
        await self._enter()
        ids = validate_workflow_ids(workflow_ids)
        data = self._data
        with data.lock:
            for workflow_id in ids:
                data.recoveries.pop(workflow_id, None)

    async def recovery_counts(self) -> dict[str, int]:
        await self._enter()
        with self._data.lock:
            return dict(self._data.recoveries)

    # -- schedules (ScheduleStore) -------------------------------------------

    async def create_schedule(self, schedule_id: str, data: str) -> StoredSchedule:
        await self._enter()
        validate_schedule_write(schedule_id, data)
        with self._data.lock:
            if schedule_id in self._data.schedules:
                raise ScheduleAlreadyExists(schedule_id)
            self._data.schedules[schedule_id] = (1, data)
        return StoredSchedule(schedule_id=schedule_id, version=1, data=data)

    async def read_schedule(self, schedule_id: str) -> StoredSchedule | None:
        await self._enter()
        found = self._data.schedules.get(schedule_id)
        return (
            None
            if found is None
            else StoredSchedule(schedule_id=schedule_id, version=found[0], data=found[1])
        )

    async def list_schedules(self) -> list[StoredSchedule]:
        await self._enter()
        with self._data.lock:
            items = sorted(self._data.schedules.items())
        return [StoredSchedule(schedule_id=sid, version=v, data=d) for sid, (v, d) in items]

    async def write_schedule(self, schedule_id: str, data: str, expected_version: int) -> StoredSchedule:
        await self._enter()
        validate_schedule_write(schedule_id, data, expected_version)
        with self._data.lock:
            found = self._data.schedules.get(schedule_id)
            version = 0 if found is None else found[0]
            if version != expected_version:
                raise ScheduleConflict(schedule_id, expected_version, version)
            self._data.schedules[schedule_id] = (version + 1, data)
        return StoredSchedule(schedule_id=schedule_id, version=version + 1, data=data)

    async def delete_schedule(self, schedule_id: str) -> bool:
        await self._enter()
        with self._data.lock:
            return self._data.schedules.pop(schedule_id, None) is not None

    # -- flow control (FlowStore) --------------------------------------------

    def _prune(
        self, key: str, period: float | None, now: datetime
    ) -> tuple[dict[str, tuple[str, datetime]], list[datetime]]:
        permits = self._data.permits.setdefault(key, {})
        for permit_id in [p for p, (_, expires) in permits.items() if expires <= now]:
            del permits[permit_id]
        starts = self._data.starts.setdefault(key, [])
        if period is not None:
            edge = now - timedelta(seconds=period)
            starts[:] = [t for t in starts if t > edge]
        return permits, starts

    async def acquire_flow_permit(
        self,
        key: str,
        *,
        holder: str,
        concurrency: int | None,
        rate: int | None,
        period: float,
        ttl: float,
        now: datetime,
    ) -> FlowGrant:
        await self._enter()
        validate_flow_key(key)
        validate_flow_key(holder, "holder")
        with self._data.lock:
            permits, starts = self._prune(key, period, now)
            if concurrency is not None and len(permits) >= concurrency:
                return FlowGrant(granted=False)
            wait = rate_window(starts, rate, period, now)
            if wait is not None:
                return FlowGrant(granted=False, retry_after=wait)
            if rate is not None:
                starts.append(now)
            if concurrency is None:
                return FlowGrant(granted=True)
            self._data.last_permit += 1
            permit_id = str(self._data.last_permit)
            permits[permit_id] = (holder, now + timedelta(seconds=ttl))
        return FlowGrant(granted=True, permit_id=permit_id)

    async def release_flow_permit(self, key: str, permit_id: str) -> bool:
        await self._enter()
        with self._data.lock:
            return self._data.permits.get(key, {}).pop(permit_id, None) is not None

    async def renew_flow_permits(self, holder: str, *, ttl: float, now: datetime) -> int:
        await self._enter()
        count = 0
        with self._data.lock:
            for permits in self._data.permits.values():
                for permit_id, (owner, expires) in list(permits.items()):
                    if owner == holder and expires > now:
                        permits[permit_id] = (owner, now + timedelta(seconds=ttl))
                        count += 1
            waiters = self._data.waiters
            for key, waiter in list(waiters.items()):
                if waiter.holder == holder and waiter.expires_at is not None and waiter.expires_at > now:
                    waiters[key] = attrs.evolve(waiter, expires_at=now + timedelta(seconds=ttl))
                    count += 1
        return count

    async def record_flow_waiter(self, waiter: FlowWaiter, *, ttl: float, now: datetime) -> None:
        await self._enter()
        validate_flow_waiter(waiter)
        with self._data.lock:
            key = (waiter.workflow_id, waiter.run_id, waiter.activity_id)
            self._data.waiters[key] = attrs.evolve(waiter, expires_at=now + timedelta(seconds=ttl))

    async def remove_flow_waiter(self, workflow_id: str, run_id: str, activity_id: int) -> bool:
        await self._enter()
        with self._data.lock:
            return self._data.waiters.pop((workflow_id, run_id, activity_id), None) is not None

    async def flow_waiters(self, workflow_id: str, *, now: datetime) -> list[FlowWaiter]:
        await self._enter()
        with self._data.lock:
            found = [
                w
                for (wid, _, _), w in self._data.waiters.items()
                if wid == workflow_id and w.expires_at is not None and w.expires_at > now
            ]
        return sorted(found, key=lambda w: (w.run_id, w.activity_id))

    async def clear_flow_waiters(self) -> int:
        await self._enter()
        with self._data.lock:
            count = len(self._data.waiters)
            self._data.waiters.clear()
        return count

    async def held_flow_permits(self, key: str, *, now: datetime) -> int:
        await self._enter()
        with self._data.lock:
            return sum(1 for _, expires in self._data.permits.get(key, {}).values() if expires > now)

    async def enqueue_flow_run(self, run: QueuedRun) -> tuple[QueuedRun, bool]:
        await self._enter()
        validate_flow_key(run.queue, "queue")
        validate_flow_key(run.workflow_id, "workflow id")
        with self._data.lock:
            entries = self._data.flow_runs.setdefault(run.queue, {})
            for entry in entries.values():
                if entry.workflow_id == run.workflow_id or (
                    run.dedup_id is not None and entry.dedup_id == run.dedup_id
                ):
                    return entry, False
            self._data.last_flow_seq += 1
            stored = attrs.evolve(run, seq=self._data.last_flow_seq, state="queued")
            entries[run.workflow_id] = stored
        return stored, True

    async def admit_flow_runs(
        self,
        queue: str,
        *,
        concurrency: int | None,
        rate: int | None,
        period: float,
        now: datetime,
        limit: int = 100,
    ) -> tuple[list[QueuedRun], float | None]:
        await self._enter()
        admitted: list[QueuedRun] = []
        retry_after: float | None = None
        with self._data.lock:
            entries = self._data.flow_runs.get(queue, {})
            running: dict[str, int] = {}
            for entry in entries.values():
                if entry.state == ADMITTED:
                    running[entry.partition_key] = running.get(entry.partition_key, 0) + 1
            for entry in sorted(entries.values(), key=lambda e: (e.priority, e.seq)):
                if len(admitted) >= limit:
                    break
                if entry.state == ADMITTED:
                    continue
                part = entry.partition_key
                if concurrency is not None and running.get(part, 0) >= concurrency:
                    continue
                _, starts = self._prune(f"queue:{queue}\x1f{part}", period, now)
                wait = rate_window(starts, rate, period, now)
                if wait is not None:
                    retry_after = wait if retry_after is None else min(retry_after, wait)
                    continue
                if rate is not None:
                    starts.append(now)
                running[part] = running.get(part, 0) + 1
                stored = attrs.evolve(entry, state=ADMITTED)
                entries[entry.workflow_id] = stored
                admitted.append(stored)
        return admitted, retry_after

    async def flow_runs(self, queue: str | None = None) -> list[QueuedRun]:
        await self._enter()
        with self._data.lock:
            found = [
                e
                for name, entries in self._data.flow_runs.items()
                if queue is None or name == queue
                for e in entries.values()
            ]
        return sorted(found, key=lambda e: (e.priority, e.seq))

    async def finish_flow_run(self, queue: str, workflow_id: str) -> bool:
        await self._enter()
        with self._data.lock:
            return self._data.flow_runs.get(queue, {}).pop(workflow_id, None) is not None

    async def aclose(self) -> None:
        """Close both stores (idempotent); the data of a named store stays for its next open."""
        await self.events.aclose()
        await self.visibility.aclose()


def _parse(url: str) -> str | None:
    prefix = "memory://"
    if not url.lower().startswith(prefix):
        raise InvalidStoreUrl(f"{redact_url(url)!r} is not a memory:// URL")
    name = url[len(prefix) :]
    if "/" in name or "?" in name or "#" in name:
        raise InvalidStoreUrl(
            f"{redact_url(url)!r}: a memory store URL is memory:// (private) or memory://NAME (shared in "
            "this process); NAME may not contain '/', '?' or '#'"
        )
    return name or None


@contextlib.asynccontextmanager
async def open_memory_store(url: str = "memory://") -> AsyncIterator[MemoryStore]:
    """Open ``memory://`` (a fresh, private store) or ``memory://NAME`` (shared in this process).

    Any other URL, or a ``NAME`` with ``/``, ``?`` or ``#``, raises ``InvalidStoreUrl``.
    """
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
