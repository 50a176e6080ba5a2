"""Mapping apsw exceptions into aion_trio's store errors.

Every mapped error keeps the apsw exception as ``__cause__``.  Errors are
built in the worker threads and travel to the Trio task inside an outcome, so
``cause()`` sets the cause by hand, exactly as ``raise ... from exc`` would.
"""

from __future__ import annotations

import os
from typing import TypeVar

import apsw

from aion_trio import AionInternalError
from aion_trio.plugin import (
    BackendUnavailable,
    DatabaseCorrupt,
    NotAnAionDatabase,
    StorePathError,
)

E = TypeVar("E", bound=BaseException)

#: apsw errors that doom the whole transaction (as opposed to one statement's bad value).
TRANSACTION_ERRORS: tuple[type[apsw.Error], ...] = (
    apsw.BusyError,
    apsw.LockedError,
    apsw.IOError,
    apsw.FullError,
    apsw.CorruptError,
    apsw.NotADBError,
    apsw.CantOpenError,
    apsw.ReadOnlyError,
    apsw.NoMemError,
    apsw.ProtocolError,
    apsw.InterruptError,
    apsw.AbortError,
    apsw.ConnectionClosedError,
)


def cause(error: E, original: BaseException) -> E:
    """Chain ``original`` as ``error.__cause__`` (``raise error from original`` without raising)."""
    error.__cause__ = original
    error.__suppress_context__ = True
    return error


def _uid() -> str:
    return f"uid {os.geteuid()}" if hasattr(os, "geteuid") else "this user"


def _can(path: str, mode: int) -> bool:
    # Effective ids: what the kernel checks when SQLite opens the file.
    if os.access in os.supports_effective_ids:
        return os.access(path, mode, effective_ids=True)
    return os.access(path, mode)  # pragma: no cover - platforms without faccessat


def describe_path_problem(path: str) -> str | None:
    """Why ``path`` cannot hold a writable database, if a look at the file system tells."""
    directory = os.path.dirname(path) or "."
    if not os.path.exists(directory):
        return f"directory {directory} does not exist; create it (mkdir -p {directory}) or point the URL elsewhere"
    if not os.path.isdir(directory):
        return f"{directory} is not a directory; point the URL at a file inside a directory"
    if os.path.isdir(path):
        return "this is a directory, not a database file; name a file inside it (e.g. .../store.db)"
    if not os.path.exists(path) and not _can(directory, os.W_OK | os.X_OK):
        return (
            f"cannot create the database file: directory {directory} is not writable by this process "
            f"({_uid()}); make it writable (chmod/chown) or point the URL at a writable directory"
        )
    if os.path.exists(path) and not _can(directory, os.W_OK | os.X_OK):
        return (
            f"directory {directory} is not writable by this process ({_uid()}); SQLite's WAL mode "
            f"creates {os.path.basename(path)}-wal and -shm next to the database, so the directory "
            "must be writable too (chmod/chown it, or move the database)"
        )
    if os.path.exists(path) and not _can(path, os.R_OK | os.W_OK):
        return f"the file is not readable and writable by this process ({_uid()}); fix its permissions (chmod u+rw, chown)"
    return None


def open_error(exc: apsw.Error, path: str) -> Exception:
    """Map an apsw error raised while opening/checking/migrating ``path``."""
    if isinstance(exc, apsw.NotADBError):
        return cause(
            NotAnAionDatabase(
                path,
                "the file is not a SQLite database (its header is not SQLite's), so it is not an "
                "aion_trio database; point the URL at an aion_trio database or at a new file name",
            ),
            exc,
        )
    if isinstance(exc, apsw.CorruptError):
        return cause(corrupt(path, exc), exc)
    if isinstance(exc, (apsw.CantOpenError, apsw.ReadOnlyError, apsw.PermissionsError, apsw.AuthError)):
        problem = describe_path_problem(path) or f"cannot open or write the database ({exc})"
        return cause(StorePathError(path, problem), exc)
    return runtime_error(exc, path, "opening the database")


def corrupt(path: str, exc: BaseException) -> DatabaseCorrupt:
    return DatabaseCorrupt(
        path,
        f"the database file is damaged (SQLite says: {exc}); restore it from a backup, or salvage "
        "what is readable with the sqlite3 shell's .recover into a new file",
    )


def runtime_error(exc: apsw.Error, path: str, doing: str) -> Exception:
    """Map an apsw error raised while ``doing`` something on an open store."""
    if isinstance(exc, apsw.CorruptError):
        return cause(corrupt(path, exc), exc)
    if isinstance(exc, apsw.NotADBError):
        return cause(
            NotAnAionDatabase(path, f"the file stopped being a SQLite database while {doing} ({exc})"), exc
        )
    if isinstance(exc, (apsw.BusyError, apsw.LockedError)):
        return cause(
            BackendUnavailable(
                f"{path}: database stayed locked by another connection for longer than busy_timeout "
                f"while {doing} ({exc}); is another process writing to it?"
            ),
            exc,
        )
    if isinstance(exc, apsw.FullError):
        return cause(BackendUnavailable(f"{path}: disk full while {doing}; free space and retry"), exc)
    # apsw's stubs do not declare the extended code its exceptions carry.
    if isinstance(exc, apsw.ReadOnlyError) and getattr(exc, "extendedresult", None) == apsw.SQLITE_READONLY:
        # Plain SQLITE_READONLY at run time: this connection was opened read-only (mode=ro);
        # a writer opened read-write is checked for a read-only file at open.
        return cause(
            StorePathError(
                path,
                f"refused {doing}: the store was opened read-only (mode=ro); nothing was written; "
                "open it without mode=ro to write",
            ),
            exc,
        )
    if isinstance(exc, apsw.ReadOnlyError):
        return cause(
            BackendUnavailable(
                f"{path}: the database became read-only while {doing} ({exc}); check permissions"
            ),
            exc,
        )
    if isinstance(exc, (apsw.SQLError, apsw.ConstraintError, apsw.MismatchError, apsw.MisuseError)):
        return cause(
            AionInternalError(
                f"{path}: unexpected SQLite error while {doing}: {type(exc).__name__}: {exc}; "
                "the schema may have been altered by hand, otherwise this is a bug: please report it"
            ),
            exc,
        )
    return cause(BackendUnavailable(f"{path}: {doing} failed: {type(exc).__name__}: {exc}"), exc)
