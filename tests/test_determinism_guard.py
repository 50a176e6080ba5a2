"""The determinism guard: workflow code that reads a clock, draws random numbers, opens a file
or a socket or starts a thread gets ``NonDeterministicCall`` naming the safe alternative;
activities, query handlers, the engine's own calls from the workflow's task and other tasks
are left alone; ``unsafe_nondeterminism()`` and ``EngineConfig(determinism_guard=False)``
turn it off (the controls that show each refusal is the guard's doing).
"""

from __future__ import annotations

import datetime as datetime_module
import logging
import random
import socket
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

import aion_trio as aion


def _utcnow() -> Any:
    # Deprecated since Python 3.12 (the suite turns warnings into errors): where the guard
    # lets the call through, the warning is the interpreter's, not what these tests check.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return datetime_module.datetime.utcnow()


#: name -> (a call workflow code must not make, the alternative the error names)
CALLS: dict[str, tuple[Callable[[], Any], str]] = {
    "time.time()": (lambda: time.time(), "ctx.now()"),
    "time.monotonic()": (lambda: time.monotonic(), "ctx.now()"),
    "time.time_ns()": (lambda: time.time_ns(), "ctx.now()"),
    "trio.current_time()": (lambda: trio.current_time(), "ctx.now()"),
    "datetime.now()": (lambda: datetime.now(timezone.utc), "ctx.now()"),
    "datetime.utcnow()": (_utcnow, "ctx.now()"),
    "random.random()": (lambda: random.random(), "ctx.random()"),
    "random.randint()": (lambda: random.randint(1, 6), "ctx.random()"),
    "random.choice()": (lambda: random.choice("abc"), "ctx.random()"),
    "uuid.uuid4()": (lambda: uuid.uuid4(), "ctx.uuid4()"),
    "open()": (lambda: open(__file__, encoding="utf-8").close(), "an activity (ctx.run)"),
    "a socket": (lambda: socket.socket().close(), "an activity (ctx.run)"),
    "starting a thread": (lambda: threading.Thread(target=int).start(), "an activity (ctx.run)"),
}


async def _sleep() -> None:
    await trio.sleep(1)


async def _sleep_until() -> None:
    await trio.sleep_until(0)


async def _to_thread() -> None:
    await trio.to_thread.run_sync(int)


async def _open_file() -> None:
    async with await trio.open_file(__file__):
        pass


ASYNC_CALLS: dict[str, tuple[Callable[[], Any], str]] = {
    "trio.sleep()": (_sleep, "ctx.sleep() or ctx.sleep_until()"),
    "trio.sleep_until()": (_sleep_until, "ctx.sleep() or ctx.sleep_until()"),
    "trio.to_thread.run_sync()": (_to_thread, "an activity (ctx.run)"),
    "trio.open_file()": (_open_file, "an activity (ctx.run)"),
}


async def _attempt(name: str) -> list[str] | str:
    """Make the call ``name``; what the guard said, or ``"allowed"``."""
    try:
        if name in CALLS:
            CALLS[name][0]()
        else:
            await ASYNC_CALLS[name][0]()
    except aion.NonDeterministicCall as refused:
        return [refused.call, refused.instead]
    return "allowed"


@aion.workflow
async def tries(ctx: aion.WorkflowContext, name: str) -> list[str] | str:
    return await _attempt(name)


@aion.workflow
async def tries_safely(ctx: aion.WorkflowContext, name: str) -> list[str] | str:
    with aion.unsafe_nondeterminism():
        return await _attempt(name)


@aion.activity
async def activity_tries(name: str) -> list[str] | str:
    return await _attempt(name)


@aion.workflow
async def tries_in_an_activity(ctx: aion.WorkflowContext, name: str) -> list[str] | str:
    result: list[str] | str = await ctx.run(activity_tries, name)
    return result


ALL = sorted([*CALLS, *ASYNC_CALLS])
DEFINITIONS: dict[str, Any] = {
    "workflows": [tries, tries_safely, tries_in_an_activity],
    "activities": [activity_tries],
}


async def _run(workflow: aion.WorkflowDefinition[Any], name: str, **config: Any) -> Any:
    async with aion.open_engine("memory://", config=aion.EngineConfig(**config), **DEFINITIONS) as engine:
        with trio.fail_after(60):
            return await (await engine.start(workflow, name)).result()


@pytest.mark.parametrize("name", ALL)
async def test_a_call_that_breaks_replay_is_refused_in_workflow_code(name: str) -> None:
    instead = (CALLS.get(name) or ASYNC_CALLS[name])[1]
    assert await _run(tries, name) == [name, instead]


@pytest.mark.parametrize("name", ALL)
async def test_the_same_call_is_allowed_without_the_guard(name: str) -> None:
    # Control: the refusal above is the guard's doing.
    assert await _run(tries, name, determinism_guard=False) == "allowed"


@pytest.mark.parametrize("name", ALL)
async def test_the_escape_hatch_allows_a_block_known_to_be_safe(name: str) -> None:
    assert await _run(tries_safely, name) == "allowed"


@pytest.mark.parametrize("name", ALL)
async def test_activities_are_not_guarded(name: str) -> None:
    assert await _run(tries_in_an_activity, name) == "allowed"


@aion.workflow
async def uncaught(ctx: aion.WorkflowContext) -> float:
    return time.time()


async def test_an_uncaught_refusal_fails_the_run_with_the_message() -> None:
    async with aion.open_engine("memory://", workflows=[uncaught]) as engine:
        run = await engine.start(uncaught)
        with trio.fail_after(60), pytest.raises(aion.WorkflowFailure) as failed:
            await run.result()
    assert "NonDeterministicCall: time.time() was called from workflow code" in str(failed.value)
    assert "use ctx.now() instead" in str(failed.value)


@aion.workflow
async def answers_queries(ctx: aion.WorkflowContext) -> str:
    @ctx.query_handler
    def stamp() -> float:
        return time.time()  # a query handler runs outside the workflow's code: not guarded

    logging.getLogger("tests.guard").info("the stdlib logger reads the clock: allowed")
    ctx.logger.info("so does ctx.logger")
    await ctx.wait_signal("done")
    return "done"


async def test_query_handlers_loggers_and_other_tasks_are_not_guarded(autojump_clock: trio.abc.Clock) -> None:
    async with aion.open_engine("memory://", workflows=[answers_queries]) as engine:
        run = await engine.start(answers_queries, workflow_id="q")
        with trio.fail_after(60):
            await trio.testing.wait_all_tasks_blocked()
            assert isinstance(await engine.query("q", "stamp"), float)
            assert isinstance(time.time(), float)  # this task: never workflow code
            await engine.signal("q", "done")
            assert await run.result() == "done"


@aion.activity
async def step(n: int) -> int:
    return n + 1


@aion.workflow
async def busy(ctx: aion.WorkflowContext, n: int) -> str:
    # The engine records each step from this task (its clock, the store's I/O, threads for
    # a file store): none of that is the code's own call.
    for _ in range(3):
        n = await ctx.run(step, n)
        await ctx.sleep(5)
    child = await ctx.child(leaf, n)
    return f"{n} {child} {ctx.now().tzinfo} {ctx.random().random() < 1} {ctx.uuid4().version}"


@aion.workflow
async def leaf(ctx: aion.WorkflowContext, n: int) -> int:
    return n


async def test_the_engines_own_calls_from_the_workflow_task_pass(
    autojump_clock: trio.abc.Clock, store_url: Callable[[], str]
) -> None:
    async with aion.open_engine(store_url(), workflows=[busy, leaf], activities=[step]) as engine:
        with trio.fail_after(600):
            assert await (await engine.start(busy, 0)).result() == "3 3 UTC True 4"


async def test_a_workflow_module_keeps_real_datetimes() -> None:
    # An engine with this module's workflows rebinds its `datetime` name: it behaves as
    # the class did, but for now()/utcnow()/today() in workflow code.
    async with aion.open_engine("memory://", **DEFINITIONS):
        pass
    real = sys.modules["datetime"].datetime
    assert datetime is not real
    assert datetime_module.datetime is datetime  # `import datetime` is rebound alike
    made = datetime(2026, 1, 2, tzinfo=timezone.utc)
    assert type(made) is real
    assert isinstance(real.now(), datetime)
    assert issubclass(real, datetime)
    assert datetime.fromisoformat("2026-01-02T00:00:00+00:00") == made
    assert type(datetime.now()) is real  # outside workflow code: allowed


async def test_outside_workflow_code_the_patched_calls_behave_as_before(tmp_path: Path) -> None:
    async with aion.open_engine("memory://", **DEFINITIONS):
        pass
    assert getattr(time.time, "__wrapped__", None) is not None  # installed: the attribute is a wrapper
    assert isinstance(time.time(), float)
    path = tmp_path / "x"
    with open(path, "w", encoding="utf-8") as f:  # noqa: ASYNC230 - the patched builtin itself
        f.write("plain code is unaffected")
    assert path.read_text(encoding="utf-8") == "plain code is unaffected"
    assert 1 <= random.randint(1, 6) <= 6
    assert uuid.uuid4().version == 4


@aion.workflow(name="stamp")
async def stamps_with_the_clock(ctx: aion.WorkflowContext) -> float:
    return time.time()


async def test_the_replayer_runs_the_code_under_the_guard() -> None:
    from aion_trio.testing import replay

    unguarded = aion.EngineConfig(determinism_guard=False)
    async with aion.open_engine("memory://", workflows=[stamps_with_the_clock], config=unguarded) as engine:
        run = await engine.start(stamps_with_the_clock)
        with trio.fail_after(60):
            assert isinstance(await run.result(), float)
        history = await engine.history(run.workflow_id)
    [result] = (await replay([stamps_with_the_clock], [history])).results
    assert result.diverged
    assert result.got == "the workflow to fail (NonDeterministicCall)"
    assert result.expected == "the run's end (WorkflowCompleted)"
