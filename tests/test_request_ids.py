"""Request ids: every client call and inbox command is applied exactly once.

One mechanism (docs/concepts.md, "Request ids"): the event a call records
carries its request id, so a retry, or an inbox command delivered again
after its worker died between applying and acking it, finds the effect in
the workflow's history, records nothing and answers with the first outcome.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

import aion_trio as aion
from aion_trio import projections
from aion_trio.testing import FlakyStoreBundle

ROOT = Path(__file__).resolve().parent.parent


@aion.workflow
async def echo(ctx: aion.WorkflowContext, value: int) -> int:
    return value


@aion.workflow
async def waits(ctx: aion.WorkflowContext, count: int) -> list[Any]:
    return [await ctx.wait_signal("go") for _ in range(count)]


BROKEN: set[str] = set()
"""Workflow ids whose ``fails_until_reopened`` still fails (the bug not yet fixed)."""


@aion.workflow
async def fails_until_reopened(ctx: aion.WorkflowContext) -> str:
    await ctx.wait_signal("go")
    if ctx.workflow_id in BROKEN:
        BROKEN.discard(ctx.workflow_id)  # "deploy the fix": the reopened run passes
        raise ValueError("broken")
    return "fixed"


@aion.workflow
async def continues(ctx: aion.WorkflowContext, left: int) -> int:
    if left:
        raise ctx.continue_as_new(left - 1)
    return 0


WORKFLOWS = [echo, waits, fails_until_reopened, continues]


@pytest.fixture
def inbox_url(store_url: Callable[[], str]) -> Callable[[], str]:
    """Store URLs whose store has a command inbox: PostgreSQL's is cluster mode's (a node id)."""

    def make() -> str:
        url = store_url()
        return f"{url}&node=inbox-node" if url.startswith("postgresql:") else url

    return make


def types(history: list[aion.Event]) -> list[str]:
    return [e.type for e in history]


async def _ambiguous(flaky: FlakyStoreBundle, call: Callable[[], Awaitable[Any]]) -> None:
    """Run ``call`` with its append committed but its acknowledgement lost."""
    before = flaky.events.faults["append"]
    flaky.events.commit_then_fail_next_appends(1, aion.BackendUnavailable("injected: ack lost"))
    with pytest.raises(aion.BackendUnavailable, match="ack lost"):
        await call()
    assert flaky.events.faults["append"] == before + 1, "control: the commit landed unacknowledged"


# --------------------------------------------------------------------------
# Direct calls: the same key twice records once and returns the first outcome
# --------------------------------------------------------------------------


async def test_a_start_retried_with_its_key_after_a_lost_ack_returns_the_one_run_and_runs_it(
    store_url: Callable[[], str],
) -> None:
    async with aion.open_store(store_url()) as inner:
        flaky = FlakyStoreBundle(inner)
        async with aion.open_engine(flaky, workflows=WORKFLOWS) as engine:
            first = await engine.start(echo, 1, workflow_id="order")
            assert first.created
            assert await first.result() == 1
            # The id has a completed run: the default policy would start another each retry.
            await _ambiguous(flaky, lambda: engine.start(echo, 2, workflow_id="order", request_id="k-1"))
            again = await engine.start(echo, 2, workflow_id="order", request_id="k-1")
            assert again.created, "the first outcome: this key's call created the run"
            with trio.fail_after(10):
                assert await again.result() == 2, "the run the lost-ack start recorded is resumed"
            # The key is remembered whatever the run did since.
            third = await engine.start(echo, 3, workflow_id="order", request_id="k-1")
            assert third.run_id == again.run_id
            history = await inner.events.read_history("order")
            assert projections.run_ids(history) == [first.run_id, again.run_id]


async def test_a_start_on_a_new_id_retried_with_its_key_resumes_the_run_the_lost_ack_recorded(
    store_url: Callable[[], str],
) -> None:
    async with aion.open_store(store_url()) as inner:
        flaky = FlakyStoreBundle(inner)
        async with aion.open_engine(flaky, workflows=WORKFLOWS) as engine:
            await _ambiguous(flaky, lambda: engine.start(echo, 5, workflow_id="fresh", request_id="k"))
            handle = await engine.start(echo, 5, workflow_id="fresh", request_id="k")
            with trio.fail_after(10):
                assert await handle.result() == 5
            assert types(await inner.events.read_history("fresh")) == ["WorkflowStarted", "WorkflowCompleted"]


async def test_a_signal_retried_with_its_key_is_recorded_once(store_url: Callable[[], str]) -> None:
    async with aion.open_store(store_url()) as inner:
        flaky = FlakyStoreBundle(inner)
        async with aion.open_engine(flaky, workflows=WORKFLOWS) as engine:
            run = await engine.start(waits, 2, workflow_id="w")
            await _ambiguous(flaky, lambda: engine.signal("w", "go", "first", request_id="s-1"))
            await engine.signal("w", "go", "first", request_id="s-1")
            await engine.signal("w", "go", "second", request_id="s-2")
            with trio.fail_after(10):
                assert await run.result() == ["first", "second"]
            # Retried after the run ended: the first outcome (recorded), not NotRunning.
            await engine.signal("w", "go", "first", request_id="s-1")
            signals = [e.body for e in await inner.events.read_history("w") if e.type == "SignalReceived"]
            assert [(s.payload.value(), s.request_id) for s in signals] == [
                ("first", "s-1"),
                ("second", "s-2"),
            ]


async def test_cancel_and_terminate_retried_with_their_keys_record_once_and_are_not_refused(
    store_url: Callable[[], str],
) -> None:
    async with aion.open_store(store_url()) as inner:
        flaky = FlakyStoreBundle(inner)
        async with aion.open_engine(flaky, workflows=WORKFLOWS) as engine:
            cancelled = await engine.start(waits, 1, workflow_id="c")
            await _ambiguous(flaky, lambda: engine.cancel("c", "asked", request_id="c-1"))
            await engine.cancel("c", "asked", request_id="c-1")
            with pytest.raises(aion.WorkflowFailure, match="cancelled"), trio.fail_after(10):
                await cancelled.result()
            await engine.cancel("c", "asked", request_id="c-1")  # ended since: still the first outcome
            history = await inner.events.read_history("c")
            assert types(history).count("WorkflowCancelRequested") == 1

            terminated = await engine.start(waits, 1, workflow_id="t")
            await _ambiguous(flaky, lambda: engine.terminate("t", "stop", request_id="t-1"))
            await engine.terminate("t", "stop", request_id="t-1")
            with pytest.raises(aion.WorkflowFailure, match="cancelled"), trio.fail_after(10):
                await terminated.result()
            with pytest.raises(aion.NotRunning):
                await engine.terminate("t", "stop", request_id="t-2")  # control: a new key is refused
            history = await inner.events.read_history("t")
            assert types(history).count("WorkflowCancelled") == 1
            assert history[-1].type != "WorkflowStarted"


async def test_a_reopen_retried_with_its_key_returns_the_first_handle_and_runs_once(
    store_url: Callable[[], str],
) -> None:
    async with aion.open_store(store_url()) as inner:
        flaky = FlakyStoreBundle(inner)
        async with aion.open_engine(flaky, workflows=WORKFLOWS) as engine:
            BROKEN.add("r")
            run = await engine.start(fails_until_reopened, workflow_id="r")
            await engine.signal("r", "go")
            with pytest.raises(aion.WorkflowFailure, match="failed"), trio.fail_after(10):
                await run.result()
            await _ambiguous(flaky, lambda: engine.reopen("r", request_id="r-1"))
            handle = await engine.reopen("r", request_id="r-1")
            assert handle.run_id == run.run_id
            assert not handle.created
            history = await inner.events.read_history("r")
            assert types(history).count("WorkflowReopened") == 1
            reopened = next(e.body for e in history if isinstance(e.body, aion.WorkflowReopened))
            assert reopened.request_id == "r-1"
            with trio.fail_after(10):
                assert await handle.result() == "fixed", "the reopened run is resumed and runs once"


async def test_a_reopen_whose_acknowledgement_was_lost_runs_without_being_retried(
    autojump_clock: trio.testing.MockClock, store_url: Callable[[], str]
) -> None:
    async with aion.open_store(store_url()) as inner:
        flaky = FlakyStoreBundle(inner)
        async with aion.open_engine(flaky, workflows=WORKFLOWS) as engine:
            BROKEN.add("r")
            run = await engine.start(fails_until_reopened, workflow_id="r")
            await engine.signal("r", "go")
            with pytest.raises(aion.WorkflowFailure, match="failed"), trio.fail_after(10):
                await run.result()
            await _ambiguous(flaky, lambda: engine.reopen("r"))
            kinds: list[str] = []
            with trio.move_on_after(3600):  # mock time: look once a second until the run ends
                while "WorkflowCompleted" not in kinds:
                    await trio.sleep(1)
                    kinds = types(await inner.events.read_history("r"))
    assert kinds.count("WorkflowReopened") == 1
    assert kinds[-1] == "WorkflowCompleted", "the reopened run is run by this engine, unretried"


async def test_keys_are_per_workflow_id_across_its_runs_and_one_key_names_one_call(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with aion.open_engine("memory://", workflows=WORKFLOWS) as engine:
        first = await engine.start(continues, 2, workflow_id="cx", request_id="same")
        assert await first.result() == 0
        # Still the first start after two continue-as-new successors.
        again = await engine.start(continues, 2, workflow_id="cx", request_id="same")
        assert again.run_id == first.run_id
        assert len(projections.run_ids(await engine.history("cx"))) == 3
        # The same key on another workflow id is another call.
        other = await engine.start(echo, 7, workflow_id="other", request_id="same")
        assert other.run_id != first.run_id
        assert await other.result() == 7
        # A key spent on a start is not a signal's.
        waiting = await engine.start(waits, 1, workflow_id="sig", request_id="k")
        with pytest.raises(ValueError, match="already used on workflow 'sig' for a WorkflowStarted"):
            await engine.signal("sig", "go", request_id="k")
        before = len(await engine.history("sig"))
        with pytest.raises(ValueError, match="needs an explicit workflow_id"):
            await engine.start(echo, 1, request_id="no-id")
        for bad, error in (
            ("", ValueError),
            (5, TypeError),
            ("x" * 201, ValueError),
            ("a\nb", ValueError),
            ("a\ud800", ValueError),
            ("inbox:3", ValueError),
        ):
            with pytest.raises(error, match="request_id"):
                await engine.signal("sig", "go", request_id=bad)  # type: ignore[arg-type]
        assert len(await engine.history("sig")) == before
        await engine.signal("sig", "go", 1)
        assert await waiting.result() == [1]


async def test_a_handle_says_whether_its_call_created_the_run(autojump_clock: trio.testing.MockClock) -> None:
    async with aion.open_engine("memory://", workflows=WORKFLOWS) as engine:
        first = await engine.start(echo, 1, workflow_id="h")
        attached = await engine.start(echo, 2, workflow_id="h", id_reuse=aion.IdReusePolicy.USE_EXISTING)
        assert (first.created, attached.created) == (True, False)
        assert attached.run_id == first.run_id
        assert "existing" in repr(attached)
        assert "existing" not in repr(first)
        # Queued for a worker, the outcome says the same.
        inbox = engine.store
        assert isinstance(inbox, aion.CommandInbox)
        command_id = await inbox.enqueue_command(
            aion.StartCommand(
                workflow_id="h", workflow_type="echo", args=aion.Payload.of([2]), id_reuse="use_existing"
            )
        )
        await engine.drain_inbox()
        outcome = await inbox.command_outcome(command_id)
        assert outcome is not None
        assert outcome.message == f"attached to existing workflow 'h' run {first.run_id}"


# --------------------------------------------------------------------------
# Inbox commands: applied, then the ack lost: delivered again, applied once
# --------------------------------------------------------------------------


async def _prepare(engine: aion.Engine, kind: str) -> aion.Command:
    """Set up workflow ``x`` for a command of ``kind``; the command (queued without a request id)."""
    if kind == "start":
        assert await (await engine.start(echo, 1, workflow_id="x")).result() == 1
        return aion.StartCommand(workflow_id="x", workflow_type="echo", args=aion.Payload.of([2]))
    if kind == "reopen":
        BROKEN.add("x")
        run = await engine.start(fails_until_reopened, workflow_id="x")
        await engine.signal("x", "go")
        with pytest.raises(aion.WorkflowFailure):
            await run.result()
        return aion.ReopenCommand(workflow_id="x")
    await engine.start(waits, 2, workflow_id="x")
    if kind == "signal":
        return aion.SignalCommand(workflow_id="x", name="go", payload=aion.Payload.of(1))
    if kind == "cancel":
        return aion.CancelCommand(workflow_id="x", reason="asked")
    return aion.TerminateCommand(workflow_id="x", reason="stop")


async def _drain_until_acked(engine: aion.Engine, store: aion.CommandInbox, command_id: int) -> None:
    """Drain until the command's ack lands (the engine's own drains, in cluster mode woken by
    the store's notifications, may be the ones that apply it)."""
    with trio.fail_after(10):
        while await store.command_outcome(command_id) is None:
            with contextlib.suppress(aion.BackendUnavailable):
                await engine.drain_inbox()


EFFECT = {
    "start": "WorkflowStarted",
    "signal": "SignalReceived",
    "cancel": "WorkflowCancelRequested",
    "terminate": "WorkflowCancelled",
    "reopen": "WorkflowReopened",
}


@pytest.mark.parametrize("kind", list(EFFECT))
async def test_an_inbox_command_delivered_again_after_a_lost_ack_is_applied_once_with_its_first_outcome(
    inbox_url: Callable[[], str], kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with aion.open_store(inbox_url()) as store:
        assert isinstance(store, aion.CommandInbox)
        async with aion.open_engine(store, workflows=WORKFLOWS) as engine:
            command = await _prepare(engine, kind)
            before = types(await store.events.read_history("x")).count(EFFECT[kind])
            command_id = await store.enqueue_command(command)
            real_ack = store.ack_command
            acks: list[aion.CommandOutcome] = []

            async def lose_first_ack(self: object, cid: int, outcome: aion.CommandOutcome) -> None:
                acks.append(outcome)
                if len(acks) == 1:
                    raise aion.BackendUnavailable("injected: the worker died before the ack")
                await real_ack(cid, outcome)

            monkeypatch.setattr(type(store), "ack_command", lose_first_ack)
            await _drain_until_acked(engine, store, command_id)
            first, second = acks  # the lost ack, then the one of its redelivery
            assert first.ok, first
            assert second == first, "delivered again: the first outcome"
            assert await store.command_outcome(command_id) == first
            history = await store.events.read_history("x")
            assert types(history).count(EFFECT[kind]) == before + 1
            recorded = [e.body for e in history if e.type == EFFECT[kind]][-1]
            assert recorded.request_id == f"inbox:{command_id}"


async def test_a_query_command_delivered_again_is_answered_again_and_records_nothing(
    inbox_url: Callable[[], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    @aion.workflow(name="queried")
    async def queried(ctx: aion.WorkflowContext) -> None:
        ctx.set_query_handler("n", lambda: 42)
        await ctx.wait_signal("go")

    async with aion.open_store(inbox_url()) as store:
        assert isinstance(store, aion.CommandInbox)
        async with aion.open_engine(store, workflows=[queried]) as engine:
            await engine.start(queried, workflow_id="q")
            with trio.fail_after(10):
                while True:
                    try:
                        assert await engine.query("q", "n") == 42
                        break
                    except aion.QueryUnavailable:
                        await trio.sleep(0.01)
            length = len(await store.events.read_history("q"))
            command_id = await store.enqueue_command(aion.QueryCommand(workflow_id="q", name="n"))
            real_ack = store.ack_command
            failed = False

            async def lose_first_ack(self: object, cid: int, outcome: aion.CommandOutcome) -> None:
                nonlocal failed
                if not failed:
                    failed = True
                    raise aion.BackendUnavailable("injected")
                await real_ack(cid, outcome)

            monkeypatch.setattr(type(store), "ack_command", lose_first_ack)
            await _drain_until_acked(engine, store, command_id)
            assert failed, "control: the first ack was lost"
            outcome = await store.command_outcome(command_id)
            assert outcome is not None
            assert outcome.ok
            assert outcome.message == "42"
            assert len(await store.events.read_history("q")) == length
            await engine.terminate("q")


# --------------------------------------------------------------------------
# A real worker SIGKILLed between applying a queued start and acking it
# --------------------------------------------------------------------------


def _worker(store: Path, ledger: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tests.procs.inbox_worker", str(store), str(ledger), *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )


@pytest.mark.slow  # two worker subprocesses
def test_a_queued_start_whose_worker_is_sigkilled_before_the_ack_runs_once_and_charges_once(
    tmp_path: Path,
) -> None:
    store, ledger = tmp_path / "shop.db", tmp_path / "ledger.txt"

    async def enqueue() -> int:
        async with aion.open_store(f"sqlite:///{store}") as opened:
            assert isinstance(opened, aion.CommandInbox)
            # As `aion-trio start checkout '"order-1"' --id order-1` queues it for a worker.
            return await opened.enqueue_command(
                aion.StartCommand(
                    workflow_id="order-1", workflow_type="checkout", args=aion.Payload.of(["o-1"])
                )
            )

    async def inspect(command_id: int) -> tuple[list[str], aion.CommandOutcome | None]:
        async with aion.open_store(f"sqlite:///{store}") as opened:
            assert isinstance(opened, aion.CommandInbox)
            history = await opened.events.read_history("order-1")
            return types(history), await opened.command_outcome(command_id)

    command_id = trio.run(enqueue)
    killed = _worker(store, ledger, "die-before-ack")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert "APPLIED started workflow 'order-1'" in killed.stdout
    assert ledger.read_text().splitlines() == ["o-1"]
    assert trio.run(inspect, command_id)[1] is None, "control: the command was applied but not acked"

    resumed = _worker(store, ledger)
    assert resumed.returncode == 0, resumed.stderr
    assert ledger.read_text().splitlines() == ["o-1"], "one charge"
    history, outcome = trio.run(inspect, command_id)
    assert history.count("WorkflowStarted") == 1, history
    assert outcome is not None
    assert outcome.ok
    assert outcome.message.startswith("started workflow 'order-1'")
