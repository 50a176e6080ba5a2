"""Workflow queues through SIGKILL: an engine killed while runs of a queue are queued and
running is restarted; every run is started exactly once, runs to its end, and the queue's
limit (two at a time) holds across the kills (issue 18)."""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from procs import queue_worker

ROOT = Path(__file__).resolve().parent.parent


def _events(store: Path, kind: str) -> list[tuple[str, int]]:
    """(workflow id, recorded_at) of every event of ``kind``, read from the file."""
    if not store.exists():
        return []
    with contextlib.closing(sqlite3.connect(f"file:{store}?mode=ro", uri=True)) as conn:
        try:
            rows = conn.execute(
                "SELECT workflow_id, recorded_at FROM events WHERE type = ? ORDER BY recorded_at", (kind,)
            ).fetchall()
        except sqlite3.OperationalError:
            return []
    return [(str(w), int(t)) for w, t in rows]


def _queued(store: Path) -> int:
    """How many entries the file's workflow queues still hold."""
    with contextlib.closing(sqlite3.connect(f"file:{store}?mode=ro", uri=True)) as conn:
        return int(conn.execute("SELECT count(*) FROM flow_runs").fetchone()[0])


def _spawn(store: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.procs.queue_worker", str(store)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def _wait(store: Path, proc: subprocess.Popen[str], kind: str, count: int) -> None:
    deadline = time.monotonic() + 60
    while len(_events(store, kind)) < count:
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the engine exited ({proc.returncode}):\n{out}\n{err[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            out, err = proc.communicate()
            with contextlib.closing(sqlite3.connect(f"file:{store}?mode=ro", uri=True)) as conn:
                queued = conn.execute("SELECT workflow_id, state FROM flow_runs").fetchall()
            started = [w for w, _ in _events(store, "WorkflowStarted")]
            ended = [w for w, _ in _events(store, "WorkflowCompleted")]
            pytest.fail(
                f"no progress: fewer than {count} {kind} (queued {queued}, started {started}, ended {ended}):"
                f"\n{out}\n{err[-3000:]}"
            )
        time.sleep(0.02)


def _kill(proc: subprocess.Popen[str]) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    proc.stdout.close()  # type: ignore[union-attr]
    proc.stderr.close()  # type: ignore[union-attr]


@pytest.mark.slow
def test_queued_runs_survive_sigkill_started_once_and_within_the_limit(tmp_path: Path) -> None:
    store = tmp_path / "queue.db"
    for started in (2, 5):
        proc = _spawn(store)
        _wait(store, proc, "WorkflowStarted", started)
        _kill(proc)
    proc = _spawn(store)
    try:
        _wait(store, proc, "WorkflowCompleted", queue_worker.RUNS)
        # A closed run's entry leaves its queue just after its terminal: wait for that
        # (bounded) before the kill; the check below fails if one was left behind.
        deadline = time.monotonic() + 60
        while _queued(store) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
    finally:
        _kill(proc)
    starts = _events(store, "WorkflowStarted")
    ends = dict(_events(store, "WorkflowCompleted"))
    assert sorted(w for w, _ in starts) == sorted(f"q-{n}" for n in range(queue_worker.RUNS)), (
        "a run started twice"
    )
    # Never more than two runs between their start and their end, kills included.
    for workflow_id, began in starts:
        running = [w for w, t in starts if t <= began and ends[w] > began]
        assert len(running) <= 2, f"{running} ran at once when {workflow_id} started"
    with contextlib.closing(sqlite3.connect(f"file:{store}?mode=ro", uri=True)) as conn:
        assert conn.execute("SELECT count(*) FROM flow_runs").fetchone()[0] == 0, "finished runs left queued"
