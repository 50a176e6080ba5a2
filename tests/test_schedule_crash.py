"""Durable schedules through SIGKILL: an engine killed mid-schedule is restarted, and no
tick is lost or started twice (ticks missed while it was down are caught up)."""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import time
from datetime import datetime, timedelta
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
INTERVAL = timedelta(milliseconds=200)


def _starts(store: Path) -> dict[str, int]:
    """WorkflowStarted events per workflow of the schedule, read from the file (WAL: a reader
    sees the last commit while the engine writes)."""
    if not store.exists():
        return {}
    with contextlib.closing(sqlite3.connect(f"file:{store}?mode=ro", uri=True)) as conn:
        try:
            rows = conn.execute(
                "SELECT workflow_id, count(*) FROM events WHERE type = 'WorkflowStarted' AND workflow_id LIKE ?"
                " GROUP BY workflow_id",
                ("beat@%",),
            ).fetchall()
        except sqlite3.OperationalError:
            return {}
    return {workflow_id: int(count) for workflow_id, count in rows}


def _spawn(store: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.procs.schedule_worker", str(store)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def _run_until(store: Path, proc: subprocess.Popen[str], count: int) -> None:
    deadline = time.monotonic() + 60
    while len(_starts(store)) < count:
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the engine exited ({proc.returncode}) before the kill:\n{out}\n{err[-3000:]}")
        assert time.monotonic() < deadline, "the schedule made no progress"
        time.sleep(0.02)


def _kill(proc: subprocess.Popen[str]) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    proc.stdout.close()  # type: ignore[union-attr]
    proc.stderr.close()  # type: ignore[union-attr]


def _nominal(workflow_id: str) -> datetime:
    return datetime.fromisoformat(workflow_id.split("@")[1].replace("Z", "+00:00"))


@pytest.mark.slow
def test_a_sigkilled_engine_neither_loses_nor_doubles_a_tick(tmp_path: Path) -> None:
    store = tmp_path / "beats.db"
    seen = 0
    for _ in range(3):
        proc = _spawn(store)
        _run_until(store, proc, seen + 5)
        _kill(proc)
        seen = len(_starts(store))
        time.sleep(0.5)  # down for a few ticks: they are caught up by the next engine
    proc = _spawn(store)
    _run_until(store, proc, seen + 5)
    _kill(proc)
    starts = _starts(store)
    assert {w: c for w, c in starts.items() if c != 1} == {}, "a tick's run was started twice"
    assert len({_nominal(w) for w in starts}) == len(starts), "a tick had two runs"
    times = sorted(_nominal(w) for w in starts)
    expected = [times[0] + k * INTERVAL for k in range(round((times[-1] - times[0]) / INTERVAL) + 1)]
    assert sorted(set(expected) - set(times)) == [], "ticks were lost"
    assert len(times) >= 20
