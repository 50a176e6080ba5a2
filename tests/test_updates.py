"""Workflow updates: a request/response into a running run, recorded before it is observed.

Scenarios carried over from Temporal's ``hello_update`` sample and its SDK's
update tests: a workflow registers update handlers (with an optional
validator) that read and change its state and return a result;
``engine.update`` returns that result or raises the handler's error.  A
validator's rejection records nothing; an accepted update is recorded
(``UpdateAccepted``) before its handler runs and its outcome
(``UpdateCompleted``) is one of the run's commands, so a replay of the history
reproduces it; an update id makes a retried call return the recorded outcome
without running the handler again.  Time is ``MockClock(autojump_threshold=0)``.
"""

from __future__ import annotations

import functools
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
from aion_trio._events import make_batch

LIMIT = 3600  # mock seconds: every wait below is bounded by this

GREETINGS = {"en": "Hello, world", "fr": "Bonjour, monde", "de": "Hallo, Welt"}


def _types(history: Sequence[aion.Event]) -> list[str]:
    return [type(e.body).__name__ for e in history]


@aion.activity
async def lookup(language: str) -> str:
    await trio.sleep(5)
    return GREETINGS[language]


@aion.workflow
async def greeter(ctx: aion.WorkflowContext) -> list[Any]:
    language = "en"
    done = False
    calls = 0

    def validate_language(new: str) -> None:
        if new not in GREETINGS:
            raise ValueError(f"{new!r} is not a supported language")

    @ctx.update_handler("set_language", validator=validate_language)
    def set_language(new: str) -> str:
        nonlocal language
        previous, language = language, new
        return previous

    @ctx.update_handler("count")
    def count(step: int = 1) -> int:
        nonlocal calls
        calls += step
        return calls

    @ctx.update_handler("broken")
    def broken() -> None:
        raise RuntimeError("the handler broke")

    @ctx.signal_handler("finish")
    def finish(_: Any) -> None:
        nonlocal done
        done = True

    greeting = await ctx.run(lookup, language)
    await ctx.wait_condition(lambda: done)
    return [greeting, language, calls]


async def test_hello_update_returns_the_handlers_result_and_the_run_sees_its_change(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    async with aion.open_engine(store_url(), workflows=[greeter], activities=[lookup]) as engine:
        run = await engine.start(greeter, workflow_id="u")
        with trio.fail_after(LIMIT):
            assert await engine.update("u", "set_language", "fr") == "en"
            assert await engine.update("u", "set_language", "de") == "fr"
            await engine.signal("u", "finish")
            assert await run.result() == ["Hello, world", "de", 0]
        history = await engine.history("u")
    assert _types(history).count("UpdateAccepted") == 2
    assert _types(history).count("UpdateCompleted") == 2
    accepted = [e for e in history if isinstance(e.body, aion.UpdateAccepted)]
    completed = [e for e in history if isinstance(e.body, aion.UpdateCompleted)]
    for a, c in zip(accepted, completed, strict=True):
        assert isinstance(a.body, aion.UpdateAccepted)
        assert isinstance(c.body, aion.UpdateCompleted)
        assert a.body.name == "set_language"
        assert c.body.update_id == a.body.update_id
        assert a.seq < c.seq
    await assert_replays_cleanly(history, workflows=[greeter], activities=[lookup])


async def test_a_validator_rejection_raises_to_the_caller_and_records_nothing(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    async with aion.open_engine(store_url(), workflows=[greeter], activities=[lookup]) as engine:
        run = await engine.start(greeter, workflow_id="u")
        with trio.fail_after(LIMIT):
            await engine.update("u", "count")  # the run is parked with its handlers registered
            before = await engine.history("u")
            with pytest.raises(aion.UpdateRejected, match="'xx' is not a supported language") as caught:
                await engine.update("u", "set_language", "xx")
            assert caught.value.error_type == "ValueError"
            with pytest.raises(aion.UpdateRejected, match="no handler"):
                await engine.update("u", "no_such_update")
            assert await engine.history("u") == before
            await engine.signal("u", "finish")
            assert await run.result() == ["Hello, world", "en", 1]


async def test_a_handlers_exception_is_recorded_and_raised_to_the_caller_as_update_failed(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    async with aion.open_engine(store_url(), workflows=[greeter], activities=[lookup]) as engine:
        run = await engine.start(greeter, workflow_id="u")
        with trio.fail_after(LIMIT):
            with pytest.raises(aion.UpdateFailed, match="RuntimeError: the handler broke") as caught:
                await engine.update("u", "broken", update_id="b-1")
            assert (caught.value.error_type, caught.value.message) == ("RuntimeError", "the handler broke")
            with pytest.raises(aion.UpdateFailed, match="the handler broke"):
                await engine.update("u", "broken", update_id="b-1")  # the recorded outcome again
            await engine.signal("u", "finish")
            assert await run.result() == ["Hello, world", "en", 0]  # the run goes on
        history = await engine.history("u")
    (failed,) = [e.body for e in history if isinstance(e.body, aion.UpdateCompleted)]
    assert failed.result is None
    assert failed.error is not None
    assert failed.error.type == "RuntimeError"
    await assert_replays_cleanly(history, workflows=[greeter], activities=[lookup])


async def test_an_update_id_makes_a_retried_call_return_the_recorded_outcome_without_running_again(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    url = store_url()
    async with aion.open_engine(url, workflows=[greeter], activities=[lookup]) as engine:
        await engine.start(greeter, workflow_id="u")
        with trio.fail_after(LIMIT):
            assert await engine.update("u", "count", 5, update_id="c-1") == 5
            assert await engine.update("u", "count", 5, update_id="c-1") == 5
            assert await engine.update("u", "count", update_id="c-2") == 6
    async with aion.open_engine(url, workflows=[greeter], activities=[lookup]) as engine:
        with trio.fail_after(LIMIT):
            # After a restart the run replays both updates; a retry still gets the first outcome.
            assert await engine.update("u", "count", 5, update_id="c-1") == 5
            assert await engine.update("u", "count", update_id="c-3") == 7
            await engine.signal("u", "finish")
            assert await engine.result("u") == ["Hello, world", "en", 7]
        history = await engine.history("u")
    assert _types(history).count("UpdateAccepted") == 3
    assert _types(history).count("UpdateCompleted") == 3
    await assert_replays_cleanly(history, workflows=[greeter], activities=[lookup])


async def test_an_update_accepted_while_an_activity_runs_is_handled_before_its_result_is_observed(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    async with aion.open_engine(store_url(), workflows=[greeter], activities=[lookup]) as engine:
        run = await engine.start(greeter, workflow_id="u")
        with trio.fail_after(LIMIT):
            await trio.testing.wait_all_tasks_blocked()  # parked on the activity (5 s)
            assert await engine.update("u", "set_language", "fr") == "en"
            await engine.signal("u", "finish")
            # The activity was scheduled with "en" before the update: its greeting stays English.
            assert await run.result() == ["Hello, world", "fr", 0]
        history = await engine.history("u")
    types = _types(history)
    assert types.index("UpdateCompleted") < types.index("ActivityCompleted")
    await assert_replays_cleanly(history, workflows=[greeter], activities=[lookup])


async def test_an_update_to_an_evicted_run_replays_it_and_is_answered_from_its_replayed_state(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    config = aion.EngineConfig(evict_after=10.0)
    async with aion.open_engine(
        store_url(), workflows=[greeter], activities=[lookup], config=config
    ) as engine:
        run = await engine.start(greeter, workflow_id="u")
        with trio.fail_after(LIMIT):
            assert await engine.update("u", "count", 2, update_id="c-1") == 2
            await trio.sleep(30)  # idle and parked: evicted
            assert (await engine.describe("u")).residency == "evicted"
            assert await engine.update("u", "count", 1) == 3
            assert engine.statistics().reloads == 1
            assert await engine.update("u", "count", 2, update_id="c-1") == 2
            await engine.signal("u", "finish")
            assert await run.result() == ["Hello, world", "en", 3]


async def test_an_update_to_a_closed_workflow_is_refused_with_not_running(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    async with aion.open_engine(store_url(), workflows=[greeter], activities=[lookup]) as engine:
        run = await engine.start(greeter, workflow_id="u")
        await engine.signal("u", "finish")
        with trio.fail_after(LIMIT):
            await run.result()
            before = await engine.history("u")
            with pytest.raises(aion.NotRunning, match="update 'count'"):
                await engine.update("u", "count")
            with pytest.raises(aion.WorkflowNotFound):
                await engine.update("nope", "count")
        assert await engine.history("u") == before


@aion.workflow
async def eager(ctx: aion.WorkflowContext) -> str:
    done = False

    @ctx.update_handler("look_up")
    def look_up(language: str) -> None:
        ctx.start(lookup, language)  # a command: refused in a handler

    def peek(language: str) -> None:
        ctx.start_timer("peek", 1)  # a command: refused in a validator

    @ctx.update_handler("peeked", validator=peek)
    def peeked(language: str) -> None:
        pass

    @ctx.update_handler("finish")
    def finish() -> str:
        nonlocal done
        done = True
        return "finishing"

    await ctx.wait_condition(lambda: done)
    return "done"


async def test_a_command_issued_by_an_update_handler_or_validator_fails_the_update_not_the_run(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    async with aion.open_engine(store_url(), workflows=[eager], activities=[lookup]) as engine:
        run = await engine.start(eager, workflow_id="e")
        with trio.fail_after(LIMIT):
            with pytest.raises(aion.UpdateFailed, match="update handler 'look_up'") as failed:
                await engine.update("e", "look_up", "fr")
            assert failed.value.error_type == "WorkflowCommandError"
            with pytest.raises(aion.UpdateRejected, match="update validator 'peeked'") as rejected:
                await engine.update("e", "peeked", "fr")
            assert rejected.value.error_type == "WorkflowCommandError"
            assert await engine.update("e", "finish") == "finishing"
            assert await run.result() == "done"
        history = await engine.history("e")
    assert "ActivityScheduled" not in _types(history)
    assert "TimerStarted" not in _types(history)
    await assert_replays_cleanly(history, workflows=[eager], activities=[lookup])


def test_update_validators_must_be_plain_functions() -> None:
    async def main() -> None:
        @aion.workflow
        async def bad(ctx: aion.WorkflowContext) -> None:
            def handler() -> None:
                pass

            async def validator() -> None:
                pass

            ctx.set_update_handler("x", handler, validator=validator)

        async with aion.open_engine("memory://", workflows=[bad]) as engine:
            run = await engine.start(bad, workflow_id="b")
            with trio.fail_after(60), pytest.raises(aion.WorkflowFailure, match="async function"):
                await run.result()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


async def test_an_update_accepted_before_a_crash_is_handled_once_on_recovery_and_a_retry_gets_its_result(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    url = store_url()
    async with aion.open_engine(url, workflows=[greeter], activities=[lookup]) as engine:
        await engine.start(greeter, workflow_id="u")
        with trio.fail_after(LIMIT):
            assert await engine.update("u", "count", 2, update_id="c-1") == 2
    # What a crash right after update c-2 was accepted leaves: its UpdateAccepted, no outcome.
    async with aion.open_store(url) as store:
        before = await store.events.read_history("u")
        body = aion.UpdateAccepted(update_id="c-2", name="count", payload=aion.Payload.of([3]))
        crashed = make_batch("u", len(before) + 1, before[-1].recorded_at, [body])
        await store.events.append("u", crashed, len(before))
    async with aion.open_engine(url, workflows=[greeter], activities=[lookup]) as engine:
        with trio.fail_after(LIMIT):
            # The caller retries with the same id: the recovered run handled it, once.
            assert await engine.update("u", "count", 3, update_id="c-2") == 5
            await engine.signal("u", "finish")
            assert await engine.result("u") == ["Hello, world", "en", 5]
        history = await engine.history("u")
    assert _types(history).count("UpdateAccepted") == 2
    outcomes = [e.body for e in history if isinstance(e.body, aion.UpdateCompleted)]
    assert [(o.update_id, o.result) for o in outcomes] == [
        ("c-1", aion.Payload.of(2)),
        ("c-2", aion.Payload.of(5)),
    ]
    await assert_replays_cleanly(history, workflows=[greeter], activities=[lookup])


async def test_a_queued_update_command_is_accepted_by_the_owner_and_its_caller_reads_the_outcome(
    store_url: Callable[[], str],
) -> None:
    """As ``aion-trio update`` queues it for a live worker (PostgreSQL: the owning node drains it)."""
    url = store_url()
    url = f"{url}&node=update-node" if url.startswith("postgresql:") else url
    async with aion.open_store(url) as store:
        assert isinstance(store, aion.CommandInbox)
        async with aion.open_engine(store, workflows=[greeter], activities=[lookup]) as engine:
            run = await engine.start(greeter, workflow_id="u")
            command = aion.UpdateCommand(
                workflow_id="u", name="count", update_id="q-1", args=aion.Payload.of([4])
            )
            command_id = await store.enqueue_command(command)
            with trio.fail_after(10):
                while (outcome := await store.command_outcome(command_id)) is None:
                    await engine.drain_inbox()
                assert outcome.ok, outcome
                assert outcome.message == "update 'q-1' accepted by workflow 'u'"
                # The caller (or a retry with its id) gets the outcome the run recorded.
                assert await engine.update("u", "count", 4, update_id="q-1") == 4
                await engine.signal("u", "finish")
                assert await run.result() == ["Hello, world", "en", 4]
            history = await store.events.read_history("u")
    assert _types(history).count("UpdateAccepted") == 1


async def test_an_update_whose_run_ends_before_its_handler_ran_raises_update_unavailable(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    url = store_url()
    async with aion.open_engine(url, workflows=[greeter], activities=[lookup]) as engine:
        await engine.start(greeter, workflow_id="u")
        with trio.fail_after(LIMIT):
            assert await engine.update("u", "count") == 1
    # An update accepted for a handler this code never registers: the run cannot deliver it.
    async with aion.open_store(url) as store:
        before = await store.events.read_history("u")
        body = aion.UpdateAccepted(update_id="g-1", name="ghost", payload=aion.Payload.of([]))
        await store.events.append(
            "u", make_batch("u", len(before) + 1, before[-1].recorded_at, [body]), len(before)
        )
    async with aion.open_engine(url, workflows=[greeter], activities=[lookup]) as engine:
        with trio.fail_after(LIMIT):
            async with trio.open_nursery() as nursery:

                async def terminate_once_waiting() -> None:
                    await trio.testing.wait_all_tasks_blocked()
                    await engine.terminate("u", "operator")

                nursery.start_soon(terminate_once_waiting)
                with pytest.raises(aion.UpdateUnavailable, match="the run ended") as caught:
                    await engine.update("u", "ghost", update_id="g-1")
            assert caught.value.name == "ghost"


# --------------------------------------------------------------------------
# A real process SIGKILLed right after the update was accepted
# --------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent


def _caller(store: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tests.procs.update_worker", str(store), *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )


@pytest.mark.slow  # two caller subprocesses
def test_a_caller_sigkilled_after_the_accept_retries_with_its_id_and_the_handler_runs_once(
    tmp_path: Path,
) -> None:
    from procs.update_worker import tally

    store = tmp_path / "tally.db"
    killed = _caller(store, "die-after-accept")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert "COMMITTED ['UpdateAccepted']" in killed.stdout
    assert "RETURNED" not in killed.stdout, "control: the call never returned"

    retried = _caller(store)
    assert retried.returncode == 0, retried.stderr
    assert "RETURNED 5" in retried.stdout.splitlines(), retried.stdout

    async def finish() -> tuple[list[aion.Event], Any]:
        async with aion.open_engine(f"sqlite:///{store}", workflows=[tally]) as engine:
            with trio.fail_after(60):
                assert await engine.update("tally-1", "add", 1) == 6
                await engine.signal("tally-1", "close")
                result = await engine.result("tally-1")
            return await engine.history("tally-1"), result

    history, result = trio.run(finish)
    assert result == 6, "add-5 was added once"
    accepted = [e.body for e in history if isinstance(e.body, aion.UpdateAccepted)]
    completed = [e.body for e in history if isinstance(e.body, aion.UpdateCompleted)]
    assert [b.update_id for b in accepted].count("add-5") == 1
    assert [b.update_id for b in completed].count("add-5") == 1
    assert len(completed) == 2
    trio.run(functools.partial(assert_replays_cleanly, history, workflows=[tally]))
