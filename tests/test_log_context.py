"""Log lines name what they are about: workflow id, run, activity and attempt are in the
message (a plain handler shows them), and stay on the record as extra fields; the
worker logs each workflow run's start and end at info."""

from __future__ import annotations

import logging
import os
import subprocess
import sysconfig
import time
from pathlib import Path

import pytest
import trio
import trio.testing

import aion_trio as aion
from aion_trio._logs import ContextLogger

ROOT = Path(__file__).resolve().parent.parent


@aion.activity(retry=aion.RetryPolicy(max_attempts=3, backoff=aion.Fixed(60.0)))
async def reserve_stock(order: int) -> str:
    if aion.activity_info().attempt == 1:
        raise ConnectionError("inventory service busy")
    return f"reserved {order}"


@aion.workflow(name="stocked_order")
async def stocked_order(ctx: aion.WorkflowContext, order: int) -> str:
    return str(await ctx.run(reserve_stock, order))


async def test_a_retry_line_names_the_workflow_run_activity_and_attempt(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="aion_trio")
    async with aion.open_engine("memory://", workflows=[stocked_order], activities=[reserve_stock]) as engine:
        run = await engine.start(stocked_order, 7, workflow_id="order-7")
        with trio.fail_after(3600):
            assert await run.result() == "reserved 7"
    [retry] = [r for r in caplog.records if "retrying in" in r.getMessage()]
    assert retry.getMessage() == (
        f"workflow 'order-7' run {run.run_id} activity:0 reserve_stock attempt 1 of 3: "
        "failed (ConnectionError: inventory service busy); retrying in 60.000s"
    )
    # The structured fields are still there, for a JSON handler.
    fields = ("workflow_id", "run_id", "activity", "activity_type", "attempt", "max_attempts", "retry_in")
    assert {name: getattr(retry, name) for name in fields} == {
        "workflow_id": "order-7",
        "run_id": run.run_id,
        "activity": 0,
        "activity_type": "reserve_stock",
        "attempt": 1,
        "max_attempts": 3,
        "retry_in": 60.0,
    }


def test_the_context_goes_first_and_a_percent_in_an_id_stays_literal(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = ContextLogger("aion_trio.test_log_context")
    caplog.set_level(logging.INFO, logger="aion_trio.test_log_context")
    log.info("no fields, no prefix: %d%%", 100)
    log.info("formatted %s", "later", extra={"workflow_id": "100%s-sure", "run_id": "r1", "timer": "t:1"})
    log.info("not formatted 50%", extra={"workflow_id": "w%d", "activity": 2})
    assert [r.getMessage() for r in caplog.records] == [
        "no fields, no prefix: 100%",
        "workflow '100%s-sure' run r1 timer t:1: formatted later",
        "workflow 'w%d' activity:2: not formatted 50%",
    ]
    assert caplog.records[1].workflow_id == "100%s-sure"  # type: ignore[attr-defined]


def _script() -> str:
    return str(Path(sysconfig.get_path("scripts")) / "aion-trio")


def _wait_logged(log: Path, text: str, proc: subprocess.Popen[str]) -> list[str]:
    deadline = time.monotonic() + 60
    while True:
        lines = log.read_text(encoding="utf-8").splitlines()
        if any(text in line for line in lines):
            return lines
        assert proc.poll() is None, f"the worker exited ({proc.returncode}): {lines}"
        assert time.monotonic() < deadline, f"the worker never logged {text!r}: {lines}"
        time.sleep(0.05)  # another process writes the log: nothing to wait on but the file


@pytest.mark.slow
def test_the_worker_logs_each_workflow_runs_start_and_end_at_info(tmp_path: Path) -> None:
    db, log = tmp_path / "w.db", tmp_path / "worker.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AION_TRIO_")}
    env.update(AION_TRIO_STORE=str(db), AION_TRIO_MODULE="tests.procs.cli_app:app", PYTHONPATH=str(ROOT))
    with log.open("w", encoding="utf-8") as stderr:
        worker = subprocess.Popen(
            [_script(), "worker", "tests.procs.cli_app:app"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            text=True,
        )
    try:
        _wait_logged(log, "ready: serving", worker)
        started = subprocess.run(
            [_script(), "start", "hello", '"ann"', "--id", "greeting"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert started.returncode == 0, started.stderr
        assert "queued for the running worker" in started.stderr, "control: the worker ran it"
        lines = _wait_logged(log, "hello ended", worker)
    finally:
        worker.terminate()
        worker.wait(timeout=60)
    [start] = [line for line in lines if "hello started" in line]
    [end] = [line for line in lines if "hello ended" in line]
    assert " INFO aion_trio.worker: workflow 'greeting' run " in start, start
    assert start.endswith(": hello started"), start
    assert " INFO aion_trio.worker: workflow 'greeting' run " in end, end
    assert end.endswith(": hello ended completed"), end
