"""One bad run never takes the engine down: BaseExceptions from user code (issue 14, item 4).

An activity or workflow raising ``SystemExit``, ``KeyboardInterrupt``, a custom
``BaseException`` or (asyncio activities) ``asyncio.CancelledError`` fails
that attempt or run, recorded with the exception's type; retry rules apply and
every other run carries on.  Only the engine's own cancellation and a real
Ctrl-C (Trio's SIGINT handler) pass through.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

import aion_trio as aion
from aion_trio._contain import is_structural


class Custom(BaseException):
    """A user's own BaseException subclass."""


RAISERS: dict[str, Callable[[], BaseException]] = {
    "SystemExit": lambda: SystemExit(3),
    "KeyboardInterrupt": KeyboardInterrupt,
    "Custom": lambda: Custom("boom"),
}

#: activity name -> attempts seen
SEEN: dict[str, list[int]] = {}


def _first_attempt_raises(kind: str) -> None:
    attempt = aion.activity_info().attempt
    SEEN.setdefault(aion.activity_info().workflow_id, []).append(attempt)
    if attempt == 1:
        raise RAISERS[kind]()


RETRY_ONCE = aion.RetryPolicy(max_attempts=2, backoff=aion.Fixed(0.001))


@aion.activity(retry=RETRY_ONCE)
async def async_raiser(kind: str) -> str:
    await trio.lowlevel.checkpoint()
    _first_attempt_raises(kind)
    return "second attempt ran"


@aion.activity(retry=RETRY_ONCE)
def thread_raiser(kind: str) -> str:
    _first_attempt_raises(kind)
    return "second attempt ran"


@aion.activity(retry=RETRY_ONCE, loop="asyncio")
async def asyncio_raiser() -> str:
    await asyncio.sleep(0)
    attempt = aion.activity_info().attempt
    SEEN.setdefault(aion.activity_info().workflow_id, []).append(attempt)
    if attempt == 1:
        raise asyncio.CancelledError("an asyncio library cancelled itself")
    return "second attempt ran"


@aion.activity
async def plain() -> str:
    return "fine"


ACTIVITIES = {"async": async_raiser, "thread": thread_raiser}


@aion.workflow
async def runs_raiser(ctx: aion.WorkflowContext, loop: str, kind: str) -> str:
    if loop == "asyncio":
        return str(await ctx.run(asyncio_raiser))
    return str(await ctx.run(ACTIVITIES[loop], kind))


@aion.workflow
async def raises_itself(ctx: aion.WorkflowContext, kind: str) -> str:
    await ctx.run(plain)
    raise RAISERS[kind]()


@aion.workflow
async def healthy(ctx: aion.WorkflowContext) -> str:
    return str(await ctx.run(plain))


def _failures(history: list[aion.Event]) -> list[tuple[str, int, bool]]:
    return [
        (e.body.error.type, e.body.attempt, e.body.final)
        for e in history
        if isinstance(e.body, aion.ActivityFailed)
    ]


CASES = [(loop, kind) for loop in ("async", "thread") for kind in RAISERS] + [("asyncio", "CancelledError")]


@pytest.mark.parametrize(("loop", "kind"), CASES)
async def test_a_base_exception_from_an_activity_fails_the_attempt_and_the_retry_runs(
    store_url: Callable[[], str], loop: str, kind: str
) -> None:
    wid = f"raiser-{loop}-{kind}"
    SEEN.pop(wid, None)
    with trio.fail_after(20):
        async with aion.open_engine(
            store_url(),
            workflows=[runs_raiser, healthy],
            activities=[async_raiser, thread_raiser, asyncio_raiser, plain],
        ) as engine:
            run = await engine.start(runs_raiser, loop, kind, workflow_id=wid)
            other = await engine.start(healthy, workflow_id="healthy")
            assert await run.result() == "second attempt ran"
            assert await other.result() == "fine"
            history = await engine.history(wid)
    assert SEEN[wid] == [1, 2]
    assert _failures(history) == [(kind, 1, False)], "recorded with its type, a retry-trail record"


async def test_a_base_exception_on_the_last_attempt_fails_the_activity_for_good(
    store_url: Callable[[], str],
) -> None:
    @aion.activity(name="exits")
    def exits() -> None:
        raise SystemExit(1)

    @aion.workflow(name="calls_exits")
    async def calls_exits(ctx: aion.WorkflowContext) -> str:
        try:
            await ctx.run(exits)
        except aion.ActivityFailure as exc:
            return f"caught {exc.type}"
        return "not reached"

    with trio.fail_after(20):
        async with aion.open_engine(store_url(), workflows=[calls_exits], activities=[exits]) as engine:
            run = await engine.start(calls_exits, workflow_id="exits")
            assert await run.result() == "caught SystemExit"
            assert _failures(await engine.history("exits")) == [("SystemExit", 1, True)]


@pytest.mark.parametrize("kind", list(RAISERS))
async def test_a_base_exception_from_workflow_code_fails_the_run_and_others_carry_on(
    store_url: Callable[[], str], kind: str
) -> None:
    with trio.fail_after(20):
        async with aion.open_engine(
            store_url(), workflows=[raises_itself, healthy], activities=[plain]
        ) as engine:
            bad = await engine.start(raises_itself, kind, workflow_id="bad")
            with pytest.raises(aion.WorkflowFailure) as failed:
                await bad.result()
            assert failed.value.error.type == kind
            assert (await engine.describe("bad")).status is aion.WorkflowStatus.FAILED
            good = await engine.start(healthy, workflow_id="good")
            assert await good.result() == "fine"


@aion.activity
async def presses_ctrl_c() -> str:
    signal.raise_signal(signal.SIGINT)  # Trio's handler raises KeyboardInterrupt right here
    return "not reached"


@aion.workflow
async def interrupted(ctx: aion.WorkflowContext) -> str:
    return str(await ctx.run(presses_ctrl_c))


async def test_a_real_ctrl_c_during_an_activity_still_interrupts_the_process() -> None:
    """Control: containment does not swallow the operator's Ctrl-C."""
    assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler, "Trio's handler is installed"
    caught: BaseException | None = None
    try:
        with trio.fail_after(20):
            async with aion.open_engine(
                "memory://", workflows=[interrupted], activities=[presses_ctrl_c]
            ) as engine:
                run = await engine.start(interrupted, workflow_id="ctrl-c")
                await run.result()
    except BaseException as exc:
        caught = exc
    assert isinstance(caught, KeyboardInterrupt), repr(caught)
    assert is_structural(caught)
    assert not is_structural(KeyboardInterrupt()), "one the code raises itself is its failure"


# --------------------------------------------------------------------------
# A restart: the store progresses afterwards
# --------------------------------------------------------------------------


@pytest.mark.slow  # two engine subprocesses
def test_after_a_crash_the_restarted_engine_contains_the_base_exception_and_progresses(
    tmp_path: Path,
) -> None:
    """The first process is SIGKILLed while the raising activity is in flight; the
    restart re-dispatches it, records the failure and finishes every run."""
    root = Path(__file__).resolve().parent.parent
    store, gate = tmp_path / "store.db", tmp_path / "gate"
    command = [sys.executable, "-m", "tests.procs.base_exception_worker", str(store), str(gate)]
    env = {**os.environ, "PYTHONPATH": str(root)}
    first = subprocess.Popen(command, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not gate.exists():  # the activity's first attempt is running (and waits)
            assert first.poll() is None, "the worker exited before its activity ran"
            assert time.monotonic() < deadline, "the activity never ran"
            time.sleep(0.02)
    finally:
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
    second = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=60)
    assert second.returncode == 0, second.stderr
    assert "RESULT raiser failed: SystemExit" in second.stdout
    assert "RESULT other done" in second.stdout
    history = trio.run(_history, store)
    assert [
        (e.body.error.type, e.body.final) for e in history if isinstance(e.body, aion.ActivityFailed)
    ] == [("SystemExit", True)]
    assert isinstance(history[-1].body, aion.WorkflowCompleted)


async def _history(store: Path) -> list[aion.Event]:
    async with aion.open_store(f"sqlite:///{store}") as opened:
        events: list[Any] = await opened.events.read_history("raiser")
        return events


def _exits() -> str:
    raise SystemExit(4)


@aion.workflow
async def answers_badly(ctx: aion.WorkflowContext) -> str:
    ctx.set_query_handler("state", _exits)
    return str(await ctx.wait_signal("go"))


async def test_a_query_handler_raising_a_base_exception_fails_the_query_only(
    store_url: Callable[[], str],
) -> None:
    with trio.fail_after(20):
        async with aion.open_engine(store_url(), workflows=[answers_badly]) as engine:
            run = await engine.start(answers_badly, workflow_id="asked")
            with pytest.raises(aion.QueryFailed, match="SystemExit") as failed:
                await engine.query("asked", "state")
            assert isinstance(failed.value.__cause__, SystemExit)
            await engine.signal("asked", "go", "still running")
            assert await run.result() == "still running"


async def test_a_base_exception_escaping_a_background_task_is_logged_not_fatal(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def dies() -> None:
        await trio.lowlevel.checkpoint()
        raise SystemExit(5)

    with trio.fail_after(20):
        async with aion.open_engine("memory://", workflows=[healthy], activities=[plain]) as engine:
            engine.epoch.spawn(dies, name="dies")
            run = await engine.start(healthy, workflow_id="after")
            assert await run.result() == "fine"
    assert any("background task dies failed" in r.getMessage() for r in caplog.records)


@aion.activity(timeout=0.1)
async def cleanup_raises() -> str:
    try:
        await trio.sleep(30)
    except trio.Cancelled:
        raise SystemExit("the cleanup gave up") from None
    return "not reached"


@aion.workflow
async def overruns(ctx: aion.WorkflowContext) -> str:
    try:
        return str(await ctx.run(cleanup_raises))
    except aion.ActivityFailure as exc:
        return f"{exc.type}: {exc.message}"


async def test_a_base_exception_raised_while_the_engine_cancels_the_attempt_is_that_cancellation() -> None:
    """An attempt that times out and raises ``SystemExit`` from its cleanup timed out."""
    with trio.fail_after(20):
        async with aion.open_engine("memory://", workflows=[overruns], activities=[cleanup_raises]) as engine:
            run = await engine.start(overruns, workflow_id="overruns")
            assert await run.result() == "ActivityTimeout: attempt 1 timed out after 0.1s"
