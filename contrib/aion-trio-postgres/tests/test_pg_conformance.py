"""The whole conformance kit against the PostgreSQL store, in its pytest form.

Twice for the event store: opened without a node identity (plain appends)
and with one (every append goes through the claim/fence path of
``aion_append``), so ownership never bends the store contract.  Each scenario
gets a fresh schema, dropped afterwards.
"""

from __future__ import annotations

import pytest
from conftest import isolated_opener

from aion_trio.testing import EventStoreSuite, VisibilityStoreSuite

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
