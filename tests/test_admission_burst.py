"""A burst of starts (issue 17): what each waiting start and each finished run costs the loop.

Thousands of starts at once wait on the engine's start pool: a release must wake
the one waiter it admits, not the next in line as well (a wake-up that finds no
slot is a wasted task step per admission, 20,000 of them in a burst).  A run that
finished must be freed by reference counting: objects of a run held in a cycle
are left to the cycle collector, whose pauses then grow with the burst and stall
every timer of the engine.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import trio
import trio.testing

import aion_trio as aion
from aion_trio._admission import AdmissionPool


class Scheduled(trio.abc.Instrument):
    """Counts how often each watched task was scheduled to run (woken)."""

    def __init__(self) -> None:
        self.watched: dict[trio.lowlevel.Task, str] = {}
        self.woken: list[str] = []

    def task_scheduled(self, task: trio.lowlevel.Task) -> None:
        name = self.watched.get(task)
        if name is not None:
            self.woken.append(name)


async def test_a_release_wakes_only_the_waiter_it_admits_in_arrival_order() -> None:
    pool = AdmissionPool("starts", 1)
    scheduled = Scheduled()
    admitted: list[str] = []
    release = {name: trio.Event() for name in ("holder", "w0", "w1", "w2")}

    async def hold(name: str) -> None:
        scheduled.watched[trio.lowlevel.current_task()] = name
        async with pool.slot():
            admitted.append(name)
            await release[name].wait()

    trio.lowlevel.add_instrument(scheduled)
    try:
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                for name in ("holder", "w0", "w1", "w2"):
                    nursery.start_soon(hold, name)
                    await trio.testing.wait_all_tasks_blocked()
                assert (admitted, pool.held, pool.waiting) == (["holder"], 1, 3)
                scheduled.woken.clear()
                for name, following in (("holder", "w0"), ("w0", "w1"), ("w1", "w2")):
                    release[name].set()
                    await trio.testing.wait_all_tasks_blocked()
                    # The releaser ran on; of the waiters only the one admitted woke, once.
                    assert [w for w in scheduled.woken if w != name] == [following]
                    assert admitted[-1] == following
                    assert pool.held == 1
                    scheduled.woken.clear()
                release["w2"].set()
    finally:
        trio.lowlevel.remove_instrument(scheduled)
    assert admitted == ["holder", "w0", "w1", "w2"]
    assert (pool.held, pool.waiting) == (0, 0)


async def test_two_releases_at_once_admit_two_waiters() -> None:
    pool = AdmissionPool("starts", 2)
    admitted: list[str] = []
    release = {name: trio.Event() for name in ("h0", "h1", "w0", "w1", "w2")}

    async def hold(name: str) -> None:
        async with pool.slot():
            admitted.append(name)
            await release[name].wait()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            for name in ("h0", "h1", "w0", "w1", "w2"):
                nursery.start_soon(hold, name)
                await trio.testing.wait_all_tasks_blocked()
            release["h0"].set()
            release["h1"].set()
            await trio.testing.wait_all_tasks_blocked()
            # The first admitted wakes the next while a slot is still free.
            assert admitted == ["h0", "h1", "w0", "w1"]
            assert (pool.held, pool.waiting) == (2, 1)
            for name in ("w0", "w1", "w2"):
                release[name].set()
    assert (pool.held, pool.waiting) == (0, 0)


@pytest.fixture
def collector_off() -> Iterator[None]:
    """The cycle collector off: what a finished run leaves must go by reference counting."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


contexts: list[weakref.ref[Any]] = []


@aion.activity(name="burst_touch")
async def touch(x: int) -> int:
    return x + 1


@aion.workflow(name="burst_short")
async def short(ctx: aion.WorkflowContext, x: int) -> int:
    contexts.append(weakref.ref(ctx))
    ctx.logger.info("running")
    return int(await ctx.run(touch, x))


async def test_a_finished_run_is_freed_without_the_cycle_collector(collector_off: None) -> None:
    contexts.clear()
    config = aion.EngineConfig(gc_thresholds=None, gc_freeze=None)
    with trio.fail_after(10):
        async with aion.open_engine(
            "memory://", workflows=[short], activities=[touch], config=config
        ) as engine:
            for i in range(3):
                handle = await engine.start(short, i, workflow_id=f"short-{i}")
                assert await handle.result() == i + 1
    assert len(contexts) == 3
    # Nothing of a run is left in a cycle: its context went when the engine let go of it.
    assert [ref() for ref in contexts] == [None, None, None]
