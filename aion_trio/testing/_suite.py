"""pytest mixin classes: one test method per conformance scenario.

They import nothing from pytest (so ``aion_trio.testing`` imports without it);
``aion_trio.testing.pytest_plugin`` supplies the fallback fixtures, the marker
and the Trio runner glue.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from . import (
    _control_scenarios as _control_scenarios,
    _event_scenarios as _event_scenarios,
    _visibility_scenarios as _visibility_scenarios,
)
from ._kit import (
    EVENT_REGISTRY,
    INBOX_REGISTRY,
    OWNER_REGISTRY,
    RECOVERY_REGISTRY,
    VISIBILITY_REGISTRY,
    OpenKeyedStore,
    OpenStore,
    Scenario,
    run_scenario,
)

SCENARIO_ATTRIBUTE = "_aion_trio_scenario"
FIXTURE_ATTRIBUTE = "_aion_trio_fixture"


def _event_test(found: Scenario) -> Callable[..., Awaitable[None]]:
    # The parameter name is the fixture pytest injects, so it is spelled out.
    async def test(self: Any, open_event_store: OpenStore) -> None:
        __tracebackhide__ = True
        await run_scenario(found, open_event_store)

    setattr(test, FIXTURE_ATTRIBUTE, "open_event_store")
    return test


def _visibility_test(found: Scenario) -> Callable[..., Awaitable[None]]:
    async def test(self: Any, open_visibility_store: OpenStore) -> None:
        __tracebackhide__ = True
        await run_scenario(found, open_visibility_store)

    setattr(test, FIXTURE_ATTRIBUTE, "open_visibility_store")
    return test


def _owned_test(found: Scenario) -> Callable[..., Awaitable[None]]:
    async def test(self: Any, open_owned_store: OpenKeyedStore) -> None:
        __tracebackhide__ = True
        await run_scenario(found, open_owned_store)

    setattr(test, FIXTURE_ATTRIBUTE, "open_owned_store")
    return test


def _inbox_test(found: Scenario) -> Callable[..., Awaitable[None]]:
    async def test(self: Any, open_command_inbox: OpenKeyedStore) -> None:
        __tracebackhide__ = True
        await run_scenario(found, open_command_inbox)

    setattr(test, FIXTURE_ATTRIBUTE, "open_command_inbox")
    return test


def _recoveries_test(found: Scenario) -> Callable[..., Awaitable[None]]:
    async def test(self: Any, open_recovery_counts: OpenKeyedStore) -> None:
        __tracebackhide__ = True
        await run_scenario(found, open_recovery_counts)

    setattr(test, FIXTURE_ATTRIBUTE, "open_recovery_counts")
    return test


def _install(
    cls: type, registry: dict[str, Scenario], make: Callable[[Scenario], Callable[..., Any]]
) -> None:
    for found in registry.values():
        test = make(found)
        test.__name__ = f"test_{found.name}"
        test.__qualname__ = f"{cls.__qualname__}.test_{found.name}"
        test.__doc__ = found.doc
        test.__module__ = cls.__module__
        setattr(test, SCENARIO_ATTRIBUTE, found.name)
        setattr(cls, test.__name__, test)


class EventStoreSuite:
    """Mixin: every event-store conformance scenario as a ``test_<scenario>`` method.

    Subclass it in a test module named ``Test...``, enable the plugin and
    provide an ``open_event_store`` fixture returning the factory (a
    zero-argument callable returning an async context manager that yields a
    fresh, isolated :class:`~aion_trio.EventStore`, or a ``Store`` bundle)::

        pytest_plugins = ["aion_trio.testing.pytest_plugin"]

        class TestMyEventStore(EventStoreSuite):
            @pytest.fixture
            def open_event_store(self, tmp_path):
                return lambda: open_my_store(tmp_path / f"{uuid.uuid4()}.db")

    The test methods are async: run them with pytest-trio (``trio_mode =
    true``); without pytest-trio the plugin runs them with ``trio.run``.
    """


class VisibilityStoreSuite:
    """Mixin: every visibility-store conformance scenario as a ``test_<scenario>`` method.

    Same use as :class:`EventStoreSuite`, with an ``open_visibility_store``
    fixture whose factory yields a fresh :class:`~aion_trio.VisibilityStore`
    (or a ``Store`` bundle).
    """


class OwnedStoreSuite:
    """Mixin: every ownership scenario (:data:`~aion_trio.testing.OWNED_STORE_SCENARIOS`) as a
    ``test_<scenario>`` method, for stores with the optional :class:`~aion_trio.OwnedStore`
    capability.

    Provide an ``open_owned_store`` fixture returning a *keyed* factory
    (``factory(key)``: the same key opens the same store again, see
    :func:`~aion_trio.testing.check_owned_store`)::

        class TestMyOwnership(OwnedStoreSuite):
            @pytest.fixture
            def open_owned_store(self, tmp_path):
                return lambda key: aion_trio.open_store(f"mystore:///{tmp_path}/{key}.db")
    """


class CommandInboxSuite:
    """Mixin: every command-inbox scenario (:data:`~aion_trio.testing.COMMAND_INBOX_SCENARIOS`)
    as a ``test_<scenario>`` method, with an ``open_command_inbox`` keyed-factory fixture
    (as for :class:`OwnedStoreSuite`)."""


class RecoveryCountsSuite:
    """Mixin: every recovery-count scenario (:data:`~aion_trio.testing.RECOVERY_COUNTS_SCENARIOS`)
    as a ``test_<scenario>`` method, with an ``open_recovery_counts`` keyed-factory fixture
    (as for :class:`OwnedStoreSuite`)."""


_install(EventStoreSuite, EVENT_REGISTRY, _event_test)
_install(VisibilityStoreSuite, VISIBILITY_REGISTRY, _visibility_test)
_install(OwnedStoreSuite, OWNER_REGISTRY, _owned_test)
_install(CommandInboxSuite, INBOX_REGISTRY, _inbox_test)
_install(RecoveryCountsSuite, RECOVERY_REGISTRY, _recoveries_test)
