"""Mapping psycopg exceptions into aion_trio's store errors.

Every mapped error keeps the psycopg exception as ``__cause__``.
"""

from __future__ import annotations

from typing import TypeVar

import psycopg
import psycopg.errors
import psycopg_pool

from aion_trio import AionInternalError
from aion_trio.plugin import BackendUnavailable, DatabaseCorrupt, StoreError

E = TypeVar("E", bound=BaseException)

# SQLSTATE classes that mean "try again later": connection trouble (08),
# transaction rollback (40: serialization failure, deadlock), insufficient
# resources (53), operator intervention (57: cancel, admin shutdown; 57014 is
# statement_timeout), system error (58), lock_timeout (55P03).
_TRANSIENT_CLASSES = ("08", "40", "53", "57", "58")
_TRANSIENT_CODES = ("55P03", "55006")


def cause(error: E, original: BaseException) -> E:
    """Chain ``original`` as ``error.__cause__`` (``raise error from original`` without raising)."""
    error.__cause__ = original
    error.__suppress_context__ = True
    return error


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def backend_error(exc: BaseException, location: str, doing: str) -> StoreError | AionInternalError:
    """Map an exception raised while ``doing`` something against ``location``."""
    if isinstance(exc, psycopg_pool.PoolTimeout):
        return cause(
            BackendUnavailable(
                f"{location}: no database connection became available while {doing} ({_describe(exc)}); "
                "is the server up and reachable, and is pool_size large enough?"
            ),
            exc,
        )
    if isinstance(exc, psycopg_pool.PoolClosed):
        return cause(BackendUnavailable(f"{location}: the connection pool is closed while {doing}"), exc)
    if not isinstance(exc, psycopg.Error):
        return cause(
            AionInternalError(f"{location}: {doing} failed: {_describe(exc)}; please report it"), exc
        )
    code = exc.sqlstate or ""
    if isinstance(exc, psycopg.errors.QueryCanceled):
        return cause(
            BackendUnavailable(
                f"{location}: {doing} was cancelled by the server, usually because it ran longer than "
                f"statement_timeout ({_describe(exc)}); raise ?statement_timeout= if this is expected"
            ),
            exc,
        )
    if isinstance(exc, psycopg.errors.LockNotAvailable):
        return cause(
            BackendUnavailable(
                f"{location}: waited longer than lock_timeout for a lock while {doing} ({_describe(exc)}); "
                "another session holds it"
            ),
            exc,
        )
    if (
        isinstance(exc, psycopg.OperationalError)
        or code[:2] in _TRANSIENT_CLASSES
        or code in _TRANSIENT_CODES
    ):
        return cause(BackendUnavailable(f"{location}: {doing} failed: {_describe(exc)}"), exc)
    if code in ("XX001", "XX002"):
        return cause(
            DatabaseCorrupt(location, f"the server reports damaged data while {doing}: {_describe(exc)}"), exc
        )
    if code in ("42P01", "42883", "42703", "3F000"):
        return cause(
            DatabaseCorrupt(
                location,
                f"a table, column or function of the aion_trio schema is missing while {doing} "
                f"({_describe(exc)}); the schema was altered or dropped by hand: restore it or use a new ?schema=",
            ),
            exc,
        )
    if isinstance(exc, psycopg.InterfaceError):
        return cause(BackendUnavailable(f"{location}: {doing} failed: {_describe(exc)}"), exc)
    return cause(
        AionInternalError(
            f"{location}: unexpected PostgreSQL error while {doing}: {_describe(exc)} (SQLSTATE {code or '?'}); "
            "the schema may have been altered by hand, otherwise this is a bug: please report it"
        ),
        exc,
    )
