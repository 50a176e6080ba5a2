"""Reset: a new run of the same workflow replays the latest run's history up to a chosen
step and goes on from there with the current code (``Engine.reset``).

The old run ends ``WorkflowReset`` naming the new run; the new run's
``WorkflowStarted`` names the old one back.  What came after the point runs again,
exactly once; what came before is replayed, not run.  A seq that is not a reset point
is refused with the valid ones named, and nothing is recorded.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import trio

import aion_trio as aion
from aion_trio import events as ev
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
            history = await engine.history("p-4")
    assert CALLS == ["a", "b", "c", "b", "c"]
    old = run_segment(history, run.run_id)
    assert [type(e.body).__name__ for e in old[-2:]] == ["WorkflowReset", "ActivityCancelled"]
    assert sum(isinstance(e.body, ev.WorkflowReset) for e in history) == 1
    with trio.fail_after(LIMIT):
        (await replay([pipeline], history, activities=[step])).check()
