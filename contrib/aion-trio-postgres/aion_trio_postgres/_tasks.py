"""Activity tasks in PostgreSQL: the engine's task dispatcher and the remote worker.

One row of ``activity_tasks`` per dispatched attempt (migration 3).  The
engine's :class:`PostgresTaskDispatcher` inserts it and waits for its
outcome; workers claim pending rows of their queues with ``FOR UPDATE SKIP
LOCKED``, hold them under a lease renewed by heartbeat (database clock), and
write the outcome guarded by the attempt token (id, attempt, worker, status
``running``).  A reaper, run by workers and dispatchers alike, returns rows
whose lease ran out to ``pending`` and counts the loss (``lost_count``); the
engine then re-dispatches the same attempt without spending retry budget.

LISTEN/NOTIFY only wakes waiters sooner: every wait is also bounded by a
poll, so a dropped LISTEN connection loses no work.  The channels are shared
by every schema of the database; payloads start with the schema name.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import socket
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any, final

import attrs
import psycopg
import trio

from aion_trio import (
    ActivityDispatcher,
    ActivityError,
    ActivityOutcome,
    ActivityRequest,
    FailureCause,
    OutcomeKind,
    Payload,
    report_heartbeat_details,
)
from aion_trio.plugin import StoreError

from ._listen import deliver_to_trio

if TYPE_CHECKING:
    from ._store import PostgresStore, _Backend

logger = logging.getLogger("aion_trio.postgres.tasks")

Conn = psycopg.Connection[Any]
Executor = Callable[[ActivityRequest, Callable[[Any], None] | None], Awaitable[ActivityOutcome]]

#: New work on a queue: payload ``schema<TAB>queue``.
CHANNEL_TASKS = "aion_trio_tasks"
#: A task row changed (outcome written, cancelled, lost): payload ``schema<TAB>id``.
CHANNEL_CHANGES = "aion_trio_task_changes"

# --------------------------------------------------------------------------
# SQL (constant text; every value is bound)
# --------------------------------------------------------------------------

_SQL_INSERT = (
    "INSERT INTO activity_tasks (workflow_id, run_id, activity_id, attempt, task_queue, activity_type,"
    " input, options, attempt_timeout, heartbeat_timeout, heartbeat_details)"
    " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
    # A re-dispatch of the same attempt finds its row (with the details its last worker
    # reported).  One that was cancelled (the engine that dispatched it shut down) is
    # queued again.
    " ON CONFLICT (workflow_id, run_id, activity_id, attempt) DO UPDATE SET status = 'pending',"
    " task_queue = excluded.task_queue, worker_id = NULL, lease_expires_at = NULL, claimed_at = NULL,"
    " finished_at = NULL WHERE activity_tasks.status = 'cancelled'"
)
_SQL_FIND = (
    "SELECT id, lost_count, status FROM activity_tasks"
    " WHERE workflow_id = %s AND run_id = %s AND activity_id = %s AND attempt = %s"
)
_SQL_NOTIFY = "SELECT pg_notify(%s, %s)"
# hb_expired: running, with a heartbeat timeout, and silent for longer than it
# (plus a grace for the worker's own, exact, watchdog to report first).
_SQL_STATE = (
    "SELECT status, outcome, result, error, lost_count, heartbeat_details,"
    " (status = 'running' AND heartbeat_timeout IS NOT NULL AND clock_timestamp() >"
    "  heartbeat_at + make_interval(secs => heartbeat_timeout + %s)) AS hb_expired"
    " FROM activity_tasks WHERE id = %s"
)
_SQL_CANCEL = (
    "WITH u AS (UPDATE activity_tasks SET status = 'cancelled', finished_at = clock_timestamp(),"
    " lease_expires_at = NULL WHERE id = %s AND status IN ('pending', 'running') RETURNING id)"
    " SELECT u.id, pg_notify(%s, %s || u.id::text) FROM u"
)
_SQL_CLAIM = (
    "WITH c AS (SELECT clock_timestamp() AS t),"
    " picked AS (SELECT id FROM activity_tasks WHERE status = 'pending' AND task_queue = ANY (%s)"
    "  ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED)"
    " UPDATE activity_tasks t SET status = 'running', worker_id = %s, claimed_at = c.t, heartbeat_at = c.t,"
    " lease_expires_at = c.t + make_interval(secs => %s)"
    " FROM c, picked WHERE t.id = picked.id"
    " RETURNING t.id, t.workflow_id, t.run_id, t.activity_id, t.attempt, t.task_queue, t.activity_type,"
    " t.input, t.options, t.attempt_timeout, t.heartbeat_details"
)
_SQL_RENEW = (
    "WITH c AS (SELECT clock_timestamp() AS t)"
    " UPDATE activity_tasks t SET lease_expires_at = c.t + make_interval(secs => %s) FROM c"
    " WHERE t.id = ANY (%s) AND t.worker_id = %s AND t.status = 'running' RETURNING t.id"
)
# A beat without details keeps the last details: they are what the next attempt resumes from.
_SQL_HEARTBEAT = (
    "UPDATE activity_tasks SET heartbeat_at = clock_timestamp(), heartbeat_details = COALESCE(%s, heartbeat_details)"
    " WHERE id = %s AND worker_id = %s AND status = 'running'"
)
_SQL_COMPLETE = (
    "WITH u AS (UPDATE activity_tasks SET status = 'done', outcome = %s, result = %s, error = %s,"
    " heartbeat_details = COALESCE(%s, heartbeat_details), finished_at = clock_timestamp(), lease_expires_at = NULL"
    " WHERE id = %s AND attempt = %s AND worker_id = %s AND status = 'running' RETURNING id)"
    " SELECT u.id, pg_notify(%s, %s || u.id::text) FROM u"
)
# The loss of an attempt (lease reaped, or released by a stopping worker):
# back to pending for any worker, counted so the engine sees a lost worker.
_SQL_REAP = (
    "WITH r AS (SELECT id FROM activity_tasks WHERE status = 'running' AND lease_expires_at < clock_timestamp()"
    "  ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED),"
    " u AS (UPDATE activity_tasks t SET status = 'pending', worker_id = NULL, lease_expires_at = NULL,"
    "  claimed_at = NULL, lost_count = t.lost_count + 1 FROM r WHERE t.id = r.id RETURNING t.id, t.task_queue)"
    " SELECT u.id, pg_notify(%s, %s || u.id::text), pg_notify(%s, %s || u.task_queue) FROM u"
)
_SQL_RELEASE = (
    "WITH u AS (UPDATE activity_tasks t SET status = 'pending', worker_id = NULL, lease_expires_at = NULL,"
    "  claimed_at = NULL, lost_count = t.lost_count + 1"
    "  WHERE t.id = ANY (%s) AND t.worker_id = %s AND t.status = 'running' RETURNING t.id, t.task_queue)"
    " SELECT u.id, pg_notify(%s, %s || u.id::text), pg_notify(%s, %s || u.task_queue) FROM u"
)

REAP_BATCH = 100


def _prefix(backend: _Backend) -> str:
    return backend.url.schema + "\t"


async def reap_expired(store: PostgresStore) -> list[int]:
    """Return running tasks whose lease expired (database clock) to ``pending``; their ids.

    Idempotent and safe to run anywhere at once (``SKIP LOCKED``); each reaped
    task's ``lost_count`` grows by one, which its engine reads as a lost worker.
    """
    backend = store._backend
    prefix = _prefix(backend)
    params = (REAP_BATCH, CHANNEL_CHANGES, prefix, CHANNEL_TASKS, prefix)

    def run(conn: Conn) -> list[int]:
        reaped: list[int] = []
        while True:
            with conn.transaction():
                rows = conn.execute(_SQL_REAP, params).fetchall()
            reaped.extend(int(r[0]) for r in rows)
            if len(rows) < REAP_BATCH:
                return reaped

    reaped = await backend.run("reaping expired activity tasks", run)
    if reaped:
        logger.warning(
            "%s: returned %d activity task(s) with expired leases to their queues",
            backend.location,
            len(reaped),
        )
    return reaped


# --------------------------------------------------------------------------
# Encoding outcomes
# --------------------------------------------------------------------------


def encode_error(error: ActivityError) -> str:
    return json.dumps(
        {
            "cause": error.cause.value,
            "type": error.type,
            "message": error.message,
            "details": None if error.details is None else error.details.json,
            "traceback": error.traceback,
        }
    )


def decode_error(text: str) -> ActivityError:
    data = json.loads(text)
    details = data.get("details")
    return ActivityError(
        cause=FailureCause(data["cause"]),
        type=data["type"],
        message=data["message"],
        details=None if details is None else Payload.from_json_text(details),
        traceback=data.get("traceback"),
    )


async def _reap_forever(store: PostgresStore, every: float) -> None:
    while True:
        try:
            await reap_expired(store)
        except StoreError as exc:
            logger.warning(
                "%s: reaping expired activity tasks failed (will retry): %s", store.url.location, exc
            )
        await trio.sleep(every)


# --------------------------------------------------------------------------
# The engine side
# --------------------------------------------------------------------------


@attrs.frozen
class _Snapshot:
    status: str
    outcome: str | None
    result: str | None
    error: str | None
    lost_count: int
    heartbeat_details: str | None
    heartbeat_expired: bool


def _worker_lost(request: ActivityRequest, why: str) -> ActivityOutcome:
    return ActivityOutcome(
        error=ActivityError(
            cause=FailureCause.RETRYABLE,
            type="WorkerLost",
            message=f"attempt {request.attempt} of activity:{request.activity_id}: {why}",
        ),
        kind=OutcomeKind.WORKER_LOST,
    )


@final
@attrs.define(eq=False)
class PostgresTaskDispatcher:
    """Sends activity attempts to remote workers through ``activity_tasks`` (an ``ActivityDispatcher``).

    Open it with :func:`open_task_dispatcher` and pass it to
    ``open_engine(..., dispatcher=...)``.  Requests for ``queues`` (all queues
    when ``None``) become task rows; the others run in the engine's process
    (the engine hands its in-process dispatcher over through
    :meth:`use_in_process`).

    ``dispatch`` inserts the row (an existing row of the same attempt is
    reused, so a re-dispatch after recovery is idempotent), NOTIFYs the
    queue, and waits for the row's outcome: woken by NOTIFY, polled every
    ``poll_interval`` seconds regardless.  A row whose worker was lost
    (``lost_count`` grew) returns a worker-lost outcome: the engine checks
    settlement and re-dispatches the same attempt, spending no budget.  A
    running row silent for longer than its ``heartbeat_timeout`` (plus
    ``poll_interval`` of grace) is cancelled and fails as a heartbeat timeout.
    Cancelling ``dispatch`` (attempt timeout, workflow cancelled, engine
    shutdown) marks the row cancelled, shielded, so its worker stops the
    attempt; a re-dispatch of a cancelled attempt queues it again.
    """

    store: PostgresStore
    queues: frozenset[str] | None
    poll_interval: float
    _local: ActivityDispatcher | None = attrs.field(default=None, init=False)
    _waiters: dict[int, trio.Event] = attrs.field(factory=dict, init=False)

    def use_in_process(self, local: ActivityDispatcher) -> None:
        """Receive the engine's in-process dispatcher, for the queues not sent to workers."""
        self._local = local

    def remote(self, task_queue: str) -> bool:
        """Whether attempts on ``task_queue`` go to remote workers."""
        return self.queues is None or task_queue in self.queues

    def _changed(self, channel: str, payload: str) -> None:
        if channel != CHANNEL_CHANGES:
            return
        try:
            event = self._waiters.get(int(payload))
        except ValueError:
            return
        if event is not None:
            event.set()

    async def dispatch(self, request: ActivityRequest) -> ActivityOutcome:
        """Run one attempt: as a task row for a remote worker, or in process (see the class)."""
        if not self.remote(request.task_queue):
            if self._local is None:
                raise RuntimeError(
                    "PostgresTaskDispatcher: no in-process dispatcher for task queue "
                    f"{request.task_queue!r}; pass this dispatcher to open_engine(dispatcher=...)"
                )
            return await self._local.dispatch(request)
        task_id, lost_seen = await self._insert(request)
        # The details the attempt's workers reported, handed to the engine as they arrive.
        details_seen = None if request.heartbeat_details is None else request.heartbeat_details.json
        event = trio.Event()
        self._waiters[task_id] = event
        settled = False
        try:
            while True:
                snap = await self._read(task_id)
                if snap is None:
                    settled = True
                    return _worker_lost(request, "its task row disappeared")
                if snap.heartbeat_details is not None and snap.heartbeat_details != details_seen:
                    details_seen = snap.heartbeat_details
                    report_heartbeat_details(Payload.from_json_text(details_seen))
                if snap.status == "done":
                    settled = True
                    return self._outcome(request, snap)
                if snap.lost_count > lost_seen:
                    settled = True
                    return _worker_lost(
                        request, "the worker running it was lost (its lease expired or it was released)"
                    )
                if snap.status == "cancelled":
                    settled = True
                    return _worker_lost(request, "its task was cancelled by another engine")
                if snap.heartbeat_expired and await self._cancel(task_id):
                    settled = True
                    options = request.resolved_options()
                    return ActivityOutcome(
                        error=ActivityError(
                            cause=FailureCause.TIMEOUT,
                            type="HeartbeatTimeout",
                            message=f"attempt {request.attempt} sent no heartbeat for "
                            f"{options.heartbeat_timeout}s (remote worker)",
                        )
                    )
                with trio.move_on_after(self.poll_interval):
                    await event.wait()
                event = self._waiters[task_id] = trio.Event()
        finally:
            del self._waiters[task_id]
            if not settled:
                # Stopped by the engine: tell the worker, whatever cancelled us.
                with trio.CancelScope(shield=True) as shield:
                    shield.deadline = trio.current_time() + 10
                    try:
                        await self._cancel(task_id)
                    except StoreError as exc:
                        logger.warning("could not mark activity task %d cancelled: %s", task_id, exc)

    def _outcome(self, request: ActivityRequest, snap: _Snapshot) -> ActivityOutcome:
        if snap.outcome == "completed" and snap.result is not None:
            return ActivityOutcome(result=Payload.from_json_text(snap.result))
        if snap.error is not None:
            return ActivityOutcome(error=decode_error(snap.error))
        return ActivityOutcome(
            error=ActivityError(
                cause=FailureCause.TERMINAL,
                type="MalformedTaskRow",
                message=f"activity task of attempt {request.attempt} is done without a result or error",
            )
        )

    async def _insert(self, request: ActivityRequest) -> tuple[int, int]:
        backend = self.store._backend
        options = request.resolved_options()
        params = (
            request.workflow_id,
            request.run_id,
            request.activity_id,
            request.attempt,
            request.task_queue,
            request.activity_type,
            request.input.json,
            request.options.json,
            options.timeout,
            options.heartbeat_timeout,
            None if request.heartbeat_details is None else request.heartbeat_details.json,
        )
        key = (request.workflow_id, request.run_id, request.activity_id, request.attempt)
        note = _prefix(backend) + request.task_queue

        def run(conn: Conn) -> tuple[int, int]:
            with conn.transaction():
                conn.execute(_SQL_INSERT, params)
                found = conn.execute(_SQL_FIND, key).fetchone()
                assert found is not None
                if found[2] == "pending":
                    conn.execute(_SQL_NOTIFY, (CHANNEL_TASKS, note))
            return int(found[0]), int(found[1])

        return await backend.run("dispatching an activity task", run)

    async def _read(self, task_id: int) -> _Snapshot | None:
        grace = self.poll_interval

        def run(conn: Conn) -> _Snapshot | None:
            row = conn.execute(_SQL_STATE, (grace, task_id)).fetchone()
            return None if row is None else _Snapshot(*row)

        return await self.store._backend.run("reading an activity task", run)

    async def _cancel(self, task_id: int) -> bool:
        prefix = _prefix(self.store._backend)

        def run(conn: Conn) -> bool:
            return conn.execute(_SQL_CANCEL, (task_id, CHANNEL_CHANGES, prefix)).fetchone() is not None

        return await self.store._backend.run("cancelling an activity task", run)


@contextlib.asynccontextmanager
async def open_task_dispatcher(
    store: PostgresStore,
    *,
    queues: Collection[str] | None = None,
    poll_interval: float | None = None,
    reap_interval: float | None = None,
) -> AsyncIterator[PostgresTaskDispatcher]:
    """A :class:`PostgresTaskDispatcher` over ``store``, with its LISTEN task and reaper.

    ``queues``: the task queues whose attempts go to remote workers (``None``:
    every queue).  ``poll_interval`` (default: the store URL's
    ``?poll_interval=``, 1 s): seconds between reads of a waiting task even
    without a NOTIFY.  ``reap_interval`` (default
    ``poll_interval``): seconds between runs of the reaper that returns
    tasks with expired leases to their queues.
    """
    if poll_interval is None:
        poll_interval = store.url.poll_interval
    if not poll_interval > 0:
        raise ValueError(f"poll_interval must be > 0 seconds, got {poll_interval!r}")
    reap_every = poll_interval if reap_interval is None else reap_interval
    if not reap_every > 0:
        raise ValueError(f"reap_interval must be > 0 seconds, got {reap_interval!r}")
    if queues is not None and (isinstance(queues, str) or not all(isinstance(q, str) and q for q in queues)):
        raise TypeError(f"queues must be a collection of non-empty str (or None for all), got {queues!r}")
    dispatcher = PostgresTaskDispatcher(
        store=store, queues=None if queues is None else frozenset(queues), poll_interval=poll_interval
    )
    backend = store._backend
    with deliver_to_trio(backend.listener, (CHANNEL_CHANGES,), _prefix(backend), dispatcher._changed):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_reap_forever, store, reap_every)
            try:
                yield dispatcher
            finally:
                nursery.cancel_scope.cancel()


# --------------------------------------------------------------------------
# The worker side
# --------------------------------------------------------------------------


@attrs.define(eq=False)
class _Running:
    task_id: int
    attempt: int
    scope: trio.CancelScope
    beats: list[str | None] = attrs.field(factory=list)
    #: The last details the attempt reported (JSON), flushed or not.
    details: str | None = None
    #: Why the attempt was stopped from outside (cancelled, lost, drained), if it was.
    stopped: str | None = None


def _request_from_row(row: Sequence[Any]) -> tuple[int, ActivityRequest, float | None]:
    (
        task_id,
        workflow_id,
        run_id,
        activity_id,
        attempt,
        queue,
        activity_type,
        input_,
        options,
        timeout,
        details,
    ) = row
    request = ActivityRequest(
        workflow_id=workflow_id,
        run_id=run_id,
        activity_id=int(activity_id),
        activity_type=activity_type,
        input=Payload.from_json_text(input_),
        attempt=int(attempt),
        task_queue=queue,
        options=Payload.from_json_text(options),
        heartbeat_details=None if details is None else Payload.from_json_text(details),
    )
    return int(task_id), request, timeout


def worker_identity() -> str:
    """``host:pid:random``: unique per worker, readable in ``activity_tasks.worker_id``."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


@final
@attrs.define(eq=False)
class ActivityWorker:
    """Claims, runs and reports the activity tasks of some queues (one per process is typical)."""

    store: PostgresStore
    execute: Executor
    queues: tuple[str, ...]
    concurrency: int
    lease_ttl: float
    poll_interval: float
    worker_id: str = attrs.field(factory=worker_identity)
    _running: dict[int, _Running] = attrs.field(factory=dict, init=False)
    _work: trio.Event = attrs.field(factory=trio.Event, init=False)
    _flush: trio.Event = attrs.field(factory=trio.Event, init=False)
    _idle: trio.Event = attrs.field(factory=trio.Event, init=False)

    @property
    def running(self) -> int:
        return len(self._running)

    def _wake_claimer(self) -> None:
        self._work.set()

    def _notified(self, channel: str, payload: str) -> None:
        if channel == CHANNEL_TASKS:
            if payload in self.queues:
                self._wake_claimer()
        elif channel == CHANNEL_CHANGES:
            try:
                task_id = int(payload)
            except ValueError:
                return
            if task_id in self._running:
                self._flush.set()  # the lease loop sees whether it is still ours

    # -- claiming ------------------------------------------------------------

    async def claim(self, limit: int) -> list[tuple[int, ActivityRequest, float | None]]:
        params = (list(self.queues), limit, self.worker_id, self.lease_ttl)

        def run(conn: Conn) -> list[tuple[int, ActivityRequest, float | None]]:
            with conn.transaction():
                rows = conn.execute(_SQL_CLAIM, params).fetchall()
            return [_request_from_row(r) for r in rows]

        return await self.store._backend.run("claiming activity tasks", run)

    async def claim_loop(self, nursery: trio.Nursery, stop: trio.Event) -> None:
        while not stop.is_set():
            self._work = trio.Event()
            free = self.concurrency - len(self._running)
            claimed: list[tuple[int, ActivityRequest, float | None]] = []
            if free > 0:
                try:
                    claimed = await self.claim(free)
                except StoreError as exc:
                    logger.warning(
                        "%s: claiming activity tasks failed (will retry): %s", self.store.url.location, exc
                    )
            for task_id, request, timeout in claimed:
                running = _Running(task_id=task_id, attempt=request.attempt, scope=trio.CancelScope())
                self._running[task_id] = running
                nursery.start_soon(self._run_one, running, request, timeout)
            if len(claimed) == free and free > 0:
                await trio.lowlevel.checkpoint()
                continue  # there may be more
            with trio.move_on_after(self.poll_interval):
                await self._work.wait()

    # -- running one attempt ---------------------------------------------------

    async def _run_one(
        self, running: _Running, request: ActivityRequest, attempt_timeout: float | None
    ) -> None:
        log = {
            "workflow_id": request.workflow_id,
            "activity": request.activity_id,
            "attempt": request.attempt,
        }

        def on_heartbeat(details: Payload | None) -> None:
            running.beats.append(None if details is None else details.json)
            if details is not None:
                running.details = details.json
            self._flush.set()

        outcome: ActivityOutcome | None = None
        try:
            with running.scope:
                with trio.move_on_after(math.inf if attempt_timeout is None else attempt_timeout) as limit:
                    outcome = await self.execute(request, on_heartbeat)
                if limit.cancelled_caught:
                    outcome = ActivityOutcome(
                        error=ActivityError(
                            cause=FailureCause.TIMEOUT,
                            type="ActivityTimeout",
                            message=f"attempt {request.attempt} timed out after {attempt_timeout}s (remote worker)",
                        )
                    )
            if outcome is None:
                logger.info("activity task %d stopped: %s", running.task_id, running.stopped, extra=log)
                return
            if outcome.kind is OutcomeKind.ASYNC:
                # Not on remote workers (yet): the engine would wait for a token nobody can use.
                outcome = ActivityOutcome(
                    error=ActivityError(
                        cause=FailureCause.TERMINAL,
                        type="AsyncCompletionUnsupported",
                        message="aion_trio.complete_async() is not supported on remote task-queue workers",
                    )
                )
            with trio.CancelScope(shield=True):
                if outcome.kind is OutcomeKind.WORKER_LOST:
                    await self.release([running.task_id])
                elif not await self.complete(running.task_id, request.attempt, outcome, running.details):
                    logger.info(
                        "activity task %d: result of attempt %d ignored (no longer this worker's running attempt)",
                        running.task_id,
                        request.attempt,
                        extra=log,
                    )
        except StoreError as exc:
            # The lease runs out and the reaper hands the attempt to another worker.
            logger.warning(
                "activity task %d: could not write its outcome: %s", running.task_id, exc, extra=log
            )
        except trio.Cancelled:
            if running.stopped is None:
                # The whole worker is being cancelled: hand the attempt back now.
                with trio.CancelScope(shield=True):
                    try:
                        await self.release([running.task_id])
                    except StoreError as exc:
                        logger.warning(
                            "activity task %d not released; the reaper will: %s", running.task_id, exc
                        )
            raise
        finally:
            self._running.pop(running.task_id, None)
            self._idle.set()
            self._wake_claimer()

    async def complete(
        self, task_id: int, attempt: int, outcome: ActivityOutcome, details: str | None = None
    ) -> bool:
        """Write ``outcome`` (with the attempt's last heartbeat ``details``, JSON, if any: a beat
        not yet flushed still reaches the engine), guarded by the attempt token; ``False`` if
        the row is no longer ours."""
        if outcome.ok:
            assert outcome.result is not None
            values: tuple[str, str | None, str | None] = ("completed", outcome.result.json, None)
        else:
            assert outcome.error is not None
            values = ("failed", None, encode_error(outcome.error))
        params = (
            *values,
            details,
            task_id,
            attempt,
            self.worker_id,
            CHANNEL_CHANGES,
            _prefix(self.store._backend),
        )

        def run(conn: Conn) -> bool:
            return conn.execute(_SQL_COMPLETE, params).fetchone() is not None

        return await self.store._backend.run("writing an activity outcome", run)

    async def release(self, task_ids: Sequence[int]) -> list[int]:
        """Hand running attempts back to their queues (counted as lost: same attempt, no budget)."""
        prefix = _prefix(self.store._backend)
        params = (list(task_ids), self.worker_id, CHANNEL_CHANGES, prefix, CHANNEL_TASKS, prefix)

        def run(conn: Conn) -> list[int]:
            with conn.transaction():
                return [int(r[0]) for r in conn.execute(_SQL_RELEASE, params).fetchall()]

        return await self.store._backend.run("releasing activity tasks", run)

    # -- leases and heartbeats ---------------------------------------------------

    async def renew(self) -> None:
        """Extend the leases of running attempts, write their heartbeats, stop the ones lost."""
        running = dict(self._running)
        if not running:
            return
        beats = {tid: r.beats[-1] for tid, r in running.items() if r.beats}
        for tid in beats:
            running[tid].beats.clear()
        params = (self.lease_ttl, list(running), self.worker_id)

        def run(conn: Conn) -> set[int]:
            with conn.transaction():
                kept = {int(r[0]) for r in conn.execute(_SQL_RENEW, params).fetchall()}
                for tid, details in beats.items():
                    if tid in kept:
                        conn.execute(_SQL_HEARTBEAT, (details, tid, self.worker_id))
            return kept

        kept = await self.store._backend.run("renewing activity task leases", run)
        for tid, r in running.items():
            if tid not in kept and tid in self._running:
                # Cancelled by its engine, or reaped and handed to someone else.
                r.stopped = "its task was cancelled or is no longer leased to this worker"
                r.scope.cancel()

    async def lease_loop(self) -> None:
        every = self.lease_ttl / 3
        while True:
            with trio.move_on_after(every):
                await self._flush.wait()
            self._flush = trio.Event()
            try:
                await self.renew()
            except StoreError as exc:
                logger.warning(
                    "%s: renewing activity task leases failed (will retry): %s", self.store.url.location, exc
                )
            await trio.sleep(0.05)  # coalesce bursts of heartbeats

    # -- the whole worker ----------------------------------------------------

    async def serve(
        self,
        *,
        drain_timeout: float,
        stop: trio.Event,
        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        backend = self.store._backend
        channels = (CHANNEL_TASKS, CHANNEL_CHANGES)
        with deliver_to_trio(backend.listener, channels, _prefix(backend), self._notified):
            async with trio.open_nursery() as services:
                services.start_soon(_reap_forever, self.store, self.poll_interval)
                services.start_soon(self.lease_loop)
                try:
                    async with trio.open_nursery() as attempts:
                        claimer = trio.CancelScope()

                        async def claiming() -> None:
                            with claimer:
                                await self.claim_loop(attempts, stop)

                        attempts.start_soon(claiming)
                        logger.info(
                            "%s: worker %s serving queue(s) %s, up to %d at once",
                            backend.location,
                            self.worker_id,
                            ", ".join(self.queues),
                            self.concurrency,
                        )
                        task_status.started(self.worker_id)
                        await stop.wait()
                        claimer.cancel()
                        with trio.move_on_after(drain_timeout):
                            while self._running:
                                self._idle = trio.Event()
                                await self._idle.wait()
                        await self._release_all("drain timeout")
                        attempts.cancel_scope.cancel()
                finally:
                    with trio.CancelScope(shield=True):
                        await self._release_all("the worker stopped")
                    services.cancel_scope.cancel()

    async def _release_all(self, why: str) -> None:
        if not self._running:
            return
        for r in self._running.values():
            r.stopped = why
            r.scope.cancel()
        ids = list(self._running)
        try:
            released = await self.release(ids)
        except StoreError as exc:
            logger.warning("could not release %d activity task(s); the reaper will: %s", len(ids), exc)
            return
        if released:
            logger.warning(
                "%s: released %d running activity task(s) back to their queues", why, len(released)
            )


async def serve_activity_tasks(
    store: PostgresStore,
    execute: Executor,
    queues: Sequence[str],
    *,
    concurrency: int,
    drain_timeout: float,
    stop: trio.Event,
    lease_ttl: float = 30.0,
    poll_interval: float = 1.0,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    worker = ActivityWorker(
        store=store,
        execute=execute,
        queues=tuple(queues),
        concurrency=concurrency,
        lease_ttl=lease_ttl,
        poll_interval=poll_interval,
    )
    await worker.serve(drain_timeout=drain_timeout, stop=stop, task_status=task_status)
