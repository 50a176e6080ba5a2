"""Plain ``def`` activities are told when their attempt stops (issue 14, item 7).

A thread cannot be interrupted: when an attempt is stopped (cancel,
terminate, attempt / heartbeat / schedule-to-close timeout, a timeout scope,
a workflow deadline, engine shutdown) the engine stops waiting for the thread
and tells it: ``aion.heartbeat()`` raises ``aion.AttemptCancelled`` and
``aion.activity_cancelled()`` returns ``True``.  Waiting for a thread slot
does not count against the attempt's ``timeout``; abandoned threads are
counted and logged.

These run on Trio's real clock: under a MockClock autojump waits for a thread
in flight, so a time-based limit could not stop one (docs/testing.md).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any

import pytest
import trio
import trio.testing

import aion_trio as aion

STOP = threading.Event()  # the test's own way to end a thread that ignores being told
STARTED = threading.Semaphore(0)
TOLD: dict[str, str] = {}
TOLD_DONE = threading.Semaphore(0)


@pytest.fixture(autouse=True)
def _threads_end() -> Any:
    STOP.clear()
    TOLD.clear()
    yield
    STOP.set()  # never leave a spinning thread behind, even when a test fails


def _wait_until_told() -> str:
    info = aion.activity_info()
    STARTED.release()
    while not aion.activity_cancelled():
        if STOP.is_set():
            return "stopped by the test"
        time.sleep(0.005)
    try:
        aion.heartbeat()
    except aion.AttemptCancelled as exc:
        TOLD[info.workflow_id] = f"{type(exc).__name__}: {exc}"
    else:
        TOLD[info.workflow_id] = "heartbeat() did not raise"
    TOLD_DONE.release()
    return "told"


@aion.activity
def waits_until_told() -> str:
    return _wait_until_told()


@aion.activity(heartbeat_timeout=timedelta(seconds=0.2))
def stops_heartbeating() -> str:
    return _wait_until_told()


@aion.workflow
async def runs_it(ctx: aion.WorkflowContext, how: str) -> str:
    if how == "timeout":
        return str(await ctx.run(waits_until_told, timeout=timedelta(seconds=0.2)))
    if how == "schedule_to_close":
        return str(await ctx.run(waits_until_told, schedule_to_close=timedelta(seconds=0.2)))
    if how == "heartbeat_timeout":
        return str(await ctx.run(stops_heartbeating))
    if how == "scope":
        async with ctx.timeout(timedelta(seconds=0.2)):
            return str(await ctx.run(waits_until_told))
    return str(await ctx.run(waits_until_told))


async def _acquire(semaphore: threading.Semaphore) -> None:
    assert await trio.to_thread.run_sync(semaphore.acquire, True, 10), "timed out waiting for a thread"


@asynccontextmanager
async def _engine(url: str, **config: Any) -> AsyncIterator[aion.Engine]:
    async with aion.open_engine(
        url,
        workflows=[runs_it, hammers, quick_flow, holds_slot],
        activities=[waits_until_told, stops_heartbeating, heartbeats_forever, quick, blocker],
        config=aion.EngineConfig(**config),
    ) as engine:
        yield engine


HOW = ["cancel", "terminate", "timeout", "heartbeat_timeout", "schedule_to_close", "scope", "deadline"]


@pytest.mark.parametrize("how", HOW)
async def test_a_stopped_thread_attempt_is_told_through_heartbeat_and_activity_cancelled(
    store_url: Callable[[], str], how: str
) -> None:
    with trio.fail_after(20):
        async with _engine(store_url()) as engine:
            deadline = 0.2 if how == "deadline" else None
            await engine.start(runs_it, how, workflow_id=how, timeout=deadline)
            await _acquire(STARTED)
            if how == "cancel":
                await engine.cancel(how)
            elif how == "terminate":
                await engine.terminate(how)
            await _acquire(TOLD_DONE)
    assert TOLD[how].startswith("AttemptCancelled: activity:0 waits_until_told attempt 1 was cancelled") or (
        how == "heartbeat_timeout" and TOLD[how].startswith("AttemptCancelled: activity:0 stops_heartbeating")
    ), TOLD[how]


async def test_engine_shutdown_tells_a_running_thread_attempt(store_url: Callable[[], str]) -> None:
    with trio.fail_after(20):
        async with _engine(store_url(), drain_timeout=0) as engine:
            await engine.start(runs_it, "shutdown", workflow_id="shutdown")
            await _acquire(STARTED)
        await _acquire(TOLD_DONE)
    assert TOLD["shutdown"].startswith("AttemptCancelled"), TOLD["shutdown"]


# --------------------------------------------------------------------------
# Forty stopped attempts no longer starve the thread activities
# --------------------------------------------------------------------------


@aion.activity
def heartbeats_forever() -> str:
    STARTED.release()
    while not STOP.is_set():  # never checks activity_cancelled(): heartbeat() must raise
        aion.heartbeat()
        time.sleep(0.005)
    return "stopped by the test"


@aion.workflow
async def hammers(ctx: aion.WorkflowContext) -> str:
    return str(await ctx.run(heartbeats_forever))


@aion.activity
def quick() -> str:
    return "quick"


@aion.workflow
async def quick_flow(ctx: aion.WorkflowContext) -> str:
    return str(await ctx.run(quick, timeout=timedelta(seconds=5)))


async def test_forty_cancelled_thread_attempts_give_their_slots_back_once_told(
    store_url: Callable[[], str],
) -> None:
    with trio.fail_after(30):
        async with _engine(store_url()) as engine:
            for i in range(40):
                await engine.start(hammers, workflow_id=f"hammer-{i}")
            for _ in range(40):
                await _acquire(STARTED)  # every slot is taken
            for i in range(40):
                await engine.cancel(f"hammer-{i}")
            run = await engine.start(quick_flow, workflow_id="quick")
            with trio.fail_after(10):
                assert await run.result() == "quick"


# --------------------------------------------------------------------------
# Slots: the wait is not the attempt's time; abandoned threads are visible
# --------------------------------------------------------------------------

RELEASE = threading.Event()


@aion.activity
def blocker() -> str:
    STARTED.release()
    while not (RELEASE.is_set() or STOP.is_set()):  # ignores being told
        time.sleep(0.005)
    return "released"


@aion.workflow
async def holds_slot(ctx: aion.WorkflowContext) -> str:
    return str(await ctx.run(blocker))


async def test_waiting_for_a_thread_slot_does_not_count_against_the_attempt_timeout(
    store_url: Callable[[], str],
) -> None:
    RELEASE.clear()
    seen: list[aion.ObserverEvent] = []
    waiter_dispatched = trio.Event()

    def observe(event: aion.ObserverEvent) -> None:
        seen.append(event)
        if isinstance(event, aion.ActivityAttemptStarted) and event.workflow_id == "waiter":
            waiter_dispatched.set()

    with trio.fail_after(20):
        async with aion.open_engine(
            store_url(),
            workflows=[holds_slot, runs_quick_with_a_short_timeout],
            activities=[blocker, quick],
            config=aion.EngineConfig(max_activity_threads=1),
            observers=[observe],
        ) as engine:
            holder = await engine.start(holds_slot, workflow_id="holder")
            await _acquire(STARTED)  # the only slot is taken
            waiter = await engine.start(runs_quick_with_a_short_timeout, workflow_id="waiter")
            await waiter_dispatched.wait()
            await trio.testing.wait_all_tasks_blocked()  # the waiter waits for the slot now
            # Real time in the queue, longer than the waiter's 0.2 s timeout: what is measured.
            await trio.sleep(0.5)
            RELEASE.set()
            assert await holder.result() == "released"
            assert await waiter.result() == "quick"
    ended = [e for e in seen if isinstance(e, aion.ActivityAttemptEnded) and e.workflow_id == "waiter"]
    assert [e.outcome for e in ended] == ["completed"]
    assert ended[0].queued_seconds >= 0.4, "the schedule-to-start wait is reported"


@aion.workflow
async def runs_quick_with_a_short_timeout(ctx: aion.WorkflowContext) -> str:
    return str(await ctx.run(quick, timeout=timedelta(seconds=0.2)))


async def test_an_abandoned_thread_is_counted_and_named_when_the_engine_closes(
    store_url: Callable[[], str], caplog: pytest.LogCaptureFixture
) -> None:
    RELEASE.clear()
    caplog.set_level(logging.INFO, logger="aion_trio.activity")
    with trio.fail_after(20):
        async with _engine(store_url()) as engine:
            await engine.start(holds_slot, workflow_id="ignores")
            await _acquire(STARTED)
            assert engine.statistics().abandoned_activity_threads == 0
            await engine.terminate("ignores")
            assert engine.statistics().abandoned_activity_threads == 1
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("was stopped while running in a thread" in m for m in warnings), warnings
        assert any(
            "closed with 1 activity thread(s) still running" in m
            and "ignores activity:0 blocker attempt 1" in m
            for m in warnings
        ), warnings
        returned = threading.Event()

        class _Watch(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                if "activity:0 blocker attempt 1: its abandoned thread returned" in record.getMessage():
                    returned.set()

        watch = _Watch()
        logging.getLogger("aion_trio.activity").addHandler(watch)
        try:
            RELEASE.set()
            assert await trio.to_thread.run_sync(returned.wait, 10), "the thread's return is logged"
        finally:
            logging.getLogger("aion_trio.activity").removeHandler(watch)


async def test_outside_an_activity_activity_cancelled_refuses() -> None:
    with pytest.raises(RuntimeError, match="outside an activity"):
        aion.activity_cancelled()
