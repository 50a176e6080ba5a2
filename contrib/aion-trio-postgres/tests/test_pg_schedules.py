"""Durable schedules on PostgreSQL with several engines: each tick starts exactly one run.

Three in-process engines with different node ids share one schema.  One of
them claims the schedule (its claim is part of the schedule's state, written
by compare-and-set) and fires it; when that node leaves, another takes the
claim over once it expired and catches up the ticks missed meanwhile.  The
invariants are checked in SQL: one ``WorkflowStarted`` per tick, and no tick
missing between the first and the last.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable
from datetime import datetime, timedelta

import trio
from aion_trio_postgres import PostgresClusterStore, open_postgres_store
from test_pg_cluster import assert_unforked, eventually, sql, sql_async

import aion_trio as aion
from aion_trio import EngineConfig

INTERVAL = timedelta(milliseconds=250)
CONFIG = EngineConfig(
    sweep_interval=0.1,
    remote_command_timeout=10.0,
    schedule_poll_interval=0.05,
    schedule_claim_ttl=1.0,
    loop_stall_warning=None,
)


@aion.workflow
async def beat(ctx: aion.WorkflowContext, label: str) -> str:
    return label


@contextlib.asynccontextmanager
async def node(url: str, name: str) -> AsyncIterator[aion.Engine]:
    async with open_postgres_store(url, node=name, lease_ttl=1.0) as store:
        assert isinstance(store, PostgresClusterStore)
        async with aion.open_engine(store, workflows=[beat], config=CONFIG) as engine:
            yield engine


def started_per_tick(url: str, schema: str) -> dict[str, int]:
    rows = sql(
        url,
        schema,
        "SELECT workflow_id, count(*) FROM events WHERE type = 'WorkflowStarted' AND workflow_id LIKE %s"
        " GROUP BY workflow_id",
        ("beat@%",),
    )
    return {workflow_id: int(count) for workflow_id, count in rows}


def nominal(workflow_id: str) -> datetime:
    return datetime.fromisoformat(workflow_id.split("@")[1].replace("Z", "+00:00"))


def assert_each_tick_once_and_none_missing(url: str, schema: str) -> int:
    counts = started_per_tick(url, schema)
    assert counts, "control: the schedule fired"
    doubled = {w: c for w, c in counts.items() if c != 1}
    assert not doubled, f"ticks started more than once: {doubled}"
    per_tick: dict[datetime, list[str]] = {}
    for workflow_id in counts:
        per_tick.setdefault(nominal(workflow_id), []).append(workflow_id)
    twice = {t: ids for t, ids in per_tick.items() if len(ids) != 1}
    assert not twice, f"ticks with more than one run: {twice}"
    times = sorted(per_tick)
    expected = [times[0] + k * INTERVAL for k in range(round((times[-1] - times[0]) / INTERVAL) + 1)]
    missing = sorted(set(expected) - set(times))
    assert not missing, f"ticks never started: {missing}"
    return len(times)


async def claimed_by(url: str, schema: str) -> str | None:
    rows = await sql_async(url, schema, "SELECT data FROM schedules WHERE schedule_id = 'beat'")
    if not rows:
        return None
    claimed = json.loads(rows[0][0])["state"]["claimed_by"]
    return None if claimed is None else str(claimed)


async def test_three_engines_start_each_tick_exactly_once_through_the_claim_holder_leaving(
    fresh_store_url: Callable[..., str], schema_of: Callable[[str], str], pg_url: str
) -> None:
    url = fresh_store_url()
    schema = schema_of(url)

    async def count() -> int:
        return len(await trio.to_thread.run_sync(started_per_tick, pg_url, schema))

    engines: dict[str, aion.Engine] = {}
    leave = {name: trio.Event() for name in ("a", "b", "c")}

    async def run_node(name: str, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with node(url, name) as engine:
            engines[name] = engine
            task_status.started()
            await leave[name].wait()
            del engines[name]

    async def at_least(n: int) -> bool:
        return await count() >= n

    async with trio.open_nursery() as nursery:
        for name in leave:
            await nursery.start(run_node, name)
        await engines["a"].schedules.create(
            "beat", beat, "x", interval=INTERVAL, overlap="allow_all", catchup_window=timedelta(minutes=5)
        )
        await eventually(lambda: at_least(6), 20)
        holder = await claimed_by(pg_url, schema)
        assert holder in leave, holder
        # The node holding the claim leaves mid-schedule; another takes the claim over once
        # it expired (schedule_claim_ttl) and catches up the ticks missed meanwhile.
        leave[holder].set()
        before = await count()
        await eventually(lambda: at_least(before + 8), 30)
        successor = await claimed_by(pg_url, schema)
        assert successor in engines, (holder, successor)
        assert successor != holder
        for event in leave.values():
            event.set()
    total = assert_each_tick_once_and_none_missing(pg_url, schema)
    assert total >= 14
    assert_unforked(pg_url, schema)
