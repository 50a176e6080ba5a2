"""Schedules and workflow queues resume by themselves after the database was out of reach
(issue 23 item 4, DBOS #139).

One cluster node reaches PostgreSQL through a fault proxy, which resets every
connection and refuses new ones for three lease TTLs (the database is gone
for the node: its lease runs out, a schedule's claim too), then passes again.
Without a restart:

* a schedule firing every 250 ms is claimed back and catches up the ticks
  missed meanwhile (inside the catch-up window): checked in SQL through the
  direct connection, every tick from the first to the last is started exactly
  once, including the outage's, and ticks keep firing after it;
* a workflow queue cut off mid-way admits the rest: every queued run finishes,
  each started once.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta, timezone

import attrs
import pytest
import trio
from _faultproxy import ProxyControl
from aion_trio_postgres import PostgresClusterStore, open_postgres_store
from test_pg_cluster import assert_unforked, eventually, sql_async
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


@aion.workflow
async def paced(ctx: aion.WorkflowContext, n: int) -> int:
    await ctx.sleep(0.2)
    return n


@pytest.mark.slow
async def test_a_workflow_queue_drains_after_the_database_was_unreachable(
    proxy: ProxyControl, fresh_store_url: Callable[..., str], schema_of: Callable[[str], str], pg_url: str
) -> None:
    """Twelve runs queued two at a time; the database goes away for three lease TTLs mid-way
    and comes back: without a restart the queue admits the rest and every run finishes once
    (DBOS #139's failure was queued work that never resumed after an outage)."""
    direct = fresh_store_url()
    schema = schema_of(direct)
    base, query = direct.split("?", 1)
    config = attrs.evolve(
        CONFIG, workflow_queues={"batch": aion.FlowLimit(concurrency=2)}, queue_poll_interval=0.1
    )
    async with open_postgres_store(f"{proxy.url(base)}?{query}", node="n1", lease_ttl=TTL) as store:
        assert isinstance(store, PostgresClusterStore)
        async with aion.open_engine(store, workflows=[paced], config=config) as engine:
            handles = [await engine.enqueue(paced, n, queue="batch", workflow_id=f"q-{n}") for n in range(12)]

            async def completed() -> int:
                rows = await sql_async(
                    pg_url,
                    schema,
                    "SELECT count(*) FROM workflows WHERE workflow_id LIKE 'q-%%' AND status = 'completed'",
                )
                return int(rows[0][0])

            await eventually(lambda: _at_least(completed, 2))
            proxy.refuse()
            proxy.reset()
            before = await completed()
            await trio.sleep(3 * TTL)  # the outage: real time must pass for the lease to run out
            assert await completed() == before, "control: runs finished while the database was gone"
            assert before < 12, "control: the queue had work left when the database went away"
            proxy.passing()
            with trio.fail_after(60):
                results = [await handle.result() for handle in handles]
    assert results == list(range(12))
    left = await sql_async(pg_url, schema, "SELECT count(*) FROM workflows WHERE status <> 'completed'")
    assert left == [(0,)]
    started = await sql_async(
        pg_url,
        schema,
        "SELECT workflow_id, count(*) FROM events WHERE type = 'WorkflowStarted' GROUP BY 1 HAVING count(*) <> 1",
    )
    assert started == [], f"runs started more than once: {started}"
    assert_unforked(pg_url, schema)


async def _at_least(count: Callable[[], Awaitable[int]], n: int) -> bool:
    return await count() >= n
