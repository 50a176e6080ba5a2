"""Conformance scenarios for :class:`~aion_trio.EventStore`.

Each scenario opens one fresh store, so scenarios never see each other's data.
:class:`~aion_trio.testing.EventStoreSuite` runs them in the order they are written
here: cheap, basic behaviour first.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

import attrs
import trio
import trio.testing

from .._errors import InvalidBatch, SequenceConflict
from .._events import (
    ActivityError,
    ActivityFailed,
    ActivityScheduled,
    ActivityStarted,
    ChildWorkflowFailed,
    ErrorInfo,
    Event,
    EventBody,
    FailureCause,
    MarkerRecorded,
    TimeoutKind,
    WorkflowCancelled,
    WorkflowCancelRequested,
    WorkflowCompleted,
    WorkflowContinuedAsNew,
    WorkflowFailed,
    WorkflowReopened,
    WorkflowStarted,
    WorkflowTimedOut,
)
from .._payload import Payload
from .._projections import is_active_status, status_after
from .._store import TimerEntry
from . import _samples as s
from ._kit import ConformanceError, ScenarioContext, short

LARGE_HISTORY_EVENTS = 10_000
LARGE_HISTORY_BATCH = 100
LARGE_HISTORY_BUDGET_SECONDS = 20.0
"""Wall-clock budget for appending and reading back the large history.

Generous on purpose, so a slow CI machine never trips it: it catches only
pathological cost (say, a store that re-reads the whole history on every
append of a large workflow); measure real performance with ``bench/``.
"""

CONCURRENT_WRITERS = 8
CONCURRENT_WORKFLOWS = 16
CANCEL_REPEATS = 6
CANCEL_PROBES = 64 * CANCEL_REPEATS
CANCEL_SETTLED = 3 * CANCEL_REPEATS


async def _append_ok(
    ctx: ScenarioContext, store: Any, workflow_id: str, events: Sequence[Event], expected: int
) -> None:
    try:
        await store.append(workflow_id, events, expected)
    except Exception as exc:
        raise ConformanceError(
            ctx.name,
            f"append({workflow_id!r}, <{len(events)} events from seq {events[0].seq if events else '-'}>, "
            f"expected_seq={expected}) raised {type(exc).__name__}: {exc}; expected it to succeed",
        ) from exc


async def _expect_history(
    ctx: ScenarioContext, store: Any, workflow_id: str, expected: Sequence[Event], what: str
) -> None:
    observed = await store.read_history(workflow_id)
    ctx.expect_equal(observed, list(expected), f"{what}: read_history({workflow_id!r})")


# --------------------------------------------------------------------------
# Round trip and reads
# --------------------------------------------------------------------------


async def round_trip_every_event_type(ctx: ScenarioContext) -> None:
    """Every event body type, every field set, survives append + read_history unchanged."""
    async with ctx.open() as store:
        full = s.batch("round-trip", 1, s.full_bodies())
        minimal = s.batch("round-trip", len(full) + 1, s.minimal_bodies())
        await _append_ok(ctx, store, "round-trip", full, 0)
        await _append_ok(ctx, store, "round-trip", minimal, len(full))
        await _expect_history(ctx, store, "round-trip", [*full, *minimal], "after two appends")
        observed = await store.read_history("round-trip")
        for event in observed:
            offset = event.recorded_at.utcoffset()
            ctx.expect(
                offset is not None,
                f"read_history returned seq {event.seq} with a naive recorded_at {event.recorded_at!r}; "
                "datetimes must come back timezone-aware",
            )
        # A workflow id full of quotes and SQL text is data, nothing more.
        odd_id = "o'brien\"; DROP TABLE events; --žluť"
        odd = s.batch(odd_id, 1, s.full_bodies()[:3])
        await _append_ok(ctx, store, odd_id, odd, 0)
        await _expect_history(ctx, store, odd_id, odd, "a workflow id holding quotes and SQL text")
        await _expect_history(
            ctx, store, "round-trip", [*full, *minimal], "after appending to another workflow"
        )


async def read_history_ranges(ctx: ScenarioContext) -> None:
    """read_history is ascending from from_seq; past the head or unknown workflow gives []."""
    async with ctx.open() as store:
        events = s.markers("ranges", 1, 4) + s.markers("ranges", 5, 3) + s.markers("ranges", 8, 3)
        await _append_ok(ctx, store, "ranges", events[:4], 0)
        await _append_ok(ctx, store, "ranges", events[4:7], 4)
        await _append_ok(ctx, store, "ranges", events[7:], 7)
        head = len(events)
        for from_seq in (1, 2, 5, 8, head):
            observed = await store.read_history("ranges", from_seq)
            ctx.expect_equal(observed, events[from_seq - 1 :], f"read_history('ranges', from_seq={from_seq})")
        observed = await store.read_history("ranges")
        ctx.expect_equal(observed, events, "read_history('ranges') with the default from_seq")
        for from_seq in (head + 1, head + 100):
            observed = await store.read_history("ranges", from_seq)
            ctx.expect_equal(
                observed, [], f"read_history('ranges', from_seq={from_seq}) past the head {head}"
            )
        for from_seq in (1, 5):
            observed = await store.read_history("never-written", from_seq)
            ctx.expect_equal(observed, [], f"read_history of an unknown workflow (from_seq={from_seq})")
        observed = await store.read_history("ranges")
        seqs = [e.seq for e in observed]
        ctx.expect_equal(seqs, list(range(1, head + 1)), "seqs of read_history (must be ascending)")


# --------------------------------------------------------------------------
# Sequence checks and batch validation
# --------------------------------------------------------------------------


async def stale_expected_seq_writes_nothing(ctx: ScenarioContext) -> None:
    """An append whose expected_seq is behind the head raises SequenceConflict and writes nothing."""
    async with ctx.open() as store:
        first = s.markers("stale", 1, 3, tag="first")
        await _append_ok(ctx, store, "stale", first, 0)
        for expected in (0, 1, 2):
            batch = s.markers("stale", expected + 1, 2, tag="late")
            with ctx.expect_raises(
                SequenceConflict, f"append with stale expected_seq={expected} (head 3)"
            ) as raised:
                await store.append("stale", batch, expected)
            exc = raised.value
            ctx.expect_equal(
                (exc.workflow_id, exc.expected, exc.found),
                ("stale", expected, 3),
                "SequenceConflict (workflow_id, expected, found)",
            )
            await _expect_history(
                ctx, store, "stale", first, f"after the refused append at expected_seq={expected}"
            )
        # The store still accepts the right expected seq afterwards.
        more = s.markers("stale", 4, 2, tag="next")
        await _append_ok(ctx, store, "stale", more, 3)
        await _expect_history(ctx, store, "stale", first + more, "after a correct append")


async def ahead_of_head_expected_seq_refused(ctx: ScenarioContext) -> None:
    """An expected_seq beyond the head (or on an unknown workflow) is a SequenceConflict too."""
    async with ctx.open() as store:
        first = s.markers("ahead", 1, 2)
        await _append_ok(ctx, store, "ahead", first, 0)
        with ctx.expect_raises(SequenceConflict, "append with expected_seq=5 when the head is 2") as raised:
            await store.append("ahead", s.markers("ahead", 6, 2), 5)
        exc = raised.value
        ctx.expect_equal(
            (exc.workflow_id, exc.expected, exc.found),
            ("ahead", 5, 2),
            "SequenceConflict (workflow_id, expected, found)",
        )
        with ctx.expect_raises(SequenceConflict, "append with expected_seq=3 when the head is 2") as raised:
            await store.append("ahead", s.markers("ahead", 4, 1), 3)
        await _expect_history(ctx, store, "ahead", first, "after refused appends ahead of the head")
        with ctx.expect_raises(
            SequenceConflict, "append with expected_seq=3 to a workflow with no events"
        ) as raised:
            await store.append("ghost", s.markers("ghost", 4, 1), 3)
        exc = raised.value
        ctx.expect_equal(
            (exc.workflow_id, exc.expected, exc.found),
            ("ghost", 3, 0),
            "SequenceConflict (workflow_id, expected, found)",
        )
        ctx.expect_equal(await store.read_history("ghost"), [], "history of the refused new workflow")
        ctx.expect_equal(
            await store.list_workflow_ids(), ["ahead"], "list_workflow_ids after a refused first append"
        )


def _with_seq(event: Event, seq: int) -> Event:
    # Event validates seq >= 1; a store must refuse seq 0 even if a caller
    # manages to build one, so bypass the validator here.
    clone = attrs.evolve(event)
    object.__setattr__(clone, "seq", seq)
    return clone


async def invalid_batches_refused(ctx: ScenarioContext) -> None:
    """Empty, gapped, duplicated, off-by-one, zero-based or foreign batches raise InvalidBatch and write nothing."""
    async with ctx.open() as store:
        first = s.markers("batch", 1, 2)
        await _append_ok(ctx, store, "batch", first, 0)
        m = s.markers("batch", 3, 4)  # seqs 3, 4, 5, 6
        other = s.markers("other-wf", 3, 2)
        cases: list[tuple[str, str, list[Event], int]] = [
            ("an empty batch", "batch", [], 2),
            ("a gap (seqs 3, 5)", "batch", [m[0], m[2]], 2),
            ("a gap inside (seqs 3, 4, 6)", "batch", [m[0], m[1], m[3]], 2),
            ("a duplicated seq (3, 3)", "batch", [m[0], m[0]], 2),
            ("descending seqs (4, 3)", "batch", [m[1], m[0]], 2),
            ("a batch starting at the head's seq (2, 3)", "batch", [first[1], m[0]], 2),
            ("a batch starting past head+1 (4, 5)", "batch", [m[1], m[2]], 2),
            ("an event of another workflow", "batch", [m[0], other[1]], 2),
            ("only events of another workflow", "batch", other, 2),
            (
                "a gapped batch at a stale expected_seq (InvalidBatch before SequenceConflict)",
                "batch",
                [*s.markers("batch", 2, 1), m[1]],
                1,
            ),
            (
                "a first batch whose seqs start at 0",
                "fresh",
                [_with_seq(e, e.seq - 1) for e in s.markers("fresh", 1, 2)],
                0,
            ),
            ("a first batch whose seqs start at 2", "fresh", s.markers("fresh", 2, 2), 0),
            ("a negative expected_seq", "fresh", s.markers("fresh", 1, 1), -1),
        ]
        for label, workflow_id, events, expected in cases:
            with ctx.expect_raises(InvalidBatch, f"append of {label}"):
                await store.append(workflow_id, events, expected)
            await _expect_history(ctx, store, "batch", first, f"after refusing {label}")
            ctx.expect_equal(
                await store.read_history("fresh"), [], f"history of 'fresh' after refusing {label}"
            )
            ctx.expect_equal(
                await store.read_history("other-wf"), [], f"history of 'other-wf' after refusing {label}"
            )
        ctx.expect_equal(
            await store.list_workflow_ids(), ["batch"], "list_workflow_ids after refused batches"
        )
        await _append_ok(ctx, store, "batch", m, 2)
        await _expect_history(ctx, store, "batch", first + m, "after a valid append")


# --------------------------------------------------------------------------
# Concurrency
# --------------------------------------------------------------------------


async def concurrent_appends_one_winner(ctx: ScenarioContext) -> None:
    """N tasks append to one workflow with the same expected_seq: exactly one wins, the rest conflict."""
    async with ctx.open() as store:
        base = s.batch(
            "race", 1, [WorkflowStarted(workflow_type="race", input=Payload.of(None), run_id=s.RUN_A)]
        )
        await _append_ok(ctx, store, "race", base, 0)
        batches = {i: s.markers("race", 2, 1 + i % 3, tag=f"writer-{i}") for i in range(CONCURRENT_WRITERS)}
        outcomes: dict[int, object] = {}
        go = trio.Event()

        async def writer(i: int) -> None:
            await go.wait()
            try:
                await store.append("race", batches[i], 1)
            except Exception as exc:
                outcomes[i] = exc
            else:
                outcomes[i] = "ok"

        async with trio.open_nursery() as nursery:
            for i in batches:
                nursery.start_soon(writer, i)
            await trio.testing.wait_all_tasks_blocked()
            go.set()
        winners = [i for i, o in outcomes.items() if o == "ok"]
        ctx.expect(
            len(winners) == 1,
            f"{CONCURRENT_WRITERS} racing appends at expected_seq=1: {len(winners)} succeeded "
            f"(writers {winners}); exactly one must",
        )
        (winner,) = winners
        head = 1 + len(batches[winner])
        for i, outcome in sorted(outcomes.items()):
            if i == winner:
                continue
            if not isinstance(outcome, SequenceConflict):
                ctx.fail(f"losing writer {i} got {short(outcome)}, expected SequenceConflict")
            ctx.expect_equal(
                (outcome.expected, outcome.found),
                (1, head),
                f"SequenceConflict (expected, found) of losing writer {i}",
            )
        await _expect_history(
            ctx, store, "race", base + batches[winner], f"after the race won by writer {winner}"
        )


async def concurrent_appends_to_many_workflows(ctx: ScenarioContext) -> None:
    """Concurrent appends to different workflows all succeed and stay separate."""
    async with ctx.open() as store:
        rounds = 4
        plans = {
            f"many-{i:02d}": [s.markers(f"many-{i:02d}", 1 + 2 * r, 2, tag=f"w{i}") for r in range(rounds)]
            for i in range(CONCURRENT_WORKFLOWS)
        }
        errors: list[str] = []

        async def writer(workflow_id: str) -> None:
            for r, events in enumerate(plans[workflow_id]):
                try:
                    await store.append(workflow_id, events, 2 * r)
                except Exception as exc:
                    errors.append(f"{workflow_id} round {r}: {type(exc).__name__}: {exc}")
                    return

        async with trio.open_nursery() as nursery:
            for workflow_id in plans:
                nursery.start_soon(writer, workflow_id)
        ctx.expect(not errors, f"concurrent appends to distinct workflows failed: {'; '.join(errors[:3])}")
        for workflow_id, batches in plans.items():
            expected = [e for b in batches for e in b]
            await _expect_history(ctx, store, workflow_id, expected, "after concurrent appends")
        ctx.expect_equal(await store.list_workflow_ids(), sorted(plans), "list_workflow_ids")


async def large_history(ctx: ScenarioContext) -> None:
    """A 10,000-event history appended in batches reads back exactly, and fast enough."""
    async with ctx.open() as store:
        events = [
            Event(
                workflow_id="large",
                seq=seq,
                recorded_at=s.BASE_TIME + timedelta(microseconds=seq),
                body=MarkerRecorded(name="step", value=Payload(str(seq))),
            )
            for seq in range(1, LARGE_HISTORY_EVENTS + 1)
        ]
        began = time.perf_counter()
        for start in range(0, LARGE_HISTORY_EVENTS, LARGE_HISTORY_BATCH):
            await _append_ok(ctx, store, "large", events[start : start + LARGE_HISTORY_BATCH], start)
        observed = await store.read_history("large")
        middle = await store.read_history("large", LARGE_HISTORY_EVENTS // 2 + 1)
        tail = await store.read_history("large", LARGE_HISTORY_EVENTS)
        elapsed = time.perf_counter() - began
        ctx.expect_equal(observed, events, "read_history of the large history")
        ctx.expect_equal(middle, events[LARGE_HISTORY_EVENTS // 2 :], "read_history from the middle")
        ctx.expect_equal(tail, events[-1:], "read_history from the last seq")
        ctx.expect(
            elapsed <= LARGE_HISTORY_BUDGET_SECONDS,
            f"appending {LARGE_HISTORY_EVENTS} events in batches of {LARGE_HISTORY_BATCH} and reading them "
            f"back took {elapsed:.1f} s, over the budget of {LARGE_HISTORY_BUDGET_SECONDS:.0f} s "
            "(does append or read cost grow with the history's length?)",
        )


# --------------------------------------------------------------------------
# Projections: list_active, list_workflow_ids
# --------------------------------------------------------------------------


def _error() -> ErrorInfo:
    return ErrorInfo(type="RuntimeError", message="boom")


def _lifecycles() -> dict[str, list[list[EventBody]]]:
    """Per workflow, the batches appended in turn (list_active is checked after each)."""
    started = WorkflowStarted(workflow_type="t", input=Payload.of(None), run_id=s.RUN_A)
    successor = WorkflowStarted(workflow_type="t", input=Payload.of(1), run_id=s.RUN_B, parent_run_id=s.RUN_A)
    can = WorkflowContinuedAsNew(input=Payload.of(1), parent_run_id=s.RUN_A)
    reopen = WorkflowReopened(run_id=s.RUN_A)
    activity_failed = ActivityFailed(
        activity_id=0,
        error=_activity_error(),
        attempt=1,
        final=True,
    )
    return {
        "running": [[started]],
        "completed": [[started], [WorkflowCompleted(result=Payload.of(1))]],
        "failed": [[started], [WorkflowFailed(error=_error())]],
        "reopened": [[started], [WorkflowFailed(error=_error())], [reopen]],
        "reopened-then-completed": [
            [started],
            [WorkflowCancelRequested(reason="r"), WorkflowCancelled(reason="r")],
            [reopen],
            [WorkflowCompleted(result=Payload.of(2))],
        ],
        "failed-and-reopened-in-one-batch": [[started, WorkflowFailed(error=_error()), reopen]],
        "timed-out": [[started], [WorkflowTimedOut(timeout_kind=TimeoutKind.DEADLINE)]],
        "continued-successor-owed": [[started], [can]],
        "continued-successor-started": [[started], [can], [successor]],
        "continued-successor-completed": [
            [started],
            [can, successor],
            [WorkflowCompleted(result=Payload.of(3))],
        ],
        "activity-and-child-failures-only": [
            [started],
            [
                ActivityScheduled(activity_id=0, activity_type="a", input=Payload.of(None)),
                ActivityStarted(activity_id=0, attempt=1),
                activity_failed,
                ChildWorkflowFailed(child_workflow_id="c", error=_error()),
            ],
        ],
        "no-lifecycle-event": [[MarkerRecorded(name="m", value=Payload.of(0))]],
    }


def _activity_error() -> ActivityError:
    return ActivityError(cause=FailureCause.TERMINAL, type="E", message="m")


async def list_active_follows_projection(ctx: ScenarioContext) -> None:
    """list_active is the sorted ids whose projected status is active: Running, reopened, continue-as-new owed."""
    async with ctx.open() as store:
        plans = _lifecycles()
        histories: dict[str, list[Event]] = {w: [] for w in plans}
        ctx.expect_equal(await store.list_active(), [], "list_active of an empty store")
        steps = max(len(p) for p in plans.values())
        for step in range(steps):
            for workflow_id, batches in plans.items():
                if step >= len(batches):
                    continue
                history = histories[workflow_id]
                events = s.batch(workflow_id, len(history) + 1, batches[step])
                await _append_ok(ctx, store, workflow_id, events, len(history))
                history.extend(events)
                expected = sorted(
                    w for w, h in histories.items() if h and is_active_status(status_after(None, h))
                )
                observed = await store.list_active()
                if observed != expected:
                    last = [type(e.body).__name__ for e in history]
                    ctx.fail(
                        f"after appending to {workflow_id!r} (its history is now {last}): "
                        f"list_active() returned {observed}, expected {expected} "
                        "(active = last lifecycle event is WorkflowStarted or WorkflowReopened, "
                        "or WorkflowContinuedAsNew whose successor is owed)"
                    )
        ctx.expect_equal(
            await store.list_workflow_ids(), sorted(plans), "list_workflow_ids after the lifecycle appends"
        )


async def list_workflow_ids_sorted(ctx: ScenarioContext) -> None:
    """list_workflow_ids is every workflow with events, sorted, each once."""
    async with ctx.open() as store:
        ctx.expect_equal(await store.list_workflow_ids(), [], "list_workflow_ids of an empty store")
        ids = ["b", "a", "A", "a-1", "a'1", "Z", "é", "a b", "10", "9"]
        for workflow_id in ids:
            await _append_ok(ctx, store, workflow_id, s.markers(workflow_id, 1, 1), 0)
        await _append_ok(ctx, store, "a", s.markers("a", 2, 2), 1)
        await store.schedule_timer("timer-only", "named:t", s.at(10))
        ctx.expect_equal(
            await store.list_workflow_ids(),
            sorted(ids),
            "list_workflow_ids (sorted by code point, each id once, timers alone do not make a workflow)",
        )


# --------------------------------------------------------------------------
# Timers
# --------------------------------------------------------------------------


def _expect_utc(ctx: ScenarioContext, entries: Sequence[TimerEntry], what: str) -> None:
    for entry in entries:
        offset = entry.fire_at.utcoffset()
        ctx.expect(
            offset is not None and offset == timedelta(0),
            f"{what}: fire_at {entry.fire_at!r} of {entry.timer_id!r} must be returned as an aware UTC datetime",
        )


def _entry(workflow_id: str, timer_id: str, fire_at: datetime) -> TimerEntry:
    return TimerEntry(fire_at=fire_at, workflow_id=workflow_id, timer_id=timer_id)


async def timer_due_boundary_inclusive(ctx: ScenarioContext) -> None:
    """expired_timers(as_of) includes a timer at exactly fire_at, never one microsecond before."""
    async with ctx.open() as store:
        fire_at = s.at(3600)
        await store.schedule_timer("wf", "named:due", fire_at)
        one_us = timedelta(microseconds=1)
        ctx.expect_equal(
            await store.expired_timers(fire_at - one_us), [], "expired_timers one microsecond before fire_at"
        )
        ctx.expect_equal(
            await store.expired_timers(fire_at - timedelta(days=365)),
            [],
            "expired_timers a year before fire_at",
        )
        want = [_entry("wf", "named:due", fire_at)]
        ctx.expect_equal(
            await store.expired_timers(fire_at), want, "expired_timers at exactly fire_at (inclusive)"
        )
        ctx.expect_equal(
            await store.expired_timers(fire_at.astimezone(s.MINUS_0700)),
            want,
            "expired_timers at exactly fire_at expressed in UTC-07:00",
        )
        ctx.expect_equal(
            await store.expired_timers(fire_at + one_us), want, "expired_timers one microsecond after"
        )
        observed = await store.expired_timers(fire_at + timedelta(days=3650))
        ctx.expect_equal(observed, want, "expired_timers ten years after")
        _expect_utc(ctx, observed, "expired_timers")


async def timer_reschedule_upserts(ctx: ScenarioContext) -> None:
    """schedule_timer on an existing (workflow, timer) moves it: one entry, the new fire_at."""
    async with ctx.open() as store:
        first, later, earlier = s.at(100), s.at(200), s.at(50)
        await store.schedule_timer("wf", "named:t", first)
        await store.schedule_timer("wf", "named:t", later)
        ctx.expect_equal(
            await store.expired_timers(first), [], "expired_timers at the old fire_at after moving it later"
        )
        ctx.expect_equal(
            await store.expired_timers(later),
            [_entry("wf", "named:t", later)],
            "expired_timers at the new fire_at (exactly one entry)",
        )
        await store.schedule_timer("wf", "named:t", earlier.astimezone(s.PLUS_0530))
        ctx.expect_equal(
            await store.expired_timers(s.at(1000)),
            [_entry("wf", "named:t", earlier)],
            "expired_timers after moving the timer earlier (exactly one entry)",
        )
        # Same timer id under another workflow is a different timer.
        await store.schedule_timer("wf2", "named:t", later)
        ctx.expect_equal(
            await store.expired_timers(s.at(1000)),
            [_entry("wf", "named:t", earlier), _entry("wf2", "named:t", later)],
            "expired_timers with one timer id under two workflows",
        )


async def timer_remove(ctx: ScenarioContext) -> None:
    """remove_timer deletes exactly that (workflow, timer); removing an absent timer is fine."""
    async with ctx.open() as store:
        await store.schedule_timer("wf", "named:a", s.at(10))
        await store.schedule_timer("wf", "named:b", s.at(10))
        await store.schedule_timer("wf2", "named:a", s.at(10))
        await store.remove_timer("wf", "named:a")
        ctx.expect_equal(
            await store.expired_timers(s.at(20)),
            [_entry("wf", "named:b", s.at(10)), _entry("wf2", "named:a", s.at(10))],
            "expired_timers after remove_timer('wf', 'named:a')",
        )
        try:
            await store.remove_timer("wf", "named:a")
            await store.remove_timer("never", "named:x")
        except Exception as exc:
            ctx.fail(
                f"remove_timer of an absent timer raised {type(exc).__name__}: {exc}; it must be a no-op"
            )
        await store.remove_timer("wf", "named:b")
        await store.remove_timer("wf2", "named:a")
        ctx.expect_equal(
            await store.expired_timers(s.at(20)), [], "expired_timers after removing every timer"
        )
        await store.schedule_timer("wf", "named:a", s.at(15))
        ctx.expect_equal(
            await store.expired_timers(s.at(20)),
            [_entry("wf", "named:a", s.at(15))],
            "expired_timers after scheduling a removed timer again",
        )


async def timer_ordering_and_utc(ctx: ScenarioContext) -> None:
    """expired_timers is ordered by (fire_at, workflow_id, timer_id) and returns aware UTC fire_at."""
    async with ctx.open() as store:
        plan = [
            ("wf-b", "named:z", s.at(30, tz=s.PLUS_0530)),
            ("wf-a", "named:z", s.at(30)),
            ("wf-a", "anonymous:1", s.at(30, tz=s.MINUS_0700)),
            ("wf-c", "named:a", s.at(10)),
            ("wf-a", "named:a", s.at(20.000001)),
            ("wf-a", "named:b", s.at(20)),
            ("wf-d", "named:late", s.at(10_000)),
        ]
        for workflow_id, timer_id, fire_at in plan:
            await store.schedule_timer(workflow_id, timer_id, fire_at)
        expected = sorted(_entry(w, t, f) for w, t, f in plan if f <= s.at(30))
        observed = await store.expired_timers(s.at(30))
        ctx.expect_equal(observed, expected, "expired_timers order (fire_at, workflow_id, timer_id)")
        _expect_utc(ctx, observed, "expired_timers")


# --------------------------------------------------------------------------
# Checkpoints, close, cancellation
# --------------------------------------------------------------------------


async def every_method_is_a_checkpoint(ctx: ScenarioContext) -> None:
    """Every method is a cancel point and a schedule point, on success and on error paths."""
    async with ctx.open() as store:
        events = s.markers("cp", 1, 2)
        calls: list[tuple[str, Any, type[BaseException] | None]] = [
            ("append", lambda: store.append("cp", events, 0), None),
            (
                "append with a stale expected_seq",
                lambda: store.append("cp", s.markers("cp", 1, 1), 0),
                SequenceConflict,
            ),
            ("append of an invalid batch", lambda: store.append("cp", [], 2), InvalidBatch),
            ("read_history", lambda: store.read_history("cp"), None),
            ("read_history of an unknown workflow", lambda: store.read_history("nope"), None),
            ("list_active", store.list_active, None),
            ("list_workflow_ids", store.list_workflow_ids, None),
            ("schedule_timer", lambda: store.schedule_timer("cp", "named:t", s.at(5)), None),
            ("expired_timers", lambda: store.expired_timers(s.at(10)), None),
            ("expired_timers with nothing due", lambda: store.expired_timers(s.at(0)), None),
            ("remove_timer", lambda: store.remove_timer("cp", "named:t"), None),
            ("remove_timer of an absent timer", lambda: store.remove_timer("cp", "named:t"), None),
            ("aclose", store.aclose, None),
            ("aclose again", store.aclose, None),
        ]
        closed = trio.ClosedResourceError
        calls += [
            ("append after aclose", lambda: store.append("cp", s.markers("cp", 3, 1), 2), closed),
            ("read_history after aclose", lambda: store.read_history("cp"), closed),
            ("list_active after aclose", store.list_active, closed),
            ("list_workflow_ids after aclose", store.list_workflow_ids, closed),
            ("schedule_timer after aclose", lambda: store.schedule_timer("cp", "named:t", s.at(5)), closed),
            ("remove_timer after aclose", lambda: store.remove_timer("cp", "named:t"), closed),
            ("expired_timers after aclose", lambda: store.expired_timers(s.at(10)), closed),
        ]
        for what, call, raises in calls:
            await ctx.expect_checkpoint(what, call, raises=raises)


async def use_after_close(ctx: ScenarioContext) -> None:
    """After aclose every method raises trio.ClosedResourceError; aclose itself is idempotent."""
    async with ctx.open() as store:
        await _append_ok(ctx, store, "closing", s.markers("closing", 1, 1), 0)
        await store.aclose()
        try:
            await store.aclose()
        except Exception as exc:
            ctx.fail(f"a second aclose() raised {type(exc).__name__}: {exc}; aclose must be idempotent")
        calls: list[tuple[str, Any]] = [
            ("append", lambda: store.append("closing", s.markers("closing", 2, 1), 1)),
            ("append (invalid batch)", lambda: store.append("closing", [], 1)),
            ("read_history", lambda: store.read_history("closing")),
            ("list_active", store.list_active),
            ("list_workflow_ids", store.list_workflow_ids),
            ("schedule_timer", lambda: store.schedule_timer("closing", "named:t", s.at(1))),
            ("remove_timer", lambda: store.remove_timer("closing", "named:t")),
            ("expired_timers", lambda: store.expired_timers(s.at(1))),
        ]
        for what, call in calls:
            with ctx.expect_raises(trio.ClosedResourceError, f"{what} after aclose()"):
                await call()
        try:
            await store.aclose()
        except Exception as exc:
            ctx.fail(f"aclose() after failed calls raised {type(exc).__name__}: {exc}")


async def cancelled_append_is_all_or_nothing(ctx: ScenarioContext) -> None:
    """An append cancelled at any point wrote all of its batch or none; Cancelled means none."""
    async with ctx.open() as store:
        # Trio randomises the order of tasks that wake together, so each
        # cancellation point is probed several times; the probes stop once
        # the append reliably completes before the cancel arrives.
        returned_in_a_row = 0
        for probe in range(CANCEL_PROBES):
            n = probe // CANCEL_REPEATS
            workflow_id = f"cancel-{probe}"
            base = s.markers(workflow_id, 1, 2, tag="base")
            await _append_ok(ctx, store, workflow_id, base, 0)
            batch = s.markers(workflow_id, 3, 3, tag="batch")
            outcome: list[str] = []

            async def attempt(
                workflow_id: str = workflow_id, batch: list[Event] = batch, outcome: list[str] = outcome
            ) -> None:
                try:
                    await store.append(workflow_id, batch, 2)
                except trio.Cancelled:
                    outcome.append("raised Cancelled")
                    raise
                except Exception as exc:
                    outcome.append(f"raised {type(exc).__name__}: {exc}")
                    return
                outcome.append("returned")

            async with trio.open_nursery() as nursery:
                nursery.start_soon(attempt)
                for _ in range(n):
                    await trio.lowlevel.checkpoint()
                nursery.cancel_scope.cancel()
            history = await store.read_history(workflow_id)
            what = f"append cancelled after {n} checkpoints of the caller"
            if outcome == ["raised Cancelled"]:
                ctx.expect_equal(
                    history, base, f"{what} raised Cancelled, so history must not hold the batch"
                )
                returned_in_a_row = 0
            elif outcome == ["returned"]:
                ctx.expect_equal(
                    history, base + batch, f"{what} returned, so history must hold the whole batch"
                )
                returned_in_a_row += 1
            else:
                got = outcome[0] if outcome else "never finished"
                ctx.fail(f"{what}: append {got}; expected it to return or raise Cancelled")
            more = s.markers(workflow_id, len(history) + 1, 1, tag="after")
            await _append_ok(ctx, store, workflow_id, more, len(history))
            await _expect_history(ctx, store, workflow_id, history + more, f"{what}, then one more append")
            if returned_in_a_row >= CANCEL_SETTLED:
                break
