"""``ctx.random()`` / ``ctx.uuid4()``: a generator built on first use, same seed, same sequence (issue 17).

A run that never asks holds no ``random.Random`` (it was about a fifth of a
sleeping run's bytes); one that asks gets the sequence seeded by
``(workflow_id, run_id)``, so a replay in another engine draws the very same
values whether the generator was first built live or during the replay.
"""

from __future__ import annotations

import gc
import random
from collections.abc import Callable
from typing import Any

import trio
import trio.testing

import aion_trio as aion

DRAWN: list[tuple[str, Any]] = []


@aion.workflow
async def parked(ctx: aion.WorkflowContext) -> None:
    await ctx.wait_signal("go")


@aion.workflow
async def draws(ctx: aion.WorkflowContext) -> list[Any]:
    first = [ctx.random().random(), str(ctx.uuid4())]
    DRAWN.append(("before", first))
    await ctx.wait_signal("go")
    second = [ctx.random().randint(0, 10**9), str(ctx.uuid4())]
    DRAWN.append(("after", second))
    return first + second


@aion.workflow
async def draws_late(ctx: aion.WorkflowContext) -> list[Any]:
    await ctx.wait_signal("go")
    late = [str(ctx.uuid4()), ctx.random().random()]
    DRAWN.append(("late", late))
    return late


def generators() -> int:
    return sum(1 for o in gc.get_objects() if type(o) is random.Random)


async def test_a_run_that_never_asks_builds_no_generator() -> None:
    async with aion.open_engine("memory://", workflows=[parked, draws]) as engine:
        gc.collect()
        before = generators()
        for n in range(10):
            await engine.start(parked, workflow_id=f"parked-{n}")
        await trio.testing.wait_all_tasks_blocked()
        gc.collect()
        assert generators() == before
        # Control: a run that asks has one.
        await engine.start(draws, workflow_id="asks")
        await trio.testing.wait_all_tasks_blocked()
        gc.collect()
        assert generators() == before + 1


async def test_the_sequence_is_the_same_after_a_replay(store_url: Callable[[], str]) -> None:
    DRAWN.clear()
    url = store_url()
    with trio.fail_after(30):
        async with aion.open_engine(url, workflows=[draws, draws_late]) as engine:
            await engine.start(draws, workflow_id="early")
            await engine.start(draws_late, workflow_id="late")
            await trio.testing.wait_all_tasks_blocked()
        live = [values for when, values in DRAWN if when == "before"]
        assert len(live) == 1
        DRAWN.clear()
        # A new engine replays "early" (building the generator during the replay) and
        # "late" (whose first draw comes after the replay, live).
        async with aion.open_engine(url, workflows=[draws, draws_late]) as engine:
            await engine.signal("early", "go")
            await engine.signal("late", "go")
            early_result = await engine.result("early")
            late_result = await engine.result("late")
    drawn = dict(DRAWN)  # this engine's draws: the replayed ones, then the live ones
    assert drawn["before"] == live[0]
    assert early_result[:2] == live[0]
    # The draws after the replay continue the same sequence (not a new one from its start).
    assert early_result[2:] == drawn["after"]
    assert late_result == drawn["late"]
    assert late_result[0] != early_result[1]
