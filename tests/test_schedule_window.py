"""The activity schedule window (``EngineConfig.activity_schedule_window``).

A just-scheduled activity's ``ActivityScheduled`` + ``ActivityStarted`` are held
back in its recorder and written at the front of the next append: the
activity's own outcome when it settles within the window (one durable write
instead of two), otherwise the window's own flush.  Any other decision made
under the recorder lock sees them written first; a graceful close writes them;
a crash inside the window loses them and replay schedules the activity again.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import datetime, timezone

import pytest
import trio
import trio.testing

import aion_trio as aion
import aion_trio.testing
from aion_trio._clock import TrioClock
from aion_trio._epoch import EngineEpoch
from aion_trio._recorder import Recorder

WINDOW = 0.02

GATE: dict[str, trio.Event] = {}
RUNS: list[str] = []


@aion.activity
async def quick(x: int) -> int:
    RUNS.append(f"quick {x}")
    return x + 1


@aion.activity
async def gated(x: int) -> int:
    RUNS.append(f"gated {x}")
    await GATE["open"].wait()
    return x * 10


@aion.workflow
async def three_steps(ctx: aion.WorkflowContext, x: int) -> int:
    for _ in range(3):
        x = await ctx.run(quick, x)
    return x


@aion.workflow
async def waits_on_gate(ctx: aion.WorkflowContext, x: int) -> int:
    return int(await ctx.run(gated, x))


@aion.workflow
async def starts_then_sleeps(ctx: aion.WorkflowContext, x: int) -> int:
    handle = ctx.start(gated, x)
    await ctx.sleep(3600)
    return int(await handle)


WORKFLOWS = [three_steps, waits_on_gate, starts_then_sleeps]
ACTIVITIES = [quick, gated]


@pytest.fixture(autouse=True)
def _fresh() -> None:
    GATE["open"] = trio.Event()
    RUNS.clear()


def _config(window: float | None = WINDOW) -> aion.EngineConfig:
    return aion.EngineConfig(activity_schedule_window=window)


def _engine(
    url: str, window: float | None = WINDOW, *, observers: Sequence[aion.Observer] = ()
) -> contextlib.AbstractAsyncContextManager[aion.Engine]:
    """An engine with this module's workflows and activities and the given window."""
    return aion.open_engine(
        url, workflows=WORKFLOWS, activities=ACTIVITIES, config=_config(window), observers=observers
    )


class _Appends:
    """An observer counting the appends that landed in the event store (the durable writes)."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, event: aion.ObserverEvent) -> None:
        if isinstance(event, aion.StoreOperation) and (event.store, event.operation, event.ok) == (
            "events",
            "append",
            True,
        ):
            self.count += 1


def _types(history: Sequence[aion.Event]) -> list[str]:
    return [e.type for e in history]


def _count(history: Sequence[aion.Event], body: type) -> int:
    return sum(isinstance(e.body, body) for e in history)


async def _until(condition: Callable[[], Awaitable[bool] | bool]) -> None:
    """Let every task run until ``condition()`` holds.  The mock clock does not move,
    so a window cannot close meanwhile; store threads (SQLite) finish in real time."""
    deadline = time.monotonic() + 10
    while True:
        await trio.testing.wait_all_tasks_blocked()
        value = condition()
        if not isinstance(value, bool):
            value = await value
        if value:
            return
        assert time.monotonic() < deadline, "the condition never held"


async def _has(engine: aion.Engine, workflow_id: str, body: type) -> bool:
    return _count(await engine.history(workflow_id), body) > 0


async def _pending(engine: aion.Engine, workflow_id: str) -> bool:
    return bool((await engine.describe(workflow_id)).pending_activities)


# --------------------------------------------------------------------------
# What it saves, and what it leaves unchanged
# --------------------------------------------------------------------------


@pytest.mark.parametrize("window", [WINDOW, None])
async def test_a_quick_activity_costs_one_append_and_the_history_is_unchanged(
    store_url: Callable[[], str], mock_clock: trio.testing.MockClock, window: float | None
) -> None:
    # The mock clock stands still, so the window cannot close before the activity's
    # outcome is appended however slow the store is (a PostgreSQL round trip under
    # load took longer than the 20 ms window in real time, and cost a second append).
    counted = _Appends()
    async with _engine(store_url(), window, observers=[counted]) as engine:
        run = await engine.start(three_steps, 1, workflow_id="w")
        assert await run.result() == 4
        appends = counted.count
        history = await engine.history("w")
    step = ["ActivityScheduled", "ActivityStarted", "ActivityCompleted"]
    assert _types(history) == ["WorkflowStarted", *step, *step, *step, "WorkflowCompleted"]
    assert [e.seq for e in history] == list(range(1, len(history) + 1))
    # Started, one per step (schedule + outcome together), the terminal; without the
    # window each step costs two appends.
    assert appends == (5 if window else 8)


async def test_a_slow_activity_is_recorded_when_the_window_closes(
    store_url: Callable[[], str], mock_clock: trio.testing.MockClock
) -> None:
    async with _engine(store_url()) as engine:
        run = await engine.start(waits_on_gate, 2, workflow_id="w")
        await _until(lambda: bool(RUNS))
        assert RUNS == ["gated 2"], "control: the attempt is running"
        history = await engine.history("w")
        assert _count(history, aion.ActivityScheduled) == 0, "control: held back inside the window"
        mock_clock.jump(WINDOW * 1.25 + 0.001)
        # Waited for through describe, which reads the engine's own copy of the history:
        # that copy takes the flushed events once their append has returned, which on a
        # store whose commit is visible before its acknowledgement (PostgreSQL, a thread
        # still finishing the call) can be after the store already shows them.
        await _until(lambda: _pending(engine, "w"))
        history = await engine.history("w")
        assert _types(history) == ["WorkflowStarted", "ActivityScheduled", "ActivityStarted"]
        description = await engine.describe("w")
        assert [a.activity_id for a in description.pending_activities] == [0]
        GATE["open"].set()
        assert await run.result() == 20
        history = await engine.history("w")
    assert _types(history) == [
        "WorkflowStarted",
        "ActivityScheduled",
        "ActivityStarted",
        "ActivityCompleted",
        "WorkflowCompleted",
    ]


async def test_the_window_flush_does_not_queue_behind_a_busy_recorder(
    store_url: Callable[[], str], mock_clock: trio.testing.MockClock
) -> None:
    async with _engine(store_url()) as engine:
        await engine.start(waits_on_gate, 7, workflow_id="w")
        await _until(lambda: bool(RUNS))
        recorder = await engine._core.recorder_for("w")
        async with recorder.lock:  # an append in progress would write them
            mock_clock.jump(WINDOW * 1.25 + 0.001)
            await trio.testing.wait_all_tasks_blocked()
            assert recorder.lock.statistics().tasks_waiting == 0, "no flush waits behind the holder"
            assert recorder.deferred
        mock_clock.jump(WINDOW * 1.25 + 0.001)
        await _until(lambda: not recorder.deferred)  # the flush's append returned
        assert await _has(engine, "w", aion.ActivityStarted)
        GATE["open"].set()
        assert await engine.result("w") == 70


async def test_a_command_recorded_inside_the_window_carries_the_held_back_schedule(
    store_url: Callable[[], str], mock_clock: trio.testing.MockClock
) -> None:
    counted = _Appends()
    async with _engine(store_url(), observers=[counted]) as engine:
        await engine.start(starts_then_sleeps, 3, workflow_id="w")
        await _until(lambda: _has(engine, "w", aion.TimerStarted))
        history = await engine.history("w")
        # Nothing is held back any more: the schedule is in history, written with the timer.
        assert counted.count == 2, "WorkflowStarted, then the schedule and the timer in one append"
        assert _types(history) == ["WorkflowStarted", "ActivityScheduled", "ActivityStarted", "TimerStarted"]
        assert history[1].recorded_at <= history[3].recorded_at
        GATE["open"].set()
        await engine.terminate("w", "done here")


# --------------------------------------------------------------------------
# Decisions see the held-back records
# --------------------------------------------------------------------------


@pytest.mark.parametrize("window", [WINDOW, None])
async def test_terminating_inside_the_window_settles_the_held_back_activity(
    store_url: Callable[[], str], mock_clock: trio.testing.MockClock, window: float | None
) -> None:
    async with _engine(store_url(), window) as engine:
        await engine.start(waits_on_gate, 4, workflow_id="w")
        await _until(lambda: bool(RUNS))
        held_back = _count(await engine.history("w"), aion.ActivityScheduled) == 0
        assert held_back is bool(window), "control: held back only inside a window"
        await engine.terminate("w", "operator")
        history = await engine.history("w")
    # The teardown saw the held-back schedule and settled the attempt, as without a window.
    assert _types(history) == [
        "WorkflowStarted",
        "ActivityScheduled",
        "ActivityStarted",
        "WorkflowCancelled",
        "ActivityCancelled",
    ]


async def test_a_graceful_close_writes_the_held_back_schedule(
    store_url: Callable[[], str], mock_clock: trio.testing.MockClock
) -> None:
    url = store_url()
    async with _engine(url) as engine:
        await engine.start(waits_on_gate, 5, workflow_id="w")
        await _until(lambda: bool(RUNS))
        assert _count(await engine.history("w"), aion.ActivityScheduled) == 0, "control: held back"
    async with aion.open_store(url) as store:
        history = await store.events.read_history("w")
    assert _types(history) == ["WorkflowStarted", "ActivityScheduled", "ActivityStarted"]


class _Crash(Exception):
    pass


async def test_a_crash_inside_the_window_loses_the_attempt_and_replay_runs_it_again(
    store_url: Callable[[], str], mock_clock: trio.testing.MockClock
) -> None:
    url = store_url()
    with pytest.raises(_Crash):  # noqa: PT012 - the crash is the block's last statement
        async with _engine(url) as engine:
            await engine.start(waits_on_gate, 6, workflow_id="w")
            await _until(lambda: bool(RUNS))
            raise _Crash  # an abnormal exit writes nothing more
    async with aion.open_store(url) as store:
        history = await store.events.read_history("w")
    assert _types(history) == ["WorkflowStarted"], "the attempt left no trace"
    GATE["open"].set()
    async with _engine(url) as engine:
        assert await engine.result("w") == 60
        history = await engine.history("w")
    assert RUNS == ["gated 6", "gated 6"], "at least once: the lost attempt ran again"
    assert _count(history, aion.ActivityScheduled) == 1
    assert _count(history, aion.ActivityCompleted) == 1


# --------------------------------------------------------------------------
# The recorder's deferred records
# --------------------------------------------------------------------------

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
RUN = str(uuid.UUID(int=1))


def _scheduled(activity_id: int) -> list[aion.EventBody]:
    return [
        aion.ActivityScheduled(
            activity_id=activity_id,
            activity_type="quick",
            input=aion.Payload.of([1]),
            task_queue="default",
            options=aion.Payload.of({}),
        ),
        aion.ActivityStarted(activity_id=activity_id, attempt=1),
    ]


async def _started(recorder: Recorder) -> None:
    async with recorder.lock:
        await recorder.append(
            [aion.WorkflowStarted(workflow_type="t", run_id=RUN, input=aion.Payload.of([]))],
            action="start",
            run_id=RUN,
        )


@contextlib.asynccontextmanager
async def _started_recorder() -> AsyncIterator[
    tuple[aion.Store, aion_trio.testing.FlakyStoreBundle, Recorder]
]:
    """Workflow ``w``'s recorder, its run started, on a memory store seen through a
    FlakyStore (no fault armed unless the test arms one): (the store, the flaky view, the recorder)."""
    async with aion.open_store("memory://") as inner, trio.open_nursery() as nursery:
        flaky = aion_trio.testing.FlakyStoreBundle(inner)
        recorder = Recorder("w", flaky.events, EngineEpoch(nursery), TrioClock.start())
        await _started(recorder)
        yield inner, flaky, recorder
        nursery.cancel_scope.cancel()


async def test_deferred_records_lead_the_next_append_with_their_own_time() -> None:
    async with _started_recorder() as (store, _, recorder):
        async with recorder.lock:
            recorder.defer(_scheduled(0), at=T0)
            assert recorder.deferred
            await recorder.append(
                [aion.ActivityCompleted(activity_id=0, result=aion.Payload.of(2), attempt=1)], action="x"
            )
        assert not recorder.deferred
        history = await store.events.read_history("w")
        assert _types(history) == [
            "WorkflowStarted",
            "ActivityScheduled",
            "ActivityStarted",
            "ActivityCompleted",
        ]
        assert [e.recorded_at for e in history[1:3]] == [T0, T0]
        assert history[3].recorded_at > T0
        assert recorder.appends == 2


async def test_a_decision_writes_deferred_records_first_unless_told_to_keep_them() -> None:
    async with _started_recorder() as (store, _, recorder):
        async with recorder.lock:
            recorder.defer(_scheduled(0), at=T0)
            history = await recorder.current_history(keep_deferred=True)
            assert len(history) == 1
            assert recorder.deferred
            history = await recorder.current_history()
            assert _types(history)[1:] == ["ActivityScheduled", "ActivityStarted"]
            assert not recorder.deferred
        assert len(await store.events.read_history("w")) == 3


async def test_deferred_records_stay_owed_when_an_append_writes_nothing() -> None:
    async with _started_recorder() as (inner, flaky, recorder):
        flaky.events.fail_next_appends(1, aion.NotFound("injected: refused"))
        async with recorder.lock:
            recorder.defer(_scheduled(0), at=T0)
            with pytest.raises(aion.NotFound):
                await recorder.append([aion.MarkerRecorded(name="m", value=aion.Payload.of(1))], action="x")
            assert recorder.deferred, "nothing was written: the records are still owed"
            assert len(await recorder.current_history(keep_deferred=True)) == 1
            await recorder.flush_deferred()
            assert not recorder.deferred
        assert flaky.events.faults["append"] == 1, "control: the first append really failed"
        assert _types(await inner.events.read_history("w")) == [
            "WorkflowStarted",
            "ActivityScheduled",
            "ActivityStarted",
        ]


async def test_deferred_records_in_an_append_that_landed_unacknowledged_are_not_written_twice() -> None:
    async with _started_recorder() as (inner, flaky, recorder):
        flaky.events.commit_then_fail_next_appends(1, aion.BackendUnavailable("injected: ack lost"))
        async with recorder.lock:
            recorder.defer(_scheduled(0), at=T0)
            with pytest.raises(aion.BackendUnavailable):
                await recorder.append([aion.MarkerRecorded(name="m", value=aion.Payload.of(1))], action="x")
            await recorder.current_history()  # the re-read adopts the landed batch
            assert not recorder.deferred, "the landed append carried them"
            await recorder.append([aion.MarkerRecorded(name="n", value=aion.Payload.of(2))], action="y")
        assert flaky.events.faults["append"] == 1, "control: the acknowledgement really was lost"
        assert _types(await inner.events.read_history("w")) == [
            "WorkflowStarted",
            "ActivityScheduled",
            "ActivityStarted",
            "MarkerRecorded",
            "MarkerRecorded",
        ]


# --------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [-0.1, float("inf"), float("nan"), True, "0.1"])
def test_a_bad_window_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="activity_schedule_window"):
        aion.EngineConfig(activity_schedule_window=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("off", [None, 0])
def test_the_window_can_be_switched_off(off: float | None) -> None:
    assert not aion.EngineConfig(activity_schedule_window=off).activity_schedule_window
    assert aion.EngineConfig().activity_schedule_window == WINDOW
