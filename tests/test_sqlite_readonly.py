"""The SQLite store's ``?mode=ro``: read an existing aion_trio database, create and write nothing.

The ``aion-trio`` CLI's read-only commands (list, show, history) open stores this way,
so pointing them at a mistyped path must not leave a new, empty database behind.
"""

from __future__ import annotations

import os
from datetime import datetime, timedelta, timezone
from pathlib import Path

import apsw
import pytest

from aion_trio import (
    Event,
    InvalidStoreUrl,
    MarkerRecorded,
    NotAnAionDatabase,
    Payload,
    StorePathError,
    VisibilityRow,
    WorkflowStatus,
)
from aion_trio_sqlite import open_sqlite_store, parse_sqlite_url

T0 = datetime(2041, 5, 6, 7, 8, 9, tzinfo=timezone.utc)


def _markers(workflow_id: str, first_seq: int, count: int) -> list[Event]:
    return [
        Event(
            workflow_id=workflow_id,
            seq=first_seq + i,
            recorded_at=T0 + timedelta(seconds=first_seq + i),
            body=MarkerRecorded(name=f"m-{first_seq + i}", value=Payload.of(first_seq + i)),
        )
        for i in range(count)
    ]


def _files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_url_mode_option() -> None:
    assert parse_sqlite_url("sqlite:////x.db").read_only is False
    assert parse_sqlite_url("sqlite:////x.db?mode=ro").read_only is True
    assert parse_sqlite_url("sqlite:////x.db?mode=RO&synchronous=NORMAL").read_only is True
    assert parse_sqlite_url("sqlite:////x.db?mode=rw").read_only is False
    with pytest.raises(InvalidStoreUrl, match="mode='rwc' is not accepted; use mode=ro or mode=rw"):
        parse_sqlite_url("sqlite:////x.db?mode=rwc")
    with pytest.raises(InvalidStoreUrl, match="option 'mode' is given twice"):
        parse_sqlite_url("sqlite:////x.db?mode=ro&mode=rw")


async def test_read_only_open_of_a_missing_file_creates_nothing(tmp_path: Path) -> None:
    with pytest.raises(StorePathError, match=r"no database file here, and a read-only open \(mode=ro\)"):
        async with open_sqlite_store(f"sqlite:///{tmp_path}/missing.db?mode=ro"):
            pass  # pragma: no cover
    assert _files(tmp_path) == []


async def test_read_only_open_refuses_an_empty_or_foreign_file_and_leaves_it_alone(tmp_path: Path) -> None:
    empty = tmp_path / "empty.db"
    empty.write_bytes(b"")
    with pytest.raises(NotAnAionDatabase, match="the file is empty"):
        async with open_sqlite_store(f"sqlite:///{empty}?mode=ro"):
            pass  # pragma: no cover
    assert empty.stat().st_size == 0

    foreign = tmp_path / "foreign.db"
    conn = apsw.Connection(str(foreign))
    conn.execute("CREATE TABLE notes (x)")
    conn.close()
    before = foreign.read_bytes()
    with pytest.raises(NotAnAionDatabase, match="another program"):
        async with open_sqlite_store(f"sqlite:///{foreign}?mode=ro"):
            pass  # pragma: no cover
    assert foreign.read_bytes() == before


async def test_read_only_store_reads_and_refuses_writes(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    row = VisibilityRow(
        workflow_id="wf", run_id="r", workflow_type="t", status=WorkflowStatus.RUNNING, start_time=T0
    )
    async with open_sqlite_store(f"sqlite:///{path}") as store:
        await store.events.append("wf", _markers("wf", 1, 2), 0)
        await store.visibility.upsert(row)
    size = os.path.getsize(path)  # noqa: ASYNC240 - a test's own tmp file

    async with open_sqlite_store(f"sqlite:///{path}?mode=ro") as store:
        assert [e.seq for e in await store.events.read_history("wf")] == [1, 2]
        assert await store.visibility.list() == [row]
        with pytest.raises(StorePathError, match=r"opened read-only \(mode=ro\); nothing was written"):
            await store.events.append("wf", _markers("wf", 3, 1), 2)
        with pytest.raises(StorePathError, match="mode=ro"):
            await store.visibility.upsert(row)
        assert [e.seq for e in await store.events.read_history("wf")] == [1, 2]

    assert os.path.getsize(path) == size  # noqa: ASYNC240 - a test's own tmp file
    async with open_sqlite_store(f"sqlite:///{path}") as store:
        assert [e.seq for e in await store.events.read_history("wf")] == [1, 2]
