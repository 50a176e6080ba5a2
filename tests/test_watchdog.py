"""A blocked Trio loop is noticed and named (issue 14, item 6).

An ``async def`` activity or workflow code that blocks the Trio thread stalls
every run.  A watchdog thread (``EngineConfig.loop_stall_warning``) logs which
activity or workflow holds the loop, where, and for how long.  These tests
block the real loop (``time.sleep``) on Trio's real clock.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import trio

import aion_trio as aion
from aion_trio._watchdog import LoopWatchdog


@aion.activity
async def blocks_loop() -> str:
    time.sleep(0.8)  # noqa: ASYNC251 - the mistake: a blocking call in an async def activity
    return "done"


@aion.workflow
async def runs_blocker(ctx: aion.WorkflowContext) -> str:
    return str(await ctx.run(blocks_loop))


@aion.workflow
async def blocks_itself(ctx: aion.WorkflowContext) -> str:
    time.sleep(0.8)  # noqa: ASYNC251 - the same mistake in workflow code
    return "done"


class _Watch(logging.Handler):
    """The watchdog's messages; :meth:`wait` (run in a thread) returns once one holds ``substring``."""

    def __init__(self, substring: str) -> None:
        super().__init__(level=logging.WARNING)
        self.substring = substring
        self.messages: list[str] = []
        self._seen = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
        if self.substring in record.getMessage():
            self._seen.set()

    def wait(self) -> list[str]:
        assert self._seen.wait(10), f"no watchdog message with {self.substring!r}: {self.messages}"
        return self.messages


@contextmanager
def _logged(substring: str) -> Iterator[_Watch]:
    watch = _Watch(substring)
    watchdog_logger = logging.getLogger("aion_trio.watchdog")
    watchdog_logger.addHandler(watch)
    try:
        yield watch
    finally:
        watchdog_logger.removeHandler(watch)


def _blocked_seconds(messages: list[str]) -> float:
    ended = [m for m in messages if "was blocked for" in m]
    assert len(ended) == 1, messages
    found = re.search(r"blocked for ([0-9.]+)s", ended[0])
    assert found is not None
    return float(found.group(1))


async def test_an_async_activity_blocking_the_loop_is_named_with_how_long(
    store_url: Callable[[], str],
) -> None:
    with _logged("in all by activity:0") as watch:
        with trio.fail_after(20):
            async with aion.open_engine(
                store_url(),
                workflows=[runs_blocker],
                activities=[blocks_loop],
                config=aion.EngineConfig(loop_stall_warning=0.2),
            ) as engine:
                run = await engine.start(runs_blocker, workflow_id="sleeper")
                assert await run.result() == "done"
                messages = await trio.to_thread.run_sync(watch.wait)
    during = [m for m in messages if "has been blocked for" in m]
    assert len(during) == 1, messages
    assert "activity:0 blocks_loop (attempt 1) of workflow 'sleeper'" in during[0]
    assert "in blocks_loop (" in during[0], "where it is blocked"
    assert "test_watchdog.py" in during[0]
    assert 0.5 <= _blocked_seconds(messages) <= 5


async def test_workflow_code_blocking_the_loop_is_named(store_url: Callable[[], str]) -> None:
    with _logged("in all by workflow 'stubborn'") as watch:
        with trio.fail_after(20):
            async with aion.open_engine(
                store_url(), workflows=[blocks_itself], config=aion.EngineConfig(loop_stall_warning=0.2)
            ) as engine:
                run = await engine.start(blocks_itself, workflow_id="stubborn")
                assert await run.result() == "done"
                messages = await trio.to_thread.run_sync(watch.wait)
    assert any("has been blocked for" in m and "workflow 'stubborn' run" in m for m in messages), messages


async def _short_step() -> None:
    time.sleep(0.02)  # noqa: ASYNC251 - each step is short; fifty in one turn are not


async def test_a_long_turn_of_many_short_steps_is_reported_busy_without_blaming_one() -> None:
    watchdog = LoopWatchdog(0.2)
    with _logged("was busy for") as watch:
        watchdog.start()
        try:
            with trio.fail_after(20):
                async with trio.open_nursery() as nursery:
                    for _ in range(50):  # all runnable at once: one turn of the loop, about 1 s
                        nursery.start_soon(_short_step)
                messages = await trio.to_thread.run_sync(watch.wait)
        finally:
            watchdog.stop()
    assert any("has been busy for" in m and "no single step held it throughout" in m for m in messages), (
        messages
    )
    assert not any("blocked" in m for m in messages), "no step is blamed"


async def test_without_a_threshold_there_is_no_watchdog(store_url: Callable[[], str]) -> None:
    with _logged("blocked") as watch, trio.fail_after(20):
        async with aion.open_engine(
            store_url(), workflows=[blocks_itself], config=aion.EngineConfig(loop_stall_warning=None)
        ) as engine:
            assert not any(t.name == "aion_trio loop watchdog" for t in threading.enumerate())
            run = await engine.start(blocks_itself, workflow_id="unwatched")
            assert await run.result() == "done"
    assert watch.messages == []
    with trio.fail_after(20):
        async with aion.open_engine("memory://", workflows=[blocks_itself]):
            assert any(t.name == "aion_trio loop watchdog" for t in threading.enumerate()), "on by default"
    assert not any(t.name == "aion_trio loop watchdog" for t in threading.enumerate()), "stopped at close"


@pytest.mark.parametrize("bad", [0, -1.0, "1"])
def test_a_bad_threshold_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="loop_stall_warning must be"):
        aion.EngineConfig(loop_stall_warning=bad)  # type: ignore[arg-type]
