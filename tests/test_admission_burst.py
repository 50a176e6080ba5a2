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
import functools
import gc
import math
import sys
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


@contextlib.asynccontextmanager
async def held_start_pool(waits: float) -> AsyncIterator[tuple[Any, GatedEvents, trio.Nursery]]:
    """An engine with one start slot, held by ``holder`` (its append waits on its gate),
    and starts that give up after ``waits`` seconds of waiting."""
    config = aion.EngineConfig(max_inflight_starts=1, admission_timeout=waits)
    async with aion.open_store("memory://") as inner:
        store = GatedStore(inner)
        store.events.gates["holder"] = trio.Event()
        async with aion.open_engine(store, workflows=[quick], config=config) as engine:
            with trio.fail_after(60):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(functools.partial(engine.start, quick, workflow_id="holder"))
                    await trio.testing.wait_all_tasks_blocked()
                    assert store.events.started == ["holder"]
                    yield engine, store.events, nursery
                    for gate in store.events.gates.values():
                        gate.set()


async def start_or_time_out(engine: Any, workflow_id: str, refused: list[str]) -> None:
    try:
        await engine.start(quick, workflow_id=workflow_id)
    except aion.AdmissionTimeout:
        refused.append(workflow_id)


async def test_thousands_of_waiting_starts_time_out_at_once_and_the_next_are_admitted_in_order(
    mock_clock: trio.testing.MockClock,
) -> None:
    count = 5_000
    refused: list[str] = []
    async with held_start_pool(waits=1.0) as (engine, events, nursery):
        for i in range(count):
            nursery.start_soon(start_or_time_out, engine, f"t{i}", refused)
        await trio.testing.wait_all_tasks_blocked()
        mock_clock.jump(0.5)
        # Three more arrive half-way: their deadline is half a second after the burst's.
        for name in ("w0", "w1", "w2"):
            events.gates[name] = trio.Event()
            nursery.start_soon(start_or_time_out, engine, name, refused)
            await trio.testing.wait_all_tasks_blocked()
        mock_clock.jump(0.5)  # the whole burst times out at once
        await trio.testing.wait_all_tasks_blocked()
        assert sorted(refused) == sorted(f"t{i}" for i in range(count))
        assert events.started == ["holder"]
        # The slot goes to the waiters left, first come first served, none skipped.
        for name, admitted in (("holder", "w0"), ("w0", "w1"), ("w1", "w2")):
            events.gates[name].set()
            await trio.testing.wait_all_tasks_blocked()
            assert events.started[-1] == admitted
        assert events.started == ["holder", "w0", "w1", "w2"]
        assert len(refused) == count


class Comparisons:
    """Counts the comparisons of waiters the admission module makes (a profile hook: each
    call of a waiter's ``__lt__``), the cost of keeping its queue in order."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, frame: Any, event: str, _: object) -> None:
        code = frame.f_code
        if event == "call" and code.co_name == "__lt__" and code.co_filename.endswith("_admission.py"):
            self.count += 1

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        before = sys.getprofile()
        sys.setprofile(self)
        try:
            yield
        finally:
            sys.setprofile(before)


async def test_waiting_starts_that_time_out_at_once_leave_the_queue_in_logarithmic_time(
    mock_clock: trio.testing.MockClock,
) -> None:
    count = 1_000
    refused: list[str] = []
    comparisons = Comparisons()
    async with held_start_pool(waits=1.0) as (engine, _, nursery):
        for i in range(count):
            nursery.start_soon(start_or_time_out, engine, f"t{i}", refused)
        await trio.testing.wait_all_tasks_blocked()
        with comparisons.counting():
            mock_clock.jump(1.0)
            await trio.testing.wait_all_tasks_blocked()
        assert len(refused) == count
        # O(log n) per waiter leaving: a few comparisons per level of the heap.  A scan and
        # a rebuild of the heap per waiter is O(n) each, some 700,000 comparisons here.
        assert 0 < comparisons.count <= 4 * count * math.log2(count), comparisons.count


queue_began: list[str] = []
queue_release = trio.Event()


@aion.activity(name="burst_queue_hold", task_queue="burst_queue")
async def queue_hold(tag: str) -> str:
    queue_began.append(tag)
    await queue_release.wait()
    return tag


@aion.activity(name="burst_queue_note", task_queue="burst_queue")
async def queue_note(tag: str) -> str:
    queue_began.append(tag)
    return tag


@aion.workflow(name="burst_queue_call")
async def queue_call(ctx: aion.WorkflowContext, tag: str, hold: bool) -> str:
    return str(await ctx.run(queue_hold if hold else queue_note, tag))


async def test_the_waiting_count_is_exact_while_waiters_leave_from_anywhere_in_the_queue(
    autojump_clock: trio.testing.MockClock,
) -> None:
    global queue_release
    queue_began.clear()
    queue_release = trio.Event()
    count = 300
    config = aion.EngineConfig(task_queue_limits={"burst_queue": aion.FlowLimit(concurrency=1)})

    def waiting(engine: aion.Engine) -> int:
        pool = next(p for p in engine.statistics().flow_pools if p.name == "task_queue:burst_queue")
        assert pool.held == 1
        return pool.waiting

    with trio.fail_after(600):
        async with aion.open_engine(
            "memory://", workflows=[queue_call], activities=[queue_hold, queue_note], config=config
        ) as engine:
            await engine.start(queue_call, "holder", True, workflow_id="holder")
            await trio.testing.wait_all_tasks_blocked()
            names = [f"q{i:03}" for i in range(count)]
            for name in names:  # one at a time: they reach the pool in this order
                await engine.start(queue_call, name, False, workflow_id=name)
                await trio.testing.wait_all_tasks_blocked()
            assert waiting(engine) == count
            # Every other one from the back (behind the head), then from the middle (more than
            # half have left by then), then from the head: the count is the waiters still there
            # after each one.
            leaving = names[count - 1 : 0 : -2] + names[count // 3 : count // 2] + names[:10]
            left: set[str] = set()
            for name in leaving:
                if name in left:
                    continue
                await engine.cancel(name)
                await trio.testing.wait_all_tasks_blocked()
                left.add(name)
                assert waiting(engine) == count - len(left), name
            assert queue_began == ["holder"]
            queue_release.set()
            await trio.testing.wait_all_tasks_blocked()
            # The rest got the slot one by one, first come first served.
            assert queue_began == ["holder", *(name for name in names if name not in left)]
