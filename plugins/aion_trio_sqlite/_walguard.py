"""Noticing a lost ``-wal`` file, while the store runs and when it opens.

Every commit since the last checkpoint lives only in the ``-wal`` file.  If
it is deleted while the store is open, SQLite goes on writing to the deleted
file (its descriptor stays open), and a crash then loses every one of those
acknowledged writes; the next open sees only the database file.

**While open** (writer thread, between transactions, at most every
:data:`CHECK_INTERVAL` seconds: one ``stat``, never per commit): if the
``-wal`` path is gone or is another file, the guard checkpoints at once
(copying the frames still readable through SQLite's open descriptor into the
database file, so nothing acknowledged is lost), logs an error, and the
store refuses every later write with :class:`~aion_trio.DatabaseCorrupt`
(they would go to the deleted file): restart the engine.

**At open**: each check also records, in ``file.db-mark`` (outside the WAL,
``fsync``-ed), the last append the store acknowledged (workflow id and head
seq).  If the database file holds less of that workflow than the mark says,
acknowledged history went backwards (the ``-wal`` was lost before the guard
saw it, or an older copy of the file was put in place): the open is refused
with ``DatabaseCorrupt``.  What cannot be detected: writes acknowledged in
the last interval before the crash (the mark lags by up to
:data:`CHECK_INTERVAL`), and a loss whose last marked append had already
been checkpointed.  A database file that does not exist is a new store: a
left-over mark is removed.
"""

from __future__ import annotations

import json
import logging
import os

import apsw

from aion_trio.plugin import DatabaseCorrupt

logger = logging.getLogger("aion_trio.sqlite")

CHECK_INTERVAL = 1.0
"""Seconds between two checks of the ``-wal`` file (and updates of the mark)."""
MARK_SUFFIX = "-mark"
_MARK_MODE = 0o600


def mark_path(db_path: str) -> str:
    return db_path + MARK_SUFFIX


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino)


def forget_mark(db_path: str) -> None:
    """A new database file: a mark left by a deleted one says nothing about it."""
    try:
        os.unlink(mark_path(db_path))
    except FileNotFoundError:
        pass


def check_mark(conn: apsw.Connection, db_path: str) -> None:
    """Refuse (``DatabaseCorrupt``) a database that holds less than its mark says was acknowledged."""
    try:
        with open(mark_path(db_path), encoding="utf-8") as f:
            mark = json.load(f)
        workflow_id, seq = str(mark["workflow_id"]), int(mark["seq"])
    except FileNotFoundError:
        return
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.warning("%s: ignoring an unreadable mark file (%s)", mark_path(db_path), exc)
        return
    rows = conn.execute("SELECT max(seq) FROM events WHERE workflow_id = ?", (workflow_id,)).fetchall()
    head = int(rows[0][0] or 0)
    if head < seq:
        name = os.path.basename(db_path)
        raise DatabaseCorrupt(
            db_path,
            f"acknowledged history went backwards: workflow {workflow_id!r} had {seq} events recorded, "
            f"the file holds {head}. Its -wal file was deleted (or an older copy of {name} was put in "
            "place), and the writes since the last checkpoint are lost. Restore the database with its "
            f"-wal file from a backup; to use the file as it is, delete {name}{MARK_SUFFIX}",
        )


class WalGuard:
    """Checks the ``-wal`` file and keeps the mark; used by the writer thread only."""

    __slots__ = ("_db", "_due", "_last", "_marked", "_wal", "_wal_id", "checks", "lost")

    def __init__(self, db_path: str, wal_path: str) -> None:
        self._db = db_path
        self._wal = wal_path
        self._wal_id = _identity(wal_path)  # the open made it (journal_mode=WAL, the first reads)
        self._due: float | None = None  # the first look, CHECK_INTERVAL after the writer's first commit
        self._last: tuple[str, int] | None = None
        self._marked: tuple[str, int] | None = None
        #: Checks made (for tests and statistics).
        self.checks = 0
        #: Set once the ``-wal`` file was found lost: why every later write is refused.
        self.lost: str | None = None

    def due(self, now: float) -> bool:
        if self._due is None:
            self._due = now + CHECK_INTERVAL
        return self.lost is None and now >= self._due

    def appended(self, workflow_id: str, head: int) -> None:
        self._last = (workflow_id, head)

    def check(self, conn: apsw.Connection, now: float) -> None:
        """One check (the writer thread, between transactions); never raises."""
        self._due = now + CHECK_INTERVAL
        self.checks += 1
        try:
            self._check(conn)
        except Exception as exc:  # pragma: no cover - a bug here must not stop the writer
            logger.exception("%s: the -wal check failed: %r", self._db, exc)

    def _check(self, conn: apsw.Connection) -> None:
        found = _identity(self._wal)
        if self._wal_id is None:
            self._wal_id = found
        elif found != self._wal_id:
            self._rescue(conn, found is None)
        if self._last is not None and self._last != self._marked:
            self._write_mark(self._last)

    def _rescue(self, conn: apsw.Connection, gone: bool) -> None:
        what = "was deleted" if gone else "was replaced by another file"
        try:
            frames, copied = conn.wal_checkpoint(mode=apsw.SQLITE_CHECKPOINT_TRUNCATE)
        except apsw.Error as exc:
            saved = f"copying its frames into the database file failed ({exc}): writes since the last checkpoint may be lost"
        else:
            if copied < frames:
                saved = (
                    f"only {copied} of its {frames} frames could be copied into the database file "
                    "(another process held it): writes since the last checkpoint may be lost"
                )
            else:
                saved = "every acknowledged write was copied into the database file first"
        self.lost = (
            f"the -wal file {self._wal} {what} while the store was open; {saved}. The store takes no "
            "more writes (they would go to the deleted file): restart the engine"
        )
        logger.error("%s: %s", self._db, self.lost)

    def _write_mark(self, mark: tuple[str, int]) -> None:
        text = json.dumps({"workflow_id": mark[0], "seq": mark[1]}).encode("utf-8")
        try:
            fd = os.open(
                mark_path(self._db), os.O_WRONLY | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), _MARK_MODE
            )
            try:
                os.pwrite(fd, text, 0)
                os.ftruncate(fd, len(text))
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            logger.warning("%s: cannot write the mark file (%s); a lost -wal may go unnoticed", self._db, exc)
            return
        self._marked = mark
