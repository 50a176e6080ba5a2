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

from aion_trio import AionError
from aion_trio.plugin import (
    CommandDecodeError,
    CommandOutcome,
    NotFound,
    OwnerClaim,
    OwnerIdentity,
    PendingCommand,
    ScheduleAlreadyExists,
    ScheduleConflict,
    StoreDecodeError,
    StoredSchedule,
    command_from_data_json,
    decide_claim,
    decide_renew,
    outcome_from_json,
    outcome_to_json,
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
