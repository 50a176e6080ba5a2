"""The worker threads: one writer that group-commits, a few readers.

A Trio task hands a request to a thread and parks in
:func:`trio.lowlevel.wait_task_rescheduled`; the thread runs it and wakes the
task through the run's :class:`trio.lowlevel.TrioToken`.  One write at a
time (the *listener*; always the write of a lone writer) instead waits on a
socket the writer thread sends one byte to: that skips ``run_sync_soon``'s
wake-up socket and extra task step, about halving the round trip.  The byte
stays in the socket until the next listener hands its write over.  A request still
waiting in the queue when its task is cancelled is withdrawn (Abort.SUCCEEDED):
nothing of it ran.  Once a thread has taken it, the abort fails and the task
waits for the real outcome; Trio then delivers the cancellation at the
caller's next checkpoint.  That is the append contract: raised ``Cancelled``
means nothing was written; returned means committed.

Group commit: the writer takes *every* queued write at once and applies them
in one ``BEGIN IMMEDIATE`` ... ``COMMIT``.  Writes that arrive while a commit
is in flight form the next group.  A refused write (sequence conflict) writes
nothing and does not disturb the others; a write whose statements fail for a
reason of its own is isolated by replaying the group without it; if the
transaction itself fails, every write in it gets the mapped backend error
(``BackendUnavailable``: outcome unknown).

Inline commits: a lone write made while the Trio run has nothing else to do
(no runnable task, no pending thread result) and the writer thread is asleep
with nothing queued (but riders, which it takes along) commits on the Trio
thread itself.  The loop had nothing
to do but wait for that commit, and handing it to the writer thread and back
costs two cross-CPU wake-ups: measured on a 2-vCPU VM, ~90-200 us each, as
much as the commit itself.  The loop is blocked for the commit (its fsync
included), so: the write lock is tried without waiting (another process
holding it sends the write to the thread, which waits for it); inline
commits stop while the moving average of commit times (on either thread) is
above :data:`INLINE_SLOW` (a slow disk), and for :data:`INLINE_COOLDOWN`
after one commit took over :data:`INLINE_STALL` (a stall); checkpoints and WAL upkeep
always run on the writer thread; ``inline_commits=off`` (URL) keeps every
commit on the thread.  Cancellation keeps the append contract: an inline
commit starts only if the caller is not cancelled, and runs to its end.

WAL upkeep: the writer connection's WAL hook records how many frames the WAL
holds after each commit; between transactions, the writer thread checkpoints
once that reaches the threshold (what ``PRAGMA wal_autocheckpoint`` does, but
after the committed writers were woken instead of inside their commit) and,
with ``synchronous=FULL``, keeps zero-filled room past the WAL's end
(:mod:`._walroom`).
"""

from __future__ import annotations

import collections
import functools
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar, final

import apsw
import attrs
import trio

from aion_trio import AionInternalError, DatabaseCorrupt
from aion_trio.plugin import hold_mock_time

from ._mapping import TRANSACTION_ERRORS, cause, runtime_error
from ._walguard import WalGuard
from ._walroom import WalRoom
from ._writes import AppendOp, WriteOp, apply_group, fence

T = TypeVar("T")

INLINE_SLOW = 0.002
"""Seconds: inline commits stop while the recent commits' average (:data:`INLINE_WEIGHT`) is above this."""
INLINE_WEIGHT = 1 / 8
"""Weight of the newest commit in that moving average."""
INLINE_STALL = 0.020
"""Seconds: a single commit slower than this stops inline commits for :data:`INLINE_COOLDOWN`."""
INLINE_COOLDOWN = 1.0
"""Seconds without inline commits after a stalled commit (each stall restarts it)."""
RIDER_WAIT = 0.005
"""Seconds a group of riders alone (visibility rows) waits for another write to join it."""


class ReadOp(Generic[T]):
    """A read: ``function(conn)`` runs in a reader thread."""

    __slots__ = ("error", "function", "task", "value")

    def __init__(self, function: Callable[[apsw.Connection], T]) -> None:
        self.function = function
        self.task: Any = None
        self.value: T | None = None
        self.error: BaseException | None = None


@final
@attrs.frozen(kw_only=True)
class WriterStatistics:
    """Counters of a store's writer thread (a snapshot)."""

    commits: int
    """Transactions committed."""
    writes: int
    """Writes committed (appends, timer and visibility writes)."""
    appends: int
    """Append batches committed."""
    events: int
    """Events committed."""
    refused: int
    """Writes refused without writing anything (sequence conflicts, values SQLite rejects)."""
    failed_transactions: int
    """Transactions that failed as a whole (each of their writers got the backend error)."""
    largest_group: int
    """Most writes ever coalesced into one transaction."""
    inline_commits: int = 0
    """Of ``commits``, those made on the Trio thread (a lone write while the loop was idle)."""
    checkpoints: int = 0
    """WAL checkpoints the writer thread ran (at the threshold)."""


class _Service:
    """A queue of requests served by threads, with cancellable waiting."""

    def __init__(self, token: trio.lowlevel.TrioToken) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._pending: collections.OrderedDict[Any, None] = collections.OrderedDict()
        self._stopping = False
        self._token = token
        self._running = 0
        self._threads: list[threading.Thread] = []
        self._stopped = trio.Event()

    async def _submit(self, request: Any) -> None:
        request.task = trio.lowlevel.current_task()
        if self._stopping:
            raise trio.ClosedResourceError("the store is closed")
        self._enqueue(request)

        def abort(raise_cancel: object) -> trio.lowlevel.Abort:
            # Still queued: withdrawn, nothing of it ran.  Taken: wait for it.
            if self._withdraw(request):
                return trio.lowlevel.Abort.SUCCEEDED
            return trio.lowlevel.Abort.FAILED

        with hold_mock_time():  # a MockClock's autojump waits for the thread
            await trio.lowlevel.wait_task_rescheduled(abort)
        if request.error is not None:
            raise request.error

    def _enqueue(self, request: Any) -> None:
        with self._lock:
            self._pending[request] = None
            self._notify()

    def _notify(self) -> None:
        # Called with the lock held: a request was queued.
        self._wake.notify()

    def _notify_all(self) -> None:
        # Called with the lock held: stopping.
        self._wake.notify_all()

    def _withdraw(self, request: Any) -> bool:
        with self._lock:
            return self._pending.pop(request, False) is None

    def _start(self, name: str, target: Callable[[], None]) -> None:
        self._running += 1
        thread = threading.Thread(target=self._thread_main, args=(target,), name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _thread_main(self, target: Callable[[], None]) -> None:
        try:
            target()
        finally:
            with self._lock:
                self._running -= 1
                last = self._running == 0
            if last:
                self._call_soon(self._stopped.set)

    def _call_soon(self, function: Callable[..., object], *args: object) -> None:
        try:
            self._token.run_sync_soon(function, *args)
        except trio.RunFinishedError:  # pragma: no cover - the run ended under us; nobody waits
            pass

    @staticmethod
    def _deliver(requests: Sequence[Any]) -> None:
        # Runs in the Trio thread.
        for request in requests:
            trio.lowlevel.reschedule(request.task)

    async def stop(self) -> None:
        """Finish every queued request, then end the threads (shielded from cancellation)."""
        with self._lock:
            self._stopping = True
            self._notify_all()
        with trio.CancelScope(shield=True), hold_mock_time():
            if self._running:
                await self._stopped.wait()
        # Each thread closed its connection before signalling; all that is left
        # is returning from its function, so these joins do not wait.
        for thread in self._threads:
            thread.join()


@final
class Writer(_Service):
    """The single writing connection and its group-commit thread."""

    def __init__(
        self,
        conn: apsw.Connection,
        location: str,
        token: trio.lowlevel.TrioToken,
        *,
        busy_timeout_ms: int,
        checkpoint_pages: int,
        room: WalRoom | None = None,
        guard: WalGuard | None = None,
        inline: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(token)
        self._busy_ms = busy_timeout_ms
        #: The token of the owner claim this handle holds (set by ``claim_owner``): every
        #: transaction first checks it is still the stored claim (:func:`~._writes.fence`).
        self.fence: str | None = None
        # WAL upkeep (writer thread, between transactions): the hook records the
        # WAL's frames after every commit, on whichever thread committed.
        self._checkpoint_pages = checkpoint_pages
        self._frames = 0
        self._room = room
        self._guard = guard
        self._upkeep_due = False  # set by an inline commit that left upkeep to do
        # Riders (RiderOp) queued alone are committed by this time at the latest.
        self._riders_due = 0.0
        # True while the Trio thread commits on the connection (inline): the
        # writer thread takes no group meanwhile.
        self._borrowed = False
        # True from the writer thread taking a group until it is done with it (upkeep included).
        self._busy = False
        conn.set_wal_hook(self._wal_hook)
        self._inline = inline
        self._clock = clock
        self._inline_resume_at = -float("inf")
        self._commit_average = 0.0  # seconds, moving average of every commit's duration
        # The one writer thread sleeps on ``_gate`` (held while it sleeps)
        # instead of the condition: waking it is one lock release, and a
        # write queued while it is busy costs no wake-up call at all.
        self._gate = threading.Lock()
        self._gate.acquire()
        self._sleeping = False
        # The listener: at most one waiting append at a time is woken through
        # this socket (the thread sends one byte once its write is done) and
        # waits on it directly, not through ``run_sync_soon``, whose extra
        # task step and wake-up socket about double the cost of a round
        # trip.  One writer is always the listener; in a group, the others
        # are delivered as before.  Written by the Trio thread only.
        self._listener: WriteOp | None = None
        # Only while writes come one at a time (the last group held one
        # write): a listener's wait registers its socket with epoll, which
        # lets the writer thread take the GIL in the middle of the scheduler
        # batch that is resubmitting a whole group, so the group would be
        # split in two commits.  Written by the writer thread.
        self._solo = True
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._conn = conn
        self._location = location
        self._commits = 0
        self._writes = 0
        self._appends = 0
        self._events = 0
        self._refused = 0
        self._failed = 0
        self._largest = 0
        self._inline_commits = 0
        self._checkpoints = 0
        self._start(f"aion_trio sqlite writer ({location})", self._run)

    async def submit(self, op: WriteOp) -> None:
        """Queue ``op`` and wait until it is committed (or refused, or failed)."""
        if op.rider or self._listener is not None or not self._solo:
            await self._submit(op)
            return
        # The cancel point comes before anything is queued: a cancelled caller
        # has written nothing.
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._may_inline() and self._commit_inline(op):
            # Committed (or refused) here: still a schedule point, as every store
            # call is; not a cancel point, the write is done.
            await trio.lowlevel.cancel_shielded_checkpoint()
            if op.error is not None:
                raise op.error
            return
        op.task = trio.lowlevel.current_task()
        if self._stopping:
            raise trio.ClosedResourceError("the store is closed")
        with self._lock:
            self._pending[op] = None
            self._listener = op
            self._notify()
        # The byte an earlier listener left is drained here, while the writer
        # thread wakes up, not by each listener on its way back: that recv
        # would put a system call, and a GIL release that lets the writer
        # thread cut in, between the commit and the caller (measured, one
        # writer with both threads on one CPU: 95 -> 84 us per append).
        self._drain()
        try:
            try:
                with hold_mock_time():  # a MockClock's autojump waits for the thread
                    waited = await self._signalled(op)
                if not waited:
                    # The writer finished before this task waited (its thread ran
                    # while ours was in a system call): still a schedule point, as
                    # every store call is; the write is committed, so not a cancel point.
                    await trio.lowlevel.cancel_shielded_checkpoint()
            except trio.Cancelled:
                # Still queued: withdrawn, nothing of it ran.  Taken: wait for
                # it (the cancellation then arrives at the next checkpoint).
                if self._withdraw(op):
                    raise
                with trio.CancelScope(shield=True), hold_mock_time():
                    await self._signalled(op)
        finally:
            if not op.done:
                # Leaving early (withdrawn above, or another exception): make
                # sure the thread never takes it without knowing it was ours.
                self._withdraw(op)
            self._listener = None
        if op.error is not None:
            raise op.error

    def _may_inline(self) -> bool:
        """Whether a lone write may commit on the Trio thread now (see the module's docstring);
        if so, the connection is borrowed until :meth:`_commit_inline` hands it back."""
        if not self._inline or self._stopping or self._commit_average > INLINE_SLOW:
            return False
        if self._clock() < self._inline_resume_at:
            return False
        stats = trio.lowlevel.current_statistics()
        if stats.tasks_runnable or stats.run_sync_soon_queue_size:
            return False  # the loop has other work: it must not wait for a commit
        with self._lock:
            # Idle, with nothing queued but riders: borrowed, it takes no group
            # (it may be awake, holding riders), and only this thread queues writes.
            if self._busy or self._upkeep_due or any(not op.rider for op in self._pending):
                return False
            self._borrowed = True
            return True

    def _commit_inline(self, op: WriteOp) -> bool:
        """Commit ``op``, with the queued riders, on this (the Trio) thread; ``False``: the
        write lock was busy and nothing was done.  Hands the connection back either way."""
        conn = self._conn
        try:
            conn.set_busy_timeout(0)
            try:
                conn.execute("BEGIN IMMEDIATE")
            except apsw.Error:
                return False  # another process writes: the writer thread waits for the lock instead
            finally:
                conn.set_busy_timeout(self._busy_ms)
            with self._lock:
                riders: list[WriteOp] = list(self._pending)
                self._pending.clear()
            self._commit_reporting([op, *riders], begun=True)
            self._inline_commits += 1
            self._deliver(riders)
            return True
        finally:
            with self._lock:
                self._borrowed = False
                if self._upkeep_wanted():
                    self._upkeep_due = True
                if self._pending or self._upkeep_due or self._stopping:
                    self._notify()

    async def _signalled(self, op: WriteOp) -> bool:
        # ``done`` decides, not the byte.  Our own byte is left in the socket
        # (the next listener drains it); a byte that woke us before ``done``
        # was set is an earlier listener's (one that went away early, or one
        # whose ``done`` we saw before its byte arrived): drain it, wait again.
        waited = False
        while not op.done:
            await trio.lowlevel.wait_readable(self._wake_r)
            waited = True
            if not op.done:
                self._drain()
        return waited

    def _drain(self) -> None:
        try:
            self._wake_r.recv(64)
        except BlockingIOError:
            pass

    def _deliver_with_listener(self, others: Sequence[WriteOp]) -> None:
        # Runs in the Trio thread.  The listener's byte is sent from here, not
        # from the writer thread, so the whole group wakes in one scheduler
        # batch and its next writes reach the writer together: a listener
        # woken ahead of its group would commit its next write alone and
        # split every later group in two (twice the fsyncs).
        self._deliver(others)
        self._wake_w.send(b"\0")

    async def stop(self) -> None:
        await super().stop()
        with trio.CancelScope(shield=True):
            # The thread has sent its last byte; let a woken listener read it.
            while self._listener is not None:
                await trio.lowlevel.checkpoint()
        self._wake_r.close()
        self._wake_w.close()

    def statistics(self) -> WriterStatistics:
        return WriterStatistics(
            commits=self._commits,
            writes=self._writes,
            appends=self._appends,
            events=self._events,
            refused=self._refused,
            failed_transactions=self._failed,
            largest_group=self._largest,
            inline_commits=self._inline_commits,
            checkpoints=self._checkpoints,
        )

    def _enqueue(self, request: Any) -> None:
        with self._lock:
            if request.rider and not self._pending:
                self._riders_due = self._clock() + RIDER_WAIT
            self._pending[request] = None
            # A rider wakes the thread too: it sleeps on until the riders are due.
            self._notify()

    def _notify(self) -> None:
        if self._sleeping:
            self._sleeping = False
            self._gate.release()

    _notify_all = _notify

    def _next_group(self) -> tuple[list[WriteOp], WriteOp | None] | None:
        """Every queued write and the listener then (``None``: stopping, nothing left); sleeps until
        there is one, or upkeep an inline commit left.  Riders alone are held until due."""
        while True:
            with self._lock:
                self._busy = False
                wait: float | None = None
                if self._borrowed:
                    pass  # the Trio thread commits on the connection: sleep until it hands back
                elif self._stopping or self._upkeep_due or any(not op.rider for op in self._pending):
                    if self._stopping and not self._pending and not self._upkeep_due:
                        return None
                    return self._take()
                elif self._pending:
                    wait = self._riders_due - self._clock()
                    if wait <= 0:
                        return self._take()
                self._sleeping = True
            if wait is None:
                self._gate.acquire()
            elif not self._gate.acquire(timeout=wait):
                with self._lock:
                    if self._sleeping:
                        self._sleeping = False  # nobody woke it
                    else:
                        # Woken just as the wait ran out: the gate was released; hold it again.
                        self._gate.acquire()

    def _take(self) -> tuple[list[WriteOp], WriteOp | None]:
        # With the lock held.  An empty group: only upkeep to do.
        self._busy = True
        group: list[WriteOp] = list(self._pending)
        self._pending.clear()
        writes = sum(not op.rider for op in group)
        if writes:
            self._solo = writes == 1
        return group, self._listener

    def _run(self) -> None:
        try:
            while True:
                taken = self._next_group()
                if taken is None:
                    return
                group, listener = taken
                if group:
                    self._commit_reporting(group)
                    if listener is not None and listener in group:
                        listener.done = True
                        if len(group) == 1:
                            self._wake_w.send(b"\0")
                        else:
                            others = [op for op in group if op is not listener]
                            self._call_soon(self._deliver_with_listener, others)
                    else:
                        self._call_soon(self._deliver, group)
                # After the wake-up: the writers just committed never wait for it.
                self._upkeep()
        finally:
            self._conn.set_wal_hook(None)
            self._conn.close()

    def _wal_hook(self, conn: apsw.Connection, name: str, frames: int) -> int:
        # Called by SQLite right after a commit, on the committing thread.
        self._frames = frames
        return apsw.SQLITE_OK

    def _upkeep_wanted(self) -> bool:
        return (
            self._frames >= self._checkpoint_pages
            or (self._room is not None and self._room.wanted(self._frames))
            or (self._guard is not None and self._guard.due(self._clock()))
        )

    def _upkeep(self) -> None:
        """Writer thread, between transactions: checkpoint at the threshold, keep WAL room."""
        self._upkeep_due = False
        if self._frames >= self._checkpoint_pages:
            try:
                self._conn.wal_checkpoint(mode=apsw.SQLITE_CHECKPOINT_PASSIVE)
                self._checkpoints += 1
            except apsw.Error:
                pass  # as SQLite's own auto-checkpoint: a later commit tries again
        if self._room is not None:
            self._room.keep(self._conn, self._frames)
        if self._guard is not None:
            now = self._clock()
            if self._guard.due(now):
                self._guard.check(self._conn, now)

    def _commit_reporting(self, group: list[WriteOp], begun: bool = False) -> None:
        try:
            self._commit(group, begun)
        except BaseException as exc:  # pragma: no cover - a bug in this package
            for op in group:
                op.error = cause(
                    AionInternalError(f"{self._location}: writer thread failed: {exc!r}; please report it"),
                    exc,
                )

    def _transaction(self, ops: Sequence[WriteOp], fast: bool, begun: bool = False) -> WriteOp | None:
        """Run ``ops`` in one transaction (``begun``: already open); return the write to drop
        if one failed on its own."""
        conn = self._conn
        try:
            if not begun:
                conn.execute("BEGIN IMMEDIATE")
            token = self.fence
            if token is not None:
                ops = fence(conn, ops, token, self._location)
            if fast:
                apply_group(conn, ops)
            else:
                for op in ops:
                    try:
                        op.apply(conn)
                    except TRANSACTION_ERRORS:
                        raise
                    except Exception as exc:
                        op.error = op.local_error(exc, self._location)
                        conn.execute("ROLLBACK")
                        return op
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        return None

    def _commit(self, group: list[WriteOp], begun: bool = False) -> None:
        began = self._clock()
        try:
            self._commit_group(group, begun)
        finally:
            ended = self._clock()
            took = ended - began
            self._commit_average += (took - self._commit_average) * INLINE_WEIGHT
            if took > INLINE_STALL:
                self._inline_resume_at = ended + INLINE_COOLDOWN

    def _commit_group(self, group: list[WriteOp], begun: bool) -> None:
        if self._guard is not None and self._guard.lost is not None:
            if begun:
                self._conn.execute("ROLLBACK")
            self._failed += 1
            for op in group:
                op.error = DatabaseCorrupt(self._location, self._guard.lost)
            return
        self._largest = max(self._largest, len(group))
        todo: Sequence[WriteOp] = group
        fast = True
        while todo:
            opened, begun = begun, False  # only the first transaction was opened by the caller
            try:
                dropped = self._transaction(todo, fast, opened)
            except TRANSACTION_ERRORS as exc:
                self._fail(todo, exc)
                return
            except Exception:
                if not fast:
                    raise
                # A value SQLite refused somewhere in the group: find whose, one write at a time.
                fast = False
                continue
            if dropped is None:
                self._count(todo)
                return
            self._refused += 1
            todo = [op for op in todo if op is not dropped]

    def _fail(self, ops: Sequence[WriteOp], exc: apsw.Error) -> None:
        self._failed += 1
        for op in ops:
            op.error = runtime_error(exc, self._location, op.doing)

    def _count(self, done: Sequence[WriteOp]) -> None:
        self._commits += 1
        for op in done:
            if op.error is not None:
                self._refused += 1
                continue
            self._writes += 1
            if isinstance(op, AppendOp):
                self._appends += 1
                self._events += len(op.rows)
                if self._guard is not None:
                    self._guard.appended(op.workflow_id, op.expected_seq + len(op.rows))


@final
class Readers(_Service):
    """A few read connections, each served by its own thread."""

    def __init__(
        self, conns: Sequence[apsw.Connection], location: str, token: trio.lowlevel.TrioToken
    ) -> None:
        super().__init__(token)
        self._location = location
        for i, conn in enumerate(conns):
            self._start(f"aion_trio sqlite reader {i} ({location})", functools.partial(self._run, conn))

    async def submit(self, request: ReadOp[T]) -> T:
        """Queue ``request`` and wait for its result."""
        await self._submit(request)
        return request.value  # type: ignore[return-value]

    def _run(self, conn: apsw.Connection) -> None:
        try:
            while True:
                with self._lock:
                    while not self._pending and not self._stopping:
                        self._wake.wait()
                    if not self._pending:
                        return
                    request: ReadOp[Any] = self._pending.popitem(last=False)[0]
                try:
                    request.value = request.function(conn)
                except apsw.Error as exc:
                    request.error = runtime_error(exc, self._location, "reading")
                except Exception as exc:
                    request.error = exc
                self._call_soon(self._deliver, (request,))
        finally:
            conn.close()
