"""Recovery under faults: transient read faults during the startup sweep (issue 14
item 10), a restart in the middle of a retry backoff (item 11), and runs whose
recovery kills the process every time (item 5).

A transient fault (``BackendUnavailable``) while recovery lists the active
workflows or loads one's history is retried with backoff: ``open_engine``
does not fail and the run is not given up.  Only a non-transient cause makes a
run stuck.  Real time with a millisecond retry ladder (so the tests run on the
thread-backed SQLite store too); restarts reopen the same store URL.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

import aion_trio as aion
import aion_trio.testing


@aion.workflow
async def waits_for_go(ctx: aion.WorkflowContext, name: str) -> str:
    value = await ctx.wait_signal("go")
    return f"{name}: {value}"


WORKFLOWS = [waits_for_go]
CONFIG = aion.EngineConfig(completion_retry=aion.CompletionRetryConfig(initial=0.001, ceiling=0.004))


async def _leave_running(url: str, *names: str) -> None:
    """An engine starts the runs, which wait for a signal; it then closes (they stay Running)."""
    async with aion.open_engine(url, workflows=WORKFLOWS) as engine:
        for name in names:
            await engine.start(waits_for_go, name, workflow_id=name)
        await trio.testing.wait_all_tasks_blocked()


@contextlib.asynccontextmanager
async def _flaky_engine(
    url: str, arm: Callable[[aion.testing.FlakyStore], None]
) -> AsyncIterator[tuple[aion.Engine, aion.testing.FlakyStoreBundle]]:
    async with aion.open_store(url) as inner:
        flaky = aion.testing.FlakyStoreBundle(inner)
        arm(flaky.events)
        async with aion.open_engine(flaky, workflows=WORKFLOWS, config=CONFIG) as engine:
            yield engine, flaky


async def _signal_retrying(engine: aion.Engine, name: str) -> None:
    with trio.fail_after(10):
        while True:
            try:
                await engine.signal(name, "go", "now")
                return
            except aion.BackendUnavailable:
                await trio.sleep(0.001)


async def test_a_transient_fault_listing_the_active_workflows_is_retried_and_open_engine_succeeds(
    store_url: Callable[[], str],
) -> None:
    url = store_url()
    await _leave_running(url, "a")

    def arm(events: aion.testing.FlakyStore) -> None:
        events.fail_next("list_active", 3)

    async with _flaky_engine(url, arm) as (engine, flaky):
        assert flaky.events.faults["list_active"] == 3, "control: the listing really failed"
        assert (await engine.describe("a")).stuck_reason is None
        await engine.signal("a", "go", "now")
        with trio.fail_after(10):
            assert await engine.result("a") == "a: now"


async def test_a_transient_fault_loading_a_history_is_retried_and_the_run_is_not_given_up(
    store_url: Callable[[], str],
) -> None:
    url = store_url()
    await _leave_running(url, "a", "b")

    def arm(events: aion.testing.FlakyStore) -> None:
        events.fail_next_reads(5)  # the sweep's first load meets them (and its retries)

    async with _flaky_engine(url, arm) as (engine, flaky):
        for name in ("a", "b"):
            # open_engine did not wait for the retried load: a signal meanwhile may meet
            # one of the armed faults too, and its client retries it.
            await _signal_retrying(engine, name)
        with trio.fail_after(10):
            assert await engine.result("a") == "a: now"
            assert await engine.result("b") == "b: now"
        assert flaky.events.faults["read_history"] == 5, "control: the loads really failed"
        assert [(await engine.describe(name)).stuck_reason for name in ("a", "b")] == [None, None]


async def test_a_non_transient_fault_loading_a_history_marks_only_that_run_stuck(
    store_url: Callable[[], str],
) -> None:
    url = store_url()
    await _leave_running(url, "a", "b")

    def arm(events: aion.testing.FlakyStore) -> None:
        events.fail_next_reads(1, aion.SerializationError("a", 2, "injected: corrupt row"))

    async with _flaky_engine(url, arm) as (engine, _):
        reasons = {name: (await engine.describe(name)).stuck_reason for name in ("a", "b")}
        stuck = [name for name, reason in reasons.items() if reason is not None]
        assert len(stuck) == 1, reasons
        assert str(reasons[stuck[0]]).startswith("recovery failed: SerializationError"), reasons
        (healthy,) = {"a", "b"} - set(stuck)
        await engine.signal(healthy, "go", "now")
        with trio.fail_after(10):
            assert await engine.result(healthy) == f"{healthy}: now"


# --------------------------------------------------------------------------
# A restart mid-backoff waits out the recorded remainder (issue 14 item 11)
# --------------------------------------------------------------------------

ATTEMPTS: list[tuple[int, float]] = []


@aion.activity(retry=aion.RetryPolicy(max_attempts=3, backoff=aion.Fixed(100)))
async def fails_once() -> str:
    attempt = aion.activity_info().attempt
    ATTEMPTS.append((attempt, trio.current_time()))
    if attempt == 1:
        raise ConnectionError("first attempt fails")
    return f"attempt {attempt}"


@aion.workflow
async def retries_once(ctx: aion.WorkflowContext) -> str:
    return str(await ctx.run(fails_once))


async def test_a_restart_mid_backoff_waits_the_recorded_remainder_and_no_more(
    autojump_clock: trio.testing.MockClock, store_url: Callable[[], str]
) -> None:
    """Attempt 1 fails at t1 (backoff 100 s, recorded as retry_at); 40 s later the engine
    stops without a drain (the backoff is cut short, nothing more recorded); the next
    engine runs attempt 2 at t1 + 100: not at once (t1 + 40), not a fresh backoff (t1 + 140)."""
    ATTEMPTS.clear()
    url = store_url()
    options: dict[str, Any] = {"workflows": [retries_once], "activities": [fails_once]}
    async with aion.open_engine(url, **options) as engine:
        await engine.start(retries_once, workflow_id="r")
        await trio.sleep(40)  # attempt 1 fails at once; its backoff is 40 s in when the engine stops
    ((_, t1),) = ATTEMPTS
    assert trio.current_time() == pytest.approx(t1 + 40, abs=0.5)
    async with aion.open_engine(url, **options) as engine:
        with trio.fail_after(300):
            assert await engine.result("r") == "attempt 2"
        history = await engine.history("r")
    assert [a for a, _ in ATTEMPTS] == [1, 2]
    assert ATTEMPTS[1][1] == pytest.approx(t1 + 100, abs=0.5)
    (failure,) = [e for e in history if isinstance(e.body, aion.ActivityFailed)]
    assert isinstance(failure.body, aion.ActivityFailed)
    assert failure.body.retry_at is not None
    assert (failure.body.retry_at - failure.recorded_at).total_seconds() == pytest.approx(100)


# --------------------------------------------------------------------------
# Poison runs (issue 14 item 5)
# --------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_a_run_that_kills_every_recovery_is_marked_stuck_after_max_attempts(tmp_path: Path) -> None:
    """A real process whose activity calls os._exit(1) is restarted until the run is marked
    stuck: the first run and max_recovery_attempts (5) recoveries die, the next marks it
    stuck naming the count; a run waiting for a signal all along is not blamed and completes."""
    store = tmp_path / "poison.db"
    command = [sys.executable, "-m", "tests.procs.poison_worker", str(store)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    deaths = 0
    for _ in range(10):
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        if done.returncode == 0:
            break
        assert done.returncode == 1, done.stderr
        deaths += 1
    assert deaths == 1 + 5, "the first run and five recoveries died; the sixth did not run it"
    assert "STUCK 5 recoveries of this run in a row never finished" in done.stdout, done.stdout
    assert "PATIENT patient got now" in done.stdout, done.stdout
    again = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert "STUCK 5 recoveries" in again.stdout, "a stuck run's count does not grow with more restarts"
    trio.run(_clear_count, store)
    cleared = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert cleared.returncode == 1, "its count cleared by the operator, the run is run again"


async def _clear_count(store: Path) -> None:
    async with aion.open_store(f"sqlite:///{store}") as opened:
        assert isinstance(opened, aion.RecoveryCounts)
        assert await opened.recovery_counts() == {"poison": 6}
        await opened.clear_recoveries(["poison"])


class Crash(Exception):
    """Leaves an engine as a dying process would: no graceful shutdown (no drain, counts kept)."""


@aion.activity
async def never_ends() -> str:
    await trio.sleep_forever()
    return "unreachable"


@aion.workflow
async def hangs_in_an_activity(ctx: aion.WorkflowContext) -> str:
    return str(await ctx.run(never_ends))


async def test_only_runs_whose_recovery_never_finished_are_counted_and_made_stuck(
    autojump_clock: trio.testing.MockClock, store_url: Callable[[], str]
) -> None:
    """Seven engines "crash" in turn: the run whose activity attempt never ends is counted
    each time and marked stuck after five; the run waiting for a signal never is."""
    url = store_url()
    options: dict[str, Any] = {"workflows": [waits_for_go, hangs_in_an_activity], "activities": [never_ends]}
    reasons: list[str | None] = []
    for generation in range(7):
        with contextlib.suppress(Crash):
            async with aion.open_engine(url, **options) as engine:
                if generation == 0:
                    await engine.start(waits_for_go, "w", workflow_id="waiting")
                    await engine.start(hangs_in_an_activity, workflow_id="hanging")
                await trio.sleep(1)
                reasons.append((await engine.describe("hanging")).stuck_reason)
                assert (await engine.describe("waiting")).stuck_reason is None
                raise Crash
    assert reasons[:6] == [None] * 6
    assert reasons[6] is not None
    assert reasons[6].startswith("5 recoveries of this run in a row never finished")
    async with aion.open_store(url) as store:
        assert isinstance(store, aion.RecoveryCounts)
        assert await store.recovery_counts() == {"hanging": 6}
    async with aion.open_engine(url, **options) as engine:
        await engine.signal("waiting", "go", "now")
        with trio.fail_after(10):
            assert await engine.result("waiting") == "w: now"
        # A graceful close clears the counts of what it recovered, not a stuck run's.
    async with aion.open_store(url) as store:
        assert isinstance(store, aion.RecoveryCounts)
        assert await store.recovery_counts() == {"hanging": 6}


@aion.workflow(name="first-step")
async def first_step_waits(ctx: aion.WorkflowContext) -> str:
    return str(await ctx.wait_signal("never"))


@aion.workflow(name="first-step")
async def first_step_runs_an_activity(ctx: aion.WorkflowContext) -> str:
    return str(await ctx.run(never_ends))


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
async def test_a_run_whose_recovery_starts_its_first_activity_stays_counted_until_it_ends(
    autojump_clock: trio.testing.MockClock, store_url: Callable[[], str], lazy: bool
) -> None:
    """A run recorded up to its start only (as when the process died before its first step's
    records) is replayed by recovery, and the replay runs that step's activity: the risky part
    of the recovery, so the run's count stays while the attempt runs.  Lazy recovery replays
    such a run in the background, after the sweep: its count must not be cleared with the
    sweep's quiet runs (a process killed by that activity would then go uncounted)."""
    url = store_url()
    async with aion.open_engine(url, workflows=[first_step_waits]) as engine:
        await engine.start(first_step_waits, workflow_id="first")
        await trio.testing.wait_all_tasks_blocked()
    config = aion.EngineConfig(lazy_recovery=lazy)
    async with aion.open_store(url) as store:
        assert isinstance(store, aion.RecoveryCounts)
        with contextlib.suppress(Crash):
            async with aion.open_engine(
                store, workflows=[first_step_runs_an_activity], activities=[never_ends], config=config
            ) as engine:
                await trio.sleep(1)
                history = await engine.history("first")
                assert "ActivityScheduled" in [e.type for e in history], "control: the attempt runs"
                assert await store.recovery_counts() == {"first": 1}
                raise Crash
