"""Recording a run's own commands (``aion_trio._engine.steps``): a transient store fault is
retried by the engine's one retry primitive (the completion_retry ladder, its observer
records) until the append lands, the retry after an append of unknown outcome finds what
landed, and a closing engine stops the retry and parks the run with nothing recorded.

Driven through a FlakyStoreBundle on Trio's mock clock: backoffs cost no real time.
"""

from __future__ import annotations

from collections.abc import Callable

import trio
import trio.testing

import aion_trio as aion
from aion_trio.testing import FlakyStoreBundle

LADDER = aion.CompletionRetryConfig(initial=1.0, ceiling=8.0)
WHAT = "record workflow commands"


@aion.activity
async def double(n: int) -> int:
    return 2 * n


@aion.workflow
async def one_step(ctx: aion.WorkflowContext, n: int) -> int:
    await ctx.sleep(1)  # a timer: its TimerStarted is always appended at once
    return await ctx.run(double, n)


def command_retries(seen: list[aion.ObserverEvent]) -> list[tuple[str, int, float | None]]:
    return [
        (e.outcome, e.attempts, e.delay)
        for e in seen
        if isinstance(e, aion.TransientRetry) and e.what == WHAT
    ]


async def test_a_command_append_that_fails_transiently_is_retried_along_the_ladder(
    autojump_clock: trio.testing.MockClock, store_url: Callable[[], str]
) -> None:
    """The run's first command append (its TimerStarted) fails three times: it is retried
    after 1, 2 and 4 s (the completion_retry ladder, doubling) through the one retry
    primitive, whose observer records say so, and lands once."""
    seen: list[aion.ObserverEvent] = []
    config = aion.EngineConfig(completion_retry=LADDER)
    async with aion.open_store(store_url()) as inner:
        flaky = FlakyStoreBundle(inner)
        async with aion.open_engine(
            flaky, workflows=[one_step], activities=[double], config=config, observers=[seen.append]
        ) as engine:
            flaky.events.fail_appends_after(1, 3)  # the start lands; the command append fails 3 times
            start = trio.current_time()
            run = await engine.start(one_step, 21, workflow_id="flaky-step")
            with trio.fail_after(60):
                assert await run.result() == 42
            took = trio.current_time() - start
        history = await inner.events.read_history("flaky-step")
    assert flaky.events.faults["append"] == 3, "control: the command append really failed"
    assert 7 <= took < 8  # 1 + 2 + 4 s of backoff; the timer is then already due
    assert [e.type for e in history] == [
        "WorkflowStarted",
        "TimerStarted",
        "TimerFired",
        "ActivityScheduled",
        "ActivityStarted",
        "ActivityCompleted",
        "WorkflowCompleted",
    ]
    assert command_retries(seen) == [
        ("retrying", 0, 1.0),
        ("retrying", 1, 2.0),
        ("retrying", 2, 4.0),
        ("recovered", 3, None),
    ]


async def test_a_command_append_whose_acknowledgement_was_lost_is_not_written_twice(
    autojump_clock: trio.testing.MockClock, store_url: Callable[[], str]
) -> None:
    """The command append lands but reports a transient failure: the retry re-reads the
    history, finds its own batch and records nothing more."""
    config = aion.EngineConfig(completion_retry=LADDER)
    async with aion.open_store(store_url()) as inner:
        flaky = FlakyStoreBundle(inner)
        async with aion.open_engine(
            flaky, workflows=[one_step], activities=[double], config=config
        ) as engine:
            flaky.events.commit_then_fail_appends_after(1, 1)
            run = await engine.start(one_step, 21, workflow_id="lost-ack-step")
            with trio.fail_after(60):
                assert await run.result() == 42
        history = await inner.events.read_history("lost-ack-step")
    assert flaky.events.faults["append"] == 1, "control: the acknowledgement really was lost"
    assert [e.type for e in history] == [
        "WorkflowStarted",
        "TimerStarted",
        "TimerFired",
        "ActivityScheduled",
        "ActivityStarted",
        "ActivityCompleted",
        "WorkflowCompleted",
    ]


async def test_a_closing_engine_stops_the_retry_and_parks_the_run(
    autojump_clock: trio.testing.MockClock, store_url: Callable[[], str]
) -> None:
    """The store stays down: the append is retried until the engine closes, which stops the
    retry; the run is parked with nothing recorded, and the next engine runs it."""
    seen: list[aion.ObserverEvent] = []
    config = aion.EngineConfig(completion_retry=LADDER)
    url = store_url()
    async with aion.open_store(url) as inner:
        flaky = FlakyStoreBundle(inner)
        with trio.fail_after(60):
            async with aion.open_engine(
                flaky, workflows=[one_step], activities=[double], config=config, observers=[seen.append]
            ) as engine:
                flaky.events.fail_appends_after(1, 1000)
                await engine.start(one_step, 21, workflow_id="parked-step")
                await trio.sleep(10)  # failed at 0, retried at 1, 3 and 7 s
        assert [e.type for e in await inner.events.read_history("parked-step")] == ["WorkflowStarted"]
        assert [outcome for outcome, _, _ in command_retries(seen)] == ["retrying"] * 4
        async with aion.open_engine(inner, workflows=[one_step], activities=[double]) as engine:
            with trio.fail_after(60):
                assert await engine.result("parked-step") == 42
