"""Async signal and update handlers: branches of one run that take turns with its code.

Scenarios carried over from Temporal's ``hello_update`` sample and its SDK's
update tests, where a handler is ``async`` and runs commands while the main
workflow body runs too: a handler that runs an activity and returns its
result, a validator's rejection that records nothing, an update id that makes
a retried call idempotent, a handler that waits on a condition another
message sets, and a workflow that waits for its handlers to finish before it
returns.  The run's branches take turns in an order history decides, so each
history here is replayed against the same code (nothing appended, nothing
stuck), and against code whose handler issues its commands in another order
(a NonDeterminismError naming the seq).  Time is
``MockClock(autojump_threshold=0)``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from _replay import assert_replays_cleanly

import aion_trio as aion
import aion_trio.testing

LIMIT = 3600  # mock seconds: every wait below is bounded by this


def _types(history: Sequence[aion.Event]) -> list[str]:
    return [type(e.body).__name__ for e in history]


def _scheduled(history: Sequence[aion.Event]) -> list[tuple[str, Any]]:
    return [
        (e.body.activity_type, e.body.input.value())
        for e in history
        if isinstance(e.body, aion.ActivityScheduled)
    ]


GREETINGS = {"en": "Hello, world", "fr": "Bonjour, monde", "de": "Hallo, Welt"}


@aion.activity
async def lookup(language: str) -> str:
    await trio.sleep(5)
    return GREETINGS[language]


@aion.activity
async def step(n: int) -> int:
    await trio.sleep(3)
    return n


# -- hello_update with an async handler ------------------------------------------------


@aion.workflow
async def greeter(ctx: aion.WorkflowContext) -> list[Any]:
    greeting = "Hello, world"
    done = False

    def supported(language: str) -> None:
        if language not in GREETINGS:
            raise ValueError(f"{language!r} is not a supported language")

    @ctx.update_handler("set_language", validator=supported)
    async def set_language(language: str) -> str:
        nonlocal greeting
        previous, greeting = greeting, await ctx.run(lookup, language)
        return previous

    @ctx.signal_handler("finish")
    def finish(_: Any) -> None:
        nonlocal done
        done = True

    @ctx.query_handler("greeting")
    def current() -> str:
        return greeting

    await ctx.wait_condition(lambda: done)
    await ctx.wait_condition(ctx.all_handlers_finished)
    return [greeting]


async def test_an_async_update_handler_runs_an_activity_and_returns_its_result(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    async with aion.open_engine(store_url(), workflows=[greeter], activities=[lookup]) as engine:
        run = await engine.start(greeter, workflow_id="g")
        with trio.fail_after(LIMIT):
            assert await engine.update("g", "set_language", "fr") == "Hello, world"
            assert await engine.update("g", "set_language", "de") == "Bonjour, monde"
            await engine.signal("g", "finish")
            assert await run.result() == ["Hallo, Welt"]
            # A query of the closed run replays it, the handlers' branches included.
            assert await engine.query("g", "greeting") == "Hallo, Welt"
        history = await engine.history("g")
    assert _scheduled(history) == [("lookup", ["fr"]), ("lookup", ["de"])]
    outcomes = [e for e in history if isinstance(e.body, aion.UpdateCompleted)]
    assert [o.body.result for o in outcomes] == [  # type: ignore[union-attr]
        aion.Payload.of("Hello, world"),
        aion.Payload.of("Bonjour, monde"),
    ]
    # Each handler's activity is recorded between its acceptance and its outcome.
    types = _types(history)
    first = types.index("UpdateAccepted")
    assert types[first : first + 5] == [
        "UpdateAccepted",
        "ActivityScheduled",
        "ActivityStarted",
        "ActivityCompleted",
        "UpdateCompleted",
    ]
    await assert_replays_cleanly(history, workflows=[greeter], activities=[lookup])
    # Cut mid-handler (what a crash after its activity completed leaves): the code replays
    # to the end of that history, the handler's branch suspended where the live one was.
    (mid,) = (await aion.testing.replay([greeter], [history[: first + 4]])).results
    assert mid.ok, mid.error
    assert not mid.complete


async def test_a_validator_rejection_of_an_async_handlers_update_records_nothing(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    async with aion.open_engine(store_url(), workflows=[greeter], activities=[lookup]) as engine:
        run = await engine.start(greeter, workflow_id="g")
        with trio.fail_after(LIMIT):
            await trio.testing.wait_all_tasks_blocked()
            before = await engine.history("g")
            with pytest.raises(aion.UpdateRejected, match="'xx' is not a supported language"):
                await engine.update("g", "set_language", "xx")
            assert await engine.history("g") == before
            await engine.signal("g", "finish")
            assert await run.result() == ["Hello, world"]
        history = await engine.history("g")
    assert "UpdateAccepted" not in _types(history)
    assert "ActivityScheduled" not in _types(history)


async def test_an_update_id_makes_a_retried_call_to_an_async_handler_idempotent(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    async with aion.open_engine(store_url(), workflows=[greeter], activities=[lookup]) as engine:
        run = await engine.start(greeter, workflow_id="g")
        with trio.fail_after(LIMIT):
            async with trio.open_nursery() as nursery:
                answers: list[str] = []

                async def call() -> None:
                    answers.append(await engine.update("g", "set_language", "fr", update_id="lang-1"))

                nursery.start_soon(call)
                nursery.start_soon(call)  # the same id while the handler's activity runs
            assert answers == ["Hello, world", "Hello, world"]
            # And once it completed: the recorded outcome, nothing run again.
            assert await engine.update("g", "set_language", "fr", update_id="lang-1") == "Hello, world"
            await engine.signal("g", "finish")
            assert await run.result() == ["Bonjour, monde"]
        history = await engine.history("g")
    assert _types(history).count("UpdateAccepted") == 1
    assert _types(history).count("UpdateCompleted") == 1
    assert _scheduled(history) == [("lookup", ["fr"])]


# -- handlers waiting on a condition; handlers beside a busy workflow body -----------------


@aion.workflow
async def approvals(ctx: aion.WorkflowContext, rounds: int) -> list[Any]:
    approved: set[str] = set()
    log: list[Any] = []

    @ctx.signal_handler("approve")
    def approve(order: str) -> None:
        approved.add(order)

    @ctx.update_handler("ship")
    async def ship(order: str) -> str:
        # Waits for state another message sets, then runs a step of its own.
        await ctx.wait_condition(lambda: order in approved)
        await ctx.run(step, len(order))
        log.append(f"shipped {order}")
        return f"{order} shipped"

    for n in range(rounds):  # the body runs steps of its own meanwhile
        log.append(await ctx.run(step, n))
    await ctx.set_event("steps", "done")
    await ctx.wait_condition(ctx.all_handlers_finished)
    return log


async def test_an_async_handler_waits_on_a_condition_while_the_workflow_body_runs_its_own_steps(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    async with aion.open_engine(store_url(), workflows=[approvals], activities=[step]) as engine:
        run = await engine.start(approvals, 4, workflow_id="a")
        with trio.fail_after(LIMIT):
            async with trio.open_nursery() as nursery:
                shipped: list[str] = []

                async def ship(order: str) -> None:
                    shipped.append(await engine.update("a", "ship", order))

                nursery.start_soon(ship, "pear")
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(ship, "fig")
                await trio.testing.wait_all_tasks_blocked()
                await engine.signal("a", "approve", "fig")
                await trio.testing.wait_all_tasks_blocked()
                await engine.signal("a", "approve", "pear")
            assert sorted(shipped) == ["fig shipped", "pear shipped"]
            result = await run.result()
        history = await engine.history("a")
    assert sorted(r for r in result if isinstance(r, str)) == ["shipped fig", "shipped pear"]
    assert [r for r in result if isinstance(r, int)] == [0, 1, 2, 3]
    assert sorted(_scheduled(history)) == sorted(
        [("step", [0]), ("step", [1]), ("step", [2]), ("step", [3]), ("step", [3]), ("step", [4])]
    )
    await assert_replays_cleanly(history, workflows=[approvals], activities=[step])


@aion.workflow(name="approvals")
async def approvals_reordered(ctx: aion.WorkflowContext, rounds: int) -> list[Any]:
    """``approvals`` with its handler changed: its step runs before the wait."""
    approved: set[str] = set()
    log: list[Any] = []

    @ctx.signal_handler("approve")
    def approve(order: str) -> None:
        approved.add(order)

    @ctx.update_handler("ship")
    async def ship(order: str) -> str:
        await ctx.run(step, len(order))
        await ctx.wait_condition(lambda: order in approved)
        log.append(f"shipped {order}")
        return f"{order} shipped"

    for n in range(rounds):
        log.append(await ctx.run(step, n))
    await ctx.set_event("steps", "done")
    await ctx.wait_condition(ctx.all_handlers_finished)
    return log


async def test_a_handler_whose_commands_come_in_another_order_diverges_on_replay_naming_the_seq(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with aion.open_engine("memory://", workflows=[approvals], activities=[step]) as engine:
        run = await engine.start(approvals, 2, workflow_id="a")
        with trio.fail_after(LIMIT):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(functools.partial(engine.update, "a", "ship", "kiwi"))
                # Approved once the body's steps are done: the handler's step comes after them.
                assert await engine.get_event("a", "steps", timeout=LIMIT) == "done"
                await engine.signal("a", "approve", "kiwi")
            await run.result()
        history = await engine.history("a")
    (same,) = (await aion.testing.replay([approvals], [history])).results
    assert same.ok, same.error
    (changed,) = (await aion.testing.replay([approvals_reordered], [history])).results
    assert changed.diverged
    assert isinstance(changed.error, aion.NonDeterminismError)
    # The first command the changed handler issues differently: where the body's next
    # step was recorded, the handler now schedules its own step first.
    recorded = next(e for e in history if e.seq == changed.seq)
    assert isinstance(recorded.body, aion.ActivityScheduled)
    assert f"seq {changed.seq}" in str(changed.error)


# -- the workflow's exit and running handlers -----------------------------------------


@aion.workflow
async def hasty(ctx: aion.WorkflowContext, wait_for_handlers: bool) -> str:
    started = False

    @ctx.update_handler("slow")
    async def slow() -> str:
        nonlocal started
        started = True
        await ctx.sleep(60)
        return "slept"

    await ctx.wait_condition(lambda: started)
    if wait_for_handlers:
        await ctx.wait_condition(ctx.all_handlers_finished)
    return "done"


async def test_all_handlers_finished_lets_the_workflow_wait_for_a_running_handler_before_it_returns(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    async with aion.open_engine(store_url(), workflows=[hasty]) as engine:
        run = await engine.start(hasty, True, workflow_id="h")
        with trio.fail_after(LIMIT):
            assert await engine.update("h", "slow") == "slept"
            assert await run.result() == "done"
        history = await engine.history("h")
    types = _types(history)
    assert types.index("UpdateCompleted") < types.index("WorkflowCompleted")
    await assert_replays_cleanly(history, workflows=[hasty])


async def test_a_workflow_returning_while_a_handler_runs_cancels_it_and_the_caller_gets_update_unavailable(
    store_url: Callable[[], str],
    autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with aion.open_engine(store_url(), workflows=[hasty]) as engine:
        run = await engine.start(hasty, False, workflow_id="h")
        with trio.fail_after(LIMIT), caplog.at_level(logging.WARNING, logger="aion_trio.workflow"):
            with pytest.raises(aion.UpdateUnavailable, match="the run ended"):
                await engine.update("h", "slow", update_id="s-1")
            assert await run.result() == "done"
        history = await engine.history("h")
    assert "UpdateCompleted" not in _types(history)
    assert _types(history)[-1] == "WorkflowCompleted"
    assert "update handler 'slow' (s-1)" in caplog.text
    assert "all_handlers_finished" in caplog.text
    await assert_replays_cleanly(history, workflows=[hasty])


@aion.workflow
async def napper(ctx: aion.WorkflowContext) -> list[str]:
    woke: list[str] = []

    @ctx.update_handler("nap")
    async def nap(name: str) -> str:
        await ctx.sleep(600)  # a durable timer: the run is idle and parked meanwhile
        woke.append(name)
        return f"{name} woke"

    await ctx.wait_condition(lambda: bool(woke))
    return woke


async def test_a_run_evicted_while_its_handler_sleeps_replays_the_handler_when_the_timer_fires(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    config = aion.EngineConfig(evict_after=10.0)
    async with aion.open_engine(store_url(), workflows=[napper], config=config) as engine:
        run = await engine.start(napper, workflow_id="n")
        with trio.fail_after(LIMIT):
            assert await engine.update("n", "nap", "cat") == "cat woke"
            assert await run.result() == ["cat"]
        assert engine.statistics().evictions >= 1, "control: the run was evicted mid-handler"
        assert engine.statistics().reloads >= 1
        history = await engine.history("n")
    assert _types(history).count("UpdateCompleted") == 1
    assert _types(history).count("TimerStarted") == 1
    await assert_replays_cleanly(history, workflows=[napper])


# -- async signal handlers ---------------------------------------------------------------


@aion.workflow
async def enroller(ctx: aion.WorkflowContext) -> list[int]:
    enrolled: list[int] = []

    @ctx.signal_handler("enroll")
    async def enroll(n: int) -> None:
        enrolled.append(await ctx.run(step, n * 10))

    @ctx.signal_handler("broken")
    async def broken(_: Any) -> None:
        await ctx.sleep(1)
        raise RuntimeError("the async handler broke")

    await ctx.wait_condition(lambda: len(enrolled) >= 2)
    await ctx.wait_condition(ctx.all_handlers_finished)
    return enrolled


async def test_an_async_signal_handler_runs_commands_and_its_failure_fails_the_workflow(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    async with aion.open_engine(store_url(), workflows=[enroller], activities=[step]) as engine:
        run = await engine.start(enroller, workflow_id="e")
        await engine.signal("e", "enroll", 1)
        await engine.signal("e", "enroll", 2)
        with trio.fail_after(LIMIT):
            # The two handlers' steps run at once: whichever result is recorded first comes first.
            assert sorted(await run.result()) == [10, 20]
        history = await engine.history("e")
        await assert_replays_cleanly(history, workflows=[enroller], activities=[step])

        broken = await engine.start(enroller, workflow_id="b")
        await engine.signal("b", "broken")
        with trio.fail_after(LIMIT), pytest.raises(aion.WorkflowFailure, match="the async handler broke"):
            await broken.result()


# -- typed arguments and results ---------------------------------------------------------


@dataclasses.dataclass
class Order:
    item: str
    quantity: int


@dataclasses.dataclass
class Receipt:
    item: str
    total: int


@aion.workflow
async def shop(ctx: aion.WorkflowContext) -> list[str]:
    seen: list[str] = []
    done = False

    def check(order: Order) -> None:
        # The validator is given the annotated type too.
        if order.quantity <= 0:
            raise ValueError(f"quantity must be positive, got {order.quantity}")

    @ctx.update_handler("buy", validator=check)
    async def buy(order: Order) -> Receipt:
        seen.append(type(order).__name__)
        price = await ctx.run(step, 7)
        return Receipt(item=order.item, total=price * order.quantity)

    @ctx.update_handler("close")
    def close() -> None:
        nonlocal done
        done = True

    await ctx.wait_condition(lambda: done)
    return seen


async def test_update_arguments_are_decoded_to_the_annotated_types_and_results_encoded(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with aion.open_engine("memory://", workflows=[shop], activities=[step]) as engine:
        run = await engine.start(shop, workflow_id="s")
        with trio.fail_after(LIMIT):
            receipt = await engine.update("s", "buy", Order(item="tea", quantity=3))
            assert receipt == {"item": "tea", "total": 21}
            with pytest.raises(aion.UpdateRejected, match="quantity must be positive"):
                await engine.update("s", "buy", {"item": "tea", "quantity": 0})
            with pytest.raises(aion.UpdateRejected, match="quantity"):
                await engine.update("s", "buy", {"item": "tea", "quantity": "many"})
            await engine.update("s", "close")
            assert await run.result() == ["Order"]


# --------------------------------------------------------------------------
# A real process SIGKILLed in the middle of an async handler
# --------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent


def _worker(store: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tests.procs.async_update_worker", str(store), *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )


@pytest.mark.slow  # two worker subprocesses
def test_a_process_sigkilled_mid_handler_resumes_the_handler_and_the_retried_call_gets_its_result(
    tmp_path: Path,
) -> None:
    from procs.async_update_worker import counted, transfer

    store = tmp_path / "transfer.db"
    killed = _worker(store, "die-after-first-step")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert "COMMITTED debit" in killed.stdout
    assert "RETURNED" not in killed.stdout, "control: the call never returned"

    resumed = _worker(store)
    assert resumed.returncode == 0, resumed.stderr
    assert "RETURNED debited 5, credited 5" in resumed.stdout.splitlines(), resumed.stdout

    async def finish() -> tuple[list[aion.Event], Any]:
        async with aion.open_engine(
            f"sqlite:///{store}", workflows=[transfer], activities=[counted]
        ) as engine:
            with trio.fail_after(60):
                await engine.signal("transfer-1", "close")
                result = await engine.result("transfer-1")
            return await engine.history("transfer-1"), result

    history, result = trio.run(finish)
    assert result == ["debited 5, credited 5"]
    # The step completed before the kill was not run again; the handler's outcome is recorded once.
    assert _scheduled(history) == [("counted", ["debit", 5]), ("counted", ["credit", 5])]
    assert _types(history).count("ActivityCompleted") == 2
    assert _types(history).count("UpdateAccepted") == 1
    assert _types(history).count("UpdateCompleted") == 1
    trio.run(functools.partial(assert_replays_cleanly, history, workflows=[transfer], activities=[counted]))
