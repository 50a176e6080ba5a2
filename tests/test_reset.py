"""Reset: a new run of the same workflow replays the latest run's history up to a chosen
step and goes on from there with the current code (``Engine.reset``).

The old run ends ``WorkflowReset`` naming the new run; the new run's
``WorkflowStarted`` names the old one back.  What came after the point runs again,
exactly once; what came before is replayed, not run.  A seq that is not a reset point
is refused with the valid ones named, and nothing is recorded.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

import aion_trio as aion
from aion_trio import events as ev, projections
from aion_trio.projections import reset_points, run_segment, run_status
from aion_trio.testing import replay

LIMIT = 20
CALLS: list[str] = []
VERSION = {"n": 1}
BUG = {"on": False}
GATE: dict[str, trio.Event | None] = {"c": None}
ARRIVED: dict[str, trio.Event] = {}


@pytest.fixture(autouse=True)
def _fresh() -> None:
    CALLS.clear()
    VERSION["n"] = 1
    BUG["on"] = False
    GATE["c"] = None
    ARRIVED.clear()


@aion.activity
async def step(name: str) -> str:
    CALLS.append(name)
    if name in ARRIVED:
        ARRIVED[name].set()
    gate = GATE.get(name)
    if gate is not None:
        await gate.wait()
    return f"{name}@v{VERSION['n']}"


@aion.workflow
async def pipeline(ctx: aion.WorkflowContext) -> list[str]:
    done = [str(await ctx.run(step, "a")), str(await ctx.run(step, "b"))]
    if BUG["on"]:
        raise KeyError("a bug after step b")
    done.append(str(await ctx.run(step, "c")))
    return done


def _completed_seq(history: list[aion.Event], activity_id: int) -> int:
    return next(
        e.seq
        for e in history
        if isinstance(e.body, ev.ActivityCompleted) and e.body.activity_id == activity_id
    )


async def _start(url: str, workflow_id: str) -> list[aion.Event]:
    async with aion.open_engine(url, workflows=[pipeline], activities=[step]) as engine:
        run = await engine.start(pipeline, workflow_id=workflow_id)
        if BUG["on"]:
            with pytest.raises(aion.WorkflowFailure, match="KeyError"):
                await run.result()
        else:
            assert await run.result() == ["a@v1", "b@v1", "c@v1"]
        return await engine.history(workflow_id)


async def test_reset_mid_way_reruns_what_came_after_once_with_the_current_code(
    store_url: Callable[[], str],
) -> None:
    url = store_url()
    with trio.fail_after(LIMIT):
        old = await _start(url, "p-1")
        assert CALLS == ["a", "b", "c"]
        point = _completed_seq(old, 0)  # after step a
        VERSION["n"] = 2  # the current code differs from what ran
        async with aion.open_engine(url, workflows=[pipeline], activities=[step]) as engine:
            handle = await engine.reset("p-1", to_seq=point, reason="redo b and c")
            assert handle.created
            assert await handle.result() == ["a@v1", "b@v2", "c@v2"]
            history = await engine.history("p-1")
            described = await engine.describe("p-1")
    # a was replayed from the copied history; b and c ran again, once each.
    assert CALLS == ["a", "b", "c", "b", "c"]
    assert described.status is aion.WorkflowStatus.COMPLETED
    old_run = old[0].body
    assert isinstance(old_run, ev.WorkflowStarted)
    # The old run shows as reset and names the new run; the new run names it back.
    assert run_status(history, old_run.run_id) is aion.WorkflowStatus.RESET
    reset = next(e.body for e in history if isinstance(e.body, ev.WorkflowReset))
    assert (reset.new_run_id, reset.to_seq, reset.reason) == (handle.run_id, point, "redo b and c")
    new_segment = run_segment(history, handle.run_id)
    started = new_segment[0].body
    assert isinstance(started, ev.WorkflowStarted)
    assert (started.reset_from_run_id, started.reset_to_seq) == (old_run.run_id, point)
    # The new run's history: the old one up to the point, then what ran again.
    copied = [type(e.body).__name__ for e in new_segment[1:]]
    assert copied[:3] == ["ActivityScheduled", "ActivityStarted", "ActivityCompleted"]
    assert [e.body.activity_id for e in new_segment if isinstance(e.body, ev.ActivityScheduled)] == [0, 1, 2]
    # The reset history replays: both runs, with the current code.
    with trio.fail_after(LIMIT):
        report = await replay([pipeline], history, activities=[step])
    report.check()
    assert len(report.results) == 2


async def test_reset_of_a_failed_run_to_its_last_step_recovers_it(store_url: Callable[[], str]) -> None:
    url = store_url()
    BUG["on"] = True
    with trio.fail_after(LIMIT):
        old = await _start(url, "p-2")
        assert CALLS == ["a", "b"]
        BUG["on"] = False  # the fix is deployed
        async with aion.open_engine(url, workflows=[pipeline], activities=[step]) as engine:
            handle = await engine.reset("p-2", reason="bug fixed")  # its last step
            assert await handle.result() == ["a@v1", "b@v1", "c@v1"]
            history = await engine.history("p-2")
    assert CALLS == ["a", "b", "c"], "the steps before the failure are not run again"
    reset = next(e.body for e in history if isinstance(e.body, ev.WorkflowReset))
    assert reset.to_seq == _completed_seq(old, 1)
    with trio.fail_after(LIMIT):
        (await replay([pipeline], history, activities=[step])).check()


async def test_a_seq_that_is_not_a_reset_point_is_refused_with_the_valid_ones_and_nothing_recorded(
    store_url: Callable[[], str],
) -> None:
    url = store_url()
    with trio.fail_after(LIMIT):
        old = await _start(url, "p-3")
        scheduled = next(e.seq for e in old if isinstance(e.body, ev.ActivityScheduled))
        async with aion.open_engine(url, workflows=[pipeline], activities=[step]) as engine:
            for bad in (scheduled, old[-1].seq, old[-1].seq + 10):
                with pytest.raises(aion.CannotReset, match="nothing was recorded") as info:
                    await engine.reset("p-3", to_seq=bad)
                assert info.value.valid == tuple(reset_points(old))
                assert str(old[0].seq) in str(info.value)
            assert await engine.history("p-3") == old
            with pytest.raises(aion.WorkflowNotFound):
                await engine.reset("nobody", to_seq=1)
    assert reset_points(old) == [old[0].seq, *(_completed_seq(old, i) for i in range(3))]


async def test_reset_of_a_running_run_cancels_its_activity_in_flight(store_url: Callable[[], str]) -> None:
    url = store_url()
    gate = trio.Event()
    GATE["c"] = gate
    ARRIVED["c"] = trio.Event()
    with trio.fail_after(LIMIT):
        async with aion.open_engine(url, workflows=[pipeline], activities=[step]) as engine:
            run = await engine.start(pipeline, workflow_id="p-4")
            await ARRIVED["c"].wait()  # step c is in flight, held by its gate
            before = await engine.history("p-4")
            GATE["c"] = None  # the re-run of c goes through
            handle = await engine.reset("p-4", to_seq=_completed_seq(before, 0), request_id="reset-once")
            again = await engine.reset("p-4", to_seq=_completed_seq(before, 0), request_id="reset-once")
            assert again.run_id == handle.run_id, "a retried reset records nothing"
            assert await handle.result() == ["a@v1", "b@v1", "c@v1"]
            # A waiter on the old run follows the reset to the run that replaced it.
            assert await run.result() == ["a@v1", "b@v1", "c@v1"]
            with pytest.raises(aion.WorkflowFailure, match="reset"):
                await run.result(follow_continue_as_new=False)
            history = await engine.history("p-4")
    assert CALLS == ["a", "b", "c", "b", "c"]
    old = run_segment(history, run.run_id)
    assert [type(e.body).__name__ for e in old[-2:]] == ["WorkflowReset", "ActivityCancelled"]
    assert sum(isinstance(e.body, ev.WorkflowReset) for e in history) == 1
    with trio.fail_after(LIMIT):
        (await replay([pipeline], history, activities=[step])).check()


# --------------------------------------------------------------------------
# A caller SIGKILLed right after the reset is recorded (tests/procs/reset_worker.py)
# --------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent


def _worker(store: Path, calls: Path, mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tests.procs.reset_worker", str(store), str(calls), mode],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )


@pytest.mark.slow  # two worker subprocesses
def test_a_caller_sigkilled_after_the_reset_is_recorded_leaves_a_new_run_that_proceeds_once(
    tmp_path: Path,
) -> None:
    store, calls = tmp_path / "jobs.db", tmp_path / "calls.txt"
    ran = _worker(store, calls, "run")
    assert ran.returncode == 0, ran.stderr
    assert calls.read_text().split() == ["a", "b", "c"]
    killed = _worker(store, calls, "reset-die")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert "COMMITTED ['WorkflowReset', 'WorkflowStarted', 'ActivityScheduled'" in killed.stdout, "one append"
    assert "RETURNED" not in killed.stdout, "control: the call never returned"
    assert calls.read_text().split() == ["a", "b", "c"], "control: the new run took no step before the kill"

    @aion.activity(name="step")
    async def worker_step(name: str) -> str:
        with calls.open("a", encoding="utf-8") as f:
            f.write(name + "\n")
        return name

    @aion.workflow(name="job")
    async def worker_job(ctx: aion.WorkflowContext) -> list[str]:
        return [str(await ctx.run(worker_step, n)) for n in ("a", "b", "c")]

    async def restart() -> tuple[list[aion.Event], object, str]:
        async with aion.open_engine(
            f"sqlite:///{store}", workflows=[worker_job], activities=[worker_step]
        ) as engine:
            with trio.fail_after(LIMIT):
                result = await engine.result("job-1")
                # The caller's retry (same request id) records nothing and names the same run.
                again = await engine.reset("job-1", to_seq=1, request_id="r-1")
            return await engine.history("job-1"), result, again.run_id

    history, result, again = trio.run(restart)
    assert result == ["a", "b", "c"]
    assert calls.read_text().split() == ["a", "b", "c", "b", "c"], "b and c ran again, once each"
    [reset] = [e.body for e in history if isinstance(e.body, ev.WorkflowReset)]
    assert again == reset.new_run_id
    assert projections.run_ids(history)[-1] == reset.new_run_id


# --------------------------------------------------------------------------
# Fork: the same under a new workflow id, the source untouched
# --------------------------------------------------------------------------

COUNTS: dict[int, int] = {}


@aion.activity
async def numbered(i: int) -> int:
    COUNTS[i] = COUNTS.get(i, 0) + 1
    return i * 10


@aion.workflow
async def five_steps(ctx: aion.WorkflowContext, base: int) -> int:
    total = base
    for i in range(1, 6):
        total += int(await ctx.run(numbered, i))
    return total


async def test_fork_from_each_step_reruns_only_the_steps_after_it_and_leaves_the_source_untouched(
    store_url: Callable[[], str],
) -> None:
    COUNTS.clear()
    url = store_url()
    with trio.fail_after(LIMIT):
        async with aion.open_engine(url, workflows=[five_steps], activities=[numbered]) as engine:
            run = await engine.start(five_steps, 1, workflow_id="src")
            assert await run.result() == 151
            source = await engine.history("src")
            points = reset_points(source)
            assert len(points) == 6, "the start and each of the five steps' completions"
            for k, point in enumerate(points):
                before = dict(COUNTS)
                fork = await engine.fork("src", to_seq=point, new_workflow_id=f"fork-{k}")
                assert fork.workflow_id == f"fork-{k}"
                assert fork.created
                assert await fork.result() == 151, "the same output"
                # Steps up to the point replay from the copied history; the later ones run again.
                expected = {i: before[i] + (1 if i > k else 0) for i in range(1, 6)}
                counts = dict(COUNTS)
                assert counts == expected, k
                forked = await engine.history(f"fork-{k}")
                assert [e.body for e in forked[1:point]] == [e.body for e in source[1:point]]
                (await replay([five_steps], forked, activities=[numbered])).check()
            assert await engine.history("src") == source, "the source is untouched"
            assert (await engine.describe("src")).status is aion.WorkflowStatus.COMPLETED
            again = await engine.fork("src", to_seq=points[2], new_workflow_id="fork-r", request_id="f-1")
            same = await engine.fork("src", to_seq=points[2], new_workflow_id="fork-r", request_id="f-1")
            assert same.run_id == again.run_id
            with pytest.raises(aion.WorkflowAlreadyStarted):
                await engine.fork("src", to_seq=points[2], new_workflow_id="fork-0")
            with pytest.raises(aion.CannotReset):
                await engine.fork("src", to_seq=points[1] - 1, new_workflow_id="fork-bad")
            with pytest.raises(aion.WorkflowNotFound):
                await engine.describe("fork-bad")


async def test_a_queued_reset_command_is_applied_by_the_owner(store_url: Callable[[], str]) -> None:
    """As ``aion-trio reset`` queues it while a worker owns the store (PostgreSQL: cluster mode)."""
    url = store_url()
    url = f"{url}&node=reset-node" if url.startswith("postgresql:") else url
    async with aion.open_store(url) as store:
        assert isinstance(store, aion.CommandInbox)
        async with aion.open_engine(store, workflows=[pipeline], activities=[step]) as engine:
            with trio.fail_after(LIMIT):
                run = await engine.start(pipeline, workflow_id="q-1")
                await run.result()
                point = _completed_seq(await engine.history("q-1"), 1)
                command_id = await store.enqueue_command(
                    aion.ResetCommand(workflow_id="q-1", to_seq=point, reason="queued")
                )
                while (outcome := await store.command_outcome(command_id)) is None:
                    await engine.drain_inbox()
                assert outcome.ok, outcome
                assert outcome.run_id is not None
                assert outcome.message == f"reset workflow 'q-1': new run {outcome.run_id}"
                assert await engine.result("q-1") == ["a@v1", "b@v1", "c@v1"]
                bad = await store.enqueue_command(aion.ResetCommand(workflow_id="q-1", to_seq=point + 1))
                while (refused := await store.command_outcome(bad)) is None:
                    await engine.drain_inbox()
                assert not refused.ok
                assert "is not a reset point" in refused.message
    assert CALLS == ["a", "b", "c", "c"]


@aion.workflow
async def parent_of_pipeline(ctx: aion.WorkflowContext) -> list[str]:
    return list(await ctx.child(pipeline, workflow_id=f"{ctx.workflow_id}-child"))


async def test_a_reset_child_is_not_its_end_the_parent_gets_the_new_run_s_result(
    store_url: Callable[[], str],
) -> None:
    url = store_url()
    gate = trio.Event()
    GATE["c"] = gate
    ARRIVED["c"] = trio.Event()
    with trio.fail_after(LIMIT):
        kinds = {"workflows": [parent_of_pipeline, pipeline], "activities": [step]}
        async with aion.open_engine(url, **kinds) as engine:
            parent = await engine.start(parent_of_pipeline, workflow_id="par")
            await ARRIVED["c"].wait()  # the child's step c is in flight
            VERSION["n"] = 2
            GATE["c"] = None
            child = await engine.history("par-child")
            await engine.reset("par-child", to_seq=_completed_seq(child, 1), reason="redo c")
            assert await parent.result() == ["a@v1", "b@v1", "c@v2"]
            history = await engine.history("par")
    assert not any(isinstance(e.body, ev.ChildWorkflowFailed) for e in history)
    assert CALLS == ["a", "b", "c", "c"]
