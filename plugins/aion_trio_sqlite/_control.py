"""Ownership and the command inbox: the writes and reads behind ``SqliteStore``'s
:class:`~aion_trio.OwnedStore` and :class:`~aion_trio.CommandInbox` methods.

The writes are :class:`WriteOp` subclasses the writer thread applies inside
its ``BEGIN IMMEDIATE`` transaction, like any other write, but not fenced
(:func:`~._writes.fence`): a claim, a renewal and a release check the claim
themselves, and queueing a command is what processes that are not the owner do.  A claim reads the
owner row, decides with :func:`aion_trio.plugin.decide_claim` and writes, all
inside that one transaction: the write lock is held from the read to the
commit, so two processes taking over one dead claim serialise and the second
reads the first's fresh claim and is refused.  A refusal sets ``error`` and
writes nothing.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any, cast

import apsw
import attrs

from aion_trio import AionError
from aion_trio.plugin import (
    ADMITTED,
    QUEUED,
    CommandDecodeError,
    CommandOutcome,
    FlowGrant,
    FlowWaiter,
    NotFound,
    OwnerClaim,
    OwnerIdentity,
    PendingCommand,
    QueuedRun,
    ScheduleAlreadyExists,
    ScheduleConflict,
    StoreDecodeError,
    StoredSchedule,
    command_from_data_json,
    decide_claim,
    decide_renew,
    outcome_from_json,
    outcome_to_json,
    rate_window,
)

from . import _codec
from ._threads import ReadOp
from ._writes import WriteOp

_SQL_OWNER = (
    "SELECT pid, host, started_at, token, since, renewed_at, stale_after_us, process FROM owner WHERE id = 1"
)
_SQL_PUT_OWNER = (
    "INSERT OR REPLACE INTO owner (id, pid, host, started_at, token, since, renewed_at, stale_after_us, process)"
    " VALUES (1, ?, ?, ?, ?, ?, ?, ?, ?)"
)
SQL_OWNER_TOKEN = "SELECT token FROM owner WHERE id = 1"
_SQL_RENEW_OWNER = "UPDATE owner SET renewed_at = ? WHERE id = 1 AND token = ?"
_SQL_RELEASE_OWNER = "DELETE FROM owner WHERE id = 1 AND token = ?"
_SQL_ENQUEUE = "INSERT INTO inbox (type, data, request_id) VALUES (?, ?, ?)"
_SQL_COMMAND_OF_REQUEST = "SELECT command_id FROM inbox WHERE request_id = ?"
_SQL_ACK = "UPDATE inbox SET acked = 1, outcome = ? WHERE command_id = ? AND acked = 0"
_SQL_COMMAND_EXISTS = "SELECT 1 FROM inbox WHERE command_id = ?"
_SQL_PENDING = "SELECT command_id, type, data FROM inbox WHERE acked = 0 ORDER BY command_id LIMIT ?"
_SQL_OUTCOME = "SELECT acked, outcome FROM inbox WHERE command_id = ?"
_SQL_COUNT_RECOVERY = (
    "INSERT INTO recoveries (workflow_id, count) VALUES (?, 1)"
    " ON CONFLICT (workflow_id) DO UPDATE SET count = count + 1 RETURNING count"
)
_SQL_CLEAR_RECOVERY = "DELETE FROM recoveries WHERE workflow_id = ?"
_SQL_RECOVERIES = "SELECT workflow_id, count FROM recoveries ORDER BY workflow_id"


_SQL_CREATE_SCHEDULE = "INSERT OR IGNORE INTO schedules (schedule_id, version, data) VALUES (?, 1, ?)"
_SQL_WRITE_SCHEDULE = (
    "UPDATE schedules SET version = version + 1, data = ? WHERE schedule_id = ? AND version = ?"
)
_SQL_SCHEDULE_VERSION = "SELECT version FROM schedules WHERE schedule_id = ?"
_SQL_DELETE_SCHEDULE = "DELETE FROM schedules WHERE schedule_id = ?"
_SQL_SCHEDULE = "SELECT schedule_id, version, data FROM schedules WHERE schedule_id = ?"
_SQL_SCHEDULES = "SELECT schedule_id, version, data FROM schedules ORDER BY schedule_id"


def _int(value: object) -> int:
    """An INTEGER column's value (a command id, a count)."""
    assert isinstance(value, int), value
    return value


def _decode_owner(row: Any, location: str) -> OwnerClaim:
    pid, host, started_at, token, since, renewed_at, stale_after_us, process = row
    try:
        return OwnerClaim(
            identity=OwnerIdentity(
                pid=pid, host=host, started_at=_codec.from_us(started_at), token=token, process=process
            ),
            since=_codec.from_us(since),
            renewed_at=_codec.from_us(renewed_at),
            stale_after=timedelta(microseconds=stale_after_us),
        )
    except (TypeError, ValueError, OverflowError) as exc:
        raise StoreDecodeError(
            "(owner)", None, f"the owner row is damaged: {exc}", location=location
        ) from exc


def read_owner(conn: apsw.Connection, location: str) -> OwnerClaim | None:
    rows = conn.execute(_SQL_OWNER).fetchall()
    return _decode_owner(rows[0], location) if rows else None


def _owner_params(claim: OwnerClaim) -> tuple[Any, ...]:
    ident = claim.identity
    stale_us = claim.stale_after // timedelta(microseconds=1)
    return (
        ident.pid,
        ident.host,
        _codec.to_us(ident.started_at),
        ident.token,
        _codec.to_us(claim.since),
        _codec.to_us(claim.renewed_at),
        stale_us,
        ident.process,
    )


class ClaimOp(WriteOp):
    """Read the claim, apply the takeover rule, write the winner's claim (or refuse)."""

    __slots__ = ("identity", "location", "now", "result", "stale_after")
    doing = "claiming the store"
    fenced = False

    def __init__(self, identity: OwnerIdentity, now: datetime, stale_after: timedelta, location: str) -> None:
        super().__init__()
        self.identity = identity
        self.now = now
        self.stale_after = stale_after
        self.location = location
        self.result: OwnerClaim | None = None

    def apply(self, conn: apsw.Connection) -> None:
        self.error = None
        self.result = None
        try:
            claim = decide_claim(
                read_owner(conn, self.location),
                self.identity,
                now=self.now,
                stale_after=self.stale_after,
                location=self.location,
            )
        except AionError as exc:  # StoreOwned, or a damaged row: refused, nothing written
            self.error = exc
            return
        conn.execute(_SQL_PUT_OWNER, _owner_params(claim))
        self.result = claim


class RenewOp(WriteOp):
    """The owner's heartbeat: refused with ``StoreTakenOver`` if the claim is no longer its own."""

    __slots__ = ("claim", "location", "now", "result")
    doing = "renewing the store's owner claim"
    fenced = False

    def __init__(self, claim: OwnerClaim, now: datetime, location: str) -> None:
        super().__init__()
        self.claim = claim
        self.now = now
        self.location = location
        self.result: OwnerClaim | None = None

    def apply(self, conn: apsw.Connection) -> None:
        self.error = None
        self.result = None
        try:
            renewed = decide_renew(read_owner(conn, self.location), self.claim, now=self.now)
        except AionError as exc:  # StoreTakenOver, or a damaged row (StoreDecodeError)
            self.error = exc
            return
        conn.execute(_SQL_RENEW_OWNER, (_codec.to_us(renewed.renewed_at), renewed.identity.token))
        self.result = renewed


class ReleaseOp(WriteOp):
    __slots__ = ("token",)
    doing = "releasing the store's owner claim"
    fenced = False

    def __init__(self, token: str) -> None:
        super().__init__()
        self.token = token

    def apply(self, conn: apsw.Connection) -> None:
        self.error = None
        conn.execute(_SQL_RELEASE_OWNER, (self.token,))


class EnqueueOp(WriteOp):
    """Queue a command; one already queued under the same request id is not added again."""

    __slots__ = ("data", "kind", "request_id", "result")
    doing = "queueing a command"
    fenced = False

    def __init__(self, kind: str, data: str, request_id: str | None) -> None:
        super().__init__()
        self.kind = kind
        self.data = data
        self.request_id = request_id
        self.result: int | None = None

    def apply(self, conn: apsw.Connection) -> None:
        # Inside the writer's BEGIN IMMEDIATE: no other process queues between the two.
        self.error = None
        if self.request_id is not None:
            found = conn.execute(_SQL_COMMAND_OF_REQUEST, (self.request_id,)).fetchall()
            if found:
                self.result = _int(found[0][0])
                return
        conn.execute(_SQL_ENQUEUE, (self.kind, self.data, self.request_id))
        self.result = conn.last_insert_rowid()


class AckOp(WriteOp):
    __slots__ = ("command_id", "location", "outcome")
    doing = "acknowledging a command"

    def __init__(self, command_id: int, outcome: CommandOutcome, location: str) -> None:
        super().__init__()
        self.command_id = command_id
        self.outcome = outcome_to_json(outcome)
        self.location = location

    def apply(self, conn: apsw.Connection) -> None:
        self.error = None
        conn.execute(_SQL_ACK, (self.outcome, self.command_id))
        if conn.changes() == 0 and not conn.execute(_SQL_COMMAND_EXISTS, (self.command_id,)).fetchall():
            self.error = NotFound(f"no inbox command #{self.command_id} in {self.location}")


class CountRecoveriesOp(WriteOp):
    """Add one to each workflow's recovery count (aion_trio.RecoveryCounts)."""

    __slots__ = ("result", "workflow_ids")
    doing = "counting recoveries"

    def __init__(self, workflow_ids: list[str]) -> None:
        super().__init__()
        self.workflow_ids = workflow_ids
        self.result: dict[str, int] = {}

    def apply(self, conn: apsw.Connection) -> None:
        self.error = None
        self.result = {
            wid: _int(conn.execute(_SQL_COUNT_RECOVERY, (wid,)).fetchall()[0][0]) for wid in self.workflow_ids
        }


class ClearRecoveriesOp(WriteOp):
    __slots__ = ("workflow_ids",)
    doing = "clearing recovery counts"

    def __init__(self, workflow_ids: list[str]) -> None:
        super().__init__()
        self.workflow_ids = workflow_ids

    def apply(self, conn: apsw.Connection) -> None:
        self.error = None
        conn.executemany(_SQL_CLEAR_RECOVERY, [(wid,) for wid in self.workflow_ids])


def recoveries_read() -> ReadOp[dict[str, int]]:
    return ReadOp(lambda conn: {wid: count for wid, count in conn.execute(_SQL_RECOVERIES)})


def owner_read(location: str) -> ReadOp[OwnerClaim | None]:
    return ReadOp(lambda conn: read_owner(conn, location))


def pending_read(limit: int, location: str) -> ReadOp[list[PendingCommand]]:
    def run(conn: apsw.Connection) -> list[PendingCommand]:
        out = []
        for command_id, kind, data in conn.execute(_SQL_PENDING, (limit,)):
            try:
                command = command_from_data_json(kind, data)
            except CommandDecodeError as exc:
                raise StoreDecodeError(
                    "(inbox)", None, f"command #{command_id}: {exc}", location=location
                ) from exc
            out.append(PendingCommand(command_id=command_id, command=command))
        return out

    return ReadOp(run)


def outcome_read(command_id: int, location: str) -> ReadOp[CommandOutcome | None]:
    def run(conn: apsw.Connection) -> CommandOutcome | None:
        rows = conn.execute(_SQL_OUTCOME, (command_id,)).fetchall()
        if not rows:
            raise NotFound(f"no inbox command #{command_id} in {location}")
        acked, text = rows[0]
        if not acked:
            return None
        try:
            return outcome_from_json(cast("str", text))  # an acknowledged row holds its outcome's JSON
        except CommandDecodeError as exc:
            raise StoreDecodeError(
                "(inbox)", None, f"command #{command_id}: {exc}", location=location
            ) from exc

    return ReadOp(run)


def renew_blocking(conn: apsw.Connection, claim: OwnerClaim, now: datetime, location: str) -> OwnerClaim:
    """:class:`RenewOp` in a transaction of its own on ``conn`` (the heartbeat thread's)."""
    op = RenewOp(claim, now, location)
    conn.execute("BEGIN IMMEDIATE")
    try:
        op.apply(conn)
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    if op.error is not None:
        raise op.error
    assert op.result is not None
    return op.result


# -- schedules (aion_trio.ScheduleStore) ---------------------------------------


class CreateScheduleOp(WriteOp):
    """Store a schedule at version 1, or refuse an id that exists (writes nothing)."""

    __slots__ = ("data", "schedule_id")
    doing = "creating a schedule"

    def __init__(self, schedule_id: str, data: str) -> None:
        super().__init__()
        self.schedule_id = schedule_id
        self.data = data

    def apply(self, conn: apsw.Connection) -> None:
        self.error = None
        conn.execute(_SQL_CREATE_SCHEDULE, (self.schedule_id, self.data))
        if conn.changes() == 0:
            self.error = ScheduleAlreadyExists(self.schedule_id)


class WriteScheduleOp(WriteOp):
    """Compare-and-set: replace a schedule's data if its version is the expected one."""

    __slots__ = ("data", "expected", "schedule_id")
    doing = "writing a schedule"

    def __init__(self, schedule_id: str, data: str, expected: int) -> None:
        super().__init__()
        self.schedule_id = schedule_id
        self.data = data
        self.expected = expected

    def apply(self, conn: apsw.Connection) -> None:
        self.error = None
        conn.execute(_SQL_WRITE_SCHEDULE, (self.data, self.schedule_id, self.expected))
        if conn.changes() == 0:
            rows = conn.execute(_SQL_SCHEDULE_VERSION, (self.schedule_id,)).fetchall()
            self.error = ScheduleConflict(self.schedule_id, self.expected, _int(rows[0][0]) if rows else 0)


class DeleteScheduleOp(WriteOp):
    __slots__ = ("result", "schedule_id")
    doing = "deleting a schedule"

    def __init__(self, schedule_id: str) -> None:
        super().__init__()
        self.schedule_id = schedule_id
        self.result = False

    def apply(self, conn: apsw.Connection) -> None:
        self.error = None
        conn.execute(_SQL_DELETE_SCHEDULE, (self.schedule_id,))
        self.result = conn.changes() > 0


def _schedule(row: Any) -> StoredSchedule:
    schedule_id, version, data = row
    return StoredSchedule(schedule_id=schedule_id, version=_int(version), data=data)


def schedule_read(schedule_id: str) -> ReadOp[StoredSchedule | None]:
    def run(conn: apsw.Connection) -> StoredSchedule | None:
        rows = conn.execute(_SQL_SCHEDULE, (schedule_id,)).fetchall()
        return _schedule(rows[0]) if rows else None

    return ReadOp(run)


def schedules_read() -> ReadOp[list[StoredSchedule]]:
    return ReadOp(lambda conn: [_schedule(row) for row in conn.execute(_SQL_SCHEDULES)])


# -- flow control (aion_trio.FlowStore) ----------------------------------------

_SQL_EXPIRE_PERMITS = "DELETE FROM flow_permits WHERE key = ? AND expires_at <= ?"
_SQL_COUNT_PERMITS = "SELECT count(*) FROM flow_permits WHERE key = ?"
_SQL_COUNT_LIVE_PERMITS = "SELECT count(*) FROM flow_permits WHERE key = ? AND expires_at > ?"
_SQL_PRUNE_STARTS = "DELETE FROM flow_starts WHERE key = ? AND at <= ?"
_SQL_STARTS = "SELECT at FROM flow_starts WHERE key = ? ORDER BY at"
_SQL_ADD_START = "INSERT INTO flow_starts (key, at) VALUES (?, ?)"
_SQL_ADD_PERMIT = "INSERT INTO flow_permits (key, holder, expires_at) VALUES (?, ?, ?) RETURNING permit_id"
_SQL_RELEASE_PERMIT = "DELETE FROM flow_permits WHERE key = ? AND permit_id = ?"
_SQL_RENEW_PERMITS = "UPDATE flow_permits SET expires_at = ? WHERE holder = ? AND expires_at > ?"
_FLOW_RUN_COLUMNS = "queue, workflow_id, partition_key, priority, dedup_id, seq, state, data"
_SQL_FLOW_TWIN = (
    f"SELECT {_FLOW_RUN_COLUMNS} FROM flow_runs WHERE queue = ? AND (workflow_id = ? OR dedup_id = ?)"
    " ORDER BY seq LIMIT 1"
)
_SQL_ADD_FLOW_RUN = (
    "INSERT INTO flow_runs (queue, workflow_id, partition_key, priority, dedup_id, state, data)"
    " VALUES (?, ?, ?, ?, ?, 'queued', ?) RETURNING seq"
)
_SQL_QUEUE_RUNS = f"SELECT {_FLOW_RUN_COLUMNS} FROM flow_runs WHERE queue = ? ORDER BY priority, seq"
_SQL_ALL_FLOW_RUNS = f"SELECT {_FLOW_RUN_COLUMNS} FROM flow_runs ORDER BY priority, seq"
_SQL_ADMIT_RUN = "UPDATE flow_runs SET state = 'admitted' WHERE seq = ?"
_SQL_FINISH_RUN = "DELETE FROM flow_runs WHERE queue = ? AND workflow_id = ?"


def _flow_run(row: Any) -> QueuedRun:
    queue, workflow_id, partition_key, priority, dedup_id, seq, state, data = row
    return QueuedRun(
        queue=queue,
        workflow_id=workflow_id,
        partition_key=partition_key,
        priority=_int(priority),
        dedup_id=dedup_id,
        seq=_int(seq),
        state=state,
        data=data,
    )


def _window(conn: apsw.Connection, key: str, period: float, now: datetime) -> list[datetime]:
    """The starts of ``key`` inside the window ending ``now`` (older ones deleted), oldest first."""
    conn.execute(_SQL_PRUNE_STARTS, (key, _codec.to_us(now - timedelta(seconds=period))))
    return [_codec.from_us(row[0]) for row in conn.execute(_SQL_STARTS, (key,))]


class AcquirePermitOp(WriteOp):
    """Count a start and take a permit if the rate and the bound allow (else write nothing)."""

    __slots__ = ("concurrency", "holder", "key", "now", "period", "rate", "result", "ttl")
    doing = "taking a flow permit"
    fenced = False

    def __init__(
        self,
        key: str,
        holder: str,
        concurrency: int | None,
        rate: int | None,
        period: float,
        ttl: float,
        now: datetime,
    ) -> None:
        super().__init__()
        self.key, self.holder, self.concurrency, self.rate = key, holder, concurrency, rate
        self.period, self.ttl, self.now = period, ttl, now
        self.result = FlowGrant(granted=False)

    def apply(self, conn: apsw.Connection) -> None:
        self.error = None
        now_us = _codec.to_us(self.now)
        conn.execute(_SQL_EXPIRE_PERMITS, (self.key, now_us))
        if self.concurrency is not None:
            held = _int(conn.execute(_SQL_COUNT_PERMITS, (self.key,)).fetchall()[0][0])
            if held >= self.concurrency:
                self.result = FlowGrant(granted=False)
                return
        if self.rate is not None:
            wait = rate_window(
                _window(conn, self.key, self.period, self.now), self.rate, self.period, self.now
            )
            if wait is not None:
                self.result = FlowGrant(granted=False, retry_after=wait)
                return
            conn.execute(_SQL_ADD_START, (self.key, now_us))
        if self.concurrency is None:
            self.result = FlowGrant(granted=True)
            return
        expires = _codec.to_us(self.now + timedelta(seconds=self.ttl))
        permit_id = conn.execute(_SQL_ADD_PERMIT, (self.key, self.holder, expires)).fetchall()[0][0]
        self.result = FlowGrant(granted=True, permit_id=str(permit_id))


class ReleasePermitOp(WriteOp):
    __slots__ = ("key", "permit_id", "result")
    doing = "releasing a flow permit"
    fenced = False

    def __init__(self, key: str, permit_id: str) -> None:
        super().__init__()
        self.key, self.permit_id, self.result = key, permit_id, False

    def apply(self, conn: apsw.Connection) -> None:
        self.error = None
        if not self.permit_id.isdigit():
            return
        conn.execute(_SQL_RELEASE_PERMIT, (self.key, int(self.permit_id)))
        self.result = conn.changes() > 0


class RenewPermitsOp(WriteOp):
    __slots__ = ("holder", "now", "result", "ttl")
    doing = "renewing flow permits"
    fenced = False

    def __init__(self, holder: str, ttl: float, now: datetime) -> None:
        super().__init__()
        self.holder, self.ttl, self.now, self.result = holder, ttl, now, 0

    def apply(self, conn: apsw.Connection) -> None:
        self.error = None
        expires = _codec.to_us(self.now + timedelta(seconds=self.ttl))
        conn.execute(_SQL_RENEW_PERMITS, (expires, self.holder, _codec.to_us(self.now)))
        self.result = conn.changes()
        conn.execute(_SQL_RENEW_WAITERS, (expires, self.holder, _codec.to_us(self.now)))
        self.result += conn.changes()


def held_permits_read(key: str, now: datetime) -> ReadOp[int]:
    return ReadOp(
        lambda conn: _int(conn.execute(_SQL_COUNT_LIVE_PERMITS, (key, _codec.to_us(now))).fetchall()[0][0])
    )


class EnqueueRunOp(WriteOp):
    """Add a queued run, or find the entry of the same queue with its workflow id or dedup id."""

    __slots__ = ("created", "result", "run")
    doing = "enqueueing a workflow run"

    def __init__(self, run: QueuedRun) -> None:
        super().__init__()
        self.run = run
        self.result = run
        self.created = False

    def apply(self, conn: apsw.Connection) -> None:
        self.error = None
        run = self.run
        twin = conn.execute(_SQL_FLOW_TWIN, (run.queue, run.workflow_id, run.dedup_id)).fetchall()
        if twin:
            self.result, self.created = _flow_run(twin[0]), False
            return
        seq = conn.execute(
            _SQL_ADD_FLOW_RUN,
            (run.queue, run.workflow_id, run.partition_key, run.priority, run.dedup_id, run.data),
        ).fetchall()[0][0]
        self.result = QueuedRun(
            queue=run.queue,
            workflow_id=run.workflow_id,
            partition_key=run.partition_key,
            priority=run.priority,
            dedup_id=run.dedup_id,
            seq=_int(seq),
            state=QUEUED,
            data=run.data,
        )
        self.created = True


class AdmitRunsOp(WriteOp):
    """Admit queued runs in (priority, seq) order within each partition's bounds."""

    __slots__ = ("concurrency", "limit", "now", "period", "queue", "rate", "result", "retry_after")
    doing = "admitting queued workflow runs"

    def __init__(
        self, queue: str, concurrency: int | None, rate: int | None, period: float, now: datetime, limit: int
    ) -> None:
        super().__init__()
        self.queue, self.concurrency, self.rate = queue, concurrency, rate
        self.period, self.now, self.limit = period, now, limit
        self.result: list[QueuedRun] = []
        self.retry_after: float | None = None

    def apply(self, conn: apsw.Connection) -> None:
        self.error = None
        self.result, self.retry_after = [], None
        entries = [_flow_run(row) for row in conn.execute(_SQL_QUEUE_RUNS, (self.queue,)).fetchall()]
        running: dict[str, int] = {}
        for entry in entries:
            if entry.state == ADMITTED:
                running[entry.partition_key] = running.get(entry.partition_key, 0) + 1
        now_us = _codec.to_us(self.now)
        for entry in entries:
            if len(self.result) >= self.limit:
                break
            if entry.state == ADMITTED:
                continue
            part = entry.partition_key
            if self.concurrency is not None and running.get(part, 0) >= self.concurrency:
                continue
            key = f"queue:{self.queue}\x1f{part}"
            if self.rate is not None:
                wait = rate_window(
                    _window(conn, key, self.period, self.now), self.rate, self.period, self.now
                )
                if wait is not None:
                    self.retry_after = wait if self.retry_after is None else min(self.retry_after, wait)
                    continue
                conn.execute(_SQL_ADD_START, (key, now_us))
            running[part] = running.get(part, 0) + 1
            conn.execute(_SQL_ADMIT_RUN, (entry.seq,))
            self.result.append(attrs.evolve(entry, state=ADMITTED))


class FinishRunOp(WriteOp):
    __slots__ = ("queue", "result", "workflow_id")
    doing = "removing a finished queued run"

    def __init__(self, queue: str, workflow_id: str) -> None:
        super().__init__()
        self.queue, self.workflow_id, self.result = queue, workflow_id, False

    def apply(self, conn: apsw.Connection) -> None:
        self.error = None
        conn.execute(_SQL_FINISH_RUN, (self.queue, self.workflow_id))
        self.result = conn.changes() > 0


_SQL_RENEW_WAITERS = "UPDATE flow_waiters SET expires_at = ? WHERE holder = ? AND expires_at > ?"
_SQL_RECORD_WAITER = (
    "INSERT OR REPLACE INTO flow_waiters (workflow_id, run_id, activity_id, attempt, pool, limit_text,"
    " priority, since, holder, expires_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
_SQL_REMOVE_WAITER = "DELETE FROM flow_waiters WHERE workflow_id = ? AND run_id = ? AND activity_id = ?"
_SQL_WAITERS = (
    "SELECT workflow_id, run_id, activity_id, attempt, pool, limit_text, priority, since, holder,"
    " expires_at FROM flow_waiters WHERE workflow_id = ? AND expires_at > ? ORDER BY run_id, activity_id"
)
_SQL_CLEAR_WAITERS = "DELETE FROM flow_waiters"


class RecordWaiterOp(WriteOp):
    """Record (or replace) an attempt waiting for a slot, lapsing ``ttl`` from ``now``."""

    __slots__ = ("now", "ttl", "waiter")
    doing = "recording a flow waiter"
    fenced = False

    def __init__(self, waiter: FlowWaiter, ttl: float, now: datetime) -> None:
        super().__init__()
        self.waiter, self.ttl, self.now = waiter, ttl, now

    def apply(self, conn: apsw.Connection) -> None:
        self.error = None
        w = self.waiter
        expires = _codec.to_us(self.now + timedelta(seconds=self.ttl))
        conn.execute(
            _SQL_RECORD_WAITER,
            (
                w.workflow_id,
                w.run_id,
                w.activity_id,
                w.attempt,
                w.pool,
                w.limit,
                w.priority,
                _codec.to_us(w.since),
                w.holder,
                expires,
            ),
        )


class RemoveWaiterOp(WriteOp):
    __slots__ = ("activity_id", "result", "run_id", "workflow_id")
    doing = "removing a flow waiter"
    fenced = False

    def __init__(self, workflow_id: str, run_id: str, activity_id: int) -> None:
        super().__init__()
        self.workflow_id, self.run_id, self.activity_id, self.result = workflow_id, run_id, activity_id, False

    def apply(self, conn: apsw.Connection) -> None:
        self.error = None
        conn.execute(_SQL_REMOVE_WAITER, (self.workflow_id, self.run_id, self.activity_id))
        self.result = conn.changes() > 0


class ClearWaitersOp(WriteOp):
    __slots__ = ("result",)
    doing = "clearing flow waiters"
    fenced = False

    def __init__(self) -> None:
        super().__init__()
        self.result = 0

    def apply(self, conn: apsw.Connection) -> None:
        self.error = None
        conn.execute(_SQL_CLEAR_WAITERS)
        self.result = conn.changes()


def _flow_waiter(workflow_id: str, row: Any) -> FlowWaiter:
    _, run_id, activity_id, attempt, pool, limit, priority, since, holder, expires_at = row
    return FlowWaiter(
        workflow_id=workflow_id,
        run_id=run_id,
        activity_id=_int(activity_id),
        attempt=_int(attempt),
        pool=pool,
        limit=limit,
        priority=_int(priority),
        since=_codec.from_us(_int(since)),
        holder=holder,
        expires_at=_codec.from_us(_int(expires_at)),
    )


def flow_waiters_read(workflow_id: str, now: datetime) -> ReadOp[list[FlowWaiter]]:
    def run(conn: apsw.Connection) -> list[FlowWaiter]:
        rows = conn.execute(_SQL_WAITERS, (workflow_id, _codec.to_us(now))).fetchall()
        return [_flow_waiter(workflow_id, row) for row in rows]

    return ReadOp(run)


def flow_runs_read(queue: str | None) -> ReadOp[list[QueuedRun]]:
    def run(conn: apsw.Connection) -> list[QueuedRun]:
        rows = conn.execute(_SQL_ALL_FLOW_RUNS) if queue is None else conn.execute(_SQL_QUEUE_RUNS, (queue,))
        return [_flow_run(row) for row in rows]

    return ReadOp(run)
