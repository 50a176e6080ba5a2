"""The recorder's lock helper ``hold()``: the hot path's way to take the lock."""

from __future__ import annotations

import pytest
import trio
import trio.testing

import aion_trio as aion
from aion_trio._clock import TrioClock
from aion_trio._epoch import EngineEpoch
from aion_trio._recorder import Recorder


async def _recorder(store: aion.Store, nursery: trio.Nursery) -> Recorder:
    return Recorder("w", store.events, EngineEpoch(nursery), TrioClock.start())


async def test_hold_takes_a_free_lock_and_releases_it_on_exit_and_on_error() -> None:
    async with aion.open_store("memory://") as store, trio.open_nursery() as nursery:
        recorder = await _recorder(store, nursery)
        async with recorder.hold():
            assert recorder.lock.statistics().owner is trio.lowlevel.current_task()
        assert not recorder.lock.locked()
        with pytest.raises(ValueError, match="inside"):
            async with recorder.hold():
                raise ValueError("inside")
        assert not recorder.lock.locked()


async def test_hold_waits_for_a_busy_lock() -> None:
    async with aion.open_store("memory://") as store, trio.open_nursery() as nursery:
        recorder = await _recorder(store, nursery)
        order: list[str] = []

        async def second() -> None:
            async with recorder.hold():
                order.append("second")

        async with recorder.hold():
            nursery.start_soon(second)
            await trio.testing.wait_all_tasks_blocked()
            assert recorder.lock.statistics().tasks_waiting == 1, "control: the second waits"
            order.append("first")
        await trio.testing.wait_all_tasks_blocked()
        assert order == ["first", "second"]


async def test_a_cancelled_caller_raises_at_hold_even_if_the_lock_is_free() -> None:
    async with aion.open_store("memory://") as store, trio.open_nursery() as nursery:
        recorder = await _recorder(store, nursery)
        entered = False
        with trio.CancelScope() as scope:
            scope.cancel()
            async with recorder.hold():
                entered = True
        assert scope.cancelled_caught
        assert not entered
        assert not recorder.lock.locked()


async def test_a_recorder_checks_its_workflow_id_once_when_made() -> None:
    # Its batches carry the id unchecked (make_batch(checked_id=True)): a bad id is refused here.
    async with aion.open_store("memory://") as store, trio.open_nursery() as nursery:
        with pytest.raises(ValueError, match="workflow_id must not be empty"):
            Recorder("", store.events, EngineEpoch(nursery), TrioClock.start())
        with pytest.raises(TypeError, match="workflow_id must be str"):
            Recorder(7, store.events, EngineEpoch(nursery), TrioClock.start())  # type: ignore[arg-type]
        assert (await _recorder(store, nursery)).workflow_id == "w"
