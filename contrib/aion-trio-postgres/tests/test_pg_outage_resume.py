"""Schedules resume by themselves after the database was out of reach (issue 23 item 4, DBOS #139).

One cluster node reaches PostgreSQL through a fault proxy.  A schedule fires
every 250 ms; the proxy then resets every connection and refuses new ones for
three lease TTLs (the database is gone for the node: its lease runs out, the
schedule's claim too), then passes again.  Without a restart the node renews
its lease, claims the schedule back and catches up the ticks missed meanwhile
(inside the catch-up window): checked in SQL through the direct connection,
every tick from the first to the last is started exactly once, including the
outage's, and ticks keep firing after it.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta, timezone

import pytest
import trio
from _faultproxy import ProxyControl
from aion_trio_postgres import PostgresClusterStore, open_postgres_store
from test_pg_cluster import assert_unforked, eventually
from test_pg_schedules import (
    CONFIG,
    INTERVAL,
    assert_each_tick_once_and_none_missing,
    beat,
    nominal,
    started_per_tick,
)

import aion_trio as aion

TTL = 1.0


@pytest.mark.slow
async def test_a_schedule_catches_up_and_goes_on_after_the_database_was_unreachable(
    proxy: ProxyControl, fresh_store_url: Callable[..., str], schema_of: Callable[[str], str], pg_url: str
) -> None:
    direct = fresh_store_url()
    schema = schema_of(direct)
    base, query = direct.split("?", 1)
    async with open_postgres_store(f"{proxy.url(base)}?{query}", node="n1", lease_ttl=TTL) as store:
        assert isinstance(store, PostgresClusterStore)
        async with aion.open_engine(store, workflows=[beat], config=CONFIG) as engine:
            await engine.schedules.create(
                "beat",
                beat,
                "tick",
                interval=INTERVAL,
                catchup_window=timedelta(minutes=5),
                overlap="allow_all",
            )

            async def fired(at_least: int) -> bool:
                return len(await trio.to_thread.run_sync(started_per_tick, pg_url, schema)) >= at_least

            await eventually(lambda: fired(3))
            proxy.refuse()
            proxy.reset()
            cut = datetime.now(timezone.utc)
            before = set(await trio.to_thread.run_sync(started_per_tick, pg_url, schema))
            await trio.sleep(3 * TTL)  # the outage: real time must pass for the lease to run out
            during_outage = set(await trio.to_thread.run_sync(started_per_tick, pg_url, schema))
            proxy.passing()
            healed = datetime.now(timezone.utc)
            assert during_outage == before, "control: the node started ticks while the database was gone"

            async def caught_up() -> bool:
                ticks = await trio.to_thread.run_sync(started_per_tick, pg_url, schema)
                return bool(ticks) and max(nominal(w) for w in ticks) >= healed + 4 * INTERVAL

            await eventually(caught_up, seconds=30)
    ticks = await trio.to_thread.run_sync(started_per_tick, pg_url, schema)
    during = [w for w in ticks if cut + INTERVAL <= nominal(w) < healed]
    assert len(during) >= (3 * TTL) / INTERVAL.total_seconds() - 2, (
        f"the outage's ticks were not caught up: {sorted(during)}"
    )
    await trio.to_thread.run_sync(assert_each_tick_once_and_none_missing, pg_url, schema)
    assert_unforked(pg_url, schema)
