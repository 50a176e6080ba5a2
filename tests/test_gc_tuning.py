"""The cycle collector while engines are open (issue 22): ``EngineConfig.gc_thresholds`` and ``gc_freeze``.

Python's collector is process-wide: an engine sets its thresholds while it is
open and the last engine to close restores the process's own; ``gc_freeze``
freezes the heap at start-up (or after recovery) and the last engine to close
thaws it.  Garbage made while the engine runs is still collected.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

import aion_trio as aion


@pytest.fixture(autouse=True)
def process_collector() -> Iterator[None]:
    """Each test starts from Python's defaults, nothing frozen, and leaves them so."""
    saved = gc.get_threshold()
    gc.unfreeze()
    gc.set_threshold(700, 10, 10)
    yield
    gc.unfreeze()
    gc.set_threshold(*saved)


@aion.workflow(name="gc_parked")
async def parked(ctx: aion.WorkflowContext) -> None:
    await ctx.sleep(timedelta(days=30))


@aion.workflow(name="gc_quick")
async def quick(ctx: aion.WorkflowContext) -> str:
    return "done"


async def test_the_thresholds_hold_while_the_engine_is_open_and_are_restored_at_close() -> None:
    config = aion.EngineConfig(gc_thresholds=(12_345, 6, 78), gc_freeze=None)
    async with aion.open_engine("memory://", workflows=[quick], config=config) as engine:
        assert gc.get_threshold() == (12_345, 6, 78)
        assert await (await engine.start(quick, workflow_id="q")).result() == "done"
    assert gc.get_threshold() == (700, 10, 10)


async def test_the_default_config_tunes_the_collector_and_none_leaves_it_alone() -> None:
    async with aion.open_engine("memory://", workflows=[quick]):
        assert gc.get_threshold() == aion.EngineConfig().gc_thresholds
        assert gc.get_freeze_count() > 0
    assert gc.get_threshold() == (700, 10, 10)
    assert gc.get_freeze_count() == 0
    untouched = aion.EngineConfig(gc_thresholds=None, gc_freeze=None)
    async with aion.open_engine("memory://", workflows=[quick], config=untouched):
        assert gc.get_threshold() == (700, 10, 10)
        assert gc.get_freeze_count() == 0


async def test_engines_open_together_restore_the_thresholds_when_the_last_one_closes() -> None:
    config = aion.EngineConfig(gc_thresholds=(20_000, 10, 50), gc_freeze="startup")
    async with aion.open_engine("memory://", workflows=[quick], config=config):
        async with aion.open_engine("memory://", workflows=[quick], config=config):
            assert gc.get_threshold() == (20_000, 10, 50)
        # The inner engine closed, the outer one still runs: still tuned, still frozen.
        assert gc.get_threshold() == (20_000, 10, 50)
        assert gc.get_freeze_count() > 0
    assert gc.get_threshold() == (700, 10, 10)
    assert gc.get_freeze_count() == 0


async def test_thresholds_changed_by_someone_else_while_open_are_left_as_they_are() -> None:
    config = aion.EngineConfig(gc_thresholds=(20_000, 10, 50), gc_freeze=None)
    async with aion.open_engine("memory://", workflows=[quick], config=config):
        gc.set_threshold(3_000, 5, 5)
    assert gc.get_threshold() == (3_000, 5, 5)


async def test_garbage_cycles_made_while_the_engine_runs_are_still_collected() -> None:
    class Node:
        other: object = None

    async with aion.open_engine("memory://", workflows=[quick]) as engine:
        assert gc.get_freeze_count() > 0
        assert await (await engine.start(quick, workflow_id="q")).result() == "done"
        a, b = Node(), Node()
        a.other, b.other = b, a
        gone = weakref.ref(a)
        del a, b
        gc.collect()
        assert gone() is None


async def test_recovered_freezes_the_runs_recovery_brought_back_startup_does_not(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'gc.db'}"
    untouched = aion.EngineConfig(gc_thresholds=None, gc_freeze=None)
    async with aion.open_engine(url, workflows=[parked], config=untouched) as engine:
        for i in range(50):
            await engine.start(parked, workflow_id=f"p-{i}")
    counts = {}
    for point in ("startup", "recovered", "startup", "recovered"):
        # Eager recovery: the runs are resident when open_engine returns, so "recovered"
        # freezes them (lazy recovery replays them later, after the freeze).
        config = aion.EngineConfig(gc_thresholds=None, gc_freeze=point, lazy_recovery=False)
        async with aion.open_engine(url, workflows=[parked], config=config) as engine:
            counts[point] = gc.get_freeze_count()
            assert engine.statistics().resident_runs == 50
        assert gc.get_freeze_count() == 0
    # Each recovered run holds well over 50 objects (its task, coroutine, context, recorder...).
    assert counts["recovered"] - counts["startup"] > 50 * 50


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("gc_thresholds", (0, 10, 10)),
        ("gc_thresholds", (700, 10)),
        ("gc_thresholds", (700, -1, 10)),
        ("gc_thresholds", (700, 10, 1.5)),
        ("gc_thresholds", [700, 10, 10]),
        ("gc_freeze", "always"),
    ],
)
def test_bad_collector_settings_are_refused_with_a_message(setting: str, value: object) -> None:
    with pytest.raises(ValueError, match=setting):
        aion.EngineConfig(**{setting: value})  # type: ignore[arg-type]
