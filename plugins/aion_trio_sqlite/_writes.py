"""The writes the writer thread applies, alone or as a group.

:func:`apply_group` is the fast path: the heads of every workflow in the
group come from one statement, each append is checked against them (a refused
batch writes nothing), then all accepted events go in with one more statement
and the new or changed workflow rows with a third.  The heads come back as one
JSON value (one SQLite step, so the GIL is released and retaken once, not
once per workflow: a writer thread that gives the GIL up often spends most
of its time waiting to get it back from the busy Trio thread).  A group of
one append (one writer) skips all of that: :data:`SQL_AT_HEAD` checks its
head with one two-key seek, then its events and, if needed, its workflow row
go in (measured on a warm connection, 19.9 -> 15.5 us of CPU for the whole
transaction of a 3-event batch with ``synchronous=OFF``).  Events go in
with ``executemany``: measured, a ``json_each`` insert or multi-row
``VALUES`` costs SQLite twice the CPU and was slower overall.  If any statement fails
for a reason that is not the transaction's (a value SQLite refuses), the
writer rolls back and replays the group one write at a time with
:meth:`WriteOp.apply` to isolate the culprit.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import apsw

from aion_trio import AionInternalError
from aion_trio.plugin import SequenceConflict, StoreEncodeError, fenced_write

from ._codec import EventRow
from ._mapping import cause, runtime_error

SQL_HEAD = "SELECT max(seq) FROM events WHERE workflow_id = ?"
SQL_OWNER_TOKEN = "SELECT token FROM owner WHERE id = 1"
SQL_OWNER_WHO = "SELECT pid, host FROM owner WHERE id = 1"
# The rows of seq ``expected`` and ``expected + 1``: the head is ``expected``
# exactly when this counts 1 (0 when ``expected`` is 0), because a workflow's
# seqs run 1..head without gaps.  It reads at most two adjacent keys; the
# aggregate ``max(seq)`` costs SQLite about three times as much.
SQL_AT_HEAD = "SELECT count(*) FROM events WHERE workflow_id = ? AND seq BETWEEN ? AND ?"
SQL_INSERT_EVENT = "INSERT INTO events (workflow_id, seq, recorded_at, type, data) VALUES (?, ?, ?, ?, ?)"
SQL_HEADS = (
    "SELECT json_group_array(json_array(j.value,"
    " (SELECT max(e.seq) FROM events AS e WHERE e.workflow_id = j.value)))"
    " FROM json_each(?) AS j"
)
# A new workflow gets its row (status NULL until a lifecycle event); an
# existing one is only rewritten when the batch changes its status.
SQL_UPSERT_WORKFLOW = (
    "INSERT INTO workflows (workflow_id, status) VALUES (?, ?)"
    " ON CONFLICT (workflow_id) DO UPDATE SET status = coalesce(excluded.status, workflows.status)"
)


def stored_head(conn: apsw.Connection, workflow_id: str) -> int:
    """The last seq stored for ``workflow_id`` (0 when it has no events)."""
    value = conn.execute(SQL_HEAD, (workflow_id,)).fetchall()[0][0]
    return 0 if value is None else int(value)


class WriteOp:
    """One write request.  The writer thread fills in ``error`` (``None``: written)."""

    __slots__ = ("done", "error", "task")
    doing = "writing"
    is_append = False
    #: A write with no need of a commit of its own (see :class:`RiderOp`).
    rider = False
    #: Refused once this handle's claim on the store was taken over (see :func:`fence`);
    #: the claim's own writes and inbox commands are not.
    fenced = True

    def __init__(self) -> None:
        self.task: Any = None
        self.error: BaseException | None = None
        #: Set by the writer thread once ``error`` is final (read by a listener, see ``Writer.submit``).
        self.done = False

    def apply(self, conn: apsw.Connection) -> None:
        """Write inside the open transaction, or set ``error`` to a refusal and write nothing."""
        raise NotImplementedError

    def local_error(self, exc: BaseException, location: str) -> BaseException:
        """The error for a failure that concerns this write alone (a value SQLite refused)."""
        if isinstance(exc, apsw.Error):
            return runtime_error(exc, location, self.doing)
        return cause(
            AionInternalError(
                f"{location}: {self.doing} failed: {type(exc).__name__}: {exc}; please report it"
            ),
            exc,
        )


class AppendOp(WriteOp):
    __slots__ = ("expected_seq", "rows", "status", "workflow_id")
    doing = "appending events"
    is_append = True

    def __init__(self, workflow_id: str, expected_seq: int, rows: list[EventRow], status: str | None) -> None:
        super().__init__()
        self.workflow_id = workflow_id
        self.expected_seq = expected_seq
        self.rows = rows
        self.status = status

    def apply(self, conn: apsw.Connection) -> None:
        head = stored_head(conn, self.workflow_id)
        if head != self.expected_seq:
            self.error = SequenceConflict(self.workflow_id, self.expected_seq, head)
            return
        self.error = None
        conn.executemany(SQL_INSERT_EVENT, self.rows)
        if head == 0 or self.status is not None:
            conn.execute(SQL_UPSERT_WORKFLOW, (self.workflow_id, self.status))

    def local_error(self, exc: BaseException, location: str) -> BaseException:
        if isinstance(exc, (UnicodeError, OverflowError, apsw.TooBigError)):
            return cause(
                StoreEncodeError(
                    self.workflow_id,
                    self.rows[0][1],
                    f"SQLite cannot store this batch: {type(exc).__name__}: {exc}",
                    location=location,
                ),
                exc,
            )
        return super().local_error(exc, location)


class StatementOp(WriteOp):
    """A write made of fixed statements: ``(sql, params, executemany?)``."""

    __slots__ = ("doing", "statements")

    def __init__(self, doing: str, statements: Sequence[tuple[str, Any, bool]]) -> None:
        super().__init__()
        self.doing = doing
        self.statements = statements

    def apply(self, conn: apsw.Connection) -> None:
        self.error = None
        for sql, params, many in self.statements:
            if many:
                conn.executemany(sql, params)
            else:
                conn.execute(sql, params)


class RiderOp(StatementOp):
    """A statement write that waits for a commit to ride along with.

    A visibility row is a projection of history, reconciled from it at
    recovery; nothing waits for it but ``list``/``count``.  So instead of a
    commit (an fsync) of its own, which a workflow's next append would queue
    behind, the writer thread holds a group made only of riders for up to
    :data:`~._threads.RIDER_WAIT` for another write to join, and an inline
    commit takes the queued riders along.  It still returns only once committed.
    """

    __slots__ = ()
    rider = True


def fence(conn: apsw.Connection, ops: Sequence[WriteOp], token: str, location: str) -> Sequence[WriteOp]:
    """The writes of ``ops`` to apply in the open transaction: all of them while the stored claim
    is still ``token``'s (one primary-key read); otherwise the fenced ones are refused with
    ``StoreTakenOver`` and write nothing (an engine taken for dead and taken over, then resumed)."""
    for (stored,) in conn.execute(SQL_OWNER_TOKEN):
        if stored == token:
            return ops
    holder = None
    for pid, host in conn.execute(SQL_OWNER_WHO):
        holder = f"pid {pid} on host {host!r}"
    kept = []
    for op in ops:
        if op.fenced:
            op.error = fenced_write(location, holder, op.doing)
        else:
            kept.append(op)
    return kept


def _json(value: object) -> str:
    # ensure_ascii=False: text SQLite cannot store (lone surrogates) fails at
    # bind time, sending the group down the one-write-at-a-time path.
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def apply_group(conn: apsw.Connection, group: Sequence[WriteOp]) -> None:
    """Apply every write of ``group`` inside the open transaction (the fast path)."""
    if len(group) == 1:
        op = group[0]
        if op.is_append:
            _apply_lone_append(conn, op)  # type: ignore[arg-type]
        else:
            op.apply(conn)
        return
    appends = [op for op in group if op.is_append]
    if appends:
        _apply_appends(conn, appends)  # type: ignore[arg-type]
    for op in group:
        if not op.is_append:
            op.apply(conn)


def _apply_lone_append(conn: apsw.Connection, op: AppendOp) -> None:
    # A group of one append: no JSON, no dicts; the exact head is read only
    # for the error of a refused batch.
    wid = op.workflow_id
    expected = op.expected_seq
    for (found,) in conn.execute(SQL_AT_HEAD, (wid, expected, expected + 1)):
        if found != (expected > 0):
            op.error = SequenceConflict(wid, expected, stored_head(conn, wid))
            return
    op.error = None
    conn.executemany(SQL_INSERT_EVENT, op.rows)
    if expected == 0 or op.status is not None:
        conn.execute(SQL_UPSERT_WORKFLOW, (wid, op.status))


def _heads(conn: apsw.Connection, appends: list[AppendOp]) -> dict[str, int]:
    if len(appends) == 1:
        # One append among other writes: a plain seek, no JSON either way.
        wid = appends[0].workflow_id
        return {wid: stored_head(conn, wid)}
    wids = list(dict.fromkeys(op.workflow_id for op in appends))
    text = conn.execute(SQL_HEADS, (_json(wids),)).fetchall()[0][0]
    assert isinstance(text, str)
    return {wid: head or 0 for wid, head in json.loads(text)}


def _apply_appends(conn: apsw.Connection, appends: list[AppendOp]) -> None:
    heads = _heads(conn, appends)
    statuses: dict[str, str | None] = {}
    rows: list[EventRow] = []
    for op in appends:
        wid = op.workflow_id
        head = heads[wid]
        if head != op.expected_seq:
            op.error = SequenceConflict(wid, op.expected_seq, head)
            continue
        op.error = None
        rows += op.rows
        heads[wid] = head + len(op.rows)
        if op.status is not None:
            statuses[wid] = op.status
        elif head == 0:
            statuses.setdefault(wid, None)
    if rows:
        conn.executemany(SQL_INSERT_EVENT, rows)
    if statuses:
        conn.executemany(SQL_UPSERT_WORKFLOW, list(statuses.items()))
