"""Each example in examples/ runs as a real subprocess and prints the outcome it promises."""

from __future__ import annotations

import contextlib
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # runs each example as a real subprocess

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def run_example(name: str, *args: str, cwd: Path) -> list[str]:
    """Run ``examples/<name>.py``; return its stdout lines (it must exit 0)."""
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / f"{name}.py"), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=60,  # subprocess.run kills the child if it hangs
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_hello_prints_the_result_and_history_and_a_rerun_reattaches(tmp_path: Path) -> None:
    history = "history: WorkflowStarted -> ActivityScheduled -> ActivityStarted -> ActivityCompleted -> WorkflowCompleted"
    # Default: a throwaway database in a temporary directory, nothing left behind.
    assert run_example("hello", cwd=tmp_path) == ["result: Hello, World!", history]
    assert list(tmp_path.iterdir()) == []

    db = tmp_path / "hello.db"
    assert run_example("hello", "--db", str(db), "--name", "Ann", cwd=tmp_path) == [
        "result: Hello, Ann!",
        history,
    ]
    assert run_example("hello", "--db", str(db), "--name", "Ann", cwd=tmp_path) == [
        "hello-ann was already in hello.db: the recorded result, nothing re-run",
        "result: Hello, Ann!",
        history,
    ]
    with contextlib.closing(sqlite3.connect(db)) as conn:
        (attempts,) = conn.execute("SELECT count(*) FROM events WHERE type = 'ActivityStarted'").fetchone()
    assert attempts == 1, "the rerun did not run the activity again"


def _primes_between(low: int, high: int) -> int:
    sieve = [True] * max(high, 2)
    sieve[0] = sieve[1] = False
    for n in range(2, int(high**0.5) + 1):
        if sieve[n]:
            sieve[n * n :: n] = [False] * len(sieve[n * n :: n])
    return sum(sieve[low:high])


def test_fan_out_gathers_every_chunk_and_the_race_cancels_the_loser(tmp_path: Path) -> None:
    per_chunk = [_primes_between(0, 34), _primes_between(34, 68), _primes_between(68, 100)]
    assert per_chunk == [11, 8, 6]  # control on the test's own sieve: 25 primes below 100
    lines = run_example("fan_out", "--chunks", "3", "--limit", "100", cwd=tmp_path)
    assert lines == [
        "fan-out: 3 count_primes activities for [0, 100), all scheduled at once",
        f"fan-in: 25 primes below 100; per chunk {per_chunk}",
        "race: nearby says release 1.2 is fine; cancelled when the workflow returned: far-away",
    ]


def test_approval_approves_escalates_and_times_out_in_simulated_days(tmp_path: Path) -> None:
    lines = run_example("approval", cwd=tmp_path)
    assert lines[:-1] == [
        "day 0.0: exp-1 is waiting for the manager",
        "day 0.0: exp-2 is waiting for the manager",
        "day 0.0: exp-3 is waiting for the manager",
        "day 1.0: the manager approves exp-1",
        "day 2.5: exp-2 is escalated to the director",
        "day 2.5: exp-3 is escalated to the director",
        "day 2.5: the director approves exp-2",
        "exp-1: approved by the manager after 1.0 days, paid 120.00",
        "exp-2: approved by the director after 2.5 days, paid 80.50",
        "exp-3: rejected by nobody (auto-rejected) after 5.0 days, not paid",
        "simulated time: 5.0 days",
    ]
    real = re.fullmatch(r"real time: (\d+\.\d\d) s", lines[-1])
    assert real is not None, lines[-1]
    assert float(real.group(1)) < 20, "five days passed in mock time, not real time"


def test_the_asyncio_activity_talks_to_an_asyncio_server_and_is_retried(tmp_path: Path) -> None:
    def price(sku: str) -> str:
        return f"{(100 + sum(map(ord, sku)) % 900) / 100:.2f}"

    lines = run_example("asyncio_activity", "--skus", "widget,gizmo,bolt", "--busy", "gizmo", cwd=tmp_path)
    total = sum(100 + sum(map(ord, s)) % 900 for s in ("widget", "gizmo", "bolt")) / 100
    assert lines == [
        "asyncio price service listening on 127.0.0.1 (its own thread and event loop)",
        f"widget: {price('widget')} (attempt 1)",
        f"gizmo: {price('gizmo')} (attempt 2, the first found the service busy)",
        f"bolt: {price('bolt')} (attempt 1)",
        f"total for 3 items: {total:.2f}",
    ]


def test_the_periodic_job_chains_its_runs_with_continue_as_new(tmp_path: Path) -> None:
    lines = run_example("periodic", "--runs", "3", cwd=tmp_path)
    header = re.fullmatch(r"3 run\(s\) of nightly-cleanup, one history of (\d+) events:", lines[0])
    assert header is not None, lines[0]
    pattern = r"  run (\d) \((first|after run \d)\): started on day (\d+), (\d+) events, (\w+)"
    runs = [re.fullmatch(pattern, line) for line in lines[1:4]]
    assert all(runs), lines
    assert [m.groups()[:3] for m in runs if m] == [
        ("1", "first", "0"),
        ("2", "after run 1", "1"),
        ("3", "after run 2", "2"),
    ]
    assert [m.group(5) for m in runs if m] == ["continued_as_new", "continued_as_new", "completed"]
    # The runs' segments make up the whole history.
    assert sum(int(m.group(4)) for m in runs if m) == int(header.group(1))
    # 11 + 12 + 13 records removed, carried from run to run in continue-as-new's arguments.
    assert lines[4:] == ["result: removed 36 records over 3 day(s)"]
