"""The SQLite writer's fast paths: inline commits, riders, WAL room (see ``aion_trio_sqlite._threads``).

Every test reads the writer's counters or the files, so each fails if its
mechanism is taken away: an inline commit shows in ``inline_commits``, a
rider riding along shows as one commit for two writes, room as zero bytes
past the WAL's last frame.  The inline and rider tests open their stores with
``synchronous=NORMAL``: with ``FULL`` the writer thread makes WAL room after a
store's first commits, and a write made while it does goes to the thread (as
it should), which would make which commit is inline a matter of timing.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import apsw
import attrs
import pytest
import trio
import trio.testing

from aion_trio import InvalidStoreUrl, MarkerRecorded, Payload, VisibilityRow, WorkflowStatus
from aion_trio._events import make_batch
from aion_trio.events import Event
from aion_trio_sqlite import _threads, _walroom, open_sqlite_store, parse_sqlite_url
from aion_trio_sqlite._store import SqliteStore
from aion_trio_sqlite._threads import Writer

UTC = timezone.utc
T0 = datetime(2041, 5, 6, 7, 8, 9, tzinfo=UTC)


def markers(workflow_id: str, first_seq: int, count: int, *, tag: str = "m") -> list[Event]:
    """``count`` small ``MarkerRecorded`` events (cheap filler with distinguishable values)."""
    bodies = [MarkerRecorded(name=tag, value=Payload.of(f"{tag}-{first_seq + i}")) for i in range(count)]
    return make_batch(workflow_id, first_seq, T0, bodies)


def row(workflow_id: str) -> VisibilityRow:
    return VisibilityRow(
        workflow_id=workflow_id,
        run_id="r1",
        workflow_type="demo",
        status=WorkflowStatus.RUNNING,
        start_time=T0,
    )


@contextlib.asynccontextmanager
async def opened(path: Path, query: str = "?synchronous=NORMAL") -> AsyncIterator[SqliteStore]:
    async with open_sqlite_store(f"sqlite:///{path}{query}") as store:
        yield store


async def writer_idle(writer: Writer) -> None:
    """Until the writer thread has nothing to do (its upkeep included)."""
    with trio.fail_after(10):
        while writer._busy or writer._upkeep_due or writer._pending:  # noqa: ASYNC110
            await trio.sleep(0.001)


def writer_of(store: SqliteStore) -> Writer:
    return store._backend.writer


def committed_elsewhere(path: Path, workflow_id: str) -> int:
    """Events of ``workflow_id`` as another connection sees them (committed, not cached)."""
    conn = apsw.Connection(str(path))
    try:
        return int(
            conn.execute("SELECT count(*) FROM events WHERE workflow_id = ?", (workflow_id,)).fetchall()[0][0]
        )
    finally:
        conn.close()


@attrs.define
class CommitClock:
    """The writer's clock: it moves only by ``cost`` seconds inside every transaction.

    A test that counts inline commits sets it (cost 0): on the real clock, one pause
    of this process during a commit (a garbage collection after a hypothesis-heavy
    test, a CPU taken by other work) makes the commit look stalled and ends inline
    commits for ``_threads.INLINE_COOLDOWN``, so the count would depend on the machine."""

    now: float = 1000.0
    cost: float = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def commit_clock(monkeypatch: pytest.MonkeyPatch) -> CommitClock:
    clock = CommitClock()
    original = Writer._transaction

    def costly(self: Writer, ops: Any, fast: bool, begun: bool = False) -> Any:
        clock.now += clock.cost
        return original(self, ops, fast, begun)

    monkeypatch.setattr(Writer, "_transaction", costly)
    return clock


# --------------------------------------------------------------------------
# Inline commits
# --------------------------------------------------------------------------


async def test_a_lone_append_on_an_idle_loop_commits_on_the_trio_thread(
    tmp_path: Path, commit_clock: CommitClock
) -> None:
    path = tmp_path / "i.db"
    async with opened(path) as store:
        writer = writer_of(store)
        writer._clock = commit_clock  # no commit looks slow, whatever pauses this process
        threads: set[int] = set()
        original = writer._transaction

        def traced(ops: Any, fast: bool, begun: bool = False) -> Any:
            threads.add(threading.get_ident())
            return original(ops, fast, begun)

        writer._transaction = traced  # type: ignore[method-assign]
        for i in range(5):
            await store.events.append("wf", markers("wf", 3 * i + 1, 3), 3 * i)
            assert committed_elsewhere(path, "wf") == 3 * i + 3  # durable when it returned
        stats = store.events.statistics()
        assert (stats.commits, stats.inline_commits, stats.appends) == (5, 5, 5)
        assert threads == {threading.get_ident()}, "every commit ran on this (the Trio) thread"


async def test_the_url_option_keeps_every_commit_on_the_writer_thread(tmp_path: Path) -> None:
    async with opened(tmp_path / "off.db", "?synchronous=NORMAL&inline_commits=off") as store:
        for i in range(5):
            await store.events.append("wf", markers("wf", i + 1, 1), i)
        stats = store.events.statistics()
        assert (stats.commits, stats.inline_commits) == (5, 0)
    async with opened(tmp_path / "on.db", "?synchronous=NORMAL&inline_commits=on") as store:
        await store.events.append("wf", markers("wf", 1, 1), 0)
        assert store.events.statistics().inline_commits == 1


def test_inline_commits_url_values() -> None:
    assert parse_sqlite_url("sqlite:////x.db").inline_commits is True
    assert parse_sqlite_url("sqlite:////x.db?inline_commits=OFF").inline_commits is False
    with pytest.raises(
        InvalidStoreUrl, match="inline_commits='maybe' is not accepted; use inline_commits=on or"
    ):
        parse_sqlite_url("sqlite:////x.db?inline_commits=maybe")
    with pytest.raises(InvalidStoreUrl, match=r"unknown option 'inline'.*inline_commits=off"):
        parse_sqlite_url("sqlite:////x.db?inline=off")


async def test_an_append_while_other_tasks_are_runnable_goes_to_the_writer_thread(
    tmp_path: Path, commit_clock: CommitClock
) -> None:
    async with opened(tmp_path / "busy.db") as store:
        # Commits take no time on this clock: a pause of the process in the first
        # commit (a garbage collection, a busy CPU) must not end inline commits
        # (INLINE_STALL) and fail the control below.
        writer = writer_of(store)
        writer._clock = commit_clock
        threads: list[int] = []
        original = writer._transaction

        def traced(ops: Any, fast: bool, begun: bool = False) -> Any:
            threads.append(threading.get_ident())
            return original(ops, fast, begun)

        writer._transaction = traced  # type: ignore[method-assign]
        ran: list[str] = []

        async def other() -> None:
            ran.append("other")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(other)  # runnable now: the loop has work, so it must not wait for a commit
            await store.events.append("wf", markers("wf", 1, 2), 0)
            # Not ``ran == ["other"]`` here: the writer thread may finish before this task
            # waits, and the append's closing schedule point then runs this task and
            # ``other`` in either order (Trio shuffles each batch).
        assert ran == ["other"]
        assert len(threads) == 1
        assert threads[0] != threading.get_ident(), "the commit ran on the writer thread"
        stats = store.events.statistics()
        assert (stats.commits, stats.inline_commits) == (1, 0)
        # Control: alone, the same kind of append commits inline, on this thread.
        await writer_idle(writer)
        await store.events.append("wf", markers("wf", 3, 1), 2)
        assert store.events.statistics().inline_commits == 1
        assert threads[1:] == [threading.get_ident()]


async def test_another_connection_holding_the_write_lock_never_blocks_the_loop(tmp_path: Path) -> None:
    path = tmp_path / "locked.db"
    async with opened(path) as store:
        await store.events.append("wf", markers("wf", 1, 1), 0)
        inline_before = store.events.statistics().inline_commits
        other = apsw.Connection(str(path))
        other.execute("BEGIN IMMEDIATE")  # another process's write transaction
        done = trio.Event()

        async def append() -> None:
            await store.events.append("wf", markers("wf", 2, 1), 1)
            done.set()

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(append)
                # The inline attempt found the lock taken without waiting for it and
                # handed the write to the thread, which waits (busy_timeout): the loop
                # runs on.  (An inline BEGIN that waited would block this very task.)
                await trio.testing.wait_all_tasks_blocked()
                assert not done.is_set()
                other.execute("ROLLBACK")
                with trio.fail_after(10):
                    await done.wait()
        finally:
            other.close()
        stats = store.events.statistics()
        assert stats.inline_commits == inline_before, "the second append was committed by the thread"
        assert len(await store.events.read_history("wf")) == 2


async def test_a_cancelled_caller_commits_nothing_inline(tmp_path: Path) -> None:
    async with opened(tmp_path / "c.db") as store:
        with trio.CancelScope() as scope:
            scope.cancel()
            await store.events.append("wf", markers("wf", 1, 1), 0)
        assert scope.cancelled_caught
        assert await store.events.read_history("wf") == []
        assert store.events.statistics().commits == 0


async def test_slow_commits_stop_inline_commits_until_they_are_fast_again(
    tmp_path: Path, commit_clock: CommitClock
) -> None:
    async with opened(tmp_path / "slow.db") as store:
        writer = writer_of(store)
        writer._clock = commit_clock
        seq = 0

        async def one() -> bool:
            """Append one event; whether it committed inline."""
            nonlocal seq
            before = store.events.statistics().inline_commits
            await writer_idle(writer)  # a commit the thread made is over, its loop included
            await store.events.append("wf", markers("wf", seq + 1, 1), seq)
            seq += 1
            return store.events.statistics().inline_commits > before

        commit_clock.cost = 0.005  # every commit now takes 5 ms: a slow disk
        inline = [await one() for _ in range(8)]
        # The average (1/8 weight) passes 2 ms after the 4th slow commit: 5 * (1 - (7/8)**4) = 2.07.
        assert inline == [True] * 4 + [False] * 4, inline
        assert writer._commit_average > _threads.INLINE_SLOW
        commit_clock.cost = 0.0  # fast again: the average decays below 2 ms within a few commits
        inline = [await one() for _ in range(12)]
        assert not inline[0], inline  # the first fast commit still finds the average high
        assert inline[-1], inline
        assert writer._commit_average <= _threads.INLINE_SLOW


async def test_one_stalled_commit_stops_inline_commits_for_the_cooldown(
    tmp_path: Path, commit_clock: CommitClock
) -> None:
    async with opened(tmp_path / "stall.db") as store:
        writer_of(store)._clock = commit_clock
        await store.events.append("wf", markers("wf", 1, 1), 0)
        commit_clock.cost = 0.025  # one commit stalls 25 ms (> INLINE_STALL)...
        await store.events.append("wf", markers("wf", 2, 1), 1)
        commit_clock.cost = 0.0
        # (one 25 ms commit moves the average by ~3 ms; let it decay to below 2 ms,
        # committing through the thread meanwhile, so only the cooldown is left)
        writer_of(store)._commit_average = 0.0
        assert store.events.statistics().inline_commits == 2
        await store.events.append("wf", markers("wf", 3, 1), 2)
        assert store.events.statistics().inline_commits == 2, "...so the next one goes to the thread"
        commit_clock.now += _threads.INLINE_COOLDOWN  # the cooldown passes
        await writer_idle(writer_of(store))  # (the thread may still be finishing its loop)
        await store.events.append("wf", markers("wf", 4, 1), 3)
        assert store.events.statistics().inline_commits == 3


# --------------------------------------------------------------------------
# Riders
# --------------------------------------------------------------------------


async def test_a_visibility_row_alone_waits_for_company_then_commits_alone(tmp_path: Path) -> None:
    async with opened(tmp_path / "alone.db") as store:
        began = time.monotonic()
        await store.visibility.upsert(row("wf"))
        assert time.monotonic() - began >= _threads.RIDER_WAIT * 0.99
        assert store.events.statistics().commits == 1
        assert await store.visibility.get("wf") == row("wf")


async def test_a_visibility_row_rides_along_with_the_next_append(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_threads, "RIDER_WAIT", 60.0)  # held until company comes, however slow the machine
    async with opened(tmp_path / "ride.db") as store:
        upserted = trio.Event()

        async def upsert() -> None:
            await store.visibility.upsert(row("wf"))
            upserted.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(upsert)
            await trio.testing.wait_all_tasks_blocked()  # the row is queued, held for company
            assert store.events.statistics().commits == 0
            await store.events.append("wf", markers("wf", 1, 2), 0)  # inline: takes the row along
            with trio.fail_after(5):
                await upserted.wait()
        stats = store.events.statistics()
        assert (stats.commits, stats.writes, stats.inline_commits) == (1, 2, 1), stats
        assert await store.visibility.get("wf") == row("wf")


async def test_a_row_rides_along_with_a_group_on_the_writer_thread_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_threads, "RIDER_WAIT", 60.0)  # held until company comes, however slow the machine
    async with opened(tmp_path / "thread.db", "?synchronous=NORMAL&inline_commits=off") as store:
        writer = writer_of(store)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(store.visibility.upsert, row("wf"))
            await trio.testing.wait_all_tasks_blocked()
            # The writer thread, woken by the row, went back to sleep holding it.
            with trio.fail_after(10):
                while not (writer._sleeping and writer._pending):  # noqa: ASYNC110 - another thread's state
                    await trio.sleep(0.001)
            assert store.events.statistics().commits == 0
            nursery.start_soon(store.events.append, "wf", markers("wf", 1, 1), 0)
        stats = store.events.statistics()
        assert (stats.commits, stats.writes, stats.largest_group) == (1, 2, 2), stats


async def test_closing_the_store_commits_the_rows_still_held(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_threads, "RIDER_WAIT", 60.0)  # held until company comes, however slow the machine
    path = tmp_path / "close.db"
    async with opened(path) as store, trio.open_nursery() as nursery:
        nursery.start_soon(store.visibility.upsert, row("wf"))
        await trio.testing.wait_all_tasks_blocked()
        await store.aclose()  # the upsert returns once the closing writer committed it
    async with opened(path) as store:
        assert await store.visibility.get("wf") == row("wf")


# --------------------------------------------------------------------------
# WAL room
# --------------------------------------------------------------------------


def wal_tail(path: Path) -> tuple[int, bytes]:
    wal = Path(f"{path}-wal")
    data = wal.read_bytes()
    return len(data), data[-_walroom.LOW_WATER // 2 :]


async def test_with_synchronous_full_the_wal_has_zero_filled_room_past_its_frames(tmp_path: Path) -> None:
    path = tmp_path / "room.db"
    async with opened(path, "") as store:
        writer = writer_of(store)
        room = writer._room
        assert room is not None
        await store.events.append("wf", markers("wf", 1, 3), 0)
        await writer_idle(writer)  # the room is made by the writer thread, after the commit
        assert room.extensions == 1
        size, tail = wal_tail(path)
        used = 32 + writer._frames * (4096 + 24)
        assert size >= used + _walroom.LOW_WATER
        assert tail == bytes(len(tail)), "past the last frame: zeros"
        for i in range(200):
            await store.events.append("wf", markers("wf", 4 + i, 1), 3 + i)
            await writer_idle(writer)
            # Every commit landed inside the room: the file is exactly as large as the
            # room made it (a commit past it would have grown the file itself).
            assert wal_tail(path)[0] == room._end, i
        assert room.extensions > 1, "the room moved ahead of the frames"
        assert len(await store.events.read_history("wf")) == 203
    # Reopened (SQLite recovers the WAL, zeros and all): everything is there.
    async with opened(path, "") as store:
        assert len(await store.events.read_history("wf")) == 203


async def test_with_synchronous_normal_there_is_no_room(tmp_path: Path) -> None:
    path = tmp_path / "normal.db"
    async with opened(path) as store:
        await store.events.append("wf", markers("wf", 1, 3), 0)
        assert writer_of(store)._room is None
        assert wal_tail(path)[0] == 32 + writer_of(store)._frames * (4096 + 24)
