"""Replay a finished history in a fresh engine and prove it appends nothing.

``assert_replays_cleanly(events, workflows=..., activities=...)`` writes the
history into a fresh in-memory store behind a wrapper that refuses (and
remembers) every append, opens an engine on it, re-runs the workflow code of
the latest run against that history, and checks that the code reached its end
without issuing a command history does not hold (which would append) and
without being marked stuck (non-determinism).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import attrs
import trio

import aion_trio as aion
from aion_trio._projections import latest_run_id, run_segment
from aion_trio.plugin import EventStore, VisibilityStore


class _NoAppendEvents:
    def __init__(self, inner: EventStore) -> None:
        self._inner = inner
        self.refused: list[list[aion.Event]] = []

    async def append(self, workflow_id: str, events: Sequence[aion.Event], expected_seq: int) -> None:
        self.refused.append(list(events))
        await trio.lowlevel.checkpoint()
        raise aion.SequenceConflict(workflow_id, expected_seq, -1)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _NoAppendStore:
    def __init__(self, inner: aion.Store) -> None:
        self._inner = inner
        self.events = _NoAppendEvents(inner.events)

    @property
    def visibility(self) -> VisibilityStore:
        return self._inner.visibility

    async def aclose(self) -> None:
        await self._inner.aclose()


@attrs.frozen
class ReplayOutcome:
    """What replaying a finished history did: ``stuck_reason`` (non-determinism), the
    appends it tried (refused), whether it reached the recorded end, the history after."""

    stuck_reason: str | None
    refused: list[list[aion.Event]]
    completed: bool
    history: list[aion.Event]


async def replay(
    events: Sequence[aion.Event],
    *,
    workflows: Sequence[aion.WorkflowDefinition[Any]],
    activities: Sequence[aion.ActivityDefinition[Any]] = (),
) -> ReplayOutcome:
    """Replay the latest run of ``events`` (a finished run) in a fresh engine that refuses appends.

    Run it under ``autojump_clock``: a replay that gets stuck is given up after an hour
    of mock time, which passes instantly."""
    assert events, "nothing to replay"
    workflow_id = events[0].workflow_id
    run_id = latest_run_id(events)
    assert run_id is not None
    start = run_segment(events, run_id)[0].body
    assert isinstance(start, aion.WorkflowStarted)
    async with aion.open_store(f"memory://replay-{uuid.uuid4().hex}") as inner:
        await inner.events.append(workflow_id, list(events), 0)
        guarded = _NoAppendStore(inner)
        async with aion.open_engine(guarded, workflows=workflows, activities=activities) as engine:  # type: ignore[arg-type]
            core = engine._core
            recorder = await core.recorder_for(workflow_id)
            lease = core.new_lease(recorder, run_id, start.workflow_type)
            core.spawn_run(lease)
            # A clean replay rings the completion at once; a stuck one never does.
            with trio.move_on_after(3600):
                await lease.completion.wait()
            return ReplayOutcome(
                stuck_reason=lease.stuck_reason,
                refused=list(guarded.events.refused),
                completed=lease.completion.is_set,
                history=await engine.history(workflow_id),
            )


async def assert_replays_cleanly(
    events: Sequence[aion.Event],
    *,
    workflows: Sequence[aion.WorkflowDefinition[Any]],
    activities: Sequence[aion.ActivityDefinition[Any]] = (),
) -> None:
    """Replay the latest run of ``events`` (a finished run) and assert nothing is appended.

    Run it under ``autojump_clock``: a replay that gets stuck is reported after an hour of
    mock time, which passes instantly."""
    outcome = await replay(events, workflows=workflows, activities=activities)
    assert outcome.stuck_reason is None, f"replay got stuck: {outcome.stuck_reason}"
    assert outcome.refused == [], f"replay tried to append: {outcome.refused}"
    assert outcome.completed, "replay did not reach the run's recorded end"
    assert outcome.history == list(events)
