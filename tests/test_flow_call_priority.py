"""Per-call priority: ``ctx.start(act, x, priority=N)`` / ``ctx.run(...)`` (issue 18, item 1;
docs/flow-control.md).

A call's ``priority`` overrides the activity's own (``@aion.activity(priority=)``),
as every other activity option does: it orders the attempt among those waiting for a
flow-control slot (lower first, then in order of arrival).  It is recorded with the
command's resolved options; replay compares an activity's type and arguments, never
its options, so a history recorded under one priority replays under code that passes
another.  A priority that is not an int is refused at the call, before anything is
recorded.  Each ordering test runs on a memory store and on a SQLite file.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import trio
import trio.testing

import aion_trio as aion
from aion_trio.testing import replay

began: list[str] = []
release = trio.Event()


@pytest.fixture(autouse=True)
def fresh_probe() -> None:
    global release
    began.clear()
    release = trio.Event()


@aion.activity(task_queue="ordered")
async def blocker(tag: str) -> str:
    began.append(tag)
    await release.wait()
    return tag


@aion.activity(task_queue="ordered")
async def plain(tag: str) -> str:
    began.append(tag)
    return tag


@aion.activity(task_queue="ordered", priority=9)
async def late(tag: str) -> str:
    """Its own priority (9) puts it behind every default call, unless a call says otherwise."""
    began.append(tag)
    return tag


async def _behind_blocker(
    ctx: aion.WorkflowContext, calls: list[tuple[aion.ActivityDefinition, str, int | None]]
) -> list[str]:
    """Hold the queue's one slot, then issue ``calls`` one second apart (so they reach the
    pool in this order); each passes its priority, or none."""
    first = ctx.start(blocker, "block")
    await ctx.sleep(1)
    handles = []
    for activity, tag, priority in calls:
        handles.append(
            ctx.start(activity, tag) if priority is None else ctx.start(activity, tag, priority=priority)
        )
        await ctx.sleep(1)
    return [await first] + [await h for h in handles]


@aion.workflow
async def mixed_priorities(ctx: aion.WorkflowContext) -> list[str]:
    return await _behind_blocker(
        ctx,
        [(plain, "r1", 5), (plain, "u1", 1), (plain, "d1", None), (plain, "r2", 5), (plain, "u2", 1)],
    )


@aion.workflow
async def overridden(ctx: aion.WorkflowContext) -> list[str]:
    # late's own priority 9 would put "l1" last; the call's -1 puts it first.  "l2" keeps 9.
    return await _behind_blocker(ctx, [(late, "l2", None), (plain, "p1", None), (late, "l1", -1)])


@aion.workflow
async def bad_priority(ctx: aion.WorkflowContext, value: object) -> str:
    try:
        ctx.start(plain, "never", priority=value)  # type: ignore[arg-type]
    except TypeError as error:
        return str(error)
    return "accepted"


@aion.workflow
async def bad_priority_run(ctx: aion.WorkflowContext, value: object) -> str:
    try:
        await ctx.run(plain, "never", priority=value)
    except TypeError as error:
        return str(error)
    return "accepted"


def engine_on(url: str) -> object:
    return aion.open_engine(
        url,
        workflows=[mixed_priorities, overridden, bad_priority, bad_priority_run],
        activities=[blocker, plain, late],
        config=aion.EngineConfig(task_queue_limits={"ordered": aion.FlowLimit(concurrency=1)}),
    )


async def _run_behind_blocker(
    engine: aion.Engine, workflow: aion.WorkflowDefinition, waiting: int
) -> list[str]:
    run = await engine.start(workflow, workflow_id=workflow.name)
    # Every call has reached the pool once the workflow is parked on its first handle
    # and the mock clock has jumped past its last sleep: all tasks blocked, N waiting.
    while True:
        await trio.testing.wait_all_tasks_blocked()
        pool = next(p for p in engine.statistics().flow_pools if p.name == "task_queue:ordered")
        if pool.waiting == waiting:
            break
        await trio.sleep(1)
    assert (pool.held, pool.waiting) == (1, waiting)
    assert began == ["block"]
    release.set()
    return await run.result()  # type: ignore[no-any-return]


async def test_per_call_priorities_order_waiting_attempts_fifo_within_a_priority(
    flow_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    async with engine_on(flow_url()) as engine:  # type: ignore[attr-defined]
        with trio.fail_after(600):
            await _run_behind_blocker(engine, mixed_priorities, 5)
    assert began == ["block", "d1", "u1", "u2", "r1", "r2"]


async def test_a_call_priority_overrides_the_activity_priority(
    flow_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    async with engine_on(flow_url()) as engine:  # type: ignore[attr-defined]
        with trio.fail_after(600):
            await _run_behind_blocker(engine, overridden, 3)
            history = await engine.history("overridden")
    assert began == ["block", "l1", "p1", "l2"]
    # The resolved priority is what the command recorded (a default 0 is left out).
    recorded = {
        e.body.activity_type + ":" + e.body.input.value()[0]: e.body.options.value().get("priority")
        for e in history
        if isinstance(e.body, aion.ActivityScheduled)
    }
    assert recorded == {"blocker:block": None, "late:l2": 9, "plain:p1": None, "late:l1": -1}


@pytest.mark.parametrize("workflow", [bad_priority, bad_priority_run], ids=["start", "run"])
@pytest.mark.parametrize("value", [True, "3", 2.5])
async def test_a_priority_that_is_not_an_int_is_refused_at_the_call(
    workflow: aion.WorkflowDefinition, value: object, autojump_clock: trio.testing.MockClock
) -> None:
    async with engine_on("memory://") as engine:  # type: ignore[attr-defined]
        with trio.fail_after(60):
            message = await (await engine.start(workflow, value, workflow_id="bad")).result()
            history = await engine.history("bad")
    assert message == f"ctx.start(plain): priority must be an int (lower runs first), got {value!r}"
    assert not any(isinstance(e.body, aion.ActivityScheduled) for e in history), "something was recorded"


# -- replay ----------------------------------------------------------------------------


@aion.activity
async def noted(tag: str) -> str:
    return tag


@aion.workflow(name="prioritised")
async def prioritised_v1(ctx: aion.WorkflowContext) -> list[str]:
    return [await ctx.run(noted, "a", priority=3), await ctx.start(noted, "b", priority=3)]


@aion.workflow(name="prioritised")
async def prioritised_v2(ctx: aion.WorkflowContext) -> list[str]:
    return [await ctx.run(noted, "a", priority=7), await ctx.start(noted, "b")]


async def test_a_history_recorded_under_one_priority_replays_under_another(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with aion.open_engine("memory://", workflows=[prioritised_v1], activities=[noted]) as engine:
        with trio.fail_after(60):
            await (await engine.start(prioritised_v1, workflow_id="p")).result()
            history = await engine.history("p")
    assert [
        e.body.options.value().get("priority") for e in history if isinstance(e.body, aion.ActivityScheduled)
    ] == [
        3,
        3,
    ]
    report = await replay([prioritised_v2], [history], activities=[noted])
    assert [r.verdict for r in report.results] == ["match"]
