"""What closing an engine and evicting a run cost (issue 17): a run's objects are freed by
reference counting as its code unwinds, and the cycle collector pauses while the close
cancels and joins every run.

The collector is disabled in the tests that check what is freed, so an object that only
a collection would free is seen alive: each test holds weak references to the runs'
``WorkflowContext`` (the root of a run's in-memory graph: replay state, port, logger).
"""

from __future__ import annotations

import gc
import uuid
import weakref
from collections.abc import Iterator
from datetime import timedelta

import pytest
import trio
import trio.testing

import aion_trio as aion

LIMIT = 100 * 86400.0  # Trio seconds: under autojump, virtual time

#: Weak references to the contexts of the runs started by a test.
contexts: list[weakref.ReferenceType[aion.WorkflowContext]] = []
#: Whether the collector was enabled when a parked run's code was unwound at close.
collector_enabled_at_unwind: list[bool] = []


@aion.workflow(name="close_cost_sleeper")
async def sleeper(ctx: aion.WorkflowContext) -> None:
    contexts.append(weakref.ref(ctx))
    ctx.set_query_handler("ping", lambda: "pong")
    ctx.logger.info("parking")  # the context's logger is built: it must not hold the run alive
    await ctx.sleep(timedelta(days=30))


@aion.workflow(name="close_cost_notes_unwind")
async def notes_unwind(ctx: aion.WorkflowContext) -> None:
    try:
        await ctx.sleep(timedelta(days=30))
    finally:
        collector_enabled_at_unwind.append(gc.isenabled())


def url() -> str:
    return f"memory://close-cost-{uuid.uuid4().hex}"


@pytest.fixture(autouse=True)
def fresh_notes() -> Iterator[None]:
    contexts.clear()
    collector_enabled_at_unwind.clear()
    yield
    contexts.clear()
    collector_enabled_at_unwind.clear()


@pytest.fixture
def collector_off() -> Iterator[None]:
    """The cycle collector stays off for the test (what it alone would free stays alive)."""
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def alive() -> int:
    return sum(1 for ref in contexts if ref() is not None)


@pytest.mark.usefixtures("collector_off")
async def test_closing_an_engine_frees_its_parked_runs_without_the_cycle_collector() -> None:
    config = aion.EngineConfig(evict_after=None, max_resident_runs=None, loop_stall_warning=None)
    with trio.fail_after(30):
        async with aion.open_engine(url(), workflows=[sleeper], config=config) as engine:
            for index in range(20):
                await engine.start(sleeper, workflow_id=f"s{index}")
            await trio.testing.wait_all_tasks_blocked()
            assert engine.statistics().resident_runs == 20
            assert alive() == 20
    assert gc.isenabled() is False, "a collector the caller disabled stays disabled after close"
    assert (len(contexts), alive()) == (20, 0)


@pytest.mark.usefixtures("collector_off")
async def test_an_evicted_run_is_freed_without_the_cycle_collector(
    autojump_clock: trio.testing.MockClock,
) -> None:
    config = aion.EngineConfig(evict_after=10.0)
    with trio.fail_after(LIMIT):
        async with aion.open_engine(url(), workflows=[sleeper], config=config) as engine:
            for index in range(5):
                await engine.start(sleeper, workflow_id=f"e{index}")
            await trio.sleep(1)
            assert alive() == 5
            await trio.sleep(10)
            await trio.testing.wait_all_tasks_blocked()
            stats = engine.statistics()
            assert (stats.resident_runs, stats.evicted_runs) == (0, 5)
            assert alive() == 0
            # Woken, an evicted run is replayed with a new context (and evicted again later).
            assert await engine.query("e0", "ping") == "pong"
            assert (len(contexts), alive()) == (6, 1)


async def test_the_collector_is_paused_while_the_engine_cancels_its_runs_and_resumed_after() -> None:
    assert gc.isenabled()
    config = aion.EngineConfig(evict_after=None, loop_stall_warning=None)
    with trio.fail_after(30):
        async with aion.open_engine(url(), workflows=[notes_unwind], config=config) as outer:
            async with aion.open_engine(url(), workflows=[notes_unwind], config=config) as inner:
                await inner.start(notes_unwind, workflow_id="inner")
                await outer.start(notes_unwind, workflow_id="outer")
                await trio.testing.wait_all_tasks_blocked()
            # The inner engine closed while the outer one runs: the collector is back on.
            assert collector_enabled_at_unwind == [False]
            assert gc.isenabled()
    assert collector_enabled_at_unwind == [False, False]
    assert gc.isenabled()
