"""The store objects the opener yields: SQL, reads, and the opener itself."""

from __future__ import annotations

import contextlib
import itertools
import operator
from collections.abc import AsyncIterator, Sequence
from datetime import datetime, timedelta
from typing import Any, NoReturn, cast, final

import apsw
import attrs
import trio

from aion_trio.plugin import (
    Command,
    CommandOutcome,
    Event,
    FlowGrant,
    FlowWaiter,
    OwnerClaim,
    OwnerIdentity,
    PendingCommand,
    QueuedRun,
    StoredSchedule,
    TimerEntry,
    VisibilityFilter,
    VisibilityRow,
    WorkflowStatus,
    command_data_json,
    hold_mock_time,
    is_active_status,
    status_after,
    validate_batch,
    validate_flow_key,
    validate_flow_waiter,
    validate_schedule_write,
    validate_workflow_ids,
)

from . import _codec, _control
from ._mapping import runtime_error
from ._schema import DEFAULT_WAL_AUTOCHECKPOINT, open_heartbeat, open_read_only, open_reader, open_writer
from ._threads import Readers, ReadOp, Writer, WriterStatistics
from ._url import SqliteUrl, parse_sqlite_url
from ._walguard import WalGuard
from ._walroom import WalRoom
from ._writes import AppendOp, RiderOp, StatementOp

DEFAULT_BUSY_TIMEOUT = 5.0
"""Seconds a connection waits for another process's lock before ``BackendUnavailable``."""
DEFAULT_READERS = 2

# --------------------------------------------------------------------------
# SQL (constant text; every value is bound)
# --------------------------------------------------------------------------

_ACTIVE = tuple(s.value for s in WorkflowStatus if is_active_status(s))
_SQL_READ_HISTORY = (
    "SELECT seq, recorded_at, type, data FROM events WHERE workflow_id = ? AND seq >= ? ORDER BY seq"
)
_SQL_READ_HISTORIES = (
    "SELECT workflow_id, seq, recorded_at, type, data FROM events WHERE workflow_id IN ({params})"
    " ORDER BY workflow_id, seq"
)
_SQL_LIST_ACTIVE = (
    "SELECT workflow_id FROM workflows WHERE status IN (" + ", ".join("?" for _ in _ACTIVE) + ")"
    " ORDER BY workflow_id"
)
_SQL_LIST_WORKFLOWS = "SELECT workflow_id FROM workflows ORDER BY workflow_id"
_SQL_SCHEDULE_TIMER = (
    "INSERT INTO timers (workflow_id, timer_id, fire_at) VALUES (?, ?, ?)"
    " ON CONFLICT (workflow_id, timer_id) DO UPDATE SET fire_at = excluded.fire_at"
)
_SQL_REMOVE_TIMER = "DELETE FROM timers WHERE workflow_id = ? AND timer_id = ?"
_SQL_EXPIRED_TIMERS = (
    "SELECT fire_at, workflow_id, timer_id FROM timers WHERE fire_at <= ?"
    " ORDER BY fire_at, workflow_id, timer_id"
)
_SQL_UPSERT_VISIBILITY = (
    f"INSERT OR REPLACE INTO visibility ({_codec.VISIBILITY_COLUMNS})"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
_SQL_CLEAR_SEARCH = "DELETE FROM search_attrs WHERE workflow_id = ?"
_SQL_INSERT_SEARCH = (
    "INSERT INTO search_attrs (workflow_id, key, part, kind, num, txt) VALUES (?, ?, ?, ?, ?, ?)"
)
_SQL_GET_VISIBILITY = f"SELECT {_codec.VISIBILITY_COLUMNS} FROM visibility WHERE workflow_id = ?"


# --------------------------------------------------------------------------
# Reads (run by a reader thread)
# --------------------------------------------------------------------------


def _read_history(workflow_id: str, from_seq: int, location: str) -> ReadOp[list[Event]]:
    def run(conn: apsw.Connection) -> list[Event]:
        rows = conn.execute(_SQL_READ_HISTORY, (workflow_id, from_seq)).fetchall()
        return _codec.decode_events(workflow_id, rows, location)

    return ReadOp(run)


#: Ids per query of a bulk history read (well under SQLite's bound-parameter limit).
_HISTORIES_PER_QUERY = 500


def _read_histories(workflow_ids: list[str], location: str) -> ReadOp[dict[str, list[Event]]]:
    """Every history of ``workflow_ids``: one query per ``_HISTORIES_PER_QUERY`` ids, in one
    read transaction (one snapshot)."""

    def run(conn: apsw.Connection) -> dict[str, list[Event]]:
        out: dict[str, list[Event]] = {workflow_id: [] for workflow_id in workflow_ids}
        with conn:  # one read transaction: every chunk sees the same snapshot
            for start in range(0, len(workflow_ids), _HISTORIES_PER_QUERY):
                chunk = workflow_ids[start : start + _HISTORIES_PER_QUERY]
                sql = _SQL_READ_HISTORIES.format(params=", ".join("?" for _ in chunk))
                rows = conn.execute(sql, chunk).fetchall()
                for workflow_id, group in itertools.groupby(rows, key=operator.itemgetter(0)):
                    out[workflow_id] = _codec.decode_events(workflow_id, [r[1:] for r in group], location)
        return out

    return ReadOp(run)


def _column(sql: str, params: Sequence[Any]) -> ReadOp[list[Any]]:
    return ReadOp(lambda conn: [r[0] for r in conn.execute(sql, params)])


def _expired(as_of_us: int) -> ReadOp[list[TimerEntry]]:
    def run(conn: apsw.Connection) -> list[TimerEntry]:
        return [
            TimerEntry(fire_at=_codec.from_us(at), workflow_id=w, timer_id=t)
            for at, w, t in conn.execute(_SQL_EXPIRED_TIMERS, (as_of_us,))
        ]

    return ReadOp(run)


def _rows(sql: str, params: Sequence[Any], location: str) -> ReadOp[list[VisibilityRow]]:
    return ReadOp(lambda conn: [_codec.decode_visibility(r, location) for r in conn.execute(sql, params)])


# --------------------------------------------------------------------------
# The store objects
# --------------------------------------------------------------------------


@attrs.define(eq=False)
class _Backend:
    location: str
    writer: Writer
    readers: Readers
    busy_ms: int

    async def stop(self) -> None:
        await self.writer.stop()
        await self.readers.stop()


class _Facade:
    _backend: _Backend
    _closed: bool

    async def _enter(self) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._closed:
            await trio.lowlevel.cancel_shielded_checkpoint()
            raise trio.ClosedResourceError(f"{type(self).__name__} of {self._backend.location} is closed")

    async def aclose(self) -> None:
        """Close this half of the store (idempotent); later calls raise ``trio.ClosedResourceError``."""
        self._closed = True
        await trio.lowlevel.checkpoint()


async def _refuse(error: BaseException) -> NoReturn:
    await trio.lowlevel.cancel_shielded_checkpoint()
    raise error


@final
@attrs.define(eq=False)
class SqliteEventStore(_Facade):
    """Event histories and the timer index in one SQLite file.

    Every method is a checkpoint.  Cancellation: a call cancelled before the
    writer thread took its request raises ``trio.Cancelled`` and did nothing;
    once taken, the write completes and the call returns (the cancellation
    then arrives at the caller's next checkpoint).
    """

    _backend: _Backend = attrs.field(alias="backend")
    _closed: bool = attrs.field(default=False, init=False)

    @property
    def location(self) -> str:
        """The database file this store reads and writes, as errors name it."""
        return self._backend.location

    def statistics(self) -> WriterStatistics:
        """Counters of the writer (commits, coalesced writes, ...); shared with the visibility store."""
        return self._backend.writer.statistics()

    async def append(self, workflow_id: str, events: Sequence[Event], expected_seq: int) -> None:
        """Append ``events`` after ``expected_seq``: all or nothing, durable when it returns."""
        await self._enter()
        try:
            validate_batch(workflow_id, events, expected_seq)
            rows = _codec.event_rows(workflow_id, events)
        except Exception as exc:
            await _refuse(exc)
        status = status_after(None, events)
        op = AppendOp(workflow_id, expected_seq, rows, None if status is None else status.value)
        await self._backend.writer.submit(op)

    async def read_history(self, workflow_id: str, from_seq: int = 1) -> list[Event]:
        await self._enter()
        return await self._backend.readers.submit(_read_history(workflow_id, from_seq, self.location))

    async def list_active(self) -> list[str]:
        await self._enter()
        return await self._backend.readers.submit(_column(_SQL_LIST_ACTIVE, _ACTIVE))

    async def list_workflow_ids(self) -> list[str]:
        await self._enter()
        return await self._backend.readers.submit(_column(_SQL_LIST_WORKFLOWS, ()))

    async def schedule_timer(self, workflow_id: str, timer_id: str, fire_at: datetime) -> None:
        await self._enter()
        if not isinstance(fire_at, datetime) or fire_at.tzinfo is None or fire_at.utcoffset() is None:
            await _refuse(ValueError(f"fire_at must be a timezone-aware datetime, got {fire_at!r}"))
        params = (workflow_id, timer_id, _codec.to_us(fire_at))
        await self._backend.writer.submit(
            StatementOp("scheduling a timer", [(_SQL_SCHEDULE_TIMER, params, False)])
        )

    async def remove_timer(self, workflow_id: str, timer_id: str) -> None:
        await self._enter()
        params = (workflow_id, timer_id)
        await self._backend.writer.submit(
            StatementOp("removing a timer", [(_SQL_REMOVE_TIMER, params, False)])
        )

    async def expired_timers(self, as_of: datetime) -> list[TimerEntry]:
        await self._enter()
        if not isinstance(as_of, datetime) or as_of.tzinfo is None or as_of.utcoffset() is None:
            await _refuse(ValueError(f"as_of must be a timezone-aware datetime, got {as_of!r}"))
        return await self._backend.readers.submit(_expired(_codec.to_us(as_of)))


@final
@attrs.define(eq=False)
class SqliteVisibilityStore(_Facade):
    """Visibility rows; search predicates are evaluated in SQL. Same checkpoint and cancellation rules."""

    _backend: _Backend = attrs.field(alias="backend")
    _closed: bool = attrs.field(default=False, init=False)

    async def upsert(self, row: VisibilityRow) -> None:
        await self._enter()
        if not isinstance(cast(object, row), VisibilityRow):
            await _refuse(TypeError(f"upsert needs a VisibilityRow, got {row!r}"))
        statements = [
            (_SQL_CLEAR_SEARCH, (row.workflow_id,), False),
            (_SQL_UPSERT_VISIBILITY, _codec.visibility_params(row), False),
            (_SQL_INSERT_SEARCH, _codec.search_rows(row.workflow_id, row.search_attributes), True),
        ]
        await self._backend.writer.submit(RiderOp("writing a visibility row", statements))

    async def get(self, workflow_id: str) -> VisibilityRow | None:
        await self._enter()
        rows = await self._backend.readers.submit(
            _rows(_SQL_GET_VISIBILITY, (workflow_id,), self._backend.location)
        )
        return rows[0] if rows else None

    async def list(self, filter: VisibilityFilter | None = None) -> list[VisibilityRow]:
        await self._enter()
        sql, params = _codec.list_query(filter or VisibilityFilter())
        return await self._backend.readers.submit(_rows(sql, params, self._backend.location))

    async def count(self, filter: VisibilityFilter | None = None) -> int:
        await self._enter()
        sql, params = _codec.count_query(filter or VisibilityFilter())
        values = await self._backend.readers.submit(_column(sql, params))
        return int(values[0])


@final
@attrs.define(eq=False)
class SqliteStore:
    """An opened SQLite store: ``events`` and ``visibility`` over one database file."""

    events: SqliteEventStore
    visibility: SqliteVisibilityStore
    url: SqliteUrl
    _backend: _Backend = attrs.field(alias="backend", repr=False)

    @property
    def path(self) -> str:
        """The absolute path of the database file."""
        return self.url.path

    async def _enter(self) -> None:
        await self.events._enter()

    # -- ownership (aion_trio.OwnedStore) ------------------------------------

    async def claim_owner(
        self, identity: OwnerIdentity, *, now: datetime, stale_after: timedelta
    ) -> OwnerClaim:
        """Claim the store for ``identity`` (one ``BEGIN IMMEDIATE`` transaction), or raise
        :class:`~aion_trio.StoreOwned` naming the live owner; see :class:`~aion_trio.OwnedStore`."""
        await self._enter()
        if not isinstance(cast(object, identity), OwnerIdentity):
            await _refuse(TypeError(f"claim_owner needs an OwnerIdentity, got {identity!r}"))
        op = _control.ClaimOp(identity, now, stale_after, self.path)
        writer = self._backend.writer
        await writer.submit(op)
        assert op.result is not None
        # From now on every write through this handle checks the claim is still ours.
        writer.fence = op.result.identity.token
        return op.result

    async def renew_owner(self, claim: OwnerClaim, *, now: datetime) -> OwnerClaim:
        await self._enter()
        op = _control.RenewOp(claim, now, self.path)
        await self._backend.writer.submit(op)
        assert op.result is not None
        return op.result

    def renew_owner_blocking(self, claim: OwnerClaim, *, now: datetime) -> OwnerClaim:
        """:meth:`renew_owner` for a heartbeat thread (:class:`~aion_trio.plugin.ThreadRenewal`):
        blocks, on a connection of its own, so it needs neither the Trio loop nor the writer thread."""
        doing = "renewing the store's owner claim"
        try:
            conn = open_heartbeat(self.path, self.url.synchronous, self._backend.busy_ms)
        except apsw.Error as exc:  # pragma: no cover - open_heartbeat maps its own errors
            raise runtime_error(exc, self.path, doing) from exc
        try:
            return _control.renew_blocking(conn, claim, now, self.path)
        except apsw.Error as exc:
            raise runtime_error(exc, self.path, doing) from exc
        finally:
            conn.close()

    async def release_owner(self, claim: OwnerClaim) -> None:
        await self._enter()
        writer = self._backend.writer
        await writer.submit(_control.ReleaseOp(claim.identity.token))
        if writer.fence == claim.identity.token:
            writer.fence = None  # released, not taken over: later writes are nobody's zombie writes

    async def current_owner(self) -> OwnerClaim | None:
        await self._enter()
        return await self._backend.readers.submit(_control.owner_read(self.path))

    # -- the command inbox (aion_trio.CommandInbox) --------------------------

    async def enqueue_command(self, command: Command) -> int:
        await self._enter()
        try:
            kind, data = command_data_json(command)
        except Exception as exc:
            await _refuse(exc)
        op = _control.EnqueueOp(kind, data, command.request_id)
        await self._backend.writer.submit(op)
        assert op.result is not None
        return op.result

    async def pending_commands(self, limit: int = 100) -> list[PendingCommand]:
        await self._enter()
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            await _refuse(ValueError(f"limit must be an int >= 1, got {limit!r}"))
        return await self._backend.readers.submit(_control.pending_read(limit, self.path))

    async def ack_command(self, command_id: int, outcome: CommandOutcome) -> None:
        await self._enter()
        if not isinstance(cast(object, outcome), CommandOutcome):
            await _refuse(TypeError(f"ack_command needs a CommandOutcome, got {outcome!r}"))
        await self._backend.writer.submit(_control.AckOp(command_id, outcome, self.path))

    async def command_outcome(self, command_id: int) -> CommandOutcome | None:
        await self._enter()
        return await self._backend.readers.submit(_control.outcome_read(command_id, self.path))

    # -- bulk history reads (aion_trio.BulkHistoryReads) -----------------------

    async def read_histories(self, workflow_ids: Sequence[str]) -> dict[str, list[Event]]:
        await self._enter()
        try:
            ids = validate_workflow_ids(workflow_ids)
        except (TypeError, ValueError) as exc:
            await _refuse(exc)
        if not ids:
            await trio.lowlevel.checkpoint()
            return {}
        return await self._backend.readers.submit(_read_histories(ids, self.events.location))

    # -- recovery counts (aion_trio.RecoveryCounts) ----------------------------

    async def count_recoveries(self, workflow_ids: Sequence[str]) -> dict[str, int]:
        await self._enter()
        try:
            ids = validate_workflow_ids(workflow_ids)
        except (TypeError, ValueError) as exc:
            await _refuse(exc)
        if not ids:
            return {}
        op = _control.CountRecoveriesOp(ids)
        await self._backend.writer.submit(op)
        return op.result

    async def clear_recoveries(self, workflow_ids: Sequence[str]) -> None:
        await self._enter()
        try:
            ids = validate_workflow_ids(workflow_ids)
        except (TypeError, ValueError) as exc:
            await _refuse(exc)
        if ids:
            await self._backend.writer.submit(_control.ClearRecoveriesOp(ids))

    async def recovery_counts(self) -> dict[str, int]:
        await self._enter()
        return await self._backend.readers.submit(_control.recoveries_read())

    # -- schedules (aion_trio.ScheduleStore) -----------------------------------

    async def create_schedule(self, schedule_id: str, data: str) -> StoredSchedule:
        await self._enter()
        try:
            validate_schedule_write(schedule_id, data)
        except (TypeError, ValueError) as exc:
            await _refuse(exc)
        await self._backend.writer.submit(_control.CreateScheduleOp(schedule_id, data))
        return StoredSchedule(schedule_id=schedule_id, version=1, data=data)

    async def read_schedule(self, schedule_id: str) -> StoredSchedule | None:
        await self._enter()
        return await self._backend.readers.submit(_control.schedule_read(schedule_id))

    async def list_schedules(self) -> list[StoredSchedule]:
        await self._enter()
        return await self._backend.readers.submit(_control.schedules_read())

    async def write_schedule(self, schedule_id: str, data: str, expected_version: int) -> StoredSchedule:
        await self._enter()
        try:
            validate_schedule_write(schedule_id, data, expected_version)
        except (TypeError, ValueError) as exc:
            await _refuse(exc)
        await self._backend.writer.submit(_control.WriteScheduleOp(schedule_id, data, expected_version))
        return StoredSchedule(schedule_id=schedule_id, version=expected_version + 1, data=data)

    async def delete_schedule(self, schedule_id: str) -> bool:
        await self._enter()
        op = _control.DeleteScheduleOp(schedule_id)
        await self._backend.writer.submit(op)
        return op.result

    # -- flow control (aion_trio.FlowStore) -------------------------------------

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
        try:
            validate_flow_key(key)
            validate_flow_key(holder, "holder")
        except ValueError as exc:
            await _refuse(exc)
        op = _control.AcquirePermitOp(key, holder, concurrency, rate, period, ttl, now)
        await self._backend.writer.submit(op)
        return op.result

    async def release_flow_permit(self, key: str, permit_id: str) -> bool:
        await self._enter()
        op = _control.ReleasePermitOp(key, permit_id)
        await self._backend.writer.submit(op)
        return op.result

    async def renew_flow_permits(self, holder: str, *, ttl: float, now: datetime) -> int:
        await self._enter()
        op = _control.RenewPermitsOp(holder, ttl, now)
        await self._backend.writer.submit(op)
        return op.result

    async def held_flow_permits(self, key: str, *, now: datetime) -> int:
        await self._enter()
        return await self._backend.readers.submit(_control.held_permits_read(key, now))

    async def record_flow_waiter(self, waiter: FlowWaiter, *, ttl: float, now: datetime) -> None:
        await self._enter()
        try:
            validate_flow_waiter(waiter)
        except (TypeError, ValueError) as exc:
            await _refuse(exc)
        await self._backend.writer.submit(_control.RecordWaiterOp(waiter, ttl, now))

    async def remove_flow_waiter(self, workflow_id: str, run_id: str, activity_id: int) -> bool:
        await self._enter()
        op = _control.RemoveWaiterOp(workflow_id, run_id, activity_id)
        await self._backend.writer.submit(op)
        return op.result

    async def flow_waiters(self, workflow_id: str, *, now: datetime) -> list[FlowWaiter]:
        await self._enter()
        return await self._backend.readers.submit(_control.flow_waiters_read(workflow_id, now))

    async def clear_flow_waiters(self) -> int:
        await self._enter()
        op = _control.ClearWaitersOp()
        await self._backend.writer.submit(op)
        return op.result

    async def enqueue_flow_run(self, run: QueuedRun) -> tuple[QueuedRun, bool]:
        await self._enter()
        try:
            validate_flow_key(run.queue, "queue")
            validate_flow_key(run.workflow_id, "workflow id")
        except ValueError as exc:
            await _refuse(exc)
        op = _control.EnqueueRunOp(run)
        await self._backend.writer.submit(op)
        return op.result, op.created

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
        op = _control.AdmitRunsOp(queue, concurrency, rate, period, now, limit)
        await self._backend.writer.submit(op)
        return op.result, op.retry_after

    async def flow_runs(self, queue: str | None = None) -> list[QueuedRun]:
        await self._enter()
        return await self._backend.readers.submit(_control.flow_runs_read(queue))

    async def finish_flow_run(self, queue: str, workflow_id: str) -> bool:
        await self._enter()
        op = _control.FinishRunOp(queue, workflow_id)
        await self._backend.writer.submit(op)
        return op.result

    async def aclose(self) -> None:
        """Close both halves, finish queued work and close the database (idempotent)."""
        self.events._closed = True
        self.visibility._closed = True
        await self._backend.stop()
        await trio.lowlevel.checkpoint()


def _open_all(url: SqliteUrl, busy_ms: int, readers: int) -> tuple[apsw.Connection, list[apsw.Connection]]:
    if url.read_only:
        writer = open_read_only(url.path, busy_ms)
    else:
        writer = open_writer(url.path, url.synchronous, busy_ms)
    opened: list[apsw.Connection] = []
    try:
        for _ in range(readers):
            opened.append(
                open_reader(url.path, url.synchronous, busy_ms, _codec.SQL_FUNCTIONS, read_only=url.read_only)
            )
    except BaseException:
        for conn in opened:
            conn.close()
        writer.close()
        raise
    return writer, opened


def _room_for(url: SqliteUrl, conn: apsw.Connection) -> WalRoom | None:
    # Room only helps a commit that syncs the WAL (FULL); a read-only store commits nothing.
    if url.read_only or url.synchronous != "FULL":
        return None
    page_size = conn.execute("PRAGMA page_size").fetchall()[0][0]
    assert isinstance(page_size, int), page_size
    return WalRoom(conn.filename_wal, page_size)


@contextlib.asynccontextmanager
async def open_sqlite_store(
    url: str,
    *,
    busy_timeout: float = DEFAULT_BUSY_TIMEOUT,
    readers: int = DEFAULT_READERS,
    wal_autocheckpoint: int = DEFAULT_WAL_AUTOCHECKPOINT,
) -> AsyncIterator[SqliteStore]:
    """Open the SQLite store named by ``url``; closes it on exit.

    ``busy_timeout``: seconds to wait for another process's lock before a
    call fails with ``BackendUnavailable``.  ``readers``: read connections.
    ``wal_autocheckpoint``: WAL pages after which the writer thread
    checkpoints (bounding the WAL file; see :data:`DEFAULT_WAL_AUTOCHECKPOINT`).
    Raises the :class:`~aion_trio.StoreOpenError` family for files that
    cannot be used (each message says what to do).
    """
    parsed = parse_sqlite_url(url)
    if readers < 1:
        raise ValueError(f"readers must be >= 1, got {readers!r}")
    if type(wal_autocheckpoint) is not int or wal_autocheckpoint < 1:
        raise ValueError(
            f"wal_autocheckpoint must be a whole number of pages >= 1 (it bounds the WAL file), "
            f"got {wal_autocheckpoint!r}"
        )
    busy_ms = max(0, round(busy_timeout * 1000))
    # Opening blocks (file I/O, maybe a migration): off the Trio thread.  The
    # open is not abandoned on cancellation, so its connections never leak.
    with hold_mock_time():
        writer_conn, reader_conns = await trio.to_thread.run_sync(_open_all, parsed, busy_ms, readers)
    token = trio.lowlevel.current_trio_token()
    backend = _Backend(
        location=parsed.path,
        writer=Writer(
            writer_conn,
            parsed.path,
            token,
            busy_timeout_ms=busy_ms,
            checkpoint_pages=wal_autocheckpoint,
            room=_room_for(parsed, writer_conn),
            guard=None if parsed.read_only else WalGuard(parsed.path, writer_conn.filename_wal),
            inline=parsed.inline_commits,
        ),
        readers=Readers(reader_conns, parsed.path, token),
        busy_ms=busy_ms,
    )
    store = SqliteStore(
        events=SqliteEventStore(backend=backend),
        visibility=SqliteVisibilityStore(backend=backend),
        url=parsed,
        backend=backend,
    )
    try:
        yield store
    finally:
        with trio.CancelScope(shield=True):
            await store.aclose()
