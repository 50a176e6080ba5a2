"""Flow control of activity attempts (issue 18, item 1; docs/flow-control.md).

``EngineConfig.activity_limits`` / ``task_queue_limits`` hold one
:class:`~aion_trio.FlowLimit` per activity type / task queue: at most
``concurrency`` attempts at once in this engine, at most ``rate`` starts per
``period`` (counted in the store, so a restart does not reset it), waiting
attempts admitted by priority (lower first, FIFO within), the wait visible in
``describe()`` and ``statistics()`` and not counted against the attempt's
``timeout``.  Each test runs on a memory store and on a SQLite file.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import trio
import trio.testing

import aion_trio as aion


class Probe:
    """What the activities saw: how many ran at once (peak), the order and times they began."""

    def __init__(self) -> None:
        self.running = 0
        self.peak = 0
        self.began: list[tuple[str, float]] = []
        self.release = trio.Event()

    async def hold(self, tag: str, seconds: float) -> str:
        self.running += 1
        self.peak = max(self.peak, self.running)
        self.began.append((tag, trio.current_time()))
        try:
            if seconds < 0:
                await self.release.wait()
            else:
                await trio.sleep(seconds)
        finally:
            self.running -= 1
        return tag


probe = Probe()


@aion.activity
async def work(tag: str, seconds: float) -> str:
    return await probe.hold(tag, seconds)


@aion.activity(task_queue="emails")
async def email(tag: str, seconds: float) -> str:
    return await probe.hold(tag, seconds)


@aion.activity(priority=1, task_queue="ordered")
async def urgent(tag: str) -> str:
    return await probe.hold(tag, 0)


@aion.activity(priority=5, task_queue="ordered")
async def routine(tag: str) -> str:
    return await probe.hold(tag, 0)


@aion.activity(task_queue="ordered")
async def blocker(tag: str) -> str:
    return await probe.hold(tag, -1)


@aion.activity(timeout=5.0)
async def bounded(tag: str, seconds: float) -> str:
    return await probe.hold(tag, seconds)


@aion.workflow
async def fan_out(ctx: aion.WorkflowContext, n: int, seconds: float) -> list[str]:
    handles = [ctx.start(work, f"w{i}", seconds) for i in range(n)]
    return [await h for h in handles]


@aion.workflow
async def fan_out_emails(ctx: aion.WorkflowContext, n: int) -> list[str]:
    handles = [ctx.start(email, f"e{i}", 3.0) for i in range(n)]
    handles += [ctx.start(work, f"w{i}", 3.0) for i in range(n)]
    return [await h for h in handles]


@aion.workflow
async def by_priority(ctx: aion.WorkflowContext) -> list[str]:
    # One at a time, a second apart, so they reach the pool in this order.
    first = ctx.start(blocker, "block")
    await ctx.sleep(1)
    handles = []
    for activity, tag in ((routine, "r1"), (urgent, "u1"), (routine, "r2"), (urgent, "u2")):
        handles.append(ctx.start(activity, tag))
        await ctx.sleep(1)
    results = [await first]
    return results + [await h for h in handles]


@aion.workflow
async def two_bounded(ctx: aion.WorkflowContext) -> list[str]:
    handles = [ctx.start(bounded, "slow", 4.0), ctx.start(bounded, "waits", 4.0)]
    return [await h for h in handles]


@pytest.fixture(autouse=True)
def fresh_probe() -> None:
    global probe
    probe = Probe()


def engine_on(url: str, config: aion.EngineConfig) -> object:
    return aion.open_engine(
        url,
        workflows=[fan_out, fan_out_emails, by_priority, two_bounded],
        activities=[work, email, urgent, routine, blocker, bounded],
        config=config,
    )


async def test_an_activity_type_limit_bounds_its_attempts_at_once(
    flow_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    config = aion.EngineConfig(activity_limits={"work": aion.FlowLimit(concurrency=3)})
    async with engine_on(flow_url(), config) as engine:  # type: ignore[attr-defined]
        with trio.fail_after(600):
            run = await engine.start(fan_out, 10, 1.0)
            assert len(await run.result()) == 10
    assert probe.peak == 3


async def test_a_task_queue_limit_bounds_that_queue_only(
    flow_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    config = aion.EngineConfig(task_queue_limits={"emails": aion.FlowLimit(concurrency=1)})
    async with engine_on(flow_url(), config) as engine:  # type: ignore[attr-defined]
        with trio.fail_after(600):
            run = await engine.start(fan_out_emails, 4)
            assert len(await run.result()) == 8
    emails = [t for tag, t in probe.began if tag.startswith("e")]
    others = [t for tag, t in probe.began if tag.startswith("w")]
    # One email at a time (3 s each); the default queue's four started together.
    assert [round(b - a, 3) for a, b in itertools.pairwise(emails)] == [3.0, 3.0, 3.0]
    assert len(set(others)) == 1


async def test_waiting_attempts_are_admitted_by_priority_then_in_order(
    flow_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    config = aion.EngineConfig(task_queue_limits={"ordered": aion.FlowLimit(concurrency=1)})
    async with engine_on(flow_url(), config) as engine:  # type: ignore[attr-defined]
        with trio.fail_after(600):
            run = await engine.start(by_priority, workflow_id="prio")
            # The workflow schedules its last activity at t=4 s; the engine is idle at t=10 s.
            await trio.sleep(10)
            # The wait is visible: each waiting attempt names its pool; the pool counts them.
            description = await engine.describe("prio")
            waiting = {p.activity_type: p.waiting_for for p in description.pending_activities}
            assert waiting == {
                "blocker": None,
                "routine": "task_queue:ordered",
                "urgent": "task_queue:ordered",
            }
            pool = next(p for p in engine.statistics().flow_pools if p.name == "task_queue:ordered")
            assert (pool.capacity, pool.held, pool.waiting) == (1, 1, 4)
            probe.release.set()
            await run.result()
    assert [tag for tag, _ in probe.began] == ["block", "u1", "u2", "r1", "r2"]


async def test_a_rate_limit_spaces_starts_over_time(
    flow_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    config = aion.EngineConfig(activity_limits={"work": aion.FlowLimit(rate=2, period=10.0)})
    async with engine_on(flow_url(), config) as engine:  # type: ignore[attr-defined]
        with trio.fail_after(600):
            start = trio.current_time()
            run = await engine.start(fan_out, 6, 0.0)
            await run.result()
    times = sorted(t - start for _, t in probe.began)
    # Never more than 2 starts in any 10 s window, and no start later than it must be.
    for i in range(len(times) - 2):
        assert times[i + 2] - times[i] >= 10.0 - 1e-6
    assert times[-1] < 30.0


async def test_a_rate_limit_survives_a_restart(
    flow_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    url = flow_url()
    config = aion.EngineConfig(activity_limits={"work": aion.FlowLimit(rate=2, period=60.0)})
    with trio.fail_after(600):
        async with engine_on(url, config) as engine:  # type: ignore[attr-defined]
            first = trio.current_time()
            await (await engine.start(fan_out, 2, 0.0)).result()
        async with engine_on(url, config) as engine:  # type: ignore[attr-defined]
            await (await engine.start(fan_out, 1, 0.0)).result()
    # The third start came from a new engine, and still waited for the window.
    assert probe.began[2][1] - first >= 60.0 - 1e-6


async def test_waiting_for_a_slot_does_not_count_against_the_attempt_timeout(
    flow_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    # Each attempt runs 4 s under a 5 s timeout; the second waits 4 s for the only slot.
    config = aion.EngineConfig(activity_limits={"bounded": aion.FlowLimit(concurrency=1)})
    async with engine_on(flow_url(), config) as engine:  # type: ignore[attr-defined]
        with trio.fail_after(600):
            run = await engine.start(two_bounded)
            assert await run.result() == ["slow", "waits"]
    assert [round(t, 3) for _, t in probe.began][1] - probe.began[0][1] == pytest.approx(4.0)


async def test_flow_limit_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="concurrency"):
        aion.FlowLimit(concurrency=0)
    with pytest.raises(ValueError, match="period"):
        aion.FlowLimit(rate=1, period=0)
    with pytest.raises(TypeError, match="FlowLimit"):
        aion.EngineConfig(activity_limits={"work": 3})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="only workflow queues"):
        aion.EngineConfig(activity_limits={"work": aion.FlowLimit(concurrency=1, partitioned=True)})
    with pytest.raises(TypeError, match="priority"):
        aion.activity(priority="high")  # type: ignore[arg-type]


class NoFlowStore:
    """A store without the flow capability (events and visibility only)."""

    def __init__(self, inner: aion.Store) -> None:
        self.events = inner.events
        self.visibility = inner.visibility

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()


async def test_a_cluster_wide_bound_needs_a_flow_store() -> None:
    config = aion.EngineConfig(activity_limits={"work": aion.FlowLimit(cluster_concurrency=2)})
    async with aion.open_store("memory://") as inner:
        with pytest.raises(aion.FlowControlUnsupported, match="cluster_concurrency"):
            async with aion.open_engine(NoFlowStore(inner), activities=[work], config=config):
                pass  # pragma: no cover
