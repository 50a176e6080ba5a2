"""A slow database: 200 ms added to every round trip (issue 23 item 5).

Throughput drops, but no lease is lost spuriously and nothing fails: in
process, a node's lease stays valid through many renewals, each one round
trip (measured here against the renewal budget ``lease_ttl - margin -
renew_every`` the contrib README documents); with real processes, two nodes
behind 200 ms proxies finish every workflow with its result, no workflow is
ever claimed a second time and every invariant holds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import trio
from _faultproxy import ProxyControl, running_proxy
from aion_trio_postgres import open_postgres_store
from partition_scenario import run_slow

LATENCY = 0.2
# The renewal budget at this TTL is 1.4 s: one 0.2 s round trip leaves 1.2 s for the stalls of
# a loaded machine.  At 1.5 s it left 0.5 s, and a two-core machine at a load of 8 (a CI run
# beside a benchmark) stalled longer than that twice in one run: the lease lapsed at 2 looks.
TTL = 3.0


@pytest.fixture
def proxy(pg_url: str) -> Iterator[ProxyControl]:
    hostport = pg_url.split("@", 1)[1].split("/", 1)[0]
    host, _, port = hostport.partition(":")
    with running_proxy(host, int(port or 5432)) as control:
        yield control


@pytest.mark.slow
async def test_a_lease_stays_valid_through_renewals_at_200ms_per_round_trip(
    proxy: ProxyControl, fresh_store_url: Callable[..., str]
) -> None:
    url = fresh_store_url(node="slow", lease_ttl=TTL)
    base, query = url.split("?", 1)
    async with open_postgres_store(url):  # migrated at full speed: the slow opens only check it
        pass
    proxy.passing(latency=LATENCY)
    async with open_postgres_store(f"{proxy.url(base)}?{query}", renew_every=None) as store:
        node = store.node
        assert node is not None
        took = []
        for _ in range(3):
            began = time.monotonic()
            await store.renew_lease()
            took.append(time.monotonic() - began)
        # One round trip per renewal, far inside the budget TTL - margin - TTL/3.
        budget = TTL - node.margin() - TTL / 3
        assert all(LATENCY <= t < budget for t in took), (took, budget)
    # Now with the store's own heartbeat: valid at every look for two TTLs (six renewals).
    async with open_postgres_store(f"{proxy.url(base)}?{query}") as store:
        lapses = 0
        end = time.monotonic() + 2 * TTL
        while time.monotonic() < end:
            lapses += not store.lease_valid()
            await trio.sleep(0.05)
        assert lapses == 0


@pytest.mark.slow
def test_two_nodes_at_200ms_per_round_trip_finish_everything_and_lose_no_lease(
    fresh_store_url: Callable[..., str], schema_of: Callable[[str], str], tmp_path: Path
) -> None:
    url = fresh_store_url()

    async def migrate() -> None:
        async with open_postgres_store(url):
            pass

    trio.run(migrate)
    outcome = run_slow(url.split("?", 1)[0], schema_of(url), tmp_path, latency=LATENCY, ttl=2.0)
    assert outcome.problems == [], "\n".join(outcome.problems[:30])
    assert outcome.taken_over == 0, outcome
    assert outcome.relinquished == 0, outcome
    print(f"finished in {outcome.seconds:.1f}s at {LATENCY * 1000:.0f} ms per round trip")
