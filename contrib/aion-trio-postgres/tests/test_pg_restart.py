"""The database stopped and restarted under a running cluster (issue 23 item 4; DBOS #716, #804).

A PostgreSQL server of the test's own (``_ownserver.py``: its own data
directory and port, never the shared server) holds the store; three node
processes run ``spans`` workflows on it (activities logging to the shared
server, so the outage fails no side effect).  The server is stopped
(``pg_ctl -m fast``: every session ends) for longer than the lease TTL and
started again: every node resumes by itself, without a restart, nothing is
stranded running, every workflow finishes with its result, and every
history invariant holds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import trio
from _ownserver import OwnServer, require_binaries
from aion_trio_postgres import open_postgres_store
from partition_scenario import run_restart

TTL = 2.0


@pytest.fixture
def own_server() -> Iterator[OwnServer]:
    require_binaries()
    server = OwnServer()
    try:
        server.start()
        yield server
    finally:
        server.destroy()


@pytest.mark.slow
def test_every_node_resumes_by_itself_after_the_database_restarts(
    own_server: OwnServer,
    fresh_store_url: Callable[..., str],
    schema_of: Callable[[str], str],
    tmp_path: Path,
) -> None:
    side = fresh_store_url()  # the span log's schema, on the shared server
    schema = schema_of(side)

    async def migrate() -> None:
        async with open_postgres_store(f"{own_server.url}?schema={schema}"):
            pass

    trio.run(migrate)
    outcome = run_restart(
        own_server, side.split("?", 1)[0], schema, tmp_path / "run", outage=2.5 * TTL, ttl=TTL
    )
    assert outcome.problems == [], "\n".join(outcome.problems[:30])
    print(
        f"every node resumed {outcome.nodes_resumed:.2f}s and every workflow finished "
        f"{outcome.resumed:.2f}s after the restart"
    )
