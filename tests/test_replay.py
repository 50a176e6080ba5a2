"""Replay and recovery inside one process: an engine closes mid-run, another resumes it.

Closing an engine parks what runs (nothing recorded), leaving history exactly
as a crash would; the next engine on the same store replays.  (Crashes of real
processes with SIGKILL are in ``test_crash_recovery.py``.)
"""

from __future__ import annotations

import itertools
import logging
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import trio
import trio.testing

import aion_trio as aion
from aion_trio import projections

EXECUTIONS: dict[str, int] = {}
RELEASED = {"value": False}
DELAY = {"seconds": 0.0}
GATE_ENTERED: dict[str, trio.Event] = {}
OBSERVED: list[Any] = []


def _count(name: str) -> None:
    EXECUTIONS[name] = EXECUTIONS.get(name, 0) + 1


@pytest.fixture(autouse=True)
def _reset() -> None:
    EXECUTIONS.clear()
    OBSERVED.clear()
    RELEASED["value"] = False
    DELAY["seconds"] = 0.0
    GATE_ENTERED["event"] = trio.Event()


@aion.activity
async def step_one(x: int) -> int:
    _count("step_one")
    await trio.sleep(DELAY["seconds"])
    return x + 1


@aion.activity
async def gated_step(x: int) -> int:
    _count("gated_step")
    GATE_ENTERED["event"].set()
    if not RELEASED["value"]:
        await trio.sleep_forever()
    await trio.sleep(DELAY["seconds"])
    return x * 10


@aion.workflow
async def two_steps(ctx: aion.WorkflowContext, x: int) -> dict[str, Any]:
    OBSERVED.append(("start", ctx.now(), ctx.random().random(), str(ctx.uuid4()), ctx.is_replaying))
    ctx.logger.info("before step one")
    a = await ctx.run(step_one, x)
    OBSERVED.append(("after one", ctx.now(), ctx.random().random(), ctx.is_replaying))
    ctx.logger.info("after step one")
    b = await ctx.run(gated_step, a)
    OBSERVED.append(("after gated", ctx.now(), ctx.is_replaying))
    ctx.logger.info("after gated step")
    return {"a": a, "b": b, "now": ctx.now().isoformat()}


def _entries(label: str) -> list[Any]:
    return [entry for entry in OBSERVED if entry[0] == label]


async def test_a_resumed_run_replays_completed_steps_instead_of_re_executing_them(
    store_url: Callable[[], str], caplog: pytest.LogCaptureFixture
) -> None:
    url = store_url()
    caplog.set_level(logging.INFO, logger="aion_trio.workflow")
    async with aion.open_engine(url, workflows=[two_steps], activities=[step_one, gated_step]) as engine:
        await engine.start(two_steps, 1, workflow_id="resume-me")
        await GATE_ENTERED["event"].wait()
    # The first engine is gone; the gated step was parked: nothing recorded for it.
    first_logs = [r.getMessage() for r in caplog.records if r.name.startswith("aion_trio.workflow")]
    assert first_logs == ["before step one", "after step one"]
    live_start = _entries("start")[0]
    live_after_one = _entries("after one")[0]
    assert live_start[-1] is False
    assert live_after_one[-1] is False

    caplog.clear()
    RELEASED["value"] = True
    async with aion.open_engine(url, workflows=[two_steps], activities=[step_one, gated_step]) as engine:
        result = await engine.result("resume-me")
        history = await engine.history("resume-me")
    assert result["a"] == 2
    assert result["b"] == 20
    # step_one ran once in total: the second engine replayed its recorded result.
    assert EXECUTIONS == {"step_one": 1, "gated_step": 2}
    # Replay saw the same now(), random and uuid values at the same points.
    replay_start = _entries("start")[1]
    replay_after_one = _entries("after one")[1]
    assert replay_start[:4] == live_start[:4]
    assert replay_after_one[:3] == live_after_one[:3]
    assert replay_start[-1] is True  # it knew it was replaying
    # now() after the resumed step is that step's recorded time, also on replay.
    gated_done = next(
        e for e in history if isinstance(e.body, aion.ActivityCompleted) and e.body.activity_id == 1
    )
    assert _entries("after gated")[0][1] == gated_done.recorded_at
    # The logger stayed silent for what the first engine had already logged.
    second_logs = [r.getMessage() for r in caplog.records if r.name.startswith("aion_trio.workflow")]
    assert second_logs == ["after step one", "after gated step"] or second_logs == ["after gated step"]
    # Exactly one terminal, no duplicated activity completions.
    assert sum(1 for e in history if e.is_terminal) == 1
    completions = [e.body.activity_id for e in history if isinstance(e.body, aion.ActivityCompleted)]
    assert sorted(completions) == [0, 1]
    # The parked attempt was re-delivered under the same attempt number.
    started = [
        e.body for e in history if isinstance(e.body, aion.ActivityStarted) and e.body.activity_id == 1
    ]
    assert [s.attempt for s in started] == [1]


async def test_now_is_the_replay_position_not_the_wall_clock(autojump_clock: trio.testing.MockClock) -> None:
    url = f"memory://now-{uuid.uuid4().hex}"
    DELAY["seconds"] = 5.0
    async with aion.open_engine(url, workflows=[two_steps], activities=[step_one, gated_step]) as engine:
        await engine.start(two_steps, 1, workflow_id="clock")
        await GATE_ENTERED["event"].wait()
        history = await engine.history("clock")
    started_at = history[0].recorded_at
    step_one_done = next(e for e in history if isinstance(e.body, aion.ActivityCompleted)).recorded_at
    assert _entries("start")[0][1] == started_at
    assert _entries("after one")[0][1] == step_one_done
    # Much later (mock time), the replay still sees the recorded instants.
    await trio.sleep(3600)
    RELEASED["value"] = True
    async with aion.open_engine(url, workflows=[two_steps], activities=[step_one, gated_step]) as engine:
        await engine.result("clock")
    assert _entries("start")[1][1] == started_at
    assert _entries("after one")[1][1] == step_one_done
    assert (_entries("after gated")[0][1] - started_at).total_seconds() > 3600


# --------------------------------------------------------------------------
# Non-determinism
# --------------------------------------------------------------------------


@aion.activity
async def reserve(x: int) -> int:
    return x


@aion.activity
async def refund(x: int) -> int:
    return -x


def _versioned(first: aion.ActivityDefinition[Any]) -> aion.WorkflowDefinition[Any]:
    @aion.workflow(name="checkout")
    async def checkout(ctx: aion.WorkflowContext, x: int) -> int:
        value = await ctx.run(first, x)
        return int(await ctx.run(gated_step, value))

    return checkout


@aion.workflow
async def unrelated(ctx: aion.WorkflowContext, x: int) -> int:
    return int(await ctx.run(reserve, x))


async def test_incompatible_code_is_reported_as_non_determinism_and_the_run_stays_running(
    store_url: Callable[[], str],
) -> None:
    url = store_url()
    v1 = _versioned(reserve)
    v2 = _versioned(refund)
    async with aion.open_engine(url, workflows=[v1], activities=[reserve, refund, gated_step]) as engine:
        await engine.start(v1, 3, workflow_id="nd")
        await GATE_ENTERED["event"].wait()
    RELEASED["value"] = True
    async with aion.open_engine(
        url, workflows=[v2, unrelated], activities=[reserve, refund, gated_step]
    ) as engine:
        # Another workflow in the same engine is unaffected.
        other = await engine.start(unrelated, 7, workflow_id="fine")
        assert await other.result() == 7
        for _ in range(100):
            description = await engine.describe("nd")
            if description.stuck_reason:
                break
            await trio.sleep(0.01)
        assert description.status is aion.WorkflowStatus.RUNNING
        reason = description.stuck_reason or ""
        assert "activity command #0" in reason
        assert "'reserve'" in reason
        assert "'refund'" in reason
        row = await engine.store.visibility.get("nd")
        assert row is not None
        assert row.stuck_reason == reason
        assert row.status is aion.WorkflowStatus.RUNNING
        history = await engine.history("nd")
    # Nothing was appended for the mismatching command, and no terminal.
    assert not any(e.is_terminal for e in history)
    assert [e.body.activity_type for e in history if isinstance(e.body, aion.ActivityScheduled)] == [
        "reserve",
        "gated_step",
    ]


# --------------------------------------------------------------------------
# Versioning with ctx.patched
# --------------------------------------------------------------------------


@aion.workflow(name="patchable")
async def patchable_v1(ctx: aion.WorkflowContext) -> str:
    await ctx.run(reserve, 1)
    await ctx.run(gated_step, 1)
    return "v1"


@aion.workflow(name="patchable")
async def patchable_v2(ctx: aion.WorkflowContext) -> str:
    if await ctx.patched("use-refund"):
        await ctx.run(refund, 1)
        await ctx.run(gated_step, 1)
        return "v2"
    await ctx.run(reserve, 1)
    await ctx.run(gated_step, 1)
    return "v1-path"


async def test_patched_keeps_old_runs_on_the_old_path_and_new_runs_on_the_new(
    store_url: Callable[[], str],
) -> None:
    url = store_url()
    async with aion.open_engine(
        url, workflows=[patchable_v1], activities=[reserve, refund, gated_step]
    ) as engine:
        await engine.start(patchable_v1, workflow_id="old")
        await GATE_ENTERED["event"].wait()
    RELEASED["value"] = True
    async with aion.open_engine(
        url, workflows=[patchable_v2], activities=[reserve, refund, gated_step]
    ) as engine:
        assert await engine.result("old") == "v1-path"
        new = await engine.start(patchable_v2, workflow_id="new")
        assert await new.result() == "v2"
        markers = [
            e.body.name for e in await engine.history("new") if isinstance(e.body, aion.MarkerRecorded)
        ]
        assert markers == ["patch:use-refund"]
        assert not any(isinstance(e.body, aion.MarkerRecorded) for e in await engine.history("old"))


# --------------------------------------------------------------------------
# Continue-as-new (the completion path's successor start)
# --------------------------------------------------------------------------


@aion.workflow
async def countdown(ctx: aion.WorkflowContext, n: int) -> int:
    if n > 0:
        await ctx.run(reserve, n)
        raise ctx.continue_as_new(n - 1)
    return 42


async def test_continue_as_new_starts_a_successor_run_and_result_follows_the_chain(
    store_url: Callable[[], str],
) -> None:
    async with aion.open_engine(store_url(), workflows=[countdown], activities=[reserve]) as engine:
        run = await engine.start(countdown, 3, workflow_id="loop")
        assert await run.result() == 42
        history = await engine.history("loop")
        runs = projections.run_ids(history)
        assert len(runs) == 4
        for earlier, later in itertools.pairwise(runs):
            start = projections.start_event(history, later)
            assert start is not None
            assert start.body.parent_run_id == earlier
            assert projections.run_status(history, earlier) is aion.WorkflowStatus.CONTINUED_AS_NEW
        assert projections.workflow_status(history) is aion.WorkflowStatus.COMPLETED
        with pytest.raises(aion.WorkflowFailure, match="continued_as_new"):
            await engine.result("loop", run_id=runs[0], follow_continue_as_new=False)


async def test_result_on_the_first_run_of_a_finished_chain_follows_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with aion.open_engine(
        f"memory://chain-{uuid.uuid4().hex}", workflows=[countdown], activities=[reserve]
    ) as engine:
        first = await engine.start(countdown, 2, workflow_id="chain")
        assert await engine.result("chain") == 42
        with trio.fail_after(3600):  # a hang fails in mock time
            assert await first.result() == 42
            assert await engine.result("chain", run_id=first.run_id) == 42


class _SuccessorStartFails:
    """Fault injection: the engine dies between a run's ContinuedAsNew and its successor's start."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.events = self
        self.visibility = inner.visibility

    async def append(self, workflow_id: str, events: Any, expected_seq: int) -> None:
        if any(isinstance(e.body, aion.WorkflowStarted) and e.body.parent_run_id for e in events):
            await trio.lowlevel.checkpoint()
            raise aion.NotOwner("simulated crash before the successor started")
        await self._inner.events.append(workflow_id, events, expected_seq)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner.events, name)

    async def aclose(self) -> None:
        await self._inner.aclose()


async def test_a_crash_between_continue_as_new_and_the_successor_start_is_repaired_by_recovery(
    autojump_clock: trio.testing.MockClock,
) -> None:
    name = f"memory://can-crash-{uuid.uuid4().hex}"
    async with (
        aion.open_store(name) as raw,
        aion.open_engine(
            _SuccessorStartFails(raw),  # type: ignore[arg-type]
            workflows=[countdown],
            activities=[reserve],
        ) as engine,
    ):
        await engine.start(countdown, 1, workflow_id="cut")
        await trio.testing.wait_all_tasks_blocked()
        cut = await engine.history("cut")
    assert projections.workflow_status(cut) is aion.WorkflowStatus.CONTINUED_AS_NEW
    assert len(projections.run_ids(cut)) == 1, "control: the successor did not start"
    async with aion.open_engine(name, workflows=[countdown], activities=[reserve]) as engine:
        with trio.fail_after(3600):
            assert await engine.result("cut") == 42
        history = await engine.history("cut")
    runs = projections.run_ids(history)
    assert len(runs) == 2
    assert history[: len(cut)] == cut


# --------------------------------------------------------------------------
# Graceful shutdown: drain, then park
# --------------------------------------------------------------------------


@aion.activity
async def slow_step(seconds: float) -> str:
    _count("slow_step")
    await trio.sleep(seconds)
    return f"slept {seconds}"


@aion.workflow
async def one_slow_step(ctx: aion.WorkflowContext, seconds: float) -> str:
    return str(await ctx.run(slow_step, seconds))


async def test_a_drain_lets_in_flight_attempts_finish_and_record(
    autojump_clock: trio.testing.MockClock,
) -> None:
    url = f"memory://drain-{uuid.uuid4().hex}"
    config = aion.EngineConfig(drain_timeout=60)
    async with aion.open_engine(
        url, workflows=[one_slow_step], activities=[slow_step], config=config
    ) as engine:
        await engine.start(one_slow_step, 30.0, workflow_id="drained")
        await trio.testing.wait_all_tasks_blocked()
        started = trio.current_time()
    assert trio.current_time() - started >= 30, "control: the exit waited for the attempt"
    async with aion.open_store(url) as store:
        history = await store.events.read_history("drained")
    outcomes = [e.body for e in history if isinstance(e.body, aion.ActivityCompleted)]
    assert [o.result.value() for o in outcomes] == ["slept 30.0"]


async def test_attempts_still_running_at_the_drain_deadline_are_parked_and_redispatched(
    autojump_clock: trio.testing.MockClock,
) -> None:
    url = f"memory://park-{uuid.uuid4().hex}"
    config = aion.EngineConfig(drain_timeout=5)
    async with aion.open_engine(
        url, workflows=[one_slow_step], activities=[slow_step], config=config
    ) as engine:
        await engine.start(one_slow_step, 30.0, workflow_id="parked")
        await trio.testing.wait_all_tasks_blocked()
        started = trio.current_time()
    assert 5 <= trio.current_time() - started < 30
    async with aion.open_store(url) as store:
        parked = await store.events.read_history("parked")
    # Parked: nothing recorded for the attempt — history ends as after a kill -9.
    assert [e.type for e in parked] == ["WorkflowStarted", "ActivityScheduled", "ActivityStarted"]
    async with aion.open_engine(url, workflows=[one_slow_step], activities=[slow_step]) as engine:
        assert await engine.result("parked") == "slept 30.0"
        history = await engine.history("parked")
    assert EXECUTIONS["slow_step"] == 2
    assert [e.body.attempt for e in history if isinstance(e.body, aion.ActivityStarted)] == [1]


# --------------------------------------------------------------------------
# Recovery reconciles visibility; a custom dispatcher
# --------------------------------------------------------------------------


async def test_recovery_rewrites_a_visibility_row_left_behind_by_a_crash(
    store_url: Callable[[], str],
) -> None:
    url = store_url()
    async with aion.open_engine(url, workflows=[unrelated], activities=[reserve]) as engine:
        run = await engine.start(unrelated, 1, workflow_id="stale-row")
        await run.result()
    async with aion.open_store(url) as store:
        # What an engine killed between the terminal and its index update leaves.
        row = await store.visibility.get("stale-row")
        assert row is not None
        await store.visibility.upsert(
            aion.VisibilityRow(
                **{**attrs_asdict(row), "status": aion.WorkflowStatus.RUNNING, "close_time": None}
            )
        )
    async with aion.open_engine(url, workflows=[unrelated], activities=[reserve]) as engine:
        row = await engine.store.visibility.get("stale-row")
    assert row is not None
    assert row.status is aion.WorkflowStatus.COMPLETED
    assert row.close_time is not None


def attrs_asdict(row: aion.VisibilityRow) -> dict[str, Any]:
    import attrs

    return {f.name: getattr(row, f.name) for f in attrs.fields(type(row))}


class RecordingDispatcher:
    """A dispatcher that answers every request itself (as a remote worker pool would)."""

    def __init__(self) -> None:
        self.requests: list[aion.ActivityRequest] = []

    async def dispatch(self, request: aion.ActivityRequest) -> aion.ActivityOutcome:
        self.requests.append(request)
        await trio.lowlevel.checkpoint()
        return aion.ActivityOutcome(
            result=aion.Payload.of(f"remote:{request.activity_type}:{request.input.value()}")
        )


async def test_activities_go_through_the_configured_dispatcher(store_url: Callable[[], str]) -> None:
    dispatcher = RecordingDispatcher()
    async with aion.open_engine(
        store_url(), workflows=[unrelated], activities=[reserve], dispatcher=dispatcher
    ) as engine:
        run = await engine.start(unrelated, 5, workflow_id="remote")
        with pytest.raises(aion.WorkflowFailure):
            # The dispatcher's payload is a string; the workflow's int() of it fails.
            await run.result()
    (request,) = dispatcher.requests
    assert (request.workflow_id, request.activity_id, request.activity_type, request.attempt) == (
        "remote",
        0,
        "reserve",
        1,
    )
    assert request.input.value() == [5]


TICKS = {"n": 0}
TICKS_SEEN: list[tuple[bool, int]] = []
STEPS_DONE: dict[str, trio.Event] = {}


@aion.activity
async def bump(x: int) -> int:
    return x + 1


@aion.workflow
async def many_steps(ctx: aion.WorkflowContext, steps: int) -> int:
    value = 0
    ctx.set_query_handler("value", lambda: value)
    for _ in range(steps):
        value = await ctx.run(bump, value)
        TICKS_SEEN.append((ctx.is_replaying, TICKS["n"]))
    STEPS_DONE["event"].set()
    await ctx.wait_signal("finish")
    return value


async def test_a_replaying_run_yields_to_other_tasks_every_64_waits_not_on_each(
    store_url: Callable[[], str],
) -> None:
    # Replaying, a wait that history resolves is a cancel point every time but a
    # schedule point only every 64th time (a scheduler pass per step cost more
    # than the step): other tasks still run while a long history replays.
    url = store_url()
    steps = 300
    STEPS_DONE["event"] = trio.Event()
    async with aion.open_engine(url, workflows=[many_steps], activities=[bump]) as engine:
        await engine.start(many_steps, steps, workflow_id="long")
        with trio.fail_after(60):
            await STEPS_DONE["event"].wait()
    TICKS_SEEN.clear()

    async def tick() -> None:
        while True:
            TICKS["n"] += 1
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(tick)
        async with aion.open_engine(url, workflows=[many_steps], activities=[bump]) as engine:
            with trio.fail_after(60):
                assert await engine.query("long", "value") == steps
        nursery.cancel_scope.cancel()
    assert len(TICKS_SEEN) == steps
    assert all(replaying for replaying, _ in TICKS_SEEN)
    # Runs of steps that saw the same tick count: between two of the run's yields the
    # ticker runs once, before or after the run in that pass of the scheduler (trio
    # varies the order), so two such stretches can merge: never more than 2 x 64...
    runs = [len(list(group)) for _, group in itertools.groupby(n for _, n in TICKS_SEEN)]
    assert max(runs) <= 2 * 64, runs
    # ... and most steps did not yield (one yield per step would make every run 1 long).
    assert len(runs) < steps // 10, runs
