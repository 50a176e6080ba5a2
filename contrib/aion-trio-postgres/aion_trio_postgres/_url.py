"""Parsing ``postgresql://`` store URLs (the rules are in the package docstring)."""

from __future__ import annotations

import math
import re
import urllib.parse
from collections.abc import Callable
from typing import Any

import attrs
import psycopg
import psycopg.conninfo

from aion_trio.plugin import InvalidStoreUrl, redact_url

SCHEMES = ("postgresql", "postgres")

DEFAULT_SCHEMA = "aion_trio"
DEFAULT_STATEMENT_TIMEOUT = 30.0
DEFAULT_LOCK_TIMEOUT = 10.0
DEFAULT_POOL_SIZE = 4
DEFAULT_APPEND_BATCH = 32
DEFAULT_POOL_TIMEOUT = 30.0
DEFAULT_CONNECT_TIMEOUT = 10
DEFAULT_LEASE_TTL = 30.0
DEFAULT_TASK_LEASE_TTL = 30.0
DEFAULT_POLL_INTERVAL = 1.0
DEFAULT_CONNECT_WAIT = 60.0

_SCHEMA_RE = re.compile(r"[a-z_][a-z0-9_]{0,62}")
_EXAMPLE = "postgresql://user@host:5432/dbname?schema=aion_trio"


def _seconds(name: str, *, zero_ok: bool) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"{name}={text!r} is not a number of seconds") from None
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
            floor = ">= 0 (0 disables it)" if zero_ok else "> 0"
            raise ValueError(f"{name}={text!r} must be a finite number of seconds {floor}")
        return value

    return parse


def _size(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 1000:
        raise ValueError(f"pool_size={text!r} must be an integer from 1 to 1000")
    return int(text)


#: Each append of a batch is a subtransaction; PostgreSQL keeps 64 per session in
#: shared memory, and more slow every other session's snapshots.
MAX_APPEND_BATCH = 64


def _append_batch(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= MAX_APPEND_BATCH:
        raise ValueError(
            f"append_batch={text!r} must be an integer from 1 to {MAX_APPEND_BATCH} (1: every append alone)"
        )
    return int(text)


def _schema(text: str) -> str:
    if not _SCHEMA_RE.fullmatch(text) or text.startswith("pg_"):
        raise ValueError(
            f"schema={text!r} is not accepted: use 1-63 lowercase letters, digits and '_', "
            "starting with a letter or '_' (and not 'pg_')"
        )
    return text


def _node(text: str) -> str:
    if not text or len(text) > 200 or not text.isprintable():
        raise ValueError(f"node={text!r} must be 1-200 printable characters")
    return text


# option -> (field, parser).  Everything else in the query string goes to libpq.
_OPTIONS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "schema": ("schema", _schema),
    "statement_timeout": ("statement_timeout", _seconds("statement_timeout", zero_ok=True)),
    "lock_timeout": ("lock_timeout", _seconds("lock_timeout", zero_ok=True)),
    "pool_size": ("pool_size", _size),
    "pool_timeout": ("pool_timeout", _seconds("pool_timeout", zero_ok=False)),
    "append_batch": ("append_batch", _append_batch),
    "node": ("node", _node),
    "lease_ttl": ("lease_ttl", _seconds("lease_ttl", zero_ok=False)),
    "task_lease_ttl": ("task_lease_ttl", _seconds("task_lease_ttl", zero_ok=False)),
    "poll_interval": ("poll_interval", _seconds("poll_interval", zero_ok=False)),
    "connect_wait": ("connect_wait", _seconds("connect_wait", zero_ok=True)),
}
_ACCEPTED = ", ".join(_OPTIONS) + " (and any libpq connection parameter, e.g. sslmode, connect_timeout)"


@attrs.frozen(kw_only=True)
class PostgresUrl:
    """A parsed ``postgresql://`` store URL."""

    url: str = attrs.field(repr=False)
    conninfo: str = attrs.field(repr=False)
    """What libpq gets: the URL without this store's own options (it may hold a password)."""
    location: str
    """The server, database and schema, for messages (never the password)."""
    schema: str = DEFAULT_SCHEMA
    statement_timeout: float = DEFAULT_STATEMENT_TIMEOUT
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT
    pool_size: int = DEFAULT_POOL_SIZE
    pool_timeout: float = DEFAULT_POOL_TIMEOUT
    append_batch: int = DEFAULT_APPEND_BATCH
    """The most appends (or visibility upserts) written in one round trip and one transaction
    when they queue for a worker slot together (1: each alone)."""
    node: str | None = None
    lease_ttl: float = DEFAULT_LEASE_TTL
    task_lease_ttl: float = DEFAULT_TASK_LEASE_TTL
    """Seconds an activity worker's lease on a running task lasts without renewal."""
    poll_interval: float = DEFAULT_POLL_INTERVAL
    """Seconds between polls of activity tasks (NOTIFY wakes sooner; polling always backs it)."""
    connect_wait: float = DEFAULT_CONNECT_WAIT
    """Seconds opening the store keeps retrying a server it cannot reach (0: fail at once)."""


def parse_postgres_url(url: str) -> PostgresUrl:
    """Parse ``url`` or raise :class:`~aion_trio.InvalidStoreUrl` saying what is wrong."""
    if not isinstance(url, str):
        raise InvalidStoreUrl(f"{redact_url(url)!r} is not a postgresql:// URL (expected e.g. {_EXAMPLE})")
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in SCHEMES:
        raise InvalidStoreUrl(f"{redact_url(url)!r} is not a postgresql:// URL (expected e.g. {_EXAMPLE})")
    if "#" in rest:
        raise InvalidStoreUrl(
            f"{redact_url(url)!r}: a postgresql:// URL has no #fragment (percent-encode '#' as %23)"
        )
    base, _, query = rest.partition("?")
    values: dict[str, Any] = {}
    passed: list[tuple[str, str]] = []
    if query:
        try:
            pairs = urllib.parse.parse_qsl(query, keep_blank_values=True, strict_parsing=True)
        except ValueError as exc:
            raise InvalidStoreUrl(
                f"{redact_url(url)!r}: malformed query string ({exc}); accepted: {_ACCEPTED}"
            ) from None
        seen: set[str] = set()
        for name, value in pairs:
            if name in seen:
                raise InvalidStoreUrl(f"{redact_url(url)!r}: option {name!r} is given twice")
            seen.add(name)
            if name not in _OPTIONS:
                passed.append((name, value))
                continue
            field, parse = _OPTIONS[name]
            try:
                values[field] = parse(value)
            except ValueError as exc:
                raise InvalidStoreUrl(f"{redact_url(url)!r}: {exc}") from None
    if not any(name == "connect_timeout" for name, _ in passed):
        passed.append(("connect_timeout", str(DEFAULT_CONNECT_TIMEOUT)))
    conninfo = f"postgresql://{base}?{urllib.parse.urlencode(passed)}"
    try:
        params = psycopg.conninfo.conninfo_to_dict(conninfo)
    except psycopg.Error as exc:
        raise InvalidStoreUrl(
            f"{redact_url(url)}: libpq refuses it ({str(exc).strip()}); accepted options: {_ACCEPTED}"
        ) from None
    if not params.get("dbname"):
        raise InvalidStoreUrl(f"{redact_url(url)} names no database (expected e.g. {_EXAMPLE})")
    host = params.get("host") or "localhost"
    port = params.get("port") or "5432"
    user = f"{params['user']}@" if params.get("user") else ""
    schema = values.get("schema", DEFAULT_SCHEMA)
    location = f"postgresql://{user}{host}:{port}/{params['dbname']} (schema {schema})"
    return PostgresUrl(url=url, conninfo=conninfo, location=location, **values)
