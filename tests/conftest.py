"""Fixtures shared by the whole suite (keep this file small).

``store_url`` is how engine-level tests get a store, so the same test runs
against every store: ``AION_TRIO_TEST_STORE`` names the kind (``memory``, the
default, ``sqlite``, or ``postgres``); tox's store factors (``py311-memory``,
``py311-sqlite``, ``py311-postgres``) set it.  A value no kind answers to
stops the run at once.

``postgres`` needs the ``aion-trio-postgres`` package (contrib/) and a server:
``AION_TRIO_TEST_PG_URL`` (default ``postgresql://postgres@127.0.0.1:5432/test``).
Each store URL names a schema of its own, dropped when the test ends.  An
unreachable server skips the test, except under ``CI=true``, where it fails.
"""

from __future__ import annotations

import itertools
import os
import signal
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

import aion_trio_memory

# Property tests are checked by what they find, never by how fast an example runs: CI runs
# the suite on a loaded 2-core machine, where hypothesis's default 200 ms deadline per
# example fails a correct test at random (a DeadlineExceeded, or a Flaky on the rerun).
# Per-test @settings that do not name a deadline inherit this profile.
settings.register_profile("aion-trio", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("aion-trio")

STORE_ENV = "AION_TRIO_TEST_STORE"
DEFAULT_STORE_KIND = "memory"


# A run started with SIGINT ignored (a background job of a non-interactive shell, nohup)
# passes that on to every process it starts, and Python keeps an inherited SIG_IGN: the
# Ctrl-C tests (a real SIGINT to the engine, the CLI, the demo) would wait for an interrupt
# that is never delivered.  Python's own handler is what a terminal gives; a child process
# sees it as the default disposition.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _memory_url(directory: Path, n: int) -> str:
    # A *named* memory store, so reopening the URL finds the same data, as with a
    # file: restart tests behave alike on every kind.  Unique per call.
    return f"memory://aion-test-{uuid.uuid4().hex}"


def _sqlite_url(directory: Path, n: int) -> str:
    # sqlite:/// + an absolute path (which starts with '/').
    return f"sqlite:///{directory}/{'store' if n == 1 else f'store-{n}'}.db"


PG_URL_ENV = "AION_TRIO_TEST_PG_URL"
_PG_SCHEMA_PREFIX = "aion_e_"
_pg_problem: list[str | None] = []


def _pg_base() -> str:
    return os.environ.get(PG_URL_ENV, "").strip() or "postgresql://postgres@127.0.0.1:5432/test"


def _require_postgres() -> None:
    """Skip the test (fail it under CI=true) when the PostgreSQL server does not answer."""
    if not _pg_problem:
        import psycopg  # only the postgres kind needs it

        try:
            with psycopg.connect(_pg_base(), connect_timeout=3) as conn:
                conn.execute("SELECT 1")
            _pg_problem.append(None)
        except psycopg.Error as exc:
            _pg_problem.append(str(exc).strip() or type(exc).__name__)
    problem = _pg_problem[0]
    if problem is None:
        return
    message = f"{STORE_ENV}=postgres but PostgreSQL is not reachable at {_pg_base()} ({problem}); start it or set {PG_URL_ENV}"
    if os.environ.get("CI", "").strip().lower() in ("1", "true", "yes"):
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def _postgres_url(directory: Path, n: int) -> str:
    # A schema of its own per URL: reopening the URL (a restart) finds the data.
    return f"{_pg_base()}?schema={_PG_SCHEMA_PREFIX}{uuid.uuid4().hex[:16]}"


def _drop_postgres_schema(url: str) -> None:
    import psycopg
    from psycopg import sql

    schema = url.rsplit("?schema=", 1)[1]
    with psycopg.connect(_pg_base(), autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


# kind -> make(directory, n): the n-th fresh store URL of one test.
STORE_KINDS: dict[str, Callable[[Path, int], str]] = {
    "memory": _memory_url,
    "sqlite": _sqlite_url,
    "postgres": _postgres_url,
}


def _store_kind() -> str:
    value = os.environ.get(STORE_ENV, "").strip().lower()
    return value or DEFAULT_STORE_KIND


def pytest_configure(config: pytest.Config) -> None:
    kind = _store_kind()
    if kind not in STORE_KINDS:
        raise pytest.UsageError(
            f"{STORE_ENV}={os.environ.get(STORE_ENV)!r} is not a store kind this suite knows; "
            f"use one of: {', '.join(STORE_KINDS)}"
        )


def pytest_report_header(config: pytest.Config) -> str:
    return f"aion_trio test store: {_store_kind()} (set {STORE_ENV} to change)"


@pytest.fixture
def store_url(tmp_path: Path) -> Iterator[Callable[[], str]]:
    """A factory of store URLs of the selected kind.

    Each call returns the URL of a new, empty store, isolated from every other
    call and test; opening the same URL again (an engine restart) finds that
    store's data.  Memory stores are forgotten when the test ends; SQLite files
    live in the test's ``tmp_path``.
    """
    kind = _store_kind()
    if kind == "postgres":
        _require_postgres()
    make = STORE_KINDS[kind]
    counter = itertools.count(1)
    issued: list[str] = []

    def new_store_url() -> str:
        url = make(tmp_path, next(counter))
        issued.append(url)
        return url

    yield new_store_url
    for url in issued:
        if url.startswith("memory://"):
            aion_trio_memory.forget(url.removeprefix("memory://"))
        elif kind == "postgres":
            _drop_postgres_schema(url)


#: Stores the flow-control tests run on: memory and SQLite, plus the selected store in the
#: PostgreSQL engine set (AION_TRIO_TEST_STORE=postgres).
FLOW_KINDS = ["memory", "sqlite"] + (
    ["selected"] if os.environ.get("AION_TRIO_TEST_STORE") == "postgres" else []
)


@pytest.fixture(params=FLOW_KINDS)
def flow_url(
    request: pytest.FixtureRequest, tmp_path: Path, store_url: Callable[[], str]
) -> Iterator[Callable[[], str]]:
    """A fresh store URL of each kind; opening it again finds the same data."""
    if request.param == "selected":
        url = store_url()
        yield lambda: url
        return
    name = f"flow-{uuid.uuid4().hex}"
    url = f"memory://{name}" if request.param == "memory" else f"sqlite:///{tmp_path / 'flow.db'}"
    yield lambda: url
    aion_trio_memory.forget(name)
