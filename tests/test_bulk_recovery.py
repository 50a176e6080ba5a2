"""Recovery reads the active workflows' histories through ``BulkHistoryReads`` when the store
has it (one call per batch, not one read per workflow), and one workflow at a time when it has
not, or when a batch fails."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

import aion_trio as aion
from aion_trio import Event

LIMIT = 30.0
COUNT = 7


@aion.workflow
async def waits(ctx: aion.WorkflowContext, base: int) -> int:
    return base + int(await ctx.wait_signal("go"))


class _CountedEvents:
    """The inner event store, its ``read_history`` calls counted."""

    def __init__(self, inner: Any, counts: dict[str, int]) -> None:
        self._inner = inner
        self._counts = counts

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def read_history(self, workflow_id: str, from_seq: int = 1) -> list[Event]:
        self._counts["read_history"] += 1
        result: list[Event] = await self._inner.read_history(workflow_id, from_seq)
        return result


class CountingStore:
    """A store bundle over a real one that counts history reads; ``bulk=False`` hides
    ``read_histories``; ``bulk_fails`` makes every ``read_histories`` raise it."""

    def __init__(self, inner: Any, *, bulk_fails: Exception | None = None) -> None:
        self._inner = inner
        self.counts = {"read_history": 0}
        self.batches: list[int] = []
        self.bulk_fails = bulk_fails
        self.events = _CountedEvents(inner.events, self.counts)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @property
    def visibility(self) -> Any:
        return self._inner.visibility

    async def read_histories(self, workflow_ids: Sequence[str]) -> dict[str, list[Event]]:
        self.batches.append(len(workflow_ids))
        if self.bulk_fails is not None:
            await trio.lowlevel.checkpoint()
            raise self.bulk_fails
        result: dict[str, list[Event]] = await self._inner.read_histories(workflow_ids)
        return result

    async def aclose(self) -> None:
        await self._inner.aclose()


class WithoutBulk:
    """A store bundle without the capability (only ``events`` and ``visibility``)."""

    def __init__(self, inner: CountingStore) -> None:
        self.events = inner.events
        self.visibility = inner.visibility

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()


@pytest.fixture(params=["memory", "sqlite"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "memory":
        return f"memory://bulk-{uuid.uuid4().hex}"
    return f"sqlite:///{tmp_path}/bulk.db"


async def _park(store_url: str) -> None:
    async with aion.open_engine(store_url, workflows=[waits]) as engine:
        for index in range(COUNT):
            await engine.start(waits, index, workflow_id=f"wf-{index}")
        await trio.testing.wait_all_tasks_blocked()


async def _until_resident(engine: aion.Engine) -> None:
    """Until every parked run is resident again (the caller bounds the wait)."""
    while True:
        if engine.statistics().resident_runs == COUNT:
            return
        await trio.sleep(0.005)


async def _answer(engine: Any) -> None:
    for index in range(COUNT):
        await engine.signal(f"wf-{index}", "go", 100)
    assert [await engine.result(f"wf-{index}") for index in range(COUNT)] == [
        100 + index for index in range(COUNT)
    ]


async def test_recovery_reads_every_history_in_one_bulk_call(store_url: str) -> None:
    with trio.fail_after(LIMIT):
        await _park(store_url)
        async with aion.open_store(store_url) as inner:
            store = CountingStore(inner)
            async with aion.open_engine(store, workflows=[waits]) as engine:
                # Open has returned: every history came from one bulk read, none one by one.
                assert (store.batches, store.counts["read_history"]) == ([COUNT], 0)
                # Every run recovered and registered (lazy recovery: replayed in the background).
                await _until_resident(engine)
                assert (engine.statistics().registered_leases, engine.statistics().evicted_runs) == (COUNT, 0)
                await _answer(engine)


async def test_recovery_reads_one_history_at_a_time_from_a_store_without_bulk_reads(
    store_url: str,
) -> None:
    with trio.fail_after(LIMIT):
        await _park(store_url)
        async with aion.open_store(store_url) as inner:
            counting = CountingStore(inner)
            async with aion.open_engine(WithoutBulk(counting), workflows=[waits]) as engine:
                assert (counting.batches, counting.counts["read_history"]) == ([], COUNT)
                await _answer(engine)


async def test_a_failed_bulk_read_falls_back_to_one_read_per_workflow(store_url: str) -> None:
    with trio.fail_after(LIMIT):
        await _park(store_url)
        async with aion.open_store(store_url) as inner:
            store = CountingStore(inner, bulk_fails=aion.StoreDecodeError("wf-3", 2, "bad row", location="x"))
            async with aion.open_engine(store, workflows=[waits]) as engine:
                assert (store.batches, store.counts["read_history"]) == ([COUNT], COUNT)
                # Every run recovered and registered (lazy recovery: replayed in the background).
                await _until_resident(engine)
                assert (engine.statistics().registered_leases, engine.statistics().evicted_runs) == (COUNT, 0)
                await _answer(engine)
