"""Workflows and activities for test_pg_tasks.py.

The activities run in ``aion-trio worker --activities-only`` subprocesses (and
in-process workers); each reports the process and attempt that ran it, so the
tests can tell where and how often it ran.  Files under the directory a
workflow passes in are how an activity tells the test it started or stopped.
"""

from __future__ import annotations

import os
import types
from pathlib import Path
from typing import Any

import trio

import aion_trio as aion

QUEUE = "remote"
FALLBACK = "remote-b"


def _where() -> dict[str, Any]:
    info = aion.activity_info()
    return {"pid": os.getpid(), "attempt": info.attempt, "queue": info.task_queue}


@aion.activity
async def echo(value: Any) -> dict[str, Any]:
    return {"value": value, **_where()}


@aion.activity
def echo_in_thread(value: Any) -> dict[str, Any]:
    return {"value": value, **_where()}


@aion.activity
async def flaky(failures: int) -> dict[str, Any]:
    if aion.activity_info().attempt <= failures:
        raise RuntimeError(f"flaky failure {aion.activity_info().attempt}")
    return _where()


@aion.activity
async def slow_first() -> dict[str, Any]:
    if aion.activity_info().attempt == 1:
        await trio.sleep(60)
    return _where()


@aion.activity
async def silent_first() -> dict[str, Any]:
    if aion.activity_info().attempt == 1:
        await trio.sleep(60)  # no heartbeat: the heartbeat timeout stops it
    aion.heartbeat({"step": 1})
    return _where()


@aion.activity
async def terminal() -> None:
    raise aion.TerminalError("card declined")


@aion.activity
async def refuse_on_primary() -> dict[str, Any]:
    if aion.activity_info().task_queue == QUEUE:
        raise aion.PolicyRefused("quota exhausted on the primary queue")
    return _where()


@aion.activity
async def mark_and_wait(directory: str, tag: str) -> dict[str, Any]:
    """First run: mark ``started`` and wait (to be killed or cancelled); a re-run returns."""
    base = Path(directory)
    started = base / f"{tag}.started"
    if started.exists():
        return _where()
    started.write_text(str(os.getpid()))
    try:
        await trio.sleep_forever()
    finally:
        (base / f"{tag}.stopped").write_text(str(os.getpid()))
    raise AssertionError("unreachable")  # pragma: no cover


@aion.activity
async def record_run(directory: str, key: str) -> int:
    """Create ``key`` exclusively: a second run of the same task would fail here."""
    with (Path(directory) / key).open("x") as out:
        out.write(str(os.getpid()))
    await trio.sleep(0.05)
    return os.getpid()


@aion.activity
async def count_on() -> dict[str, Any]:
    """Counts two steps per attempt from the last attempt's heartbeat details; the first two fail."""
    start = aion.activity_info().heartbeat_details or 0
    aion.heartbeat(start + 1)
    aion.heartbeat(start + 2)
    if aion.activity_info().attempt < 3:
        raise RuntimeError(f"failed at {start + 2}")
    return {"start": start, **_where()}


@aion.activity
async def progress_then_refuse() -> dict[str, Any]:
    """Reports progress 10; refused on the remote queue, so the next attempt runs on the fallback."""
    start = aion.activity_info().heartbeat_details or 0
    aion.heartbeat(start + 10)
    if aion.activity_info().task_queue == QUEUE:
        raise aion.PolicyRefused("not here")
    return {"start": start, **_where()}


@aion.activity
async def goes_async() -> None:
    aion.complete_async()


@aion.activity
async def wait_for_go(directory: str, tag: str) -> dict[str, Any]:
    """Mark ``started``, then wait until the test creates ``go``."""
    base = Path(directory)
    (base / f"{tag}.started").write_text(str(os.getpid()))
    while True:
        if (base / f"{tag}.go").exists():
            return _where()
        await trio.sleep(0.02)


FAST = aion.RetryPolicy(max_attempts=4, backoff=aion.Fixed(0.3))
LOCAL = "local"


@aion.workflow
async def run_echo(ctx: aion.WorkflowContext, value: Any) -> Any:
    first = await ctx.run(echo, value, task_queue=QUEUE)
    second = await ctx.run(echo_in_thread, value, task_queue=QUEUE)
    return [first, second]


@aion.workflow
async def run_flaky(ctx: aion.WorkflowContext) -> Any:
    return await ctx.run(flaky, 2, task_queue=QUEUE, retry=FAST)


@aion.workflow
async def run_slow_first(ctx: aion.WorkflowContext) -> Any:
    return await ctx.run(slow_first, task_queue=QUEUE, retry=FAST, timeout=1.0)


@aion.workflow
async def run_silent_first(ctx: aion.WorkflowContext) -> Any:
    return await ctx.run(silent_first, task_queue=QUEUE, retry=FAST, heartbeat_timeout=0.6)


@aion.workflow
async def run_terminal(ctx: aion.WorkflowContext) -> Any:
    try:
        await ctx.run(terminal, task_queue=QUEUE, retry=FAST)
    except aion.ActivityFailure as exc:
        return ["failed", exc.type, exc.message]
    return ["completed"]  # pragma: no cover


@aion.workflow
async def run_fallback(ctx: aion.WorkflowContext) -> Any:
    return await ctx.run(refuse_on_primary, task_queue=QUEUE, retry=FAST, fallback_queues=[FALLBACK])


@aion.workflow
async def run_count_on(ctx: aion.WorkflowContext) -> Any:
    return await ctx.run(count_on, task_queue=QUEUE, retry=FAST)


@aion.workflow
async def run_progress_then_local(ctx: aion.WorkflowContext) -> Any:
    return await ctx.run(progress_then_refuse, task_queue=QUEUE, retry=FAST, fallback_queues=[LOCAL])


@aion.workflow
async def run_goes_async(ctx: aion.WorkflowContext) -> Any:
    try:
        await ctx.run(goes_async, task_queue=QUEUE, retry=FAST)
    except aion.ActivityFailure as exc:
        return [exc.type, exc.message]
    return ["completed"]  # pragma: no cover


@aion.workflow
async def run_mark_and_wait(ctx: aion.WorkflowContext, directory: str, tag: str) -> Any:
    return await ctx.run(mark_and_wait, directory, tag, task_queue=QUEUE)


@aion.workflow
async def run_records(ctx: aion.WorkflowContext, directory: str, count: int) -> Any:
    handles = [
        ctx.start(record_run, directory, f"{ctx.workflow_id}-{i}", task_queue=QUEUE) for i in range(count)
    ]
    return [await h for h in handles]


@aion.workflow
async def run_gated(ctx: aion.WorkflowContext, directory: str, tag: str) -> Any:
    handle = ctx.start(wait_for_go, directory, tag, task_queue=QUEUE)
    note = await ctx.wait_signal("note")
    return [note, await handle]


app = types.SimpleNamespace(
    workflows=[
        run_echo,
        run_flaky,
        run_slow_first,
        run_silent_first,
        run_terminal,
        run_fallback,
        run_mark_and_wait,
        run_records,
        run_count_on,
        run_progress_then_local,
        run_goes_async,
        run_gated,
    ],
    activities=[
        echo,
        echo_in_thread,
        flaky,
        slow_first,
        silent_first,
        terminal,
        refuse_on_primary,
        mark_and_wait,
        record_run,
        count_on,
        progress_then_refuse,
        goes_async,
        wait_for_go,
    ],
)
