"""Zero-filled room beyond the WAL's end (``aion_trio_sqlite._wal``).

With ``synchronous=FULL`` the writer keeps a chunk of synced zeros past the
WAL's end, so commits overwrite bytes the file has instead of growing it.
SQLite must read such a WAL exactly as one without the zeros, including
when it recovers it after a crash.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import apsw
import pytest
import trio

import aion_trio as aion
import aion_trio_sqlite
from aion_trio._events import make_batch
from aion_trio_sqlite import open_sqlite_store

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
CHUNK = 64 * 1024


@asynccontextmanager
async def opened(path: Path, query: str = "", **kwargs: Any) -> AsyncIterator[aion_trio_sqlite.SqliteStore]:
    async with open_sqlite_store(f"sqlite:///{path}{query}", **kwargs) as store:
        yield store


def _batch(workflow_id: str, head: int, n: int = 3) -> list[aion.Event]:
    bodies = [aion.MarkerRecorded(name=f"m{head + i}", value=aion.Payload.of(head + i)) for i in range(n)]
    return make_batch(workflow_id, head + 1, T0, bodies)


async def _append_many(
    store: aion_trio_sqlite.SqliteStore, workflow_id: str, count: int, head: int = 0
) -> int:
    """Append ``count`` batches; returns once the writer thread is also done with the room."""
    for _ in range(count):
        await store.events.append(workflow_id, _batch(workflow_id, head), head)
        head += 3
    # The room is added after the waiters were told; the writer takes writes in
    # order, so a later (empty) write returning means it has finished with it.
    await store.events.remove_timer(workflow_id, "named:absent")
    return head


def _wal(path: Path) -> Path:
    return Path(f"{path}-wal")


def _tail(path: Path, n: int) -> bytes:
    with open(path, "rb") as file:
        file.seek(-n, os.SEEK_END)
        return file.read()


async def test_commits_overwrite_the_room_instead_of_growing_the_wal(tmp_path: Path) -> None:
    path = tmp_path / "room.db"
    async with opened(path, wal_room=CHUNK) as store:
        room = store._backend.writer.wal_room
        assert room is not None
        head = await _append_many(store, "w", 1)
        assert room.extensions == 1
        size = _wal(path).stat().st_size
        assert _tail(_wal(path), CHUNK) == bytes(CHUNK), "the room is zeros"
        head = await _append_many(store, "w", 3, head)
        assert _wal(path).stat().st_size == size, "these commits overwrote the room"
        # Outgrowing the room adds the next chunk (after the commit that outgrew it).
        head = await _append_many(store, "w", 60, head)
        assert room.extensions >= 2
        assert room.failures == 0
        assert len(await store.events.read_history("w")) == head


async def test_a_wal_with_room_is_recovered_as_if_it_had_none(tmp_path: Path) -> None:
    # A copy taken while the store is open is what a crash leaves behind: a WAL
    # with uncheckpointed frames and zeros after them.  SQLite must recover every
    # committed frame and ignore the zeros.
    path = tmp_path / "crash.db"
    copy = tmp_path / "copy.db"
    async with opened(path, wal_room=CHUNK, wal_autocheckpoint=100_000) as store:
        room = store._backend.writer.wal_room
        assert room is not None
        head = await _append_many(store, "w", 20)
        # Copy right after a chunk was added: the file then ends in a whole chunk of zeros.
        extensions = room.extensions
        for _ in range(100):
            head = await _append_many(store, "w", 1, head)
            if room.extensions > extensions:
                break
        assert room.extensions > extensions, "control: a chunk was added"
        shutil.copyfile(path, copy)
        shutil.copyfile(_wal(path), _wal(copy))
    assert _tail(_wal(copy), CHUNK) == bytes(CHUNK), "control: the copied WAL ends in zeros"
    conn = apsw.Connection(str(copy))
    try:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    finally:
        conn.close()
    async with opened(copy) as store:
        history = await store.events.read_history("w")
        assert [e.seq for e in history] == list(range(1, head + 1))
        head = await _append_many(store, "w", 5, head)
        assert len(await store.events.read_history("w")) == head


@pytest.mark.parametrize(
    ("query", "kwargs"),
    [("?synchronous=NORMAL", {}), ("", {"wal_room": 0})],
    ids=["normal-syncs-no-commit", "switched-off"],
)
async def test_no_room_without_full_sync_or_when_switched_off(
    tmp_path: Path, query: str, kwargs: dict[str, Any]
) -> None:
    async with opened(tmp_path / "none.db", query, **kwargs) as store:
        assert store._backend.writer.wal_room is None
        await _append_many(store, "w", 2)


async def test_the_room_is_on_by_default_for_full_sync(tmp_path: Path) -> None:
    async with opened(tmp_path / "default.db") as store:
        room = store._backend.writer.wal_room
        assert room is not None
        await _append_many(store, "w", 1)
        assert room.extensions == 1
        assert _wal(tmp_path / "default.db").stat().st_size >= aion_trio_sqlite.DEFAULT_WAL_ROOM


async def test_a_failed_attempt_is_counted_never_raises_and_is_tried_again_a_chunk_later(
    tmp_path: Path,
) -> None:
    path = tmp_path / "fail.db"
    async with opened(path, wal_room=CHUNK, busy_timeout=0.05) as store:
        room = store._backend.writer.wal_room
        assert room is not None
        head = await _append_many(store, "w", 1)
        assert room.extensions == 1
        other = apsw.Connection(str(path))
        try:
            # Another connection outgrows the room, then holds the write lock.
            other.execute("BEGIN IMMEDIATE")
            other.execute("CREATE TABLE filler(x)")
            other.execute("INSERT INTO filler VALUES (randomblob(?))", (CHUNK * 2,))
            other.execute("COMMIT")
            other.execute("BEGIN IMMEDIATE")
            # The writer thread is idle: call it as it would, off the Trio thread.
            await trio.to_thread.run_sync(room.after_commit)  # busy: counted, not raised
            other.execute("ROLLBACK")
        finally:
            other.close()
        assert room.failures == 1
        assert room.extensions == 1
        head = await _append_many(store, "w", 1, head)
        assert room.extensions == 1, "not tried again before the WAL grows by another chunk"
        head = await _append_many(store, "w", 60, head)
        assert room.extensions >= 2, "tried again once it grew by a chunk, and this time it worked"
        assert room.failures == 1
        assert len(await store.events.read_history("w")) == head


@pytest.mark.parametrize("bad", [-1, 1.5, "1"])
async def test_a_bad_room_is_refused(tmp_path: Path, bad: object) -> None:
    with pytest.raises(ValueError, match="wal_room"):
        async with opened(tmp_path / "bad.db", wal_room=bad):
            pass
