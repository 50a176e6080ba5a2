"""Flow control (``aion_trio.FlowStore``): the statements behind ``PostgresStore``'s
permit and workflow-queue methods.

Each change of one key (a limit's permits and starts) or one queue runs in one
transaction under ``pg_advisory_xact_lock`` on that key, so the count-decide-write
of concurrent nodes serialises and none of them passes the bound together.  A
permit is reclaimed once it expires: its engine renews it while the attempt
runs, so a killed node's slots come back one ``flow_permit_ttl`` later.  (Not
with the node's lease: a live node whose lease lapsed for a moment still runs
its attempts, and taking their slots would let more run than the bound.)
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import attrs
import psycopg

from aion_trio.plugin import ADMITTED, QUEUED, FlowGrant, FlowWaiter, QueuedRun, rate_window

Conn = psycopg.Connection[Any]

_SQL_LOCK = "SELECT pg_advisory_xact_lock(hashtextextended(%s, 18))"
_SQL_EXPIRE_PERMITS = "DELETE FROM flow_permits WHERE key = %s AND expires_at <= %s"
_SQL_COUNT_PERMITS = "SELECT count(*) FROM flow_permits WHERE key = %s"
_SQL_COUNT_LIVE_PERMITS = "SELECT count(*) FROM flow_permits WHERE key = %s AND expires_at > %s"
_SQL_PRUNE_STARTS = "DELETE FROM flow_starts WHERE key = %s AND at <= %s"
_SQL_STARTS = "SELECT at FROM flow_starts WHERE key = %s ORDER BY at"
_SQL_ADD_START = "INSERT INTO flow_starts (key, at) VALUES (%s, %s)"
_SQL_ADD_PERMIT = "INSERT INTO flow_permits (key, holder, expires_at) VALUES (%s, %s, %s) RETURNING permit_id"
_SQL_RELEASE_PERMIT = "DELETE FROM flow_permits WHERE key = %s AND permit_id = %s"
_SQL_RENEW_PERMITS = "UPDATE flow_permits SET expires_at = %s WHERE holder = %s AND expires_at > %s"
_SQL_RENEW_WAITERS = "UPDATE flow_waiters SET expires_at = %s WHERE holder = %s AND expires_at > %s"
_SQL_RECORD_WAITER = (
    "INSERT INTO flow_waiters (workflow_id, run_id, activity_id, attempt, pool, limit_text, priority,"
    " since, holder, expires_at) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
    " ON CONFLICT (workflow_id, run_id, activity_id) DO UPDATE SET attempt = excluded.attempt,"
    " pool = excluded.pool, limit_text = excluded.limit_text, priority = excluded.priority,"
    " since = excluded.since, holder = excluded.holder, expires_at = excluded.expires_at"
)
_SQL_REMOVE_WAITER = "DELETE FROM flow_waiters WHERE workflow_id = %s AND run_id = %s AND activity_id = %s"
_SQL_WAITERS = (
    "SELECT run_id, activity_id, attempt, pool, limit_text, priority, since, holder, expires_at"
    " FROM flow_waiters WHERE workflow_id = %s AND expires_at > %s ORDER BY run_id, activity_id"
)
_SQL_CLEAR_WAITERS = "DELETE FROM flow_waiters"
_COLUMNS = "queue, workflow_id, partition_key, priority, dedup_id, seq, state, data"
_SQL_TWIN = (
    f"SELECT {_COLUMNS} FROM flow_runs WHERE queue = %s AND (workflow_id = %s OR dedup_id = %s)"
    " ORDER BY seq LIMIT 1"
)
_SQL_ADD_RUN = (
    "INSERT INTO flow_runs (queue, workflow_id, partition_key, priority, dedup_id, state, data)"
    " VALUES (%s, %s, %s, %s, %s, 'queued', %s) RETURNING seq"
)
_SQL_QUEUE_RUNS = f"SELECT {_COLUMNS} FROM flow_runs WHERE queue = %s ORDER BY priority, seq"
_SQL_ALL_RUNS = f"SELECT {_COLUMNS} FROM flow_runs ORDER BY priority, seq"
_SQL_ADMIT = "UPDATE flow_runs SET state = 'admitted' WHERE seq = %s"
_SQL_FINISH = "DELETE FROM flow_runs WHERE queue = %s AND workflow_id = %s"


def _run(row: Any) -> QueuedRun:
    queue, workflow_id, partition_key, priority, dedup_id, seq, state, data = row
    return QueuedRun(
        queue=queue,
        workflow_id=workflow_id,
        partition_key=partition_key,
        priority=int(priority),
        dedup_id=dedup_id,
        seq=int(seq),
        state=state,
        data=data,
    )


def _window(conn: Conn, key: str, period: float, now: datetime) -> list[datetime]:
    conn.execute(_SQL_PRUNE_STARTS, (key, now - timedelta(seconds=period)))
    return [row[0] for row in conn.execute(_SQL_STARTS, (key,))]


def acquire(
    conn: Conn,
    key: str,
    holder: str,
    concurrency: int | None,
    rate: int | None,
    period: float,
    ttl: float,
    now: datetime,
) -> FlowGrant:
    with conn.transaction():
        conn.execute(_SQL_LOCK, (f"permit:{key}",))
        conn.execute(_SQL_EXPIRE_PERMITS, (key, now))
        if concurrency is not None:
            row = conn.execute(_SQL_COUNT_PERMITS, (key,)).fetchone()
            if row is not None and int(row[0]) >= concurrency:
                return FlowGrant(granted=False)
        if rate is not None:
            wait = rate_window(_window(conn, key, period, now), rate, period, now)
            if wait is not None:
                return FlowGrant(granted=False, retry_after=wait)
            conn.execute(_SQL_ADD_START, (key, now))
        if concurrency is None:
            return FlowGrant(granted=True)
        added = conn.execute(_SQL_ADD_PERMIT, (key, holder, now + timedelta(seconds=ttl))).fetchone()
        assert added is not None
        return FlowGrant(granted=True, permit_id=str(added[0]))


def release(conn: Conn, key: str, permit_id: str) -> bool:
    if not permit_id.isdigit():
        return False
    with conn.transaction():
        return bool(conn.execute(_SQL_RELEASE_PERMIT, (key, int(permit_id))).rowcount)


def renew(conn: Conn, holder: str, ttl: float, now: datetime) -> int:
    expires = now + timedelta(seconds=ttl)
    with conn.transaction():
        permits = int(conn.execute(_SQL_RENEW_PERMITS, (expires, holder, now)).rowcount)
        return permits + int(conn.execute(_SQL_RENEW_WAITERS, (expires, holder, now)).rowcount)


def record_waiter(conn: Conn, w: FlowWaiter, ttl: float, now: datetime) -> None:
    with conn.transaction():
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
                w.since,
                w.holder,
                now + timedelta(seconds=ttl),
            ),
        )


def remove_waiter(conn: Conn, workflow_id: str, run_id: str, activity_id: int) -> bool:
    with conn.transaction():
        return bool(conn.execute(_SQL_REMOVE_WAITER, (workflow_id, run_id, activity_id)).rowcount)


def waiters(conn: Conn, workflow_id: str, now: datetime) -> list[FlowWaiter]:
    return [
        FlowWaiter(
            workflow_id=workflow_id,
            run_id=run_id,
            activity_id=int(activity_id),
            attempt=int(attempt),
            pool=pool,
            limit=limit,
            priority=int(priority),
            since=since,
            holder=holder,
            expires_at=expires_at,
        )
        for run_id, activity_id, attempt, pool, limit, priority, since, holder, expires_at in conn.execute(
            _SQL_WAITERS, (workflow_id, now)
        )
    ]


def clear_waiters(conn: Conn) -> int:
    with conn.transaction():
        return int(conn.execute(_SQL_CLEAR_WAITERS).rowcount)


def held(conn: Conn, key: str, now: datetime) -> int:
    row = conn.execute(_SQL_COUNT_LIVE_PERMITS, (key, now)).fetchone()
    return 0 if row is None else int(row[0])


def enqueue(conn: Conn, run: QueuedRun) -> tuple[QueuedRun, bool]:
    with conn.transaction():
        conn.execute(_SQL_LOCK, (f"queue:{run.queue}",))
        twin = conn.execute(_SQL_TWIN, (run.queue, run.workflow_id, run.dedup_id)).fetchone()
        if twin is not None:
            return _run(twin), False
        row = conn.execute(
            _SQL_ADD_RUN,
            (run.queue, run.workflow_id, run.partition_key, run.priority, run.dedup_id, run.data),
        ).fetchone()
        assert row is not None
        return attrs.evolve(run, seq=int(row[0]), state=QUEUED), True


def admit(
    conn: Conn,
    queue: str,
    concurrency: int | None,
    rate: int | None,
    period: float,
    now: datetime,
    limit: int,
) -> tuple[list[QueuedRun], float | None]:
    admitted: list[QueuedRun] = []
    retry_after: float | None = None
    with conn.transaction():
        conn.execute(_SQL_LOCK, (f"queue:{queue}",))
        entries = [_run(row) for row in conn.execute(_SQL_QUEUE_RUNS, (queue,)).fetchall()]
        running: dict[str, int] = {}
        for entry in entries:
            if entry.state == ADMITTED:
                running[entry.partition_key] = running.get(entry.partition_key, 0) + 1
        for entry in entries:
            if len(admitted) >= limit:
                break
            if entry.state == ADMITTED:
                continue
            part = entry.partition_key
            if concurrency is not None and running.get(part, 0) >= concurrency:
                continue
            key = f"queue:{queue}\x1f{part}"
            if rate is not None:
                wait = rate_window(_window(conn, key, period, now), rate, period, now)
                if wait is not None:
                    retry_after = wait if retry_after is None else min(retry_after, wait)
                    continue
                conn.execute(_SQL_ADD_START, (key, now))
            running[part] = running.get(part, 0) + 1
            conn.execute(_SQL_ADMIT, (entry.seq,))
            admitted.append(attrs.evolve(entry, state=ADMITTED))
    return admitted, retry_after


def runs(conn: Conn, queue: str | None) -> list[QueuedRun]:
    rows = conn.execute(_SQL_ALL_RUNS) if queue is None else conn.execute(_SQL_QUEUE_RUNS, (queue,))
    return [_run(row) for row in rows.fetchall()]


def finish(conn: Conn, queue: str, workflow_id: str) -> bool:
    with conn.transaction():
        return bool(conn.execute(_SQL_FINISH, (queue, workflow_id)).rowcount)
