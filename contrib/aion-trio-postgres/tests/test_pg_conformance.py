"""The whole conformance kit against the PostgreSQL store, in its pytest form.

Twice for the event store: opened without a node identity (plain appends)
and with one (every append goes through the claim/fence path of
``aion_append``), so ownership never bends the store contract.  Each scenario
gets a fresh schema, dropped afterwards.  The command inbox is not run here:
the kit's inbox lists every pending command, a cluster node's only those for
the workflows it owns (``tests/test_pg_cluster.py`` covers it).
"""

from __future__ import annotations

import pytest
from aion_trio_postgres import open_postgres_store
from conftest import drop_schema, isolated_opener, new_schema_name

from aion_trio.testing import (
    BulkHistoryReadsSuite,
    EventStoreSuite,
    FlowStoreSuite,
    RecoveryCountsSuite,
    ScheduleStoreSuite,
    VisibilityStoreSuite,
)

pytest_plugins = ["aion_trio.testing.pytest_plugin"]


class TestPostgresEventStore(EventStoreSuite):
    @pytest.fixture
    def open_event_store(self, pg_url: str):  # type: ignore[no-untyped-def]
        return isolated_opener(pg_url)


class TestPostgresEventStoreAsNode(EventStoreSuite):
    @pytest.fixture
    def open_event_store(self, pg_url: str):  # type: ignore[no-untyped-def]
        return isolated_opener(pg_url, node="kit-node")


class TestPostgresVisibilityStore(VisibilityStoreSuite):
    @pytest.fixture
    def open_visibility_store(self, pg_url: str):  # type: ignore[no-untyped-def]
        return isolated_opener(pg_url)


class TestPostgresRecoveryCounts(RecoveryCountsSuite):
    @pytest.fixture
    def open_recovery_counts(self, pg_url: str):  # type: ignore[no-untyped-def]
        """A keyed factory: one schema per key (the same key reopens it), all dropped after."""
        schemas: dict[str, str] = {}

        def open_keyed(key: str):  # type: ignore[no-untyped-def]
            schema = schemas.setdefault(key, new_schema_name())
            return open_postgres_store(f"{pg_url}?schema={schema}")

        yield open_keyed
        for schema in schemas.values():
            drop_schema(pg_url, schema)


class TestPostgresScheduleStore(ScheduleStoreSuite):
    @pytest.fixture
    def open_schedule_store(self, pg_url: str):  # type: ignore[no-untyped-def]
        """A keyed factory as for the recovery counts: one schema per key, all dropped after."""
        schemas: dict[str, str] = {}

        def open_keyed(key: str):  # type: ignore[no-untyped-def]
            schema = schemas.setdefault(key, new_schema_name())
            return open_postgres_store(f"{pg_url}?schema={schema}")

        yield open_keyed
        for schema in schemas.values():
            drop_schema(pg_url, schema)


class TestPostgresFlowStore(FlowStoreSuite):
    @pytest.fixture
    def open_flow_store(self, pg_url: str):  # type: ignore[no-untyped-def]
        """A keyed factory as for the recovery counts: one schema per key, all dropped after."""
        schemas: dict[str, str] = {}

        def open_keyed(key: str):  # type: ignore[no-untyped-def]
            schema = schemas.setdefault(key, new_schema_name())
            return open_postgres_store(f"{pg_url}?schema={schema}")

        yield open_keyed
        for schema in schemas.values():
            drop_schema(pg_url, schema)


class TestPostgresBulkHistoryReads(BulkHistoryReadsSuite):
    @pytest.fixture
    def open_bulk_history_store(self, pg_url: str):  # type: ignore[no-untyped-def]
        """A keyed factory as for the schedules: one schema per key, all dropped after."""
        schemas: dict[str, str] = {}

        def open_keyed(key: str):  # type: ignore[no-untyped-def]
            schema = schemas.setdefault(key, new_schema_name())
            return open_postgres_store(f"{pg_url}?schema={schema}")

        yield open_keyed
        for schema in schemas.values():
            drop_schema(pg_url, schema)
