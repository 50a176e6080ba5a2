"""Observer hooks and the structured fields of ``aion_trio.*`` logs.

Observers get typed records: run started/ended, activity attempts and their
outcomes, store operation timings, the recovery sweep.  They are called
outside every recorder lock, never for what replay re-reads, an observer that
raises does not break the engine, and nothing is built when nobody observes.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

import aion_trio as aion
from aion_trio import _observe, _plugins
from aion_trio.plugin import DISABLE_ENV, ENTRY_POINT_GROUP, hookimpl

FLAKY: dict[str, int] = {}


@aion.activity(retry=aion.RetryPolicy(max_attempts=3, backoff=aion.Fixed(0.5)))
async def flaky_once(key: str) -> str:
    FLAKY[key] = FLAKY.get(key, 0) + 1
    if FLAKY[key] == 1:
        raise ConnectionError(f"first try of {key} fails")
    return key.upper()


@aion.activity
async def steady(x: int) -> int:
    await trio.lowlevel.checkpoint()
    return x + 1


@aion.workflow
async def uses_flaky(ctx: aion.WorkflowContext, key: str) -> str:
    return await ctx.run(flaky_once, key)


@aion.workflow
async def breaks(ctx: aion.WorkflowContext) -> None:
    await ctx.run(steady, 1)
    raise ValueError("the order is invalid")


@aion.workflow
async def step_then_signal(ctx: aion.WorkflowContext, x: int) -> int:
    y = await ctx.run(steady, x)
    extra = await ctx.wait_signal("go")
    return int(y + extra)


WORKFLOWS = [uses_flaky, breaks, step_then_signal]
ACTIVITIES = [flaky_once, steady]


def _other_entry_point_observers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Disable installed plugins other than the built-in stores (e.g. a metrics
    contrib installed in the same environment), so these tests see only their own."""
    others = [
        ep.name
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
        if ep.name not in ("memory", "sqlite", "postgres")
    ]
    if others:
        monkeypatch.setenv(DISABLE_ENV, ",".join(others))


@pytest.fixture(autouse=True)
def _only_our_observers(monkeypatch: pytest.MonkeyPatch) -> None:
    _other_entry_point_observers(monkeypatch)
    FLAKY.clear()


def _of(events: list[aion.ObserverEvent], kind: type[Any]) -> list[Any]:
    return [e for e in events if isinstance(e, kind)]


async def test_observers_see_runs_attempts_outcomes_store_operations_and_recovery(
    store_url: Callable[[], str],
) -> None:
    # Real time (a 0.5 s retry backoff): under an autojump clock a thread-backed store
    # "takes" arbitrary mock time, so the bounded visibility bookkeeping may be skipped
    # (it is reconciled later) and this test could not count on seeing its upsert.
    seen: list[aion.ObserverEvent] = []
    async with aion.open_engine(
        store_url(), workflows=WORKFLOWS, activities=ACTIVITIES, observers=[seen.append]
    ) as engine:
        (recovery,) = _of(seen, aion.RecoveryFinished)
        assert (recovery.active, recovery.resumed) == (0, 0)
        ok = await engine.start(uses_flaky, "abc", workflow_id="obs-ok")
        bad = await engine.start(breaks, workflow_id="obs-bad")
        assert await ok.result() == "ABC"
        with pytest.raises(aion.WorkflowFailure):
            await bad.result()

    started = {(e.workflow_id, e.workflow_type) for e in _of(seen, aion.WorkflowRunStarted)}
    assert started == {("obs-ok", "uses_flaky"), ("obs-bad", "breaks")}
    ended = {(e.workflow_id, e.workflow_type, e.status) for e in _of(seen, aion.WorkflowRunEnded)}
    assert ended == {
        ("obs-ok", "uses_flaky", aion.WorkflowStatus.COMPLETED),
        ("obs-bad", "breaks", aion.WorkflowStatus.FAILED),
    }
    run_ids = {e.workflow_id: e.run_id for e in _of(seen, aion.WorkflowRunStarted)}
    assert {e.workflow_id: e.run_id for e in _of(seen, aion.WorkflowRunEnded)} == run_ids

    flaky_attempts = [
        (e.attempt, e.task_queue) for e in _of(seen, aion.ActivityAttemptStarted) if e.workflow_id == "obs-ok"
    ]
    assert flaky_attempts == [(1, "default"), (2, "default")]
    outcomes = [
        (e.activity_type, e.attempt, e.outcome, e.error_type)
        for e in _of(seen, aion.ActivityAttemptEnded)
        if e.workflow_id == "obs-ok"
    ]
    assert outcomes == [("flaky_once", 1, "failed", "ConnectionError"), ("flaky_once", 2, "completed", None)]
    assert all(e.seconds >= 0 for e in _of(seen, aion.ActivityAttemptEnded))

    operations = _of(seen, aion.StoreOperation)
    appends = [op for op in operations if (op.store, op.operation) == ("events", "append")]
    # Every append of both histories was timed: starts, schedules, retries, outcomes, terminals.
    assert len(appends) >= 6
    assert all(op.ok and op.error_type is None and op.seconds >= 0 for op in appends)
    assert any(op.store == "visibility" and op.operation == "upsert" for op in operations)
    # Terminals are observed after the run's last activity outcome.
    ok_order = [type(e).__name__ for e in seen if getattr(e, "workflow_id", None) == "obs-ok"]
    assert ok_order[0] == "WorkflowRunStarted"
    assert ok_order[-1] == "WorkflowRunEnded"


async def test_observers_are_never_called_while_a_recorder_lock_is_held(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    engines: list[aion.Engine] = []
    under_lock: list[str] = []
    calls = 0

    def observer(event: aion.ObserverEvent) -> None:
        nonlocal calls
        calls += 1
        me = trio.lowlevel.current_task()
        for recorder in engines[0]._core.recorders.snapshot() if engines else ():
            if recorder._lock.statistics().owner is me:
                under_lock.append(f"{type(event).__name__} under the lock of {recorder.workflow_id}")

    async with aion.open_engine(
        store_url(), workflows=WORKFLOWS, activities=ACTIVITIES, observers=[observer]
    ) as engine:
        engines.append(engine)
        handles = [await engine.start(uses_flaky, f"k{i}", workflow_id=f"lock-{i}") for i in range(3)]
        for handle in handles:
            await handle.result()
    assert calls > 20, "control: the observer was called for appends and terminals"
    assert under_lock == []


async def test_an_observer_that_raises_is_logged_once_and_breaks_nothing(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="aion_trio.observe")
    good: list[aion.ObserverEvent] = []

    def broken(event: aion.ObserverEvent) -> None:
        raise RuntimeError("metrics backend is down")

    async with aion.open_engine(
        store_url(), workflows=WORKFLOWS, activities=ACTIVITIES, observers=[broken, good.append]
    ) as engine:
        assert await (await engine.start(uses_flaky, "x", workflow_id="raise-1")).result() == "X"
        assert await (await engine.start(uses_flaky, "y", workflow_id="raise-2")).result() == "Y"

    # The other observer got everything, the engine finished both runs.
    assert len(_of(good, aion.WorkflowRunEnded)) == 2
    assert len(good) > 10
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1
    assert "raised on" in errors[0].getMessage()
    assert errors[0].exc_info is not None
    assert "metrics backend is down" in str(errors[0].exc_info[1])
    # The broken observer failed on every event the good one got: the first failure is
    # logged with its traceback, every later one at DEBUG.
    assert sum(1 for r in caplog.records if r.levelno == logging.DEBUG) == len(good) - 1


async def test_replay_after_a_restart_reports_no_second_start_and_no_replayed_outcomes(
    store_url: Callable[[], str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="aion_trio.engine")
    url = store_url()
    first: list[aion.ObserverEvent] = []
    attempt_ended = trio.Event()  # the step ran; its record follows

    def observe(event: aion.ObserverEvent) -> None:
        first.append(event)
        if isinstance(event, aion.ActivityAttemptEnded):
            attempt_ended.set()

    async with aion.open_engine(url, workflows=WORKFLOWS, activities=ACTIVITIES, observers=[observe]) as e:
        await e.start(step_then_signal, 1, workflow_id="replayed")
        await attempt_ended.wait()
        while not any(isinstance(x.body, aion.ActivityCompleted) for x in await e.history("replayed")):
            await trio.testing.wait_all_tasks_blocked()
    assert len(_of(first, aion.WorkflowRunStarted)) == 1
    assert len(_of(first, aion.ActivityAttemptEnded)) == 1

    second: list[aion.ObserverEvent] = []
    async with aion.open_engine(
        url, workflows=WORKFLOWS, activities=ACTIVITIES, observers=[second.append]
    ) as engine:
        (recovery,) = _of(second, aion.RecoveryFinished)
        assert (recovery.active, recovery.resumed) == (1, 1)
        await trio.testing.wait_all_tasks_blocked()
        await engine.signal("replayed", "go", 40)
        assert await engine.result("replayed") == 42
    # The resumed run replayed its start and its activity: neither is reported again.
    assert _of(second, aion.WorkflowRunStarted) == []
    assert _of(second, aion.ActivityAttemptStarted) == []
    assert _of(second, aion.ActivityAttemptEnded) == []
    (ended,) = _of(second, aion.WorkflowRunEnded)
    assert (ended.workflow_id, ended.workflow_type, ended.status) == (
        "replayed",
        "step_then_signal",
        aion.WorkflowStatus.COMPLETED,
    )
    # The recovery summary line carries its figures as fields too.
    summary = next(r for r in caplog.records if r.getMessage().startswith("recovery resumed"))
    assert _fields(summary, "active", "resumed") == {"active": 1, "resumed": 1}


async def test_no_observer_means_no_hub_no_wrapped_store_and_no_event_objects(
    store_url: Callable[[], str], monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    def never(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("an observer event was built although nobody observes")

    for cls in (
        aion.WorkflowRunStarted,
        aion.WorkflowRunEnded,
        aion.ActivityAttemptStarted,
        aion.ActivityAttemptEnded,
        aion.StoreOperation,
        aion.RecoveryFinished,
    ):
        monkeypatch.setattr(cls, "__init__", never)
    async with aion.open_engine(store_url(), workflows=WORKFLOWS, activities=ACTIVITIES) as engine:
        core = engine._core
        assert core.observers is None
        assert core.events is core.store.events
        assert core.visibility is core.store.visibility
        assert await (await engine.start(uses_flaky, "z", workflow_id="quiet")).result() == "Z"
        recorder = core.loaded_recorder("quiet")
        assert recorder is not None
        assert type(recorder.lock) is trio.Lock


# -- registration: entry points, plugin objects, bad observers ----------------------------


class _PluginObserver:
    def __init__(self) -> None:
        self.seen: list[aion.ObserverEvent] = []

    @hookimpl
    def aion_trio_observe(self, event: aion.ObserverEvent) -> None:
        self.seen.append(event)


async def test_a_plugin_object_passed_directly_observes(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    plugin = _PluginObserver()
    async with aion.open_engine(
        store_url(), workflows=WORKFLOWS, activities=ACTIVITIES, observers=[plugin]
    ) as engine:
        await (await engine.start(uses_flaky, "p", workflow_id="plugin-obj")).result()
    assert [e.status for e in _of(plugin.seen, aion.WorkflowRunEnded)] == [aion.WorkflowStatus.COMPLETED]


async def test_bad_observers_are_refused_before_the_engine_opens(store_url: Callable[[], str]) -> None:
    class Unmarked:
        def aion_trio_observe(self, event: object) -> None: ...

    with pytest.raises(TypeError, match="an observer must be a callable"):
        async with aion.open_engine(store_url(), observers=[42]):
            pass  # pragma: no cover
    with pytest.raises(aion.PluginError, match=r"not marked with aion_trio\.plugin\.hookimpl"):
        async with aion.open_engine(store_url(), observers=[Unmarked()]):
            pass  # pragma: no cover


async def test_an_entry_point_plugin_observes_every_engine(
    store_url: Callable[[], str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    autojump_clock: trio.testing.MockClock,
) -> None:
    (tmp_path / "aion_trio_test_observer.py").write_text(
        "from aion_trio.plugin import hookimpl\n"
        "SEEN = []\n"
        "@hookimpl\n"
        "def aion_trio_observe(event):\n"
        "    SEEN.append(event)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    real = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    fake = importlib.metadata.EntryPoint(
        name="test-observer", value="aion_trio_test_observer", group=ENTRY_POINT_GROUP
    )

    def entry_points(**params: Any) -> list[importlib.metadata.EntryPoint]:
        assert params == {"group": ENTRY_POINT_GROUP}
        return [*real, fake]

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    monkeypatch.setattr(_plugins, "_default_managers", {})
    async with aion.open_engine(store_url(), workflows=WORKFLOWS, activities=ACTIVITIES) as engine:
        await (await engine.start(uses_flaky, "e", workflow_id="ep")).result()
    import aion_trio_test_observer  # type: ignore[import-not-found]

    seen = aion_trio_test_observer.SEEN
    assert [e.workflow_id for e in _of(seen, aion.WorkflowRunEnded)] == ["ep"]
    # Disabled by name, it is not loaded.
    disabled = [name for name in os.environ.get(DISABLE_ENV, "").split(",") if name]
    monkeypatch.setenv(DISABLE_ENV, ",".join([*disabled, "test-observer"]))
    before = len(seen)
    async with aion.open_engine(store_url(), workflows=WORKFLOWS, activities=ACTIVITIES) as engine:
        await (await engine.start(uses_flaky, "d", workflow_id="disabled")).result()
    assert len(seen) == before, "the disabled observer saw nothing"


def test_the_hub_queues_events_while_the_lock_is_held_and_delivers_after_release() -> None:
    delivered: list[str] = []
    hub = _observe.ObserverHub([("probe", lambda e: delivered.append(type(e).__name__))])
    lock = trio.Lock()

    async def main() -> None:
        async with hub.lock(lock):
            hub.emit(aion.RecoveryFinished(active=0, resumed=0, seconds=0.0))
            assert delivered == [], "delivered while the lock is held"
            assert lock.locked()
        assert delivered == ["RecoveryFinished"]
        hub.emit(aion.RecoveryFinished(active=0, resumed=0, seconds=0.0))
        assert delivered == ["RecoveryFinished", "RecoveryFinished"]

    trio.run(main)


# -- structured log fields -------------------------------------------------------------------


def _fields(record: logging.LogRecord, *names: str) -> dict[str, Any]:
    return {name: getattr(record, name, "<missing>") for name in names}


async def test_key_log_lines_carry_structured_fields(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="aion_trio")

    @aion.workflow(name="logs_from_code")
    async def logs_from_code(ctx: aion.WorkflowContext) -> str:
        ctx.logger.info("hello from the workflow")
        result: str = await ctx.run(flaky_once, "log")
        await ctx.wait_signal("never")
        return result

    second_attempt_done = trio.Event()

    def observe(event: aion.ObserverEvent) -> None:
        if isinstance(event, aion.ActivityAttemptEnded) and event.attempt == 2:
            second_attempt_done.set()

    async with aion.open_engine(
        store_url(), workflows=[logs_from_code], activities=ACTIVITIES, observers=[observe]
    ) as engine:
        handle = await engine.start(logs_from_code, workflow_id="logged")
        await second_attempt_done.wait()
        await engine.terminate("logged", "operator says stop")
    run_id = handle.run_id

    retry = next(r for r in caplog.records if "attempt 1 of 3: failed" in r.getMessage())
    assert retry.name == "aion_trio.activity"
    assert _fields(retry, "workflow_id", "run_id", "activity", "activity_type", "attempt") == {
        "workflow_id": "logged",
        "run_id": run_id,
        "activity": 0,
        "activity_type": "flaky_once",
        "attempt": 1,
    }
    code = next(r for r in caplog.records if r.getMessage() == "hello from the workflow")
    assert code.name == "aion_trio.workflow.logs_from_code"
    assert _fields(code, "workflow_id", "run_id") == {"workflow_id": "logged", "run_id": run_id}
    terminated = next(
        r for r in caplog.records if r.getMessage().endswith(": workflow run terminated: operator says stop")
    )
    assert _fields(terminated, "workflow_id", "run_id") == {"workflow_id": "logged", "run_id": run_id}
