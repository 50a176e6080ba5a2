"""Signal-with-start: one atomic call that starts the workflow if it is not running and
delivers the signal either way.

Scenarios carried over from Temporal's SDK tests (``signal_with_start``): the
first call starts the run with the signal, a second one signals the running run;
a closed workflow starts again (its id reuse policy allowing).  A start records
``WorkflowStarted`` and ``SignalReceived`` in one append (the start path's own),
so no crash leaves one without the other; request ids make a retry record
nothing; a real process SIGKILLed right after that append's commit, retried,
gives one start and one signal.
"""

from __future__ import annotations

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

import aion_trio as aion
from aion_trio import projections

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 3600  # mock seconds: every wait below is bounded by this


def _types(history: Sequence[aion.Event]) -> list[str]:
    return [e.type for e in history]


@aion.workflow
async def cart(ctx: aion.WorkflowContext, owner: str) -> dict[str, Any]:
    items: list[str] = []
    ctx.set_signal_handler("add", items.append)
    await ctx.wait_condition(lambda: "checkout" in items)
    return {"owner": owner, "items": items}


async def test_the_first_call_starts_the_run_with_the_signal_and_the_next_signals_it(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    async with aion.open_engine(store_url(), workflows=[cart]) as engine:
        first = await engine.signal_with_start(
            cart, "ann", workflow_id="cart-1", signal="add", payload="tea", search_attributes={"shop": "a"}
        )
        assert first.created
        history = await engine.history("cart-1")
        assert _types(history[:2]) == ["WorkflowStarted", "SignalReceived"]
        assert history[0].recorded_at == history[1].recorded_at, "one append: the start's"
        second = await engine.signal_with_start(
            cart, "bob", workflow_id="cart-1", signal="add", payload="cups"
        )
        assert (second.created, second.run_id) == (False, first.run_id), "running: a plain signal"
        await engine.signal("cart-1", "add", "checkout")
        with trio.fail_after(LIMIT):
            assert await first.result() == {"owner": "ann", "items": ["tea", "cups", "checkout"]}
        history = await engine.history("cart-1")
        assert _types(history).count("WorkflowStarted") == 1
        assert (await engine.describe("cart-1")).search_attributes == {"shop": "a"}


async def test_a_closed_workflow_starts_again_with_the_signal_as_its_policy_allows(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    async with aion.open_engine(store_url(), workflows=[cart]) as engine:
        first = await engine.signal_with_start(cart, "ann", workflow_id="c", signal="add", payload="checkout")
        with trio.fail_after(LIMIT):
            assert await first.result() == {"owner": "ann", "items": ["checkout"]}
        before = await engine.history("c")
        with pytest.raises(aion.WorkflowAlreadyStarted):
            await engine.signal_with_start(
                cart, "bob", workflow_id="c", signal="add", id_reuse=aion.IdReusePolicy.REJECT_DUPLICATE
            )
        with pytest.raises(aion.WorkflowAlreadyStarted):
            await engine.signal_with_start(
                cart, "bob", workflow_id="c", signal="add", id_reuse=aion.IdReusePolicy.ALLOW_IF_FAILED
            )
        with pytest.raises(ValueError, match="use_existing"):
            await engine.signal_with_start(
                cart, "bob", workflow_id="c", signal="add", id_reuse=aion.IdReusePolicy.USE_EXISTING
            )
        assert await engine.history("c") == before, "refused: nothing recorded"
        again = await engine.signal_with_start(cart, "bob", workflow_id="c", signal="add", payload="checkout")
        assert again.created
        assert again.run_id != first.run_id
        with trio.fail_after(LIMIT):
            assert await again.result() == {"owner": "bob", "items": ["checkout"]}
        assert projections.run_ids(await engine.history("c")) == [first.run_id, again.run_id]


async def test_bad_input_is_refused_before_anything_is_recorded(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    async with aion.open_engine(store_url(), workflows=[cart]) as engine:
        with pytest.raises(aion.UnknownWorkflowType):
            await engine.signal_with_start("nope", workflow_id="b", signal="add")
        with pytest.raises(aion.PayloadNotSerializable):
            await engine.signal_with_start(cart, "ann", workflow_id="b", signal="add", payload=object())
        with pytest.raises(aion.InvalidArguments):
            await engine.signal_with_start(cart, workflow_id="b", signal="add")
        with pytest.raises(ValueError, match="signal name"):
            await engine.signal_with_start(cart, "ann", workflow_id="b", signal="")
        with pytest.raises(ValueError, match="search attribute"):
            await engine.signal_with_start(
                cart, "ann", workflow_id="b", signal="add", search_attributes={"bad key": 1}
            )
        with pytest.raises(aion.WorkflowNotFound):
            await engine.history("b")


@pytest.mark.parametrize("running", [False, True])
async def test_a_call_retried_with_its_request_id_records_once(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock, running: bool
) -> None:
    async with aion.open_engine(store_url(), workflows=[cart]) as engine:
        if running:
            await engine.start(cart, "ann", workflow_id="r")
        calls = [
            await engine.signal_with_start(
                cart, "ann", workflow_id="r", signal="add", payload="tea", request_id="add-tea"
            )
            for _ in range(3)
        ]
        assert {(h.run_id, h.created) for h in calls} == {(calls[0].run_id, not running)}
        history = await engine.history("r")
        assert _types(history).count("WorkflowStarted") == 1
        assert [e.body.request_id for e in history if isinstance(e.body, aion.SignalReceived)] == ["add-tea"]
        with pytest.raises(ValueError, match="already used"):
            await engine.cancel("r", request_id="add-tea")
        await engine.signal("r", "add", "checkout")
        with trio.fail_after(LIMIT):
            assert (await engine.result("r"))["items"] == ["tea", "checkout"]


async def _apply_queued(
    engine: aion.Engine, store: aion.CommandInbox, command: aion.Command
) -> aion.CommandOutcome:
    command_id = await store.enqueue_command(command)
    with trio.fail_after(10):
        while (outcome := await store.command_outcome(command_id)) is None:
            await engine.drain_inbox()
    assert outcome.ok, outcome
    return outcome


def _queued(workflow_id: str, item: str) -> aion.SignalWithStartCommand:
    """As ``aion-trio signal WORKFLOW_ID add ITEM --start cart --start-arg '"ann"'`` queues it."""
    return aion.SignalWithStartCommand(
        workflow_id=workflow_id,
        workflow_type="cart",
        args=aion.Payload.of(["ann"]),
        signal_name="add",
        payload=aion.Payload.of(item),
        search_attributes={"via": "inbox"},
    )


async def test_a_queued_signal_with_start_starts_the_workflow_in_the_owner(tmp_path: Path) -> None:
    """The embedded stores' owner applies every queued command (a new workflow too)."""
    async with aion.open_store(f"sqlite:///{tmp_path / 'owned.db'}") as store:
        assert isinstance(store, aion.CommandInbox)
        async with aion.open_engine(store, workflows=[cart]) as engine:
            outcome = await _apply_queued(engine, store, _queued("q", "checkout"))
            assert outcome.message.startswith("started workflow 'q' run ")
            history = await store.events.read_history("q")
            assert _types(history[:2]) == ["WorkflowStarted", "SignalReceived"]
            assert history[1].body.request_id == history[0].body.request_id == "inbox:1"
            with trio.fail_after(10):
                assert await engine.result("q") == {"owner": "ann", "items": ["checkout"]}
            assert (await engine.describe("q")).search_attributes == {"via": "inbox"}


async def test_a_queued_signal_with_start_signals_the_running_run_in_its_owner(
    store_url: Callable[[], str],
) -> None:
    """On every store, cluster mode's too (PostgreSQL: the owning node drains it)."""
    url = store_url()
    url = f"{url}&node=inbox-node" if url.startswith("postgresql:") else url
    async with aion.open_store(url) as store:
        assert isinstance(store, aion.CommandInbox)
        async with aion.open_engine(store, workflows=[cart]) as engine:
            run = await engine.start(cart, "ann", workflow_id="q")
            outcome = await _apply_queued(engine, store, _queued("q", "checkout"))
            assert outcome.message == f"signalled running workflow 'q' run {run.run_id} with signal 'add'"
            with trio.fail_after(10):
                assert await run.result() == {"owner": "ann", "items": ["checkout"]}
            assert _types(await store.events.read_history("q")).count("WorkflowStarted") == 1


# --------------------------------------------------------------------------
# A real process SIGKILLed right after the start's append committed
# --------------------------------------------------------------------------


@aion.workflow(name="cart")
async def worker_cart(ctx: aion.WorkflowContext) -> list[str]:
    """The worker's ``cart`` (tests/procs/signal_with_start_worker.py), as this process runs it."""
    items: list[str] = []
    ctx.set_signal_handler("add", items.append)
    await ctx.wait_condition(lambda: "checkout" in items)
    return items


def _caller(store: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tests.procs.signal_with_start_worker", str(store), *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )


@pytest.mark.slow  # two caller subprocesses
def test_a_caller_sigkilled_after_the_commit_retries_to_one_start_and_one_signal(tmp_path: Path) -> None:
    store = tmp_path / "carts.db"
    killed = _caller(store, "die-after-append")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert "COMMITTED ['WorkflowStarted', 'SignalReceived']" in killed.stdout, "one append, both events"
    assert "RETURNED" not in killed.stdout, "control: the call never returned"

    retried = _caller(store)
    assert retried.returncode == 0, retried.stderr
    [line] = [x for x in retried.stdout.splitlines() if x.startswith("RETURNED")]
    _, run_id, created = line.split()
    assert created == "True", "the first call (same request id) started the run"

    async def finish() -> tuple[list[aion.Event], Any]:
        async with aion.open_engine(f"sqlite:///{store}", workflows=[worker_cart]) as engine:
            await engine.signal("cart-1", "add", "checkout")
            with trio.fail_after(60):
                result = await engine.result("cart-1")
            return await engine.history("cart-1"), result

    history, result = trio.run(finish)
    assert result == ["tea", "checkout"], "the signal delivered once"
    assert _types(history).count("WorkflowStarted") == 1
    assert projections.run_ids(history) == [run_id]
    assert [e.body.payload.value() for e in history if isinstance(e.body, aion.SignalReceived)] == [
        "tea",
        "checkout",
    ]
