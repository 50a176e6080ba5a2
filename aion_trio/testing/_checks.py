"""The pytest-free entry points: ``await check_event_store(open_store)`` and friends.

Each runs the test methods of its suite (:class:`~aion_trio.testing.EventStoreSuite`, ...):
the same scenarios, in the same order, as the pytest form.
"""

from __future__ import annotations

from collections.abc import Iterable

from ._kit import OpenKeyedStore, OpenStore, select
from ._suite import (
    BulkHistoryReadsSuite,
    CommandInboxSuite,
    EventStoreSuite,
    FlowStoreSuite,
    OwnedStoreSuite,
    RecoveryCountsSuite,
    ScheduleStoreSuite,
    VisibilityStoreSuite,
    scenario_names,
)

EVENT_STORE_SCENARIOS: tuple[str, ...] = scenario_names(EventStoreSuite)
"""Names of the event-store scenarios, in the order :func:`check_event_store` runs them."""

VISIBILITY_STORE_SCENARIOS: tuple[str, ...] = scenario_names(VisibilityStoreSuite)
"""Names of the visibility-store scenarios, in the order :func:`check_visibility_store` runs them."""

OWNED_STORE_SCENARIOS: tuple[str, ...] = scenario_names(OwnedStoreSuite)
"""Names of the ownership scenarios, in the order :func:`check_owned_store` runs them."""

COMMAND_INBOX_SCENARIOS: tuple[str, ...] = scenario_names(CommandInboxSuite)
"""Names of the command-inbox scenarios, in the order :func:`check_command_inbox` runs them."""

RECOVERY_COUNTS_SCENARIOS: tuple[str, ...] = scenario_names(RecoveryCountsSuite)
"""Names of the recovery-count scenarios, in the order :func:`check_recovery_counts` runs them."""

SCHEDULE_STORE_SCENARIOS: tuple[str, ...] = scenario_names(ScheduleStoreSuite)
"""Names of the schedule-store scenarios, in the order :func:`check_schedule_store` runs them."""

FLOW_STORE_SCENARIOS: tuple[str, ...] = scenario_names(FlowStoreSuite)
"""Names of the flow-store scenarios, in the order :func:`check_flow_store` runs them."""
BULK_HISTORY_READS_SCENARIOS: tuple[str, ...] = scenario_names(BulkHistoryReadsSuite)
"""Names of the bulk-history-read scenarios, in the order :func:`check_bulk_history_reads` runs them."""


async def _run_suite(
    suite: type, known: tuple[str, ...], open_store: object, scenarios: Iterable[str] | None, what: str
) -> None:
    tests = suite()
    for name in select(known, scenarios, what):
        await getattr(tests, f"test_{name}")(open_store)


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
    await _run_suite(EventStoreSuite, EVENT_STORE_SCENARIOS, open_store, scenarios, "event store")


async def check_visibility_store(open_store: OpenStore, *, scenarios: Iterable[str] | None = None) -> None:
    """Check that a visibility store keeps the :class:`~aion_trio.VisibilityStore` contract.

    Like :func:`check_event_store`; the factory yields a fresh visibility
    store (or a ``Store`` bundle, whose ``.visibility`` is used), and
    ``scenarios`` selects from :data:`VISIBILITY_STORE_SCENARIOS`.  The
    reference semantics for ``list``/``count`` are
    :meth:`aion_trio.VisibilityFilter.apply` and ``.matches``.
    """
    await _run_suite(
        VisibilityStoreSuite, VISIBILITY_STORE_SCENARIOS, open_store, scenarios, "visibility store"
    )


async def check_owned_store(open_store: OpenKeyedStore, *, scenarios: Iterable[str] | None = None) -> None:
    """Check that a store keeps the optional :class:`~aion_trio.OwnedStore` contract.

    ``open_store`` is a *keyed* factory: ``open_store(key)`` returns an async
    context manager yielding a store object with the ownership methods (the
    object the store plugin's opener yields); the same ``key`` must open the
    same store again, at the same time (several handles, e.g. several
    connections to one database file) or after it was closed, and a new key
    a fresh, empty store.  The kit makes every key unique per scenario run.
    ``scenarios`` selects from :data:`OWNED_STORE_SCENARIOS`.

    The scenarios pass their own ``now`` to every call, so nothing depends on
    the wall clock; "dead owner" scenarios use a pid no process has on this
    host, and "stale heartbeat" ones an owner on a host named
    ``elsewhere.invalid``.  Raises :class:`ConformanceError` for the first
    scenario that fails.
    """
    await _run_suite(OwnedStoreSuite, OWNED_STORE_SCENARIOS, open_store, scenarios, "owned store")


async def check_command_inbox(open_store: OpenKeyedStore, *, scenarios: Iterable[str] | None = None) -> None:
    """Check that a store keeps the optional :class:`~aion_trio.CommandInbox` contract.

    ``open_store`` is a keyed factory as for :func:`check_owned_store`;
    ``scenarios`` selects from :data:`COMMAND_INBOX_SCENARIOS`.
    """
    await _run_suite(CommandInboxSuite, COMMAND_INBOX_SCENARIOS, open_store, scenarios, "command inbox")


async def check_recovery_counts(
    open_store: OpenKeyedStore, *, scenarios: Iterable[str] | None = None
) -> None:
    """Check that a store keeps the optional :class:`~aion_trio.RecoveryCounts` contract.

    ``open_store`` is a keyed factory as for :func:`check_owned_store`;
    ``scenarios`` selects from :data:`RECOVERY_COUNTS_SCENARIOS`.
    """
    await _run_suite(RecoveryCountsSuite, RECOVERY_COUNTS_SCENARIOS, open_store, scenarios, "recovery counts")


async def check_schedule_store(open_store: OpenKeyedStore, *, scenarios: Iterable[str] | None = None) -> None:
    """Check that a store keeps the optional :class:`~aion_trio.ScheduleStore` contract.

    ``open_store`` is a keyed factory as for :func:`check_owned_store`;
    ``scenarios`` selects from :data:`SCHEDULE_STORE_SCENARIOS`.
    """
    await _run_suite(ScheduleStoreSuite, SCHEDULE_STORE_SCENARIOS, open_store, scenarios, "schedule store")


async def check_flow_store(open_store: OpenKeyedStore, *, scenarios: Iterable[str] | None = None) -> None:
    """Check that a store keeps the optional :class:`~aion_trio.FlowStore` contract.

    ``open_store`` is a keyed factory as for :func:`check_owned_store`;
    ``scenarios`` selects from :data:`FLOW_STORE_SCENARIOS`.
    """
    await _run_suite(FlowStoreSuite, FLOW_STORE_SCENARIOS, open_store, scenarios, "flow store")


async def check_bulk_history_reads(
    open_store: OpenKeyedStore, *, scenarios: Iterable[str] | None = None
) -> None:
    """Check that a store keeps the optional :class:`~aion_trio.BulkHistoryReads` contract.

    ``open_store`` is a keyed factory as for :func:`check_owned_store`, yielding the
    store bundle (its ``events`` write the histories the scenarios read back);
    ``scenarios`` selects from :data:`BULK_HISTORY_READS_SCENARIOS`.
    """
    await _run_suite(
        BulkHistoryReadsSuite, BULK_HISTORY_READS_SCENARIOS, open_store, scenarios, "bulk history reads"
    )
