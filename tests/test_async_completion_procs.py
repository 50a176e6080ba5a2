"""Async activity completion across processes: a token outlives the engine that handed it out
(SIGKILLed while the attempt waits), and ``aion-trio activity complete|fail`` settles the
attempt from another process, directly or through the inbox of the store's live owner.

The processes are ``tests/procs/async_activity_worker.py`` and the ``aion-trio`` console
script, both real subprocesses on one SQLite file.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest
import trio

import aion_trio as aion

ROOT = Path(__file__).resolve().parent.parent
APP = "tests.procs.async_activity_worker"
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _worker(store: Path, mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", APP, str(store), mode],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )


def _token_line(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline()  # bounded: the worker gives up after 60 s
    assert line.startswith("TOKEN "), (
        line,
        proc.stderr.read() if proc.poll() is not None and proc.stderr else "",
    )
    return line.split(" ", 1)[1].strip()


def _cli(store: Path, *args: str) -> subprocess.CompletedProcess[str]:
    script = Path(sysconfig.get_path("scripts")) / "aion-trio"
    return subprocess.run(
        [str(script), "activity", *args, "--store", f"sqlite:///{store}", "-m", APP],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=ENV,
        check=False,
    )


def _asked(store: Path) -> list[str]:
    return Path(f"{store}.asked").read_text(encoding="utf-8").splitlines()


async def _finish(store: Path) -> tuple[Any, list[aion.Event]]:
    from procs.async_activity_worker import activities, workflows

    async with aion.open_engine(f"sqlite:///{store}", workflows=workflows, activities=activities) as engine:
        with trio.fail_after(60):
            return await engine.result("approval-1"), await engine.history("approval-1")


@pytest.mark.slow  # two subprocesses
def test_a_token_outlives_a_sigkilled_engine_and_the_cli_completes_the_attempt(tmp_path: Path) -> None:
    store = tmp_path / "approvals.db"
    killed = _worker(store, "die")
    token = _token_line(killed)
    killed.communicate(timeout=60)  # reaps it and closes its pipes
    assert killed.returncode == -signal.SIGKILL
    assert _asked(store) == ["order-1"]

    bad = _cli(store, "complete", token[:-3] + "???", '"x"')
    assert bad.returncode == 2, bad.stderr
    assert "not an activity task token" in bad.stderr

    done = _cli(store, "complete", token, '{"approved": true}')
    assert done.returncode == 0, done.stderr
    assert "completed (no worker owns the store: applied directly" in done.stderr, done.stderr
    again = _cli(store, "complete", token, '{"approved": true}')
    assert again.returncode == 0, again.stderr  # a retried completion: quiet
    refused = _cli(store, "fail", token, "changed my mind")
    assert refused.returncode == 1, refused.stderr
    assert "is not open: its outcome is recorded: completed" in refused.stderr

    result, history = trio.run(_finish, store)
    assert result == {"approved": True}
    assert _asked(store) == ["order-1"], "no engine ran the activity's code again"
    went_async = [
        e.body
        for e in history
        if isinstance(e.body, aion.MarkerRecorded) and e.body.name.startswith("async-completion:")
    ]
    assert len(went_async) == 1, "the CLI's engine waited for the token; it did not run the code again"
    completed = [e.body for e in history if isinstance(e.body, aion.ActivityCompleted)]
    assert [(b.attempt, b.result.value()) for b in completed] == [(1, {"approved": True})]
    assert not any(isinstance(e.body, aion.ActivityFailed) for e in history)


@pytest.mark.slow  # a worker subprocess and CLI subprocesses
def test_the_cli_fails_the_attempt_through_the_inbox_of_the_live_owner(tmp_path: Path) -> None:
    store = tmp_path / "approvals.db"
    owner = _worker(store, "serve")
    try:
        token = _token_line(owner)
        failed = _cli(store, "fail", token, "out of stock", "--type", "Refused", "--non-retryable")
        assert failed.returncode == 0, failed.stderr
        assert "queued for the running worker" in failed.stderr
        assert "applied by the worker: activity attempt of workflow 'approval-1' failed" in failed.stderr
        out, err = owner.communicate(timeout=60)
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
    assert owner.returncode == 1, (out, err)  # run.result() raised the workflow's failure
    assert "out of stock" in err

    async def history() -> list[aion.Event]:
        async with aion.open_store(f"sqlite:///{store}") as opened:
            return list(await opened.events.read_history("approval-1"))

    events = trio.run(history)
    [failure] = [e.body for e in events if isinstance(e.body, aion.ActivityFailed)]
    assert (failure.attempt, failure.final, failure.error.type, failure.error.message) == (
        1,
        True,
        "Refused",
        "out of stock",
    )
    assert _asked(store) == ["order-1"]
