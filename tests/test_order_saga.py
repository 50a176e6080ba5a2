"""The order saga (examples/order_saga.py) end to end under MockClock, in-process and
across a real SIGKILL of the process running it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from _replay import assert_replays_cleanly

import aion_trio as aion
from aion_trio import events as ev
from aion_trio.projections import current_lease_terminal

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
import order_saga as saga  # noqa: E402

ORDERS = 28
EXPECTED = Counter(saga.plan(n) for n in range(1, ORDERS + 1))
ACTIVITIES = [saga.reserve, saga.charge, saga.refund, saga.release]


def check_history(n: int, history: list[aion.Event]) -> None:
    """One order's history tells the story its plan says, with each step recorded once."""
    types = {
        e.body.activity_id: e.body.activity_type
        for e in history
        if isinstance(e.body, aion.ActivityScheduled)
    }
    completed = Counter(
        types[e.body.activity_id] for e in history if isinstance(e.body, aion.ActivityCompleted)
    )
    scheduled = Counter(e.body.activity_type for e in history if isinstance(e.body, aion.ActivityScheduled))
    assert all(count == 1 for count in scheduled.values()), (n, scheduled)
    terminal = current_lease_terminal(history)
    assert terminal is not None, n
    assert sum(1 for e in history if e.is_terminal) == 1, n
    plan = saga.plan(n)
    if plan == "shipped":
        assert isinstance(terminal.body, aion.WorkflowCompleted)
        assert set(completed) == {"reserve", "charge"}
    elif plan == "declined":
        assert isinstance(terminal.body, aion.WorkflowCompleted)
        assert set(completed) == {"reserve", "release"}
    elif plan == "not shipped in time":
        assert isinstance(terminal.body, aion.WorkflowCompleted)
        assert set(completed) == {"reserve", "charge", "refund", "release"}
        assert any(isinstance(e.body, aion.TimerFired) for e in history)
    else:
        assert isinstance(terminal.body, ev.WorkflowCancelled)
        assert ("release" in completed) == ("reserve" in completed), (n, completed)
        assert ("refund" in completed) == ("charge" in completed), (n, completed)


async def test_the_saga_runs_end_to_end_under_the_mock_clock_and_replays(
    autojump_clock: trio.testing.MockClock,
) -> None:
    outcomes: Counter[str] = Counter()
    with trio.fail_after(30 * 86400):
        async with aion.open_engine(
            "memory://", workflows=[saga.order_saga], activities=ACTIVITIES
        ) as engine:
            for n in range(1, ORDERS + 1):
                await engine.start(saga.order_saga, {"n": n}, workflow_id=f"saga-{n}")
                if saga.plan(n) == "shipped":
                    await engine.signal(f"saga-{n}", "shipped", f"track-{n}")
                elif saga.plan(n) == "cancelled":
                    await engine.cancel(f"saga-{n}", "changed my mind")
            started = trio.current_time()
            histories: dict[int, list[aion.Event]] = {}
            for n in range(1, ORDERS + 1):
                try:
                    outcomes[(await engine.result(f"saga-{n}"))["outcome"]] += 1
                except aion.WorkflowFailure as failure:
                    outcomes[failure.status] += 1
                histories[n] = await engine.history(f"saga-{n}")
            elapsed = trio.current_time() - started
    assert outcomes == EXPECTED
    assert elapsed >= 2 * 86400, "the two-day shipping timeout really elapsed (in mock time)"
    for n, history in histories.items():
        check_history(n, history)
        await assert_replays_cleanly(history, workflows=[saga.order_saga], activities=ACTIVITIES)


def _saga(db: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "examples" / "order_saga.py"),
            "--db",
            str(db),
            "--orders",
            str(ORDERS),
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "tests")},
    )


@pytest.mark.slow
def test_the_saga_resumes_after_a_sigkill_in_the_middle(tmp_path: Path) -> None:
    db = tmp_path / "saga.db"
    first = _saga(db, "--pause")
    try:
        assert first.stdout is not None
        line = first.stdout.readline()
        assert line.strip() == "PAUSED", line
        first.send_signal(signal.SIGKILL)
        assert first.wait(timeout=30) == -signal.SIGKILL
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
        if first.stdout is not None:
            first.stdout.close()

    async def unfinished() -> tuple[int, int]:
        async with aion.open_store(f"sqlite:///{db}") as store:
            ids = await store.events.list_workflow_ids()
            active = await store.events.list_active()
            return len(ids), len(active)

    total, active = trio.run(unfinished)
    assert total == ORDERS
    assert active > 0, "control: the kill left orders in flight (waiting for shipment or a retry)"

    second = _saga(db)
    try:
        out, _ = second.communicate(timeout=120)
    finally:
        if second.poll() is None:  # a hang must not outlive the test
            second.kill()
            second.communicate()
    assert second.returncode == 0
    assert f"resumed {ORDERS} orders" in out
    summary: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    assert Counter(summary["outcomes"]) == EXPECTED

    async def histories() -> dict[int, list[aion.Event]]:
        async with aion.open_store(f"sqlite:///{db}") as store:
            return {n: await store.events.read_history(f"saga-{n}") for n in range(1, ORDERS + 1)}

    for n, history in trio.run(histories).items():
        check_history(n, history)
