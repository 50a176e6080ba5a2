"""The conformance kit catches broken stores, each with the scenario meant to catch it.

Every broken store below wraps the memory store and breaks one rule of the
contract.  Each case runs only the scenario that pins that rule and asserts
the ConformanceError names it; the control shows the unbroken memory store
passes the very same scenario, so no case passes for an unrelated reason.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from datetime import datetime, timedelta, timezone
from typing import Any

import attrs
import pytest
import trio
import trio.lowlevel

import aion_trio
import aion_trio_memory
from aion_trio import (
    CommandOutcome,
    Event,
    InvalidBatch,
    NotOwner,
    OwnerClaim,
    OwnerIdentity,
    PendingCommand,
    SearchOp,
    SearchPredicate,
    SequenceConflict,
    SignalCommand,
    VisibilityFilter,
    VisibilityRow,
    WorkflowReopened,
    WorkflowStarted,
    WorkflowStatus,
)
from aion_trio.plugin import TimerEntry, this_host
from aion_trio.testing import (
    BULK_HISTORY_READS_SCENARIOS,
    COMMAND_INBOX_SCENARIOS,
    EVENT_STORE_SCENARIOS,
    FLOW_STORE_SCENARIOS,
    OWNED_STORE_SCENARIOS,
    RECOVERY_COUNTS_SCENARIOS,
    SCHEDULE_STORE_SCENARIOS,
    VISIBILITY_STORE_SCENARIOS,
    ConformanceError,
    EventStoreSuite,
    RecoveryCountsSuite,
    check_bulk_history_reads,
    check_command_inbox,
    check_event_store,
    check_flow_store,
    check_owned_store,
    check_recovery_counts,
    check_schedule_store,
    check_visibility_store,
)

# --------------------------------------------------------------------------
# Delegating wrappers: the unbroken baseline each broken store edits
# --------------------------------------------------------------------------


class EventsProxy:
    """Passes every call to a real memory event store."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    async def append(self, workflow_id: str, events: Sequence[Event], expected_seq: int) -> None:
        await self.inner.append(workflow_id, events, expected_seq)

    async def read_history(self, workflow_id: str, from_seq: int = 1) -> list[Event]:
        return await self.inner.read_history(workflow_id, from_seq)

    async def list_active(self) -> list[str]:
        return await self.inner.list_active()

    async def list_workflow_ids(self) -> list[str]:
        return await self.inner.list_workflow_ids()

    async def schedule_timer(self, workflow_id: str, timer_id: str, fire_at: datetime) -> None:
        await self.inner.schedule_timer(workflow_id, timer_id, fire_at)

    async def remove_timer(self, workflow_id: str, timer_id: str) -> None:
        await self.inner.remove_timer(workflow_id, timer_id)

    async def expired_timers(self, as_of: datetime) -> list[TimerEntry]:
        return await self.inner.expired_timers(as_of)

    async def aclose(self) -> None:
        await self.inner.aclose()


class VisibilityProxy:
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    async def upsert(self, row: VisibilityRow) -> None:
        await self.inner.upsert(row)

    async def get(self, workflow_id: str) -> VisibilityRow | None:
        return await self.inner.get(workflow_id)

    async def list(self, filter: VisibilityFilter | None = None) -> list[VisibilityRow]:
        return await self.inner.list(filter)

    async def count(self, filter: VisibilityFilter | None = None) -> int:
        return await self.inner.count(filter)

    async def aclose(self) -> None:
        await self.inner.aclose()


def factory_of(wrapper: Callable[[Any], Any], part: str) -> Callable[[], Any]:
    @contextlib.asynccontextmanager
    async def open_wrapped() -> AsyncIterator[Any]:
        async with aion_trio.open_store("memory://") as store:
            yield wrapper(getattr(store, part))

    return open_wrapped


def renumbered(events: Sequence[Event], first_seq: int) -> list[Event]:
    return [attrs.evolve(e, seq=first_seq + i) for i, e in enumerate(events)]


# --------------------------------------------------------------------------
# Broken event stores
# --------------------------------------------------------------------------


class IgnoresExpectedSeq(EventsProxy):
    """Appends at the current head whatever expected_seq says."""

    async def append(self, workflow_id: str, events: Sequence[Event], expected_seq: int) -> None:
        head = len(await self.inner.read_history(workflow_id))
        await self.inner.append(workflow_id, renumbered(events, head + 1), head)


class AcceptsGaps(EventsProxy):
    """Quietly renumbers a gapped or duplicated batch instead of refusing it."""

    async def append(self, workflow_id: str, events: Sequence[Event], expected_seq: int) -> None:
        try:
            await self.inner.append(workflow_id, events, expected_seq)
        except InvalidBatch:
            if not events:
                raise
            await self.inner.append(workflow_id, renumbered(events, expected_seq + 1), expected_seq)


class UnorderedHistory(EventsProxy):
    """Returns history in the order a hash table might: not by seq."""

    async def read_history(self, workflow_id: str, from_seq: int = 1) -> list[Event]:
        events = await self.inner.read_history(workflow_id, from_seq)
        return sorted(events, key=lambda e: (e.seq % 2, e.seq))


class NotACheckpoint(EventsProxy):
    """Answers list_workflow_ids from a cache, without yielding to Trio."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.ids: set[str] = set()

    async def append(self, workflow_id: str, events: Sequence[Event], expected_seq: int) -> None:
        await self.inner.append(workflow_id, events, expected_seq)
        self.ids.add(workflow_id)

    async def list_workflow_ids(self) -> list[str]:
        return sorted(self.ids)


class PartialWriteOnConflict(EventsProxy):
    """On a stale expected_seq, still writes the part of the batch past the head."""

    async def append(self, workflow_id: str, events: Sequence[Event], expected_seq: int) -> None:
        try:
            await self.inner.append(workflow_id, events, expected_seq)
        except SequenceConflict as exc:
            tail = [e for e in events if e.seq > exc.found]
            if tail and tail[0].seq == exc.found + 1:
                await self.inner.append(workflow_id, tail, exc.found)
            raise


class ListActiveIgnoresReopen(EventsProxy):
    """Computes list_active from lifecycle events but forgets WorkflowReopened."""

    async def list_active(self) -> list[str]:
        active = []
        for workflow_id in await self.inner.list_workflow_ids():
            status = None
            for event in await self.inner.read_history(workflow_id):
                if isinstance(event.body, WorkflowStarted):
                    status = WorkflowStatus.RUNNING
                elif isinstance(event.body, WorkflowReopened):
                    continue
                elif event.is_terminal:
                    status = aion_trio.projections.status_after(None, [event])
            if aion_trio.projections.is_active_status(status):
                active.append(workflow_id)
        return active


class TimerBoundaryExclusive(EventsProxy):
    """expired_timers(as_of) uses fire_at < as_of."""

    async def expired_timers(self, as_of: datetime) -> list[TimerEntry]:
        return [t for t in await self.inner.expired_timers(as_of) if t.fire_at < as_of]


class TimerInsertNotUpsert(EventsProxy):
    """Rescheduling a timer adds a second entry instead of moving the first."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.extra: list[TimerEntry] = []

    async def schedule_timer(self, workflow_id: str, timer_id: str, fire_at: datetime) -> None:
        for entry in await self.inner.expired_timers(datetime.max.replace(tzinfo=fire_at.tzinfo)):
            if (entry.workflow_id, entry.timer_id) == (workflow_id, timer_id):
                self.extra.append(entry)
        await self.inner.schedule_timer(workflow_id, timer_id, fire_at)

    async def expired_timers(self, as_of: datetime) -> list[TimerEntry]:
        found = await self.inner.expired_timers(as_of)
        return sorted([*found, *(e for e in self.extra if e.fire_at <= as_of)])


class RemoveTimerRemovesWorkflowTimers(EventsProxy):
    """remove_timer deletes every timer of the workflow, not only the named one."""

    async def remove_timer(self, workflow_id: str, timer_id: str) -> None:
        for entry in await self.inner.expired_timers(datetime.max.replace(tzinfo=timezone.utc)):
            if entry.workflow_id == workflow_id:
                await self.inner.remove_timer(workflow_id, entry.timer_id)
        await self.inner.remove_timer(workflow_id, timer_id)


class TimersUnordered(EventsProxy):
    """expired_timers ordered by timer id first."""

    async def expired_timers(self, as_of: datetime) -> list[TimerEntry]:
        found = await self.inner.expired_timers(as_of)
        return sorted(found, key=lambda e: (e.timer_id, e.workflow_id, e.fire_at))


class LosesTimezone(EventsProxy):
    """Hands recorded_at back as naive UTC, as a careless TEXT column would."""

    async def read_history(self, workflow_id: str, from_seq: int = 1) -> list[Event]:
        events = await self.inner.read_history(workflow_id, from_seq)
        return [_naive(e) for e in events]


def _naive(event: Event) -> Event:
    clone = attrs.evolve(event)
    object.__setattr__(clone, "recorded_at", event.recorded_at.replace(tzinfo=None))
    return clone


class EmptyHistoryPastHeadIsError(EventsProxy):
    """from_seq past the head is treated as an error."""

    async def read_history(self, workflow_id: str, from_seq: int = 1) -> list[Event]:
        events = await self.inner.read_history(workflow_id, 1)
        if events and from_seq > len(events):
            raise aion_trio.NotFound(f"{workflow_id} has no seq {from_seq}")
        return events[from_seq - 1 :]


class AheadIsAccepted(EventsProxy):
    """Accepts an expected_seq ahead of the head, writing at the head."""

    async def append(self, workflow_id: str, events: Sequence[Event], expected_seq: int) -> None:
        head = len(await self.inner.read_history(workflow_id))
        if expected_seq > head:
            await self.inner.append(workflow_id, renumbered(events, head + 1), head)
        else:
            await self.inner.append(workflow_id, events, expected_seq)


class CheckThenWriteRace(EventsProxy):
    """Checks the head once, yields, then writes at whatever head it finds: racers all "win"."""

    async def append(self, workflow_id: str, events: Sequence[Event], expected_seq: int) -> None:
        head = len(await self.inner.read_history(workflow_id))
        if head != expected_seq:
            raise SequenceConflict(workflow_id, expected_seq, head)
        while True:
            now = len(await self.inner.read_history(workflow_id))
            try:
                await self.inner.append(workflow_id, renumbered(events, now + 1), now)
            except SequenceConflict:
                continue
            return


class SharedStateAcrossWorkflows(EventsProxy):
    """Keys histories by the first character of the workflow id."""

    async def append(self, workflow_id: str, events: Sequence[Event], expected_seq: int) -> None:
        await self.inner.append(
            workflow_id[:6], [attrs.evolve(e, workflow_id=workflow_id[:6]) for e in events], expected_seq
        )

    async def read_history(self, workflow_id: str, from_seq: int = 1) -> list[Event]:
        events = await self.inner.read_history(workflow_id[:6], from_seq)
        return [attrs.evolve(e, workflow_id=workflow_id) for e in events]

    async def list_workflow_ids(self) -> list[str]:
        return await self.inner.list_workflow_ids()


class TruncatesLongHistories(EventsProxy):
    """read_history returns at most 1,000 events (a forgotten LIMIT)."""

    async def read_history(self, workflow_id: str, from_seq: int = 1) -> list[Event]:
        return (await self.inner.read_history(workflow_id, from_seq))[:1000]


class UnsortedWorkflowIds(EventsProxy):
    async def list_workflow_ids(self) -> list[str]:
        return list(reversed(await self.inner.list_workflow_ids()))


class SilentAfterClose(EventsProxy):
    """After aclose, reads answer with empty results instead of raising."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.closed = False

    async def aclose(self) -> None:
        self.closed = True
        await self.inner.aclose()

    async def list_active(self) -> list[str]:
        if self.closed:
            await trio.lowlevel.checkpoint()
            return []
        return await self.inner.list_active()


class WritesThenHonoursCancel(EventsProxy):
    """Writes the batch, then checkpoints: a cancel there raises Cancelled after the write."""

    async def append(self, workflow_id: str, events: Sequence[Event], expected_seq: int) -> None:
        await self.inner.append(workflow_id, events, expected_seq)
        await trio.lowlevel.checkpoint()


# --------------------------------------------------------------------------
# Broken visibility stores
# --------------------------------------------------------------------------


class OrderingByIdOnly(VisibilityProxy):
    """Orders by workflow_id, ignoring start_time."""

    async def list(self, filter: VisibilityFilter | None = None) -> list[VisibilityRow]:
        f = filter or VisibilityFilter()
        rows = await self.inner.list(attrs.evolve(f, limit=None, offset=0))
        rows.sort(key=lambda r: r.workflow_id, reverse=f.newest_first)
        end = None if f.limit is None else f.offset + f.limit
        return rows[f.offset : end]


class CountHonoursLimit(VisibilityProxy):
    async def count(self, filter: VisibilityFilter | None = None) -> int:
        return len(await self.inner.list(filter))


class RowsNotReplaced(VisibilityProxy):
    """Merges search attributes on upsert instead of replacing the row."""

    async def upsert(self, row: VisibilityRow) -> None:
        old = await self.inner.get(row.workflow_id)
        if old is not None:
            row = attrs.evolve(row, search_attributes={**old.search_attributes, **row.search_attributes})
        await self.inner.upsert(row)


class BoolBecomesInt(VisibilityProxy):
    """Stores booleans as 0/1 integers (a common SQL shortcut)."""

    async def upsert(self, row: VisibilityRow) -> None:
        attrs_ = {k: int(v) if isinstance(v, bool) else v for k, v in row.search_attributes.items()}
        await self.inner.upsert(attrs.evolve(row, search_attributes=attrs_))


class GetFallsBackToNeighbour(VisibilityProxy):
    """get matches case-insensitively."""

    async def get(self, workflow_id: str) -> VisibilityRow | None:
        for row in await self.inner.list(None):
            if row.workflow_id.lower() == workflow_id.lower():
                return row
        return None


class TypeFilterIsPrefix(VisibilityProxy):
    """Filters workflow_type with LIKE 'x%' instead of equality."""

    async def list(self, filter: VisibilityFilter | None = None) -> list[VisibilityRow]:
        f = filter or VisibilityFilter()
        if f.workflow_type is None:
            return await self.inner.list(f)
        rows = await self.inner.list(attrs.evolve(f, workflow_type=None, limit=None, offset=0))
        rows = [r for r in rows if r.workflow_type.startswith(f.workflow_type)]
        end = None if f.limit is None else f.offset + f.limit
        return rows[f.offset : end]


class ExclusiveTimeBounds(VisibilityProxy):
    """started_after is exclusive."""

    async def list(self, filter: VisibilityFilter | None = None) -> list[VisibilityRow]:
        f = filter or VisibilityFilter()
        rows = await self.inner.list(f)
        return [r for r in rows if f.started_after is None or r.start_time > f.started_after]


class CaseInsensitiveContains(VisibilityProxy):
    """CONTAINS implemented like SQLite's LIKE: ASCII case-insensitive."""

    async def list(self, filter: VisibilityFilter | None = None) -> list[VisibilityRow]:
        f = filter or VisibilityFilter()
        candidates = attrs.evolve(f, search=(), limit=None, offset=0).apply(await self.inner.list(None))
        kept = [r for r in candidates if all(_loose(p, r.search_attributes) for p in f.search)]
        return kept[f.offset :][: f.limit]


def _loose(p: SearchPredicate, attributes: Any) -> bool:
    if p.op is not SearchOp.CONTAINS or p.key not in attributes:
        return p.matches(attributes)
    have = attributes[p.key]
    want = str(p.value).lower()
    if isinstance(have, tuple):
        return want in (v.lower() for v in have)
    return isinstance(have, str) and want in have.lower()


class LikeWildcards(VisibilityProxy):
    """Filters task_queue with an unescaped LIKE: '%' and '_' match anything."""

    async def list(self, filter: VisibilityFilter | None = None) -> list[VisibilityRow]:
        f = filter or VisibilityFilter()
        if f.task_queue not in ("%", "_"):
            return await self.inner.list(f)
        return await self.inner.list(attrs.evolve(f, task_queue=None))


class PagingUnstable(VisibilityProxy):
    """Applies offset before ordering."""

    async def list(self, filter: VisibilityFilter | None = None) -> list[VisibilityRow]:
        f = filter or VisibilityFilter()
        if f.limit is None and f.offset == 0:
            return await self.inner.list(f)
        rows = await self.inner.list(attrs.evolve(f, limit=None, offset=0, newest_first=False))
        end = None if f.limit is None else f.offset + f.limit
        page = rows[f.offset : end]
        return sorted(page, key=lambda r: r.start_time, reverse=f.newest_first)


class IntFloatNotEqual(VisibilityProxy):
    """EQUALS compares kinds strictly, so 1 does not match 1.0."""

    async def list(self, filter: VisibilityFilter | None = None) -> list[VisibilityRow]:
        f = filter or VisibilityFilter()
        rows = await self.inner.list(attrs.evolve(f, limit=None, offset=0))

        def strict(r: VisibilityRow) -> bool:
            for p in f.search:
                kinds_differ = p.key in r.search_attributes and type(r.search_attributes[p.key]) is not type(
                    p.value
                )
                if p.op is SearchOp.EQUALS and kinds_differ:
                    return False
            return True

        kept = [r for r in rows if strict(r)]
        end = None if f.limit is None else f.offset + f.limit
        return kept[f.offset : end]

    async def count(self, filter: VisibilityFilter | None = None) -> int:
        return len(await self.list(attrs.evolve(filter or VisibilityFilter(), limit=None, offset=0)))


class VisibilityNotACheckpoint(VisibilityProxy):
    """get answers from a dict without yielding."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.rows: dict[str, VisibilityRow] = {}

    async def upsert(self, row: VisibilityRow) -> None:
        await self.inner.upsert(row)
        self.rows[row.workflow_id] = row

    async def get(self, workflow_id: str) -> VisibilityRow | None:
        return self.rows.get(workflow_id)


class VisibilityAcloseNotIdempotent(VisibilityProxy):
    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.closed = False

    async def aclose(self) -> None:
        if self.closed:
            raise trio.ClosedResourceError("already closed")
        self.closed = True
        await self.inner.aclose()


EVENT_CASES = [
    pytest.param(IgnoresExpectedSeq, "stale_expected_seq_writes_nothing", id="ignores-expected-seq"),
    pytest.param(AcceptsGaps, "invalid_batches_refused", id="accepts-a-gap"),
    pytest.param(UnorderedHistory, "read_history_ranges", id="unordered-history"),
    pytest.param(NotACheckpoint, "every_method_is_a_checkpoint", id="not-a-checkpoint"),
    pytest.param(PartialWriteOnConflict, "stale_expected_seq_writes_nothing", id="partial-write-on-conflict"),
    pytest.param(ListActiveIgnoresReopen, "list_active_follows_projection", id="list-active-ignores-reopen"),
    pytest.param(TimerBoundaryExclusive, "timer_due_boundary_inclusive", id="timer-boundary-exclusive"),
    pytest.param(TimerInsertNotUpsert, "timer_reschedule_upserts", id="timer-insert-not-upsert"),
    pytest.param(RemoveTimerRemovesWorkflowTimers, "timer_remove", id="remove-timer-too-broad"),
    pytest.param(TimersUnordered, "timer_ordering_and_utc", id="timers-unordered"),
    pytest.param(LosesTimezone, "round_trip_every_event_type", id="loses-timezone"),
    pytest.param(EmptyHistoryPastHeadIsError, "read_history_ranges", id="past-head-is-error"),
    pytest.param(AheadIsAccepted, "ahead_of_head_expected_seq_refused", id="ahead-accepted"),
    pytest.param(CheckThenWriteRace, "concurrent_appends_one_winner", id="check-then-write-race"),
    pytest.param(
        SharedStateAcrossWorkflows, "concurrent_appends_to_many_workflows", id="workflows-share-state"
    ),
    pytest.param(TruncatesLongHistories, "large_history", id="truncates-long-histories"),
    pytest.param(UnsortedWorkflowIds, "list_workflow_ids_sorted", id="unsorted-workflow-ids"),
    pytest.param(SilentAfterClose, "use_after_close", id="silent-after-close"),
    pytest.param(WritesThenHonoursCancel, "cancelled_append_is_all_or_nothing", id="writes-then-cancelled"),
]

VISIBILITY_CASES = [
    pytest.param(OrderingByIdOnly, "visibility_ordering", id="ordering-by-id-only"),
    pytest.param(CountHonoursLimit, "visibility_count_ignores_paging", id="count-honours-limit"),
    pytest.param(RowsNotReplaced, "visibility_upsert_replaces", id="rows-merged-not-replaced"),
    pytest.param(BoolBecomesInt, "visibility_upsert_get_round_trip", id="bool-becomes-int"),
    pytest.param(GetFallsBackToNeighbour, "visibility_get_unknown_is_none", id="get-case-insensitive"),
    pytest.param(TypeFilterIsPrefix, "visibility_filters_by_field", id="type-filter-is-prefix"),
    pytest.param(ExclusiveTimeBounds, "visibility_time_ranges_inclusive", id="exclusive-time-bounds"),
    pytest.param(CaseInsensitiveContains, "visibility_search_predicates", id="contains-case-insensitive"),
    pytest.param(IntFloatNotEqual, "visibility_search_predicates", id="int-float-not-equal"),
    pytest.param(LikeWildcards, "visibility_values_bound_safely", id="like-wildcards"),
    pytest.param(PagingUnstable, "visibility_paging", id="paging-unstable"),
    pytest.param(
        CaseInsensitiveContains, "visibility_randomized_against_oracle", id="randomized-catches-contains"
    ),
    pytest.param(
        VisibilityNotACheckpoint, "visibility_every_method_is_a_checkpoint", id="visibility-not-a-checkpoint"
    ),
    pytest.param(VisibilityAcloseNotIdempotent, "visibility_use_after_close", id="aclose-not-idempotent"),
]


@pytest.mark.parametrize(("broken", "scenario"), EVENT_CASES)
async def test_broken_event_store_is_caught_by_its_scenario(
    broken: Callable[[Any], Any], scenario: str
) -> None:
    with pytest.raises(ConformanceError) as info:
        await check_event_store(factory_of(broken, "events"), scenarios=[scenario])
    assert info.value.scenario == scenario
    assert scenario in str(info.value)
    # Control: the same scenario passes on the unbroken memory store.
    await check_event_store(factory_of(EventsProxy, "events"), scenarios=[scenario])


@pytest.mark.parametrize(("broken", "scenario"), VISIBILITY_CASES)
async def test_broken_visibility_store_is_caught_by_its_scenario(
    broken: Callable[[Any], Any], scenario: str
) -> None:
    with pytest.raises(ConformanceError) as info:
        await check_visibility_store(factory_of(broken, "visibility"), scenarios=[scenario])
    assert info.value.scenario == scenario
    await check_visibility_store(factory_of(VisibilityProxy, "visibility"), scenarios=[scenario])


def test_every_scenario_has_a_broken_store_it_catches() -> None:
    # A scenario no broken store fails could be vacuous.
    caught_event = {p.values[1] for p in EVENT_CASES}
    caught_visibility = {p.values[1] for p in VISIBILITY_CASES}
    assert set(EVENT_STORE_SCENARIOS) - caught_event == set()
    assert set(VISIBILITY_STORE_SCENARIOS) - caught_visibility == set()


async def test_unbroken_memory_store_passes_the_whole_kit() -> None:
    await check_event_store(factory_of(EventsProxy, "events"))
    await check_visibility_store(factory_of(VisibilityProxy, "visibility"))


async def test_broken_store_fails_the_whole_kit_too() -> None:
    # The full run (not only the targeted scenario) reports a failure.
    with pytest.raises(ConformanceError):
        await check_event_store(factory_of(TimerBoundaryExclusive, "events"))
    with pytest.raises(ConformanceError):
        await check_visibility_store(factory_of(CountHonoursLimit, "visibility"))


# --------------------------------------------------------------------------
# Broken ownership and inbox stores, over keyed memory stores
# --------------------------------------------------------------------------


class ControlProxy:
    """Passes every ownership and inbox call to a real memory store bundle."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    async def claim_owner(
        self, identity: OwnerIdentity, *, now: datetime, stale_after: timedelta
    ) -> OwnerClaim:
        return await self.inner.claim_owner(identity, now=now, stale_after=stale_after)

    async def renew_owner(self, claim: OwnerClaim, *, now: datetime) -> OwnerClaim:
        return await self.inner.renew_owner(claim, now=now)

    async def release_owner(self, claim: OwnerClaim) -> None:
        await self.inner.release_owner(claim)

    async def current_owner(self) -> OwnerClaim | None:
        return await self.inner.current_owner()

    async def enqueue_command(self, command: Any) -> int:
        return await self.inner.enqueue_command(command)

    async def pending_commands(self, limit: int = 100) -> list[PendingCommand]:
        return await self.inner.pending_commands(limit)

    async def ack_command(self, command_id: int, outcome: CommandOutcome) -> None:
        await self.inner.ack_command(command_id, outcome)

    async def command_outcome(self, command_id: int) -> CommandOutcome | None:
        return await self.inner.command_outcome(command_id)

    async def count_recoveries(self, workflow_ids: Sequence[str]) -> dict[str, int]:
        return await self.inner.count_recoveries(workflow_ids)

    async def clear_recoveries(self, workflow_ids: Sequence[str]) -> None:
        await self.inner.clear_recoveries(workflow_ids)

    async def recovery_counts(self) -> dict[str, int]:
        return await self.inner.recovery_counts()

    async def create_schedule(self, schedule_id: str, data: str) -> Any:
        return await self.inner.create_schedule(schedule_id, data)

    async def read_schedule(self, schedule_id: str) -> Any:
        return await self.inner.read_schedule(schedule_id)

    async def list_schedules(self) -> Any:
        return await self.inner.list_schedules()

    async def write_schedule(self, schedule_id: str, data: str, expected_version: int) -> Any:
        return await self.inner.write_schedule(schedule_id, data, expected_version)

    async def delete_schedule(self, schedule_id: str) -> bool:
        return bool(await self.inner.delete_schedule(schedule_id))

    @property
    def events(self) -> Any:
        return self.inner.events

    async def read_histories(self, workflow_ids: Sequence[str]) -> dict[str, list[Event]]:
        return dict(await self.inner.read_histories(workflow_ids))

    async def aclose(self) -> None:
        await self.inner.aclose()


def keyed_factory_of(wrapper: Callable[[Any], Any]) -> Callable[[str], Any]:
    @contextlib.asynccontextmanager
    async def open_wrapped(key: str) -> AsyncIterator[Any]:
        async with aion_trio.open_store(f"memory://broken-{key}") as store:
            yield wrapper(store)

    return open_wrapped


def _stored(inner: Any) -> Any:
    return inner._data


class ClaimNeverRefused(ControlProxy):
    """Overwrites whatever claim is there."""

    async def claim_owner(
        self, identity: OwnerIdentity, *, now: datetime, stale_after: timedelta
    ) -> OwnerClaim:
        current = await self.inner.current_owner()
        if current is not None:
            await self.inner.release_owner(current)
        return await self.inner.claim_owner(identity, now=now, stale_after=stale_after)


def _nobody() -> OwnerClaim:
    when = datetime(2041, 1, 1, tzinfo=timezone.utc)
    ident = OwnerIdentity(pid=1, host="nobody", started_at=when, token="nobody")
    return OwnerClaim(identity=ident, since=when, renewed_at=when, stale_after=timedelta(seconds=1))


class NeverTakesOver(ControlProxy):
    """Treats every existing claim as live."""

    async def claim_owner(
        self, identity: OwnerIdentity, *, now: datetime, stale_after: timedelta
    ) -> OwnerClaim:
        current = await self.inner.current_owner()
        if current is not None and current.identity.token != identity.token:
            raise current.owned_error()
        return await self.inner.claim_owner(identity, now=now, stale_after=stale_after)


class IgnoresHeartbeatAge(ControlProxy):
    """Judges liveness by the pid alone, so an owner on another host is never stale."""

    async def claim_owner(
        self, identity: OwnerIdentity, *, now: datetime, stale_after: timedelta
    ) -> OwnerClaim:
        current = await self.inner.current_owner()
        if (
            current is not None
            and current.identity.token != identity.token
            and current.identity.host != this_host()
        ):
            raise current.owned_error()
        return await self.inner.claim_owner(identity, now=now, stale_after=stale_after)


class ReclaimRefused(ControlProxy):
    """Refuses the owner's own re-claim."""

    async def claim_owner(
        self, identity: OwnerIdentity, *, now: datetime, stale_after: timedelta
    ) -> OwnerClaim:
        current = await self.inner.current_owner()
        if current is not None and current.identity.token == identity.token:
            raise current.owned_error()
        return await self.inner.claim_owner(identity, now=now, stale_after=stale_after)


class RenewNotStored(ControlProxy):
    """Returns a renewed claim without storing it."""

    async def renew_owner(self, claim: OwnerClaim, *, now: datetime) -> OwnerClaim:
        current = await self.inner.current_owner()
        assert current is not None
        return attrs.evolve(current, renewed_at=now)


class RenewAlwaysSucceeds(ControlProxy):
    """Renews whatever claim it is handed, taken over or not."""

    async def renew_owner(self, claim: OwnerClaim, *, now: datetime) -> OwnerClaim:
        await trio.lowlevel.checkpoint()
        return attrs.evolve(claim, renewed_at=now)


class RenewRaisesTheBareBase(ControlProxy):
    """Refuses a taken-over renewal with the bare NotOwner base instead of StoreTakenOver."""

    async def renew_owner(self, claim: OwnerClaim, *, now: datetime) -> OwnerClaim:
        try:
            return await self.inner.renew_owner(claim, now=now)
        except NotOwner as exc:
            raise NotOwner(exc.shard, exc.detail) from None


class ReleaseIgnoresToken(ControlProxy):
    """Drops the stored claim whoever asks."""

    async def release_owner(self, claim: OwnerClaim) -> None:
        current = await self.inner.current_owner()
        if current is not None:
            await self.inner.release_owner(current)


class ClaimNotDurable(ControlProxy):
    """Keeps the claim in the handle, so a reopened store has forgotten it."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.claim: OwnerClaim | None = None

    async def claim_owner(
        self, identity: OwnerIdentity, *, now: datetime, stale_after: timedelta
    ) -> OwnerClaim:
        await trio.lowlevel.checkpoint()
        claim = aion_trio.plugin.decide_claim(self.claim, identity, now=now, stale_after=stale_after)
        self.claim = claim
        return claim

    async def current_owner(self) -> OwnerClaim | None:
        await trio.lowlevel.checkpoint()
        return self.claim


class ClaimCheckThenSet(ControlProxy):
    """Reads the claim, yields, then writes: racing claimants all "win"."""

    async def claim_owner(
        self, identity: OwnerIdentity, *, now: datetime, stale_after: timedelta
    ) -> OwnerClaim:
        current = await self.inner.current_owner()
        claim = aion_trio.plugin.decide_claim(current, identity, now=now, stale_after=stale_after)
        await trio.lowlevel.checkpoint()
        _stored(self.inner).owner = claim
        return claim


class ClaimMillisecondsOnly(ControlProxy):
    """Reads the claim's times back cut to milliseconds (a careless column type)."""

    async def current_owner(self) -> OwnerClaim | None:
        claim = await self.inner.current_owner()
        if claim is None:
            return None
        cut = claim.renewed_at.replace(microsecond=claim.renewed_at.microsecond // 1000 * 1000)
        return attrs.evolve(claim, renewed_at=cut)


class OwnerNotACheckpoint(ControlProxy):
    async def current_owner(self) -> OwnerClaim | None:
        return _stored(self.inner).owner  # type: ignore[no-any-return]


class OwnerSilentAfterClose(ControlProxy):
    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.closed = False

    async def aclose(self) -> None:
        self.closed = True
        await self.inner.aclose()

    async def current_owner(self) -> OwnerClaim | None:
        if self.closed:
            await trio.lowlevel.checkpoint()
            return None
        return await self.inner.current_owner()

    async def claim_owner(
        self, identity: OwnerIdentity, *, now: datetime, stale_after: timedelta
    ) -> OwnerClaim:
        if self.closed:
            await trio.lowlevel.checkpoint()
            return _nobody()
        return await super().claim_owner(identity, now=now, stale_after=stale_after)


class PendingNewestFirst(ControlProxy):
    async def pending_commands(self, limit: int = 100) -> list[PendingCommand]:
        return list(reversed(await self.inner.pending_commands(10_000)))[:limit]


class DropsSignalPayloads(ControlProxy):
    """Stores a signal's name but loses its payload."""

    async def enqueue_command(self, command: Any) -> int:
        if isinstance(command, SignalCommand):
            command = attrs.evolve(command, payload=aion_trio.Payload.of(None))
        return await self.inner.enqueue_command(command)


class AckKeepsPending(ControlProxy):
    """Records the outcome but leaves the command pending."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.outcomes: dict[int, CommandOutcome] = {}

    async def ack_command(self, command_id: int, outcome: CommandOutcome) -> None:
        await trio.lowlevel.checkpoint()
        self.outcomes.setdefault(command_id, outcome)

    async def command_outcome(self, command_id: int) -> CommandOutcome | None:
        await self.inner.command_outcome(command_id)
        return self.outcomes.get(command_id)


class OutcomeForgotten(ControlProxy):
    async def command_outcome(self, command_id: int) -> CommandOutcome | None:
        await self.inner.command_outcome(command_id)
        return None


class InboxNotDurable(ControlProxy):
    """Keeps the inbox in the handle: a reopened store starts empty, ids from 1 again."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.items: dict[int, tuple[Any, CommandOutcome | None]] = {}

    async def enqueue_command(self, command: Any) -> int:
        await trio.lowlevel.checkpoint()
        self.items[len(self.items) + 1] = (command, None)
        return len(self.items)

    async def pending_commands(self, limit: int = 100) -> list[PendingCommand]:
        await trio.lowlevel.checkpoint()
        return [
            PendingCommand(command_id=i, command=c) for i, (c, o) in sorted(self.items.items()) if o is None
        ][:limit]

    async def ack_command(self, command_id: int, outcome: CommandOutcome) -> None:
        await trio.lowlevel.checkpoint()
        if command_id not in self.items:
            raise aion_trio.NotFound(str(command_id))
        command, previous = self.items[command_id]
        self.items[command_id] = (command, previous or outcome)

    async def command_outcome(self, command_id: int) -> CommandOutcome | None:
        await trio.lowlevel.checkpoint()
        if command_id not in self.items:
            raise aion_trio.NotFound(str(command_id))
        return self.items[command_id][1]


class EnqueueIdRace(ControlProxy):
    """Picks the next id from a read, yields, then stores: two handles can take one id."""

    async def enqueue_command(self, command: Any) -> int:
        data = _stored(self.inner)
        next_id = data.last_command_id + 1
        await trio.lowlevel.checkpoint()
        data.last_command_id = next_id
        data.commands[next_id] = (aion_trio.plugin.command_data_json(command), None)
        return next_id


class EnqueueIgnoresRequestId(ControlProxy):
    """Queues every command anew: a client's retry after an ambiguous failure adds a duplicate."""

    async def enqueue_command(self, command: Any) -> int:
        return await self.inner.enqueue_command(attrs.evolve(command, request_id=None))


class InboxNotACheckpoint(ControlProxy):
    async def command_outcome(self, command_id: int) -> CommandOutcome | None:
        return _stored(self.inner).commands[command_id][1]  # type: ignore[no-any-return]


class InboxSilentAfterClose(ControlProxy):
    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.closed = False

    async def aclose(self) -> None:
        self.closed = True
        await self.inner.aclose()

    async def enqueue_command(self, command: Any) -> int:
        if self.closed:
            await trio.lowlevel.checkpoint()
            return 0
        return await self.inner.enqueue_command(command)


class CountsEachMention(ControlProxy):
    """Counts an id given twice in one call twice."""

    async def count_recoveries(self, workflow_ids: Sequence[str]) -> dict[str, int]:
        counts: dict[str, int] = {}
        for workflow_id in workflow_ids:
            counts.update(await self.inner.count_recoveries([workflow_id]))
        return counts


class RecoveriesNotDurable(ControlProxy):
    """Keeps the counts in the handle, so a reopened store has forgotten them."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.counts: dict[str, int] = {}

    async def count_recoveries(self, workflow_ids: Sequence[str]) -> dict[str, int]:
        await trio.lowlevel.checkpoint()
        for workflow_id in dict.fromkeys(workflow_ids):
            self.counts[workflow_id] = self.counts.get(workflow_id, 0) + 1
        return {workflow_id: self.counts[workflow_id] for workflow_id in workflow_ids}

    async def recovery_counts(self) -> dict[str, int]:
        await trio.lowlevel.checkpoint()
        return dict(self.counts)


class CountsTheLettersOfOneId(ControlProxy):
    """Takes any iterable: one id passed as a str counts each of its letters."""

    async def count_recoveries(self, workflow_ids: Sequence[str]) -> dict[str, int]:
        return await self.inner.count_recoveries(list(workflow_ids))


class RecoveriesNotACheckpoint(ControlProxy):
    async def recovery_counts(self) -> dict[str, int]:
        return dict(_stored(self.inner).recoveries)


class RecoveriesSilentAfterClose(ControlProxy):
    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.closed = False

    async def aclose(self) -> None:
        self.closed = True
        await self.inner.aclose()

    async def count_recoveries(self, workflow_ids: Sequence[str]) -> dict[str, int]:
        if self.closed:
            await trio.lowlevel.checkpoint()
            return {}
        return await self.inner.count_recoveries(workflow_ids)


OWNER_CASES = [
    pytest.param(ClaimNeverRefused, "owner_live_owner_refuses", id="claim-never-refused"),
    pytest.param(NeverTakesOver, "owner_dead_pid_taken_over", id="never-takes-over"),
    pytest.param(IgnoresHeartbeatAge, "owner_stale_heartbeat_taken_over", id="ignores-heartbeat-age"),
    pytest.param(ReclaimRefused, "owner_reclaim_by_same_token_refreshes", id="reclaim-refused"),
    pytest.param(RenewNotStored, "owner_renew_extends_the_claim", id="renew-not-stored"),
    pytest.param(RenewAlwaysSucceeds, "owner_renew_after_takeover_is_not_owner", id="renew-always-succeeds"),
    pytest.param(
        RenewRaisesTheBareBase, "owner_renew_after_takeover_is_not_owner", id="renew-raises-the-bare-base"
    ),
    pytest.param(ReleaseIgnoresToken, "owner_release_frees_the_store", id="release-ignores-token"),
    pytest.param(ClaimNotDurable, "owner_claim_survives_reopen", id="claim-not-durable"),
    pytest.param(ClaimCheckThenSet, "owner_concurrent_takeover_one_winner", id="claim-check-then-set"),
    pytest.param(ClaimMillisecondsOnly, "owner_claim_round_trip", id="claim-milliseconds-only"),
    pytest.param(OwnerNotACheckpoint, "owner_every_method_is_a_checkpoint", id="owner-not-a-checkpoint"),
    pytest.param(OwnerSilentAfterClose, "owner_use_after_close", id="owner-silent-after-close"),
]

INBOX_CASES = [
    pytest.param(DropsSignalPayloads, "inbox_round_trip_every_command_type", id="drops-signal-payloads"),
    pytest.param(PendingNewestFirst, "inbox_fifo_order", id="pending-newest-first"),
    pytest.param(AckKeepsPending, "inbox_ack_removes_from_pending", id="ack-keeps-pending"),
    pytest.param(OutcomeForgotten, "inbox_outcome_readable", id="outcome-forgotten"),
    pytest.param(InboxNotDurable, "inbox_survives_reopen", id="inbox-not-durable"),
    pytest.param(EnqueueIdRace, "inbox_concurrent_enqueues_from_two_handles", id="enqueue-id-race"),
    pytest.param(
        EnqueueIgnoresRequestId, "inbox_enqueue_once_per_request_id", id="enqueue-ignores-request-id"
    ),
    pytest.param(InboxNotACheckpoint, "inbox_every_method_is_a_checkpoint", id="inbox-not-a-checkpoint"),
    pytest.param(InboxSilentAfterClose, "inbox_use_after_close", id="inbox-silent-after-close"),
]


class SchedulesListedNewestFirst(ControlProxy):
    async def list_schedules(self) -> Any:
        return list(reversed(await self.inner.list_schedules()))


class ScheduleCreateOverwrites(ControlProxy):
    async def create_schedule(self, schedule_id: str, data: str) -> Any:
        await self.inner.delete_schedule(schedule_id)
        return await self.inner.create_schedule(schedule_id, data)


class ScheduleWriteIgnoresTheVersion(ControlProxy):
    async def write_schedule(self, schedule_id: str, data: str, expected_version: int) -> Any:
        stored = await self.inner.read_schedule(schedule_id)
        version = 0 if stored is None else stored.version
        return await self.inner.write_schedule(schedule_id, data, version)


class ScheduleWriteReadsThenWrites(ControlProxy):
    """Compares and sets in two steps with a checkpoint between: concurrent writers both win."""

    async def write_schedule(self, schedule_id: str, data: str, expected_version: int) -> Any:
        stored = await self.inner.read_schedule(schedule_id)
        await trio.lowlevel.checkpoint()
        if stored is None or stored.version != expected_version:
            raise aion_trio.ScheduleConflict(
                schedule_id, expected_version, 0 if stored is None else stored.version
            )
        _stored(self.inner).schedules[schedule_id] = (expected_version + 1, data)
        return aion_trio.StoredSchedule(schedule_id=schedule_id, version=expected_version + 1, data=data)


class ScheduleDeleteAlwaysTrue(ControlProxy):
    async def delete_schedule(self, schedule_id: str) -> bool:
        await self.inner.delete_schedule(schedule_id)
        return True


class SchedulesNotDurable(ControlProxy):
    """Keeps schedules in the handle, so a reopened store has forgotten them."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.fresh = False

    async def create_schedule(self, schedule_id: str, data: str) -> Any:
        if not self.fresh:
            self.fresh = True
            _stored(self.inner).schedules.clear()
        return await self.inner.create_schedule(schedule_id, data)

    async def list_schedules(self) -> Any:
        if not self.fresh:
            await trio.lowlevel.checkpoint()
            return []
        return await self.inner.list_schedules()


class ScheduleDataNotChecked(ControlProxy):
    async def create_schedule(self, schedule_id: str, data: str) -> Any:
        await trio.lowlevel.checkpoint()
        _stored(self.inner).schedules[schedule_id] = (1, data)
        return aion_trio.StoredSchedule(schedule_id=schedule_id, version=1, data=str(data))


class ScheduleReadNotACheckpoint(ControlProxy):
    async def read_schedule(self, schedule_id: str) -> Any:
        found = _stored(self.inner).schedules.get(schedule_id)
        return (
            None
            if found is None
            else aion_trio.StoredSchedule(schedule_id=schedule_id, version=found[0], data=found[1])
        )


class SchedulesSilentAfterClose(ControlProxy):
    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.closed = False

    async def aclose(self) -> None:
        self.closed = True
        await self.inner.aclose()

    async def list_schedules(self) -> Any:
        if self.closed:
            await trio.lowlevel.checkpoint()
            return []
        return await self.inner.list_schedules()

    async def create_schedule(self, schedule_id: str, data: str) -> Any:
        if self.closed:
            await trio.lowlevel.checkpoint()
            return aion_trio.StoredSchedule(schedule_id=schedule_id, version=1, data=data)
        return await self.inner.create_schedule(schedule_id, data)


SCHEDULE_CASES = [
    pytest.param(SchedulesListedNewestFirst, "schedules_create_read_list", id="listed-newest-first"),
    pytest.param(ScheduleCreateOverwrites, "schedules_duplicate_create_refused", id="create-overwrites"),
    pytest.param(
        ScheduleWriteIgnoresTheVersion, "schedules_write_compare_and_set", id="write-ignores-version"
    ),
    pytest.param(ScheduleWriteReadsThenWrites, "schedules_concurrent_writers_one_wins", id="read-then-write"),
    pytest.param(ScheduleDeleteAlwaysTrue, "schedules_delete", id="delete-always-true"),
    pytest.param(SchedulesNotDurable, "schedules_survive_reopen", id="schedules-not-durable"),
    pytest.param(ScheduleDataNotChecked, "schedules_bad_input_refused", id="data-not-checked"),
    pytest.param(
        ScheduleReadNotACheckpoint, "schedules_every_method_is_a_checkpoint", id="read-not-a-checkpoint"
    ),
    pytest.param(SchedulesSilentAfterClose, "schedules_use_after_close", id="schedules-silent-after-close"),
]


@pytest.mark.parametrize(("broken", "scenario"), SCHEDULE_CASES)
async def test_broken_schedule_stores_are_caught_by_their_scenario(
    broken: Callable[[Any], Any], scenario: str
) -> None:
    with pytest.raises(ConformanceError) as info:
        await check_schedule_store(keyed_factory_of(broken), scenarios=[scenario])
    assert info.value.scenario == scenario
    await check_schedule_store(keyed_factory_of(ControlProxy), scenarios=[scenario])


def test_every_schedule_scenario_has_a_broken_store_it_catches() -> None:
    assert set(SCHEDULE_STORE_SCENARIOS) == {p.values[1] for p in SCHEDULE_CASES}


class HistoriesLeaveOutUnknownIds(ControlProxy):
    async def read_histories(self, workflow_ids: Sequence[str]) -> dict[str, list[Event]]:
        return {w: h for w, h in (await self.inner.read_histories(workflow_ids)).items() if h}


class HistoriesFirstQueryOnly(ControlProxy):
    """Answers only the ids its first query could bind, as a store that forgot to split a batch."""

    async def read_histories(self, workflow_ids: Sequence[str]) -> dict[str, list[Event]]:
        return await self.inner.read_histories(list(workflow_ids)[:999])


class HistoriesTakeOneStrAsIds(ControlProxy):
    async def read_histories(self, workflow_ids: Sequence[str]) -> dict[str, list[Event]]:
        return await self.inner.read_histories([w for w in workflow_ids if w])


class HistoriesNotACheckpoint(ControlProxy):
    async def read_histories(self, workflow_ids: Sequence[str]) -> dict[str, list[Event]]:
        histories = _stored(self.inner).histories
        return {w: list(histories.get(w, ())) for w in workflow_ids}


class HistoriesSilentAfterClose(ControlProxy):
    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.closed = False

    async def aclose(self) -> None:
        self.closed = True
        await self.inner.aclose()

    async def read_histories(self, workflow_ids: Sequence[str]) -> dict[str, list[Event]]:
        if self.closed:
            await trio.lowlevel.checkpoint()
            return {w: [] for w in workflow_ids}
        return await self.inner.read_histories(workflow_ids)


HISTORIES_CASES = [
    pytest.param(HistoriesLeaveOutUnknownIds, "histories_read_many", id="leave-out-unknown-ids"),
    pytest.param(HistoriesFirstQueryOnly, "histories_large_batch", id="first-query-only"),
    pytest.param(HistoriesTakeOneStrAsIds, "histories_bad_ids_refused", id="one-str-taken-as-ids"),
    pytest.param(HistoriesNotACheckpoint, "histories_every_method_is_a_checkpoint", id="not-a-checkpoint"),
    pytest.param(HistoriesSilentAfterClose, "histories_use_after_close", id="histories-silent-after-close"),
]


@pytest.mark.parametrize(("broken", "scenario"), HISTORIES_CASES)
async def test_broken_bulk_history_reads_are_caught_by_their_scenario(
    broken: Callable[[Any], Any], scenario: str
) -> None:
    with pytest.raises(ConformanceError) as info:
        await check_bulk_history_reads(keyed_factory_of(broken), scenarios=[scenario])
    assert info.value.scenario == scenario
    await check_bulk_history_reads(keyed_factory_of(ControlProxy), scenarios=[scenario])


def test_every_bulk_history_read_scenario_has_a_broken_store_it_catches() -> None:
    assert set(BULK_HISTORY_READS_SCENARIOS) == {p.values[1] for p in HISTORIES_CASES}


RECOVERY_CASES = [
    pytest.param(CountsEachMention, "recoveries_count_and_clear", id="counts-each-mention"),
    pytest.param(RecoveriesNotDurable, "recoveries_survive_reopen", id="recoveries-not-durable"),
    pytest.param(CountsTheLettersOfOneId, "recoveries_bad_ids_refused", id="counts-the-letters-of-one-id"),
    pytest.param(
        RecoveriesNotACheckpoint, "recoveries_every_method_is_a_checkpoint", id="recoveries-not-a-checkpoint"
    ),
    pytest.param(
        RecoveriesSilentAfterClose, "recoveries_use_after_close", id="recoveries-silent-after-close"
    ),
]


@pytest.mark.parametrize(("broken", "scenario"), OWNER_CASES)
async def test_broken_owned_store_is_caught_by_its_scenario(
    broken: Callable[[Any], Any], scenario: str
) -> None:
    with pytest.raises(ConformanceError) as info:
        await check_owned_store(keyed_factory_of(broken), scenarios=[scenario])
    assert info.value.scenario == scenario
    await check_owned_store(keyed_factory_of(ControlProxy), scenarios=[scenario])


@pytest.mark.parametrize(("broken", "scenario"), INBOX_CASES)
async def test_broken_command_inbox_is_caught_by_its_scenario(
    broken: Callable[[Any], Any], scenario: str
) -> None:
    with pytest.raises(ConformanceError) as info:
        await check_command_inbox(keyed_factory_of(broken), scenarios=[scenario])
    assert info.value.scenario == scenario
    await check_command_inbox(keyed_factory_of(ControlProxy), scenarios=[scenario])


@pytest.mark.parametrize(("broken", "scenario"), RECOVERY_CASES)
async def test_broken_recovery_counts_are_caught_by_their_scenario(
    broken: Callable[[Any], Any], scenario: str
) -> None:
    with pytest.raises(ConformanceError) as info:
        await check_recovery_counts(keyed_factory_of(broken), scenarios=[scenario])
    assert info.value.scenario == scenario
    await check_recovery_counts(keyed_factory_of(ControlProxy), scenarios=[scenario])


def test_every_ownership_inbox_and_recovery_scenario_has_a_broken_store_it_catches() -> None:
    assert set(OWNED_STORE_SCENARIOS) - {p.values[1] for p in OWNER_CASES} == set()
    assert set(COMMAND_INBOX_SCENARIOS) - {p.values[1] for p in INBOX_CASES} == set()
    assert set(RECOVERY_COUNTS_SCENARIOS) - {p.values[1] for p in RECOVERY_CASES} == set()


async def test_unbroken_memory_store_passes_the_ownership_inbox_and_recovery_kit() -> None:
    await check_owned_store(keyed_factory_of(ControlProxy))
    await check_command_inbox(keyed_factory_of(ControlProxy))
    await check_recovery_counts(keyed_factory_of(ControlProxy))


# --------------------------------------------------------------------------
# The suites' methods are the scenarios: called directly, they catch the same stores
# --------------------------------------------------------------------------


async def test_a_suite_method_called_directly_catches_its_broken_store() -> None:
    # What pytest runs for a suite subclass, without pytest: one visible method per scenario.
    events = EventStoreSuite()
    with pytest.raises(ConformanceError) as info:
        await events.test_timer_due_boundary_inclusive(factory_of(TimerBoundaryExclusive, "events"))
    assert info.value.scenario == "timer_due_boundary_inclusive"
    await events.test_timer_due_boundary_inclusive(factory_of(EventsProxy, "events"))
    recoveries = RecoveryCountsSuite()
    with pytest.raises(ConformanceError) as info:
        await recoveries.test_recoveries_survive_reopen(keyed_factory_of(RecoveriesNotDurable))
    assert info.value.scenario == "recoveries_survive_reopen"
    await recoveries.test_recoveries_survive_reopen(keyed_factory_of(ControlProxy))


# --------------------------------------------------------------------------
# Flow stores (aion_trio.FlowStore)
# --------------------------------------------------------------------------


class FlowProxy(ControlProxy):
    """Passes every flow call to a real memory store bundle."""

    async def acquire_flow_permit(self, key: str, **kw: Any) -> Any:
        return await self.inner.acquire_flow_permit(key, **kw)

    async def release_flow_permit(self, key: str, permit_id: str) -> bool:
        return bool(await self.inner.release_flow_permit(key, permit_id))

    async def renew_flow_permits(self, holder: str, **kw: Any) -> int:
        return int(await self.inner.renew_flow_permits(holder, **kw))

    async def held_flow_permits(self, key: str, **kw: Any) -> int:
        return int(await self.inner.held_flow_permits(key, **kw))

    async def enqueue_flow_run(self, run: Any) -> Any:
        return await self.inner.enqueue_flow_run(run)

    async def admit_flow_runs(self, queue: str, **kw: Any) -> Any:
        return await self.inner.admit_flow_runs(queue, **kw)

    async def flow_runs(self, queue: str | None = None) -> Any:
        return await self.inner.flow_runs(queue)

    async def finish_flow_run(self, queue: str, workflow_id: str) -> bool:
        return bool(await self.inner.finish_flow_run(queue, workflow_id))

    async def record_flow_waiter(self, waiter: Any, **kw: Any) -> None:
        await self.inner.record_flow_waiter(waiter, **kw)

    async def remove_flow_waiter(self, workflow_id: str, run_id: str, activity_id: int) -> bool:
        return bool(await self.inner.remove_flow_waiter(workflow_id, run_id, activity_id))

    async def flow_waiters(self, workflow_id: str, **kw: Any) -> Any:
        return await self.inner.flow_waiters(workflow_id, **kw)

    async def clear_flow_waiters(self) -> int:
        return int(await self.inner.clear_flow_waiters())


class PermitsIgnoreTheBound(FlowProxy):
    async def acquire_flow_permit(self, key: str, **kw: Any) -> Any:
        if kw["concurrency"] is not None:
            kw["concurrency"] = 10**6
        return await self.inner.acquire_flow_permit(key, **kw)


class RenewDoesNothing(FlowProxy):
    async def renew_flow_permits(self, holder: str, **kw: Any) -> int:
        await trio.lowlevel.checkpoint()
        return 1


class RateIgnored(FlowProxy):
    async def acquire_flow_permit(self, key: str, **kw: Any) -> Any:
        return await self.inner.acquire_flow_permit(key, **{**kw, "rate": None})


class PermitCountedThenTaken(FlowProxy):
    """Counts the held permits in one call and takes one in another: concurrent callers
    all see room and all take one."""

    async def acquire_flow_permit(self, key: str, **kw: Any) -> Any:
        bound = kw["concurrency"]
        if bound is not None and await self.inner.held_flow_permits(key, now=kw["now"]) >= bound:
            return aion_trio.FlowGrant(granted=False)
        await trio.lowlevel.checkpoint()
        return await self.inner.acquire_flow_permit(key, **{**kw, "concurrency": 10**6})


class FlowNotDurable(FlowProxy):
    """Keeps the flow state in the handle, so a reopened store has forgotten it."""

    def __init__(self, inner: Any) -> None:
        super().__init__(aion_trio_memory.MemoryStore.fresh())


class DedupIgnored(FlowProxy):
    async def enqueue_flow_run(self, run: Any) -> Any:
        return await self.inner.enqueue_flow_run(attrs.evolve(run, dedup_id=None))


class AdmitIgnoresTheBound(FlowProxy):
    async def admit_flow_runs(self, queue: str, **kw: Any) -> Any:
        return await self.inner.admit_flow_runs(queue, **{**kw, "concurrency": None})


class AdmitIgnoresTheRate(FlowProxy):
    async def admit_flow_runs(self, queue: str, **kw: Any) -> Any:
        admitted, _ = await self.inner.admit_flow_runs(queue, **{**kw, "rate": None})
        return admitted, None


class HeldPermitsNotACheckpoint(FlowProxy):
    async def held_flow_permits(self, key: str, **kw: Any) -> int:
        return sum(
            1 for _, expires in _stored(self.inner).permits.get(key, {}).values() if expires > kw["now"]
        )


class WaiterRemoveDoesNothing(FlowProxy):
    async def remove_flow_waiter(self, workflow_id: str, run_id: str, activity_id: int) -> bool:
        await trio.lowlevel.checkpoint()
        return True


class WaiterRecordedTwice(FlowProxy):
    """Keys its records by attempt too: a second wait of an activity adds a record."""

    async def record_flow_waiter(self, waiter: Any, **kw: Any) -> None:
        await self.inner.record_flow_waiter(
            attrs.evolve(waiter, activity_id=waiter.activity_id * 1000 + waiter.attempt), **kw
        )


class WaitersNeverLapse(FlowProxy):
    async def flow_waiters(self, workflow_id: str, **kw: Any) -> Any:
        return await self.inner.flow_waiters(workflow_id, now=kw["now"] - timedelta(days=1))


class RenewSkipsWaiters(FlowProxy):
    async def record_flow_waiter(self, waiter: Any, **kw: Any) -> None:
        # Recorded under another holder: the holder's renewal never reaches it.
        await self.inner.record_flow_waiter(attrs.evolve(waiter, holder=f"{waiter.holder}'"), **kw)

    async def flow_waiters(self, workflow_id: str, **kw: Any) -> Any:
        found = await self.inner.flow_waiters(workflow_id, **kw)
        return [attrs.evolve(w, holder=w.holder[:-1]) for w in found]


class FlowSilentAfterClose(FlowProxy):
    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.closed = False

    async def aclose(self) -> None:
        self.closed = True
        await self.inner.aclose()

    async def acquire_flow_permit(self, key: str, **kw: Any) -> Any:
        if self.closed:
            await trio.lowlevel.checkpoint()
            return aion_trio.FlowGrant(granted=False)
        return await self.inner.acquire_flow_permit(key, **kw)


FLOW_CASES = [
    pytest.param(PermitsIgnoreTheBound, "flow_permits_bound_concurrency", id="permits-ignore-bound"),
    pytest.param(RenewDoesNothing, "flow_permits_expire_and_renew", id="renew-does-nothing"),
    pytest.param(RateIgnored, "flow_rate_window", id="rate-ignored"),
    pytest.param(
        PermitCountedThenTaken, "flow_concurrent_acquirers_respect_the_bound", id="counted-then-taken"
    ),
    pytest.param(FlowNotDurable, "flow_state_survives_reopen", id="flow-not-durable"),
    pytest.param(DedupIgnored, "flow_runs_enqueue_and_dedup", id="dedup-ignored"),
    pytest.param(AdmitIgnoresTheBound, "flow_runs_admitted_in_order_within_bounds", id="admit-ignores-bound"),
    pytest.param(AdmitIgnoresTheRate, "flow_runs_admitted_at_the_rate", id="admit-ignores-rate"),
    pytest.param(HeldPermitsNotACheckpoint, "flow_every_method_is_a_checkpoint", id="held-not-a-checkpoint"),
    pytest.param(FlowSilentAfterClose, "flow_use_after_close", id="flow-silent-after-close"),
    pytest.param(
        WaiterRemoveDoesNothing, "flow_waiters_recorded_replaced_and_removed", id="waiter-remove-does-nothing"
    ),
    pytest.param(
        WaiterRecordedTwice, "flow_waiters_recorded_replaced_and_removed", id="waiter-recorded-twice"
    ),
    pytest.param(WaitersNeverLapse, "flow_waiters_lapse_unless_renewed", id="waiters-never-lapse"),
    pytest.param(RenewSkipsWaiters, "flow_waiters_lapse_unless_renewed", id="renew-skips-waiters"),
]


@pytest.mark.parametrize(("broken", "scenario"), FLOW_CASES)
async def test_broken_flow_stores_are_caught_by_their_scenario(
    broken: Callable[[Any], Any], scenario: str
) -> None:
    with pytest.raises(ConformanceError) as info:
        await check_flow_store(keyed_factory_of(broken), scenarios=[scenario])
    assert info.value.scenario == scenario
    await check_flow_store(keyed_factory_of(FlowProxy), scenarios=[scenario])


def test_every_flow_scenario_has_a_broken_store_it_catches() -> None:
    assert set(FLOW_STORE_SCENARIOS) == {p.values[1] for p in FLOW_CASES}
