"""A burst of starts (issue 17): what each waiting start and each finished run costs the loop.

Thousands of starts at once wait on the engine's start pool: a release must wake
the one waiter it admits, not the next in line as well (a wake-up that finds no
slot is a wasted task step per admission, 20,000 of them in a burst).  A run that
finished must be freed by reference counting: objects of a run held in a cycle
are left to the cycle collector, whose pauses then grow with the burst and stall
every timer of the engine.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import pytest
import trio
import trio.testing

import aion_trio as aion
from aion_trio.events import Event


class Scheduled(trio.abc.Instrument):
    """Records each time a watched task was scheduled to run (woken)."""

    def __init__(self) -> None:
        self.watched: dict[trio.lowlevel.Task, str] = {}
        self.woken: list[str] = []

    def task_scheduled(self, task: trio.lowlevel.Task) -> None:
        name = self.watched.get(task)
        if name is not None:
            self.woken.append(name)


class GatedEvents:
    """An event store whose append of workflow ``w`` waits until ``gates[w]`` is set."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.gates: dict[str, trio.Event] = {}
        self.appended: list[str] = []  # workflow ids, as their appends reached the store

    @property
    def started(self) -> list[str]:
        """The workflows in the order their first append (the start) reached the store."""
        return list(dict.fromkeys(self.appended))

    async def append(self, workflow_id: str, events: Sequence[Event], expected_seq: int) -> None:
        self.appended.append(workflow_id)
        gate = self.gates.get(workflow_id)
        if gate is not None:
            await gate.wait()
        await self.inner.append(workflow_id, events, expected_seq)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class GatedStore:
    def __init__(self, inner: Any) -> None:
        self.events = GatedEvents(inner.events)
        self.visibility = inner.visibility

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()


@aion.workflow(name="burst_quick")
async def quick(ctx: aion.WorkflowContext) -> str:
    return ctx.workflow_id


@contextlib.asynccontextmanager
async def burst(
    limit: int, holders: list[str], waiters: list[str]
) -> AsyncIterator[tuple[GatedEvents, Scheduled, trio.Nursery]]:
    """An engine with ``max_inflight_starts=limit``: ``holders`` start first and hold their
    slots (their appends wait on their gates), then ``waiters`` queue, in that order."""
    config = aion.EngineConfig(max_inflight_starts=limit)
    scheduled = Scheduled()
    async with aion.open_store("memory://") as inner:
        store = GatedStore(inner)
        for name in (*holders, *waiters):
            store.events.gates[name] = trio.Event()
        async with aion.open_engine(store, workflows=[quick], config=config) as engine:

            async def start(workflow_id: str) -> None:
                scheduled.watched[trio.lowlevel.current_task()] = workflow_id
                await engine.start(quick, workflow_id=workflow_id)

            trio.lowlevel.add_instrument(scheduled)
            try:
                with trio.fail_after(10):
                    async with trio.open_nursery() as nursery:
                        for name in (*holders, *waiters):
                            nursery.start_soon(start, name)
                            await trio.testing.wait_all_tasks_blocked()
                        assert store.events.started == holders
                        scheduled.woken.clear()
                        yield store.events, scheduled, nursery
                        for gate in store.events.gates.values():
                            gate.set()
            finally:
                trio.lowlevel.remove_instrument(scheduled)


async def test_a_start_admitted_from_the_queue_wakes_no_other_waiting_start() -> None:
    waiters = ["w0", "w1", "w2"]
    async with burst(1, ["holder"], waiters) as (events, scheduled, _):
        for name, admitted in (("holder", "w0"), ("w0", "w1"), ("w1", "w2")):
            events.gates[name].set()
            await trio.testing.wait_all_tasks_blocked()
            # The slot went to the next start in arrival order (it now waits at its own
            # append); no start behind it was woken to find the slot taken.
            assert events.started[-1] == admitted
            behind = waiters[waiters.index(admitted) + 1 :]
            assert [w for w in scheduled.woken if w in behind] == []
            scheduled.woken.clear()


async def test_two_slots_freed_at_once_admit_two_waiting_starts() -> None:
    async with burst(2, ["h0", "h1"], ["w0", "w1", "w2"]) as (events, _, _):
        events.gates["h0"].set()
        events.gates["h1"].set()
        await trio.testing.wait_all_tasks_blocked()
        # The first admitted passes the turn on while a slot is still free.
        assert events.started == ["h0", "h1", "w0", "w1"]


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
