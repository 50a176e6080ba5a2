"""Heartbeat details: an activity attempt's last ``heartbeat(details)`` reaches the next
attempt as ``activity_info().heartbeat_details``, so a long job resumes its progress.

The scenario of Temporal's heartbeat-details tests, carried over: an attempt
reports progress and fails, the retry starts from the reported progress.  The
details are recorded (a ``heartbeat:N`` marker, throttled), so an engine that
restarts mid-retry still hands them over.  Every test runs on the store
``AION_TRIO_TEST_STORE`` names.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import trio
import trio.testing

import aion_trio as aion

LIMIT = 3600  # mock seconds: every wait below is bounded by this
SEEN: list[Any] = []


@aion.activity(retry=aion.RetryPolicy(max_attempts=3, backoff=aion.Fixed(1)))
async def count_on() -> int:
    """Counts two steps per attempt from where the last attempt got; the first two crash."""
    start = aion.activity_info().heartbeat_details or 0
    SEEN.append(start)
    aion.heartbeat(start + 1)
    aion.heartbeat(start + 2)
    if aion.activity_info().attempt < 3:
        raise RuntimeError(f"crashed at {start + 2}")
    return start


@aion.activity(retry=aion.RetryPolicy(max_attempts=2, backoff=aion.Fixed(1)))
def count_in_a_thread() -> int:
    start = aion.activity_info().heartbeat_details or 0
    SEEN.append(start)
    aion.heartbeat(start + 5)
    if start == 0:
        raise RuntimeError("crashed after 5")
    return start


@aion.workflow
async def counter(ctx: aion.WorkflowContext, name: str) -> Any:
    return await ctx.run(name)


def _heartbeats(history: Sequence[aion.Event]) -> list[Any]:
    return [
        e.body.value.value()
        for e in history
        if isinstance(e.body, aion.MarkerRecorded) and e.body.name.startswith("heartbeat:")
    ]


async def test_the_next_attempt_gets_the_last_heartbeat_details(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    SEEN.clear()
    async with aion.open_engine(
        store_url(), workflows=[counter], activities=[count_on, count_in_a_thread]
    ) as engine:
        run = await engine.start(counter, "count_on", workflow_id="c")
        with trio.fail_after(LIMIT):
            assert await run.result() == 4
        assert SEEN == [0, 2, 4], "each attempt went on from the last one's progress"
        recorded = _heartbeats(await engine.history("c"))
        assert recorded[:2] == [{"attempt": 1, "details": 2}, {"attempt": 2, "details": 4}], (
            "each failed attempt's last beat is recorded, once (the beats came within the interval)"
        )
        SEEN.clear()
        threaded = await engine.start(counter, "count_in_a_thread", workflow_id="t")
        with trio.fail_after(LIMIT):
            assert await threaded.result() == 5
        assert SEEN == [0, 5]


@aion.activity(retry=aion.RetryPolicy(max_attempts=2, backoff=aion.Fixed(600)))
async def resumable() -> int:
    start = aion.activity_info().heartbeat_details or 0
    SEEN.append(start)
    aion.heartbeat(start + 7)
    if aion.activity_info().attempt == 1:
        raise RuntimeError("crashed at 7")
    return start


async def test_an_engine_restarted_mid_retry_hands_over_the_recorded_details(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    SEEN.clear()
    url = store_url()
    async with aion.open_engine(url, workflows=[counter], activities=[resumable]) as engine:
        await engine.start(counter, "resumable", workflow_id="r")
        with trio.fail_after(LIMIT):
            history = await engine.history("r")
            while not any(isinstance(e.body, aion.ActivityFailed) for e in history):
                await trio.testing.wait_all_tasks_blocked()
                history = await engine.history("r")
        assert _heartbeats(history) == [{"attempt": 1, "details": 7}], (
            "the attempt's last details were recorded before its failure"
        )
    assert SEEN == [0]
    async with aion.open_engine(url, workflows=[counter], activities=[resumable]) as engine:
        with trio.fail_after(LIMIT):
            assert await engine.result("r") == 7, "the new engine's attempt went on from the record"
    assert SEEN == [0, 7]
