"""Workflow-to-workflow messages: ``ctx.signal_external`` and ``ctx.cancel_external``.

Scenarios carried over from Temporal's SDK tests (a workflow signals or cancels
another by id; a missing target is an error the sender can catch): the intent is
recorded in the sender's history first (a command: replay finds it, another
target or payload there is non-determinism), then delivered with a request id
derived from the sender's run and the message's ordinal, and how it was received
(delivered, not found, closed) is recorded too, so a replay answers the same.
A sender stopped between the record and the delivery delivers on restart, once;
one stopped after the delivery but before the outcome delivers again and the
target's request-id dedupe makes that a no-op.  A real process SIGKILLed at each
of those points is the slow test at the end.  Every test runs on the store
``AION_TRIO_TEST_STORE`` names.
"""

from __future__ import annotations

import hashlib
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

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 3600  # mock seconds: every wait below is bounded by this


def _markers(history: Sequence[aion.Event], workflow_id: str | None = None) -> list[tuple[str, Any]]:
    return [
        (e.body.name, e.body.value.value())
        for e in history
        if isinstance(e.body, aion.MarkerRecorded) and e.body.name.startswith("external")
    ]


def _signals(history: Sequence[aion.Event]) -> list[tuple[str, Any, str | None]]:
    return [
        (e.body.name, e.body.payload.value(), e.body.request_id)
        for e in history
        if isinstance(e.body, aion.SignalReceived)
    ]


@aion.workflow
async def receiver(ctx: aion.WorkflowContext) -> list[Any]:
    got: list[Any] = []
    ctx.set_signal_handler("note", got.append)
    await ctx.wait_condition(lambda: "done" in got)
    return got


@aion.workflow
async def sleeper(ctx: aion.WorkflowContext) -> str:
    await ctx.sleep(3600 * 24)
    return "woke"


@aion.workflow
async def sender(ctx: aion.WorkflowContext, target: str) -> str:
    await ctx.signal_external(target, "note", {"n": 1})
    await ctx.signal_external(target, "note", "done")
    return "sent"


@aion.workflow
async def canceller(ctx: aion.WorkflowContext, target: str) -> str:
    await ctx.cancel_external(target, "no longer needed")
    return "cancelled it"


@aion.workflow
async def prober(ctx: aion.WorkflowContext, target: str) -> str:
    try:
        await ctx.signal_external(target, "note", "hello")
    except aion.WorkflowNotFound as exc:
        return f"not found: {exc.workflow_id}"
    except aion.NotRunning as exc:
        return f"closed: {exc.status}"
    return "delivered"


async def test_a_workflow_signals_another_and_both_histories_record_it(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    async with aion.open_engine(store_url(), workflows=[receiver, sender]) as engine:
        target = await engine.start(receiver, workflow_id="inbox-1")
        run = await engine.start(sender, "inbox-1", workflow_id="sender-1")
        with trio.fail_after(LIMIT):
            assert await run.result() == "sent"
            assert await target.result() == [{"n": 1}, "done"]
        sent = await engine.history("sender-1")
        assert _markers(sent) == [
            (
                "external:0",
                {"kind": "signal", "workflow_id": "inbox-1", "name": "note", "digest": _digest({"n": 1})},
            ),
            ("external-outcome:0", {"outcome": "delivered"}),
            (
                "external:1",
                {"kind": "signal", "workflow_id": "inbox-1", "name": "note", "digest": _digest("done")},
            ),
            ("external-outcome:1", {"outcome": "delivered"}),
        ]
        received = _signals(await engine.history("inbox-1"))
        assert [(name, payload) for name, payload, _ in received] == [("note", {"n": 1}), ("note", "done")]
        keys = [key for _, _, key in received]
        assert all(key and key.startswith("external:") for key in keys), keys
        assert len(set(keys)) == 2, "one request id per message"


def _digest(value: Any) -> str:
    """The digest of the encoded payload a signal's command key carries."""
    return hashlib.blake2b(aion.Payload.of(value).json.encode(), digest_size=16).hexdigest()


async def test_a_workflow_cancels_another(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    async with aion.open_engine(store_url(), workflows=[sleeper, canceller]) as engine:
        target = await engine.start(sleeper, workflow_id="long")
        run = await engine.start(canceller, "long", workflow_id="boss")
        with trio.fail_after(LIMIT):
            assert await run.result() == "cancelled it"
            with pytest.raises(aion.WorkflowFailure) as failure:
                await target.result()
        assert (failure.value.status, failure.value.reason) == ("cancelled", "no longer needed")
        requests = [
            e.body for e in await engine.history("long") if isinstance(e.body, aion.WorkflowCancelRequested)
        ]
        assert [r.reason for r in requests] == ["no longer needed"]
        assert (requests[0].request_id or "").startswith("external:")
        assert _markers(await engine.history("boss"))[1] == ("external-outcome:0", {"outcome": "delivered"})


async def test_a_missing_or_closed_target_is_a_typed_error_recorded_in_the_sender(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    url = store_url()
    async with aion.open_engine(url, workflows=[receiver, prober]) as engine:
        missing = await engine.start(prober, "nobody", workflow_id="p-1")
        done = await engine.start(receiver, workflow_id="closed")
        await engine.signal("closed", "note", "done")
        with trio.fail_after(LIMIT):
            assert await missing.result() == "not found: nobody"
            await done.result()
        closed = await engine.start(prober, "closed", workflow_id="p-2")
        with trio.fail_after(LIMIT):
            assert await closed.result() == "closed: completed"
        assert _markers(await engine.history("p-1"))[1] == ("external-outcome:0", {"outcome": "not_found"})
        assert _markers(await engine.history("p-2"))[1] == (
            "external-outcome:0",
            {"outcome": "closed", "status": "completed"},
        )
        with pytest.raises(aion.WorkflowNotFound):
            await engine.history("nobody")
    # A closed sender's query replays the recorded outcomes, delivering nothing.
    async with aion.open_engine(url, workflows=[receiver, prober]) as engine:
        before = await engine.history("closed")
        assert await engine.result("p-2") == "closed: completed"
        assert await engine.history("closed") == before


@aion.workflow(name="waiting_sender")
async def waiting_sender(ctx: aion.WorkflowContext, target: str) -> str:
    await ctx.signal_external(target, "note", {"n": 1})
    await ctx.wait_signal("finish")
    return "sent"


@aion.workflow(name="waiting_sender")
async def sender_to_another(ctx: aion.WorkflowContext, target: str) -> str:
    await ctx.signal_external("someone-else", "note", {"n": 1})
    await ctx.wait_signal("finish")
    return "sent"


@aion.workflow(name="waiting_sender")
async def sender_with_another_payload(ctx: aion.WorkflowContext, target: str) -> str:
    await ctx.signal_external(target, "note", {"n": 2})
    await ctx.wait_signal("finish")
    return "sent"


@aion.workflow(name="waiting_sender")
async def sender_that_cancels(ctx: aion.WorkflowContext, target: str) -> str:
    await ctx.cancel_external(target)
    await ctx.wait_signal("finish")
    return "sent"


async def _history_until(
    engine: aion.Engine, workflow_id: str, done: Callable[[list[aion.Event]], bool]
) -> list[aion.Event]:
    with trio.fail_after(20):
        while True:
            history = await engine.history(workflow_id)
            if done(history):
                return history
            await trio.sleep(0.005)


async def _stuck(engine: aion.Engine, workflow_id: str) -> str:
    with trio.fail_after(20):
        while True:
            description = await engine.describe(workflow_id)
            if description.stuck_reason:
                return description.stuck_reason
            await trio.sleep(0.005)


@pytest.mark.parametrize(
    ("changed", "wanted"),
    [
        (sender_to_another, "now requests signal 'note' to workflow 'someone-else'"),
        (sender_with_another_payload, "with other arguments"),
        (sender_that_cancels, "now requests cancel of workflow 'inbox-1'"),
    ],
)
async def test_another_message_on_replay_is_non_determinism(
    store_url: Callable[[], str], changed: aion.WorkflowDefinition[Any], wanted: str
) -> None:
    url = store_url()
    async with aion.open_engine(url, workflows=[receiver, waiting_sender]) as engine:
        await engine.start(receiver, workflow_id="inbox-1")
        await engine.start(waiting_sender, "inbox-1", workflow_id="s")
        history = await _history_until(engine, "s", lambda h: len(_markers(h)) == 2)
    async with aion.open_engine(url, workflows=[receiver, changed]) as engine:
        reason = await _stuck(engine, "s")
        assert "was recorded as signal 'note' to workflow 'inbox-1'" in reason, reason
        assert wanted in reason, reason
        assert await engine.history("s") == history, "nothing recorded for the divergent message"
        assert len(_signals(await engine.history("inbox-1"))) == 1, "nothing delivered again"


# --------------------------------------------------------------------------
# A sender stopped between recording and delivering, or before the outcome
# --------------------------------------------------------------------------


class _Stop(Exception):
    """Raised by the fault-injecting append: the engine stops here."""


async def _crash_sender_at(url: str, stop_when: Callable[[str, Sequence[aion.Event]], bool]) -> None:
    """Run sender → receiver until ``stop_when(workflow_id, batch)`` is true of a committed
    append, then abandon the engine there (its later appends are refused)."""
    stopped = trio.Event()
    async with aion.open_store(url) as store:
        real_append = store.events.append

        async def append(workflow_id: str, events: Sequence[aion.Event], expected_seq: int) -> None:
            if stopped.is_set():
                raise aion.BackendUnavailable("stopped")
            await real_append(workflow_id, events, expected_seq)
            if stop_when(workflow_id, events):
                stopped.set()

        store.events.append = append  # type: ignore[method-assign]
        async with aion.open_engine(store, workflows=[receiver, sender]) as engine:
            await engine.start(receiver, workflow_id="inbox-1")
            await engine.start(sender, "inbox-1", workflow_id="s")
            with trio.fail_after(LIMIT):
                await stopped.wait()
            await trio.testing.wait_all_tasks_blocked()


def _intent_committed(workflow_id: str, events: Sequence[aion.Event]) -> bool:
    return any(isinstance(e.body, aion.MarkerRecorded) and e.body.name == "external:0" for e in events)


def _delivered(workflow_id: str, events: Sequence[aion.Event]) -> bool:
    return workflow_id == "inbox-1" and any(isinstance(e.body, aion.SignalReceived) for e in events)


@pytest.mark.parametrize("stop_when", [_intent_committed, _delivered], ids=["after-intent", "after-delivery"])
async def test_a_sender_stopped_mid_send_delivers_exactly_once_on_restart(
    tmp_path: Path,
    autojump_clock: trio.testing.MockClock,
    stop_when: Callable[[str, Sequence[aion.Event]], bool],
) -> None:
    url = f"sqlite:///{tmp_path / 'messages.db'}"
    await _crash_sender_at(url, stop_when)
    async with aion.open_store(url) as store:
        before = _signals(await store.events.read_history("inbox-1"))
    assert len(before) == (1 if stop_when is _delivered else 0), before
    async with aion.open_engine(url, workflows=[receiver, sender]) as engine:
        with trio.fail_after(LIMIT):
            assert await engine.result("s") == "sent"
            assert await engine.result("inbox-1") == [{"n": 1}, "done"]
        assert [s[1] for s in _signals(await engine.history("inbox-1"))] == [{"n": 1}, "done"]
        names = [name for name, _ in _markers(await engine.history("s"))]
        assert names == ["external:0", "external-outcome:0", "external:1", "external-outcome:1"]


# --------------------------------------------------------------------------
# A real process SIGKILLed between recording the send and delivering it
# --------------------------------------------------------------------------


@pytest.mark.slow  # a worker subprocess per case
@pytest.mark.parametrize("when", ["die-after-intent", "die-after-delivery"])
def test_a_sender_sigkilled_mid_send_delivers_exactly_once_on_restart(tmp_path: Path, when: str) -> None:
    store = tmp_path / "messages.db"
    killed = subprocess.run(
        [sys.executable, "-m", "tests.procs.external_message_worker", str(store), when],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert "COMMITTED" in killed.stdout, killed.stdout
    assert "RETURNED" not in killed.stdout, "control: the sender never finished"

    async def restart() -> tuple[list[aion.Event], list[aion.Event], list[tuple[str, Any, str | None]]]:
        async with aion.open_store(f"sqlite:///{store}") as opened:
            before = _signals(await opened.events.read_history("inbox-1"))
        async with aion.open_engine(f"sqlite:///{store}", workflows=[receiver, sender]) as engine:
            with trio.fail_after(60):
                assert await engine.result("s") == "sent"
                assert await engine.result("inbox-1") == [{"n": 1}, "done"]
            return await engine.history("s"), await engine.history("inbox-1"), before

    sent, received, before = trio.run(restart)
    assert len(before) == (0 if when == "die-after-intent" else 1), "control: where the process died"
    signals = _signals(received)
    assert [payload for _, payload, _ in signals] == [{"n": 1}, "done"], "delivered exactly once"
    if before:
        assert signals[0] == before[0], "the redelivery was the same request, recorded once"
    assert [name for name, _ in _markers(sent)] == [
        "external:0",
        "external-outcome:0",
        "external:1",
        "external-outcome:1",
    ]


@aion.workflow
async def selfish(ctx: aion.WorkflowContext) -> list[Any]:
    got: list[Any] = []
    ctx.set_signal_handler("me", got.append)
    await ctx.signal_external(ctx.workflow_id, "me", 1)
    await ctx.wait_condition(lambda: bool(got))
    return got


async def test_a_workflow_may_signal_itself(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    async with aion.open_engine(store_url(), workflows=[selfish]) as engine:
        run = await engine.start(selfish, workflow_id="self")
        with trio.fail_after(LIMIT):
            assert await run.result() == [1]
