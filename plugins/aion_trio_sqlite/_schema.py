"""The database file: identity stamp, numbered migrations, connection setup.

Runs in worker threads only (every function here blocks).  Nothing is
written to a file until it is known to be empty or an aion_trio database, so
pointing the URL at another program's database leaves it untouched.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import apsw

from aion_trio.plugin import DatabaseCorrupt, DatabaseTooNew, NotAnAionDatabase, StorePathError

from ._mapping import describe_path_problem, open_error
from ._walguard import check_mark, forget_mark

APPLICATION_ID = 0x41494F4E
"""``PRAGMA application_id`` of every aion_trio SQLite database (ASCII ``AION``)."""

# PRAGMA arguments cannot be bound; both texts are built once from code constants.
_STAMP_APPLICATION_ID = f"PRAGMA application_id = {APPLICATION_ID:d}"

MIGRATIONS: tuple[tuple[str, ...], ...] = (
    # 1: the initial schema.  Datetimes are integer microseconds since the Unix
    # epoch (UTC), so they sort and compare correctly in SQL.
    (
        "CREATE TABLE events ("
        " workflow_id TEXT NOT NULL, seq INTEGER NOT NULL, recorded_at INTEGER NOT NULL,"
        " type TEXT NOT NULL, data TEXT NOT NULL, PRIMARY KEY (workflow_id, seq)) WITHOUT ROWID",
        # One row per workflow with at least one event, written in the same
        # transaction as the append that creates it or changes its status
        # (status_after of the batch), so list_active is an index range.  The
        # head is max(seq) of events (one primary-key seek): keeping it here
        # too would rewrite this table's page on every append, and each page
        # a commit touches is more bytes to fsync.
        "CREATE TABLE workflows (workflow_id TEXT NOT NULL PRIMARY KEY, status TEXT) WITHOUT ROWID",
        "CREATE INDEX workflows_by_status ON workflows (status, workflow_id)",
        "CREATE TABLE timers ("
        " workflow_id TEXT NOT NULL, timer_id TEXT NOT NULL, fire_at INTEGER NOT NULL,"
        " PRIMARY KEY (workflow_id, timer_id)) WITHOUT ROWID",
        "CREATE INDEX timers_by_fire_at ON timers (fire_at, workflow_id, timer_id)",
        "CREATE TABLE visibility ("
        " workflow_id TEXT NOT NULL PRIMARY KEY, run_id TEXT NOT NULL, workflow_type TEXT NOT NULL,"
        " status TEXT NOT NULL, start_time INTEGER NOT NULL, close_time INTEGER,"
        " task_queue TEXT NOT NULL, failed_step TEXT, failure_reason TEXT, stuck_reason TEXT,"
        " search_attributes TEXT NOT NULL) WITHOUT ROWID",
        "CREATE INDEX visibility_by_start ON visibility (start_time, workflow_id)",
        "CREATE INDEX visibility_by_type ON visibility (workflow_type, start_time)",
        # Search attributes, one row per attribute (part 0) plus one per element
        # of a list value (parts 1..n, kind 'elem').  ``num`` has no declared type
        # so integers stay exact integers and floats stay floats.
        "CREATE TABLE search_attrs ("
        " workflow_id TEXT NOT NULL, key TEXT NOT NULL, part INTEGER NOT NULL, kind TEXT NOT NULL,"
        " num, txt TEXT, PRIMARY KEY (workflow_id, key, part)) WITHOUT ROWID",
        "CREATE INDEX search_attrs_by_num ON search_attrs (key, kind, num)",
        "CREATE INDEX search_attrs_by_txt ON search_attrs (key, kind, txt)",
    ),
    # 2: one owner per store and the command inbox.  ``owner``
    # holds at most one row (id 1), read and rewritten inside one BEGIN
    # IMMEDIATE transaction, so concurrent claimants serialise on the write
    # lock.  Inbox commands stay after their ack (with the outcome) so the
    # sender can read the outcome back; ``inbox_pending`` covers only
    # un-acked rows.
    (
        "CREATE TABLE owner ("
        " id INTEGER PRIMARY KEY CHECK (id = 1), pid INTEGER NOT NULL, host TEXT NOT NULL,"
        " started_at INTEGER NOT NULL, token TEXT NOT NULL, since INTEGER NOT NULL,"
        " renewed_at INTEGER NOT NULL, stale_after_us INTEGER NOT NULL)",
        "CREATE TABLE inbox ("
        " command_id INTEGER PRIMARY KEY AUTOINCREMENT, type TEXT NOT NULL, data TEXT NOT NULL,"
        " acked INTEGER NOT NULL DEFAULT 0, outcome TEXT)",
        "CREATE INDEX inbox_pending ON inbox (command_id) WHERE acked = 0",
    ),
    # 3: inbox commands' request ids (idempotency keys): a command queued again
    # under its request id is found here and not added twice.
    (
        "ALTER TABLE inbox ADD COLUMN request_id TEXT",
        "CREATE UNIQUE INDEX inbox_by_request ON inbox (request_id) WHERE request_id IS NOT NULL",
    ),
    # 4: the owner's process start mark (aion_trio's ``process_mark``), so a
    # same-host owner is judged by its process, not its pid alone (pids are reused).
    ("ALTER TABLE owner ADD COLUMN process TEXT",),
    # 5: recoveries begun and not finished, per workflow (aion_trio.RecoveryCounts);
    # a row exists only while its count is not zero.
    (
        "CREATE TABLE recoveries (workflow_id TEXT NOT NULL PRIMARY KEY, count INTEGER NOT NULL) WITHOUT ROWID",
    ),
    # 6: durable schedules (aion_trio.ScheduleStore): the engine's JSON text under a
    # version bumped by every write (compare-and-set).
    (
        "CREATE TABLE schedules ("
        " schedule_id TEXT NOT NULL PRIMARY KEY, version INTEGER NOT NULL, data TEXT NOT NULL) WITHOUT ROWID",
    ),
    # 7: flow control (aion_trio.FlowStore): permits held until they expire, the starts
    # a rate counts, and the runs of workflow queues (seq: their order of arrival).
    (
        "CREATE TABLE flow_permits (permit_id INTEGER PRIMARY KEY AUTOINCREMENT, key TEXT NOT NULL,"
        " holder TEXT NOT NULL, expires_at INTEGER NOT NULL)",
        "CREATE INDEX flow_permits_by_key ON flow_permits (key, expires_at)",
        "CREATE TABLE flow_starts (key TEXT NOT NULL, at INTEGER NOT NULL)",
        "CREATE INDEX flow_starts_by_key ON flow_starts (key, at)",
        "CREATE TABLE flow_runs (seq INTEGER PRIMARY KEY AUTOINCREMENT, queue TEXT NOT NULL,"
        " workflow_id TEXT NOT NULL, partition_key TEXT NOT NULL, priority INTEGER NOT NULL,"
        " dedup_id TEXT, state TEXT NOT NULL, data TEXT NOT NULL, UNIQUE (queue, workflow_id))",
        "CREATE INDEX flow_runs_by_order ON flow_runs (queue, priority, seq)",
    ),
    # 8: attempts waiting for a flow-control slot (aion_trio.FlowWaiter), one row per
    # waiting activity of a run, so a reader of the file (aion-trio show) sees the wait.
    # Written only by a wait that blocks; expires_at (renewed by its engine) makes the
    # row of an engine that died lapse.
    (
        "CREATE TABLE flow_waiters (workflow_id TEXT NOT NULL, run_id TEXT NOT NULL,"
        " activity_id INTEGER NOT NULL, attempt INTEGER NOT NULL, pool TEXT NOT NULL,"
        " limit_text TEXT NOT NULL, priority INTEGER NOT NULL, since INTEGER NOT NULL,"
        " holder TEXT NOT NULL, expires_at INTEGER NOT NULL,"
        " PRIMARY KEY (workflow_id, run_id, activity_id)) WITHOUT ROWID",
    ),
)

DEFAULT_WAL_AUTOCHECKPOINT = 4000
"""WAL pages after which a commit of the writer connection checkpoints (SQLite's default is 1000).

A checkpoint copies every page changed since the last one into the database
file and fsyncs it (with ``synchronous=FULL``, the WAL too), inside the commit
that triggers it, so every write waiting on that commit waits for it.  With
many workflows appending, a group commit dirties one page per workflow and
SQLite's 1000 pages come every few commits; checkpointing four times less
often copies each hot page (a workflow's last one) once instead of four times.
The WAL file then grows to about this many pages (16 MiB at 4 KiB pages) plus
one group, and is reused from its start after each checkpoint."""

SCHEMA_VERSION = len(MIGRATIONS)
"""The newest ``PRAGMA user_version`` this code knows."""

_SET_USER_VERSION = tuple(f"PRAGMA user_version = {v:d}" for v in range(SCHEMA_VERSION + 1))
_SYNCHRONOUS = {"FULL": "PRAGMA synchronous = FULL", "NORMAL": "PRAGMA synchronous = NORMAL"}
TABLES = (
    "events",
    "workflows",
    "timers",
    "visibility",
    "search_attrs",
    "owner",
    "inbox",
    "recoveries",
    "schedules",
    "flow_permits",
    "flow_starts",
    "flow_runs",
    "flow_waiters",
)
# Touching each table's root page at open finds damaged files early.
_PROBES = tuple(f"SELECT 1 FROM {t} LIMIT 1" for t in TABLES)

_OPEN_WRITE = apsw.SQLITE_OPEN_READWRITE | apsw.SQLITE_OPEN_CREATE
_OPEN_READ = apsw.SQLITE_OPEN_READWRITE
_OPEN_READ_ONLY = apsw.SQLITE_OPEN_READONLY


def _user_tables(conn: apsw.Connection) -> list[str]:
    return [
        r[0]
        for r in conn.execute(
            "SELECT name FROM sqlite_schema WHERE type = 'table' AND name NOT LIKE 'sqlite\\_%' ESCAPE '\\'"
            " ORDER BY name"
        )
    ]


def _pragma_int(conn: apsw.Connection, sql: str) -> int:
    value = conn.execute(sql).fetchall()[0][0]
    assert isinstance(value, int), value
    return value


def _check_identity(conn: apsw.Connection, path: str) -> int:
    """Return the file's schema version (0: empty, to be created) or raise why it is not ours."""
    app_id = _pragma_int(conn, "PRAGMA application_id")
    version = _pragma_int(conn, "PRAGMA user_version")
    if app_id == APPLICATION_ID:
        if version > SCHEMA_VERSION:
            raise DatabaseTooNew(path, version, SCHEMA_VERSION)
        return version
    if app_id != 0:
        raise NotAnAionDatabase(
            path,
            f"its application_id is {app_id:#010x}, not aion_trio's {APPLICATION_ID:#010x}: it belongs "
            "to another program; point the URL at an aion_trio database or at a new file name",
        )
    tables = _user_tables(conn)
    if tables or version != 0:
        shown = ", ".join(tables[:5]) + (", ..." if len(tables) > 5 else "")
        raise NotAnAionDatabase(
            path,
            f"it is a SQLite database of another program (tables: {shown or 'none'}; user_version "
            f"{version}; no aion_trio stamp); point the URL at an aion_trio database or at a new file name",
        )
    return 0


def _migrate(conn: apsw.Connection, path: str, found: int) -> None:
    for version in range(found + 1, SCHEMA_VERSION + 1):
        conn.execute("BEGIN IMMEDIATE")
        try:
            # Re-check under the write lock: another process may have migrated meanwhile.
            current = _check_identity(conn, path)
            if current < version:
                if current == 0:
                    conn.execute(_STAMP_APPLICATION_ID)
                for statement in MIGRATIONS[version - 1]:
                    conn.execute(statement)
                conn.execute(_SET_USER_VERSION[version])
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise


def _check_tables(conn: apsw.Connection, path: str) -> None:
    missing = sorted(set(TABLES) - set(_user_tables(conn)))
    if missing:
        raise DatabaseCorrupt(
            path,
            f"it is stamped as an aion_trio database but table(s) {', '.join(missing)} are missing; "
            "restore it from a backup",
        )
    for probe in _PROBES:
        conn.execute(probe).fetchall()


def _configure(conn: apsw.Connection, synchronous: str, busy_timeout_ms: int) -> None:
    conn.set_busy_timeout(busy_timeout_ms)
    conn.execute(_SYNCHRONOUS[synchronous])


def open_read_only(path: str, busy_timeout_ms: int) -> apsw.Connection:
    """``mode=ro``: open an existing, current aion_trio database without creating, migrating
    or writing anything; the connection refuses writes (``query_only``)."""
    if not os.path.exists(path):
        raise StorePathError(
            path,
            "no database file here, and a read-only open (mode=ro) creates none; check the path, or "
            "open the store read-write once (e.g. start a worker on it) to create it",
        )
    if os.path.isdir(path):
        raise StorePathError(path, "this is a directory, not a database file")
    try:
        conn = apsw.Connection(path, flags=_OPEN_READ_ONLY)
    except apsw.Error as exc:
        raise open_error(exc, path) from exc
    try:
        conn.set_busy_timeout(busy_timeout_ms)
        found = _check_identity(conn, path)
        if found == 0:
            raise NotAnAionDatabase(
                path,
                "the file is empty: no aion_trio database was ever created in it; check the path",
            )
        if found < SCHEMA_VERSION:
            raise StorePathError(
                path,
                f"schema version {found} is older than this aion_trio's ({SCHEMA_VERSION}) and a "
                "read-only open (mode=ro) does not migrate; open it read-write once to upgrade it",
            )
        _check_tables(conn, path)
        conn.execute("PRAGMA query_only = ON")
    except apsw.Error as exc:
        conn.close()
        raise open_error(exc, path) from exc
    except BaseException:
        conn.close()
        raise
    return conn


FILE_MODE = 0o600
"""A new database file's permissions (histories hold business data); its -wal and -shm follow."""


def _create_private(path: str) -> bool:
    """Create a missing database file ``0600``, whatever the umask, before SQLite opens it.

    SQLite creates the ``-wal`` and ``-shm`` files with the database file's
    permission bits (and sets them, past the umask), so all three are private.
    An existing file keeps the permissions its owner gave it.  Returns whether
    the file was created.
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), FILE_MODE)
    except OSError:
        return False  # it exists (or cannot be created: SQLite's own open says why)
    try:
        os.fchmod(fd, FILE_MODE)  # the umask may have taken bits from FILE_MODE
    finally:
        os.close(fd)
    return True


def open_writer(path: str, synchronous: str, busy_timeout_ms: int) -> apsw.Connection:
    """Open (creating if needed), check and migrate the database; return the writer connection.

    Its checkpoints are the writer thread's (:class:`~._threads.Writer` sets its WAL hook)."""
    problem = describe_path_problem(path)
    if problem is not None and not os.path.exists(path):
        raise StorePathError(path, problem)
    if os.path.isdir(path):
        raise StorePathError(path, problem or "this is a directory, not a database file")
    if _create_private(path):
        forget_mark(path)
    try:
        conn = apsw.Connection(path, flags=_OPEN_WRITE)
    except apsw.Error as exc:
        raise open_error(exc, path) from exc
    try:
        conn.set_busy_timeout(busy_timeout_ms)
        found = _check_identity(conn, path)
        if conn.readonly("main"):
            raise StorePathError(
                path,
                describe_path_problem(path)
                or "the file is read-only for this process; make it writable (chmod u+w, chown) or "
                "open the store from a user that may write it",
            )
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchall()[0][0]
        if str(mode).lower() != "wal":
            raise StorePathError(
                path,
                f"cannot switch the database to WAL mode (it stayed in {mode!r} mode); the file system "
                "may not support shared memory (network file systems often do not): use a local disk",
            )
        _configure(conn, synchronous, busy_timeout_ms)
        _migrate(conn, path, found)
        if found < SCHEMA_VERSION:
            # The schema's pages go to the file once, so the WAL starts empty: the writer's
            # checkpoint threshold then bounds it from the first append.
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        _check_tables(conn, path)
        check_mark(conn, path)
    except apsw.Error as exc:
        conn.close()
        raise open_error(exc, path) from exc
    except BaseException:
        conn.close()
        raise
    return conn


def open_heartbeat(path: str, synchronous: str, busy_timeout_ms: int) -> apsw.Connection:
    """Open a connection for one owner heartbeat (after :func:`open_writer` succeeded)."""
    try:
        conn = apsw.Connection(path, flags=_OPEN_READ)
    except apsw.Error as exc:
        raise open_error(exc, path) from exc
    try:
        _configure(conn, synchronous, busy_timeout_ms)
    except apsw.Error as exc:
        conn.close()
        raise open_error(exc, path) from exc
    return conn


def open_reader(
    path: str,
    synchronous: str,
    busy_timeout_ms: int,
    functions: Mapping[str, tuple[Callable[..., Any], int]],
    *,
    read_only: bool = False,
) -> apsw.Connection:
    """Open a read connection (after :func:`open_writer` or :func:`open_read_only` succeeded)."""
    try:
        conn = apsw.Connection(path, flags=_OPEN_READ_ONLY if read_only else _OPEN_READ)
    except apsw.Error as exc:
        raise open_error(exc, path) from exc
    try:
        _configure(conn, synchronous, busy_timeout_ms)
        conn.execute("PRAGMA query_only = ON")
        for name, (function, nargs) in functions.items():
            conn.create_scalar_function(name, function, nargs, deterministic=True)
    except apsw.Error as exc:
        conn.close()
        raise open_error(exc, path) from exc
    except BaseException:
        conn.close()
        raise
    return conn
