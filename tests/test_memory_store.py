"""The memory store keeps each history as one list, extended in place (issue 17, item 4b).

Appending used to build a new list of the whole history (``[*history, *events]``),
so every step of a long workflow cost O(history).  What pins the fix without
timing anything: the list that holds a workflow's first event is the one that
holds its later events too (found through the garbage collector, so no private
name is touched), and what a reader was handed never changes under it.
"""

from __future__ import annotations

import gc
from datetime import datetime, timezone

import aion_trio
from aion_trio import Payload
from aion_trio.events import Event, MarkerRecorded, WorkflowStarted

AT = datetime(2026, 1, 1, tzinfo=timezone.utc)


def started(workflow_id: str) -> Event:
    body = WorkflowStarted(
        workflow_type="w", input=Payload.of([]), run_id="00000000-0000-4000-8000-000000000001"
    )
    return Event(workflow_id=workflow_id, seq=1, recorded_at=AT, body=body)


def marker(workflow_id: str, seq: int) -> Event:
    body = MarkerRecorded(name=f"m{seq}", value=Payload.of(None))
    return Event(workflow_id=workflow_id, seq=seq, recorded_at=AT, body=body)


def lists_holding(obj: object) -> list[list[object]]:
    return [ref for ref in gc.get_referrers(obj) if type(ref) is list]


async def test_an_append_extends_the_stored_history_instead_of_copying_it() -> None:
    async with aion_trio.open_store("memory://") as store:
        first = started("wf")
        await store.events.append("wf", (first,), 0)
        holders = lists_holding(first)
        assert len(holders) == 1, "control: the store holds the event in one list"
        (stored,) = holders
        for seq in range(2, 6):
            await store.events.append("wf", (marker("wf", seq),), seq - 1)
        # The same list grew: no append built a new one (which would leave this one at 1).
        assert [e.seq for e in stored] == [1, 2, 3, 4, 5]  # type: ignore[attr-defined]
        assert lists_holding(first) == [stored]


async def test_what_a_reader_was_handed_never_changes_under_it() -> None:
    async with aion_trio.open_store("memory://") as store:
        await store.events.append("wf", (started("wf"),), 0)
        before = await store.events.read_history("wf")
        tail = await store.events.read_history("wf", 1)
        await store.events.append("wf", (marker("wf", 2), marker("wf", 3)), 1)
        assert [e.seq for e in before] == [1]
        assert [e.seq for e in tail] == [1]
        # Nor does changing the copy change the store.
        before.clear()
        assert [e.seq for e in await store.events.read_history("wf")] == [1, 2, 3]
        assert [e.seq for e in await store.events.read_history("wf", 3)] == [3]
