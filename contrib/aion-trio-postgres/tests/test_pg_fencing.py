"""Ownership and fencing at the store level: two store instances
("nodes") on one schema.

Leases are judged by the database clock.  A test that needs a lease to run
out opens the node with the default (long) ``lease_ttl`` and renewal off, so the
lease is surely live for as long as the test needs it to be, however slow the
machine; then it ends the lease on purpose, setting its expiry to the database's
now, and checks that the *database* says it has expired (it asks, it does not
guess).  The node itself is not told: it still believes its lease live, as a
paused process does.
After each scenario the history is checked in SQL: contiguous seqs from 1,
owner epochs never decreasing along it, and no event written by the fenced
node after the claim.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest
import trio
from aion_trio_postgres import PostgresStore, open_postgres_store
from conftest import drop_schema, new_schema_name

from aion_trio import (
    BackendUnavailable,
    Event,
    MarkerRecorded,
    NodeInUse,
    NotOwner,
    Payload,
    SequenceConflict,
    StoreTakenOver,
    WorkflowFenced,
)
from aion_trio.plugin import this_host

T0 = datetime(2030, 1, 1, tzinfo=timezone.utc)


def markers(workflow_id: str, first: int, count: int, tag: str) -> list[Event]:
    return [
        Event(
            workflow_id=workflow_id,
            seq=seq,
            recorded_at=T0 + timedelta(seconds=seq),
            body=MarkerRecorded(name=tag, value=Payload.of(seq)),
        )
        for seq in range(first, first + count)
    ]


def query(url: str, schema: str, text: str, params: Any = None) -> list[tuple[Any, ...]]:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT set_config('search_path', %s, false)", (schema,))
        cur = conn.execute(text, params)
        return cur.fetchall() if cur.description else []


def history_rows(url: str, schema: str, workflow_id: str) -> list[tuple[int, int, str]]:
    """``(seq, owner_epoch, marker name)`` of every stored event, in seq order."""
    return [
        (seq, epoch, data)
        for seq, epoch, data in query(
            url,
            schema,
            "SELECT seq, owner_epoch, data::json->>'name' FROM events WHERE workflow_id = %s ORDER BY seq",
            (workflow_id,),
        )
    ]


def assert_history_never_forked(url: str, schema: str, workflow_id: str) -> None:
    """Contiguous seqs 1..head, epochs non-decreasing, the head column agreeing: checked in SQL."""
    (gaps, decreasing, count, max_seq, head), *_ = query(
        url,
        schema,
        "WITH h AS (SELECT seq, owner_epoch, lag(owner_epoch) OVER (ORDER BY seq) AS prev,"
        " row_number() OVER (ORDER BY seq) AS n FROM events WHERE workflow_id = %s)"
        " SELECT count(*) FILTER (WHERE seq <> n), count(*) FILTER (WHERE owner_epoch < prev),"
        " count(*), max(seq), (SELECT head FROM workflows WHERE workflow_id = %s) FROM h",
        (workflow_id, workflow_id),
    )
    assert (gaps, decreasing) == (0, 0)
    assert count == max_seq == head


async def expire_lease(url: str, schema: str, node: str) -> None:
    """End ``node``'s lease now by the database clock (as if its renewals had stopped a
    ``lease_ttl`` ago), then confirm that the database sees it expired."""
    text = "UPDATE nodes SET lease_expires_at = clock_timestamp() WHERE node_id = %s RETURNING 1"
    assert await trio.to_thread.run_sync(query, url, schema, text, (node,)) == [(1,)]
    await wait_until_lease_expired(url, schema, node)


async def wait_until_lease_expired(url: str, schema: str, node: str) -> None:
    """Sleep (real time) until the database clock is past ``node``'s lease, then confirm it."""
    text = (
        "SELECT extract(epoch FROM lease_expires_at - clock_timestamp())::float FROM nodes WHERE node_id = %s"
    )
    with trio.fail_after(30):
        while True:
            (remaining,), *_ = await trio.to_thread.run_sync(query, url, schema, text, (node,))
            if remaining < 0:
                return
            await trio.sleep(remaining + 0.01)


@pytest.fixture
async def schema(pg_url: str) -> AsyncIterator[str]:
    name = new_schema_name()
    try:
        yield name
    finally:
        await trio.to_thread.run_sync(drop_schema, pg_url, name)


def node_url(pg_url: str, schema: str, node: str, **options: Any) -> str:
    extra = "".join(f"&{k}={v}" for k, v in options.items())
    return f"{pg_url}?schema={schema}&node={node}{extra}"


async def test_a_claim_after_lease_expiry_fences_the_old_owner(pg_url: str, schema: str) -> None:
    """B claims a workflow A owns once A's lease has expired by the database clock; A's next
    append raises WorkflowFenced (a NotOwner) and writes nothing; the history never forks."""
    async with open_postgres_store(node_url(pg_url, schema, "A"), renew_every=None) as a:
        await a.events.append("wf", markers("wf", 1, 2, "A"), 0)
        assert a.events.held_epoch("wf") == 1
        async with open_postgres_store(node_url(pg_url, schema, "B")) as b:
            # A's lease is still live: B may not take the workflow.
            with pytest.raises(WorkflowFenced, match="owned by node A") as refused:
                await b.events.append("wf", markers("wf", 3, 1, "B"), 2)
            assert refused.value.shard == refused.value.workflow_id == "wf"
            assert history_rows(pg_url, schema, "wf") == [(1, 1, "A"), (2, 1, "A")]

            await expire_lease(pg_url, schema, "A")
            await b.events.append("wf", markers("wf", 3, 1, "B"), 2)
            assert b.events.held_epoch("wf") == 2

            # The zombie wakes up and carries on from where it was: fenced, nothing written.
            with pytest.raises(
                WorkflowFenced, match="now owned by node B with epoch 2; this node held epoch 1"
            ):
                await a.events.append("wf", markers("wf", 3, 1, "A-zombie"), 2)
            # Even with the right seq it stays fenced: it is never retried here.  The common base
            # still catches it.
            caught: list[NotOwner] = []
            try:
                await a.events.append("wf", markers("wf", 4, 1, "A-zombie"), 3)
            except NotOwner as exc:
                caught.append(exc)
            assert [type(exc) for exc in caught] == [WorkflowFenced]
            await b.events.append("wf", markers("wf", 4, 1, "B"), 3)

    assert history_rows(pg_url, schema, "wf") == [(1, 1, "A"), (2, 1, "A"), (3, 2, "B"), (4, 2, "B")]
    assert_history_never_forked(pg_url, schema, "wf")
    assert query(pg_url, schema, "SELECT owner_node, owner_epoch FROM workflows") == [("B", 2)]


async def test_racing_appends_of_old_and_new_owner_never_fork(pg_url: str, schema: str) -> None:
    """After the claim, the fenced node and the new owner append concurrently many times:
    every append of the fenced one is refused, every one of the owner lands, in order."""
    async with (
        open_postgres_store(node_url(pg_url, schema, "A"), renew_every=None) as a,
        open_postgres_store(node_url(pg_url, schema, "B")) as b,
    ):
        await a.events.append("wf", markers("wf", 1, 1, "A"), 0)
        await expire_lease(pg_url, schema, "A")
        await b.events.claim("wf")
        refused: list[type[BaseException]] = []

        async def zombie(store: PostgresStore) -> None:
            for _ in range(20):
                head = (await store.events.read_history("wf"))[-1].seq
                try:
                    await store.events.append("wf", markers("wf", head + 1, 1, "A-zombie"), head)
                except (NotOwner, SequenceConflict) as exc:
                    refused.append(type(exc))

        async def owner(store: PostgresStore) -> None:
            for seq in range(2, 22):
                await store.events.append("wf", markers("wf", seq, 1, "B"), seq - 1)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(zombie, a)
            nursery.start_soon(owner, b)
    assert refused == [WorkflowFenced] * 20
    rows = history_rows(pg_url, schema, "wf")
    assert [name for _, _, name in rows] == ["A"] + ["B"] * 20
    assert_history_never_forked(pg_url, schema, "wf")


async def test_a_live_lease_refuses_claims_and_every_claim_bumps_the_epoch(pg_url: str, schema: str) -> None:
    async with (
        open_postgres_store(node_url(pg_url, schema, "A")) as a,
        open_postgres_store(node_url(pg_url, schema, "B")) as b,
    ):
        assert await a.events.claim("wf") == 1
        assert await a.events.claim("wf") == 2  # re-claiming is a claim too
        with pytest.raises(WorkflowFenced, match=r"owned by node A \(epoch 2\) whose lease runs until"):
            await b.events.claim("wf")
        # A claimed workflow without events is not listed until it has one.
        assert await a.events.list_workflow_ids() == []
        await a.events.append("wf", markers("wf", 1, 1, "A"), 0)
        assert history_rows(pg_url, schema, "wf") == [(1, 2, "A")]


async def test_a_closed_node_hands_its_workflows_over_at_once(pg_url: str, schema: str) -> None:
    async with open_postgres_store(node_url(pg_url, schema, "A")) as a:
        await a.events.append("wf", markers("wf", 1, 1, "A"), 0)
    async with open_postgres_store(node_url(pg_url, schema, "B")) as b:
        await b.events.append("wf", markers("wf", 2, 1, "B"), 1)
    assert history_rows(pg_url, schema, "wf") == [(1, 1, "A"), (2, 2, "B")]


DEAD_PID = 4_194_304 + 7
"""A pid no process has (beyond every kernel's pid range)."""


async def test_reopening_a_node_id_fences_the_older_incarnation(pg_url: str, schema: str) -> None:
    """A process restarted after a crash reuses its node id: the new incarnation fences the old
    one (a zombie, if its process was not really gone) at once, without waiting for its lease."""
    async with open_postgres_store(node_url(pg_url, schema, "A"), renew_every=None) as old:
        await old.events.append("wf", markers("wf", 1, 1, "old"), 0)
        # The old incarnation's process is gone (as after kill -9), its lease still live.
        query(pg_url, schema, "UPDATE nodes SET pid = %s WHERE node_id = 'A' RETURNING 1", (DEAD_PID,))
        async with open_postgres_store(node_url(pg_url, schema, "A")) as new:
            assert new.node is not None
            assert old.node is not None
            assert new.node.incarnation == old.node.incarnation + 1
            # Each of its workflows is fenced (the append names the workflow) ...
            with pytest.raises(WorkflowFenced, match="superseded"):
                await old.events.append("wf", markers("wf", 2, 1, "old"), 1)
            with pytest.raises(WorkflowFenced, match="superseded"):
                await old.events.append("other", markers("other", 1, 1, "old"), 0)
            # ... and the node itself was taken over: it owns nothing any more.
            with pytest.raises(StoreTakenOver, match="superseded") as taken:
                await old.renew_lease()
            assert taken.value.shard == "A"
            with pytest.raises(StoreTakenOver, match="superseded"):
                await old.renew_lease()  # known locally now, refused without asking
            await new.events.append("wf", markers("wf", 2, 1, "new"), 1)
    assert history_rows(pg_url, schema, "wf") == [(1, 1, "old"), (2, 2, "new")]
    assert query(pg_url, schema, "SELECT count(*) FROM workflows WHERE workflow_id = 'other'") == [(0,)]


async def test_a_node_id_whose_lease_a_live_process_holds_is_refused_naming_it(
    pg_url: str, schema: str
) -> None:
    """A second live process opened with the same node id would fence the first out of
    everything: it is refused with NodeInUse naming the holder, and changes nothing."""
    async with open_postgres_store(node_url(pg_url, schema, "A")) as first:
        await first.events.append("wf", markers("wf", 1, 1, "first"), 0)
        before = query(pg_url, schema, "SELECT incarnation, lease_expires_at FROM nodes WHERE node_id = 'A'")
        with pytest.raises(NodeInUse) as refused:
            async with open_postgres_store(node_url(pg_url, schema, "A")):
                pytest.fail("a second incarnation opened while the first is live")  # pragma: no cover
        assert (refused.value.node_id, refused.value.pid, refused.value.host) == (
            "A",
            os.getpid(),
            this_host(),
        )
        assert f"node id 'A' of {first.url.location} is held by a live engine: pid {os.getpid()}" in str(
            refused.value
        )
        assert query(pg_url, schema, "SELECT incarnation FROM nodes WHERE node_id = 'A'") == [(before[0][0],)]
        await first.events.append("wf", markers("wf", 2, 1, "first"), 1)  # still the owner
        assert first.node is not None
        assert not first.node.superseded
    # Released on close: the id is free at once.
    async with open_postgres_store(node_url(pg_url, schema, "A")) as again:
        assert again.node is not None
        assert again.node.incarnation == before[0][0] + 1


async def test_a_store_without_a_node_never_writes_to_an_owned_workflow(pg_url: str, schema: str) -> None:
    async with (
        open_postgres_store(f"{pg_url}?schema={schema}") as plain,
        open_postgres_store(node_url(pg_url, schema, "A")) as a,
    ):
        await plain.events.append("free", markers("free", 1, 1, "plain"), 0)
        await a.events.append("owned", markers("owned", 1, 1, "A"), 0)
        with pytest.raises(WorkflowFenced, match="owned by node A"):
            await plain.events.append("owned", markers("owned", 2, 1, "plain"), 1)
        # A node may adopt a workflow nobody owns.
        await a.events.append("free", markers("free", 2, 1, "A"), 1)
        with pytest.raises(WorkflowFenced):
            await plain.events.append("free", markers("free", 3, 1, "plain"), 2)
    assert history_rows(pg_url, schema, "owned") == [(1, 1, "A")]
    assert history_rows(pg_url, schema, "free") == [(1, 0, "plain"), (2, 1, "A")]


async def test_a_stale_seq_on_a_claim_writes_nothing_not_even_the_claim(pg_url: str, schema: str) -> None:
    async with open_postgres_store(node_url(pg_url, schema, "A")) as a:
        await a.events.append("wf", markers("wf", 1, 2, "A"), 0)
    async with open_postgres_store(node_url(pg_url, schema, "B")) as b:
        with pytest.raises(SequenceConflict) as info:
            await b.events.append("wf", markers("wf", 2, 1, "B"), 1)
        assert (info.value.expected, info.value.found) == (1, 2)
        assert b.events.held_epoch("wf") is None
    assert query(pg_url, schema, "SELECT owner_node, owner_epoch FROM workflows") == [("A", 1)]


async def test_the_heartbeat_renews_the_lease_by_the_database_clock(
    pg_url: str, schema: str, mock_clock: trio.testing.MockClock
) -> None:
    """Renewals happen on the Trio clock's schedule; each extends the lease from the database's now.

    The mock clock does not autojump here: time moves only when the test jumps it, so
    no renewal can slip in between the reads (the database call itself is real, so the
    wait for it polls real time, bounded).
    """
    text = "SELECT lease_expires_at, renewed_at, clock_timestamp() FROM nodes WHERE node_id = 'A'"
    async with open_postgres_store(node_url(pg_url, schema, "A", lease_ttl=30), renew_every=10) as a:
        assert a.node is not None
        first_expiry = a.node.expires_at
        (expires, renewed, now), *_ = await trio.to_thread.run_sync(query, pg_url, schema, text)
        assert expires == first_expiry
        assert timedelta(0) < expires - now <= timedelta(seconds=30)
        mock_clock.jump(10)
        for _ in range(3000):  # up to ~30 s of real time for the renewal's database call
            if a.node.expires_at != first_expiry:
                break
            await trio.to_thread.run_sync(time.sleep, 0.01)
        else:
            pytest.fail("the heartbeat did not renew the lease after its period passed")
        (expires, renewed_later, now), *_ = await trio.to_thread.run_sync(query, pg_url, schema, text)
        assert renewed_later > renewed
        assert expires > first_expiry
        assert a.node.expires_at == expires
        assert expires - renewed_later == timedelta(seconds=30)  # ttl from the database's clock


async def test_renewal_trouble_is_logged_and_renewal_goes_on(
    pg_url: str, schema: str, mock_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A renewal that fails is BackendUnavailable to a direct caller; the heartbeat logs it and
    keeps trying instead of tearing down the store's user.

    Time moves only when the test jumps it (one heartbeat period per jump), so the count
    of failures follows the count of periods; the failing call itself runs in a thread,
    so each wait for it polls real time, bounded.
    """

    def failures() -> int:
        return sum("lease renewal failed (will retry)" in r.getMessage() for r in caplog.records)

    async with open_postgres_store(node_url(pg_url, schema, "A", lease_ttl=30), renew_every=10) as a:
        a._backend.pool.close()  # the database becomes unreachable for this store
        with pytest.raises(BackendUnavailable):
            await a.renew_lease()
        for period in range(1, 4):
            mock_clock.jump(10)
            for _ in range(3000):  # up to ~30 s of real time for this period's failing renewal
                if failures() >= period:
                    break
                await trio.to_thread.run_sync(time.sleep, 0.01)
            else:
                pytest.fail(f"heartbeat period {period} logged no renewal failure")
