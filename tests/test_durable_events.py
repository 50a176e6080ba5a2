"""Durable events: a workflow publishes key/value state with ``ctx.set_event``; callers
read it, or wait for it, with ``engine.get_event`` and ``aion-trio event get``.

Scenarios carried over from DBOS's ``set_event`` / ``get_event`` tests: values are
read back by key, the last write wins, a reader waits for a value published
later, a wait for a key never published ends with ``None`` at its timeout, and
(this engine's decision) a closed workflow that never published the key answers
``None`` at once.  ``set_event`` is a recorded command: a restart replays it and
records nothing twice, another value on replay is non-determinism.  Every test
runs on the store ``AION_TRIO_TEST_STORE`` names.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from test_cli import run_cli

import aion_trio as aion

LIMIT = 3600  # mock seconds: every wait below is bounded by this


def _published(history: Sequence[aion.Event]) -> list[Any]:
    return [
        e.body.value.value()
        for e in history
        if isinstance(e.body, aion.MarkerRecorded) and e.body.name.startswith("set-event:")
    ]


@aion.workflow
async def publisher(ctx: aion.WorkflowContext) -> str:
    await ctx.set_event("stage", "received")
    await ctx.set_event("payment", {"id": 7, "ok": True})
    await ctx.wait_signal("go")
    await ctx.set_event("stage", "shipped")
    await ctx.wait_signal("finish")
    return "done"


async def test_events_are_read_by_key_and_the_last_write_wins(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    async with aion.open_engine(store_url(), workflows=[publisher]) as engine:
        await engine.start(publisher, workflow_id="p")
        with trio.fail_after(LIMIT):
            assert await engine.get_event("p", "payment", timeout=LIMIT) == {"id": 7, "ok": True}
            assert await engine.get_event("p", "stage", timeout=LIMIT) == "received"
        await engine.signal("p", "go")
        with trio.fail_after(LIMIT):
            while await engine.get_event("p", "stage", timeout=LIMIT) != "shipped":
                await trio.testing.wait_all_tasks_blocked()
        assert _published(await engine.history("p")) == [
            {"key": "stage", "value": "received"},
            {"key": "payment", "value": {"id": 7, "ok": True}},
            {"key": "stage", "value": "shipped"},
        ]


@aion.workflow
async def late_publisher(ctx: aion.WorkflowContext) -> None:
    await ctx.sleep(30)
    await ctx.set_event("ready", 42)
    await ctx.wait_signal("finish")


async def test_a_reader_waits_for_a_value_published_later_or_times_out(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    async with aion.open_engine(store_url(), workflows=[late_publisher]) as engine:
        await engine.start(late_publisher, workflow_id="late")
        began = trio.current_time()
        with trio.fail_after(LIMIT):
            assert await engine.get_event("late", "never", timeout=5) is None
        assert trio.current_time() - began == pytest.approx(5), "waited its whole timeout"
        with trio.fail_after(LIMIT):
            assert await engine.get_event("late", "ready", timeout=60) == 42
        assert 30 <= trio.current_time() - began < 60, "returned when it was published"


@aion.workflow
async def quiet(ctx: aion.WorkflowContext) -> str:
    await ctx.set_event("one", 1)
    return "done"


async def test_a_closed_workflow_that_never_published_the_key_answers_none_at_once(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    async with aion.open_engine(store_url(), workflows=[quiet]) as engine:
        run = await engine.start(quiet, workflow_id="q")
        with trio.fail_after(LIMIT):
            await run.result()
        began = trio.current_time()
        assert await engine.get_event("q", "other", timeout=LIMIT) is None
        assert trio.current_time() == began, "no wait: nothing can publish it any more"
        assert await engine.get_event("q", "one", timeout=0) == 1, "published values outlive the run"
        with pytest.raises(aion.WorkflowNotFound):
            await engine.get_event("nobody", "one", timeout=1)
        with pytest.raises(ValueError, match="event key"):
            await engine.get_event("q", "", timeout=1)


async def test_a_restart_replays_set_event_and_records_it_once(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    url = store_url()
    async with aion.open_engine(url, workflows=[publisher]) as engine:
        await engine.start(publisher, workflow_id="p")
        with trio.fail_after(LIMIT):
            assert await engine.get_event("p", "payment", timeout=LIMIT) == {"id": 7, "ok": True}
    async with aion.open_engine(url, workflows=[publisher]) as engine:
        await engine.signal("p", "go")
        with trio.fail_after(LIMIT):
            while await engine.get_event("p", "stage", timeout=LIMIT) != "shipped":
                await trio.testing.wait_all_tasks_blocked()
        await engine.signal("p", "finish")
        with trio.fail_after(LIMIT):
            assert await engine.result("p") == "done"
        assert len(_published(await engine.history("p"))) == 3, "replay recorded nothing twice"


@aion.workflow(name="publisher")
async def publisher_with_another_value(ctx: aion.WorkflowContext) -> str:
    await ctx.set_event("stage", "lost")
    await ctx.wait_signal("finish")
    return "done"


async def _stuck(engine: aion.Engine, workflow_id: str) -> str:
    with trio.fail_after(20):
        while True:
            description = await engine.describe(workflow_id)
            if description.stuck_reason:
                return description.stuck_reason
            await trio.sleep(0.005)


async def test_another_value_on_replay_is_non_determinism(store_url: Callable[[], str]) -> None:
    url = store_url()
    async with aion.open_engine(url, workflows=[publisher]) as engine:
        await engine.start(publisher, workflow_id="p")
        with trio.fail_after(20):
            await engine.get_event("p", "payment", timeout=20)
        before = await engine.history("p")
    async with aion.open_engine(url, workflows=[publisher_with_another_value]) as engine:
        reason = await _stuck(engine, "p")
        assert "was recorded as set_event 'stage'" in reason, reason
        assert "with other arguments" in reason, reason
        assert await engine.history("p") == before


@aion.workflow
async def bad_publisher(ctx: aion.WorkflowContext, key: Any) -> str:
    try:
        await ctx.set_event(key, object() if key == "obj" else 1)
    except (ValueError, TypeError) as exc:
        return type(exc).__name__
    return "accepted"


@pytest.mark.parametrize(
    ("key", "error"), [("", "ValueError"), (3, "ValueError"), ("obj", "PayloadNotSerializable")]
)
async def test_a_bad_key_or_value_raises_in_the_workflow_and_records_nothing(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock, key: Any, error: str
) -> None:
    async with aion.open_engine(store_url(), workflows=[bad_publisher]) as engine:
        run = await engine.start(bad_publisher, key, workflow_id="b")
        with trio.fail_after(LIMIT):
            assert await run.result() == error
        assert _published(await engine.history("b")) == []


def test_the_cli_reads_a_published_event(tmp_path: Path) -> None:
    db = tmp_path / "events.db"

    async def seed() -> None:
        async with aion.open_engine(f"sqlite:///{db}", workflows=[quiet]) as engine:
            with trio.fail_after(20):
                await (await engine.start(quiet, workflow_id="q")).result()

    trio.run(seed)
    found = run_cli("event", "get", "q", "one", "--store", str(db))
    assert found.exit_code == 0, found.output
    assert json.loads(found.stdout) == 1
    missing = run_cli("event", "get", "q", "two", "--store", str(db), "--timeout", "30")
    assert missing.exit_code == 0, missing.output
    assert json.loads(missing.stdout) is None, "closed without it: null at once"
    unknown = run_cli("event", "get", "nope", "one", "--store", str(db))
    assert unknown.exit_code == 1
    assert "workflow 'nope' does not exist" in unknown.stderr or "does not exist" in unknown.output


# --------------------------------------------------------------------------
# From another workflow: ctx.get_event (recorded; its timeout a durable timer)
# --------------------------------------------------------------------------


@aion.workflow
async def reader(ctx: aion.WorkflowContext, target: str, key: str, seconds: float) -> Any:
    try:
        return {"got": await ctx.get_event(target, key, timeout=seconds)}
    except aion.WorkflowNotFound:
        return "no such workflow"


def _reads(history: Sequence[aion.Event]) -> list[tuple[str, Any]]:
    return [
        (e.body.name, e.body.value.value())
        for e in history
        if isinstance(e.body, aion.MarkerRecorded) and e.body.name.startswith("get-event")
    ]


async def test_a_workflow_waits_for_another_workflows_event(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    async with aion.open_engine(store_url(), workflows=[late_publisher, reader]) as engine:
        await engine.start(late_publisher, workflow_id="late")
        began = trio.current_time()
        run = await engine.start(reader, "late", "ready", 3600, workflow_id="r")
        with trio.fail_after(LIMIT):
            assert await run.result() == {"got": 42}
        assert 30 <= trio.current_time() - began < 3600, "woken when it was published"
        history = await engine.history("r")
        assert _reads(history) == [
            ("get-event:0", {"workflow_id": "late", "key": "ready", "first": {"outcome": "waiting"}}),
            ("get-event-result:0", {"outcome": "published", "value": 42}),
        ]
        types = [e.type for e in history]
        assert "TimerStarted" in types, "the wait's timeout is a durable timer"
        assert "TimerCancelled" in types, "and it is cancelled once the value came first"


async def test_a_workflow_read_times_out_on_its_durable_timer_or_answers_at_once(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    async with aion.open_engine(store_url(), workflows=[late_publisher, quiet, reader]) as engine:
        await engine.start(late_publisher, workflow_id="late")
        timed_out = await engine.start(reader, "late", "never", 10, workflow_id="r-1")
        with trio.fail_after(LIMIT):
            assert await timed_out.result() == {"got": None}
        assert "TimerFired" in [e.type for e in await engine.history("r-1")]
        with trio.fail_after(LIMIT):
            await (await engine.start(quiet, workflow_id="q")).result()
        answers = {}
        for name, key, target in [("r-2", "one", "q"), ("r-3", "two", "q"), ("r-4", "one", "nobody")]:
            with trio.fail_after(LIMIT):
                answers[name] = await (
                    await engine.start(reader, target, key, 3600, workflow_id=name)
                ).result()
            assert "TimerStarted" not in [e.type for e in await engine.history(name)], "answered at once"
        assert answers == {"r-2": {"got": 1}, "r-3": {"got": None}, "r-4": "no such workflow"}


async def test_a_restart_mid_wait_watches_again_and_replays_the_same_answer(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    url = store_url()
    async with aion.open_engine(url, workflows=[publisher, reader]) as engine:
        await engine.start(publisher, workflow_id="p")
        await engine.start(reader, "p", "late-key", 3600, workflow_id="r")
        with trio.fail_after(LIMIT):
            while not _reads(await engine.history("r")):
                await trio.testing.wait_all_tasks_blocked()
    async with aion.open_engine(url, workflows=[publisher_of_late_key, reader]) as engine:
        await engine.signal("p", "go")
        with trio.fail_after(LIMIT):
            assert await engine.result("r") == {"got": "at last"}
        assert [name for name, _ in _reads(await engine.history("r"))] == [
            "get-event:0",
            "get-event-result:0",
        ]
    async with aion.open_engine(url, workflows=[publisher_of_late_key, reader]) as engine:
        with trio.fail_after(LIMIT):
            assert await engine.result("r") == {"got": "at last"}, "a closed reader's result stands"


@aion.workflow(name="publisher")
async def publisher_of_late_key(ctx: aion.WorkflowContext) -> str:
    await ctx.set_event("stage", "received")
    await ctx.set_event("payment", {"id": 7, "ok": True})
    await ctx.wait_signal("go")
    await ctx.set_event("late-key", "at last")
    await ctx.wait_signal("finish")
    return "done"


@aion.workflow(name="reader")
async def reader_of_another_key(ctx: aion.WorkflowContext, target: str, key: str, seconds: float) -> Any:
    return {"got": await ctx.get_event(target, "other-key", timeout=seconds)}


async def _until_read(engine: aion.Engine, workflow_id: str) -> list[aion.Event]:
    with trio.fail_after(20):
        while True:
            history = await engine.history(workflow_id)
            if _reads(history) and any(e.type == "TimerStarted" for e in history):
                return history  # the read and its timeout's timer are both recorded
            await trio.sleep(0.005)


async def test_another_read_on_replay_is_non_determinism(store_url: Callable[[], str]) -> None:
    url = store_url()
    async with aion.open_engine(url, workflows=[publisher, reader]) as engine:
        await engine.start(publisher, workflow_id="p")
        await engine.start(reader, "p", "late-key", 3600, workflow_id="r")
        before = await _until_read(engine, "r")
    async with aion.open_engine(url, workflows=[publisher, reader_of_another_key]) as engine:
        reason = await _stuck(engine, "r")
        assert "was recorded as get_event 'late-key' of workflow 'p'" in reason, reason
        assert await engine.history("r") == before


# --------------------------------------------------------------------------
# Waiting through an eviction (a run parked longer than evict_after leaves memory)
# --------------------------------------------------------------------------


@aion.workflow
async def slow_publisher(ctx: aion.WorkflowContext) -> str:
    await ctx.sleep(300)
    await ctx.set_event("done", "yes")
    return "published"


@aion.workflow
async def slow_reader(ctx: aion.WorkflowContext, target: str) -> object:
    return await ctx.get_event(target, "done", timeout=3600)


async def test_engine_get_event_waits_through_the_publishers_eviction(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    config = aion.EngineConfig(evict_after=60)
    async with aion.open_engine(store_url(), workflows=[slow_publisher], config=config) as engine:
        await engine.start(slow_publisher, workflow_id="pub")
        # The publisher is evicted after a minute parked; its timer wakes it four minutes
        # later, and the value it then publishes must still reach this wait.
        assert await engine.get_event("pub", "done", timeout=3600) == "yes"
        assert engine.statistics().evictions >= 1


async def test_ctx_get_event_is_answered_though_both_runs_park_past_evict_after(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    config = aion.EngineConfig(evict_after=60)
    async with aion.open_engine(
        store_url(), workflows=[slow_publisher, slow_reader], config=config
    ) as engine:
        await engine.start(slow_publisher, workflow_id="pub")
        reader = await engine.start(slow_reader, "pub", workflow_id="reader")
        # The reader's watch is in flight here: it is not evicted (its answer would have
        # nowhere to land), so it gets the value, not the timeout's None.
        assert await reader.result() == "yes"
