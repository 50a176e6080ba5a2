"""Waiting for a flow-control slot is visible from PostgreSQL (issue 18): ``aion-trio
show`` reading the database reports the attempt that waits, its pool, since when and
its priority, and stops once the attempt runs; a record its engine stopped renewing
(the engine died) lapses; schema 10 adds the records to a schema-9 database."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import attrs
import pytest
import trio
from aion_trio_postgres import _schema, open_postgres_store
from click.testing import CliRunner

import aion_trio as aion
from aion_trio import _cli

#: The tags of the attempts that began, in order; ``begun[i]`` is set when the i-th began.
began: list[str] = []
begun: list[trio.Event] = []
release: dict[str, trio.Event] = {}


@aion.activity(priority=2)
async def pg_slow(tag: str) -> str:
    began.append(tag)
    begun[len(began) - 1].set()
    await release[tag].wait()
    return tag


@aion.workflow
async def pg_two_slow(ctx: aion.WorkflowContext) -> list[str]:
    first = ctx.start(pg_slow, "first")
    second = ctx.start(pg_slow, "second")
    return [await first, await second]


@pytest.fixture(autouse=True)
def fresh_events() -> None:
    began.clear()
    begun[:] = [trio.Event(), trio.Event()]
    for tag in ("first", "second"):
        release[tag] = trio.Event()


def _show(url: str) -> dict[str, Any]:
    try:
        runner = CliRunner(mix_stderr=False)  # type: ignore[call-arg,unused-ignore]
    except TypeError:  # click >= 8.2 keeps stdout and stderr apart anyway
        runner = CliRunner()
    result = runner.invoke(_cli.cli, ["show", "--store", url, "fw", "--json"], prog_name="aion-trio")
    assert result.exit_code == 0, (result.stdout, result.stderr)
    data: dict[str, Any] = json.loads(result.stdout)
    return data


async def show_waits(url: str) -> dict[int, Any]:
    """activity id -> its slot wait as ``show --json`` (in a thread: it runs its own loop) reports it."""
    data = await trio.to_thread.run_sync(_show, url)
    assert data["slot_waits_known"] is True
    return {a["activity_id"]: a["slot_wait"] for a in data["pending_activities"]}


async def until_recorded(engine: aion.Engine, store: Any) -> None:
    """Until a wait of ``fw`` is recorded and both activities are in its history (bounded by the caller)."""
    while not await store.flow_waiters("fw", now=datetime.now(timezone.utc)):  # noqa: ASYNC110
        await trio.sleep(0.01)
    while len((await engine.describe("fw")).pending_activities) != 2:  # noqa: ASYNC110
        await trio.sleep(0.01)


async def test_show_reports_the_wait_from_postgresql_until_the_attempt_runs(
    fresh_store_url: Callable[..., str],
) -> None:
    url = fresh_store_url()
    config = aion.EngineConfig(activity_limits={"pg_slow": aion.FlowLimit(concurrency=1)})
    with trio.fail_after(60):
        async with (
            open_postgres_store(url) as store,
            aion.open_engine(store, workflows=[pg_two_slow], activities=[pg_slow], config=config) as engine,
        ):
            run = await engine.start(pg_two_slow, workflow_id="fw")
            await begun[0].wait()
            await until_recorded(engine, store)
            description = await engine.describe("fw")
            [waiting_id] = [p.activity_id for p in description.pending_activities if p.waiting_for]

            reported = await show_waits(url)
            wait = reported.pop(waiting_id)
            assert list(reported.values()) == [None], "the running attempt does not wait"
            assert (wait["pool"], wait["limit"], wait["priority"], wait["attempt"]) == (
                "activity:pg_slow",
                "concurrency=1",
                2,
                1,
            )

            release[began[0]].set()
            await begun[1].wait()
            # The record is removed in the background once the attempt has its slot.
            while await store.flow_waiters("fw", now=datetime.now(timezone.utc)):  # noqa: ASYNC110
                await trio.sleep(0.01)
            assert await show_waits(url) == {waiting_id: None}
            release[began[1]].set()
            await run.result()


async def test_a_record_its_engine_stopped_renewing_lapses(fresh_store_url: Callable[..., str]) -> None:
    url = fresh_store_url()
    config = aion.EngineConfig(activity_limits={"pg_slow": aion.FlowLimit(concurrency=1)})
    with trio.fail_after(60):
        async with (
            open_postgres_store(url) as store,
            aion.open_engine(store, workflows=[pg_two_slow], activities=[pg_slow], config=config) as engine,
        ):
            await engine.start(pg_two_slow, workflow_id="fw")
            await begun[0].wait()
            await until_recorded(engine, store)
            [waiter] = await store.flow_waiters("fw", now=datetime.now(timezone.utc))
            # As a node that died an hour ago would have left it: never renewed since.
            await store.record_flow_waiter(
                attrs.evolve(waiter, holder="dead-node"),
                ttl=30.0,
                now=datetime.now(timezone.utc) - timedelta(hours=1),
            )
            assert list((await show_waits(url)).values()) == [None, None]
            release[began[0]].set()
            await begun[1].wait()
            release[began[1]].set()


async def test_schema_10_adds_the_records_to_a_schema_9_database(
    fresh_store_url: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    url = fresh_store_url()
    now = datetime(2041, 5, 6, 7, 8, 9, tzinfo=timezone.utc)
    with monkeypatch.context() as old:
        old.setattr(_schema, "MIGRATIONS", _schema.MIGRATIONS[:9])
        old.setattr(_schema, "SCHEMA_VERSION", 9)
        async with open_postgres_store(url) as store:
            grant = await store.acquire_flow_permit(
                "k", holder="h", concurrency=1, rate=None, period=1.0, ttl=60.0, now=now
            )
            assert grant.granted
    async with open_postgres_store(url) as store:
        assert await store.held_flow_permits("k", now=now) == 1
        waiter = aion.FlowWaiter(
            workflow_id="wf",
            run_id="r",
            activity_id=0,
            attempt=1,
            pool="activity:a",
            limit="concurrency=1",
            since=now,
            holder="h",
        )
        await store.record_flow_waiter(waiter, ttl=60.0, now=now)
        assert await store.flow_waiters("wf", now=now) == [
            attrs.evolve(waiter, expires_at=now + timedelta(seconds=60))
        ]
    assert _schema.SCHEMA_VERSION == 10
