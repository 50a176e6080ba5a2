"""FlakyStore: faults injected by operation and count, truth kept in ``.inner``.

With nothing armed it passes the conformance kit (``tests/test_conformance.py``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import trio
import trio.testing

import aion_trio
from aion_trio import (
    BackendUnavailable,
    NotOwner,
    SequenceConflict,
    VisibilityRow,
    WorkflowFenced,
    WorkflowStatus,
)
from aion_trio.testing import FlakyStore, FlakyStoreBundle, FlakyVisibilityStore
from aion_trio.testing._samples import at, markers


@pytest.fixture
async def bundle() -> AsyncIterator[FlakyStoreBundle]:
    async with aion_trio.open_store("memory://") as store:
        yield FlakyStoreBundle(store)


@pytest.fixture
def flaky(bundle: FlakyStoreBundle) -> FlakyStore:
    return bundle.events


async def test_unarmed_wrapper_passes_calls_through(flaky: FlakyStore) -> None:
    await flaky.append("wf", markers("wf", 1, 2), 0)
    assert await flaky.read_history("wf") == markers("wf", 1, 2)
    assert await flaky.inner.read_history("wf") == markers("wf", 1, 2)
    assert await flaky.list_workflow_ids() == ["wf"]
    assert flaky.calls["append"] == 1
    assert flaky.calls["read_history"] == 1
    assert sum(flaky.faults.values()) == 0


async def test_fail_next_reads_fails_exactly_n_reads_then_recovers(flaky: FlakyStore) -> None:
    await flaky.append("wf", markers("wf", 1, 1), 0)
    flaky.fail_next_reads(2)
    for _ in range(2):
        with pytest.raises(BackendUnavailable, match="injected fault"):
            await flaky.read_history("wf")
    assert await flaky.read_history("wf") == markers("wf", 1, 1)
    assert await flaky.list_active() == []  # other operations were never armed
    assert (flaky.calls["read_history"], flaky.faults["read_history"]) == (3, 2)
    assert flaky.pending_faults() == 0


async def test_fail_next_appends_writes_nothing(flaky: FlakyStore) -> None:
    flaky.fail_next_appends(1)
    with pytest.raises(BackendUnavailable):
        await flaky.append("wf", markers("wf", 1, 2), 0)
    assert await flaky.inner.read_history("wf") == []
    await flaky.append("wf", markers("wf", 1, 2), 0)
    assert await flaky.inner.read_history("wf") == markers("wf", 1, 2)
    assert flaky.faults["append"] == 1


async def test_fail_after_lets_k_calls_through_then_fails_n(flaky: FlakyStore) -> None:
    await flaky.append("wf", markers("wf", 1, 1), 0)
    flaky.fail_reads_after(2, 2)
    flaky.fail_appends_after(1, 1)
    outcomes = []
    for _ in range(5):
        try:
            await flaky.read_history("wf")
            outcomes.append("ok")
        except BackendUnavailable:
            outcomes.append("fault")
    assert outcomes == ["ok", "ok", "fault", "fault", "ok"]
    await flaky.append("wf", markers("wf", 2, 1), 1)
    with pytest.raises(BackendUnavailable):
        await flaky.append("wf", markers("wf", 3, 1), 2)
    await flaky.append("wf", markers("wf", 3, 1), 2)
    assert len(await flaky.inner.read_history("wf")) == 3


async def test_conflict_next_appends_reports_the_real_head_and_writes_nothing(flaky: FlakyStore) -> None:
    await flaky.append("wf", markers("wf", 1, 3), 0)
    flaky.conflict_next_appends(2)
    with pytest.raises(SequenceConflict) as info:
        await flaky.append("wf", markers("wf", 4, 1), 3)
    assert (info.value.workflow_id, info.value.expected, info.value.found) == ("wf", 3, 3)
    with pytest.raises(SequenceConflict) as info:
        await flaky.append("wf", markers("wf", 6, 1), 5)
    assert (info.value.expected, info.value.found) == (5, 3)
    assert len(await flaky.inner.read_history("wf")) == 3
    assert flaky.faults["append"] == 2


async def test_not_owner_next_appends(flaky: FlakyStore) -> None:
    flaky.not_owner_next_appends(1)
    with pytest.raises(WorkflowFenced) as info:
        await flaky.append("wf", markers("wf", 1, 1), 0)
    assert info.value.shard == info.value.workflow_id == "wf"
    assert await flaky.inner.read_history("wf") == []
    await flaky.append("wf", markers("wf", 1, 1), 0)


async def test_commit_then_fail_lands_the_batch_but_loses_the_acknowledgement(flaky: FlakyStore) -> None:
    flaky.commit_then_fail_next_appends(1)
    with pytest.raises(BackendUnavailable, match="committed but its acknowledgement was lost"):
        await flaky.append("wf", markers("wf", 1, 2), 0)
    assert await flaky.inner.read_history("wf") == markers("wf", 1, 2)
    # A blind retry of the "failed" append now meets its own commit.
    with pytest.raises(SequenceConflict) as info:
        await flaky.append("wf", markers("wf", 1, 2), 0)
    assert info.value.found == 2


async def test_commit_then_fail_after_k_lets_k_appends_through_first(flaky: FlakyStore) -> None:
    flaky.commit_then_fail_appends_after(1, 1)
    await flaky.append("wf", markers("wf", 1, 1), 0)
    with pytest.raises(BackendUnavailable, match="committed but its acknowledgement was lost"):
        await flaky.append("wf", markers("wf", 2, 1), 1)
    assert len(await flaky.inner.read_history("wf")) == 2
    await flaky.append("wf", markers("wf", 3, 1), 2)
    assert flaky.faults["append"] == 1


async def test_commit_then_fail_stays_armed_when_the_inner_append_fails(flaky: FlakyStore) -> None:
    await flaky.append("wf", markers("wf", 1, 1), 0)
    flaky.commit_then_fail_next_appends(1)
    with pytest.raises(SequenceConflict):
        await flaky.append("wf", markers("wf", 1, 1), 0)
    assert flaky.pending_faults("append") == 1
    with pytest.raises(BackendUnavailable):
        await flaky.append("wf", markers("wf", 2, 1), 1)
    assert len(await flaky.inner.read_history("wf")) == 2
    assert flaky.pending_faults() == 0


async def test_generic_fail_next_takes_any_operation_and_exception(flaky: FlakyStore) -> None:
    flaky.fail_next("list_active", 1, exc=KeyError("custom"))
    flaky.fail_next("expired_timers", 2, exc=lambda: NotOwner("shard-7"))
    flaky.fail_next("schedule_timer", 1, exc=aion_trio.StoreError)
    with pytest.raises(KeyError, match="custom"):
        await flaky.list_active()
    for _ in range(2):
        with pytest.raises(NotOwner, match="shard-7"):
            await flaky.expired_timers(at(0))
    with pytest.raises(aion_trio.StoreError):
        await flaky.schedule_timer("wf", "named:t", at(1))
    assert await flaky.expired_timers(at(5)) == []  # the refused timer was not scheduled
    assert flaky.faults == {
        "append": 0,
        "read_history": 0,
        "list_active": 1,
        "list_workflow_ids": 0,
        "schedule_timer": 1,
        "remove_timer": 0,
        "expired_timers": 2,
    }


async def test_later_arming_wins_where_it_overlaps(flaky: FlakyStore) -> None:
    flaky.fail_after("list_workflow_ids", 1, 2)
    flaky.fail_next("list_workflow_ids", 2, exc=ValueError)
    seen = []
    for _ in range(4):
        try:
            await flaky.list_workflow_ids()
            seen.append("ok")
        except Exception as exc:
            seen.append(type(exc).__name__)
    assert seen == ["ValueError", "ValueError", "BackendUnavailable", "ok"]


async def test_disarm_forgets_pending_faults_but_keeps_counters(flaky: FlakyStore) -> None:
    flaky.fail_next_reads(3)
    with pytest.raises(BackendUnavailable):
        await flaky.read_history("wf")
    assert flaky.pending_faults() == 2
    flaky.disarm()
    assert flaky.pending_faults() == 0
    assert await flaky.read_history("wf") == []
    assert (flaky.calls["read_history"], flaky.faults["read_history"]) == (2, 1)


async def test_arming_refuses_nonsense(flaky: FlakyStore) -> None:
    with pytest.raises(ValueError, match="cannot fault 'aclose'; operations: append, read_history"):
        flaky.fail_next("aclose")
    with pytest.raises(ValueError, match="n must be an int >= 0"):
        flaky.fail_next_reads(-1)
    with pytest.raises(ValueError, match="k must be an int >= 0"):
        flaky.fail_reads_after(True, 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="exception instance or a callable"):
        flaky.fail_next_appends(1, exc="boom")  # type: ignore[arg-type]
    assert flaky.pending_faults() == 0


async def test_injected_faults_are_checkpoints(flaky: FlakyStore) -> None:
    flaky.fail_next_reads(1)
    with trio.testing.assert_checkpoints():
        try:
            await flaky.read_history("wf")
        except BackendUnavailable:
            pass
    for arm, expected in (
        (flaky.conflict_next_appends, SequenceConflict),
        (flaky.not_owner_next_appends, WorkflowFenced),
    ):
        arm(1)
        with trio.testing.assert_checkpoints():
            try:
                await flaky.append("wf", markers("wf", 1, 1), 0)
            except expected:
                pass
    assert flaky.faults["read_history"] == 1
    assert flaky.faults["append"] == 2


async def test_a_call_cancelled_before_its_fault_fires_leaves_it_armed(flaky: FlakyStore) -> None:
    flaky.fail_next_appends(1)
    with trio.CancelScope() as scope:
        scope.cancel()
        await flaky.append("wf", markers("wf", 1, 1), 0)
    assert scope.cancelled_caught
    assert flaky.pending_faults("append") == 1
    assert flaky.faults["append"] == 0
    with pytest.raises(BackendUnavailable):
        await flaky.append("wf", markers("wf", 1, 1), 0)
    assert await flaky.inner.read_history("wf") == []


async def test_closing_the_wrapper_leaves_the_inner_store_readable(bundle: FlakyStoreBundle) -> None:
    flaky = bundle.events
    await flaky.append("wf", markers("wf", 1, 1), 0)
    flaky.fail_next_reads(1)
    await bundle.aclose()
    await bundle.aclose()
    with pytest.raises(trio.ClosedResourceError):
        await flaky.read_history("wf")
    with pytest.raises(trio.ClosedResourceError):
        await flaky.append("wf", markers("wf", 2, 1), 1)
    with pytest.raises(trio.ClosedResourceError):
        await bundle.visibility.get("wf")
    assert flaky.pending_faults() == 1  # a refused call consumes no fault
    assert await bundle.inner.events.read_history("wf") == markers("wf", 1, 1)


async def test_flaky_visibility_store(bundle: FlakyStoreBundle) -> None:
    vis = bundle.visibility
    assert isinstance(vis, FlakyVisibilityStore)
    row = VisibilityRow(
        workflow_id="wf",
        run_id="6f1c2a3e-0000-4000-8000-00000000000a",
        workflow_type="t",
        status=WorkflowStatus.RUNNING,
        start_time=at(0),
    )
    vis.fail_next("upsert", 1)
    with pytest.raises(BackendUnavailable):
        await vis.upsert(row)
    assert await bundle.inner.visibility.get("wf") is None
    await vis.upsert(row)
    vis.fail_after("count", 1, 1, exc=RuntimeError)
    assert await vis.count(None) == 1
    with pytest.raises(RuntimeError):
        await vis.count(None)
    assert await vis.list(None) == [row]
    assert vis.calls == {"upsert": 2, "get": 0, "list": 1, "count": 2}
    assert vis.faults == {"upsert": 1, "get": 0, "list": 0, "count": 1}
    with pytest.raises(ValueError, match="operations: upsert, get, list, count"):
        vis.fail_next("append")


async def test_bundle_is_a_store_over_the_inner_store(bundle: FlakyStoreBundle) -> None:
    assert isinstance(bundle, aion_trio.Store)
    assert isinstance(bundle.events, aion_trio.EventStore)
    assert isinstance(bundle.visibility, aion_trio.VisibilityStore)
    assert bundle.events.inner is bundle.inner.events
    assert bundle.visibility.inner is bundle.inner.visibility
    assert "FlakyStoreBundle(" in repr(bundle)
