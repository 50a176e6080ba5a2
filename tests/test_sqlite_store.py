"""The SQLite store beyond the conformance kit: the file, its pragmas, bad input,
cancellation, group commit, and search predicates evaluated in SQL.

The kit itself runs against SQLite in ``tests/test_conformance.py``.  Tests here
that need the writer thread held at a known point use ``writer_gate``: it parks
the writer just before its next transaction until the test releases it, so
"queued" versus "taken" is decided by the test, not by thread timing.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import apsw
import attrs
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings, strategies as st

import aion_trio
import aion_trio_sqlite
from aion_trio import (
    AionInternalError,
    BackendUnavailable,
    DatabaseCorrupt,
    DatabaseTooNew,
    Event,
    InvalidBatch,
    InvalidStoreUrl,
    MarkerRecorded,
    NotAnAionDatabase,
    Payload,
    SequenceConflict,
    SerializationError,
    StoreDecodeError,
    StoreEncodeError,
    StorePathError,
    WorkflowCompleted,
    WorkflowStarted,
)
from aion_trio.plugin import (
    EventDecodeError,
    SearchOp,
    SearchPredicate,
    VisibilityFilter,
    VisibilityRow,
    WorkflowStatus,
    build_registry,
    make_plugin_manager,
)
from aion_trio_sqlite import (
    APPLICATION_ID,
    SCHEMA_VERSION,
    _codec,
    _mapping,
    _schema,
    _store,
    _walroom,
    _writes,
    open_sqlite_store,
    parse_sqlite_url,
)
from aion_trio_sqlite._threads import Writer
from aion_trio_sqlite._writes import AppendOp

UTC = timezone.utc
T0 = datetime(2041, 5, 6, 7, 8, 9, 123456, tzinfo=UTC)
RUN = "6f1c2a3e-0000-4000-8000-0000000000aa"


def markers(workflow_id: str, first_seq: int, count: int, tag: str = "m") -> list[Event]:
    return [
        Event(
            workflow_id=workflow_id,
            seq=first_seq + i,
            recorded_at=T0 + timedelta(microseconds=first_seq + i),
            body=MarkerRecorded(name=f"{tag}-{first_seq + i}", value=Payload.of({"i": first_seq + i})),
        )
        for i in range(count)
    ]


def url_of(path: Path | str, query: str = "") -> str:
    return f"sqlite:///{path}{query}"


@contextlib.asynccontextmanager
async def opened(path: Path, **kwargs: Any) -> AsyncIterator[aion_trio_sqlite.SqliteStore]:
    async with open_sqlite_store(url_of(path), **kwargs) as store:
        yield store


def raw(path: Path) -> apsw.Connection:
    """A second connection, as another process would open it (waiting for the write lock)."""
    conn = apsw.Connection(str(path))
    conn.set_busy_timeout(5000)
    return conn


def pragma(conn: apsw.Connection, name: str) -> Any:
    return conn.execute(f"PRAGMA {name}").fetchall()[0][0]


@attrs.define
class WriterGate:
    """Holds the writer thread before its next transaction until ``release`` is set."""

    armed: bool = False
    entered: threading.Event = attrs.Factory(threading.Event)
    release: threading.Event = attrs.Factory(threading.Event)

    async def wait_entered(self) -> None:
        assert await trio.to_thread.run_sync(self.entered.wait, 10), "the writer never reached the gate"


@pytest.fixture
def writer_gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[WriterGate]:
    gate = WriterGate()
    original = Writer._transaction

    def gated(self: Writer, ops: Any, fast: bool, begun: bool = False) -> Any:
        if gate.armed:
            gate.armed = False
            gate.entered.set()
            gate.release.wait(10)
        return original(self, ops, fast, begun)

    monkeypatch.setattr(Writer, "_transaction", gated)
    # Held in the writer thread only: no commit on the Trio thread, which the gate would block.
    monkeypatch.setattr(Writer, "_may_inline", lambda self: False)
    yield gate
    gate.release.set()


# --------------------------------------------------------------------------
# URLs and registration
# --------------------------------------------------------------------------


def test_url_absolute_path_after_the_third_slash() -> None:
    parsed = parse_sqlite_url("sqlite:////var/lib/aion/store.db")
    assert (parsed.path, parsed.synchronous) == ("/var/lib/aion/store.db", "FULL")


def test_url_relative_path_is_resolved_against_the_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert parse_sqlite_url("sqlite:///data/x.db").path == str(tmp_path / "data" / "x.db")
    assert parse_sqlite_url("sqlite:///a%3Fb.db").path == str(tmp_path / "a?b.db")


def test_url_synchronous_normal_is_an_explicit_opt_in() -> None:
    assert parse_sqlite_url("sqlite:////x.db?synchronous=NORMAL").synchronous == "NORMAL"
    assert parse_sqlite_url("sqlite:////x.db?synchronous=normal").synchronous == "NORMAL"
    assert parse_sqlite_url("sqlite:////x.db?synchronous=FULL").synchronous == "FULL"


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("sqlite:////x.db?cache=shared", r"unknown option 'cache'; accepted options: synchronous=FULL"),
        ("sqlite:////x.db?synchronous=OFF", r"synchronous='OFF' is not accepted; use synchronous=FULL"),
        ("sqlite:////x.db?synchronous=NORMAL&synchronous=FULL", "given twice"),
        ("sqlite:////x.db?synchronous", "malformed query string"),
        ("sqlite://host/x.db", "names no host; write three slashes"),
        ("sqlite:///", "names no database file"),
        ("sqlite:////tmp/", "names no database file"),
        ("sqlite:////x.db#frag", "no #fragment"),
        ("memory://x", "is not a sqlite:// URL"),
    ],
)
def test_url_refusals_say_what_is_accepted(url: str, match: str) -> None:
    with pytest.raises(InvalidStoreUrl, match=match):
        parse_sqlite_url(url)


async def test_unknown_option_is_refused_by_the_opener_before_any_file_exists(tmp_path: Path) -> None:
    with pytest.raises(InvalidStoreUrl, match="accepted options"):
        async with open_sqlite_store(url_of(tmp_path / "x.db", "?journal_mode=DELETE")):
            pass  # pragma: no cover
    assert not any(tmp_path.iterdir())  # noqa: ASYNC240 - a test's own tmp dir


def test_plugin_registers_the_scheme_without_io(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    registry = build_registry(make_plugin_manager(load_entry_points=False, plugins=[aion_trio_sqlite]))
    entry = registry.get("sqlite")
    assert entry.opener is open_sqlite_store
    assert "synchronous=NORMAL" in entry.description
    assert list(tmp_path.iterdir()) == []


async def test_open_store_finds_the_plugin_through_its_entry_point(tmp_path: Path) -> None:
    async with aion_trio.open_store(url_of(tmp_path / "ep.db")) as store:
        assert isinstance(store, aion_trio_sqlite.SqliteStore)
        await store.events.append("wf", markers("wf", 1, 2), 0)
    assert (tmp_path / "ep.db").exists()


# --------------------------------------------------------------------------
# The file: pragmas, stamp, migrations, persistence
# --------------------------------------------------------------------------


async def test_default_pragmas_wal_full_busy_timeout_and_the_stamp(tmp_path: Path) -> None:
    path = tmp_path / "p.db"
    async with opened(path, busy_timeout=1.5) as store:
        writer = store._backend.writer._conn
        assert pragma(writer, "journal_mode") == "wal"
        assert pragma(writer, "synchronous") == 2  # FULL
        assert pragma(writer, "busy_timeout") == 1500
        # The writer thread checkpoints (its WAL hook replaces SQLite's auto-checkpoint).
        assert pragma(writer, "wal_autocheckpoint") == 0
        assert store._backend.writer._checkpoint_pages == aion_trio_sqlite.DEFAULT_WAL_AUTOCHECKPOINT == 4000
        readers = await store._backend.readers.submit(
            _store.ReadOp(
                lambda c: (pragma(c, "synchronous"), pragma(c, "busy_timeout"), pragma(c, "query_only"))
            )
        )
        assert readers == (2, 1500, 1)
    conn = raw(path)
    assert pragma(conn, "application_id") == APPLICATION_ID == 0x41494F4E
    assert pragma(conn, "user_version") == SCHEMA_VERSION
    assert pragma(conn, "journal_mode") == "wal"  # persistent in the file


async def test_synchronous_normal_only_when_the_url_asks(tmp_path: Path) -> None:
    async with open_sqlite_store(url_of(tmp_path / "n.db", "?synchronous=NORMAL")) as store:
        assert pragma(store._backend.writer._conn, "synchronous") == 1  # NORMAL
    async with opened(tmp_path / "n.db") as store:
        assert pragma(store._backend.writer._conn, "synchronous") == 2  # back to FULL


def wal_frames(path: Path) -> int:
    """Frames the WAL file of ``path`` has room for (its size: SQLite reuses it, never shrinks it)."""
    wal = Path(f"{path}-wal")
    if not wal.exists():
        return 0
    return max(0, (wal.stat().st_size - 32) // (4096 + 24))


async def test_the_writer_checkpoints_at_its_threshold_so_the_wal_stays_bounded(tmp_path: Path) -> None:
    path = tmp_path / "w.db"
    largest = 0
    largest_file = 0
    async with opened(path, wal_autocheckpoint=16) as store:
        writer = store._backend.writer
        assert writer._checkpoint_pages == 16
        for i in range(150):
            await store.events.append("wf", markers("wf", 3 * i + 1, 3), 3 * i)
            largest = max(largest, writer._frames)  # what the WAL hook saw after the commit
            largest_file = max(largest_file, wal_frames(path))
        # 150 commits wrote far more than 16 + one commit's frames: the WAL was reused.
        assert store.events.statistics().commits == 150
        assert store.events.statistics().checkpoints >= 5  # the thread checkpointed, again and again
        assert len(await store.events.read_history("wf")) == 450
    # A commit reaching 16 frames has the writer thread checkpoint, after the
    # writes it finds queued then (they do not wait for the checkpoint); the
    # commit after that starts the WAL over.  One append dirties at most a few
    # pages (a leaf split touches its parent): two commits' worth past 16.
    assert 16 <= largest <= 16 + 2 * 8, largest
    # The file: those frames and the zero-filled room past them (synchronous=FULL), no more.
    room = (_walroom.FIRST + _walroom.LOW_WATER) // (4096 + 24) + 1
    assert largest_file <= 16 + 2 * 8 + room, largest_file


@pytest.mark.parametrize("bad", [0, -1, True, 2.5, "100"])
async def test_wal_autocheckpoint_must_be_a_positive_whole_number(tmp_path: Path, bad: Any) -> None:
    with pytest.raises(ValueError, match="wal_autocheckpoint must be a whole number of pages >= 1"):
        async with opened(tmp_path / "x.db", wal_autocheckpoint=bad):
            pass  # pragma: no cover - never opened
    assert not (tmp_path / "x.db").exists()


@pytest.mark.slow
def test_sigkill_with_a_long_unchecked_wal_loses_no_acknowledged_batch(tmp_path: Path) -> None:
    from procs.wal_writer import BATCH, marker  # tests/ is on sys.path, as for _samples

    path = tmp_path / "k.db"
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.procs.wal_writer", str(path)],
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    acked: dict[str, int] = {}
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 60
        # Kill once the WAL holds more frames than SQLite's own threshold (1000)
        # would ever let it: the crash leaves that much to recover from the WAL.
        while wal_frames(path) <= 1200:
            line = proc.stdout.readline()
            assert line.startswith("ACK "), (
                f"writer stopped: {line!r} {proc.stderr.read() if proc.stderr else ''}"
            )
            _, wid, head = line.split()
            acked[wid] = int(head)
            assert time.monotonic() < deadline, f"the WAL never passed 1200 frames ({wal_frames(path)})"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
    assert proc.returncode == -signal.SIGKILL
    assert wal_frames(path) > 1200, "the kill must leave the long WAL behind"
    # With synchronous=FULL the writer keeps zero-filled room past the last frame
    # (aion_trio_sqlite._walroom): recovery must read through it and stop there.
    with open(f"{path}-wal", "rb") as wal:
        wal.seek(-16384, os.SEEK_END)
        assert wal.read() == bytes(16384), "the killed writer left room past its frames"

    async def check() -> None:
        async with opened(path) as store:
            for wid, head in acked.items():
                history = await store.events.read_history(wid)
                # Every acknowledged batch is there, and only whole batches.
                assert len(history) >= head, (wid, head, len(history))
                assert len(history) % BATCH == 0, (wid, len(history))
                assert history == [marker(wid, seq) for seq in range(1, len(history) + 1)], wid
            assert sorted(await store.events.list_workflow_ids()) == sorted(acked)

    trio.run(check)


async def test_data_survives_close_and_reopen(tmp_path: Path) -> None:
    path = tmp_path / "d.db"
    async with opened(path) as store:
        await store.events.append("wf", markers("wf", 1, 3), 0)
        await store.events.schedule_timer("wf", "named:t", T0)
    async with opened(path) as store:
        assert await store.events.read_history("wf") == markers("wf", 1, 3)
        assert [t.timer_id for t in await store.events.expired_timers(T0)] == ["named:t"]
        await store.events.append("wf", markers("wf", 4, 1), 3)
    assert pragma(raw(path), "user_version") == SCHEMA_VERSION


async def test_an_empty_file_is_a_new_database(tmp_path: Path) -> None:
    path = tmp_path / "empty.db"
    path.write_bytes(b"")
    async with opened(path) as store:
        await store.events.append("wf", markers("wf", 1, 1), 0)
    assert pragma(raw(path), "application_id") == APPLICATION_ID


async def test_a_newer_schema_is_database_too_new(tmp_path: Path) -> None:
    path = tmp_path / "new.db"
    async with opened(path):
        pass
    conn = raw(path)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(DatabaseTooNew, match="upgrade aion-trio") as info:
        async with opened(path):
            pass  # pragma: no cover
    assert (info.value.found, info.value.supported, info.value.location) == (
        SCHEMA_VERSION + 1,
        SCHEMA_VERSION,
        str(path),
    )


async def test_a_new_migration_is_applied_to_an_existing_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "m.db"
    async with opened(path) as store:
        await store.events.append("wf", markers("wf", 1, 2), 0)
    later = (*_schema.MIGRATIONS, ("CREATE TABLE later_feature (x INTEGER)",))
    monkeypatch.setattr(_schema, "MIGRATIONS", later)
    monkeypatch.setattr(_schema, "SCHEMA_VERSION", len(later))
    monkeypatch.setattr(
        _schema, "_SET_USER_VERSION", tuple(f"PRAGMA user_version = {v}" for v in range(len(later) + 1))
    )
    async with opened(path) as store:
        assert await store.events.read_history("wf") == markers("wf", 1, 2)
    conn = raw(path)
    assert pragma(conn, "user_version") == len(later)
    assert conn.execute("SELECT count(*) FROM later_feature").fetchall() == [(0,)]


async def test_a_schema_7_file_gains_the_flow_waiter_records_and_keeps_its_permits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Migration 8 (flow waiter records) on a file written by the schema-7 code."""
    path = tmp_path / "seven.db"
    with monkeypatch.context() as old:
        old.setattr(_schema, "MIGRATIONS", _schema.MIGRATIONS[:7])
        old.setattr(_schema, "SCHEMA_VERSION", 7)
        old.setattr(_schema, "TABLES", tuple(t for t in _schema.TABLES if t != "flow_waiters"))
        old.setattr(_schema, "_PROBES", tuple(p for p in _schema._PROBES if "flow_waiters" not in p))
        async with opened(path) as store:
            grant = await store.acquire_flow_permit(
                "k", holder="h", concurrency=1, rate=None, period=1.0, ttl=60.0, now=T0
            )
            assert grant.granted
        assert pragma(raw(path), "user_version") == 7
    async with opened(path) as store:
        assert await store.held_flow_permits("k", now=T0) == 1
        waiter = aion_trio.FlowWaiter(
            workflow_id="wf",
            run_id="r",
            activity_id=0,
            attempt=1,
            pool="activity:a",
            limit="concurrency=1",
            since=T0,
            holder="h",
        )
        await store.record_flow_waiter(waiter, ttl=60.0, now=T0)
        assert await store.flow_waiters("wf", now=T0) == [
            attrs.evolve(waiter, expires_at=T0 + timedelta(seconds=60))
        ]
    assert pragma(raw(path), "user_version") == SCHEMA_VERSION == 8


async def test_a_failing_migration_leaves_the_file_untouched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each migration is one transaction: its first statement is rolled back too.
    broken = (("CREATE TABLE first_step (x INTEGER)", "CREATE TABLE broken ("),)
    monkeypatch.setattr(_schema, "MIGRATIONS", broken)
    path = tmp_path / "b.db"
    with pytest.raises(AionInternalError, match="unexpected SQLite error while opening") as info:
        async with opened(path):
            pass  # pragma: no cover
    assert isinstance(info.value.__cause__, apsw.SQLError)
    conn = raw(path)
    assert (pragma(conn, "user_version"), pragma(conn, "application_id")) == (0, 0)
    assert conn.execute("SELECT name FROM sqlite_schema").fetchall() == []


async def test_datetimes_are_integer_microseconds_and_come_back_aware_utc(tmp_path: Path) -> None:
    path = tmp_path / "t.db"
    plus2 = timezone(timedelta(hours=2))
    old = datetime(1901, 12, 13, 20, 45, 52, 1, tzinfo=plus2)  # before the epoch: negative
    event = Event(
        workflow_id="wf", seq=1, recorded_at=old, body=MarkerRecorded(name="m", value=Payload.of(1))
    )
    async with opened(path) as store:
        await store.events.append("wf", [event], 0)
        await store.events.schedule_timer("wf", "named:a", T0.astimezone(plus2))
        await store.events.schedule_timer("wf", "named:b", T0 - timedelta(microseconds=1))
        (back,) = await store.events.read_history("wf")
        timers = await store.events.expired_timers(T0.astimezone(timezone(timedelta(hours=-7))))
    assert back == event
    assert back.recorded_at.tzinfo is UTC
    assert [(t.timer_id, t.fire_at) for t in timers] == [
        ("named:b", T0 - timedelta(microseconds=1)),
        ("named:a", T0),
    ]
    assert all(t.fire_at.tzinfo is UTC for t in timers)
    stored = raw(path).execute("SELECT typeof(recorded_at), recorded_at FROM events").fetchall()
    assert stored == [("integer", _codec.to_us(old))]
    assert stored[0][1] < 0


async def test_naive_datetimes_are_refused_at_the_checkpoint(tmp_path: Path) -> None:
    async with opened(tmp_path / "n.db") as store:
        with trio.testing.assert_checkpoints(), pytest.raises(ValueError, match="timezone-aware"):
            await store.events.schedule_timer("wf", "named:x", datetime(2041, 1, 1))
        with trio.testing.assert_checkpoints(), pytest.raises(ValueError, match="timezone-aware"):
            await store.events.expired_timers(datetime(2041, 1, 1))


async def test_list_active_is_an_index_range_kept_by_each_append(tmp_path: Path) -> None:
    path = tmp_path / "a.db"
    started = WorkflowStarted(workflow_type="t", input=Payload.of(None), run_id=RUN)
    async with opened(path) as store:
        for wid in ("b", "a", "c"):
            await store.events.append(wid, [Event(workflow_id=wid, seq=1, recorded_at=T0, body=started)], 0)
        await store.events.append("x", markers("x", 1, 1), 0)  # no lifecycle event: not active
        done = Event(workflow_id="b", seq=2, recorded_at=T0, body=WorkflowCompleted(result=Payload.of(1)))
        await store.events.append("b", [done], 1)
        await store.events.append("a", markers("a", 2, 2), 1)  # no status change: row untouched
        assert await store.events.list_active() == ["a", "c"]
        assert await store.events.list_workflow_ids() == ["a", "b", "c", "x"]
    conn = raw(path)
    assert conn.execute("SELECT workflow_id, status FROM workflows ORDER BY 1").fetchall() == [
        ("a", "running"),
        ("b", "completed"),
        ("c", "running"),
        ("x", None),
    ]
    plan = " ".join(
        r[3] for r in conn.execute("EXPLAIN QUERY PLAN " + _store._SQL_LIST_ACTIVE, _store._ACTIVE)
    )
    assert "workflows_by_status" in plan


async def test_two_stores_on_one_file_see_each_others_heads(tmp_path: Path) -> None:
    # The head is checked inside the write transaction, so a second writer
    # (another connection, another process) is caught, never silently merged.
    path = tmp_path / "two.db"
    async with opened(path) as one, opened(path) as two:
        await one.events.append("wf", markers("wf", 1, 2), 0)
        with pytest.raises(SequenceConflict) as info:
            await two.events.append("wf", markers("wf", 1, 1, tag="other"), 0)
        assert (info.value.expected, info.value.found) == (0, 2)
        assert await two.events.read_history("wf") == markers("wf", 1, 2)


async def test_closing_ends_every_thread_and_later_calls_are_closed_errors(tmp_path: Path) -> None:
    path = tmp_path / "c.db"

    def threads() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name.endswith(f"({path})")]

    async with opened(path, readers=3) as store:
        assert sorted(threads()) == [
            f"aion_trio sqlite {role} ({path})" for role in ("reader 0", "reader 1", "reader 2", "writer")
        ]
        await store.aclose()
        assert threads() == []
        await store.aclose()  # idempotent
        for call in (store.events.list_workflow_ids(), store.visibility.count()):
            with trio.testing.assert_checkpoints(), pytest.raises(trio.ClosedResourceError):
                await call
    assert threads() == []


# --------------------------------------------------------------------------
# Bad input: each a typed error with an actionable message
# --------------------------------------------------------------------------


async def test_a_text_file_is_not_an_aion_database(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("shopping list\n" * 500)
    with pytest.raises(NotAnAionDatabase, match=r"not a SQLite database.*new file name") as info:
        async with opened(path):
            pass  # pragma: no cover
    assert info.value.location == str(path)
    assert isinstance(info.value.__cause__, apsw.NotADBError)
    assert path.read_text() == "shopping list\n" * 500


async def test_another_programs_database_is_refused_untouched(tmp_path: Path) -> None:
    path = tmp_path / "crm.db"
    conn = raw(path)
    conn.execute("CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT)")
    conn.execute("INSERT INTO customers (name) VALUES ('ada')")
    conn.close()
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    with pytest.raises(NotAnAionDatabase, match=r"another program \(tables: customers"):
        async with opened(path):
            pass  # pragma: no cover
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["crm.db"]  # noqa: ASYNC240 - not switched to WAL


async def test_a_foreign_application_id_is_named(tmp_path: Path) -> None:
    path = tmp_path / "other.db"
    conn = raw(path)
    conn.execute("PRAGMA application_id = 1234")
    conn.close()
    with pytest.raises(NotAnAionDatabase, match=r"application_id is 0x000004d2, not aion_trio's 0x41494f4e"):
        async with opened(path):
            pass  # pragma: no cover


@pytest.mark.parametrize("keep", [100, 4096], ids=["header-only", "first-page"])
async def test_garbage_after_a_valid_header_is_database_corrupt(tmp_path: Path, keep: int) -> None:
    path = tmp_path / "c.db"
    async with opened(path) as store:
        for w in range(12):
            await store.events.append(f"wf-{w}", markers(f"wf-{w}", 1, 40), 0)
    # Every page in the database file itself: a close checkpoints the WAL only when no other
    # connection is still closing, which a loaded machine does not promise.
    conn = raw(path)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    size = path.stat().st_size
    assert size > 4 * 4096
    with path.open("r+b") as f:
        f.seek(keep)
        f.write(bytes((i * 7 + 13) % 256 for i in range(size - keep)))
    with pytest.raises(DatabaseCorrupt, match=r"damaged.*restore it from a backup") as info:
        async with opened(path):
            pass  # pragma: no cover
    assert info.value.location == str(path)
    assert isinstance(info.value.__cause__, apsw.CorruptError)


@pytest.mark.parametrize(
    ("column", "value", "detail"),
    [
        ("data", "{not json", "not valid JSON"),
        ("type", "NoSuchEvent", "unknown event type 'NoSuchEvent'"),
        ("data", '{"name":"m","value":1,"extra":2}', "unknown field"),
        ("data", '{"value":1}', "missing field 'name'"),
        ("recorded_at", "yesterday", "recorded_at is 'yesterday'"),
        # Corrupt payloads fail the read, as before payloads were carried as text:
        ("data", '{"name":"m-2","value":{"i":NaN}}', "NaN is not valid JSON"),
        ("data", '{"name":"m-2","value":{"i":1e400}}', "out of range"),
        ("data", '{"name":"m-2","value":{"i":2}', "not valid JSON"),
        # seq 1's payload text, then more: its decoded value is not reused for this.
        ("data", '{"name":"m-2","value":{"i":1}}}', "not valid JSON"),
        ("data", '{"name":"m-2","value":{"i":1},"value":{"i":1}', "not valid JSON"),
    ],
)
async def test_a_corrupt_event_row_names_file_workflow_and_seq(
    tmp_path: Path, column: str, value: str, detail: str
) -> None:
    path = tmp_path / "rows.db"
    async with opened(path) as store:
        await store.events.append("good", markers("good", 1, 3), 0)
        await store.events.append("bad", markers("bad", 1, 3), 0)
        conn = raw(path)
        statements = {
            "data": "UPDATE events SET data = ? WHERE workflow_id = 'bad' AND seq = 2",
            "type": "UPDATE events SET type = ? WHERE workflow_id = 'bad' AND seq = 2",
            "recorded_at": "UPDATE events SET recorded_at = ? WHERE workflow_id = 'bad' AND seq = 2",
        }
        conn.execute(statements[column], (value,))
        conn.close()
        with pytest.raises(StoreDecodeError, match=detail) as info:
            await store.events.read_history("bad")
        error = info.value
        assert isinstance(error, SerializationError)  # the common base still catches it
        assert (error.workflow_id, error.seq, error.location) == ("bad", 2, str(path))
        assert f"workflow 'bad' seq 2 in {path}" in str(error)
        assert isinstance(error.__cause__, EventDecodeError | TypeError | ValueError)
        # The damage is local: other workflows, and the rest of this one, still read.
        assert await store.events.read_history("good") == markers("good", 1, 3)
        assert await store.events.read_history("bad", 3) == markers("bad", 3, 1)
        assert await store.events.list_workflow_ids() == ["bad", "good"]


async def test_a_missing_directory_says_to_create_it(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such"
    with pytest.raises(StorePathError, match=f"directory {missing} does not exist; create it") as info:
        async with opened(missing / "x.db"):
            pass  # pragma: no cover
    assert info.value.location == str(missing / "x.db")
    assert not (tmp_path / "no").exists()


async def test_a_directory_is_not_a_database_file(tmp_path: Path) -> None:
    with pytest.raises(StorePathError, match="is a directory, not a database file"):
        async with opened(tmp_path):
            pass  # pragma: no cover


@contextlib.contextmanager
def unprivileged() -> Iterator[None]:
    """Act as user "nobody" for file access when running as root (root ignores permissions).

    Only the effective ids change (the saved uid stays 0), so root is restored on
    exit; glibc applies the change to every thread, the store's threads included.
    """
    if os.geteuid() != 0:
        yield
        return
    groups = os.getgroups()
    os.setgroups([])
    os.setegid(65534)
    os.seteuid(65534)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)
        os.setgroups(groups)


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory "nobody" can reach (pytest's tmp_path is private to its owner)."""
    base = Path(tempfile.mkdtemp(prefix="aion-perm-"))
    base.chmod(0o755)
    yield base
    for root, dirs, _files in os.walk(base):
        for d in dirs:
            os.chmod(os.path.join(root, d), 0o755)
    shutil.rmtree(base)


async def attempt_open(path: Path) -> BaseException | int:
    try:
        async with opened(path) as store:
            return len(await store.events.read_history("wf"))
    except Exception as exc:
        return exc


async def test_read_only_directory_and_file_are_store_path_errors(shared_dir: Path) -> None:
    # The refusals come from the kernel's permission checks, as for a service
    # user; the writable control proves the harness itself can open stores.
    for name in ("ro_dir", "ro_dir_with_db", "rw_dir"):
        (shared_dir / name).mkdir()
    async with opened(shared_dir / "rw_dir" / "ro_file.db") as store:
        await store.events.append("wf", markers("wf", 1, 1), 0)
    async with opened(shared_dir / "ro_dir_with_db" / "shared.db") as store:
        await store.events.append("wf", markers("wf", 1, 1), 0)
    (shared_dir / "ro_dir_with_db" / "shared.db").chmod(0o666)
    (shared_dir / "rw_dir" / "ro_file.db").chmod(0o444)
    (shared_dir / "rw_dir").chmod(0o777)
    (shared_dir / "ro_dir").chmod(0o555)
    (shared_dir / "ro_dir_with_db").chmod(0o555)
    with unprivileged():
        control = await attempt_open(shared_dir / "rw_dir" / "fresh.db")
        ro_dir = await attempt_open(shared_dir / "ro_dir" / "new.db")
        ro_file = await attempt_open(shared_dir / "rw_dir" / "ro_file.db")
        ro_dir_with_db = await attempt_open(shared_dir / "ro_dir_with_db" / "shared.db")
    assert control == 0
    assert isinstance(ro_dir, StorePathError), ro_dir
    assert "is not writable by this process" in str(ro_dir)
    assert ro_dir.location == str(shared_dir / "ro_dir" / "new.db")
    assert isinstance(ro_file, StorePathError), ro_file
    assert "the file is not readable and writable by this process" in str(ro_file)
    assert isinstance(ro_dir_with_db, StorePathError), ro_dir_with_db
    assert "-wal and -shm next to the database" in str(ro_dir_with_db)
    assert not (shared_dir / "ro_dir" / "new.db").exists()


@pytest.mark.parametrize(
    ("error", "mapped", "text"),
    [
        (apsw.BusyError("database is locked"), BackendUnavailable, "locked by another connection"),
        (apsw.LockedError("locked"), BackendUnavailable, "locked by another connection"),
        (apsw.IOError("disk I/O error"), BackendUnavailable, "disk I/O error"),
        (apsw.FullError("full"), BackendUnavailable, "disk full"),
        (apsw.CantOpenError("cannot open"), BackendUnavailable, "cannot open"),
        (apsw.CorruptError("malformed"), DatabaseCorrupt, "damaged"),
        (apsw.NotADBError("not a database"), NotAnAionDatabase, "stopped being a SQLite database"),
        (apsw.SQLError("no such table"), AionInternalError, "please report"),
    ],
)
def test_backend_errors_are_mapped_with_the_original_as_cause(
    error: apsw.Error, mapped: type[Exception], text: str
) -> None:
    result = _mapping.runtime_error(error, "/x.db", "reading")
    assert type(result) is mapped
    assert text in str(result)
    assert result.__cause__ is error


def test_open_time_cant_open_is_a_path_error(tmp_path: Path) -> None:
    result = _mapping.open_error(apsw.CantOpenError("unable to open"), str(tmp_path / "x" / "y.db"))
    assert isinstance(result, StorePathError)
    assert "does not exist; create it" in str(result)


# --------------------------------------------------------------------------
# Cancellation: raised Cancelled => nothing written; begun => completes
# --------------------------------------------------------------------------


@attrs.define
class Attempt:
    returned: bool = False
    cancelled: bool = False
    scope: trio.CancelScope = attrs.Factory(trio.CancelScope)


async def attempt_append(store: Any, attempt: Attempt, wid: str, events: list[Event], expected: int) -> None:
    with attempt.scope:
        await store.events.append(wid, events, expected)
        attempt.returned = True
        await trio.lowlevel.checkpoint()  # a deferred cancellation lands here
    attempt.cancelled = attempt.scope.cancelled_caught


async def test_cancelled_while_queued_raises_and_writes_nothing(
    tmp_path: Path, writer_gate: WriterGate
) -> None:
    async with opened(tmp_path / "q.db") as store:
        victim = Attempt()
        async with trio.open_nursery() as nursery:
            writer_gate.armed = True
            nursery.start_soon(store.events.schedule_timer, "held", "named:t", T0)
            await writer_gate.wait_entered()  # the writer is busy with someone else's write
            nursery.start_soon(attempt_append, store, victim, "wf", markers("wf", 1, 3), 0)
            await trio.testing.wait_all_tasks_blocked()
            victim.scope.cancel()
            await trio.testing.wait_all_tasks_blocked()
            # Withdrawn from the queue at once, while the writer is still held.
            assert (victim.returned, victim.cancelled) == (False, True)
            writer_gate.release.set()
        assert await store.events.read_history("wf") == []
        assert store.events.statistics().appends == 0
        await store.events.append("wf", markers("wf", 1, 3), 0)  # still usable, head still 0


async def test_cancelled_after_the_writer_took_it_completes_and_returns(
    tmp_path: Path, writer_gate: WriterGate
) -> None:
    async with opened(tmp_path / "t.db") as store:
        victim = Attempt()
        async with trio.open_nursery() as nursery:
            writer_gate.armed = True
            nursery.start_soon(attempt_append, store, victim, "wf", markers("wf", 1, 3), 0)
            await writer_gate.wait_entered()  # the writer holds this very append
            victim.scope.cancel()
            await trio.testing.wait_all_tasks_blocked()
            assert (victim.returned, victim.cancelled) == (False, False)  # still waiting for its commit
            writer_gate.release.set()
        assert (victim.returned, victim.cancelled) == (True, True)
        assert await store.events.read_history("wf") == markers("wf", 1, 3)


async def test_cancelling_at_every_point_is_all_or_nothing_with_a_known_outcome(tmp_path: Path) -> None:
    outcomes = set()
    async with opened(tmp_path / "sweep.db") as store:
        for n in range(60):
            wid = f"wf-{n}"
            attempt = Attempt()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(attempt_append, store, attempt, wid, markers(wid, 1, 3), 0)
                for _ in range(n):
                    await trio.lowlevel.checkpoint()
                attempt.scope.cancel()
            history = await store.events.read_history(wid)
            if attempt.returned:
                assert history == markers(wid, 1, 3)
            else:
                assert attempt.cancelled
                assert history == []
            outcomes.add(attempt.returned)
            # The store stays usable and the head is exactly what the outcome says.
            await store.events.append(wid, markers(wid, len(history) + 1, 1, tag="after"), len(history))
    assert False in outcomes  # n=0 always cancels before the writer can take it


@attrs.define
class SteppedWriter:
    """Holds the writer thread before every transaction until the test lets it go."""

    entered: threading.Semaphore = attrs.Factory(lambda: threading.Semaphore(0))
    proceed: threading.Semaphore = attrs.Factory(lambda: threading.Semaphore(0))

    async def took_group(self) -> None:
        assert await trio.to_thread.run_sync(self.entered.acquire, True, 10), "the writer never took a group"


@pytest.fixture
def stepped_writer(monkeypatch: pytest.MonkeyPatch) -> Iterator[SteppedWriter]:
    stepped = SteppedWriter()
    original = Writer._transaction

    def held(self: Writer, ops: Any, fast: bool, begun: bool = False) -> Any:
        stepped.entered.release()
        assert stepped.proceed.acquire(timeout=10), "the test never let the writer proceed"
        return original(self, ops, fast, begun)

    monkeypatch.setattr(Writer, "_transaction", held)
    monkeypatch.setattr(Writer, "_may_inline", lambda self: False)  # every commit steps through the thread
    yield stepped
    for _ in range(10):
        stepped.proceed.release()


async def test_the_listener_and_the_others_of_one_group_are_each_woken_once(
    tmp_path: Path, stepped_writer: SteppedWriter
) -> None:
    # While writes come one at a time, one waiting append (the listener) is
    # woken through the writer's socket, the others through run_sync_soon.
    # Build a group that holds both: the listener's own write must not be
    # rescheduled as well (Trio refuses to reschedule a task waiting on a
    # socket), and the others must all be woken.
    done: list[str] = []

    async def append(wid: str) -> None:
        await store.events.append(wid, markers(wid, 1, 2), 0)
        done.append(wid)

    async with opened(tmp_path / "l.db") as store:
        writer = store._backend.writer
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(append, "x")  # the listener; group 1 is {x}
                await stepped_writer.took_group()
                nursery.start_soon(append, "y")  # queued behind x, woken by run_sync_soon
                await trio.testing.wait_all_tasks_blocked()
                stepped_writer.proceed.release()
                await stepped_writer.took_group()  # group 2 is {y}: still one at a time; x has its answer
                await trio.testing.wait_all_tasks_blocked()
                assert done == ["x"]
                nursery.start_soon(append, "z")  # no listener left: z becomes it
                await trio.testing.wait_all_tasks_blocked()
                listener = writer._listener
                assert isinstance(listener, AppendOp)
                assert listener.workflow_id == "z"
                for wid in ("w1", "w2"):
                    nursery.start_soon(append, wid)
                await trio.testing.wait_all_tasks_blocked()
                stepped_writer.proceed.release()
                await stepped_writer.took_group()  # group 3 is {z, w1, w2}
                stepped_writer.proceed.release()
        assert sorted(done) == ["w1", "w2", "x", "y", "z"]
        assert writer._listener is None
        stats = store.events.statistics()
        assert (stats.commits, stats.appends, stats.largest_group) == (3, 5, 3)
        for wid in done:
            assert await store.events.read_history(wid) == markers(wid, 1, 2)


async def test_after_a_group_of_several_writes_no_append_listens_on_the_socket(
    tmp_path: Path, stepped_writer: SteppedWriter
) -> None:
    # A listener's wait lets the writer thread in mid-batch, which would split
    # a group being resubmitted; so once writes come several at a time, every
    # append waits the ordinary way until a group holds one write again.
    async with opened(tmp_path / "s.db") as store:
        writer = store._backend.writer
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(store.events.append, "x", markers("x", 1, 1), 0)
                await stepped_writer.took_group()
                assert writer._listener is not None  # alone: x listens
                for wid in ("y1", "y2"):
                    nursery.start_soon(store.events.append, wid, markers(wid, 1, 1), 0)
                await trio.testing.wait_all_tasks_blocked()
                stepped_writer.proceed.release()
                await stepped_writer.took_group()  # group 2 is {y1, y2}
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(store.events.append, "z", markers("z", 1, 1), 0)
                await trio.testing.wait_all_tasks_blocked()
                assert writer._listener is None  # z waits the ordinary way
                stepped_writer.proceed.release()
                await stepped_writer.took_group()  # group 3 is {z}: one at a time again
                stepped_writer.proceed.release()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(store.events.append, "v", markers("v", 1, 1), 0)
                await trio.testing.wait_all_tasks_blocked()
                assert writer._listener is not None  # v, alone after a one-write group, listens
                stepped_writer.proceed.release()
        assert store.events.statistics().largest_group == 2


@attrs.define
class HeldSend:
    """Stands in for the writer's end of the listener socket; can hold one send."""

    sock: Any
    hold: bool = False
    entered: threading.Event = attrs.Factory(threading.Event)
    release: threading.Event = attrs.Factory(threading.Event)

    def send(self, data: bytes) -> int:
        if self.hold:
            self.hold = False
            self.entered.set()
            self.release.wait(10)
        return int(self.sock.send(data))

    def close(self) -> None:
        self.sock.close()


async def test_a_listener_woken_by_an_earlier_listeners_late_byte_drains_it_and_waits_for_its_own(
    tmp_path: Path, writer_gate: WriterGate
) -> None:
    # A listener does not read its own byte on the way out (that would be a
    # system call between the commit and the caller); the next listener drains
    # it when it hands its write over.  A byte that arrives later than that
    # wakes the new listener before its write is done: it must drain that
    # byte and wait again, and in the end leave exactly its own byte behind.
    async with opened(tmp_path / "late.db") as store:
        writer = store._backend.writer
        held = HeldSend(writer._wake_w)
        writer._wake_w = held
        with trio.fail_after(30):
            first = Attempt()
            async with trio.open_nursery() as nursery:
                held.hold = True
                nursery.start_soon(attempt_append, store, first, "a", markers("a", 1, 1), 0)
                assert await trio.to_thread.run_sync(held.entered.wait, 10)  # committed, byte not sent
                first.scope.cancel()  # taken: it returns on ``done`` without its byte
            assert (first.returned, first.cancelled) == (True, True)
            writer_gate.armed = True  # hold the writer before b's transaction
            async with trio.open_nursery() as nursery:
                nursery.start_soon(store.events.append, "b", markers("b", 1, 1), 0)
                await trio.testing.wait_all_tasks_blocked()
                assert writer._listener is not None  # b listens
                held.release.set()  # a's byte arrives while b's write is still to come
                await writer_gate.wait_entered()
                await trio.testing.wait_all_tasks_blocked()  # b woke, drained it, waits again
                with pytest.raises(BlockingIOError):
                    writer._wake_r.recv(64)
                writer_gate.release.set()
        assert await store.events.read_history("b") == markers("b", 1, 1)
        assert writer._wake_r.recv(64) == b"\0"  # b's own byte, for the next listener to drain
        # The next listener leaves its own byte too.  Held until c listens: a writer
        # thread that commits c before c's drain has run (a loaded machine) sends the
        # byte that drain then takes, which is correct ("done" decides) but leaves none.
        writer_gate.entered.clear()
        writer_gate.release.clear()
        writer_gate.armed = True
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(store.events.append, "c", markers("c", 1, 1), 0)
                await writer_gate.wait_entered()
                await trio.testing.wait_all_tasks_blocked()  # c drained, and waits
                writer_gate.release.set()
        assert writer._wake_r.recv(64) == b"\0"


async def test_a_lone_append_the_writer_finished_before_it_waited_is_still_a_checkpoint(
    tmp_path: Path,
) -> None:
    # The listener drains a leftover byte (a system call) after handing its write
    # over; the writer thread can commit the whole write meanwhile.  Forced here:
    # the drain returns only once the write is done.
    async with opened(tmp_path / "early.db") as store:
        writer = store._backend.writer
        drain = writer._drain

        def drain_after_the_commit() -> None:
            deadline = time.monotonic() + 10
            while not (writer._listener is not None and writer._listener.done):
                assert time.monotonic() < deadline, "the writer never finished"
                time.sleep(0.0005)
            drain()

        writer._drain = drain_after_the_commit
        with trio.testing.assert_checkpoints():
            await store.events.append("a", markers("a", 1, 1), 0)
        assert writer._listener is None
        assert await store.events.read_history("a") == markers("a", 1, 1)
        # Already cancelled: refused before anything is queued.
        with trio.CancelScope() as scope:
            scope.cancel()
            await store.events.append("a", markers("a", 2, 1), 1)
        assert scope.cancelled_caught
        assert await store.events.read_history("a") == markers("a", 1, 1)


# --------------------------------------------------------------------------
# Group commit
# --------------------------------------------------------------------------


async def test_concurrent_appends_share_one_transaction_and_a_conflict_fails_only_its_own(
    tmp_path: Path, writer_gate: WriterGate
) -> None:
    results: dict[str, object] = {}

    async def append(wid: str, events: list[Event], expected: int, key: str) -> None:
        try:
            await store.events.append(wid, events, expected)
            results[key] = "ok"
        except SequenceConflict as exc:
            results[key] = exc

    async with opened(tmp_path / "g.db") as store:
        async with trio.open_nursery() as nursery:
            writer_gate.armed = True
            nursery.start_soon(append, "contested", markers("contested", 1, 3), 0, "first")
            await writer_gate.wait_entered()
            before = store.events.statistics()
            for i in range(50):
                nursery.start_soon(append, f"wf-{i}", markers(f"wf-{i}", 1, 3), 0, f"wf-{i}")
            nursery.start_soon(append, "contested", markers("contested", 1, 2, tag="late"), 0, "late")
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(InvalidBatch):  # refused before it reaches the writer
                await store.events.append("wf-0", markers("wf-0", 2, 1), 0)
            writer_gate.release.set()
        after = store.events.statistics()
        assert after.commits - before.commits == 2  # the held append, then all 51 together
        assert after.largest_group == 51
        assert (after.appends - before.appends, after.refused - before.refused) == (51, 1)
        assert after.events - before.events == 3 * 51
        late = results.pop("late")
        assert isinstance(late, SequenceConflict)
        assert (late.workflow_id, late.expected, late.found) == ("contested", 0, 3)
        assert set(results.values()) == {"ok"}
        assert len(results) == 51
        for i in range(50):
            assert await store.events.read_history(f"wf-{i}") == markers(f"wf-{i}", 1, 3)
        assert await store.events.read_history("contested") == markers("contested", 1, 3)


async def test_a_lone_append_checks_its_head_with_one_seek_and_reads_the_head_only_to_refuse(
    tmp_path: Path,
) -> None:
    # One writer's appends come one per transaction: BEGIN, one two-key head
    # check, the inserts (and the workflow row when the batch creates the
    # workflow or changes its status), COMMIT.  No max(seq) on the way.
    insert = "INSERT INTO events "
    # NORMAL: no WAL room to keep, whose upkeep (BEGIN IMMEDIATE, ROLLBACK) would show in the trace.
    async with open_sqlite_store(url_of(tmp_path / "lone.db", "?synchronous=NORMAL")) as store:
        seen: list[str] = []

        def trace(cursor: apsw.Cursor, sql: str, bindings: Any) -> bool:
            seen.append(sql)
            return True

        store._backend.writer._conn.exec_trace = trace

        def statements() -> list[str]:
            out = [insert if sql.startswith(insert) else sql for sql in seen]
            seen.clear()
            return out

        check = "SELECT count(*) FROM events WHERE workflow_id = ? AND seq BETWEEN ? AND ?"
        upsert = _writes.SQL_UPSERT_WORKFLOW
        await store.events.append("wf", markers("wf", 1, 3), 0)
        assert statements() == ["BEGIN IMMEDIATE", check, insert, insert, insert, upsert, "COMMIT"]
        await store.events.append("wf", markers("wf", 4, 2), 3)
        assert statements() == ["BEGIN IMMEDIATE", check, insert, insert, "COMMIT"]
        for expected, first in ((2, 3), (7, 8), (0, 1)):  # behind, ahead, a second "first" batch
            with pytest.raises(SequenceConflict) as info:
                await store.events.append("wf", markers("wf", first, 2, tag="x"), expected)
            assert (info.value.expected, info.value.found) == (expected, 5)
            assert statements() == ["BEGIN IMMEDIATE", check, _writes.SQL_HEAD, "COMMIT"]
        with pytest.raises(SequenceConflict) as info:
            await store.events.append("new", markers("new", 2, 1), 1)
        assert (info.value.expected, info.value.found) == (1, 0)
        assert await store.events.read_history("wf") == markers("wf", 1, 3) + markers("wf", 4, 2)
        assert await store.events.list_workflow_ids() == ["wf"]


async def test_a_lone_batch_sqlite_refuses_is_an_encode_error_and_writes_nothing(
    tmp_path: Path,
) -> None:
    bad = [
        Event(
            workflow_id="bad", seq=1, recorded_at=T0, body=MarkerRecorded(name="m\ud800", value=Payload.of(1))
        )
    ]
    async with opened(tmp_path / "lone-bad.db") as store:
        with pytest.raises(StoreEncodeError, match="cannot encode workflow 'bad' seq 1") as info:
            await store.events.append("bad", bad, 0)
        assert isinstance(info.value, SerializationError)  # the common base still catches it
        assert isinstance(info.value.__cause__, UnicodeEncodeError)
        assert await store.events.read_history("bad") == []
        assert await store.events.list_workflow_ids() == []
        await store.events.append("bad", markers("bad", 1, 1), 0)  # the head is still 0
        stats = store.events.statistics()
        assert (stats.refused, stats.appends, stats.commits) == (1, 1, 1)


async def test_a_body_the_codec_cannot_encode_is_an_encode_error_and_writes_nothing(tmp_path: Path) -> None:
    body = MarkerRecorded(name="m", value=Payload.of(1))
    object.__setattr__(body, "name", object())  # bypasses the validators, as a bug would
    async with opened(tmp_path / "codec-bad.db") as store:
        caught: list[SerializationError] = []
        try:
            await store.events.append("bad", [Event(workflow_id="bad", seq=1, recorded_at=T0, body=body)], 0)
        except SerializationError as exc:  # the common base still catches it
            caught.append(exc)
        assert [type(exc) for exc in caught] == [StoreEncodeError]
        assert str(caught[0]).startswith("cannot encode workflow 'bad' seq 1: cannot encode the event")
        assert isinstance(caught[0].__cause__, TypeError)
        assert await store.events.read_history("bad") == []


@pytest.mark.parametrize("damaged", ["visibility", "owner", "inbox"])
async def test_a_damaged_control_or_visibility_row_is_a_decode_error(tmp_path: Path, damaged: str) -> None:
    path = tmp_path / "damaged.db"
    async with opened(path) as store:
        await store.visibility.upsert(
            VisibilityRow(
                workflow_id="wf", run_id="r", workflow_type="t", status=WorkflowStatus.RUNNING, start_time=T0
            )
        )
        await store.claim_owner(aion_trio.OwnerIdentity.current(), now=T0, stale_after=timedelta(seconds=30))
        await store.enqueue_command(aion_trio.CancelCommand(workflow_id="wf"))
        conn = raw(path)
        conn.execute(
            {
                "visibility": "UPDATE visibility SET status = 'no-such-status'",
                "owner": "UPDATE owner SET since = 'yesterday'",
                "inbox": "UPDATE inbox SET data = '{not json'",
            }[damaged]
        )
        conn.close()
        read = {
            "visibility": lambda: store.visibility.get("wf"),
            "owner": store.current_owner,
            "inbox": store.pending_commands,
        }[damaged]
        with pytest.raises(StoreDecodeError, match="cannot decode") as info:
            await read()
        assert isinstance(info.value, SerializationError)
        assert info.value.location == store.path


async def test_a_batch_sqlite_refuses_is_isolated_from_its_group(
    tmp_path: Path, writer_gate: WriterGate
) -> None:
    # A lone surrogate cannot be encoded as UTF-8: SQLite refuses that batch alone.
    bad = [
        Event(
            workflow_id="bad", seq=1, recorded_at=T0, body=MarkerRecorded(name="m\ud800", value=Payload.of(1))
        )
    ]
    results: dict[str, BaseException | None] = {}

    async def append(wid: str, events: list[Event]) -> None:
        try:
            await store.events.append(wid, events, 0)
            results[wid] = None
        except SerializationError as exc:
            results[wid] = exc

    async with opened(tmp_path / "iso.db") as store:
        async with trio.open_nursery() as nursery:
            writer_gate.armed = True
            nursery.start_soon(store.events.schedule_timer, "held", "named:t", T0)
            await writer_gate.wait_entered()
            nursery.start_soon(append, "a", markers("a", 1, 2))
            nursery.start_soon(append, "bad", bad)
            nursery.start_soon(append, "b", markers("b", 1, 2))
            await trio.testing.wait_all_tasks_blocked()
            before = store.events.statistics()
            writer_gate.release.set()
        after = store.events.statistics()
        error = results.pop("bad")
        assert isinstance(error, StoreEncodeError)
        assert (error.workflow_id, error.seq, error.location) == ("bad", 1, store.path)
        assert isinstance(error.__cause__, UnicodeEncodeError)
        assert results == {"a": None, "b": None}
        assert after.commits - before.commits == 2  # the held write, then a+b together
        assert await store.events.read_history("a") == markers("a", 1, 2)
        assert await store.events.read_history("bad") == []
        assert await store.events.list_workflow_ids() == ["a", "b"]


async def test_a_failed_transaction_gives_every_writer_in_it_backend_unavailable(
    tmp_path: Path, writer_gate: WriterGate
) -> None:
    path = tmp_path / "busy.db"
    errors: list[BaseException] = []

    async def append(wid: str) -> None:
        try:
            await store.events.append(wid, markers(wid, 1, 2), 0)
        except BackendUnavailable as exc:
            errors.append(exc)

    async def held_write() -> None:
        with pytest.raises(BackendUnavailable):
            await store.events.schedule_timer("held", "named:t", T0)

    async with opened(path, busy_timeout=0.05) as store:
        locker = raw(path)
        async with trio.open_nursery() as nursery:
            writer_gate.armed = True
            nursery.start_soon(held_write)
            await writer_gate.wait_entered()
            for i in range(5):
                nursery.start_soon(append, f"wf-{i}")
            await trio.testing.wait_all_tasks_blocked()
            locker.execute("BEGIN IMMEDIATE")  # another process holds the write lock
            writer_gate.release.set()
        locker.execute("ROLLBACK")
        assert len(errors) == 5
        for exc in errors:
            assert "locked by another connection" in str(exc)
            assert isinstance(exc.__cause__, apsw.BusyError)
        stats = store.events.statistics()
        assert (stats.failed_transactions, stats.largest_group, stats.commits) == (2, 5, 0)
        assert await store.events.list_workflow_ids() == []
        await store.events.append("wf-0", markers("wf-0", 1, 2), 0)  # usable again


async def test_each_method_is_a_checkpoint_on_success_and_on_refusal(tmp_path: Path) -> None:
    row = VisibilityRow(
        workflow_id="wf", run_id=RUN, workflow_type="t", status=WorkflowStatus.RUNNING, start_time=T0
    )
    async with opened(tmp_path / "cp.db") as store:
        events, vis = store.events, store.visibility
        calls = [
            events.append("wf", markers("wf", 1, 1), 0),
            events.read_history("wf"),
            events.list_active(),
            events.list_workflow_ids(),
            events.schedule_timer("wf", "named:t", T0),
            events.expired_timers(T0),
            events.remove_timer("wf", "named:t"),
            vis.upsert(row),
            vis.get("wf"),
            vis.list(),
            vis.count(),
        ]
        for call in calls:
            with trio.testing.assert_checkpoints():
                await call
        with trio.testing.assert_checkpoints(), pytest.raises(SequenceConflict):
            await events.append("wf", markers("wf", 1, 1), 0)
        with trio.testing.assert_checkpoints(), pytest.raises(InvalidBatch):
            await events.append("wf", markers("wf", 3, 1), 1)


# --------------------------------------------------------------------------
# Visibility: search predicates in SQL == the reference semantics
# --------------------------------------------------------------------------

_NUMBERS: list[Any] = [
    0, 1, -1, 2, 0.0, -0.0, 0.5, 1.0, 2.5, -3.25, 1e300,
    2**53, 2**53 + 1, float(2**53), 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64, float(2**64), 10**30,
]  # fmt: skip
_STRINGS = ["", "a", "ab", "b", "B", "é", "\x00", "a\x00b", "🐍", "z🐍"]
_KEYS = st.sampled_from(["k", "n", "s"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_search_in_sql_agrees_with_the_reference_semantics(data: st.DataObject) -> None:
    # Values come from small per-example pools, so rows and predicates collide
    # often (equal numbers of both kinds, shared list elements, substrings).
    strings = data.draw(
        st.lists(
            st.sampled_from(_STRINGS) | st.text(alphabet="ab\x00é🐍", max_size=3), min_size=1, max_size=5
        )
    )
    numbers = data.draw(
        st.lists(
            st.sampled_from(_NUMBERS)
            | st.integers(min_value=-(2**65), max_value=2**65)
            | st.floats(allow_nan=False, allow_infinity=False),
            max_size=4,
        )
    )
    # Always one integer beyond SQLite's 64-bit range (compared by the SQL function).
    numbers.append(data.draw(st.sampled_from([2**63, -(2**63) - 1, 2**64, 10**30])))
    word = st.sampled_from(strings)
    scalar = st.one_of(word, st.sampled_from(numbers), st.booleans())
    value = scalar | st.lists(word, max_size=3).map(tuple)
    attributes = data.draw(st.lists(st.dictionaries(_KEYS, value, max_size=3), min_size=1, max_size=8))
    predicates = []
    for _ in range(data.draw(st.integers(min_value=1, max_value=2))):
        op = data.draw(st.sampled_from(list(SearchOp)))
        if op is SearchOp.CONTAINS:
            wanted: Any = data.draw(word)
        elif op is SearchOp.EQUALS:
            wanted = data.draw(value)
        else:
            wanted = data.draw(word | st.sampled_from(numbers))
        predicates.append(SearchPredicate(key=data.draw(_KEYS), op=op, value=wanted))
    newest_first = data.draw(st.booleans())
    rows = [
        VisibilityRow(
            workflow_id=f"wf-{i}",
            run_id=RUN,
            workflow_type="t",
            status=WorkflowStatus.RUNNING,
            start_time=T0 + timedelta(seconds=i % 3),
            search_attributes=attrs_,
        )
        for i, attrs_ in enumerate(attributes)
    ]
    filters = [VisibilityFilter(search=[p], newest_first=newest_first) for p in predicates]
    filters.append(VisibilityFilter(search=predicates, newest_first=newest_first, offset=1, limit=3))

    async def check(directory: str) -> None:
        async with opened(Path(directory) / "s.db") as store:
            for row in rows:
                await store.visibility.upsert(row)
            for f in filters:
                assert await store.visibility.list(f) == f.apply(rows), f
                assert await store.visibility.count(f) == sum(f.matches(r) for r in rows), f

    with tempfile.TemporaryDirectory() as directory:
        trio.run(check, directory)


async def test_search_predicates_use_the_side_table_indexes(tmp_path: Path) -> None:
    path = tmp_path / "plan.db"
    async with opened(path):
        pass
    conn = raw(path)
    for predicate, index in [
        (SearchPredicate(key="n", op=SearchOp.GREATER, value=3), "search_attrs_by_num"),
        (SearchPredicate(key="s", op=SearchOp.EQUALS, value="x"), "search_attrs_by_txt"),
    ]:
        sql, params = _codec.count_query(VisibilityFilter(search=[predicate]))
        conn.create_scalar_function("aion_search_match", _codec.search_match, 5)
        plan = " ".join(r[3] for r in conn.execute("EXPLAIN QUERY PLAN " + sql, params))
        assert index in plan, plan


async def test_upsert_replaces_the_row_and_its_search_attributes(tmp_path: Path) -> None:
    path = tmp_path / "v.db"
    first = VisibilityRow(
        workflow_id="wf",
        run_id=RUN,
        workflow_type="t",
        status=WorkflowStatus.RUNNING,
        start_time=T0,
        search_attributes={"tags": ("a", "b"), "n": 2**63},
    )
    second = attrs.evolve(
        first,
        status=WorkflowStatus.COMPLETED,
        close_time=T0 + timedelta(seconds=1),
        search_attributes={"n": 1},
    )
    contains_a = VisibilityFilter(search=[SearchPredicate(key="tags", op=SearchOp.CONTAINS, value="a")])
    async with opened(path) as store:
        await store.visibility.upsert(first)
        assert await store.visibility.get("wf") == first
        assert await store.visibility.count(contains_a) == 1
        await store.visibility.upsert(second)
        assert await store.visibility.get("wf") == second
        assert await store.visibility.count(contains_a) == 0
        assert await store.visibility.get("nope") is None
    assert raw(path).execute("SELECT key, part, kind, num FROM search_attrs").fetchall() == [
        ("n", 0, "int", 1)
    ]
