"""Residency: idle parked runs are evicted and replayed when woken; closed workflows leave
memory; the startup sweep leaves runs parked on a timer evicted (lazy recovery)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from procs.parked_app import WORKFLOWS as PARKED_WORKFLOWS

import aion_trio as aion

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 100 * 86400.0  # Trio seconds: under autojump, virtual time


def url() -> str:
    return f"memory://residency-{uuid.uuid4().hex}"


@aion.activity
async def add_one(value: int) -> int:
    return value + 1


@aion.activity
async def slow(value: int) -> int:
    await trio.sleep(1000)
    return value


@aion.workflow
async def waits_for_go(ctx: aion.WorkflowContext, base: int) -> int:
    seen: list[int] = []
    ctx.set_query_handler("seen", lambda: list(seen))
    value = int(await ctx.wait_signal("go"))
    seen.append(value)
    value = int(await ctx.wait_signal("go"))
    return base + value + await ctx.run(add_one, value)


@aion.workflow
async def sleeps(ctx: aion.WorkflowContext, seconds: float) -> str:
    await ctx.sleep(seconds)
    return "woke"


@aion.workflow
async def nags(ctx: aion.WorkflowContext) -> str:
    ctx.start_timer("nag", 30 * 86400)
    return str(await ctx.wait_signal("go"))


@aion.workflow
async def sleeps_then_waits(ctx: aion.WorkflowContext) -> str:
    await ctx.sleep(3600)
    return "after the sleep: " + str(await ctx.wait_signal("go"))


@aion.workflow
async def child_waits(ctx: aion.WorkflowContext) -> str:
    return "child:" + str(await ctx.wait_signal("go"))


@aion.workflow
async def parent(ctx: aion.WorkflowContext) -> str:
    return "parent:" + str(await ctx.child(child_waits, workflow_id=f"{ctx.workflow_id}-child"))


@aion.workflow
async def runs_slow(ctx: aion.WorkflowContext) -> int:
    return await ctx.run(slow, 5)


@aion.workflow
async def quick(ctx: aion.WorkflowContext, value: int) -> int:
    return value * 2


WORKFLOWS = [waits_for_go, sleeps, sleeps_then_waits, nags, child_waits, parent, runs_slow, quick]
ACTIVITIES = [add_one, slow]


def config(**settings: Any) -> aion.EngineConfig:
    return aion.EngineConfig(**{"evict_after": 10.0, **settings})


def observed() -> tuple[list[aion.ObserverEvent], Any]:
    seen: list[aion.ObserverEvent] = []
    return seen, seen.append


async def test_an_idle_parked_run_is_evicted_and_a_signal_replays_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    seen, observer = observed()
    with trio.fail_after(LIMIT):
        async with aion.open_engine(
            url(), workflows=WORKFLOWS, activities=ACTIVITIES, config=config(), observers=[observer]
        ) as engine:
            run = await engine.start(waits_for_go, 100, workflow_id="w")
            await trio.sleep(5)
            stats = engine.statistics()
            assert (stats.resident_runs, stats.evicted_runs, stats.evictions) == (1, 0, 0)
            assert (await engine.describe("w")).residency == "resident"
            await trio.sleep(6)
            stats = engine.statistics()
            assert (stats.resident_runs, stats.evicted_runs, stats.evictions) == (0, 1, 1)
            assert (stats.registered_leases, stats.loaded_recorders) == (0, 0)
            assert (await engine.describe("w")).residency == "evicted"
            assert engine.statistics().reloads == 0, "describing an evicted run does not wake it"
            await engine.signal("w", "go", 1)
            assert engine.statistics().reloads == 1
            # Evicted again once idle; the query replays it and answers from its state.
            await trio.sleep(11)
            assert engine.statistics().evictions == 2
            assert await engine.query("w", "seen") == [1]
            assert engine.statistics().reloads == 2
            await engine.signal("w", "go", 2)
            assert await run.result() == 100 + 2 + 3
    evicted = [e for e in seen if isinstance(e, aion.RunEvicted)]
    reloaded = [e for e in seen if isinstance(e, aion.RunReloaded)]
    assert [(e.workflow_id, e.reason) for e in evicted] == [("w", "idle"), ("w", "idle")]
    assert [(e.workflow_id, e.workflow_type) for e in reloaded] == [("w", "waits_for_go")] * 2


async def test_beyond_max_resident_runs_the_longest_parked_are_evicted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    seen, observer = observed()
    with trio.fail_after(LIMIT):
        async with aion.open_engine(
            url(),
            workflows=WORKFLOWS,
            activities=ACTIVITIES,
            config=config(evict_after=None, max_resident_runs=2),
            observers=[observer],
        ) as engine:
            runs = []
            for index in range(5):
                runs.append(await engine.start(waits_for_go, index, workflow_id=f"c{index}"))
                await trio.sleep(1)
            await trio.testing.wait_all_tasks_blocked()
            stats = engine.statistics()
            assert (stats.resident_runs, stats.evicted_runs) == (2, 3)
            assert [e.workflow_id for e in seen if isinstance(e, aion.RunEvicted)] == ["c0", "c1", "c2"]
            assert {e.reason for e in seen if isinstance(e, aion.RunEvicted)} == {"capacity"}
            for index in range(5):
                await engine.signal(f"c{index}", "go", 10)
                await engine.signal(f"c{index}", "go", 20)
            assert [await run.result() for run in runs] == [index + 20 + 21 for index in range(5)]
            assert engine.statistics().resident_runs == 0


async def test_a_timer_wakes_an_evicted_run(autojump_clock: trio.testing.MockClock) -> None:
    with trio.fail_after(LIMIT):
        async with aion.open_engine(url(), workflows=WORKFLOWS, config=config()) as engine:
            run = await engine.start(sleeps, 3600.0, workflow_id="t")
            await trio.sleep(20)
            assert engine.statistics().evicted_runs == 1
            assert await run.result() == "woke"
            assert engine.statistics().reloads == 1


async def test_a_child_result_wakes_an_evicted_parent(autojump_clock: trio.testing.MockClock) -> None:
    with trio.fail_after(LIMIT):
        async with aion.open_engine(url(), workflows=WORKFLOWS, config=config()) as engine:
            run = await engine.start(parent, workflow_id="p")
            await trio.sleep(20)
            stats = engine.statistics()
            assert (stats.evicted_runs, stats.resident_runs) == (2, 0), "parent and child both evicted"
            await engine.signal("p-child", "go", "ok")
            assert await run.result() == "parent:child:ok"
            assert engine.statistics().reloads == 2


@pytest.mark.parametrize("operation", ["cancel", "terminate"])
async def test_cancel_and_terminate_reach_an_evicted_run(
    autojump_clock: trio.testing.MockClock, operation: str
) -> None:
    with trio.fail_after(LIMIT):
        async with aion.open_engine(url(), workflows=WORKFLOWS, config=config()) as engine:
            run = await engine.start(nags, workflow_id="x")
            await trio.sleep(20)
            assert engine.statistics().evicted_runs == 1
            await getattr(engine, operation)("x", "stop")
            with pytest.raises(aion.WorkflowFailure):
                await run.result()
            assert (await engine.describe("x")).status is not aion.WorkflowStatus.RUNNING
            assert engine.statistics().evicted_runs == 0


async def test_a_start_retried_with_its_request_id_resumes_an_evicted_run_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(LIMIT):
        async with aion.open_engine(
            url(), workflows=WORKFLOWS, activities=ACTIVITIES, config=config()
        ) as engine:
            first = await engine.start(waits_for_go, 7, workflow_id="r", request_id="key")
            await trio.sleep(20)
            assert engine.statistics().evicted_runs == 1
            again = await engine.start(waits_for_go, 7, workflow_id="r", request_id="key")
            assert again.run_id == first.run_id
            await trio.testing.wait_all_tasks_blocked()
            stats = engine.statistics()
            assert (stats.resident_runs, stats.evicted_runs, stats.reloads) == (1, 0, 1)
            await engine.signal("r", "go", 1)
            await engine.signal("r", "go", 2)
            assert await first.result() == 7 + 2 + 3
            history = await engine.history("r")
            assert sum(isinstance(e.body, aion.ActivityScheduled) for e in history) == 1


async def test_a_run_with_an_activity_in_flight_is_not_evicted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(LIMIT):
        async with aion.open_engine(
            url(), workflows=WORKFLOWS, activities=ACTIVITIES, config=config()
        ) as engine:
            run = await engine.start(runs_slow, workflow_id="a")
            await trio.sleep(100)
            stats = engine.statistics()
            assert (stats.evicted_runs, stats.evictions, stats.resident_runs) == (0, 0, 1)
            assert await run.result() == 5


async def test_closed_workflows_leave_the_registry_and_the_recorder_cache(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(LIMIT):
        async with aion.open_engine(url(), workflows=WORKFLOWS) as engine:
            runs = [await engine.start(quick, index, workflow_id=f"q{index}") for index in range(20)]
            assert [await run.result() for run in runs] == [2 * index for index in range(20)]
            await trio.sleep(2)
            stats = engine.statistics()
            assert (stats.registered_leases, stats.loaded_recorders, stats.released_workflows) == (0, 0, 20)
            # Handles, result() and describe read the store; nothing is loaded back.
            assert [await run.result() for run in runs] == [2 * index for index in range(20)]
            description = await engine.describe("q3")
            assert (description.status, description.result, description.residency) == (
                aion.WorkflowStatus.COMPLETED,
                6,
                None,
            )
            assert engine.statistics().loaded_recorders == 0


async def test_lazy_recovery_leaves_timer_parked_runs_evicted_until_woken(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = url()
    with trio.fail_after(LIMIT):
        async with aion.open_engine(store, workflows=WORKFLOWS, activities=ACTIVITIES) as engine:
            await engine.start(nags, workflow_id="n1")
            await engine.start(nags, workflow_id="n2")
            await engine.start(sleeps, 7200.0, workflow_id="s")
            await engine.start(waits_for_go, 1, workflow_id="g")
            await engine.start(runs_slow, workflow_id="a")
            await trio.testing.wait_all_tasks_blocked()
        seen, observer = observed()
        async with aion.open_engine(
            store,
            workflows=WORKFLOWS,
            activities=ACTIVITIES,
            config=aion.EngineConfig(lazy_recovery=True),
            observers=[observer],
        ) as engine:
            # n1, n2 and s parked on a timer: not replayed.  g (a signal alone: it may have
            # something to consume) is replayed in the background, a (an activity to
            # re-dispatch) at once: both resume by themselves.
            await trio.testing.wait_all_tasks_blocked()
            stats = engine.statistics()
            assert (stats.evicted_runs, stats.resident_runs) == (3, 2)
            assert [(r.active, r.resumed) for r in seen if isinstance(r, aion.RecoveryFinished)] == [(5, 5)]
            assert (await engine.describe("n1")).residency == "evicted"
            await engine.signal("n1", "go", "one")
            assert await engine.result("n1") == "one"
            assert engine.statistics().evicted_runs == 2
            assert await engine.result("a") == 5
            assert await engine.result("s") == "woke"
            await engine.terminate("n2")
            await engine.terminate("g")


async def test_lazy_recovery_fires_the_timer_of_a_run_that_has_a_signal_to_consume(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A signal recorded while its run sleeps: at recovery the run is left for the background
    replay (it may have something to consume), and its pending timer must still fire; the
    soak smoke run found such runs parked for good (WorkflowStarted, TimerStarted,
    SignalReceived, then nothing)."""
    store = url()
    with trio.fail_after(LIMIT):
        async with aion.open_engine(store, workflows=WORKFLOWS) as engine:
            await engine.start(sleeps_then_waits, workflow_id="sw")
            await trio.testing.wait_all_tasks_blocked()
            await engine.signal("sw", "go", "early")
            await trio.testing.wait_all_tasks_blocked()
        async with aion.open_engine(
            store, workflows=WORKFLOWS, config=aion.EngineConfig(lazy_recovery=True)
        ) as engine:
            assert await engine.result("sw") == "after the sleep: early"


async def test_recovery_writes_only_the_visibility_rows_that_changed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = url()
    with trio.fail_after(LIMIT):
        async with aion.open_engine(store, workflows=WORKFLOWS, activities=ACTIVITIES) as engine:
            for index in range(5):
                await engine.start(waits_for_go, index, workflow_id=f"v{index}")
            await trio.testing.wait_all_tasks_blocked()
        seen, observer = observed()
        async with aion.open_engine(
            store, workflows=WORKFLOWS, activities=ACTIVITIES, observers=[observer]
        ) as engine:
            assert [(r.active, r.resumed) for r in seen if isinstance(r, aion.RecoveryFinished)] == [(5, 5)]
            upserts = [e for e in seen if isinstance(e, aion.StoreOperation) and e.operation == "upsert"]
            assert upserts == [], "every row already said what history says"
            assert [row.workflow_id for row in await engine.list(status=aion.WorkflowStatus.RUNNING)] == [
                f"v{index}" for index in range(5)
            ]
            for index in range(5):
                await engine.terminate(f"v{index}")


@pytest.mark.slow
def test_sigkilled_engine_with_parked_runs_reopens_lazily_and_every_run_answers(tmp_path: Path) -> None:
    store = tmp_path / "parked.db"
    count = 40
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.procs.parked_worker", str(store), str(count)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])},
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the worker prints READY, or dies (then its stderr says why)
    if line.strip() != "READY":
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the worker did not park its runs ({proc.returncode}): {line}{out}\n{err}")
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL

    async def reopen() -> None:
        with trio.fail_after(120):  # real time: SQLite's threads
            async with aion.open_engine(
                f"sqlite:///{store}",
                workflows=PARKED_WORKFLOWS,
                config=aion.EngineConfig(lazy_recovery=True),
            ) as engine:
                # The runs that parked on a timer stay evicted; those on a signal alone are
                # replayed in the background (no store access: their histories are loaded).
                await trio.testing.wait_all_tasks_blocked(cushion=0.2)
                stats = engine.statistics()
                assert (stats.evicted_runs, stats.resident_runs) == (count // 2, count // 2)
                for index in range(count):
                    await engine.signal(f"wf-{index}", "go", 1000)
                results = [await engine.result(f"wf-{index}") for index in range(count)]
                assert results == [1000 + index for index in range(count)]
                # Half replayed in the background after open, half by their signal.
                assert engine.statistics().reloads == count

    trio.run(reopen)
