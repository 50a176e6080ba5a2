"""``engine.enqueue(..., workflow_id=..., id_reuse=...)`` (issue 18, item 2; docs/flow-control.md).

The id reuse policy means what it means for ``engine.start`` and applies twice: at
enqueue, against the workflow as it is then (a refusal raises
:class:`~aion_trio.WorkflowAlreadyStarted` and writes nothing; ``USE_EXISTING``
returns a handle of the existing run and writes nothing), and at admission, when the
queue starts the run (the id may have been taken meanwhile: a refused entry ends
without a run and gives its place back; its handle's ``result()`` raises the same
error).  The policy is stored with the entry, so it survives a restart.  A handle's
``result()`` is the result of the run its entry started, never an earlier run of the
same id.  Each test runs on a memory store and on a SQLite file (and on PostgreSQL in
the PostgreSQL engine set).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import pytest
import trio
import trio.testing

import aion_trio as aion

REJECT = aion.IdReusePolicy.REJECT_DUPLICATE
USE_EXISTING = aion.IdReusePolicy.USE_EXISTING

release = trio.Event()
waiting = trio.Event()
began: list[str] = []


@pytest.fixture(autouse=True)
def fresh_probe() -> None:
    global release, waiting
    release = trio.Event()
    waiting = trio.Event()
    began.clear()


@aion.activity
async def step(tag: str, wait: bool) -> str:
    began.append(tag)
    if wait:
        waiting.set()
        await release.wait()
    return tag


@aion.workflow
async def job(ctx: aion.WorkflowContext, tag: str, wait: bool = False) -> str:
    return await ctx.run(step, tag, wait)


def engine_on(url: str) -> Any:
    return aion.open_engine(
        url,
        workflows=[job],
        activities=[step],
        config=aion.EngineConfig(workflow_queues={"serial": aion.FlowLimit(concurrency=1)}),
    )


async def starts(engine: aion.Engine, workflow_id: str) -> int:
    return sum(isinstance(e.body, aion.WorkflowStarted) for e in await engine.history(workflow_id))


async def entry_of(engine: aion.Engine, workflow_id: str) -> list[str]:
    """The queue entries of ``workflow_id`` left in the store (an entry that ended without a
    run of its own is gone by the time its handle answers)."""
    return [e.state for e in await engine.store.flow_runs() if e.workflow_id == workflow_id]  # type: ignore[attr-defined]


async def until_blocked_on_release() -> None:
    """The blocker runs and holds the queue's one place; everything else waits."""
    await waiting.wait()
    await trio.testing.wait_all_tasks_blocked()
    assert began[-1] == "block"


async def test_enqueue_applies_the_policy_to_an_existing_id_and_a_refusal_writes_nothing(
    flow_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    async with engine_on(flow_url()) as engine:
        with trio.fail_after(600):
            done = await engine.start(job, "old", workflow_id="done")
            assert await done.result() == "old"
            running = await engine.start(job, "block", True, workflow_id="running")
            await until_blocked_on_release()
            refusals = [
                ("done", REJECT, "completed"),
                ("done", aion.IdReusePolicy.ALLOW_IF_FAILED, "completed"),
                # The default, as for start: no second run while one is running.
                ("running", aion.IdReusePolicy.ALLOW_DUPLICATE, "running"),
                ("running", aion.IdReusePolicy.ALLOW_IF_FAILED, "running"),
            ]
            for workflow_id, policy, status in refusals:
                with pytest.raises(aion.WorkflowAlreadyStarted) as info:
                    await engine.enqueue(job, "new", queue="serial", workflow_id=workflow_id, id_reuse=policy)
                holder = done if workflow_id == "done" else running
                assert (info.value.workflow_id, info.value.run_id, info.value.status, info.value.policy) == (
                    workflow_id,
                    holder.run_id,
                    status,
                    policy.value,
                )
            assert await engine.store.flow_runs() == []  # nothing was written
            release.set()
            await running.result()
            # Allowed: a new run of the closed id, and the handle gives that run's result.
            again = await engine.enqueue(job, "new", queue="serial", workflow_id="done")
            assert again.created
            assert await again.result() == "new"
            assert await starts(engine, "done") == 2


async def test_use_existing_at_enqueue_returns_the_existing_run_and_writes_nothing(
    flow_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    async with engine_on(flow_url()) as engine:
        with trio.fail_after(600):
            assert await (await engine.start(job, "old", workflow_id="x")).result() == "old"
            handle = await engine.enqueue(job, "new", queue="serial", workflow_id="x", id_reuse=USE_EXISTING)
            assert not handle.created
            assert await engine.store.flow_runs() == []
            assert await handle.result() == "old"
            assert await starts(engine, "x") == 1
            # An id not taken yet is queued as under any policy.
            fresh = await engine.enqueue(job, "fresh", queue="serial", workflow_id="y", id_reuse=USE_EXISTING)
            assert fresh.created
            assert await fresh.result() == "fresh"
    assert began == ["old", "fresh"]


@pytest.mark.parametrize("direct_waits", [False, True], ids=["closed", "running"])
async def test_a_refusal_at_admission_ends_the_entry_and_the_queue_moves_on(
    flow_url: Callable[[], str], autojump_clock: trio.testing.MockClock, direct_waits: bool
) -> None:
    async with engine_on(flow_url()) as engine:
        with trio.fail_after(600):
            blocker = await engine.enqueue(job, "block", True, queue="serial")
            await until_blocked_on_release()
            # "x" is free now: the enqueue passes; the run waits behind the blocker.
            refused = await engine.enqueue(job, "queued", queue="serial", workflow_id="x", id_reuse=REJECT)
            after = await engine.enqueue(job, "after", queue="serial")
            # Meanwhile the id is taken by a run started directly (closed, or still running).
            direct = await engine.start(job, "direct", direct_waits, workflow_id="x")
            if not direct_waits:
                assert await direct.result() == "direct"
            await trio.testing.wait_all_tasks_blocked()
            release.set()
            await blocker.result()
            with pytest.raises(aion.WorkflowAlreadyStarted) as info:
                await refused.result()
            assert (info.value.workflow_id, info.value.run_id, info.value.policy) == (
                "x",
                direct.run_id,
                REJECT.value,
            )
            # The refused entry gave its place back: the next one ran.
            assert await after.result() == "after"
            assert await direct.result() == "direct"
            assert await starts(engine, "x") == 1
            assert await entry_of(engine, "x") == []
    assert "queued" not in began


async def test_use_existing_at_admission_ends_the_entry_and_follows_the_run_that_took_the_id(
    flow_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    async with engine_on(flow_url()) as engine:
        with trio.fail_after(600):
            blocker = await engine.enqueue(job, "block", True, queue="serial")
            await until_blocked_on_release()
            attached = await engine.enqueue(
                job, "queued", queue="serial", workflow_id="x", id_reuse=USE_EXISTING
            )
            assert attached.created
            after = await engine.enqueue(job, "after", queue="serial")
            direct = await engine.start(job, "direct", workflow_id="x")
            assert await direct.result() == "direct"
            release.set()
            await blocker.result()
            assert await attached.result() == "direct"
            assert await after.result() == "after"
            assert await starts(engine, "x") == 1
            assert await entry_of(engine, "x") == []
    assert began == ["block", "direct", "after"]


async def test_an_entry_keeps_its_policy_across_a_restart(
    flow_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    url = flow_url()
    with trio.fail_after(600):
        async with engine_on(url) as engine:
            await engine.enqueue(job, "block", True, queue="serial")
            await until_blocked_on_release()
            await engine.enqueue(job, "queued", queue="serial", workflow_id="x", id_reuse=REJECT)
            after = await engine.enqueue(job, "after", queue="serial")
            assert await (await engine.start(job, "direct", workflow_id="x")).result() == "direct"
        # The engine is gone with both entries queued; the next one finds them in the store.
        release.set()
        async with engine_on(url) as engine:
            while True:  # "after" is started once its turn comes: not found until then
                try:
                    assert await engine.result(after.workflow_id) == "after"
                    break
                except aion.WorkflowNotFound:
                    await trio.sleep(1)
            assert await starts(engine, "x") == 1
            assert await entry_of(engine, "x") == []
    assert "queued" not in began


async def test_enqueue_refuses_a_bad_policy_or_workflow_id_and_writes_nothing(
    flow_url: Callable[[], str],
) -> None:
    async with engine_on(flow_url()) as engine:
        with pytest.raises(
            TypeError, match=r"enqueue\(id_reuse=...\) must be an IdReusePolicy, got 'reject_duplicate'"
        ):
            await engine.enqueue(job, "t", queue="serial", workflow_id="x", id_reuse="reject_duplicate")
        with pytest.raises(ValueError, match="workflow_id must not be empty"):
            await engine.enqueue(job, "t", queue="serial", workflow_id="")
        assert await engine.store.flow_runs() == []


async def test_an_entry_admitted_but_never_started_is_started_even_if_its_id_has_a_closed_run(
    flow_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    """The engine died between admitting an entry and starting its run, and the entry's id
    has a closed run that the entry did not start: after the restart the entry's own run
    starts (its policy allows a new run); the closed run is not mistaken for its own."""
    url = flow_url()
    with trio.fail_after(600):
        async with engine_on(url) as engine:
            assert await (await engine.start(job, "direct", workflow_id="x")).result() == "direct"
            await engine.enqueue(job, "block", True, queue="serial")
            await until_blocked_on_release()
            queued = await engine.enqueue(job, "queued", queue="serial", workflow_id="x")
            assert queued.created
        # What a crash between admission and start leaves: the entry admitted, no run of its own.
        async with aion.open_store(url) as store:
            admitted, _ = await store.admit_flow_runs(  # type: ignore[attr-defined]
                "serial", concurrency=None, rate=None, period=1.0, now=datetime.now(timezone.utc)
            )
        assert [e.workflow_id for e in admitted] == ["x"]
        release.set()
        async with engine_on(url) as engine:
            while True:  # the restarted engine reconciles the admitted entry on its first pass
                if await starts(engine, "x") == 2:
                    break
                await trio.sleep(1)
            assert await engine.result("x") == "queued"
    assert began.count("queued") == 1


async def test_an_id_held_by_an_entry_of_the_queue_is_refused_as_a_duplicate_entry(
    flow_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    """The id's run was started by an entry of this queue that still holds its place: the
    queue refuses the second entry (``QueueDeduplicated``), queued or running alike."""
    async with engine_on(flow_url()) as engine:
        with trio.fail_after(600):
            first = await engine.enqueue(job, "block", True, queue="serial", workflow_id="x")
            await until_blocked_on_release()
            waiting = await engine.enqueue(job, "waiting", queue="serial", workflow_id="y")
            for workflow_id in ("x", "y"):  # running, queued
                with pytest.raises(aion.QueueDeduplicated) as info:
                    await engine.enqueue(job, "again", queue="serial", workflow_id=workflow_id)
                assert info.value.workflow_id == workflow_id
            release.set()
            assert [await first.result(), await waiting.result()] == ["block", "waiting"]
    assert "again" not in began
