"""The store conformance kit and test helpers (docs/writing-a-store-plugin.md).

A store author proves a store correct without reading aion_trio's tests:

* pytest-free, from any Trio code::

      await aion_trio.testing.check_event_store(open_events)
      await aion_trio.testing.check_visibility_store(open_visibility)

  where each argument is a zero-argument callable returning an async context
  manager that yields a fresh, isolated store (or an opened ``Store`` bundle).

* stores with the optional ownership and inbox capabilities
  also run ``check_owned_store(open_keyed)`` and ``check_command_inbox(open_keyed)``,
  whose factory takes a key (the same key reopens the same store), and those
  with :class:`~aion_trio.RecoveryCounts` ``check_recovery_counts(open_keyed)``, and
  those with :class:`~aion_trio.ScheduleStore` ``check_schedule_store(open_keyed)``;
  those with :class:`~aion_trio.FlowStore` ``check_flow_store(open_keyed)``, and
  those with :class:`~aion_trio.BulkHistoryReads` ``check_bulk_history_reads(open_keyed)``;

* with pytest: subclass :class:`EventStoreSuite` / :class:`VisibilityStoreSuite`
  (and :class:`OwnedStoreSuite` / :class:`CommandInboxSuite` /
  :class:`RecoveryCountsSuite` / :class:`ScheduleStoreSuite` / :class:`BulkHistoryReadsSuite`), whose ``test_<scenario>`` methods are the
  scenarios (the checkers above run the same methods), provide the factory
  as a fixture and enable the plugin with
  ``pytest_plugins = ["aion_trio.testing.pytest_plugin"]``.

:class:`FlakyStore` and friends wrap a store and inject faults for engine
tests.  :func:`replay` replays recorded histories against the current
workflow code and reports, per run, a match or the first divergence
(docs/testing.md).  Importing this package does not import pytest.
"""

from __future__ import annotations

from ._checks import (
    BULK_HISTORY_READS_SCENARIOS as BULK_HISTORY_READS_SCENARIOS,
    COMMAND_INBOX_SCENARIOS as COMMAND_INBOX_SCENARIOS,
    EVENT_STORE_SCENARIOS as EVENT_STORE_SCENARIOS,
    FLOW_STORE_SCENARIOS as FLOW_STORE_SCENARIOS,
    OWNED_STORE_SCENARIOS as OWNED_STORE_SCENARIOS,
    RECOVERY_COUNTS_SCENARIOS as RECOVERY_COUNTS_SCENARIOS,
    SCHEDULE_STORE_SCENARIOS as SCHEDULE_STORE_SCENARIOS,
    VISIBILITY_STORE_SCENARIOS as VISIBILITY_STORE_SCENARIOS,
    check_bulk_history_reads as check_bulk_history_reads,
    check_command_inbox as check_command_inbox,
    check_event_store as check_event_store,
    check_flow_store as check_flow_store,
    check_owned_store as check_owned_store,
    check_recovery_counts as check_recovery_counts,
    check_schedule_store as check_schedule_store,
    check_visibility_store as check_visibility_store,
)
from ._flaky import (
    FlakyStore as FlakyStore,
    FlakyStoreBundle as FlakyStoreBundle,
    FlakyVisibilityStore as FlakyVisibilityStore,
)
from ._kit import ConformanceError as ConformanceError
from ._replayer import (
    History as History,
    ReplayReport as ReplayReport,
    ReplayResult as ReplayResult,
    read_histories as read_histories,
    replay as replay,
)
from ._suite import (
    BulkHistoryReadsSuite as BulkHistoryReadsSuite,
    CommandInboxSuite as CommandInboxSuite,
    EventStoreSuite as EventStoreSuite,
    FlowStoreSuite as FlowStoreSuite,
    OwnedStoreSuite as OwnedStoreSuite,
    RecoveryCountsSuite as RecoveryCountsSuite,
    ScheduleStoreSuite as ScheduleStoreSuite,
    VisibilityStoreSuite as VisibilityStoreSuite,
)


def _fixup_module_metadata() -> None:
    # Tracebacks and reprs say aion_trio.testing.FlakyStore, not the private module.
    for name, obj in globals().items():
        if not name.startswith("_") and getattr(obj, "__module__", "").startswith(__name__ + "._"):
            obj.__module__ = __name__


_fixup_module_metadata()
del _fixup_module_metadata
