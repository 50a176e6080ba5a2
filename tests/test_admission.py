"""Admission control: bounded starts and activity attempts in flight, with backpressure (issue 17).

``EngineConfig.max_inflight_starts`` bounds the starts in flight (a start holds
its slot until its ``WorkflowStarted`` is durable); beyond it a start waits its
turn, or after ``admission_timeout`` raises :class:`~aion_trio.AdmissionTimeout`
having recorded nothing.  ``max_inflight_activities`` bounds activity attempts;
the wait for a slot does not count against the attempt's own ``timeout``.
A start is held in flight by a store whose appends of a chosen workflow wait
on a gate.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import pytest
import trio
import trio.testing

import aion_trio as aion
from aion_trio.events import Event


class GatedEvents:
    """An event store whose appends to the workflows in ``gated`` wait until ``gate`` is set."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.gate = trio.Event()
        self.gated: set[str] = set()
        self.appended: list[str] = []  # workflow ids, each time an append reached the store

    async def append(self, workflow_id: str, events: Sequence[Event], expected_seq: int) -> None:
        self.appended.append(workflow_id)
        if workflow_id in self.gated:
            await self.gate.wait()
        await self.inner.append(workflow_id, events, expected_seq)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class GatedStore:
    def __init__(self, inner: Any) -> None:
        self.events = GatedEvents(inner.events)
        self.visibility = inner.visibility

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()


@aion.workflow
async def quick(ctx: aion.WorkflowContext) -> str:
    return ctx.workflow_id


async def test_a_start_beyond_the_bound_waits_and_proceeds_when_a_slot_frees() -> None:
    config = aion.EngineConfig(max_inflight_starts=1)
    async with aion.open_store("memory://") as inner:
        store = GatedStore(inner)
        store.events.gated.add("first")
        async with aion.open_engine(store, workflows=[quick], config=config) as engine:
            handles: dict[str, aion.RunHandle] = {}

            async def start(workflow_id: str) -> None:
                handles[workflow_id] = await engine.start(quick, workflow_id=workflow_id)

            with trio.fail_after(10):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(start, "first")
                    await trio.testing.wait_all_tasks_blocked()
                    nursery.start_soon(start, "second")
                    await trio.testing.wait_all_tasks_blocked()
                    # The first start holds the only slot (its append waits on the gate):
                    # the second has not reached the store.
                    assert store.events.appended == ["first"]
                    assert handles == {}
                    store.events.gate.set()
                assert await handles["first"].result() == "first"
                assert await handles["second"].result() == "second"


async def test_a_start_that_gets_no_slot_in_time_raises_admission_timeout_and_records_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    config = aion.EngineConfig(max_inflight_starts=1, admission_timeout=5.0)
    async with aion.open_store("memory://") as inner:
        store = GatedStore(inner)
        store.events.gated.add("first")
        async with aion.open_engine(store, workflows=[quick], config=config) as engine:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(functools.partial(engine.start, quick, workflow_id="first"))
                await trio.testing.wait_all_tasks_blocked()
                began = trio.current_time()
                with pytest.raises(aion.AdmissionTimeout) as caught:
                    await engine.start(quick, workflow_id="second")
                assert trio.current_time() - began == pytest.approx(5.0)
                error = caught.value
                assert (error.pool, error.capacity, error.timeout) == ("starts", 1, 5.0)
                assert "EngineConfig.max_inflight_starts" in str(error)
                assert "second" not in store.events.appended
                assert await inner.events.read_history("second") == []
                store.events.gate.set()
            # Nothing was recorded: the same start may simply be made again.
            handle = await engine.start(quick, workflow_id="second")
            assert await handle.result() == "second"


async def test_admission_timeout_zero_refuses_at_once_only_when_every_slot_is_taken(
    autojump_clock: trio.testing.MockClock,
) -> None:
    config = aion.EngineConfig(max_inflight_starts=1, admission_timeout=0)
    async with aion.open_store("memory://") as inner:
        store = GatedStore(inner)
        store.events.gated.add("first")
        async with aion.open_engine(store, workflows=[quick], config=config) as engine:
            # A free slot admits a start at once even with no time to wait.
            assert await (await engine.start(quick, workflow_id="free")).result() == "free"
            async with trio.open_nursery() as nursery:
                nursery.start_soon(functools.partial(engine.start, quick, workflow_id="first"))
                await trio.testing.wait_all_tasks_blocked()
                began = trio.current_time()
                with pytest.raises(aion.AdmissionTimeout):
                    await engine.start(quick, workflow_id="second")
                assert trio.current_time() == began
                store.events.gate.set()


RUNNING: list[str] = []
PEAK: list[int] = []
RELEASE: dict[str, trio.Event] = {}


@aion.activity
async def occupy(name: str) -> str:
    RUNNING.append(name)
    PEAK.append(len(RUNNING))
    try:
        await RELEASE.setdefault("all", trio.Event()).wait()
    finally:
        RUNNING.remove(name)
    return name


@aion.workflow
async def fan_out(ctx: aion.WorkflowContext, n: int) -> list[str]:
    handles = [ctx.start(occupy, f"a{i}") for i in range(n)]
    return list(await ctx.gather(*handles))


async def test_activity_attempts_in_flight_are_bounded() -> None:
    RUNNING.clear()
    PEAK.clear()
    RELEASE.clear()
    config = aion.EngineConfig(max_inflight_activities=2)
    with trio.fail_after(10):
        async with aion.open_engine(
            "memory://", workflows=[fan_out], activities=[occupy], config=config
        ) as engine:
            handle = await engine.start(fan_out, 5)
            while len(RUNNING) < 2:
                await trio.testing.wait_all_tasks_blocked()
            await trio.testing.wait_all_tasks_blocked()
            assert len(RUNNING) == 2  # the other three attempts wait for a slot
            RELEASE["all"].set()
            assert await handle.result() == [f"a{i}" for i in range(5)]
    assert max(PEAK) == 2
    assert len(PEAK) == 5


@aion.activity(timeout=10.0)
async def takes_eight_seconds(name: str) -> float:
    began = trio.current_time()
    await trio.sleep(8)
    return began


@aion.workflow
async def two_slow(ctx: aion.WorkflowContext) -> list[float]:
    return list(await ctx.gather(ctx.start(takes_eight_seconds, "a"), ctx.start(takes_eight_seconds, "b")))


async def test_the_wait_for_a_slot_does_not_count_against_the_attempt_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # One slot: the second attempt waits 8 s for it, then runs 8 s: 16 s after it was
    # dispatched, beyond its 10 s timeout, yet it did not time out (its clock ran 8 s).
    config = aion.EngineConfig(max_inflight_activities=1)
    async with aion.open_engine(
        "memory://", workflows=[two_slow], activities=[takes_eight_seconds], config=config
    ) as engine:
        began = trio.current_time()
        handle = await engine.start(two_slow)
        first, second = await handle.result()
        assert sorted([first - began, second - began]) == [
            pytest.approx(0, abs=0.1),
            pytest.approx(8, abs=0.1),
        ]
        history = await engine.history(handle.workflow_id)
        assert not [e for e in history if isinstance(e.body, aion.ActivityFailed)]


async def test_admission_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="max_inflight_starts"):
        aion.EngineConfig(max_inflight_starts=0)
    with pytest.raises(ValueError, match="max_inflight_activities"):
        aion.EngineConfig(max_inflight_activities=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="admission_timeout"):
        aion.EngineConfig(admission_timeout=-1)
    assert aion.EngineConfig(max_inflight_starts=None).max_inflight_starts is None
