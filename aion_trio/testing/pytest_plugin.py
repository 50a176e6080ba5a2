"""pytest plugin for store authors and engine tests.

Enable it with ``pytest_plugins = ["aion_trio.testing.pytest_plugin"]`` (in
the root ``conftest.py`` or a test module) or ``-p
aion_trio.testing.pytest_plugin``.  It provides:

* the marker ``aion_trio_conformance``, put on every test method a suite
  subclass inherits (:class:`~aion_trio.testing.EventStoreSuite`,
  :class:`~aion_trio.testing.VisibilityStoreSuite`, ...; ``-m
  aion_trio_conformance`` selects the kit, ``-m "not ..."`` skips it);
* ``open_event_store`` / ``open_visibility_store`` fallback fixtures that fail
  with instructions when a suite subclass forgot to define its own;
* a Trio runner for the suites' async tests when pytest-trio does not run
  them (no pytest-trio installed, or ``trio_mode`` off: the plugin adds
  ``@pytest.mark.trio`` when pytest-trio is present);
* fixtures: ``memory_event_store_factory`` and
  ``memory_visibility_store_factory`` (factories of fresh ``memory://``
  stores, e.g. as a reference to compare with) and ``flaky_store`` (a
  :class:`~aion_trio.testing.FlakyStore` over a fresh memory event store,
  with ``.inner`` as the oracle; an async fixture, so it needs pytest-trio).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import pytest
import trio

from .._plugins import open_store
from .._store import EventStore, VisibilityStore
from ._flaky import FlakyStore
from ._suite import SUITES

MARKER = "aion_trio_conformance"

_MISSING_FIXTURE = """\
{node} comes from aion_trio.testing.{suite} but no {fixture!r} fixture is defined for it.

Define one on the subclass (or in a conftest.py) that returns a factory: a
zero-argument callable returning an async context manager that yields a fresh,
isolated {protocol} (an opened Store bundle works too), for example:

    class {cls}({suite}):
        @pytest.fixture
        def {fixture}(self, tmp_path):
            counter = itertools.count()
            return lambda: aion_trio.open_store(f"mystore:///{{tmp_path}}/{{next(counter)}}.db")

Each scenario calls the factory once and expects a store nobody else uses."""


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(scenario): a store conformance scenario, a test method of an aion_trio.testing "
        "suite (EventStoreSuite, VisibilityStoreSuite, ...)",
    )


def _kit_test(item: pytest.Item) -> tuple[str, str] | None:
    """``(scenario, factory fixture)`` of a suite's test method, as a subclass inherits it.

    ``None`` for any other test, including a subclass's override of a suite method.
    """
    if not isinstance(item, pytest.Function) or item.cls is None:
        return None
    name = item.function.__name__
    for suite, fixture in SUITES.items():
        if vars(suite).get(name) is item.function:
            return name.removeprefix("test_"), fixture
    return None


def pytest_itemcollected(item: pytest.Item) -> None:
    # Per item, right after collection: before -m deselects by marker.
    found = _kit_test(item)
    if found is None:
        return
    item.add_marker(pytest.mark.aion_trio_conformance(found[0]))
    if item.config.pluginmanager.has_plugin("trio") and item.get_closest_marker("trio") is None:
        item.add_marker(pytest.mark.trio)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    # Only without pytest-trio: with it, the trio marker above hands the
    # async test to pytest-trio (which also resolves async fixtures).
    found = _kit_test(pyfuncitem)
    if found is None or pyfuncitem.get_closest_marker("trio") is not None:
        return None
    trio.run(functools.partial(pyfuncitem.obj, pyfuncitem.funcargs[found[1]]))
    return True


def _missing(request: pytest.FixtureRequest, fixture: str, suite: str, protocol: str) -> None:
    cls = request.cls.__name__ if request.cls is not None else "TestMyStore"
    pytest.fail(
        _MISSING_FIXTURE.format(
            node=request.node.nodeid, suite=suite, fixture=fixture, protocol=protocol, cls=cls
        ),
        pytrace=False,
    )


@pytest.fixture
def open_event_store(request: pytest.FixtureRequest) -> Callable[[], AbstractAsyncContextManager[Any]]:
    """Fallback: a suite subclass must override this with its store's factory."""
    _missing(request, "open_event_store", "EventStoreSuite", "EventStore")
    raise AssertionError("unreachable")  # pragma: no cover


@pytest.fixture
def open_visibility_store(request: pytest.FixtureRequest) -> Callable[[], AbstractAsyncContextManager[Any]]:
    """Fallback: a suite subclass must override this with its store's factory."""
    _missing(request, "open_visibility_store", "VisibilityStoreSuite", "VisibilityStore")
    raise AssertionError("unreachable")  # pragma: no cover


@pytest.fixture
def open_owned_store(request: pytest.FixtureRequest) -> Callable[[str], AbstractAsyncContextManager[Any]]:
    """Fallback: an OwnedStoreSuite subclass must override this with its keyed factory."""
    _missing(request, "open_owned_store", "OwnedStoreSuite", "OwnedStore (keyed: factory(key))")
    raise AssertionError("unreachable")  # pragma: no cover


@pytest.fixture
def open_command_inbox(request: pytest.FixtureRequest) -> Callable[[str], AbstractAsyncContextManager[Any]]:
    """Fallback: a CommandInboxSuite subclass must override this with its keyed factory."""
    _missing(request, "open_command_inbox", "CommandInboxSuite", "CommandInbox (keyed: factory(key))")
    raise AssertionError("unreachable")  # pragma: no cover


@pytest.fixture
def open_recovery_counts(request: pytest.FixtureRequest) -> Callable[[str], AbstractAsyncContextManager[Any]]:
    """Fallback: a RecoveryCountsSuite subclass must override this with its keyed factory."""
    _missing(request, "open_recovery_counts", "RecoveryCountsSuite", "RecoveryCounts (keyed: factory(key))")
    raise AssertionError("unreachable")  # pragma: no cover


@pytest.fixture
def open_schedule_store(request: pytest.FixtureRequest) -> Callable[[str], AbstractAsyncContextManager[Any]]:
    """Fallback: a ScheduleStoreSuite subclass must override this with its keyed factory."""
    _missing(request, "open_schedule_store", "ScheduleStoreSuite", "ScheduleStore (keyed: factory(key))")
    raise AssertionError("unreachable")  # pragma: no cover


@pytest.fixture
def open_flow_store(request: pytest.FixtureRequest) -> Callable[[str], AbstractAsyncContextManager[Any]]:
    """Fallback: a FlowStoreSuite subclass must override this with its keyed factory."""
    _missing(request, "open_flow_store", "FlowStoreSuite", "FlowStore (keyed: factory(key))")
    raise AssertionError("unreachable")  # pragma: no cover


@pytest.fixture
def open_bulk_history_store(
    request: pytest.FixtureRequest,
) -> Callable[[str], AbstractAsyncContextManager[Any]]:
    """Fallback: a BulkHistoryReadsSuite subclass must override this with its keyed factory."""
    _missing(
        request, "open_bulk_history_store", "BulkHistoryReadsSuite", "BulkHistoryReads (keyed: factory(key))"
    )
    raise AssertionError("unreachable")  # pragma: no cover


@contextlib.asynccontextmanager
async def _memory_events() -> AsyncIterator[EventStore]:
    async with open_store("memory://") as store:
        yield store.events


@contextlib.asynccontextmanager
async def _memory_visibility() -> AsyncIterator[VisibilityStore]:
    async with open_store("memory://") as store:
        yield store.visibility


@pytest.fixture
def memory_event_store_factory() -> Callable[[], AbstractAsyncContextManager[EventStore]]:
    """A factory of fresh, private ``memory://`` event stores (the reference implementation)."""
    return _memory_events


@pytest.fixture
def memory_visibility_store_factory() -> Callable[[], AbstractAsyncContextManager[VisibilityStore]]:
    """A factory of fresh, private ``memory://`` visibility stores (the reference implementation)."""
    return _memory_visibility


@pytest.fixture
async def flaky_store() -> AsyncIterator[FlakyStore]:
    """A :class:`FlakyStore` over a fresh memory event store; ``.inner`` is the oracle."""
    async with _memory_events() as inner:
        yield FlakyStore(inner)
