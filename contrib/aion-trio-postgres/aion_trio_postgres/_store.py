"""The store objects the opener yields, the node lease, and the opener itself."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import logging
import math
import operator
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import datetime
from typing import Any, NoReturn, TypeVar, cast, final

import attrs
import psycopg
import psycopg_pool
import trio

from aion_trio import ActivityOutcome, ActivityRequest, AionInternalError
from aion_trio.plugin import (
    BackendUnavailable,
    Command,
    CommandOutcome,
    Event,
    FlowGrant,
    FlowWaiter,
    NodeInUse,
    NotFound,
    OwnerIdentity,
    PendingCommand,
    QueuedRun,
    ScheduleAlreadyExists,
    ScheduleConflict,
    SequenceConflict,
    StoredSchedule,
    StoreEncodeError,
    StoreError,
    StoreTakenOver,
    TimerEntry,
    VisibilityFilter,
    VisibilityRow,
    WorkflowFenced,
    command_data_json,
    command_from_data_json,
    hold_mock_time,
    outcome_from_json,
    outcome_to_json,
    owner_alive,
    status_after,
    this_host,
    validate_batch,
    validate_flow_key,
    validate_flow_waiter,
    validate_schedule_write,
    validate_workflow_ids,
)

from . import _codec, _flow
from ._batch import BatchQueue, PendingAppend, PendingUpsert
from ._hangwatch import HangWatch, hang_bound
from ._listen import Listener
from ._mapping import backend_error, cause
from ._schema import (
    ACTIVE_LIST,
    ACTIVE_STATUSES,
    SQLSTATE_NOT_OWNER,
    SQLSTATE_SEQUENCE_CONFLICT,
    configure,
    migrate,
)
from ._url import PostgresUrl, parse_postgres_url

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup  # type: ignore[import-not-found,unused-ignore]

logger = logging.getLogger("aion_trio.postgres")
ACTIVE_LIST_VALUES = frozenset(ACTIVE_STATUSES)

T = TypeVar("T")
Conn = psycopg.Connection[Any]

# --------------------------------------------------------------------------
# SQL (constant text; every value is bound)
# --------------------------------------------------------------------------

_SQL_COUNT_RECOVERY = (
    "INSERT INTO recoveries (workflow_id, count) VALUES (%s, 1)"
    " ON CONFLICT (workflow_id) DO UPDATE SET count = recoveries.count + 1 RETURNING count"
)
_SQL_CLEAR_RECOVERIES = "DELETE FROM recoveries WHERE workflow_id = ANY(%s)"
_SQL_RECOVERIES = "SELECT workflow_id, count FROM recoveries ORDER BY workflow_id"
_SQL_CREATE_SCHEDULE = "INSERT INTO schedules (schedule_id, version, data) VALUES (%s, 1, %s) ON CONFLICT (schedule_id) DO NOTHING"
_SQL_WRITE_SCHEDULE = (
    "UPDATE schedules SET version = version + 1, data = %s WHERE schedule_id = %s AND version = %s"
)
_SQL_SCHEDULE_VERSION = "SELECT version FROM schedules WHERE schedule_id = %s"
_SQL_DELETE_SCHEDULE = "DELETE FROM schedules WHERE schedule_id = %s"
_SQL_SCHEDULE = "SELECT schedule_id, version, data FROM schedules WHERE schedule_id = %s"
_SQL_SCHEDULES = "SELECT schedule_id, version, data FROM schedules ORDER BY schedule_id"
_SQL_APPEND = (
    "SELECT aion_append(%s, %s, %s, %s, %s, %s::timestamptz[], %s::text[], %s::text[], %s,"
    " %s::text[], %s::timestamptz[], %s::text[])"
)
_SQL_APPEND_BATCH = (
    "SELECT epoch, state, message, detail FROM aion_append_batch(%s, %s, %s::text[], %s::bigint[],"
    " %s::bigint[], %s::text[], %s::integer[], %s::timestamptz[], %s::text[], %s::text[], %s::integer[],"
    " %s::text[], %s::timestamptz[], %s::integer[], %s::text[])"
)
_SQL_CLAIM = "SELECT aion_claim(%s, %s, %s)"
_SQL_READ_HISTORY = (
    "SELECT seq, recorded_at, type, data FROM events WHERE workflow_id = %s AND seq >= %s ORDER BY seq"
)
_SQL_READ_HISTORIES = (
    "SELECT workflow_id, seq, recorded_at, type, data FROM events WHERE workflow_id = ANY(%s)"
    " ORDER BY workflow_id, seq"
)
_SQL_LIST_ACTIVE = f"SELECT workflow_id FROM workflows WHERE status IN ({ACTIVE_LIST}) ORDER BY workflow_id"
_SQL_LIST_WORKFLOWS = "SELECT workflow_id FROM workflows WHERE head > 0 ORDER BY workflow_id"
_SQL_SCHEDULE_TIMER = (
    "INSERT INTO timers (workflow_id, timer_id, fire_at) VALUES (%s, %s, %s)"
    " ON CONFLICT (workflow_id, timer_id) DO UPDATE SET fire_at = excluded.fire_at"
)
_SQL_REMOVE_TIMER = "DELETE FROM timers WHERE workflow_id = %s AND timer_id = %s"
_SQL_EXPIRED_TIMERS = "SELECT fire_at, workflow_id, timer_id FROM timers WHERE fire_at <= %s ORDER BY fire_at, workflow_id, timer_id"
_SQL_CLEAR_SEARCH = "DELETE FROM search_attrs WHERE workflow_id = %s"
_SQL_UPSERT_VISIBILITY = (
    f"INSERT INTO visibility ({_codec.VISIBILITY_COLUMNS}) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
    " ON CONFLICT (workflow_id) DO UPDATE SET run_id = excluded.run_id,"
    " workflow_type = excluded.workflow_type, status = excluded.status, start_time = excluded.start_time,"
    " close_time = excluded.close_time, task_queue = excluded.task_queue,"
    " failed_step = excluded.failed_step, failure_reason = excluded.failure_reason,"
    " stuck_reason = excluded.stuck_reason, search_attributes = excluded.search_attributes"
)
_SQL_INSERT_SEARCH = (
    "INSERT INTO search_attrs (workflow_id, key, part, kind, num, txt) VALUES (%s, %s, %s, %s, %s, %s)"
)
_SQL_GET_VISIBILITY = f"SELECT {_codec.VISIBILITY_COLUMNS} FROM visibility WHERE workflow_id = %s"
# One reading of the database clock per statement, so renewed_at + ttl == lease_expires_at.
_SQL_REGISTER_NODE = (
    "INSERT INTO nodes (node_id, incarnation, lease_expires_at, started_at, renewed_at, host, pid, process)"
    " SELECT %s, 1, c.t + make_interval(secs => %s), c.t, c.t, %s, %s, %s"
    " FROM (SELECT clock_timestamp() AS t) AS c"
    " ON CONFLICT (node_id) DO UPDATE SET incarnation = nodes.incarnation + 1,"
    " lease_expires_at = excluded.lease_expires_at, started_at = excluded.started_at,"
    " renewed_at = excluded.renewed_at, host = excluded.host, pid = excluded.pid, process = excluded.process"
    " RETURNING incarnation, lease_expires_at"
)
# The node id's current holder, locked until the registration commits: two opens
# of one id serialise here, and the second sees the first's live lease.
_SQL_NODE_HOLDER = (
    "SELECT host, pid, process, started_at, lease_expires_at, lease_expires_at > clock_timestamp()"
    " FROM nodes WHERE node_id = %s FOR UPDATE"
)
_SQL_RENEW_LEASE = (
    "UPDATE nodes SET lease_expires_at = c.t + make_interval(secs => %s), renewed_at = c.t"
    " FROM (SELECT clock_timestamp() AS t) AS c"
    " WHERE node_id = %s AND incarnation = %s RETURNING lease_expires_at"
)
_SQL_RELEASE_LEASE = (
    "UPDATE nodes SET lease_expires_at = clock_timestamp() WHERE node_id = %s AND incarnation = %s"
)
_SQL_NOTIFY = "SELECT pg_notify(%s, %s)"
_SQL_CHECK_INCARNATION = "SELECT incarnation FROM nodes WHERE node_id = %s FOR SHARE"
_SQL_OWNED_ACTIVE = (
    "UPDATE workflows SET owner_epoch = owner_epoch + 1"
    f" WHERE owner_node = %s AND status IN ({ACTIVE_LIST}) RETURNING workflow_id, owner_epoch"
)
# The orphans: active, not ours, and unowned or owned by a node whose lease has
# run out by the database clock.  SKIP LOCKED: a row another sweeper (or an
# append) holds is left to it, so concurrent sweepers never claim one twice.
# The owner's lease is looked up in a subquery, not a join: a row claimed and
# committed meanwhile is re-checked with its new owner (a joined row would be
# re-checked as it was, and the claim would be taken twice).
_SQL_CLAIM_ORPHANS = (
    "WITH c AS (SELECT w.workflow_id FROM workflows w"
    f" WHERE w.status IN ({ACTIVE_LIST}) AND w.owner_node IS DISTINCT FROM %(me)s"
    " AND (w.owner_node IS NULL OR NOT EXISTS (SELECT 1 FROM nodes n WHERE n.node_id = w.owner_node"
    " AND n.lease_expires_at > clock_timestamp()))"
    " ORDER BY w.workflow_id LIMIT %(limit)s FOR UPDATE SKIP LOCKED)"
    " UPDATE workflows w SET owner_node = %(me)s, owner_epoch = w.owner_epoch + 1 FROM c"
    " WHERE w.workflow_id = c.workflow_id RETURNING w.workflow_id, w.owner_epoch"
)
_SQL_OWNER_OF = (
    "SELECT w.owner_node, w.status, w.head, n.lease_expires_at > clock_timestamp()"
    " FROM workflows w LEFT JOIN nodes n ON n.node_id = w.owner_node WHERE w.workflow_id = %s"
)
_SQL_ENQUEUE = (
    "WITH c AS (INSERT INTO inbox (workflow_id, type, data, request_id) VALUES (%s, %s, %s, %s)"
    " ON CONFLICT (request_id) WHERE request_id IS NOT NULL DO NOTHING RETURNING id, workflow_id)"
    " SELECT c.id, pg_notify(%s, coalesce((SELECT w.owner_node FROM workflows w"
    " WHERE w.workflow_id = c.workflow_id), '')) FROM c"
)
_SQL_COMMAND_OF_REQUEST = "SELECT id FROM inbox WHERE request_id = %s"
_SQL_PENDING = (
    "SELECT i.id, i.type, i.data FROM inbox i JOIN workflows w ON w.workflow_id = i.workflow_id"
    " WHERE NOT i.acked AND w.owner_node = %s ORDER BY i.id LIMIT %s"
)
_SQL_ACK = "UPDATE inbox SET acked = true, outcome = %s WHERE id = %s AND NOT acked RETURNING id"
_SQL_INBOX_ROW = "SELECT acked, outcome FROM inbox WHERE id = %s"


# --------------------------------------------------------------------------
# The backend: a connection pool used from worker threads
# --------------------------------------------------------------------------


@final
@attrs.define(eq=False)
class NodeLease:
    """This store's node identity and its lease, as last seen (times by the database clock)."""

    node_id: str
    incarnation: int
    """Bumped each time a store opens with this node id; an older incarnation is fenced."""
    lease_ttl: float
    expires_at: datetime
    superseded: bool = False
    """True once a renewal found a newer incarnation of this node id."""
    valid_until: float = 0.0
    """Local judgement (``time.monotonic()``): the send time of the last successful
    registration or renewal, plus ``lease_ttl``, minus :meth:`margin`."""

    def margin(self) -> float:
        """The safety margin taken off the lease locally: a fifth of it, at most 5 seconds."""
        return min(self.lease_ttl / 5, 5.0)

    def renewed(self, sent: float) -> None:
        """A registration or renewal sent at ``sent`` (monotonic) succeeded."""
        self.valid_until = max(self.valid_until, sent + self.lease_ttl - self.margin())

    def valid(self) -> bool:
        """Whether this node may still act as owner: not superseded, and before ``valid_until``."""
        return not self.superseded and time.monotonic() < self.valid_until


@attrs.define(eq=False)
class _Backend:
    url: PostgresUrl
    pool: psycopg_pool.ConnectionPool[Any]
    limiter: trio.CapacityLimiter
    """The store's calls at once (``pool_size``)."""
    held: trio.CapacityLimiter
    """No limit: for a call whose caller already holds a slot of ``limiter`` (a batch of appends)."""
    lease_limiter: trio.CapacityLimiter
    """The node lease's renewals, one at a time on the pool's one connection beyond
    ``pool_size``: a renewal never waits behind the store's other calls."""
    node: NodeLease | None
    listener: Listener
    """The store's one LISTEN connection (its thread starts with the first subscriber)."""
    hangs: HangWatch
    """Abandons the connection of a call that gets no answer (see :mod:`._hangwatch`)."""
    closed: bool = False

    @property
    def location(self) -> str:
        return self.url.location

    @property
    def channel(self) -> str:
        """The NOTIFY channel of this schema (channels are database-wide)."""
        return notify_channel(self.url.schema)

    async def run(
        self, doing: str, function: Callable[[Conn], T], *, limiter: trio.CapacityLimiter | None = None
    ) -> T:
        """Run ``function(conn)`` in a worker thread on a pooled connection, under ``limiter``
        (default: the store's own).

        Never abandoned: a call cancelled before its thread started raised
        ``trio.Cancelled`` and did nothing; once started it finishes (every
        transaction it opens commits or rolls back) and returns normally,
        and the cancellation arrives at the caller's next checkpoint.
        """
        with hold_mock_time():  # a MockClock's autojump waits for the database
            return await trio.to_thread.run_sync(
                self._call, doing, function, limiter=self.limiter if limiter is None else limiter
            )

    def _call(self, doing: str, function: Callable[[Conn], T]) -> T:
        abandoned: list[bool] = []
        try:
            with (
                self.pool.connection(timeout=self.url.pool_timeout) as conn,
                self.hangs.watching(conn, doing) as abandoned,
            ):
                return function(conn)
        except (StoreError, trio.ClosedResourceError):
            raise
        except (psycopg.Error, psycopg_pool.PoolTimeout, psycopg_pool.PoolClosed) as exc:
            if abandoned:
                raise BackendUnavailable(
                    f"{self.location}: {doing} failed: no answer within {self.hangs.bound:.1f}s "
                    f"(statement_timeout {self.url.statement_timeout:g}s + margin), so its connection "
                    "was abandoned; the outcome is unknown, a retry is safe"
                ) from exc
            raise backend_error(exc, self.location, doing) from exc


@final
@attrs.define(eq=False)
class _InCallOrder:
    """Writes to one key apply in the order they were called (a FIFO lock per key).

    Callers compute what they write at call time (the engine derives a
    visibility row from the history it holds), so a later call must never be
    overtaken by an earlier one still waiting for a worker thread.  trio.Lock
    is fair: waiters acquire it in arrival order.
    """

    _locks: dict[object, tuple[trio.Lock, int]] = attrs.field(factory=dict, init=False)

    def waiting(self, key: object) -> int:
        """How many calls for ``key`` wait behind the one in progress."""
        found = self._locks.get(key)
        return 0 if found is None else found[0].statistics().tasks_waiting

    @contextlib.asynccontextmanager
    async def hold(self, key: object) -> AsyncIterator[None]:
        lock, users = self._locks.get(key, (None, 0))
        if lock is None:
            lock = trio.Lock()
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[key]
            if users == 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)


class _Facade:
    _backend: _Backend
    _closed: bool

    @property
    def location(self) -> str:
        """The server, database and schema (never the password)."""
        return self._backend.location

    async def _enter(self) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._closed or self._backend.closed:
            await trio.lowlevel.cancel_shielded_checkpoint()
            raise trio.ClosedResourceError(f"{type(self).__name__} of {self._backend.location} is closed")

    async def aclose(self) -> None:
        """Close this half of the store (idempotent); later calls raise ``trio.ClosedResourceError``."""
        self._closed = True
        await trio.lowlevel.checkpoint()


async def _refuse(error: BaseException) -> NoReturn:
    await trio.lowlevel.cancel_shielded_checkpoint()
    raise error


def _check_aware(name: str, value: object) -> datetime | ValueError:
    if not isinstance(value, datetime) or value.tzinfo is None or value.utcoffset() is None:
        return ValueError(f"{name} must be a timezone-aware datetime, got {value!r}")
    return value


# --------------------------------------------------------------------------
# Event store
# --------------------------------------------------------------------------


def _refusal(
    item: PendingAppend, state: str | None, primary: str, detail: str | None, original: BaseException
) -> Exception | None:
    """The typed refusal the append function raised for ``item``, or ``None`` for any other error."""
    if state == SQLSTATE_SEQUENCE_CONFLICT:
        return cause(SequenceConflict(item.workflow_id, item.expected_seq, int(detail or "0")), original)
    if state == SQLSTATE_NOT_OWNER:
        return cause(WorkflowFenced(item.workflow_id, primary), original)
    if state is not None and state.startswith("22"):  # data exception: a value it cannot hold
        return cause(
            StoreEncodeError(
                item.workflow_id, item.first_seq, f"PostgreSQL cannot store this batch: {primary}"
            ),
            original,
        )
    return None


def _append_one(conn: Conn, *, node: NodeLease | None, item: PendingAppend) -> int:
    """One append on its own: one call of ``aion_append``."""
    batch = item.encoded
    params = (
        item.workflow_id,
        item.expected_seq,
        None if node is None else node.node_id,
        None if node is None else node.incarnation,
        item.epoch,
        batch.recorded_at,
        batch.types,
        batch.data,
        item.status,
        batch.timer_ids,
        batch.timer_fire_at,
        batch.dropped_timers,
    )
    try:
        row = conn.execute(_SQL_APPEND, params).fetchone()
    except psycopg.Error as exc:
        refusal = _refusal(
            item, exc.sqlstate, exc.diag.message_primary or str(exc), exc.diag.message_detail, exc
        )
        if refusal is not None:
            raise refusal from exc
        raise
    except UnicodeError as exc:
        raise StoreEncodeError(
            item.workflow_id, item.first_seq, f"PostgreSQL cannot store this batch: {exc}"
        ) from exc
    assert row is not None
    return int(row[0])


def _append_many(
    conn: Conn, node: NodeLease | None, items: Sequence[PendingAppend], location: str
) -> list[int | Exception]:
    """Several appends in one call of ``aion_append_batch`` (one transaction, each item a
    subtransaction), in workflow id order (stable: one workflow's appends keep their order),
    so two batches lock the workflow rows they share in the same order.  Returns each item's
    epoch or typed error, in the order of ``items``."""
    order = sorted(range(len(items)), key=lambda i: items[i].workflow_id)
    ids: list[str] = []
    expected: list[int] = []
    epochs: list[int | None] = []
    statuses: list[str | None] = []
    event_ends: list[int] = []
    timer_ends: list[int] = []
    dropped_ends: list[int] = []
    recorded_at: list[datetime] = []
    types: list[str] = []
    data: list[str] = []
    timer_ids: list[str] = []
    timer_fire_at: list[datetime] = []
    dropped: list[str] = []
    for i in order:
        item = items[i]
        batch = item.encoded
        ids.append(item.workflow_id)
        expected.append(item.expected_seq)
        epochs.append(item.epoch)
        statuses.append(item.status)
        recorded_at += batch.recorded_at
        types += batch.types
        data += batch.data
        timer_ids += batch.timer_ids
        timer_fire_at += batch.timer_fire_at
        dropped += batch.dropped_timers
        event_ends.append(len(types))
        timer_ends.append(len(timer_ids))
        dropped_ends.append(len(dropped))
    params = (
        None if node is None else node.node_id,
        None if node is None else node.incarnation,
        ids,
        expected,
        epochs,
        statuses,
        event_ends,
        recorded_at,
        types,
        data,
        timer_ends,
        timer_ids,
        timer_fire_at,
        dropped_ends,
        dropped,
    )
    rows = conn.execute(_SQL_APPEND_BATCH, params).fetchall()
    if len(rows) != len(items):
        raise AionInternalError(f"{location}: aion_append_batch returned {len(rows)} rows for {len(items)}")
    out: list[int | Exception] = [0] * len(items)
    for i, (epoch, state, message, detail) in zip(order, rows, strict=True):
        item = items[i]
        if state is None:
            out[i] = int(epoch)
            continue
        try:
            original: psycopg.Error = psycopg.errors.lookup(state)(message)
        except KeyError:
            original = psycopg.DatabaseError(message)
        refusal = _refusal(item, state, message or "", detail, original)
        out[i] = refusal if refusal is not None else backend_error(original, location, "appending events")
    return out


@final
@attrs.define(eq=False)
class PostgresEventStore(_Facade):
    """Event histories and the timer index in one PostgreSQL schema.

    Every method is a checkpoint.  Cancellation: a call cancelled before its
    worker thread started raises ``trio.Cancelled`` and did nothing; once
    started, its transaction commits or rolls back and the call returns (the
    cancellation then arrives at the caller's next checkpoint).

    Ownership: opened with a node identity (``?node=NAME``), the first append
    to a workflow (or :meth:`claim`) claims it for this node, bumping its
    fencing epoch; later appends carry that epoch and the database refuses
    them with :class:`~aion_trio.WorkflowFenced` once another node has claimed the
    workflow.  Opened without one, appends are refused for workflows some
    node owns.
    """

    _backend: _Backend = attrs.field(alias="backend")
    _closed: bool = attrs.field(default=False, init=False)
    _epochs: dict[str, int] = attrs.field(factory=dict, init=False)
    _timer_order: _InCallOrder = attrs.field(factory=_InCallOrder, init=False)
    _appends: BatchQueue[PendingAppend] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        backend = self._backend
        self._appends = BatchQueue(backend.limiter, self._write_appends, backend.url.append_batch)

    @property
    def node(self) -> NodeLease | None:
        """The node identity appends are fenced under (``None``: opened without ``?node=``)."""
        return self._backend.node

    def held_epoch(self, workflow_id: str) -> int | None:
        """The fencing epoch this store holds for ``workflow_id`` (``None``: not claimed by this store)."""
        return self._epochs.get(workflow_id)

    def _remember(self, workflow_id: str, epoch: int) -> None:
        # Epochs only grow, and concurrent claims by this store are all ours.
        self._epochs[workflow_id] = max(epoch, self._epochs.get(workflow_id, 0))

    async def append(self, workflow_id: str, events: Sequence[Event], expected_seq: int) -> None:
        """Append ``events`` after ``expected_seq``: all or nothing, committed when it returns.

        One server-side call checks the fence (:class:`~aion_trio.WorkflowFenced`)
        and the expected seq (:class:`~aion_trio.SequenceConflict`) and writes
        the events, the workflow row and the timer rows the batch causes
        (``TimerStarted`` upserts, ``TimerFired``/``TimerCancelled`` removes).
        ``BackendUnavailable`` means the outcome is unknown.  Appends that queue
        for a worker slot together share one call and one transaction, each on
        its own (a subtransaction); see the package docstring.
        """
        await self._enter()
        try:
            validate_batch(workflow_id, events, expected_seq)
            batch = _codec.encode_batch(workflow_id, events)
        except Exception as exc:
            await _refuse(exc)
        status = status_after(None, events)
        item = PendingAppend(
            workflow_id=workflow_id,
            expected_seq=expected_seq,
            first_seq=events[0].seq,
            epoch=self._epochs.get(workflow_id),
            status=None if status is None else status.value,
            encoded=batch,
        )
        epoch = int(await self._appends.submit(item))
        if self._backend.node is not None:
            self._remember(workflow_id, epoch)

    async def _write_appends(self, items: list[PendingAppend]) -> None:
        """Write a batch taken from the append queue (its caller holds a worker slot):
        alone, or together in one call; set every item's outcome, never raise."""
        backend = self._backend
        node = backend.node
        location = self.location
        if len(items) > 1:
            try:
                outcomes = await backend.run(
                    "appending events",
                    lambda conn: _append_many(conn, node, items, location),
                    limiter=backend.held,
                )
            except (BackendUnavailable, trio.ClosedResourceError) as exc:
                # Nothing known of any of them: each caller gets its own copy to raise.
                for item in items:
                    item.outcome = cause(type(exc)(*exc.args), exc)
                return
            except Exception:
                # The batch as a whole was refused (a value one item holds that the server
                # cannot take): each on its own, so the error reaches only its own caller.
                pass
            else:
                for item, outcome in zip(items, outcomes, strict=True):
                    item.outcome = outcome
                return
        for item in items:
            try:
                item.outcome = await backend.run(
                    "appending events",
                    functools.partial(_append_one, node=node, item=item),
                    limiter=backend.held,
                )
            except Exception as exc:
                item.outcome = exc

    async def claim(self, workflow_id: str) -> int:
        """Claim ``workflow_id`` for this node now and return the new fencing epoch.

        Succeeds when the workflow is unowned, owned by this node id, or owned
        by a node whose lease has expired by the database clock; otherwise
        raises :class:`~aion_trio.WorkflowFenced` naming the owner.  Every claim
        bumps the epoch, fencing whoever held it before.
        """
        await self._enter()
        node = self._backend.node
        if node is None:
            await _refuse(
                TypeError(f"{self.location}: claim() needs a node identity; open the store with ?node=NAME")
            )

        def run(conn: Conn) -> int:
            try:
                row = conn.execute(_SQL_CLAIM, (workflow_id, node.node_id, node.incarnation)).fetchone()
            except psycopg.Error as exc:
                if exc.sqlstate == SQLSTATE_NOT_OWNER:
                    raise WorkflowFenced(workflow_id, exc.diag.message_primary or "") from exc
                raise
            assert row is not None
            return int(row[0])

        epoch = await self._backend.run("claiming a workflow", run)
        self._remember(workflow_id, epoch)
        return epoch

    async def read_history(self, workflow_id: str, from_seq: int = 1) -> list[Event]:
        await self._enter()
        if "\x00" in workflow_id:  # PostgreSQL text cannot hold it, so no such workflow exists
            await trio.lowlevel.cancel_shielded_checkpoint()
            return []
        location = self.location

        def run(conn: Conn) -> list[Event]:
            rows = conn.execute(_SQL_READ_HISTORY, (workflow_id, from_seq)).fetchall()
            return _codec.decode_events(workflow_id, rows, location)

        return await self._backend.run("reading a history", run)

    async def list_active(self) -> list[str]:
        await self._enter()
        return await self._backend.run(
            "listing active workflows",
            lambda conn: [r[0] for r in conn.execute(_SQL_LIST_ACTIVE)],
        )

    async def list_workflow_ids(self) -> list[str]:
        await self._enter()
        return await self._backend.run(
            "listing workflows", lambda conn: [r[0] for r in conn.execute(_SQL_LIST_WORKFLOWS)]
        )

    async def schedule_timer(self, workflow_id: str, timer_id: str, fire_at: datetime) -> None:
        await self._enter()
        checked = _check_aware("fire_at", fire_at)
        if isinstance(checked, ValueError):
            await _refuse(checked)
        params = (workflow_id, timer_id, fire_at)
        async with self._timer_order.hold((workflow_id, timer_id)):
            await self._backend.run(
                "scheduling a timer", lambda conn: conn.execute(_SQL_SCHEDULE_TIMER, params)
            )

    async def remove_timer(self, workflow_id: str, timer_id: str) -> None:
        await self._enter()
        params = (workflow_id, timer_id)
        async with self._timer_order.hold((workflow_id, timer_id)):
            await self._backend.run("removing a timer", lambda conn: conn.execute(_SQL_REMOVE_TIMER, params))

    async def expired_timers(self, as_of: datetime) -> list[TimerEntry]:
        await self._enter()
        checked = _check_aware("as_of", as_of)
        if isinstance(checked, ValueError):
            await _refuse(checked)

        def run(conn: Conn) -> list[TimerEntry]:
            return [
                TimerEntry(fire_at=_codec.utc(at), workflow_id=w, timer_id=t)
                for at, w, t in conn.execute(_SQL_EXPIRED_TIMERS, (as_of,))
            ]

        return await self._backend.run("reading due timers", run)


def _upsert_one(conn: Conn, *, item: PendingUpsert) -> None:
    try:
        _upsert_many(conn, items=[item])
    except (psycopg.DataError, UnicodeError) as exc:
        raise StoreEncodeError(
            item.workflow_id, None, f"PostgreSQL cannot store this visibility row: {exc}"
        ) from exc


# --------------------------------------------------------------------------
# Visibility store
# --------------------------------------------------------------------------


def _upsert_many(conn: Conn, *, items: Sequence[PendingUpsert]) -> None:
    """Visibility upserts in one transaction, sent in one round trip (pipeline mode), in
    workflow id order (stable), so two batches lock the rows they share in the same order.

    Per row, the upsert comes first: its row lock serialises concurrent upserts of one
    workflow, so the delete after it (a new snapshot, read committed) sees and removes the
    search rows a racing upsert just committed.  A value the server refuses raises
    ``psycopg.DataError``; one psycopg cannot encode, ``UnicodeError``: nothing is written.
    """
    with conn.pipeline(), conn.transaction(), conn.cursor() as cur:
        for item in sorted(items, key=operator.attrgetter("workflow_id")):
            cur.execute(_SQL_UPSERT_VISIBILITY, item.params)
            cur.execute(_SQL_CLEAR_SEARCH, (item.workflow_id,))
            if item.search:
                cur.executemany(_SQL_INSERT_SEARCH, item.search)


@final
@attrs.define(eq=False)
class PostgresVisibilityStore(_Facade):
    """Visibility rows; filters and search predicates are evaluated in SQL. Same checkpoint and cancellation rules.

    Upserts of one workflow apply in the order they were called, as with a
    single-threaded store, even though several worker threads write at once.
    """

    _backend: _Backend = attrs.field(alias="backend")
    _closed: bool = attrs.field(default=False, init=False)
    _order: _InCallOrder = attrs.field(factory=_InCallOrder, init=False)
    _upserts: BatchQueue[PendingUpsert] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        backend = self._backend
        self._upserts = BatchQueue(backend.limiter, self._write_upserts, backend.url.append_batch)

    async def upsert(self, row: VisibilityRow) -> None:
        """Write ``row`` (and its search attributes), replacing the workflow's row.

        Upserts that queue for a worker slot together are written in one
        transaction, sent in one round trip (pipeline mode)."""
        await self._enter()
        if not isinstance(cast(object, row), VisibilityRow):
            await _refuse(TypeError(f"upsert needs a VisibilityRow, got {row!r}"))
        wid = row.workflow_id
        item = PendingUpsert(
            workflow_id=wid,
            params=_codec.visibility_params(row),
            search=_codec.search_rows(wid, row.search_attributes),
        )
        async with self._order.hold(wid):
            await self._upserts.submit(item)

    async def _write_upserts(self, items: list[PendingUpsert]) -> None:
        """Write a batch taken from the upsert queue (its caller holds a worker slot): in one
        transaction, or one by one when that fails for a reason other than the connection;
        set every item's outcome, never raise."""
        backend = self._backend
        if len(items) > 1:
            try:
                await backend.run(
                    "writing visibility rows",
                    functools.partial(_upsert_many, items=items),
                    limiter=backend.held,
                )
            except (BackendUnavailable, trio.ClosedResourceError) as exc:
                for item in items:
                    item.outcome = cause(type(exc)(*exc.args), exc)
                return
            except Exception:
                pass  # a row the server cannot take: each on its own, the error to its caller only
            else:
                for item in items:
                    item.outcome = True
                return
        for item in items:
            try:
                await backend.run(
                    "writing a visibility row",
                    functools.partial(_upsert_one, item=item),
                    limiter=backend.held,
                )
            except Exception as exc:
                item.outcome = exc
            else:
                item.outcome = True

    async def get(self, workflow_id: str) -> VisibilityRow | None:
        await self._enter()
        if "\x00" in workflow_id:
            await trio.lowlevel.cancel_shielded_checkpoint()
            return None
        location = self.location

        def run(conn: Conn) -> VisibilityRow | None:
            found = conn.execute(_SQL_GET_VISIBILITY, (workflow_id,)).fetchone()
            return None if found is None else _codec.decode_visibility(found, location)

        return await self._backend.run("reading a visibility row", run)

    async def list(self, filter: VisibilityFilter | None = None) -> list[VisibilityRow]:
        await self._enter()
        query, params = _codec.list_query(filter or VisibilityFilter())
        location = self.location

        def run(conn: Conn) -> list[VisibilityRow]:
            return [_codec.decode_visibility(r, location) for r in conn.execute(query, params)]

        return await self._backend.run("listing visibility rows", run)

    async def count(self, filter: VisibilityFilter | None = None) -> int:
        await self._enter()
        query, params = _codec.count_query(filter or VisibilityFilter())

        def run(conn: Conn) -> int:
            found = conn.execute(query, params).fetchone()
            assert found is not None
            return int(found[0])

        return await self._backend.run("counting visibility rows", run)


# --------------------------------------------------------------------------
# The opened store and the opener
# --------------------------------------------------------------------------


@attrs.define(eq=False)
class PostgresStore:
    """An opened PostgreSQL store: ``events`` and ``visibility`` over one schema."""

    events: PostgresEventStore
    visibility: PostgresVisibilityStore
    url: PostgresUrl
    _backend: _Backend = attrs.field(alias="backend", repr=False)

    @property
    def node(self) -> NodeLease | None:
        """This store's node identity and lease (``None``: opened without ``?node=``)."""
        return self._backend.node

    async def renew_lease(self) -> datetime:
        """Extend this node's lease by ``lease_ttl`` from now by the database clock; return the new expiry.

        Raises :class:`~aion_trio.StoreTakenOver` when a newer incarnation of this
        node id has been opened (this one is fenced for good).
        """
        await self.events._enter()
        node = self._backend.node
        if node is None:
            await _refuse(TypeError(f"{self.url.location}: renew_lease() needs a node identity (?node=NAME)"))
        if node.superseded:
            await _refuse(StoreTakenOver(node.node_id, f"incarnation {node.incarnation} has been superseded"))

        def run(conn: Conn) -> datetime | None:
            found = conn.execute(
                _SQL_RENEW_LEASE, (node.lease_ttl, node.node_id, node.incarnation)
            ).fetchone()
            return None if found is None else _codec.utc(found[0])

        sent = time.monotonic()
        # Its own worker slot and connection: a node busy with its workflows (every slot
        # taken, calls queued) still renews on time instead of losing them all to a claim.
        expires = await self._backend.run("renewing the node lease", run, limiter=self._backend.lease_limiter)
        if expires is None:
            node.superseded = True
            raise StoreTakenOver(
                node.node_id,
                f"incarnation {node.incarnation} has been superseded by a newer open of this node id",
            )
        node.expires_at = expires
        node.renewed(sent)
        return expires

    async def serve_activity_tasks(
        self,
        execute: Callable[[ActivityRequest, Callable[[Any], None] | None], Awaitable[ActivityOutcome]],
        queues: Sequence[str],
        *,
        concurrency: int,
        drain_timeout: float,
        stop: trio.Event,
        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Be a remote activity worker for ``queues`` (``aion_trio.ActivityTaskQueues``).

        Claims pending tasks with ``FOR UPDATE SKIP LOCKED``, holds each under
        a lease of ``?task_lease_ttl=`` seconds (database clock) renewed a
        third of the way and on heartbeats, runs it through ``execute``,
        writes the outcome guarded by the attempt token, and reaps expired
        leases.  See :mod:`aion_trio_postgres` and ``aion_trio.run_activity_worker``.
        """
        from ._tasks import serve_activity_tasks

        await self.events._enter()
        await serve_activity_tasks(
            self,
            execute,
            queues,
            concurrency=concurrency,
            drain_timeout=drain_timeout,
            stop=stop,
            lease_ttl=self.url.task_lease_ttl,
            poll_interval=self.url.poll_interval,
            task_status=task_status,
        )

    # -- bulk history reads (aion_trio.BulkHistoryReads) -----------------------

    async def read_histories(self, workflow_ids: Sequence[str]) -> dict[str, list[Event]]:
        await self.events._enter()
        try:
            ids = validate_workflow_ids(workflow_ids)
        except (TypeError, ValueError) as exc:
            await _refuse(exc)
        if not ids:
            await trio.lowlevel.checkpoint()
            return {}
        location = self.events.location
        # PostgreSQL text cannot hold NUL, so no workflow with one in its id exists.
        stored = [workflow_id for workflow_id in ids if "\x00" not in workflow_id]

        def run(conn: Conn) -> dict[str, list[Event]]:
            out: dict[str, list[Event]] = {workflow_id: [] for workflow_id in ids}
            rows = conn.execute(_SQL_READ_HISTORIES, (stored,)).fetchall()
            for workflow_id, group in itertools.groupby(rows, key=operator.itemgetter(0)):
                out[workflow_id] = _codec.decode_events(workflow_id, [r[1:] for r in group], location)
            return out

        return await self._backend.run("reading histories", run)

    # -- recovery counts (aion_trio.RecoveryCounts) ----------------------------

    async def count_recoveries(self, workflow_ids: Sequence[str]) -> dict[str, int]:
        await self.events._enter()
        try:
            ids = validate_workflow_ids(workflow_ids)
        except (TypeError, ValueError) as exc:
            await _refuse(exc)
        if not ids:
            return {}

        def count(conn: Conn, workflow_id: str) -> int:
            row = conn.execute(_SQL_COUNT_RECOVERY, (workflow_id,)).fetchone()
            assert row is not None  # an upsert RETURNING always returns its row
            return int(row[0])

        def run(conn: Conn) -> dict[str, int]:
            with conn.transaction():
                return {wid: count(conn, wid) for wid in ids}

        return await self._backend.run("counting recoveries", run)

    async def clear_recoveries(self, workflow_ids: Sequence[str]) -> None:
        await self.events._enter()
        try:
            ids = validate_workflow_ids(workflow_ids)
        except (TypeError, ValueError) as exc:
            await _refuse(exc)
        if not ids:
            return

        def run(conn: Conn) -> None:
            with conn.transaction():
                conn.execute(_SQL_CLEAR_RECOVERIES, (ids,))

        await self._backend.run("clearing recovery counts", run)

    async def recovery_counts(self) -> dict[str, int]:
        await self.events._enter()

        def run(conn: Conn) -> dict[str, int]:
            return {r[0]: int(r[1]) for r in conn.execute(_SQL_RECOVERIES)}

        return await self._backend.run("reading recovery counts", run)

    # -- schedules (aion_trio.ScheduleStore) -----------------------------------

    async def create_schedule(self, schedule_id: str, data: str) -> StoredSchedule:
        await self.events._enter()
        try:
            validate_schedule_write(schedule_id, data)
        except (TypeError, ValueError) as exc:
            await _refuse(exc)

        def run(conn: Conn) -> None:
            with conn.transaction():
                if conn.execute(_SQL_CREATE_SCHEDULE, (schedule_id, data)).rowcount == 0:
                    raise ScheduleAlreadyExists(schedule_id)

        await self._backend.run("creating a schedule", run)
        return StoredSchedule(schedule_id=schedule_id, version=1, data=data)

    async def read_schedule(self, schedule_id: str) -> StoredSchedule | None:
        await self.events._enter()

        def run(conn: Conn) -> StoredSchedule | None:
            row = conn.execute(_SQL_SCHEDULE, (schedule_id,)).fetchone()
            return (
                None if row is None else StoredSchedule(schedule_id=row[0], version=int(row[1]), data=row[2])
            )

        return await self._backend.run("reading a schedule", run)

    async def list_schedules(self) -> list[StoredSchedule]:
        await self.events._enter()

        def run(conn: Conn) -> list[StoredSchedule]:
            return [
                StoredSchedule(schedule_id=r[0], version=int(r[1]), data=r[2])
                for r in conn.execute(_SQL_SCHEDULES)
            ]

        return await self._backend.run("listing schedules", run)

    async def write_schedule(self, schedule_id: str, data: str, expected_version: int) -> StoredSchedule:
        await self.events._enter()
        try:
            validate_schedule_write(schedule_id, data, expected_version)
        except (TypeError, ValueError) as exc:
            await _refuse(exc)

        def run(conn: Conn) -> None:
            with conn.transaction():
                if conn.execute(_SQL_WRITE_SCHEDULE, (data, schedule_id, expected_version)).rowcount == 0:
                    row = conn.execute(_SQL_SCHEDULE_VERSION, (schedule_id,)).fetchone()
                    raise ScheduleConflict(schedule_id, expected_version, 0 if row is None else int(row[0]))

        await self._backend.run("writing a schedule", run)
        return StoredSchedule(schedule_id=schedule_id, version=expected_version + 1, data=data)

    async def delete_schedule(self, schedule_id: str) -> bool:
        await self.events._enter()

        def run(conn: Conn) -> bool:
            with conn.transaction():
                return bool(conn.execute(_SQL_DELETE_SCHEDULE, (schedule_id,)).rowcount)

        return await self._backend.run("deleting a schedule", run)

    # -- flow control (aion_trio.FlowStore; the statements are in _flow) --------

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
        await self.events._enter()
        try:
            validate_flow_key(key)
            validate_flow_key(holder, "holder")
        except ValueError as exc:
            await _refuse(exc)
        return await self._backend.run(
            "taking a flow permit",
            lambda conn: _flow.acquire(conn, key, holder, concurrency, rate, period, ttl, now),
        )

    async def release_flow_permit(self, key: str, permit_id: str) -> bool:
        await self.events._enter()
        return await self._backend.run(
            "releasing a flow permit", lambda conn: _flow.release(conn, key, permit_id)
        )

    async def renew_flow_permits(self, holder: str, *, ttl: float, now: datetime) -> int:
        await self.events._enter()
        return await self._backend.run(
            "renewing flow permits", lambda conn: _flow.renew(conn, holder, ttl, now)
        )

    async def held_flow_permits(self, key: str, *, now: datetime) -> int:
        await self.events._enter()
        return await self._backend.run("counting flow permits", lambda conn: _flow.held(conn, key, now))

    async def record_flow_waiter(self, waiter: FlowWaiter, *, ttl: float, now: datetime) -> None:
        await self.events._enter()
        try:
            validate_flow_waiter(waiter)
            if "\x00" in "".join(
                (waiter.workflow_id, waiter.run_id, waiter.pool, waiter.limit, waiter.holder)
            ):
                raise ValueError("a flow waiter's text cannot hold NUL characters (PostgreSQL text)")
        except (TypeError, ValueError) as exc:
            await _refuse(exc)
        await self._backend.run(
            "recording a flow waiter", lambda conn: _flow.record_waiter(conn, waiter, ttl, now)
        )

    async def remove_flow_waiter(self, workflow_id: str, run_id: str, activity_id: int) -> bool:
        await self.events._enter()
        if "\x00" in workflow_id + run_id:  # PostgreSQL text cannot hold it: no such record
            await trio.lowlevel.cancel_shielded_checkpoint()
            return False
        return await self._backend.run(
            "removing a flow waiter", lambda conn: _flow.remove_waiter(conn, workflow_id, run_id, activity_id)
        )

    async def flow_waiters(self, workflow_id: str, *, now: datetime) -> list[FlowWaiter]:
        await self.events._enter()
        if "\x00" in workflow_id:
            await trio.lowlevel.cancel_shielded_checkpoint()
            return []
        return await self._backend.run(
            "reading flow waiters", lambda conn: _flow.waiters(conn, workflow_id, now)
        )

    async def clear_flow_waiters(self) -> int:
        await self.events._enter()
        return await self._backend.run("clearing flow waiters", _flow.clear_waiters)

    async def enqueue_flow_run(self, run: QueuedRun) -> tuple[QueuedRun, bool]:
        await self.events._enter()
        try:
            validate_flow_key(run.queue, "queue")
            validate_flow_key(run.workflow_id, "workflow id")
        except ValueError as exc:
            await _refuse(exc)
        return await self._backend.run("enqueueing a workflow run", lambda conn: _flow.enqueue(conn, run))

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
        await self.events._enter()
        return await self._backend.run(
            "admitting queued workflow runs",
            lambda conn: _flow.admit(conn, queue, concurrency, rate, period, now, limit),
        )

    async def flow_runs(self, queue: str | None = None) -> list[QueuedRun]:
        await self.events._enter()
        return await self._backend.run("listing queued workflow runs", lambda conn: _flow.runs(conn, queue))

    async def finish_flow_run(self, queue: str, workflow_id: str) -> bool:
        await self.events._enter()
        return await self._backend.run(
            "removing a finished queued run", lambda conn: _flow.finish(conn, queue, workflow_id)
        )

    async def aclose(self) -> None:
        """Close both halves, release the node lease and close the pool (idempotent)."""
        self.events._closed = True
        self.visibility._closed = True
        backend = self._backend
        if not backend.closed:
            backend.closed = True
            with hold_mock_time():
                await trio.to_thread.run_sync(_close_backend, backend)
        await trio.lowlevel.checkpoint()


def notify_channel(schema: str) -> str:
    """``aion_trio_`` plus a digest of the schema name: a valid channel of bounded length."""
    return "aion_trio_" + hashlib.sha256(schema.encode()).hexdigest()[:24]


@final
class _Wakeups:
    """Cluster mode's wake-ups: a counter bumped (from the listener thread) by each
    notification for this node or for the cluster (empty payload), and by every
    (re)LISTEN, since notifications sent meanwhile are lost."""

    def __init__(self, node_id: str) -> None:
        self._node_id = node_id
        self._cond = threading.Condition()
        self._closed = False
        self.generation = 0

    def notified(self, channel: str, payload: str | None) -> None:
        if payload is None or payload in ("", self._node_id):
            with self._cond:
                self.generation += 1
                self._cond.notify_all()

    def wait(self, since: int, timeout: float) -> int:
        """Block until ``generation`` differs from ``since`` or ``timeout`` seconds pass; return it."""
        with self._cond:
            self._cond.wait_for(lambda: self.generation != since or self._closed, timeout)
            return self.generation

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


@final
@attrs.define(eq=False)
class PostgresClusterStore(PostgresStore):
    """A store opened with a node identity: cluster mode's capabilities.

    Implements :class:`aion_trio.plugin.ClusterStore` (the engine detects it
    and runs in cluster mode) and :class:`aion_trio.plugin.CommandInbox` (the
    ``inbox`` table; ``pending_commands`` lists only commands for workflows
    this node owns).  Notifications travel on one channel per schema
    (:func:`notify_channel`): enqueued commands notify the owning node,
    acked commands and released leases notify everyone.
    """

    _wakeups: _Wakeups = attrs.field(alias="wakeups", repr=False)
    _seen: int = attrs.field(default=0, init=False, repr=False)
    _waits: trio.CapacityLimiter = attrs.field(
        factory=lambda: trio.CapacityLimiter(4), init=False, repr=False
    )

    @property
    def node_id(self) -> str:
        node = self._backend.node
        assert node is not None
        return node.node_id

    @property
    def listener(self) -> Listener:
        """The LISTEN connection's thread (``backend_pid``, ``connects``; for operators and tests)."""
        return self._backend.listener

    def _node(self) -> NodeLease:
        node = self._backend.node
        assert node is not None
        return node

    def lease_valid(self) -> bool:
        """Local judgement, no I/O: the last successful renewal's *send* time plus the TTL, minus
        the safety margin, is still ahead (``time.monotonic()``)."""
        return self._node().valid()

    def _check_incarnation(self, conn: Conn) -> None:
        node = self._node()
        found = conn.execute(_SQL_CHECK_INCARNATION, (node.node_id,)).fetchone()
        if found is None or int(found[0]) != node.incarnation:
            node.superseded = True
            raise StoreTakenOver(
                node.node_id,
                f"incarnation {node.incarnation} has been superseded by a newer open of this node id",
            )

    def fenced_out(self) -> StoreTakenOver | None:
        """The ``StoreTakenOver`` that ended this node once a newer incarnation of its id superseded it
        (it can never own a workflow again), else ``None``; no I/O."""
        node = self._node()
        if not node.superseded:
            return None
        return StoreTakenOver(
            node.node_id,
            f"incarnation {node.incarnation} has been superseded by a newer open of this node id "
            "(another process was started with the same node id): this node owns nothing any more",
        )

    async def owned_active(self) -> list[str]:
        """This node id's active workflows, each re-claimed (its epoch bumped), sorted."""
        await self.events._enter()

        def run(conn: Conn) -> list[tuple[str, int]]:
            with conn.transaction():
                self._check_incarnation(conn)
                return [(r[0], int(r[1])) for r in conn.execute(_SQL_OWNED_ACTIVE, (self.node_id,))]

        rows = await self._backend.run("re-claiming this node's workflows", run)
        for workflow_id, epoch in rows:
            self.events._remember(workflow_id, epoch)
        return sorted(w for w, _ in rows)

    async def claim_orphans(self, limit: int) -> list[str]:
        """Claim at most ``limit`` orphaned active workflows in one transaction; return their ids."""
        await self.events._enter()
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            await _refuse(ValueError(f"limit must be an int >= 1, got {limit!r}"))

        def run(conn: Conn) -> list[tuple[str, int]]:
            with conn.transaction():
                self._check_incarnation(conn)
                params = {"me": self.node_id, "limit": limit}
                return [(r[0], int(r[1])) for r in conn.execute(_SQL_CLAIM_ORPHANS, params)]

        rows = await self._backend.run("claiming orphaned workflows", run)
        for workflow_id, epoch in rows:
            self.events._remember(workflow_id, epoch)
        return sorted(w for w, _ in rows)

    async def wait_for_work(self, timeout: float) -> None:  # noqa: ASYNC109 - a wall-clock poll bound
        """Return on a notification for this node or the cluster (also one that arrived since
        the previous call returned) or after ``timeout`` seconds of wall time."""
        await self.events._enter()
        since = self._seen
        # Not under hold_mock_time: this thread waits for a notification, it does no work.
        self._seen = await trio.to_thread.run_sync(
            self._wakeups.wait, since, timeout, abandon_on_cancel=True, limiter=self._waits
        )

    async def command_target(self, workflow_id: str) -> str | None:
        """``None``: commands for the workflow are applied here; else the owning node's id
        (``""`` for an active workflow whose owner is gone: the next claimant applies them)."""
        await self.events._enter()
        me = self.node_id

        def run(conn: Conn) -> tuple[Any, ...] | None:
            return conn.execute(_SQL_OWNER_OF, (workflow_id,)).fetchone()

        found = await self._backend.run("looking up a workflow's owner", run)
        if found is None or int(found[2]) == 0:
            return None
        owner, status, _, live = found
        if owner == me:
            return None
        if owner is not None and live:
            return str(owner)
        active = status in ACTIVE_LIST_VALUES
        return "" if active else None

    # -- the command inbox -------------------------------------------------------

    async def enqueue_command(self, command: Command) -> int:
        await self.events._enter()
        try:
            type_name, data = command_data_json(command)
        except Exception as exc:
            await _refuse(exc)
        params = (command.workflow_id, type_name, data, command.request_id, self._backend.channel)

        def run(conn: Conn) -> int:
            with conn.transaction():
                found = conn.execute(_SQL_ENQUEUE, params).fetchone()
                if found is None:  # queued before under its request id: that command stands
                    found = conn.execute(_SQL_COMMAND_OF_REQUEST, (command.request_id,)).fetchone()
            assert found is not None
            return int(found[0])

        return await self._backend.run("queueing a command", run)

    async def pending_commands(self, limit: int = 100) -> list[PendingCommand]:
        """Un-acked commands for workflows this node owns, oldest first."""
        await self.events._enter()

        def run(conn: Conn) -> list[tuple[int, str, str]]:
            return [(int(r[0]), r[1], r[2]) for r in conn.execute(_SQL_PENDING, (self.node_id, limit))]

        rows = await self._backend.run("reading the command inbox", run)
        return [PendingCommand(command_id=i, command=command_from_data_json(t, d)) for i, t, d in rows]

    async def ack_command(self, command_id: int, outcome: CommandOutcome) -> None:
        """Mark the command done with ``outcome`` (an acked one keeps its first outcome)."""
        await self.events._enter()
        text = outcome_to_json(outcome)
        channel = self._backend.channel

        def run(conn: Conn) -> None:
            with conn.transaction():
                if conn.execute(_SQL_ACK, (text, command_id)).fetchone() is None:
                    if conn.execute(_SQL_INBOX_ROW, (command_id,)).fetchone() is None:
                        raise NotFound(f"no inbox command #{command_id} in {self.url.location}")
                    return
                conn.execute(_SQL_NOTIFY, (channel, ""))

        await self._backend.run("acking a command", run)

    async def command_outcome(self, command_id: int) -> CommandOutcome | None:
        await self.events._enter()

        def run(conn: Conn) -> tuple[Any, ...] | None:
            return conn.execute(_SQL_INBOX_ROW, (command_id,)).fetchone()

        found = await self._backend.run("reading a command outcome", run)
        if found is None:
            raise NotFound(f"no inbox command #{command_id} in {self.url.location}")
        acked, text = found
        return outcome_from_json(text) if acked and text is not None else None

    async def aclose(self) -> None:
        """Wake any waiter, then close as :class:`PostgresStore` does (the lease is released)."""
        self._wakeups.close()
        await super().aclose()


def _close_backend(backend: _Backend) -> None:
    backend.listener.close()
    node = backend.node
    try:
        if node is not None and not node.superseded:
            # A clean shutdown hands this node's workflows over at once.
            with (
                backend.pool.connection(timeout=min(backend.url.pool_timeout, 5.0)) as conn,
                backend.hangs.watching(conn, "releasing the node lease"),
            ):
                conn.execute(_SQL_RELEASE_LEASE, (node.node_id, node.incarnation))
                # The other nodes sweep at once instead of at their next interval.
                conn.execute(_SQL_NOTIFY, (backend.channel, ""))
    except (psycopg.Error, psycopg_pool.PoolTimeout, psycopg_pool.PoolClosed) as exc:
        logger.warning("%s: could not release the lease of node %s: %s", backend.location, node, exc)
    finally:
        backend.pool.close()
        backend.hangs.close()


def _refuse_live_holder(conn: Conn, node_id: str, location: str) -> None:
    """Raise :class:`NodeInUse` if another live process holds ``node_id``'s lease.

    Live: its lease has not run out (database clock), unless it is on this host
    and its process is gone (a node killed and restarted under its id takes over
    at once, as an embedded store's owner does)."""
    row = conn.execute(_SQL_NODE_HOLDER, (node_id,)).fetchone()
    if row is None:
        return
    host, pid, process, since, expires, live = row
    if not live or pid is None or host is None:
        return  # expired or released (or registered before holders were recorded)
    holder = OwnerIdentity(
        pid=int(pid), host=str(host), started_at=_codec.utc(since), token="node", process=process
    )
    if holder.host == this_host() and not owner_alive(holder):
        return
    raise NodeInUse(node_id, holder.pid, holder.host, _codec.utc(since), _codec.utc(expires), location)


def _open_sync(url: PostgresUrl, node_id: str | None, lease_ttl: float) -> _Backend:
    """Connect, migrate, register the node and start the pool (blocks: run in a thread)."""
    doing = "opening the store"
    try:
        conn = psycopg.connect(url.conninfo, autocommit=True)
    except psycopg.Error as exc:
        raise cause(
            BackendUnavailable(
                f"{url.location}: cannot connect ({str(exc).strip()}); is the server running and reachable, "
                "and do host, port, user, password and database name match?"
            ),
            exc,
        ) from exc
    node: NodeLease | None = None
    try:
        configure(conn, url)
        migrate(conn, url)
        if node_id is not None:
            sent = time.monotonic()
            me = OwnerIdentity.current()
            with conn.transaction():
                _refuse_live_holder(conn, node_id, url.location)
                found = conn.execute(
                    _SQL_REGISTER_NODE, (node_id, lease_ttl, me.host, me.pid, me.process)
                ).fetchone()
            assert found is not None
            node = NodeLease(
                node_id=node_id,
                incarnation=int(found[0]),
                lease_ttl=lease_ttl,
                expires_at=_codec.utc(found[1]),
            )
            node.renewed(sent)
    except psycopg.Error as exc:
        raise backend_error(exc, url.location, doing) from exc
    finally:
        conn.close()
    pool: psycopg_pool.ConnectionPool[Any] = psycopg_pool.ConnectionPool(
        url.conninfo,
        min_size=1,
        # One connection beyond pool_size for the lease renewals (lease_limiter).
        max_size=url.pool_size + (1 if node is not None else 0),
        kwargs={"autocommit": True},
        configure=lambda c: configure(c, url),
        timeout=url.pool_timeout,
        name=f"aion_trio {url.location}",
        open=False,
    )
    try:
        # Ready before the store is handed out: the first renewal must not wait for a connection.
        pool.open(wait=True, timeout=url.pool_timeout)
    except psycopg_pool.PoolTimeout as exc:
        pool.close()
        raise backend_error(exc, url.location, doing) from exc
    return _Backend(
        url=url,
        pool=pool,
        limiter=trio.CapacityLimiter(url.pool_size),
        held=trio.CapacityLimiter(math.inf),
        lease_limiter=trio.CapacityLimiter(1),
        node=node,
        listener=Listener(url, node_id or url.location),
        hangs=HangWatch(hang_bound(url.statement_timeout), url.location),
    )


#: The first and the longest pause between two attempts to reach the server while opening (seconds).
CONNECT_RETRY_FIRST = 0.1
CONNECT_RETRY_MAX = 5.0

# Connection failures worth waiting out: no answer at all (refused, timed out,
# reset: no SQLSTATE), the server starting up or shutting down (57P0x), too
# many connections (53300).  A wrong password or database name is not.
_TRANSIENT_CONNECT_STATES = ("57P01", "57P02", "57P03", "53300")


def _unreachable(exc: BaseException) -> bool:
    """Whether an open failed because the server could not be reached (worth retrying)."""
    found = exc.__cause__
    if not isinstance(exc, BackendUnavailable) or not isinstance(found, psycopg.OperationalError):
        return False
    return found.sqlstate is None or found.sqlstate in _TRANSIENT_CONNECT_STATES


async def _open_waiting(parsed: PostgresUrl, node_id: str | None, ttl: float) -> _Backend:
    """:func:`_open_sync`, retried with backoff for up to ``connect_wait`` seconds while the
    server cannot be reached (each retry logged, saying how long it keeps trying)."""
    deadline = time.monotonic() + parsed.connect_wait
    delay = CONNECT_RETRY_FIRST
    attempts = 0
    while True:
        attempts += 1
        try:
            # Opening blocks (network, maybe a migration): off the Trio thread and
            # never abandoned, so a cancelled open still closes what it opened.
            with hold_mock_time():
                return await trio.to_thread.run_sync(_open_sync, parsed, node_id, ttl)
        except BackendUnavailable as exc:
            left = deadline - time.monotonic()
            if not _unreachable(exc) or left <= 0:
                if attempts > 1:
                    raise BackendUnavailable(
                        f"{exc} (gave up after {attempts} attempts in connect_wait={parsed.connect_wait:g}s)"
                    ) from exc.__cause__
                raise
            pause = min(delay, left)
            logger.warning(
                "%s: the server cannot be reached (%s); waiting for it: attempt %d failed, retrying in %.1fs "
                "(for up to %.0fs more; connect_wait=0 fails at once)",
                parsed.location,
                str(exc.__cause__).strip() or type(exc.__cause__).__name__,
                attempts,
                pause,
                left,
            )
            # Wall time, whatever the Trio clock: the server comes back in real time.
            with hold_mock_time():
                await trio.to_thread.run_sync(time.sleep, pause, abandon_on_cancel=True)
            delay = min(delay * 2, CONNECT_RETRY_MAX)


async def _renew_once(store: PostgresStore) -> bool:
    """Renew the node lease, logging a failure; ``False`` once renewing is over for good."""
    try:
        await store.renew_lease()
    except StoreTakenOver as exc:
        logger.error("%s: %s; stopping lease renewal", store.url.location, exc)
        return False
    except StoreError as exc:
        logger.warning("%s: lease renewal failed (will retry): %s", store.url.location, exc)
    except trio.ClosedResourceError:
        return False
    return True


async def _heartbeat(store: PostgresStore, every: float) -> None:
    """Renew the node lease every ``every`` seconds until cancelled (errors are logged, never raised)."""
    while True:
        await trio.sleep(every)
        if not await _renew_once(store):
            return


@contextlib.asynccontextmanager
async def open_postgres_store(
    url: str,
    *,
    node: str | None = None,
    lease_ttl: float | None = None,
    renew_every: float | None = -1.0,
) -> AsyncIterator[PostgresStore]:
    """Open the PostgreSQL store named by ``url``; close it on exit.

    ``node`` / ``lease_ttl`` override the URL's ``?node=`` / ``?lease_ttl=``.
    With a node identity the store registers the node (a new incarnation),
    renews its lease in the background every ``renew_every`` seconds
    (default: a third of the TTL; ``None`` turns renewal off, for tests that
    drive :meth:`PostgresStore.renew_lease` themselves) and releases the
    lease on exit.  A server it cannot reach (refused, no answer, starting
    up) is retried with backoff (0.1 s doubling to 5 s), each failure logged
    as a warning, for up to the URL's ``connect_wait`` seconds (default 60;
    0 fails at once).  Raises :class:`~aion_trio.BackendUnavailable` when the
    server still cannot be reached, or refuses the credentials, and the :class:`~aion_trio.StoreOpenError`
    family for schemas it cannot use.
    """
    parsed = parse_postgres_url(url)
    node_id = node if node is not None else parsed.node
    ttl = lease_ttl if lease_ttl is not None else parsed.lease_ttl
    if ttl <= 0:
        raise ValueError(f"lease_ttl must be > 0 seconds, got {ttl!r}")
    every = ttl / 3 if renew_every is not None and renew_every < 0 else renew_every
    backend = await _open_waiting(parsed, node_id, ttl)
    events = PostgresEventStore(backend=backend)
    visibility = PostgresVisibilityStore(backend=backend)
    store: PostgresStore
    if backend.node is None:
        store = PostgresStore(events=events, visibility=visibility, url=parsed, backend=backend)
    else:
        wakeups = _Wakeups(backend.node.node_id)
        store = PostgresClusterStore(
            events=events, visibility=visibility, url=parsed, backend=backend, wakeups=wakeups
        )
        listening = backend.listener.subscribe(backend.channel, wakeups.notified)
        # Listening before the engine looks at the tables: a notification sent after
        # that look is not lost.  Bounded: polling covers a slow connect.
        with hold_mock_time():
            await trio.to_thread.run_sync(listening.wait, parsed.pool_timeout)
    try:
        try:
            async with trio.open_nursery() as nursery:
                # Renewed once before the store is handed out: opening took round trips since
                # the registration (the pool, the LISTEN connection), and on a slow network the
                # registration's lease may be nearly spent.
                if backend.node is not None and every is not None and await _renew_once(store):
                    nursery.start_soon(_heartbeat, store, every)
                try:
                    yield store
                finally:
                    nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            # The heartbeat never raises: a lone exception is the caller's own, raised as it was.
            if len(group.exceptions) == 1:
                raise group.exceptions[0] from None
            raise
    finally:
        with trio.CancelScope(shield=True):
            await store.aclose()
