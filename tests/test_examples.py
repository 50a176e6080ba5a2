"""The examples run, and the order example resumes after a SIGKILL instead of starting over."""

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

ROOT = Path(__file__).resolve().parent.parent
ORDERS = ROOT / "examples" / "orders.py"


def _run(db: Path, orders: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ORDERS), "--db", str(db), "--orders", str(orders)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_order_example_completes_every_order(tmp_path: Path) -> None:
    result = _run(tmp_path / "orders.db", 30)
    assert result.returncode == 0, result.stderr
    # Orders whose amount is over 900 are declined and compensated; the rest ship.
    declined = sum(1 for i in range(30) if 100 + (i * 37) % 1000 > 900)
    assert "30 orders in" in result.stdout
    assert f"declined {declined}, shipped {30 - declined}" in result.stdout


@pytest.mark.slow
def test_the_order_example_resumes_after_sigkill(tmp_path: Path) -> None:
    db = tmp_path / "orders.db"
    proc = subprocess.Popen(
        [sys.executable, str(ORDERS), "--db", str(db), "--orders", "100"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        # Kill it once some orders have started their durable timer, before all finished.
        while True:
            assert proc.poll() is None, "the example finished before it could be killed"
            assert time.monotonic() < deadline
            if db.exists():
                try:
                    with contextlib.closing(sqlite3.connect(db)) as conn:
                        timers = conn.execute(
                            "SELECT count(*) FROM events WHERE type = 'TimerStarted'"
                        ).fetchone()[0]
                except sqlite3.OperationalError:
                    timers = 0
                if timers >= 10:
                    break
            time.sleep(0.01)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    rerun = _run(db, 100)
    assert rerun.returncode == 0, rerun.stderr
    assert "resuming" in rerun.stdout, rerun.stdout
    declined = sum(1 for i in range(100) if 100 + (i * 37) % 1000 > 900)
    assert f"declined {declined}, shipped {100 - declined}" in rerun.stdout
    with contextlib.closing(sqlite3.connect(db)) as conn:
        shipped = conn.execute(
            "SELECT count(*) FROM events WHERE type = 'ActivityCompleted' AND data LIKE '%shipment-%'"
        ).fetchone()[0]
    assert shipped == 100 - declined, "each order shipped exactly once"
