"""Fixtures for the PostgreSQL store's tests.

``AION_TRIO_TEST_PG_URL`` names the server (default
``postgresql://postgres@127.0.0.1:5432/test``).  Each store a test opens
through ``fresh_store_url`` lives in a schema of its own, dropped when the
test ends.  An unreachable server skips the tests, except under ``CI=true``,
where it fails them: CI must never go green by skipping the database.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import trio
from _faultproxy import ProxyControl, running_proxy
from _flowcluster import Nodes
from aion_trio_postgres import PostgresStore, open_postgres_store

PG_URL_ENV = "AION_TRIO_TEST_PG_URL"
DEFAULT_PG_URL = "postgresql://postgres@127.0.0.1:5432/test"

_reachable: dict[str, str | None] = {}


def base_url() -> str:
    return os.environ.get(PG_URL_ENV, "").strip() or DEFAULT_PG_URL


def _probe(url: str) -> str | None:
    """``None`` when ``url`` accepts a connection, else why not."""
    if url not in _reachable:
        try:
            with psycopg.connect(url, connect_timeout=3) as conn:
                conn.execute("SELECT 1")
            _reachable[url] = None
        except psycopg.Error as exc:
            _reachable[url] = str(exc).strip() or type(exc).__name__
    return _reachable[url]


def require_server(url: str) -> None:
    """Skip (or, with CI=true, fail) the calling test when no server answers at ``url``."""
    problem = _probe(url)
    if problem is None:
        return
    message = (
        f"PostgreSQL is not reachable at {url} ({problem}); start it (PostgreSQL 15 on 127.0.0.1:5432, "
        f"trust auth, database 'test') or point {PG_URL_ENV} at a server"
    )
    if os.environ.get("CI", "").strip().lower() in ("1", "true", "yes"):
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def drop_schema(url: str, schema: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            psycopg.sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(psycopg.sql.Identifier(schema))
        )


def new_schema_name() -> str:
    return f"aion_t_{uuid.uuid4().hex[:16]}"


@pytest.fixture
def pg_url() -> str:
    """The server's base URL (no store options); the test is skipped/failed if it is unreachable."""
    url = base_url()
    require_server(url)
    return url


@pytest.fixture
def fresh_store_url(pg_url: str) -> Iterator[Callable[..., str]]:
    """A factory of store URLs, each naming a new schema; every schema is dropped after the test."""
    schemas: list[str] = []

    def make(**options: Any) -> str:
        schema = new_schema_name()
        schemas.append(schema)
        extra = "".join(f"&{k}={v}" for k, v in options.items())
        return f"{pg_url}?schema={schema}{extra}"

    yield make
    for schema in schemas:
        drop_schema(pg_url, schema)


@pytest.fixture
def proxy(pg_url: str) -> Iterator[ProxyControl]:
    """A fault proxy (``_faultproxy``) in front of the server; connect through ``proxy.port``."""
    hostport = pg_url.split("@", 1)[1].split("/", 1)[0]
    host, _, port = hostport.partition(":")
    with running_proxy(host, int(port or 5432)) as control:
        yield control


@pytest.fixture
def schema_of() -> Callable[[str], str]:
    return lambda url: url.split("schema=", 1)[1].split("&", 1)[0]


@pytest.fixture
def cluster_nodes(
    fresh_store_url: Callable[..., str], schema_of: Callable[[str], str], tmp_path: Path
) -> Iterator[Nodes]:
    """Engine processes to spawn (``_flowcluster.Nodes``) on a new, migrated schema;
    every node still running is stopped after the test."""
    url = fresh_store_url()
    made = Nodes(url.split("?", 1)[0], schema_of(url), tmp_path)

    async def migrate() -> None:
        async with open_postgres_store(url):
            pass

    trio.run(migrate)
    try:
        yield made
    finally:
        made.stop_all()


def isolated_opener(
    url: str, **kwargs: Any
) -> Callable[[], contextlib.AbstractAsyncContextManager[PostgresStore]]:
    """A conformance-kit factory: each call opens a store in a new schema, dropped on exit."""

    @contextlib.asynccontextmanager
    async def open_fresh() -> AsyncIterator[PostgresStore]:
        schema = new_schema_name()
        try:
            async with open_postgres_store(f"{url}?schema={schema}", **kwargs) as store:
                yield store
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(drop_schema, url, schema)

    return open_fresh
