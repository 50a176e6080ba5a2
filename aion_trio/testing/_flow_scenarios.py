"""Conformance scenarios for the optional capability :class:`~aion_trio.FlowStore`
(flow-control permits, rate windows, workflow queues and the records of attempts
waiting for a slot).

Keyed factory as for the other optional capabilities: the same key opens the
same store again.  Every time passed is chosen here (``now=``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import attrs
import trio

from .._store import ADMITTED, QUEUED, FlowWaiter, QueuedRun
from ._control_scenarios import CONTENDERS, _at
from ._kit import ScenarioContext, short

_TTL = 30.0


def _permit(
    store: Any,
    key: str,
    now: float,
    *,
    concurrency: int | None = None,
    rate: int | None = None,
    period: float = 10.0,
    holder: str = "node-a",
    ttl: float = _TTL,
) -> Any:
    return store.acquire_flow_permit(
        key, holder=holder, concurrency=concurrency, rate=rate, period=period, ttl=ttl, now=_at(now)
    )


def _run(
    workflow_id: str, *, queue: str = "q", priority: int = 0, partition: str = "", dedup: str | None = None
) -> QueuedRun:
    return QueuedRun(
        queue=queue,
        workflow_id=workflow_id,
        partition_key=partition,
        priority=priority,
        dedup_id=dedup,
        data=f'{{"id": "{workflow_id}"}}',
    )


def _waiter(
    workflow_id: str = "wf-ünï/1",
    activity_id: int = 3,
    *,
    run_id: str = "run-1",
    attempt: int = 1,
    pool: str = "activity:charge",
    holder: str = "node-a",
    since: float = 0,
) -> FlowWaiter:
    return FlowWaiter(
        workflow_id=workflow_id,
        run_id=run_id,
        activity_id=activity_id,
        attempt=attempt,
        pool=pool,
        limit="concurrency=1, rate=2 per 10s",
        priority=-3,
        since=_at(since),
        holder=holder,
    )


def _record(store: Any, waiter: FlowWaiter, now: float, ttl: float = _TTL) -> Any:
    return store.record_flow_waiter(waiter, ttl=ttl, now=_at(now))


def _waits(found: list[FlowWaiter]) -> list[tuple[str, int, int, str]]:
    return [(w.run_id, w.activity_id, w.attempt, w.pool) for w in found]


def _ids(runs: list[QueuedRun]) -> list[str]:
    return [r.workflow_id for r in runs]


async def flow_permits_bound_concurrency(ctx: ScenarioContext) -> None:
    """At most ``concurrency`` permits of a key are held; a refusal names no wait
    (``retry_after`` None) and takes nothing; a release frees one; keys are independent."""
    async with ctx.open() as store:
        grants = [await _permit(store, "k", 0, concurrency=2) for _ in range(3)]
        ctx.expect_equal(
            [g.granted for g in grants], [True, True, False], "three acquires under a bound of 2"
        )
        ctx.expect(
            grants[0].permit_id is not None and grants[0].permit_id != grants[1].permit_id,
            f"granted permits have distinct ids, got {short([g.permit_id for g in grants])}",
        )
        ctx.expect_equal((grants[2].permit_id, grants[2].retry_after), (None, None), "the refusal")
        ctx.expect_equal(await store.held_flow_permits("k", now=_at(0)), 2, "held_flow_permits() after")
        ctx.expect_equal((await _permit(store, "other", 0, concurrency=2)).granted, True, "another key")
        ctx.expect_equal(await store.release_flow_permit("k", grants[0].permit_id), True, "release")
        ctx.expect_equal(await store.release_flow_permit("k", grants[0].permit_id), False, "release again")
        ctx.expect_equal(
            (await _permit(store, "k", 1, concurrency=2)).granted, True, "acquire after a release"
        )


async def flow_permits_expire_and_renew(ctx: ScenarioContext) -> None:
    """A permit lasts ``ttl`` from its grant; renewing the holder's permits moves their
    expiry to ``now + ttl``; an expired permit no longer counts."""
    async with ctx.open() as store:
        await _permit(store, "k", 0, concurrency=1, holder="a", ttl=10)
        ctx.expect_equal(
            (await _permit(store, "k", 5, concurrency=1, holder="b")).granted, False, "before expiry"
        )
        ctx.expect_equal(
            await store.renew_flow_permits("a", ttl=10, now=_at(8)), 1, "renew_flow_permits('a')"
        )
        ctx.expect_equal(
            (await _permit(store, "k", 15, concurrency=1, holder="b")).granted,
            False,
            "after the old expiry, renewed until 18",
        )
        ctx.expect_equal(await store.held_flow_permits("k", now=_at(18)), 0, "held at the renewed expiry")
        ctx.expect_equal(
            (await _permit(store, "k", 18, concurrency=1, holder="b")).granted,
            True,
            "acquire once the renewed permit expired",
        )


async def flow_rate_window(ctx: ScenarioContext) -> None:
    """At most ``rate`` starts in any window of ``period``: a refusal says when the oldest
    leaves it and counts nothing; a start exactly ``period`` after the oldest fits."""
    async with ctx.open() as store:
        ctx.expect_equal((await _permit(store, "r", 0, rate=2)).granted, True, "start 1 at t=0")
        ctx.expect_equal((await _permit(store, "r", 4, rate=2)).granted, True, "start 2 at t=4")
        refused = await _permit(store, "r", 6, rate=2)
        ctx.expect_equal((refused.granted, refused.retry_after), (False, 4.0), "start 3 at t=6")
        ctx.expect_equal((await _permit(store, "r", 10, rate=2)).granted, True, "start 3 at t=10")
        refused = await _permit(store, "r", 11, rate=2)
        ctx.expect_equal(
            (refused.granted, refused.retry_after), (False, 3.0), "start 4 at t=11 (t=4 is oldest)"
        )
        both = await _permit(store, "rc", 0, rate=1, concurrency=5)
        ctx.expect(both.granted and both.permit_id is not None, f"rate and bound together: {short(both)}")
        again = await _permit(store, "rc", 1, rate=1, concurrency=5)
        ctx.expect_equal(again.granted, False, "a rate refusal under a free bound")
        ctx.expect_equal(await store.held_flow_permits("rc", now=_at(1)), 1, "a refusal takes no permit")


async def flow_concurrent_acquirers_respect_the_bound(ctx: ScenarioContext) -> None:
    """Handles acquiring one key at once never hold more than the bound together."""
    async with contextlib.AsyncExitStack() as stack:
        handles = [await stack.enter_async_context(ctx.open()) for _ in range(CONTENDERS)]
        granted: list[bool] = []

        async def contend(index: int) -> None:
            for _ in range(2):
                grant = await _permit(handles[index], "k", 0, concurrency=3, rate=5, holder=f"n{index}")
                granted.append(grant.granted)

        async with trio.open_nursery() as nursery:
            for index in range(CONTENDERS):
                nursery.start_soon(contend, index)
        ctx.expect_equal(granted.count(True), 3, f"grants among {len(granted)} concurrent acquires (bound 3)")


async def flow_state_survives_reopen(ctx: ScenarioContext) -> None:
    """Permits, rate starts, queued runs and waiter records survive closing and reopening the store."""
    async with ctx.open() as store:
        await _permit(store, "k", 0, concurrency=1, rate=1)
        await store.enqueue_flow_run(_run("w1"))
        await _record(store, _waiter(), 0)
    async with ctx.open() as store:
        ctx.expect_equal(
            _waits(await store.flow_waiters("wf-ünï/1", now=_at(1))),
            [("run-1", 3, 1, "activity:charge")],
            "waiter records after reopening",
        )
        ctx.expect_equal(await store.held_flow_permits("k", now=_at(1)), 1, "held permits after reopening")
        ctx.expect_equal((await _permit(store, "r0", 1, rate=1)).granted, True, "another key's rate")
        refused = await _permit(store, "k", 1, rate=1)
        ctx.expect_equal((refused.granted, refused.retry_after), (False, 9.0), "the rate after reopening")
        ctx.expect_equal(_ids(await store.flow_runs("q")), ["w1"], "queued runs after reopening")


async def flow_runs_enqueue_and_dedup(ctx: ScenarioContext) -> None:
    """enqueue gives increasing seqs, state queued; the same dedup id or workflow id in a
    queue finds the entry there and writes nothing; another queue is independent; finish removes."""
    async with ctx.open() as store:
        first, created = await store.enqueue_flow_run(_run("w1", dedup="d"))
        ctx.expect_equal(
            (created, first.state, first.workflow_id, first.dedup_id),
            (True, QUEUED, "w1", "d"),
            "the first enqueue",
        )
        second, _ = await store.enqueue_flow_run(_run("w2"))
        ctx.expect(second.seq > first.seq, f"seqs increase, got {first.seq} then {second.seq}")
        twin, created = await store.enqueue_flow_run(_run("w3", dedup="d"))
        ctx.expect_equal((created, twin.workflow_id), (False, "w1"), "an enqueue with a held dedup id")
        twin, created = await store.enqueue_flow_run(_run("w2", dedup="other"))
        ctx.expect_equal((created, twin.workflow_id), (False, "w2"), "an enqueue of a held workflow id")
        _, created = await store.enqueue_flow_run(_run("w3", queue="q2", dedup="d"))
        ctx.expect_equal(created, True, "the same dedup id in another queue")
        ctx.expect_equal(_ids(await store.flow_runs("q")), ["w1", "w2"], "flow_runs('q')")
        ctx.expect_equal(sorted(_ids(await store.flow_runs())), ["w1", "w2", "w3"], "flow_runs()")
        ctx.expect_equal(await store.finish_flow_run("q", "w1"), True, "finish_flow_run()")
        ctx.expect_equal(await store.finish_flow_run("q", "w1"), False, "finish_flow_run() again")
        _, created = await store.enqueue_flow_run(_run("w4", dedup="d"))
        ctx.expect_equal(created, True, "the dedup id once its run finished")


async def flow_runs_admitted_in_order_within_bounds(ctx: ScenarioContext) -> None:
    """admit takes queued runs by (priority, seq), at most ``concurrency`` admitted per
    partition at once; a finished run frees its partition's place."""
    async with ctx.open() as store:
        for wid, prio, part in (
            ("a1", 5, "A"),
            ("a2", 1, "A"),
            ("a3", 1, "A"),
            ("b1", 9, "B"),
            ("b2", 0, "B"),
        ):
            await store.enqueue_flow_run(_run(wid, priority=prio, partition=part))
        admitted, retry = await store.admit_flow_runs("q", concurrency=2, rate=None, period=1.0, now=_at(0))
        ctx.expect_equal(
            (sorted(_ids(admitted)), retry), (["a2", "a3", "b1", "b2"], None), "the first admission"
        )
        ctx.expect(all(r.state == ADMITTED for r in admitted), f"admitted entries say so: {short(admitted)}")
        admitted, _ = await store.admit_flow_runs("q", concurrency=2, rate=None, period=1.0, now=_at(0))
        ctx.expect_equal(_ids(admitted), [], "an admission with every partition full")
        await store.finish_flow_run("q", "a2")
        admitted, _ = await store.admit_flow_runs("q", concurrency=2, rate=None, period=1.0, now=_at(1))
        ctx.expect_equal(_ids(admitted), ["a1"], "an admission after a run of A finished")
        states = {r.workflow_id: r.state for r in await store.flow_runs("q")}
        ctx.expect_equal(set(states.values()), {ADMITTED}, "every remaining entry admitted")
        await store.enqueue_flow_run(_run("c1"))
        await store.enqueue_flow_run(_run("c2"))
        admitted, _ = await store.admit_flow_runs(
            "q", concurrency=None, rate=None, period=1.0, now=_at(1), limit=1
        )
        ctx.expect_equal(_ids(admitted), ["c1"], "an admission limited to one")


async def flow_runs_admitted_at_the_rate(ctx: ScenarioContext) -> None:
    """admit counts one start per admitted run against ``rate`` per ``period`` of the run's
    partition and says when the next start frees up."""
    async with ctx.open() as store:
        for index in range(4):
            await store.enqueue_flow_run(_run(f"w{index}"))
        admitted, retry = await store.admit_flow_runs("q", concurrency=None, rate=2, period=10.0, now=_at(0))
        ctx.expect_equal((_ids(admitted), retry), (["w0", "w1"], 10.0), "admission at t=0 (2 per 10 s)")
        admitted, retry = await store.admit_flow_runs("q", concurrency=None, rate=2, period=10.0, now=_at(3))
        ctx.expect_equal((_ids(admitted), retry), ([], 7.0), "admission at t=3")
        admitted, _ = await store.admit_flow_runs("q", concurrency=None, rate=2, period=10.0, now=_at(10))
        ctx.expect_equal(_ids(admitted), ["w2", "w3"], "admission at t=10")


async def flow_waiters_recorded_replaced_and_removed(ctx: ScenarioContext) -> None:
    """A waiter record reads back whole, lapsing ``ttl`` after it was recorded; recording the
    same (workflow, run, activity) replaces it; others are independent and read in (run id,
    activity id) order; remove and clear take them away; a bad record is refused."""
    async with ctx.open() as store:
        first = _waiter(since=1)
        await _record(store, first, 2, ttl=10)
        found = await store.flow_waiters(first.workflow_id, now=_at(3))
        ctx.expect_equal(found, [attrs.evolve(first, expires_at=_at(12))], "the record read back")
        await _record(store, _waiter(attempt=2, pool="task_queue:emails"), 4)
        await _record(store, _waiter(activity_id=1), 4)
        await _record(store, _waiter(activity_id=2, run_id="run-0"), 4)
        await _record(store, _waiter("other", 3), 4)
        found = await store.flow_waiters(first.workflow_id, now=_at(5))
        ctx.expect_equal(
            _waits(found),
            [
                ("run-0", 2, 1, "activity:charge"),
                ("run-1", 1, 1, "activity:charge"),
                ("run-1", 3, 2, "task_queue:emails"),
            ],
            "the workflow's records after one was replaced",
        )
        ctx.expect_equal(await store.remove_flow_waiter(first.workflow_id, "run-1", 3), True, "remove")
        ctx.expect_equal(await store.remove_flow_waiter(first.workflow_id, "run-1", 3), False, "remove again")
        found = await store.flow_waiters(first.workflow_id, now=_at(5))
        ctx.expect_equal(
            _waits(found),
            [("run-0", 2, 1, "activity:charge"), ("run-1", 1, 1, "activity:charge")],
            "after a removal",
        )
        ctx.expect_equal(len(await store.flow_waiters("other", now=_at(5))), 1, "another workflow's record")
        with ctx.expect_raises(ValueError, "record_flow_waiter() with an empty pool name"):
            await _record(store, attrs.evolve(first, pool=""), 5)
        ctx.expect_equal(await store.clear_flow_waiters(), 3, "clear_flow_waiters()")
        ctx.expect_equal(await store.flow_waiters(first.workflow_id, now=_at(5)), [], "after clearing")
        ctx.expect_equal(await store.flow_waiters("other", now=_at(5)), [], "another workflow after clearing")


async def flow_waiters_lapse_unless_renewed(ctx: ScenarioContext) -> None:
    """A waiter record no longer reads once ``now`` reaches its expiry; renewing its holder's
    permits renews its records too (and counts them); another holder's record lapses."""
    async with ctx.open() as store:
        await _record(store, _waiter(activity_id=1, holder="a"), 0, ttl=10)
        await _record(store, _waiter(activity_id=2, holder="b"), 0, ttl=10)
        ctx.expect_equal(
            [w.activity_id for w in await store.flow_waiters("wf-ünï/1", now=_at(5))], [1, 2], "both at t=5"
        )
        ctx.expect_equal(
            await store.renew_flow_permits("a", ttl=10, now=_at(8)), 1, "renew_flow_permits('a')"
        )
        found = await store.flow_waiters("wf-ünï/1", now=_at(15))
        ctx.expect_equal(
            [(w.activity_id, w.expires_at) for w in found], [(1, _at(18))], "at t=15 (a's renewed until 18)"
        )
        ctx.expect_equal(await store.flow_waiters("wf-ünï/1", now=_at(18)), [], "at the renewed expiry")
        ctx.expect_equal(
            await store.renew_flow_permits("a", ttl=10, now=_at(19)), 0, "renewing a lapsed record"
        )


async def flow_every_method_is_a_checkpoint(ctx: ScenarioContext) -> None:
    """Every flow method is a Trio checkpoint."""
    async with ctx.open() as store:
        await ctx.expect_checkpoint("acquire_flow_permit()", lambda: _permit(store, "k", 0, concurrency=1))
        await ctx.expect_checkpoint(
            "acquire_flow_permit() refused", lambda: _permit(store, "k", 0, concurrency=1)
        )
        await ctx.expect_checkpoint("release_flow_permit()", lambda: store.release_flow_permit("k", "0"))
        await ctx.expect_checkpoint(
            "renew_flow_permits()", lambda: store.renew_flow_permits("x", ttl=1, now=_at(0))
        )
        await ctx.expect_checkpoint("held_flow_permits()", lambda: store.held_flow_permits("k", now=_at(0)))
        await ctx.expect_checkpoint("enqueue_flow_run()", lambda: store.enqueue_flow_run(_run("w")))
        await ctx.expect_checkpoint(
            "admit_flow_runs()",
            lambda: store.admit_flow_runs("q", concurrency=1, rate=None, period=1.0, now=_at(0)),
        )
        await ctx.expect_checkpoint("flow_runs()", lambda: store.flow_runs("q"))
        await ctx.expect_checkpoint("finish_flow_run()", lambda: store.finish_flow_run("q", "w"))
        await ctx.expect_checkpoint("record_flow_waiter()", lambda: _record(store, _waiter(), 0))
        await ctx.expect_checkpoint("flow_waiters()", lambda: store.flow_waiters("wf-ünï/1", now=_at(0)))
        await ctx.expect_checkpoint(
            "remove_flow_waiter()", lambda: store.remove_flow_waiter("wf-ünï/1", "run-1", 3)
        )
        await ctx.expect_checkpoint("clear_flow_waiters()", lambda: store.clear_flow_waiters())


async def flow_use_after_close(ctx: ScenarioContext) -> None:
    """After the store is closed, flow methods raise trio.ClosedResourceError."""
    async with ctx.open() as store:
        await store.aclose()
        with ctx.expect_raises(trio.ClosedResourceError, "acquire_flow_permit() after aclose()"):
            await _permit(store, "k", 0, concurrency=1)
        with ctx.expect_raises(trio.ClosedResourceError, "enqueue_flow_run() after aclose()"):
            await store.enqueue_flow_run(_run("w"))
        with ctx.expect_raises(trio.ClosedResourceError, "record_flow_waiter() after aclose()"):
            await _record(store, _waiter(), 0)
        with ctx.expect_raises(trio.ClosedResourceError, "flow_waiters() after aclose()"):
            await store.flow_waiters("wf-ünï/1", now=_at(0))
