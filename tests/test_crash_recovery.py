"""Crash recovery with real processes: SIGKILL a worker mid-run, restart it, check history.

A child process runs 200 workflows x 5 activities on a SQLite file.  The test
kills it with SIGKILL at three points (chosen by a seeded RNG as thresholds of
executed activities), restarts it each time, and finally checks every history
and the side table of executions the activities wrote.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio

import aion_trio as aion
from aion_trio import projections

ROOT = Path(__file__).resolve().parent.parent
N, K = 200, 5


def _executions(side: Path) -> list[tuple[str, int, int, float]]:
    if not side.exists():
        return []
    # closing(): sqlite3's own context manager commits but never closes (ResourceWarning on 3.13)
    with contextlib.closing(sqlite3.connect(side)) as conn:
        try:
            return list(conn.execute("SELECT workflow, step, generation, at FROM executions"))
        except sqlite3.OperationalError:
            return []


def _spawn(store: Path, side: Path, generation: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.procs.crash_worker",
            str(store),
            str(side),
            str(generation),
            str(N),
            str(K),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


@pytest.mark.slow
def test_sigkilled_workers_resume_without_losing_or_repeating_work(tmp_path: Path) -> None:
    store = tmp_path / "orders.db"
    side = tmp_path / "side.db"
    rng = random.Random(20261130)
    total = N * K
    thresholds = sorted(rng.sample(range(total // 10, total * 8 // 10), 3))
    # (workflow, activity) pairs whose completion was durable when generation g died.
    completed_by: list[set[tuple[str, int]]] = []
    for generation, threshold in enumerate(thresholds):
        proc = _spawn(store, side, generation)
        deadline = time.monotonic() + 120
        while len(_executions(side)) < threshold:
            if proc.poll() is not None:
                out, err = proc.communicate()
                pytest.fail(f"worker exited early ({proc.returncode}) before the kill:\n{out}\n{err}")
            assert time.monotonic() < deadline, "worker made no progress"
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert proc.returncode == -signal.SIGKILL
        proc.stdout.close()  # type: ignore[union-attr]
        proc.stderr.close()  # type: ignore[union-attr]
        snapshot = trio.run(_read_histories, store)
        completed_by.append(
            {
                (wid, e.body.activity_id)
                for wid, history in snapshot.items()
                for e in history
                if isinstance(e.body, aion.ActivityCompleted)
            }
        )
    assert 0 < len(completed_by[0]) < len(completed_by[-1]) < N * K, "control: the kills landed mid-run"
    proc = _spawn(store, side, len(thresholds))
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        dump = subprocess.run(
            ["py-spy", "dump", "--pid", str(proc.pid)], capture_output=True, text=True
        ).stdout
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"final worker hung; executions={len(_executions(side))}\n{dump}\n{err[-3000:]}")
    assert proc.returncode == 0, f"final worker failed:\n{out}\n{err}"
    assert "ALL DONE" in out

    histories = trio.run(_read_histories, store)
    executions = _executions(side)
    assert len(histories) == N
    for index in range(N):
        wid = f"wf-{index}"
        history = histories[wid]
        assert [e.seq for e in history] == list(range(1, len(history) + 1)), f"{wid}: seq gap"
        terminals = [e for e in history if e.is_terminal]
        assert len(terminals) == 1, wid
        assert isinstance(terminals[0].body, aion.WorkflowCompleted), wid
        assert terminals[0].body.result.value() == sum(index * 10 + k for k in range(K)), wid
        completed = [e for e in history if isinstance(e.body, aion.ActivityCompleted)]
        assert sorted(e.body.activity_id for e in completed) == list(range(K)), f"{wid}: duplicate completion"
        assert projections.workflow_status(history) is aion.WorkflowStatus.COMPLETED
    # Replayed, not re-executed: an activity whose completion was durable when
    # generation g died never executes in a later generation.
    for generation, done in enumerate(completed_by):
        rerun = [x for x in executions if (x[0], x[1]) in done and x[2] > generation]
        assert rerun == [], (
            f"completed activities re-executed after the kill of generation {generation}: {rerun[:5]}"
        )
    # Every activity ran at least once; re-execution is bounded by what was in flight at each kill.
    per_activity: dict[tuple[str, int], int] = {}
    for wid, step, _gen, _at in executions:
        per_activity[(wid, step)] = per_activity.get((wid, step), 0) + 1
    assert len(per_activity) == total
    assert max(per_activity.values()) <= len(thresholds) + 1
    assert len(executions) < total + 3 * N, "far more re-execution than the in-flight work at the kills"
    # No run was marked stuck: visibility says so for every workflow.
    rows = trio.run(_rows, store)
    assert len(rows) == N
    assert all(r.stuck_reason is None and r.status is aion.WorkflowStatus.COMPLETED for r in rows)


async def _read_histories(store: Path) -> dict[str, list[aion.Event]]:
    async with aion.open_store(f"sqlite:///{store}") as opened:
        return {wid: await opened.events.read_history(wid) for wid in await opened.events.list_workflow_ids()}


async def _rows(store: Path) -> list[aion.VisibilityRow]:
    async with aion.open_store(f"sqlite:///{store}") as opened:
        return await opened.visibility.list()
