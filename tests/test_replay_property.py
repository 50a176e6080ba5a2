"""Property: replaying a history with changed code reproduces it exactly or reports non-determinism.

A random workflow program (activities, sleeps, children, signal waits with and
without a timeout, ``ctx.patched`` blocks, activities raced by a timer and
cancelled through their handle) is run to completion on a memory
store under an autojump clock; then the program is mutated (a step inserted,
deleted, moved, replaced by another kind, or given other arguments) and the
recorded history is replayed with the mutated program in an engine that
refuses appends.  The replay must either reach the recorded end having
appended nothing (the history is reproduced exactly) or mark the run stuck
with ``NonDeterminismError`` — never take another path silently.

Examples: ``AION_TRIO_REPLAY_EXAMPLES`` (default 10, derandomized, about a
second); e.g. ``AION_TRIO_REPLAY_EXAMPLES=2000`` for a long randomized run.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import trio
import trio.testing
from _replay import ReplayOutcome, replay
from hypothesis import HealthCheck, given, settings, strategies as st

import aion_trio as aion

_EXAMPLES = int(os.environ.get("AION_TRIO_REPLAY_EXAMPLES", "10"))
settings.register_profile(
    "aion-replay",
    max_examples=_EXAMPLES,
    deadline=None,
    derandomize="AION_TRIO_REPLAY_EXAMPLES" not in os.environ,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

Step = tuple[Any, ...]
PROGRAM: list[Step] = []


@aion.activity
async def act_a(n: int) -> str:
    return f"a{n}"


@aion.activity
async def act_b(n: int) -> str:
    return f"b{n}"


@aion.activity
async def act_slow(n: int) -> str:
    await trio.sleep(10**6)  # mock time: cancelled by the workflow long before
    return f"slow{n}"


ACTIVITIES = {"a": act_a, "b": act_b}


@aion.workflow
async def echo(ctx: aion.WorkflowContext, n: int) -> int:
    return n


@aion.workflow(name="program")
async def program(ctx: aion.WorkflowContext) -> list[Any]:
    """Runs the global PROGRAM: the same workflow type, different code per phase."""
    out: list[Any] = []
    for index, step in enumerate(PROGRAM):
        kind = step[0]
        if kind == "activity":
            out.append(await ctx.run(ACTIVITIES[step[1]], step[2]))
        elif kind == "sleep":
            await ctx.sleep(step[1])
        elif kind == "child":
            out.append(await ctx.child(echo, step[1]))
        elif kind == "signal":
            _, name, timeout = step
            try:
                out.append(await ctx.wait_signal(name, timeout=timeout))
            except aion.Timeout:
                out.append(f"no {name}")
        elif kind == "race":  # a slow activity raced by a timer, then cancelled through its handle
            slow = ctx.start(act_slow, step[1])
            timer = ctx.start_timer(f"race-{index}", 1)
            first = await ctx.wait_first(slow, timer)
            out.append([first is timer, await slow.cancel()])
        elif kind == "patch":
            if await ctx.patched(step[1]):
                out.append(await ctx.run(act_a, -1))
        else:  # pragma: no cover
            raise AssertionError(step)
    return out


activity_steps = st.tuples(st.just("activity"), st.sampled_from(["a", "b"]), st.integers(0, 2))
sleep_steps = st.tuples(st.just("sleep"), st.integers(1, 3))
child_steps = st.tuples(st.just("child"), st.integers(0, 2))
# "s" and "t" are sent once per wait for them; "u" never is, so its wait needs a timeout.
signal_steps = st.tuples(
    st.just("signal"), st.sampled_from(["s", "t", "u"]), st.sampled_from([None, 5])
).filter(lambda s: s[1] != "u" or s[2] is not None)
patch_steps = st.tuples(st.just("patch"), st.sampled_from(["p", "q"]))
race_steps = st.tuples(st.just("race"), st.integers(0, 2))
steps = st.one_of(activity_steps, sleep_steps, child_steps, signal_steps, patch_steps, race_steps)
programs = st.lists(steps, min_size=1, max_size=6)


def _tweak(step: Step) -> Step:
    """The same kind of step with other arguments."""
    kind = step[0]
    if kind == "activity":
        return (kind, step[1], step[2] + 1)
    if kind == "sleep":
        return (kind, step[1] + 1)
    if kind in ("child", "race"):
        return (kind, step[1] + 1)
    if kind == "signal":
        _, name, timeout = step
        return (kind, name, None if timeout is not None and name != "u" else 5)
    return (kind, "q" if step[1] == "p" else "p")


@st.composite
def mutated(draw: st.DrawFn, original: list[Step]) -> tuple[str, list[Step]]:
    new = list(original)
    what = draw(st.sampled_from(["insert", "delete", "move", "replace", "arguments"]))
    if what == "insert":
        new.insert(draw(st.integers(0, len(new))), draw(steps))
    else:
        i = draw(st.integers(0, len(new) - 1))
        if what == "delete":
            del new[i]
        elif what == "move":
            new.insert(draw(st.integers(0, len(new) - 1)), new.pop(i))
        elif what == "replace":
            new[i] = draw(steps.filter(lambda s: s[0] != original[i][0]))
        else:
            new[i] = _tweak(new[i])
    return what, new


async def _record(steps_: list[Step]) -> list[aion.Event]:
    PROGRAM[:] = steps_
    async with aion.open_engine(
        f"memory://prop-{uuid.uuid4().hex}", workflows=[program, echo], activities=[act_a, act_b, act_slow]
    ) as engine:
        run = await engine.start(program, workflow_id="prog")
        for step in steps_:
            if step[0] == "signal" and step[1] != "u":
                await engine.signal("prog", step[1], f"sig-{step[1]}")
        with trio.fail_after(86400):
            await run.result()
        return await engine.history("prog")


async def _replay(history: list[aion.Event], steps_: list[Step]) -> ReplayOutcome:
    PROGRAM[:] = steps_
    return await replay(history, workflows=[program, echo], activities=[act_a, act_b, act_slow])


def _run(fn: Any, *args: Any) -> Any:
    return trio.run(fn, *args, clock=trio.testing.MockClock(autojump_threshold=0))


@settings(settings.get_profile("aion-replay"))
@given(data=st.data(), original=programs)
def test_replay_with_changed_code_reproduces_the_history_or_reports_non_determinism(
    data: st.DataObject, original: list[Step]
) -> None:
    history = _run(_record, original)
    same = _run(_replay, history, original)
    assert (same.stuck_reason, same.refused, same.completed) == (None, [], True), "control: v1 replays"
    what, changed = data.draw(mutated(original), label="mutation")
    outcome: ReplayOutcome = _run(_replay, history, changed)
    if outcome.stuck_reason is not None:
        assert outcome.stuck_reason.startswith("non-determinism in workflow 'prog'"), outcome.stuck_reason
        assert outcome.refused == [], "nothing is attempted once non-determinism is found"
    else:
        assert outcome.refused == [], f"{what}: replay tried to record something new without an error"
        assert outcome.completed, f"{what}: replay neither reached the recorded end nor reported it"
    assert outcome.history == history
