"""Workflow queues (issue 18, items 2 and 3; docs/flow-control.md).

``engine.enqueue(workflow, ..., queue=NAME)`` puts a run into a queue of
``EngineConfig.workflow_queues``; the engine admits runs under the queue's
:class:`~aion_trio.FlowLimit` (``concurrency`` runs at once, ``rate`` per
``period``, per partition key in a partitioned queue) by priority then order of
arrival, and starts each through ``Engine.start``.  A ``dedup_id`` held by a
queued or running run refuses a second enqueue.  Each test runs on a memory
store and on a SQLite file.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import trio
import trio.testing

import aion_trio as aion


class Probe:
    def __init__(self) -> None:
        self.running: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.began: list[tuple[str, float]] = []
        self.release = trio.Event()

    async def hold(self, group: str, tag: str, seconds: float) -> str:
        self.running[group] = self.running.get(group, 0) + 1
        self.peak[group] = max(self.peak.get(group, 0), self.running[group])
        self.began.append((tag, trio.current_time()))
        try:
            if seconds < 0:
                await self.release.wait()
            else:
                await trio.sleep(seconds)
        finally:
            self.running[group] -= 1
        return tag


probe = Probe()


@pytest.fixture(autouse=True)
def fresh_probe() -> None:
    global probe
    probe = Probe()


@aion.activity
async def step(group: str, tag: str, seconds: float) -> str:
    return await probe.hold(group, tag, seconds)


@aion.workflow
async def job(ctx: aion.WorkflowContext, group: str, tag: str, seconds: float) -> str:
    return await ctx.run(step, group, tag, seconds)


QUEUES = {
    "serial": aion.FlowLimit(concurrency=1),
    "pair": aion.FlowLimit(concurrency=2),
    "paced": aion.FlowLimit(rate=2, period=10.0),
    "emails": aion.FlowLimit(concurrency=1, partitioned=True),
    "cluster_pair": aion.FlowLimit(cluster_concurrency=2),
    "both": aion.FlowLimit(concurrency=3, cluster_concurrency=1),
}


def engine_on(url: str, **config: Any) -> Any:
    return aion.open_engine(
        url,
        workflows=[job],
        activities=[step],
        config=aion.EngineConfig(workflow_queues=QUEUES, **config),
    )


async def test_a_one_at_a_time_queue_runs_its_runs_in_turn(
    flow_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    async with engine_on(flow_url()) as engine:
        with trio.fail_after(600):
            handles = [await engine.enqueue(job, "g", f"t{i}", 2.0, queue="serial") for i in range(4)]
            assert [await h.result() for h in handles] == ["t0", "t1", "t2", "t3"]
    assert probe.peak["g"] == 1
    assert [tag for tag, _ in probe.began] == ["t0", "t1", "t2", "t3"]


async def test_a_queue_admits_up_to_its_concurrency(
    flow_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    async with engine_on(flow_url()) as engine:
        with trio.fail_after(600):
            handles = [await engine.enqueue(job, "g", f"t{i}", 2.0, queue="pair") for i in range(6)]
            for h in handles:
                await h.result()
    assert probe.peak["g"] == 2


async def test_a_queue_s_cluster_concurrency_bounds_its_runs_the_smaller_bound_holding(
    flow_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    # A queue's admitted runs are counted in the store, which every engine on it
    # shares: cluster_concurrency is that bound too (it was once ignored: no bound).
    async with engine_on(flow_url()) as engine:
        with trio.fail_after(600):
            for queue in ("cluster_pair", "both"):
                handles = [await engine.enqueue(job, queue, f"t{i}", 2.0, queue=queue) for i in range(5)]
                for h in handles:
                    await h.result()
    assert probe.peak == {"cluster_pair": 2, "both": 1}


async def test_a_rate_limited_queue_spaces_its_starts(
    flow_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    async with engine_on(flow_url()) as engine:
        with trio.fail_after(600):
            start = trio.current_time()
            handles = [await engine.enqueue(job, "g", f"t{i}", 0.0, queue="paced") for i in range(6)]
            for h in handles:
                await h.result()
    times = sorted(t - start for _, t in probe.began)
    for i in range(len(times) - 2):
        assert times[i + 2] - times[i] >= 10.0 - 1e-6
    assert times[-1] < 40.0


async def test_a_dedup_id_is_refused_while_its_run_is_queued_or_running(
    flow_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    async with engine_on(flow_url()) as engine:
        with trio.fail_after(600):
            blocker = await engine.enqueue(job, "g", "block", -1, queue="serial", dedup_id="nightly")
            queued = await engine.enqueue(job, "g", "second", 0.0, queue="serial", dedup_id="report")
            await trio.sleep(5)  # the blocker runs; "report" waits behind it
            for dedup, holder in (("nightly", blocker), ("report", queued)):
                with pytest.raises(aion.QueueDeduplicated) as info:
                    await engine.enqueue(job, "g", "again", 0.0, queue="serial", dedup_id=dedup)
                assert info.value.workflow_id == holder.workflow_id
            # Another queue may hold the same id.
            other = await engine.enqueue(job, "h", "elsewhere", 0.0, queue="pair", dedup_id="nightly")
            await other.result()
            probe.release.set()
            await blocker.result()
            await queued.result()
            # Once its run ended, the id may be used again.
            again = await engine.enqueue(job, "g", "again", 0.0, queue="serial", dedup_id="nightly")
            assert await again.result() == "again"
    assert [tag for tag, _ in probe.began].count("again") == 1


async def test_queued_runs_start_by_priority_then_in_order(
    flow_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    async with engine_on(flow_url()) as engine:
        with trio.fail_after(600):
            first = await engine.enqueue(job, "g", "block", -1, queue="serial")
            await trio.sleep(5)
            handles = [
                await engine.enqueue(job, "g", tag, 0.0, queue="serial", priority=prio)
                for tag, prio in (("r1", 5), ("u1", 1), ("r2", 5), ("u2", 1))
            ]
            probe.release.set()
            await first.result()
            for h in handles:
                await h.result()
    assert [tag for tag, _ in probe.began] == ["block", "u1", "u2", "r1", "r2"]


async def test_a_partitioned_queue_bounds_each_key_on_its_own(
    flow_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    async with engine_on(flow_url()) as engine:
        with trio.fail_after(600):
            handles = [
                await engine.enqueue(
                    job, customer, f"{customer}{i}", 2.0, queue="emails", partition_key=customer
                )
                for i in range(3)
                for customer in ("ann", "bob")
            ]
            for h in handles:
                await h.result()
    # One run per customer at a time, both customers at once.
    assert (probe.peak["ann"], probe.peak["bob"]) == (1, 1)
    starts = sorted({round(t, 3) for _, t in probe.began})
    assert len(starts) == 3


async def test_queued_runs_survive_a_restart_and_none_is_started_twice(
    flow_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    url = flow_url()
    with trio.fail_after(600):
        async with engine_on(url) as engine:
            handles = [await engine.enqueue(job, "g", f"t{i}", 3.0, queue="serial") for i in range(3)]
            await trio.sleep(1)  # t0 runs, t1 and t2 wait
        ids = [h.workflow_id for h in handles]
        async with engine_on(url) as engine:
            for workflow_id in ids:
                while True:  # not started until its turn comes: not found until then
                    try:
                        await engine.result(workflow_id)
                        break
                    except aion.WorkflowNotFound:
                        await trio.sleep(1)
            histories = [await engine.history(workflow_id) for workflow_id in ids]
    assert [sum(type(e.body).__name__ == "WorkflowStarted" for e in h) for h in histories] == [1, 1, 1]
    assert probe.peak["g"] == 1


async def test_enqueue_refuses_bad_input_and_writes_nothing(flow_url: Callable[[], str]) -> None:
    async with engine_on(flow_url()) as engine:
        with pytest.raises(aion.UnknownQueue, match="'nope'"):
            await engine.enqueue(job, "g", "t", 0.0, queue="nope")
        with pytest.raises(ValueError, match="partition_key"):
            await engine.enqueue(job, "g", "t", 0.0, queue="emails")
        with pytest.raises(ValueError, match="not partitioned"):
            await engine.enqueue(job, "g", "t", 0.0, queue="serial", partition_key="x")
        with pytest.raises(aion.PayloadNotSerializable):
            await engine.enqueue(job, "g", object(), 0.0, queue="serial")
        with pytest.raises(aion.UnknownWorkflowType):
            await engine.enqueue("missing", queue="serial")
        assert await engine.store.flow_runs() == []  # type: ignore[attr-defined]
