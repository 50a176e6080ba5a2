"""The one retry of a transient store fault (``aion_trio._transient``): its ladder, its
loudness (an outage stated once, restated rarely, its end said once), its observer
records, and its give-up (the epoch closed, or the caller's own reason).

Driven directly, on Trio's mock clock, with an attempt that fails a given number
of times: every path of the engine that retries a ``BackendUnavailable`` goes
through this, so these tests pin what they all do.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import AsyncIterator

import pytest
import trio
import trio.testing

import aion_trio as aion
from aion_trio._epoch import EngineEpoch
from aion_trio._logs import ContextLogger
from aion_trio._observe import ObserverHub
from aion_trio._transient import CompletionRetryConfig, RetryAbandoned, Transient

LOGGER = "aion_trio.test_transient"
log = ContextLogger(LOGGER)


class Failing:
    """An attempt failing ``n`` times with ``BackendUnavailable``, then returning ``"done"``;
    records the Trio time of every call."""

    def __init__(self, n: int) -> None:
        self.left = n
        self.calls: list[float] = []

    async def __call__(self) -> str:
        self.calls.append(trio.current_time())
        await trio.lowlevel.checkpoint()
        if self.left:
            self.left -= 1
            raise aion.BackendUnavailable("injected: the store is down")
        return "done"


def gaps(times: list[float]) -> list[float]:
    return [round(b - a, 6) for a, b in itertools.pairwise(times)]


def warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def infos(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.INFO]


@pytest.fixture
async def epoch() -> AsyncIterator[EngineEpoch]:
    async with trio.open_nursery() as nursery:
        yield EngineEpoch(nursery)
        nursery.cancel_scope.cancel()


async def test_the_retries_follow_the_ladder_doubling_to_its_ceiling(
    autojump_clock: trio.testing.MockClock,
) -> None:
    attempt = Failing(6)
    transient = Transient(CompletionRetryConfig(initial=0.5, ceiling=4.0))
    assert await transient.call("write a thing", attempt, log) == "done"
    assert gaps(attempt.calls) == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]


async def test_an_attempt_that_does_not_fail_is_neither_delayed_nor_logged_nor_observed(
    caplog: pytest.LogCaptureFixture, autojump_clock: trio.testing.MockClock
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    seen: list[aion.ObserverEvent] = []
    transient = Transient(CompletionRetryConfig(), observers=ObserverHub([("seen", seen.append)]))
    start = trio.current_time()
    assert await transient.call("write a thing", Failing(0), log) == "done"
    assert trio.current_time() == start
    assert [r for r in caplog.records if r.name == LOGGER] == []
    assert seen == []


async def test_an_outage_is_stated_once_restated_on_doublings_and_its_end_said_once(
    caplog: pytest.LogCaptureFixture, autojump_clock: trio.testing.MockClock
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    transient = Transient(CompletionRetryConfig(initial=0.01, ceiling=1000.0))
    await transient.call("write a thing", Failing(10), log, {"workflow_id": "wf-1"})
    stated = warnings(caplog)
    # The failure that began the outage, then the retries at 1, 2, 4 and 8 (of 9 failed).
    assert [r.attempts for r in stated] == [0, 1, 2, 4, 8]  # type: ignore[attr-defined]
    assert stated[0].getMessage() == (
        "workflow 'wf-1': could not write a thing; retrying with backoff: injected: the store is down"
    )
    assert all(r.fault.endswith("BackendUnavailable") for r in stated)  # type: ignore[attr-defined]
    assert all(r.at_ceiling is False for r in stated)  # type: ignore[attr-defined]
    (recovered,) = infos(caplog)
    assert recovered.startswith(
        "workflow 'wf-1': the store answered again: could write a thing after 10 retries"
    )


async def test_at_the_ceiling_every_failed_retry_is_stated(
    caplog: pytest.LogCaptureFixture, autojump_clock: trio.testing.MockClock
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    transient = Transient(CompletionRetryConfig(initial=1.0, ceiling=1.0))
    await transient.call("write a thing", Failing(12), log)
    assert [r.attempts for r in warnings(caplog)] == list(range(12))  # type: ignore[attr-defined]


async def test_a_fault_of_another_type_is_stated_at_once(
    caplog: pytest.LogCaptureFixture, autojump_clock: trio.testing.MockClock
) -> None:
    class Unreachable(aion.BackendUnavailable):
        pass

    caplog.set_level(logging.WARNING, logger=LOGGER)
    faults = [aion.BackendUnavailable("a")] * 3 + [Unreachable("b")]

    async def attempt() -> None:
        await trio.lowlevel.checkpoint()
        if faults:
            raise faults.pop(0)

    await Transient(CompletionRetryConfig(initial=0.01, ceiling=1000.0)).call("write a thing", attempt, log)
    assert [r.attempts for r in warnings(caplog)] == [0, 1, 2, 3]  # type: ignore[attr-defined]
    assert warnings(caplog)[-1].fault.endswith("Unreachable")  # type: ignore[attr-defined]


async def test_observers_see_each_failure_and_the_recovery(autojump_clock: trio.testing.MockClock) -> None:
    seen: list[aion.ObserverEvent] = []
    transient = Transient(
        CompletionRetryConfig(initial=1.0, ceiling=2.0), observers=ObserverHub([("s", seen.append)])
    )
    await transient.call("write a thing", Failing(3), log, {"workflow_id": "wf-1", "run_id": "r-1"})
    assert all(isinstance(e, aion.TransientRetry) for e in seen)
    assert [(e.outcome, e.attempts, e.delay) for e in seen] == [  # type: ignore[attr-defined]
        ("retrying", 0, 1.0),
        ("retrying", 1, 2.0),
        ("retrying", 2, 2.0),
        ("recovered", 3, None),
    ]
    assert [e.seconds for e in seen] == [0.0, 1.0, 3.0, 5.0]  # type: ignore[attr-defined]
    assert {(e.what, e.workflow_id, e.run_id) for e in seen} == {("write a thing", "wf-1", "r-1")}  # type: ignore[attr-defined]


async def test_a_closed_epoch_ends_the_retry_before_its_next_attempt(
    epoch: EngineEpoch, caplog: pytest.LogCaptureFixture, autojump_clock: trio.testing.MockClock
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    seen: list[aion.ObserverEvent] = []
    transient = Transient(
        CompletionRetryConfig(initial=1.0, ceiling=1.0), epoch, ObserverHub([("s", seen.append)])
    )
    attempt = Failing(1000)
    with trio.fail_after(100):
        async with trio.open_nursery() as nursery:

            async def close_soon() -> None:
                await trio.sleep(2.5)
                epoch.begin_close()

            nursery.start_soon(close_soon)
            with pytest.raises(aion.EngineEpochClosed):
                await transient.call("write a thing", attempt, log, {"workflow_id": "wf-1"})
    assert len(attempt.calls) == 3, "attempts at 0, 1 and 2; none after the close at 2.5"
    assert trio.current_time() == 3.0
    assert infos(caplog) == [
        "workflow 'wf-1': stopped retrying to write a thing after 2 retries: the engine is shutting down; "
        "the next engine's recovery redoes it"
    ]
    assert seen[-1].outcome == "gave_up"  # type: ignore[attr-defined]


async def test_the_callers_stop_hook_ends_the_retry_with_its_reason(
    caplog: pytest.LogCaptureFixture, autojump_clock: trio.testing.MockClock
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    attempt = Failing(1000)

    def stop() -> str | None:
        return "relinquished" if len(attempt.calls) >= 4 else None

    retry = Transient(CompletionRetryConfig(initial=1.0, ceiling=1.0)).retrying("write a thing", log)
    with pytest.raises(RetryAbandoned) as info:
        await retry.run(attempt, stop=stop)
    assert info.value.reason == "relinquished"
    assert len(attempt.calls) == 4
    assert retry.attempts == 3
    assert infos(caplog) == ["stopped retrying to write a thing after 3 retries: relinquished"]


async def test_a_retry_after_a_failure_starts_with_the_backoff_and_need_not_restate_it(
    caplog: pytest.LogCaptureFixture, autojump_clock: trio.testing.MockClock
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    attempt = Failing(1)
    retry = Transient(CompletionRetryConfig(initial=3.0, ceiling=30.0)).retrying("write a thing", log)
    await retry.run(attempt, after=aion.BackendUnavailable("earlier"), reported=True)
    assert attempt.calls == [3.0, 9.0]
    assert [r.attempts for r in warnings(caplog)] == [1]  # type: ignore[attr-defined]


async def test_any_other_error_propagates_at_once(autojump_clock: trio.testing.MockClock) -> None:
    calls = 0

    async def attempt() -> None:
        nonlocal calls
        calls += 1
        await trio.lowlevel.checkpoint()
        raise aion.SequenceConflict("wf-1", 3, 4)

    with pytest.raises(aion.SequenceConflict):
        await Transient(CompletionRetryConfig()).call("write a thing", attempt, log)
    assert calls == 1


async def test_a_background_retry_lands_while_the_caller_goes_on(
    epoch: EngineEpoch, caplog: pytest.LogCaptureFixture, autojump_clock: trio.testing.MockClock
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    attempt = Failing(2)
    transient = Transient(CompletionRetryConfig(initial=1.0, ceiling=1.0), epoch)
    await transient.now_or_in_background("write a thing", attempt, log, {"workflow_id": "wf-1"})
    assert trio.current_time() == 0.0, "the caller did not wait for the retry"
    assert attempt.calls == [0.0]
    await trio.sleep(5)  # mock time: the retry's two backoffs are long over
    await trio.testing.wait_all_tasks_blocked()
    assert attempt.calls == [0.0, 1.0, 2.0]
    assert [r.attempts for r in warnings(caplog)] == [0, 1]  # type: ignore[attr-defined]
    assert infos(caplog)[-1].startswith(
        "workflow 'wf-1': the store answered again: could write a thing after 2"
    )
