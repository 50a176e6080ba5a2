"""Cluster mode on PostgreSQL: several in-process engines with different node ids.

Real PostgreSQL, a fresh schema per test.  Leases are short (0.5-1 s) and real
time passes only where the database clock must (a lease running out); every
wait is for a condition, bounded by ``trio.fail_after``.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime, timezone
from typing import Any

import psycopg
import pytest
import trio
import trio.testing
from aion_trio_postgres import PostgresClusterStore, open_postgres_store

import aion_trio as aion
from aion_trio import EngineConfig, NotOwner, NotRunning, Payload, StoreTakenOver, WorkflowRelinquished
from aion_trio._ids import new_run_id
from aion_trio.events import SignalReceived, TimerFired, WorkflowStarted
from aion_trio.plugin import ClusterStore, body_data_json

FAST = EngineConfig(sweep_interval=0.1, remote_command_timeout=10.0)
CALLS: list[str] = []


@aion.activity
async def note(text: str) -> str:
    CALLS.append(text)
    return f"noted {text}"


@aion.workflow
async def approval(ctx: aion.WorkflowContext, order: int) -> dict[str, object]:
    ctx.set_query_handler("order", lambda: {"order": order})
    decision = await ctx.wait_signal("approve")
    return {"order": order, "decision": decision}


@aion.workflow
async def two_ticks(ctx: aion.WorkflowContext) -> list[object]:
    first = await ctx.wait_signal("tick")
    second = await ctx.wait_signal("tick")
    return [first, second]


@aion.workflow
async def nap_then_note(ctx: aion.WorkflowContext, text: str) -> str:
    await ctx.sleep(1.5)
    return str(await ctx.run(note, text))


@aion.workflow
async def just_note(ctx: aion.WorkflowContext, text: str) -> str:
    return str(await ctx.run(note, text))


@aion.workflow
async def ticker(ctx: aion.WorkflowContext, target: str) -> str:
    await ctx.signal_external(target, "tick", 1)
    await ctx.signal_external(target, "tick", 2)
    try:
        await ctx.cancel_external(target)
    except NotRunning as exc:
        return f"then it was {exc.status}"
    return "cancelled it too"


@aion.workflow
async def announcer(ctx: aion.WorkflowContext) -> str:
    await ctx.set_event("stage", "one")
    await ctx.wait_signal("tick")
    await ctx.set_event("stage", "two")
    await ctx.set_event("final", True)
    return "announced"


@aion.workflow
async def listener(ctx: aion.WorkflowContext, target: str) -> list[object]:
    first = await ctx.get_event(target, "stage", timeout=30)
    await ctx.signal_external(target, "tick")
    later = await ctx.get_event(target, "final", timeout=30)
    return [first, later]


@aion.workflow
async def tally(ctx: aion.WorkflowContext) -> int:
    total = 0
    closed = False

    @ctx.update_handler("add")
    def add(amount: int) -> int:
        nonlocal total
        total += amount
        return total

    @ctx.signal_handler("close")
    def close(_: object) -> None:
        nonlocal closed
        closed = True

    await ctx.wait_condition(lambda: closed)
    return total


@aion.workflow
async def notary(ctx: aion.WorkflowContext) -> list[str]:
    notes: list[str] = []
    closed = False

    @ctx.update_handler("note")
    async def take_note(text: str) -> str:
        notes.append(await ctx.run(note, text))  # an async handler runs an activity
        return notes[-1]

    @ctx.signal_handler("close")
    def close(_: object) -> None:
        nonlocal closed
        closed = True

    await ctx.wait_condition(lambda: closed)
    await ctx.wait_condition(ctx.all_handlers_finished)
    return notes


TOKENS: list[str] = []


@aion.activity(retry=aion.RetryPolicy(max_attempts=2, backoff=aion.Fixed(0.1)))
async def hand_over() -> Any:
    TOKENS.append(aion.activity_info().task_token)
    aion.complete_async()


@aion.workflow
async def awaits_token(ctx: aion.WorkflowContext) -> Any:
    return await ctx.run(hand_over)


@aion.workflow
async def long_nap(ctx: aion.WorkflowContext) -> str:
    await ctx.sleep(86400)
    return "rested"


WORKFLOWS = [
    long_nap,
    approval,
    two_ticks,
    nap_then_note,
    just_note,
    ticker,
    announcer,
    listener,
    tally,
    notary,
    awaits_token,
]


@pytest.fixture(autouse=True)
def _clear_calls() -> None:
    CALLS.clear()
    TOKENS.clear()


@contextlib.asynccontextmanager
async def node(
    url: str,
    name: str,
    *,
    ttl: float = 1.0,
    renew_every: float | None = -1.0,
    observers: Any = (),
    config: EngineConfig = FAST,
) -> AsyncIterator[tuple[PostgresClusterStore, aion.Engine]]:
    async with open_postgres_store(url, node=name, lease_ttl=ttl, renew_every=renew_every) as store:
        assert isinstance(store, PostgresClusterStore)
        async with aion.open_engine(
            store, workflows=WORKFLOWS, activities=[note, hand_over], config=config, observers=observers
        ) as engine:
            yield store, engine


def sql(url: str, schema: str, text: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(psycopg.sql.SQL("SET search_path TO {}").format(psycopg.sql.Identifier(schema)))
        cur = conn.execute(text, params)
        return cur.fetchall() if cur.description is not None else []


async def sql_async(url: str, schema: str, text: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    return await trio.to_thread.run_sync(sql, url, schema, text, params)


async def eventually(check: Callable[[], Awaitable[bool]], seconds: float = 10.0) -> None:
    """Poll ``check`` until it holds (bounded: a hang fails the test)."""
    with trio.fail_after(seconds):
        while not await check():  # noqa: ASYNC110 - the condition lives in the database
            await trio.sleep(0.02)


async def owner_of(url: str, schema: str, workflow_id: str) -> str | None:
    rows = await sql_async(
        url, schema, "SELECT owner_node FROM workflows WHERE workflow_id = %s", (workflow_id,)
    )
    return rows[0][0] if rows else None


async def finished(url: str, schema: str, workflow_id: str) -> bool:
    rows = await sql_async(url, schema, "SELECT status FROM workflows WHERE workflow_id = %s", (workflow_id,))
    return bool(rows) and rows[0][0] not in ("running", "continued_as_new")


def assert_unforked(url: str, schema: str) -> None:
    """Every history: seqs 1..n without a gap, owner epochs never decreasing."""
    rows = sql(url, schema, "SELECT workflow_id, seq, owner_epoch FROM events ORDER BY workflow_id, seq")
    by_workflow: dict[str, list[tuple[int, int]]] = {}
    for workflow_id, seq, epoch in rows:
        by_workflow.setdefault(workflow_id, []).append((seq, epoch))
    assert by_workflow, "control: there are histories to check"
    for workflow_id, pairs in by_workflow.items():
        assert [s for s, _ in pairs] == list(range(1, len(pairs) + 1)), workflow_id
        epochs = [e for _, e in pairs]
        assert epochs == sorted(epochs), (workflow_id, epochs)


async def test_two_engines_split_work_and_commands_reach_the_owner(
    fresh_store_url: Callable[..., str], schema_of: Callable[[str], str], pg_url: str
) -> None:
    url = fresh_store_url()
    schema = schema_of(url)
    async with node(url, "a") as (store_a, a), node(url, "b") as (_, b):
        assert isinstance(store_a, ClusterStore)
        for i in range(3):
            await a.start(approval, i, workflow_id=f"a-{i}")
            await b.start(approval, 10 + i, workflow_id=f"b-{i}")
        assert [await owner_of(pg_url, schema, f"a-{i}") for i in range(3)] == ["a", "a", "a"]
        assert [await owner_of(pg_url, schema, f"b-{i}") for i in range(3)] == ["b", "b", "b"]
        assert await store_a.command_target("b-0") == "b"
        assert await store_a.command_target("a-0") is None

        # Query, signal and cancel sent to the non-owner come back with the owner's outcome.
        assert await a.query("b-0", "order") == {"order": 10}
        await a.signal("b-0", "approve", "yes")
        await a.signal("a-0", "approve", "local")
        await a.cancel("b-1", "not needed")
        await b.signal("a-1", "approve", "from b")
        await eventually(lambda: finished(pg_url, schema, "b-0"))
        assert await b.result("b-0") == {"order": 10, "decision": "yes"}
        assert await a.result("a-0") == {"order": 0, "decision": "local"}
        assert await a.result("a-1") == {"order": 1, "decision": "from b"}
        await eventually(lambda: finished(pg_url, schema, "b-1"))
        status = await sql_async(pg_url, schema, "SELECT status FROM workflows WHERE workflow_id = 'b-1'")
        assert status == [("cancelled",)]
        # A refusal is raised as the owner raised it.
        with pytest.raises(NotRunning):
            await a.signal("b-0", "approve", "again")
        assert a._cluster is not None
        assert a._cluster.remote_commands == 4
        assert b._cluster is not None
        assert b._cluster.remote_commands == 1
        # The owner recorded every signal: nothing was appended by the other node.
        owners = await sql_async(
            pg_url,
            schema,
            "SELECT DISTINCT w.owner_node FROM events e JOIN workflows w USING (workflow_id)"
            " WHERE e.workflow_id LIKE 'b-%%'",
        )
        assert owners == [("b",)]
    assert_unforked(pg_url, schema)


async def test_expired_lease_is_taken_over_and_the_stale_node_relinquishes(
    fresh_store_url: Callable[..., str], schema_of: Callable[[str], str], pg_url: str
) -> None:
    url = fresh_store_url()
    schema = schema_of(url)
    seen: list[WorkflowRelinquished] = []

    def observe(event: object) -> None:
        if isinstance(event, WorkflowRelinquished):
            seen.append(event)

    # "stale" never renews its lease: it runs out after 0.6 s by the database clock.
    async with node(url, "stale", ttl=0.6, renew_every=None, observers=[observe]) as (store_s, stale):
        await stale.start(nap_then_note, "once", workflow_id="w")
        assert await owner_of(pg_url, schema, "w") == "stale"
        async with node(url, "fresh") as (_, fresh):
            await eventually(lambda: _owned_by(pg_url, schema, "w", "fresh"))
            assert not store_s.lease_valid()
            await eventually(lambda: finished(pg_url, schema, "w"))
            assert await fresh.result("w") == "noted once"
            # The stale node's timer fire was refused: it stopped the workflow, retried nothing.
            await eventually(lambda: _true(stale._core.recorders.relinquished == 1))
            assert [e.workflow_id for e in seen] == ["w"]
            assert seen[0].node_id == "stale"
            assert stale._core.loaded_recorder("w") is None
            assert [lease for lease in stale._core.registry.leases() if lease.workflow_id == "w"] == []
            assert not stale._core.timers.armed_for("w")
            assert CALLS == ["once"]
    history = await _history(url, "w")
    assert sum(isinstance(e.body, TimerFired) for e in history) == 1
    assert sum(isinstance(e.body, WorkflowStarted) for e in history) == 1
    epochs = sql(pg_url, schema, "SELECT DISTINCT owner_epoch FROM events WHERE workflow_id = 'w' ORDER BY 1")
    assert [e for (e,) in epochs] == [1, 2]
    assert_unforked(pg_url, schema)


async def test_lazy_recovery_leaves_a_nodes_own_sleeper_evicted_and_a_takeover_replays_at_once(
    fresh_store_url: Callable[..., str], schema_of: Callable[[str], str], pg_url: str
) -> None:
    """Lazy recovery (the default) applies to what a node resumes when it opens (its own
    workflows, the orphans claimed then); a workflow taken over later by the orphan sweep
    is recovered eagerly: replayed, its timers armed, resident at once."""
    url = fresh_store_url()
    schema = schema_of(url)
    async with node(url, "a") as (_, engine):
        await engine.start(long_nap, workflow_id="own")
        await eventually(lambda: _recorded(url, "own", "TimerStarted"))
    async with node(url, "a") as (_, engine):
        own = await engine.describe("own")
        assert (own.status, own.residency, own.stuck_reason) == (aion.WorkflowStatus.RUNNING, "evicted", None)
        # "dead" never renews its lease: its sleeper is an orphan 0.6 s later.
        async with node(url, "dead", ttl=0.6, renew_every=None) as (_, dead):
            await dead.start(long_nap, workflow_id="orphan")
            await eventually(lambda: _recorded(url, "orphan", "TimerStarted"))
            await eventually(lambda: _owned_by(pg_url, schema, "orphan", "a"))
            await eventually(lambda: _resident(engine, "orphan"))
        assert (await engine.describe("own")).residency == "evicted", "nothing woke it"


async def _recorded(url: str, workflow_id: str, event_type: str) -> bool:
    return any(e.type == event_type for e in await _history(url, workflow_id))


async def _resident(engine: aion.Engine, workflow_id: str) -> bool:
    return (await engine.describe(workflow_id)).residency == "resident"


async def _owned_by(url: str, schema: str, workflow_id: str, node_id: str) -> bool:
    return await owner_of(url, schema, workflow_id) == node_id


async def _true(value: bool) -> bool:
    await trio.lowlevel.checkpoint()
    return value


async def _history(url: str, workflow_id: str) -> list[Any]:
    async with open_postgres_store(url) as store:
        return await store.events.read_history(workflow_id)


async def test_concurrent_orphan_sweeps_never_claim_one_workflow_twice(
    fresh_store_url: Callable[..., str], schema_of: Callable[[str], str], pg_url: str
) -> None:
    url = fresh_store_url()
    schema = schema_of(url)
    ids = [f"o-{i:02d}" for i in range(60)]
    async with open_postgres_store(url) as plain:  # no node: the workflows stay unowned
        now = datetime.now(timezone.utc)
        for workflow_id in ids:
            body = WorkflowStarted(workflow_type="approval", input=Payload.of([1]), run_id=new_run_id())
            await plain.events.append(
                workflow_id, [aion.Event(workflow_id=workflow_id, seq=1, recorded_at=now, body=body)], 0
            )
    claims: dict[str, list[str]] = {}
    async with contextlib.AsyncExitStack() as stack:
        stores = [
            await stack.enter_async_context(open_postgres_store(url, node=f"n{i}", lease_ttl=5.0))
            for i in range(3)
        ]

        async def sweep(store: Any) -> None:
            mine = claims.setdefault(store.node_id, [])
            while True:
                got = await store.claim_orphans(3)
                if not got:
                    return
                mine.extend(got)

        async with trio.open_nursery() as nursery:
            for store in stores:
                nursery.start_soon(sweep, store)
    every = [w for got in claims.values() for w in got]
    assert sorted(every) == ids, "each orphan claimed exactly once"
    assert sum(1 for got in claims.values() if got) >= 2, "control: the sweeps really ran side by side"
    epochs = sql(pg_url, schema, "SELECT DISTINCT owner_epoch FROM workflows")
    assert epochs == [(1,)]


async def test_an_invalid_lease_holds_activity_dispatch_back(
    fresh_store_url: Callable[..., str], schema_of: Callable[[str], str], pg_url: str
) -> None:
    url = fresh_store_url()
    async with node(url, "lonely", ttl=0.5, renew_every=None) as (store, engine):
        await eventually(lambda: _true(not store.lease_valid()))
        await engine.start(just_note, "held", workflow_id="held")
        gate = engine._core.dispatcher
        await eventually(lambda: _true(getattr(gate, "held_back", 0) == 1))
        await trio.testing.wait_all_tasks_blocked()
        assert CALLS == []
        await store.renew_lease()
        assert store.lease_valid()
        with trio.fail_after(10):
            assert await engine.result("held") == "noted held"
        assert CALLS == ["held"]


async def test_a_held_back_attempt_whose_workflow_was_taken_over_meanwhile_never_runs(
    fresh_store_url: Callable[..., str], schema_of: Callable[[str], str], pg_url: str
) -> None:
    """A partition healed after another node took the workflow over: the attempt the cut-off
    node held back does not run once its lease is renewed (its completion would be fenced,
    but the side effect would have happened on a node that no longer owns the run); the
    node relinquishes the workflow instead."""
    url = fresh_store_url()
    schema = schema_of(url)
    seen: list[WorkflowRelinquished] = []

    def observe(event: object) -> None:
        if isinstance(event, WorkflowRelinquished):
            seen.append(event)

    async with node(url, "cut", ttl=0.5, renew_every=None, observers=[observe]) as (store_c, cut):
        await eventually(lambda: _true(not store_c.lease_valid()))
        await cut.start(just_note, "once", workflow_id="w")
        gate = cut._core.dispatcher
        await eventually(lambda: _true(getattr(gate, "held_back", 0) == 1))
        async with node(url, "other") as (_, other):
            await eventually(lambda: _owned_by(pg_url, schema, "w", "other"))
            with trio.fail_after(10):
                assert await other.result("w") == "noted once"
            assert CALLS == ["once"]
            await store_c.renew_lease()  # the partition heals
            assert store_c.lease_valid()
            await eventually(lambda: _true(cut._core.recorders.relinquished == 1))
            assert CALLS == ["once"], "the held-back attempt ran on the node that lost the workflow"
            # Stopped once the lease is back by the gate's ownership check (the attempt raises
            # WorkflowFenced), the node's rejoin (the workflow is dropped and the held attempt
            # cancelled), or both when each looks before the other acts; never by neither.
            # Either way the workflow is relinquished once (the observer saw one event).
            assert getattr(gate, "not_owned", 0) + cut.statistics().lost_on_rejoin >= 1
            assert [e.workflow_id for e in seen] == ["w"]
            assert cut._core.loaded_recorder("w") is None
    assert_unforked(pg_url, schema)


async def test_a_node_whose_lease_lapsed_drops_what_it_lost_when_it_rejoins(
    fresh_store_url: Callable[..., str], schema_of: Callable[[str], str], pg_url: str
) -> None:
    """A partition longer than the TTL healed: the node does not wait for a fenced write to
    find out what it lost.  On rejoining it checks every workflow it holds, the resident one
    and the evicted one, and drops those another node claimed meanwhile (an evicted run kept
    here could be woken by its own timer, replayed and dispatch a side effect)."""
    url = fresh_store_url()
    schema = schema_of(url)
    seen: list[WorkflowRelinquished] = []

    def observe(event: object) -> None:
        if isinstance(event, WorkflowRelinquished):
            seen.append(event)

    one_resident = EngineConfig(sweep_interval=0.1, remote_command_timeout=10.0, max_resident_runs=1)
    async with node(url, "cut", ttl=0.5, renew_every=None, observers=[observe], config=one_resident) as (
        store_c,
        cut,
    ):
        await cut.start(approval, 1, workflow_id="evicted")
        await cut.start(approval, 2, workflow_id="resident")
        await eventually(lambda: _true(cut.statistics().evicted_runs == 1))
        assert (await cut.describe("evicted")).residency == "evicted"
        assert (await cut.describe("resident")).residency == "resident"
        await eventually(lambda: _true(not store_c.lease_valid()))  # the partition: no renewal
        async with node(url, "other") as (_, other):
            await eventually(lambda: _owned_by(pg_url, schema, "evicted", "other"))
            await eventually(lambda: _owned_by(pg_url, schema, "resident", "other"))
            assert seen == [], "control: nothing was dropped before the lease came back"
            await store_c.renew_lease()  # the partition heals
            await eventually(lambda: _true(cut.statistics().lost_on_rejoin == 2))
            stats = cut.statistics()
            assert (stats.rejoins, stats.evicted_runs, stats.loaded_recorders) == (1, 0, 0)
            assert stats.relinquished_workflows == 2
            assert sorted(e.workflow_id for e in seen) == ["evicted", "resident"]
            assert cut._core.loaded_recorder("resident") is None
            # The workflows go on where they are owned now, untouched by the rejoined node.
            await other.signal("evicted", "approve", "yes")
            await other.signal("resident", "approve", "no")
            with trio.fail_after(10):
                assert await other.result("evicted") == {"order": 1, "decision": "yes"}
                assert await other.result("resident") == {"order": 2, "decision": "no"}
    assert_unforked(pg_url, schema)


async def test_a_killed_listen_connection_loses_no_command(
    fresh_store_url: Callable[..., str], schema_of: Callable[[str], str], pg_url: str
) -> None:
    url = fresh_store_url()
    schema = schema_of(url)
    async with node(url, "a") as (_, a), node(url, "b") as (store_b, b):
        await b.start(approval, 5, workflow_id="w")
        pid = store_b.listener.backend_pid
        assert pid is not None
        await sql_async(pg_url, schema, "SELECT pg_terminate_backend(%s)", (pid,))
        await a.signal("w", "approve", "after the drop")
        with trio.fail_after(10):
            assert await b.result("w") == {"order": 5, "decision": "after the drop"}
        await eventually(lambda: _true(store_b.listener.connects >= 2))
        assert store_b.listener.backend_pid != pid


async def test_a_redelivered_signal_command_is_applied_once(
    fresh_store_url: Callable[..., str], schema_of: Callable[[str], str], pg_url: str
) -> None:
    url = fresh_store_url()
    schema = schema_of(url)
    async with node(url, "a") as (_, a), node(url, "b") as (_, b):
        await b.start(two_ticks, workflow_id="w")
        await a.signal("w", "tick", 1)
        rows = await sql_async(pg_url, schema, "SELECT id, acked FROM inbox")
        assert len(rows) == 1
        assert rows[0][1] is True
        command_id = rows[0][0]
        signals = [e.body for e in await b.history("w") if isinstance(e.body, SignalReceived)]
        assert [(s.payload.json, s.request_id) for s in signals] == [("1", f"inbox:{command_id}")]
        # The row is delivered again (as after a lost acknowledgement): history says it is done.
        await sql_async(
            pg_url, schema, "UPDATE inbox SET acked = false, outcome = NULL WHERE id = %s", (command_id,)
        )
        assert await b.drain_inbox() == 1
        signals = [e.body for e in await b.history("w") if isinstance(e.body, SignalReceived)]
        assert len(signals) == 1
        await a.signal("w", "tick", 2)
        with trio.fail_after(10):
            assert await b.result("w") == [1, 2]


async def test_a_routed_command_carries_its_request_id_and_redelivered_is_applied_once(
    fresh_store_url: Callable[..., str], schema_of: Callable[[str], str], pg_url: str
) -> None:
    url = fresh_store_url()
    schema = schema_of(url)
    async with node(url, "a") as (store_a, a), node(url, "b") as (_, b):
        await b.start(two_ticks, workflow_id="w")
        await a.terminate("w", "stop", request_id="client-7")
        rows = await sql_async(pg_url, schema, "SELECT id, acked, outcome, request_id FROM inbox")
        assert [(r[1], r[3]) for r in rows] == [(True, "client-7")]
        command_id, first_outcome = rows[0][0], rows[0][2]
        # Delivered again, as after a worker died between applying and acking it.
        await sql_async(
            pg_url, schema, "UPDATE inbox SET acked = false, outcome = NULL WHERE id = %s", (command_id,)
        )
        assert await b.drain_inbox() == 1
        rows = await sql_async(pg_url, schema, "SELECT outcome FROM inbox WHERE id = %s", (command_id,))
        assert rows[0][0] == first_outcome, "the first outcome, not NotRunning"
        assert [e.type for e in await b.history("w")].count("WorkflowCancelled") == 1
        # The sender retrying (same key) after an ambiguous failure: no new command, no refusal.
        await a.terminate("w", "stop", request_id="client-7")
        assert len(await sql_async(pg_url, schema, "SELECT id FROM inbox")) == 1
        queued = aion.SignalCommand(workflow_id="w", name="tick", request_id="client-8")
        assert await store_a.enqueue_command(queued) == await store_a.enqueue_command(queued)


async def test_result_and_describe_on_a_non_owner_follow_the_store(
    fresh_store_url: Callable[..., str], schema_of: Callable[[str], str], pg_url: str
) -> None:
    url = fresh_store_url()
    async with node(url, "a") as (_, a), node(url, "b") as (_, b):
        await a.start(approval, 7, workflow_id="w")
        assert (await b.describe("w")).status is aion.WorkflowStatus.RUNNING
        got: list[object] = []

        async def wait_on_b() -> None:
            got.append(await b.result("w"))

        with trio.fail_after(15):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(wait_on_b)
                # b's wait has read the history (no terminal yet: the signal is still to come).
                await eventually(lambda: _true(b._core.loaded_recorder("w") is not None))
                await a.signal("w", "approve", "ok")
                with trio.fail_after(10):
                    assert await a.result("w") == {"order": 7, "decision": "ok"}
        # b never drove "w": its answer came from the store, not from a snapshot it cached.
        assert got == [{"order": 7, "decision": "ok"}]
        assert (await b.describe("w")).status is aion.WorkflowStatus.COMPLETED
        assert not b._core.drives("w")


async def test_a_claim_recovers_from_the_store_not_from_a_cached_read(
    fresh_store_url: Callable[..., str], schema_of: Callable[[str], str], pg_url: str
) -> None:
    url = fresh_store_url()
    schema = schema_of(url)
    async with node(url, "old", ttl=0.6, renew_every=None) as (_, old), node(url, "new") as (_, new):
        await old.start(two_ticks, workflow_id="w")
        # "new" reads the workflow early (as a result() call does), caching a recorder ...
        cached = await new._core.recorder_for("w")
        assert cached.head == 1
        await old.signal("w", "tick", 1)  # ... then the owner records more.
        await eventually(lambda: _owned_by(pg_url, schema, "w", "new"))
        await new.signal("w", "tick", 2)
        with trio.fail_after(10):
            assert await new.result("w") == [1, 2]
        assert "w" not in new._core.stuck
    assert_unforked(pg_url, schema)


async def test_a_zombie_that_claims_back_its_workflow_restarts_it_from_the_store(
    fresh_store_url: Callable[..., str], schema_of: Callable[[str], str], pg_url: str
) -> None:
    url = fresh_store_url()
    schema = schema_of(url)
    # "zombie" stops renewing (as a stopped process would); its run of "w" stays parked in memory.
    async with node(url, "zombie", ttl=0.6, renew_every=None) as (store_z, zombie):
        await zombie.start(two_ticks, workflow_id="w")
        assert zombie._core.drives("w")
        async with node(url, "other") as (_, other):
            await eventually(lambda: _owned_by(pg_url, schema, "w", "other"))
            await other.signal("w", "tick", 1)  # recorded under other's epoch
        # "other" shut down (its lease released); the zombie comes back and sweeps "w" up again.
        assert zombie._core.drives("w"), "control: the zombie still holds its stale run"
        await store_z.renew_lease()
        await eventually(lambda: _owned_by(pg_url, schema, "w", "zombie"))
        await eventually(lambda: _true("w" in {r.workflow_id for r in zombie._core.registry.leases()}))
        await zombie.signal("w", "tick", 2)
        with trio.fail_after(10):
            assert await zombie.result("w") == [1, 2]
        assert "w" not in zombie._core.stuck
    epochs = sql(pg_url, schema, "SELECT DISTINCT owner_epoch FROM events WHERE workflow_id = 'w' ORDER BY 1")
    assert [e for (e,) in epochs] == [1, 2, 3]
    assert_unforked(pg_url, schema)


async def test_an_interrupted_deadline_teardown_is_finished_by_its_owner_only(
    fresh_store_url: Callable[..., str], schema_of: Callable[[str], str], pg_url: str
) -> None:
    from datetime import timedelta

    from aion_trio.events import TimerStarted, WorkflowTimedOut

    url = fresh_store_url()
    schema = schema_of(url)
    async with open_postgres_store(url, node="a", lease_ttl=30.0) as store_a:
        # "a" timed the run out and crashed before retiring its deadline (the teardown's anchor).
        run_id = new_run_id()
        now = datetime.now(timezone.utc)
        bodies = [
            WorkflowStarted(workflow_type="approval", input=Payload.of([1]), run_id=run_id),
            TimerStarted(timer_id=f"deadline:{run_id}", fire_at=now - timedelta(seconds=5)),
            WorkflowTimedOut(),
        ]
        events = [
            aion.Event(workflow_id="w", seq=i + 1, recorded_at=now, body=body)
            for i, body in enumerate(bodies)
        ]
        await store_a.events.append("w", events, 0)
        async with node(url, "b") as (_, b):
            # b's recovery sees the due deadline, but "w" belongs to the live node a.
            assert b._core.cluster is not None
            assert await b._core.cluster.command_target("w") == "a"
            # (Asked again here, the heap is checked before the timer service can run.)
            await b._core.teardown.resume(set())
            assert not b._core.timers.armed_for("w")
            assert b._core.recorders.relinquished == 0
            assert await owner_of(pg_url, schema, "w") == "a"
        async with aion.open_engine(store_a, workflows=WORKFLOWS, activities=[note], config=FAST):
            await eventually(lambda: _deadline_retired(pg_url, schema, run_id))
    assert_unforked(pg_url, schema)


async def _deadline_retired(url: str, schema: str, run_id: str) -> bool:
    rows = await sql_async(
        url, schema, "SELECT count(*) FROM events WHERE workflow_id = 'w' AND type = 'TimerFired'"
    )
    return rows[0][0] == 1


@aion.workflow
async def parent_of_kid(ctx: aion.WorkflowContext) -> str:
    ctx.start_child(approval, 99, workflow_id="kid", parent_close_policy=aion.ParentClosePolicy.TERMINATE)
    return str(await ctx.wait_signal("go"))


async def test_the_parent_close_policy_reaches_a_child_another_node_owns(
    fresh_store_url: Callable[..., str], schema_of: Callable[[str], str], pg_url: str
) -> None:
    url = fresh_store_url()
    schema = schema_of(url)
    WORKFLOWS.append(parent_of_kid)
    try:
        # b's store is open (its lease live) before its engine: the child can be moved to b
        # without a's sweeper taking it back, and b's engine then recovers it at open.
        async with open_postgres_store(url, node="b", lease_ttl=1.0) as store_b, node(url, "a") as (_, a):
            await a.start(parent_of_kid, workflow_id="p")
            await eventually(lambda: _owned_by(pg_url, schema, "kid", "a"))
            # The child moves to node b (as a sweep claims a workflow whose owner lapsed);
            # a still holds its copy and does not know.
            await sql_async(
                pg_url,
                schema,
                "UPDATE workflows SET owner_node = 'b', owner_epoch = owner_epoch + 1 WHERE workflow_id = 'kid'",
            )
            async with aion.open_engine(store_b, workflows=WORKFLOWS, activities=[note], config=FAST) as b:
                assert b._core.drives("kid")
                assert a._core.drives("p")
                await a.signal("p", "go", "done")  # the parent ends on a: its children are closed
                with trio.fail_after(10):
                    assert await a.result("p") == "done"
                await eventually(lambda: finished(pg_url, schema, "kid"))
    finally:
        WORKFLOWS.remove(parent_of_kid)
    status = await sql_async(
        pg_url, schema, "SELECT status, owner_node FROM workflows WHERE workflow_id = 'kid'"
    )
    assert status == [("cancelled", "b")]
    history = await _history(url, "kid")
    terminal = history[-1].body
    assert type(terminal).__name__ == "WorkflowCancelled"
    assert terminal.terminated
    assert "parent workflow 'p' closed (parent_close_policy=terminate)" in terminal.reason
    # Written by b, the owner: with its epoch (a's was 1), and a appended nothing after the move.
    epochs = sql(pg_url, schema, "SELECT seq, owner_epoch FROM events WHERE workflow_id = 'kid' ORDER BY seq")
    assert [e for _, e in epochs] == [1, 3]
    assert_unforked(pg_url, schema)


async def test_a_node_superseded_by_a_newer_incarnation_stops_its_engine(
    fresh_store_url: Callable[..., str], schema_of: Callable[[str], str], pg_url: str
) -> None:
    """Fenced out of everything (its node id reopened elsewhere), an engine does not idle: it
    closes its epoch and raises StoreTakenOver (a NotOwner) out of open_engine."""
    url = fresh_store_url()
    schema = schema_of(url)
    engines: list[aion.Engine] = []

    async def serve_until_superseded() -> None:
        async with node(url, "a") as (_, a):
            engines.append(a)
            await a.start(approval, 1, workflow_id="x")
            # As if a's process had died: a restart under its id may take over at once.
            await sql_async(pg_url, schema, "UPDATE nodes SET pid = %s WHERE node_id = 'a'", (4_194_304 + 7,))
            async with open_postgres_store(url, node="a", lease_ttl=5.0) as newer:
                assert newer.node is not None
                await trio.sleep_forever()  # the superseded engine must end this on its own

    with trio.fail_after(30), pytest.raises(StoreTakenOver, match="superseded") as stopped:
        await serve_until_superseded()
    assert stopped.value.shard == "a"
    assert isinstance(stopped.value, NotOwner)
    assert not engines[0].epoch.is_open


async def test_a_stale_copy_is_relinquished_and_recovered_from_the_store_not_marked_stuck(
    fresh_store_url: Callable[..., str], schema_of: Callable[[str], str], pg_url: str
) -> None:
    """The owner's copy of a history falls behind the store (another node appended while this
    one was fenced, before it claimed the workflow back; simulated by one foreign event): its
    next append is a SequenceConflict, after which it drops the copy and recovers the run
    from the store instead of marking it stuck."""
    url = fresh_store_url()
    schema = schema_of(url)
    seen: list[WorkflowRelinquished] = []
    async with node(url, "a", observers=[seen.append]) as (_, a):
        await a.start(nap_then_note, "late", workflow_id="w")
        (epoch,) = (
            await sql_async(pg_url, schema, "SELECT owner_epoch FROM workflows WHERE workflow_id = 'w'")
        )[0]
        kind, data = body_data_json(SignalReceived(name="noise", payload=Payload.of(1)))
        await sql_async(
            pg_url,
            schema,
            "WITH h AS (UPDATE workflows SET head = head + 1 WHERE workflow_id = 'w' RETURNING head)"
            " INSERT INTO events (workflow_id, seq, recorded_at, type, data, owner_epoch)"
            " SELECT 'w', h.head, clock_timestamp(), %s, %s, %s FROM h",
            (kind, data, epoch),
        )
        with trio.fail_after(20):
            assert await a.result("w") == "noted late"  # the timer fired on the fresh copy
        assert "w" not in a._core.stuck
        assert [e.workflow_id for e in seen if isinstance(e, WorkflowRelinquished)] == ["w"]
        assert CALLS == ["late"]
    history = await _history(url, "w")
    assert [type(e.body).__name__ for e in history].count("TimerFired") == 1
    assert_unforked(pg_url, schema)


async def test_a_running_row_of_an_ended_workflow_is_reconciled_by_its_owner_after_a_claim(
    fresh_store_url: Callable[..., str], schema_of: Callable[[str], str], pg_url: str
) -> None:
    """A visibility row that still says running for a workflow its history ended (its index
    write was lost when a node died or was fenced) is rewritten by the owning node, without a
    restart: at the next sweep that claims workflows (a node died), and now and then."""
    url = fresh_store_url()
    schema = schema_of(url)
    async with node(url, "a") as (_, a):
        await a.start(just_note, "x", workflow_id="done")
        assert await a.result("done") == "noted x"
        await eventually(lambda: _row_status(pg_url, schema, "done", "completed"))
        # The index write lost: the row says running again.
        await sql_async(
            pg_url,
            schema,
            "UPDATE visibility SET status = 'running', close_time = NULL WHERE workflow_id = 'done'",
        )
        # A workflow nobody owns appears (as a dead node's would): a's sweep claims it.
        async with open_postgres_store(url) as plain:
            body = WorkflowStarted(workflow_type="approval", input=Payload.of([1]), run_id=new_run_id())
            now = datetime.now(timezone.utc)
            await plain.events.append(
                "orphan", [aion.Event(workflow_id="orphan", seq=1, recorded_at=now, body=body)], 0
            )
        await eventually(lambda: _owned_by(pg_url, schema, "orphan", "a"))
        await eventually(lambda: _row_status(pg_url, schema, "done", "completed"))


async def _row_status(url: str, schema: str, workflow_id: str, status: str) -> bool:
    rows = await sql_async(
        url, schema, "SELECT status FROM visibility WHERE workflow_id = %s", (workflow_id,)
    )
    return rows == [(status,)]


async def test_signal_with_start_reaches_the_owner_or_starts_here(
    fresh_store_url: Callable[..., str], schema_of: Callable[[str], str], pg_url: str
) -> None:
    url = fresh_store_url()
    schema = schema_of(url)
    async with node(url, "a") as (_, a), node(url, "b") as (_, b):
        started = await a.start(two_ticks, workflow_id="ticks")
        assert await owner_of(pg_url, schema, "ticks") == "a"
        # Running on node a: b's call is a signal, sent to a through the inbox.
        sent = await b.signal_with_start(
            two_ticks, workflow_id="ticks", signal="tick", payload=1, request_id="t-1"
        )
        assert (sent.run_id, sent.created) == (started.run_id, False)
        assert b._cluster is not None
        assert b._cluster.remote_commands == 1
        # Not running anywhere: b starts it here, with the signal in the start's append.
        fresh = await b.signal_with_start(two_ticks, workflow_id="fresh", signal="tick", payload="x")
        assert fresh.created
        assert await owner_of(pg_url, schema, "fresh") == "b"
        # Its second tick from a goes to b, the owner.
        again = await a.signal_with_start(two_ticks, workflow_id="fresh", signal="tick", payload="y")
        assert (again.run_id, again.created) == (fresh.run_id, False)
        await a.signal("ticks", "tick", 2)
        with trio.fail_after(20):
            assert await a.result("ticks") == [1, 2]
            assert await b.result("fresh") == ["x", "y"]
        history = await b.history("fresh")
        assert [e.type for e in history[:2]] == ["WorkflowStarted", "SignalReceived"]
        assert [e.type for e in history].count("WorkflowStarted") == 1
    assert_unforked(pg_url, schema)


async def test_a_workflow_signals_a_workflow_another_node_owns_through_the_inbox(
    fresh_store_url: Callable[..., str], schema_of: Callable[[str], str], pg_url: str
) -> None:
    url = fresh_store_url()
    schema = schema_of(url)
    async with node(url, "a") as (_, a), node(url, "b") as (_, b):
        await a.start(two_ticks, workflow_id="ticks")
        assert await owner_of(pg_url, schema, "ticks") == "a"
        await b.start(ticker, "ticks", workflow_id="ticker")
        assert await owner_of(pg_url, schema, "ticker") == "b"
        with trio.fail_after(20):
            assert await a.result("ticks") == [1, 2]
            assert await b.result("ticker") == "then it was completed"
        assert b._cluster is not None
        assert b._cluster.remote_commands == 3, "both signals and the cancel went to a through the inbox"
        received = [e.body for e in await a.history("ticks") if isinstance(e.body, SignalReceived)]
        assert [s.payload.value() for s in received] == [1, 2]
        assert all((s.request_id or "").startswith("external:") for s in received)
    assert_unforked(pg_url, schema)


async def test_get_event_reads_a_workflow_another_node_drives(
    fresh_store_url: Callable[..., str], schema_of: Callable[[str], str], pg_url: str
) -> None:
    url = fresh_store_url()
    schema = schema_of(url)
    async with node(url, "a") as (_, a), node(url, "b") as (_, b):
        await a.start(announcer, workflow_id="news")
        assert await owner_of(pg_url, schema, "news") == "a"
        with trio.fail_after(20):
            assert await b.get_event("news", "stage", timeout=20) == "one"
            await b.signal("news", "tick")
            assert await a.result("news") == "announced"
            assert await b.get_event("news", "stage", timeout=20) == "two"
            assert await b.get_event("news", "never", timeout=20) is None, "closed without it: at once"
    assert_unforked(pg_url, schema)


async def test_a_workflow_reads_the_event_of_a_workflow_another_node_drives(
    fresh_store_url: Callable[..., str], schema_of: Callable[[str], str], pg_url: str
) -> None:
    url = fresh_store_url()
    schema = schema_of(url)
    async with node(url, "a") as (_, a), node(url, "b") as (_, b):
        await a.start(announcer, workflow_id="news")
        await b.start(listener, "news", workflow_id="listener")
        assert await owner_of(pg_url, schema, "listener") == "b"
        with trio.fail_after(20):
            assert await b.result("listener") == ["one", True], "the second read waited across nodes"
            assert await a.result("news") == "announced"
    assert_unforked(pg_url, schema)


async def test_an_update_reaches_the_owner_through_the_inbox_and_a_retry_is_not_run_twice(
    fresh_store_url: Callable[..., str], schema_of: Callable[[str], str], pg_url: str
) -> None:
    url = fresh_store_url()
    schema = schema_of(url)
    async with node(url, "a") as (_, a), node(url, "b") as (_, b):
        await a.start(tally, workflow_id="tally")
        assert await owner_of(pg_url, schema, "tally") == "a"
        with trio.fail_after(20):
            # b is not the owner: the update is validated and accepted by a (through the
            # inbox), and b reads the outcome from the store.
            assert await b.update("tally", "add", 2, update_id="add-1") == 2
            assert await b.update("tally", "add", 2, update_id="add-1") == 2
            assert await a.update("tally", "add", 3) == 5
            with pytest.raises(aion.UpdateRejected, match="no handler"):
                await b.update("tally", "subtract", 1)
            await b.signal("tally", "close")
            assert await b.result("tally") == 5
        assert b._cluster is not None
        assert b._cluster.remote_commands == 4
        history = await b.history("tally")
        assert [e.type for e in history].count("UpdateAccepted") == 2
        with pytest.raises(NotRunning):
            await b.update("tally", "add", 1)
    assert_unforked(pg_url, schema)


async def test_an_activity_completion_by_token_reaches_the_owner_through_the_inbox(
    fresh_store_url: Callable[..., str], schema_of: Callable[[str], str], pg_url: str
) -> None:
    url = fresh_store_url()
    schema = schema_of(url)
    async with node(url, "a") as (_, a), node(url, "b") as (_, b):
        await a.start(awaits_token, workflow_id="token")
        assert await owner_of(pg_url, schema, "token") == "a"

        async def handed_over(count: int) -> bool:
            await trio.lowlevel.checkpoint()
            return len(TOKENS) >= count

        with trio.fail_after(20):
            await eventually(lambda: handed_over(1))
            # b does not own the workflow: each call goes to a through the inbox.
            await b.fail_activity(TOKENS[0], "try again")
            await eventually(lambda: handed_over(2))
            with pytest.raises(aion.ActivityAttemptClosed, match="not open"):
                await b.complete_activity(TOKENS[0], "stale")
            await b.heartbeat_activity(TOKENS[1], {"progress": 1})
            await b.complete_activity(TOKENS[1], "done")
            assert await b.result("token") == "done"
        history = await b.history("token")
    trail = [(type(e.body).__name__, getattr(e.body, "attempt", None)) for e in history]
    assert ("ActivityFailed", 1) in trail
    assert ("ActivityCompleted", 2) in trail
    assert_unforked(pg_url, schema)


async def test_an_update_to_an_async_handler_on_another_node_runs_its_activity_once(
    fresh_store_url: Callable[..., str], schema_of: Callable[[str], str], pg_url: str
) -> None:
    url = fresh_store_url()
    schema = schema_of(url)
    async with node(url, "a") as (_, a), node(url, "b") as (_, b):
        await a.start(notary, workflow_id="notary")
        assert await owner_of(pg_url, schema, "notary") == "a"
        with trio.fail_after(20):
            # Accepted by a through the inbox; a's run gives the handler a branch that runs
            # the activity; b reads the recorded outcome (and a retry gets it again).
            assert await b.update("notary", "note", "deed", update_id="deed-1") == "noted deed"
            assert await b.update("notary", "note", "deed", update_id="deed-1") == "noted deed"
            await b.signal("notary", "close")
            assert await b.result("notary") == ["noted deed"]
        assert CALLS == ["deed"]
        history = await b.history("notary")
        assert [e.type for e in history].count("UpdateCompleted") == 1
    assert_unforked(pg_url, schema)
