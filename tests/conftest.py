"""Fixtures shared by the whole suite (keep this file small).

``store_url`` is how engine-level tests get a store, so the same test runs
against every store: ``AION_TRIO_TEST_STORE`` names the kind (``memory``, the
default, or ``sqlite``); tox's store factors (``py311-memory``,
``py311-sqlite``) set it.  A value no kind answers to stops the run at once.
"""

from __future__ import annotations

import itertools
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import aion_trio_memory

STORE_ENV = "AION_TRIO_TEST_STORE"
DEFAULT_STORE_KIND = "memory"


def _memory_url(directory: Path, n: int) -> str:
    # A *named* memory store, so reopening the URL finds the same data, as with a
    # file: restart tests behave alike on every kind.  Unique per call.
    return f"memory://aion-test-{uuid.uuid4().hex}"


def _sqlite_url(directory: Path, n: int) -> str:
    # sqlite:/// + an absolute path (which starts with '/').
    return f"sqlite:///{directory}/{'store' if n == 1 else f'store-{n}'}.db"


# kind -> make(directory, n): the n-th fresh store URL of one test.
STORE_KINDS: dict[str, Callable[[Path, int], str]] = {
    "memory": _memory_url,
    "sqlite": _sqlite_url,
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
    make = STORE_KINDS[_store_kind()]
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
