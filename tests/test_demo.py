"""``aion-trio demo``: the README's main job.  It completes every order, and after a
SIGKILL in the middle the same command resumes the same workflows instead of
starting over."""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sysconfig
import time
from pathlib import Path

import pytest
import trio
from click.testing import CliRunner

import aion_trio as aion
from aion_trio import _cli, _demo as _demo_module

ORDERS = 40
# Every 9th order's card is declined (compensated); every other order ships.
DECLINED = sum(1 for n in range(1, ORDERS + 1) if n % 9 == 0)


def _script() -> str:
    script = Path(sysconfig.get_path("scripts")) / "aion-trio"
    if not script.exists():
        pytest.fail(f"console script {script} is not installed; run: pip install -e '.[test]'")
    return str(script)


def _demo(db: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [_script(), "demo", "--db", str(db), "--orders", str(ORDERS)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
    )


def _events(db: Path, sql: str) -> int:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        return int(conn.execute(sql).fetchone()[0])


def _summary(out: str) -> dict[str, str]:
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("│┃").split("│")]
        if len(cells) == 2 and cells[1].isdigit():
            rows[cells[0]] = cells[1]
    return rows


@pytest.mark.slow
def test_the_demo_completes_then_resumes_after_sigkill_instead_of_starting_over(tmp_path: Path) -> None:
    db = tmp_path / "demo.db"
    first = _demo(db)
    try:
        _wait_for_progress(first)  # kill it once some orders finished and others are still in flight
        first.send_signal(signal.SIGKILL)
        assert first.wait(timeout=30) == -signal.SIGKILL
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
        for stream in (first.stdout, first.stderr):
            if stream is not None:
                stream.close()
    started_before = _events(
        db,
        "SELECT count(*) FROM events WHERE type = 'WorkflowStarted' AND workflow_id LIKE 'demo-order-%' "
        "AND workflow_id NOT LIKE '%/%'",
    )
    completed_before = _events(db, "SELECT count(*) FROM events WHERE type = 'ActivityCompleted'")
    assert completed_before > 0

    second = _demo(db)
    try:
        out, err = second.communicate(timeout=120)
    finally:
        if second.poll() is None:  # a hang must not outlive the test
            second.kill()
            second.communicate()
    assert second.returncode == 0, err
    assert "Resuming from" in out, out
    summary = _summary(out)
    assert summary.get("shipped") == str(ORDERS - DECLINED), out
    assert summary.get("declined, stock released") == str(DECLINED), out
    assert summary.get("resumed from the database") == str(started_before), out
    assert int(summary["retries (transient failures retried)"]) >= ORDERS // 4
    # Nothing started over: one WorkflowStarted per order (plus one per shipment child),
    # and every step recorded before the kill kept its single record.
    orders_started = _events(
        db,
        "SELECT count(*) FROM events WHERE type = 'WorkflowStarted' AND workflow_id LIKE 'demo-order-%' AND workflow_id NOT LIKE '%/%'",
    )
    assert orders_started == ORDERS
    assert 0 < started_before <= ORDERS
    per_step = _events(
        db,
        "SELECT max(c) FROM (SELECT count(*) AS c FROM events WHERE type = 'ActivityCompleted' "
        "GROUP BY workflow_id, json_extract(data, '$.activity_id'))",
    )
    assert per_step == 1

    third = _demo(db)
    try:
        out, err = third.communicate(timeout=60)
    finally:
        if third.poll() is None:  # a hang must not outlive the test
            third.kill()
            third.communicate()
    assert third.returncode == 0, err
    assert f"{ORDERS} finished" in out


def _wait_for_progress(proc: subprocess.Popen[str]) -> None:
    """Read the demo's plain output until some orders finished and others are in flight."""
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    while True:
        assert time.monotonic() < deadline, "the demo made no progress"
        line = proc.stdout.readline()
        assert line, f"the demo ended early: {proc.stderr.read() if proc.stderr else ''}"
        if line.startswith("progress:"):
            fields = dict(part.split("=") for part in line.split()[1:])
            if int(fields["completed"]) >= 1 and int(fields["running"]) + int(fields["waiting"]) >= 3:
                return


@pytest.mark.slow
def test_ctrl_c_stops_the_demo_with_status_130_and_says_how_to_resume(tmp_path: Path) -> None:
    db = tmp_path / "interrupted.db"
    demo = _demo(db)
    try:
        _wait_for_progress(demo)
        demo.send_signal(signal.SIGINT)
        out, err = demo.communicate(timeout=60)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.communicate()
    assert demo.returncode == 130, err
    assert err == "", err  # no "Error: aborted", no traceback
    assert out.rstrip().splitlines()[-1] == (
        f"Interrupted. Run 'aion-trio demo --db {db}' to resume: every order carries on from its last "
        "recorded step, and nothing that completed runs again."
    )
    again = subprocess.run(
        [_script(), "demo", "--db", str(db)], capture_output=True, text=True, timeout=120, check=False
    )
    assert again.returncode == 0, again.stderr
    assert f"of {ORDERS} orders found" in again.stdout
    assert _summary(again.stdout).get("shipped") == str(ORDERS - DECLINED), again.stdout


def test_a_stored_demo_refuses_another_order_count_and_writes_nothing(tmp_path: Path) -> None:
    db = tmp_path / "planned.db"

    async def plant() -> None:
        # A demo of 5 orders, killed after the first one arrived.
        async with aion.open_engine(
            f"sqlite:///{db}", workflows=[_demo_module.demo_order, _demo_module.demo_shipment]
        ) as engine:
            await engine.start(_demo_module.demo_order, {"n": 1, "of": 5}, workflow_id="demo-order-1")

    trio.run(plant)
    before = _events(db, "SELECT count(*) FROM events")
    result = CliRunner().invoke(_cli.cli, ["demo", "--db", str(db), "--orders", "3"], prog_name="aion-trio")
    assert result.exit_code == 2, result.output
    [line] = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert line.startswith(
        f"Error: {db} holds a demo of 5 orders, not 3: run 'aion-trio demo' without --orders"
    )
    assert "--fresh" in line
    assert _events(db, "SELECT count(*) FROM events") == before
