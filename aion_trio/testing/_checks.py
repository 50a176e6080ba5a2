"""The pytest-free entry points: ``await check_event_store(open_store)`` and friends."""

from __future__ import annotations

from collections.abc import Iterable

from . import _event_scenarios as _event_scenarios, _visibility_scenarios as _visibility_scenarios
from ._kit import EVENT_REGISTRY, VISIBILITY_REGISTRY, OpenStore, run_scenario, select

EVENT_STORE_SCENARIOS: tuple[str, ...] = tuple(EVENT_REGISTRY)
"""Names of the event-store scenarios, in the order :func:`check_event_store` runs them."""

VISIBILITY_STORE_SCENARIOS: tuple[str, ...] = tuple(VISIBILITY_REGISTRY)
"""Names of the visibility-store scenarios, in the order :func:`check_visibility_store` runs them."""


async def check_event_store(open_store: OpenStore, *, scenarios: Iterable[str] | None = None) -> None:
    """Check that an event store keeps the :class:`~aion_trio.EventStore` contract.

    ``open_store`` is a zero-argument callable returning an async context
    manager that yields a fresh, isolated event store (or an opened ``Store``
    bundle, whose ``.events`` is used); it is called once per scenario, and
    the context is left (closing the store) when the scenario ends.
    ``scenarios`` selects scenarios by name (see
    :data:`EVENT_STORE_SCENARIOS`); by default all run, in order.

    Raises :class:`ConformanceError` for the first scenario that fails,
    naming it and what was observed versus expected.  Needs no pytest: call
    it from any Trio test or script.  The scenarios never sleep and never read
    the wall clock except to bound the large-history scenario's duration, so
    they also run under ``trio.testing.MockClock``.
    """
    for found in select(EVENT_REGISTRY, scenarios, "event store"):
        await run_scenario(found, open_store)


async def check_visibility_store(open_store: OpenStore, *, scenarios: Iterable[str] | None = None) -> None:
    """Check that a visibility store keeps the :class:`~aion_trio.VisibilityStore` contract.

    Like :func:`check_event_store`; the factory yields a fresh visibility
    store (or a ``Store`` bundle, whose ``.visibility`` is used), and
    ``scenarios`` selects from :data:`VISIBILITY_STORE_SCENARIOS`.  The
    reference semantics for ``list``/``count`` are
    :meth:`aion_trio.VisibilityFilter.apply` and ``.matches``.
    """
    for found in select(VISIBILITY_REGISTRY, scenarios, "visibility store"):
        await run_scenario(found, open_store)
