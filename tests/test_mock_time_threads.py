"""Mock time stands still while a thread call is in flight (issue 14, item 14).

Under ``MockClock(autojump_threshold=0)`` the clock jumps whenever every task
is blocked, and a task waiting for a thread counts as blocked.  Every thread
hop of the engine and of the stores runs under ``hold_mock_time()``, so a
plain ``def`` activity or a store call that takes real time takes no mock
time.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path

import apsw
import trio
import trio.testing

import aion_trio as aion
from aion_trio.plugin import hold_mock_time


@aion.activity(timeout=timedelta(hours=1))
def crunch() -> str:
    time.sleep(0.2)  # real work in the thread
    return "crunched"


@aion.workflow
async def crunching(ctx: aion.WorkflowContext) -> str:
    return str(await ctx.run(crunch))


async def test_a_thread_activity_doing_real_work_under_a_long_timeout_does_not_time_out(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    with trio.fail_after(30):
        async with aion.open_engine(store_url(), workflows=[crunching], activities=[crunch]) as engine:
            began = trio.current_time()
            run = await engine.start(crunching, workflow_id="crunch")
            assert await run.result() == "crunched"
            assert trio.current_time() - began < 60, "mock time passed while the thread ran"
    assert autojump_clock.autojump_threshold == 0, "autojump is restored"


T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def _marker(workflow_id: str) -> list[aion.Event]:
    return [
        aion.Event(
            workflow_id=workflow_id,
            seq=1,
            recorded_at=T0,
            body=aion.MarkerRecorded(name="m", value=aion.Payload.of(1)),
        )
    ]


async def test_mock_time_stands_still_while_sqlite_writes_wait_for_their_thread(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    path = tmp_path / "held.db"
    async with aion.open_store(f"sqlite:///{path}") as store:
        # Another connection holds the write lock for 0.3 s of real time: the
        # writer thread waits for it (busy timeout) while both appends wait for
        # the thread (one as the listener, one queued).
        foreign = apsw.Connection(str(path))
        foreign.execute("BEGIN IMMEDIATE")
        release = threading.Timer(0.3, foreign.execute, ("COMMIT",))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.sleep, 3600)  # a deadline autojump would jump to
            began = trio.current_time()
            release.start()
            with trio.fail_after(30):
                async with trio.open_nursery() as appends:
                    appends.start_soon(store.events.append, "a", _marker("a"), 0)
                    appends.start_soon(store.events.append, "b", _marker("b"), 0)
            assert trio.current_time() - began < 1, "mock time passed while the writes waited"
            nursery.cancel_scope.cancel()
        release.join()
        foreign.close()
        assert len(await store.events.read_history("a")) == len(await store.events.read_history("b")) == 1


async def test_holds_nest_and_the_last_one_restores_autojump(autojump_clock: trio.testing.MockClock) -> None:
    outer, inner = hold_mock_time(), hold_mock_time()
    with outer:
        assert autojump_clock.autojump_threshold == math.inf
        with inner:
            assert autojump_clock.autojump_threshold == math.inf
        assert autojump_clock.autojump_threshold == math.inf, "one hold is still in flight"
    assert autojump_clock.autojump_threshold == 0


def test_without_a_mock_clock_a_hold_does_nothing() -> None:
    async def main() -> None:
        with hold_mock_time():
            await trio.to_thread.run_sync(time.sleep, 0)

    trio.run(main)
