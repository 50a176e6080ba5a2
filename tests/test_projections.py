"""Projections: property tests over generated valid histories, plus examples.

The generator below plays a small model of the engine: it emits only histories
the engine could record (runs that start, schedule and attempt activities,
arm/fire/cancel timers, end, get reopened after Failed/Cancelled, continue as
new into a successor whose start may still be owed), and keeps its own model
of what is settled, armed and owed.  The properties compare the projections
with that model and with naive reference functions written here, differently
from the implementation (backward scans, per-item state machines).
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Sequence
from datetime import datetime, timedelta, timezone
from typing import Any

import attrs
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from aion_trio import (
    ActivityAdvisoryExhausted,
    ActivityCancelled,
    ActivityCompleted,
    ActivityError,
    ActivityFailed,
    ActivityFallbackRouted,
    ActivityScheduled,
    ActivityStarted,
    AionInternalError,
    ErrorInfo,
    Event,
    EventBody,
    FailureCause,
    MarkerRecorded,
    Payload,
    SearchAttributesUpserted,
    SignalReceived,
    TimerCancelCause,
    TimerCancelled,
    TimerFired,
    TimerStarted,
    WorkflowCancelRequested,
    WorkflowCompleted,
    WorkflowContinuedAsNew,
    WorkflowFailed,
    WorkflowFailure,
    WorkflowReopened,
    WorkflowStarted,
    WorkflowStatus,
    WorkflowTimedOut,
)
from aion_trio._chain import ChainPosition, ChainState, follow_chain, settled_result, successor_run_id
from aion_trio._projections import (
    RunState,
    activity_settled_or_run_ended,
    latest_run,
    search_attributes_of,
)
from aion_trio.events import WorkflowCancelled
from aion_trio.projections import (
    AttemptRecord,
    FailureSummary,
    OutstandingTimer,
    activity_settled,
    current_lease_terminal,
    failure,
    is_active,
    is_active_status,
    latest_run_id,
    next_delivery_attempt,
    outstanding_timers,
    retry_trail,
    run_ids,
    run_segment,
    run_status,
    scheduled_activities,
    search_attributes,
    start_event,
    status_after,
    timer_resolved,
    unsettled_activities,
    workflow_status,
)

WF = "wf-1"
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
NULL = Payload.of(None)
LIFECYCLE = (
    WorkflowStarted,
    WorkflowReopened,
    WorkflowCompleted,
    WorkflowFailed,
    WorkflowCancelled,
    WorkflowTimedOut,
    WorkflowContinuedAsNew,
)
STATUS_OF = {
    WorkflowStarted: WorkflowStatus.RUNNING,
    WorkflowReopened: WorkflowStatus.RUNNING,
    WorkflowCompleted: WorkflowStatus.COMPLETED,
    WorkflowFailed: WorkflowStatus.FAILED,
    WorkflowCancelled: WorkflowStatus.CANCELLED,
    WorkflowTimedOut: WorkflowStatus.TIMED_OUT,
    WorkflowContinuedAsNew: WorkflowStatus.CONTINUED_AS_NEW,
}


def rid(n: int) -> str:
    return str(uuid.UUID(int=n, version=4))


def envelope(bodies: Sequence[EventBody], first_seq: int = 1) -> list[Event]:
    return [
        Event(workflow_id=WF, seq=first_seq + i, recorded_at=T0 + timedelta(seconds=first_seq + i), body=b)
        for i, b in enumerate(bodies)
    ]


def aerr(cause: FailureCause = FailureCause.RETRYABLE, message: str = "boom") -> ActivityError:
    return ActivityError(cause=cause, type="RuntimeError", message=message)


# --------------------------------------------------------------------------
# The generator: a model of the engine that emits valid histories
# --------------------------------------------------------------------------


@attrs.define
class ActivityModel:
    in_flight: int | None = None  # an attempt started without an outcome yet
    last_attempt: int = 0
    settled_by: str | None = None  # "completed" | "failed" | "cancelled"

    def next_attempt(self) -> int | None:
        if self.settled_by is not None:
            return None
        return self.in_flight if self.in_flight is not None else self.last_attempt + 1


@attrs.define
class RunModel:
    run_id: str
    activities: dict[int, ActivityModel] = attrs.field(factory=dict)
    #: timer id -> (state, fire_at); state is armed | fired | cancelled | torn_down
    timers: dict[str, tuple[str, datetime]] = attrs.field(factory=dict)
    lease_open: bool = True
    terminal: type | None = None
    next_anonymous: int = 0
    attrs_now: dict[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class RunSnapshot:
    """What the model says about a run at the end of its segment."""

    run_id: str
    settled: frozenset[int]
    next_attempts: dict[int, int]
    armed: dict[str, datetime]
    lease_open: bool
    terminal: type | None
    search_attributes: dict[str, Any]


@attrs.frozen
class History:
    events: list[Event]
    runs: list[RunSnapshot]
    #: True if the last run ended in ContinuedAsNew and its successor has not started.
    successor_owed: bool


def _snapshot(run: RunModel) -> RunSnapshot:
    return RunSnapshot(
        run_id=run.run_id,
        settled=frozenset(a for a, m in run.activities.items() if m.settled_by is not None),
        next_attempts={a: n for a, m in run.activities.items() if (n := m.next_attempt()) is not None},
        armed={t: at for t, (state, at) in run.timers.items() if state == "armed"},
        lease_open=run.lease_open,
        terminal=run.terminal,
        search_attributes=dict(run.attrs_now),
    )


@st.composite
def histories(draw: st.DrawFn, max_events: int = 60) -> History:
    bodies: list[EventBody] = []
    snapshots: list[RunSnapshot] = []
    run_counter = 0

    def new_run(parent: str | None) -> RunModel:
        nonlocal run_counter
        run_counter += 1
        run = RunModel(run_id=rid(run_counter))
        sa = draw(st.dictionaries(st.sampled_from(["a", "b", "c"]), st.integers(0, 9), max_size=2))
        run.attrs_now.update(sa)
        bodies.append(
            WorkflowStarted(
                workflow_type="wf",
                input=NULL,
                run_id=run.run_id,
                parent_run_id=parent,
                search_attributes=sa,
            )
        )
        return run

    run = new_run(None)
    successor_owed = False
    clock = 0

    while len(bodies) < max_events:
        clock += 1
        if run.lease_open:
            _running_step(draw, run, bodies, clock)
            continue
        # The lease has ended: reopen, continue, start anew, or stop here.
        if run.terminal is WorkflowContinuedAsNew:
            if draw(st.booleans()):
                successor_owed = True
                break
            snapshots.append(_snapshot(run))
            run = new_run(run.run_id)
            continue
        choices = ["stop", "new_run"]
        if run.terminal in (WorkflowFailed, WorkflowCancelled):
            choices = ["reopen", "reopen", "reopen", *choices]
        choice = draw(st.sampled_from(choices))
        if choice == "stop":
            break
        if choice == "new_run":  # workflow-id reuse after a closed run
            snapshots.append(_snapshot(run))
            run = new_run(None)
            continue
        reopenable = sorted(a for a, m in run.activities.items() if m.settled_by in ("failed", "cancelled"))
        reopened = draw(st.lists(st.sampled_from(reopenable), unique=True, min_size=1)) if reopenable else []
        if reopened and draw(st.integers(0, 3)) == 3:
            reopened = []
        for a in reopened:
            run.activities[a].settled_by = None
        for t, (state, at) in run.timers.items():
            if state == "torn_down":
                run.timers[t] = ("armed", at)
        run.lease_open = True
        run.terminal = None
        bodies.append(WorkflowReopened(run_id=run.run_id, reopened_activity_ids=tuple(reopened)))
    else:
        successor_owed = False
    snapshots.append(_snapshot(run))
    return History(events=envelope(bodies), runs=snapshots, successor_owed=successor_owed)


def _running_step(draw: st.DrawFn, run: RunModel, bodies: list[EventBody], clock: int) -> None:
    acts = run.activities
    unsettled = sorted(a for a, m in acts.items() if m.settled_by is None)
    idle = [a for a in unsettled if acts[a].in_flight is None]
    busy = [a for a in unsettled if acts[a].in_flight is not None]
    armed = sorted(t for t, (s, _) in run.timers.items() if s == "armed")
    restartable = sorted(
        t for t, (s, _) in run.timers.items() if s in ("fired", "cancelled") and t.startswith("named:")
    )

    # Weighted by repetition; Hypothesis leans toward the first entry, so the
    # most productive action for the current state goes first.
    actions: list[str] = []
    if busy:
        actions += ["outcome", "trail_failure", "trail_failure", "outcome", "redeliver", "fallback"]
    if idle:
        actions += ["start", "start", "start", "cancel_unstarted"]
    actions += ["schedule", "schedule", "timer", "filler", "terminal"]
    if armed:
        actions += ["fire", "cancel_timer"]
    if restartable:
        actions.append("restart_timer")
    action = draw(st.sampled_from(actions))

    if action == "schedule":
        aid = len(acts)
        acts[aid] = ActivityModel()
        bodies.append(ActivityScheduled(activity_id=aid, activity_type=f"act{aid % 3}", input=NULL))
    elif action == "start":
        aid = draw(st.sampled_from(idle))
        m = acts[aid]
        m.last_attempt += 1
        m.in_flight = m.last_attempt
        bodies.append(ActivityStarted(activity_id=aid, attempt=m.in_flight))
    elif action == "redeliver":  # worker lost: the same attempt goes on the wire again
        aid = draw(st.sampled_from(busy))
        bodies.append(ActivityStarted(activity_id=aid, attempt=acts[aid].in_flight))  # type: ignore[arg-type]
    elif action == "cancel_unstarted":
        aid = draw(st.sampled_from(idle))
        m = acts[aid]
        m.last_attempt += 1
        m.settled_by = "cancelled"
        bodies.append(ActivityCancelled(activity_id=aid, attempt=m.last_attempt))
    elif action == "trail_failure":
        aid = draw(st.sampled_from(busy))
        m = acts[aid]
        attempt, m.in_flight = m.in_flight, None
        bodies.append(ActivityFailed(activity_id=aid, error=aerr(), attempt=attempt, final=False))  # type: ignore[arg-type]
    elif action == "outcome":
        aid = draw(st.sampled_from(busy))
        m = acts[aid]
        attempt, m.in_flight = m.in_flight, None
        assert attempt is not None
        kind = draw(st.sampled_from(["completed", "failed", "cancelled"]))
        m.settled_by = kind
        if kind == "completed":
            bodies.append(ActivityCompleted(activity_id=aid, result=NULL, attempt=attempt))
        elif kind == "failed":
            cause = draw(st.sampled_from(list(FailureCause)))
            bodies.append(ActivityFailed(activity_id=aid, error=aerr(cause), attempt=attempt, final=True))
        else:
            bodies.append(ActivityCancelled(activity_id=aid, attempt=attempt))
    elif action == "fallback":
        aid = draw(st.sampled_from(busy))
        attempt = acts[aid].in_flight
        assert attempt is not None
        bodies.append(
            ActivityFallbackRouted(
                activity_id=aid, attempt=attempt, from_task_queue="q", to_task_queue="q2", fallback_index=0
            )
        )
    elif action in ("timer", "restart_timer"):
        if action == "restart_timer":
            timer_id = draw(st.sampled_from(restartable))
        elif draw(st.booleans()):
            timer_id = f"anonymous:{run.next_anonymous}"
            run.next_anonymous += 1
        else:
            timer_id = f"named:t{len(run.timers)}"
        fire_at = T0 + timedelta(seconds=draw(st.integers(0, 5)))  # ties on purpose
        run.timers[timer_id] = ("armed", fire_at)
        bodies.append(TimerStarted(timer_id=timer_id, fire_at=fire_at))
    elif action == "fire":
        timer_id = draw(st.sampled_from(armed))
        run.timers[timer_id] = ("fired", run.timers[timer_id][1])
        bodies.append(TimerFired(timer_id=timer_id))
    elif action == "cancel_timer":
        timer_id = draw(st.sampled_from(armed))
        run.timers[timer_id] = ("cancelled", run.timers[timer_id][1])
        bodies.append(TimerCancelled(timer_id=timer_id, cause=TimerCancelCause.WORKFLOW_INTENT))
    elif action == "filler":
        kind = draw(st.sampled_from(["signal", "marker", "upsert", "cancel_requested", "advisory"]))
        if kind == "signal":
            bodies.append(SignalReceived(name="go", payload=NULL))
        elif kind == "marker":
            bodies.append(MarkerRecorded(name="m", value=NULL))
        elif kind == "upsert":
            upsert = draw(
                st.dictionaries(st.sampled_from(["a", "b", "c"]), st.integers(0, 9), min_size=1, max_size=2)
            )
            run.attrs_now.update(upsert)
            bodies.append(SearchAttributesUpserted(attributes=upsert))
        elif kind == "cancel_requested":
            bodies.append(WorkflowCancelRequested(reason="asked"))
        elif acts:
            aid = draw(st.sampled_from(sorted(acts)))
            bodies.append(
                ActivityAdvisoryExhausted(
                    activity_id=aid,
                    activity_type="a",
                    reason="budget",
                    attempt=max(acts[aid].last_attempt, 1),
                )
            )
    else:
        _terminal(draw, run, bodies)


def _terminal(draw: st.DrawFn, run: RunModel, bodies: list[EventBody]) -> None:
    # Failed and Cancelled twice as likely: they lead to reopens, the subtle cases.
    terminal = draw(
        st.sampled_from(
            [
                WorkflowFailed,
                WorkflowCancelled,
                WorkflowFailed,
                WorkflowCancelled,
                WorkflowCompleted,
                WorkflowTimedOut,
                WorkflowContinuedAsNew,
            ]
        )
    )
    if terminal in (WorkflowFailed, WorkflowCancelled):
        # Teardown: cancel in-flight attempts (always on cancel, sometimes on
        # failure — otherwise they are abandoned and re-delivered after a
        # reopen) and retire armed timers so a reopen can re-arm them.
        for aid, m in sorted(run.activities.items()):
            if m.in_flight is not None and (terminal is WorkflowCancelled or draw(st.booleans())):
                bodies.append(ActivityCancelled(activity_id=aid, attempt=m.in_flight))
                m.in_flight = None
                m.settled_by = "cancelled"
        for timer_id, (state, at) in sorted(run.timers.items()):
            if state == "armed" and (terminal is WorkflowCancelled or draw(st.booleans())):
                bodies.append(TimerCancelled(timer_id=timer_id, cause=TimerCancelCause.CANCEL_TEARDOWN))
                run.timers[timer_id] = ("torn_down", at)
    if terminal is WorkflowCompleted:
        bodies.append(WorkflowCompleted(result=NULL))
    elif terminal is WorkflowFailed:
        bodies.append(WorkflowFailed(error=ErrorInfo(type="RuntimeError", message="workflow failed")))
    elif terminal is WorkflowCancelled:
        bodies.append(WorkflowCancelled(reason="asked"))
    elif terminal is WorkflowTimedOut:
        bodies.append(WorkflowTimedOut())
    else:
        bodies.append(WorkflowContinuedAsNew(input=NULL, parent_run_id=run.run_id))
    run.lease_open = False
    run.terminal = terminal


# --------------------------------------------------------------------------
# Naive references (written differently from the implementation)
# --------------------------------------------------------------------------


def ref_segments(events: Sequence[Event]) -> list[list[Event]]:
    starts = [i for i, e in enumerate(events) if isinstance(e.body, WorkflowStarted)]
    return [list(events[a:b]) for a, b in zip(starts, [*starts[1:], len(events)], strict=True)]


def ref_status(events: Sequence[Event]) -> WorkflowStatus | None:
    lifecycle = [e for e in events if isinstance(e.body, LIFECYCLE)]
    return STATUS_OF[type(lifecycle[-1].body)] if lifecycle else None


def ref_lease_terminal(segment: Sequence[Event]) -> Event | None:
    lifecycle = [e for e in segment if isinstance(e.body, LIFECYCLE)]
    if not lifecycle or isinstance(lifecycle[-1].body, (WorkflowStarted, WorkflowReopened)):
        return None
    return lifecycle[-1]


def _about(event: Event, activity_id: int) -> bool:
    return getattr(event.body, "activity_id", None) == activity_id


def ref_settled(segment: Sequence[Event], activity_id: int) -> Event | None:
    for event in reversed(segment):
        body = event.body
        if isinstance(body, WorkflowReopened) and activity_id in body.reopened_activity_ids:
            return None
        if _about(event, activity_id) and (
            isinstance(body, (ActivityCompleted, ActivityCancelled))
            or (isinstance(body, ActivityFailed) and body.final)
        ):
            return event
    return None


def ref_next_attempt(segment: Sequence[Event], activity_id: int) -> int | None:
    if ref_settled(segment, activity_id) is not None:
        return None
    attempts = [
        e.body
        for e in segment
        if _about(e, activity_id)
        and isinstance(e.body, (ActivityStarted, ActivityFailed, ActivityCancelled, ActivityCompleted))
    ]
    if not attempts:
        return 1
    last = attempts[-1]
    return last.attempt if isinstance(last, ActivityStarted) else last.attempt + 1


def ref_outstanding(segment: Sequence[Event]) -> list[OutstandingTimer]:
    ids = {e.body.timer_id for e in segment if isinstance(e.body, TimerStarted)}
    out = []
    for timer_id in ids:
        state, fire_at = "none", None
        for event in segment:
            body = event.body
            if isinstance(body, TimerStarted) and body.timer_id == timer_id:
                state, fire_at = "armed", body.fire_at
            elif isinstance(body, TimerFired) and body.timer_id == timer_id:
                state = "done"
            elif isinstance(body, TimerCancelled) and body.timer_id == timer_id:
                state = "torn" if body.cause is TimerCancelCause.CANCEL_TEARDOWN else "done"
            elif isinstance(body, WorkflowReopened) and state == "torn":
                state = "armed"
        if state == "armed":
            assert fire_at is not None
            out.append(OutstandingTimer(timer_id=timer_id, fire_at=fire_at))
    return sorted(out, key=lambda t: (t.fire_at, t.timer_id))


def scheduled_ids(segment: Sequence[Event]) -> list[int]:
    return [e.body.activity_id for e in segment if isinstance(e.body, ActivityScheduled)]


# --------------------------------------------------------------------------
# Properties: each check_* is one property; the test_*_properties below run
# them in groups so each generated history is used several times.
# --------------------------------------------------------------------------

PROPERTY_SETTINGS = settings(
    max_examples=120, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def check_history_is_valid(h: History) -> None:
    # Guard the generator itself: contiguous seqs, starts first, unique run ids.
    assert [e.seq for e in h.events] == list(range(1, len(h.events) + 1))
    assert isinstance(h.events[0].body, WorkflowStarted)
    assert len(set(run_ids(h.events))) == len(run_ids(h.events)) == len(h.runs)


def _features(h: History) -> set[str]:
    out = set()
    bodies = [e.body for e in h.events]
    for i, body in enumerate(bodies):
        before = bodies[:i]
        if isinstance(body, WorkflowReopened):
            out.add("reopen_with_activities" if body.reopened_activity_ids else "reopen_without_activities")
            torn = {
                b.timer_id
                for b in before
                if isinstance(b, TimerCancelled) and b.cause is TimerCancelCause.CANCEL_TEARDOWN
            }
            if torn and any(isinstance(b, TimerFired) and b.timer_id in torn for b in bodies[i:]):
                out.add("rearmed_timer_fires")
        if isinstance(body, WorkflowStarted) and body.parent_run_id is not None:
            out.add("continued_as_new_successor")
        if isinstance(body, WorkflowStarted) and i > 0 and body.parent_run_id is None:
            out.add("id_reuse_new_run")
        if (
            isinstance(body, ActivityStarted)
            and ActivityStarted(activity_id=body.activity_id, attempt=body.attempt) in before
        ):
            out.add("redelivery")
        if isinstance(body, ActivityStarted) and body.attempt >= 3:
            out.add("third_attempt")
        if isinstance(body, ActivityFailed):
            out.add("final_failure" if body.final else "trail_failure")
        if isinstance(body, ActivityCancelled) and not any(
            isinstance(b, ActivityStarted) and b.activity_id == body.activity_id for b in before
        ):
            out.add("cancel_unstarted")
        if isinstance(body, TimerStarted) and any(
            isinstance(b, TimerStarted) and b.timer_id == body.timer_id for b in before
        ):
            out.add("timer_restart")
    if h.successor_owed:
        out.add("successor_owed")
    if len(h.runs) >= 3:
        out.add("three_runs")
    return out


def test_the_generator_reaches_every_interesting_shape() -> None:
    # Guard against a generator that silently stops producing the cases the
    # properties are about (every property would still pass, vacuously).
    seen: set[str] = set()

    @PROPERTY_SETTINGS
    @given(h=histories())
    def collect(h: History) -> None:
        seen.update(_features(h))

    collect()
    assert seen >= {
        "reopen_with_activities",
        "reopen_without_activities",
        "rearmed_timer_fires",
        "continued_as_new_successor",
        "id_reuse_new_run",
        "redelivery",
        "third_attempt",
        "final_failure",
        "trail_failure",
        "cancel_unstarted",
        "timer_restart",
        "successor_owed",
        "three_runs",
    }


def check_a_segments_partition_the_history(h: History) -> None:
    ids = run_ids(h.events)
    segments = [run_segment(h.events, r) for r in ids]
    assert [e for seg in segments for e in seg] == h.events
    for r, seg in zip(ids, segments, strict=True):
        assert isinstance(seg[0].body, WorkflowStarted)
        assert seg[0].body.run_id == r
        assert start_event(h.events, r) == seg[0]
        assert sum(isinstance(e.body, WorkflowStarted) for e in seg) == 1
    assert segments == ref_segments(h.events)
    assert latest_run_id(h.events) == (ids[-1] if ids else None)
    assert run_segment(h.events, rid(10**6)) == []
    assert start_event(h.events, rid(10**6)) is None


def check_b_status_after_folded_over_any_split_equals_workflow_status(
    h: History, data: st.DataObject
) -> None:
    n = len(h.events)
    cuts = sorted(data.draw(st.sets(st.integers(1, max(n - 1, 1)), max_size=6)))
    bounds = [0, *[c for c in cuts if c < n], n]
    status: WorkflowStatus | None = None
    for a, b in itertools.pairwise(bounds):
        status = status_after(status, h.events[a:b])
    assert status == workflow_status(h.events) == ref_status(h.events)
    # Every prefix is a valid history too, and an empty batch changes nothing.
    for i in range(n + 1):
        assert workflow_status(h.events[:i]) == ref_status(h.events[:i])
        assert status_after(workflow_status(h.events[:i]), []) == workflow_status(h.events[:i])


def check_c_current_lease_terminal_is_none_iff_the_last_lifecycle_event_is_a_start_or_reopen(
    h: History,
) -> None:
    for seg in ref_segments(h.events):
        for i in range(1, len(seg) + 1):
            prefix = seg[:i]
            got = current_lease_terminal(prefix)
            assert got == ref_lease_terminal(prefix)
            lifecycle = [e for e in prefix if isinstance(e.body, LIFECYCLE)]
            assert (got is None) == isinstance(lifecycle[-1].body, (WorkflowStarted, WorkflowReopened))
            if got is not None:
                assert got.is_terminal


def check_d_only_the_latest_run_can_be_running(h: History) -> None:
    ids = run_ids(h.events)
    for r, snap in zip(ids, h.runs, strict=True):
        status = run_status(h.events, r)
        if r != ids[-1]:
            assert status is not WorkflowStatus.RUNNING
            assert status is not None
        assert (status is WorkflowStatus.RUNNING) == snap.lease_open
        if snap.terminal is not None:
            assert status is STATUS_OF[snap.terminal]
    assert workflow_status(h.events) == run_status(h.events, ids[-1])
    assert run_status(h.events, rid(10**6)) is None
    # list_active's rule: running, or a continued-as-new whose successor start is owed.
    assert is_active(h.events) == (h.runs[-1].lease_open or h.successor_owed)


def check_e_activity_settled_agrees_with_the_reference_and_the_model(h: History, data: st.DataObject) -> None:
    for seg, snap in zip(ref_segments(h.events), h.runs, strict=True):
        ids = scheduled_ids(seg)
        for aid in ids:
            got = activity_settled(seg, aid)
            assert got == ref_settled(seg, aid)
            assert (got is not None) == (aid in snap.settled)
        assert unsettled_activities(seg) == sorted(a for a in ids if a not in snap.settled)
        assert sorted(scheduled_activities(seg)) == ids
        # And at an arbitrary point inside the segment.
        cut = data.draw(st.integers(1, len(seg)))
        for aid in scheduled_ids(seg[:cut]):
            assert activity_settled(seg[:cut], aid) == ref_settled(seg[:cut], aid)
    # The recorder's one-pass check agrees with the segment projections, on every
    # prefix of the whole history (later runs and all), for every run and activity.
    cut = data.draw(st.integers(1, len(h.events)))
    prefix = h.events[:cut]
    for r in [*run_ids(h.events), rid(10**6)]:
        seg = run_segment(prefix, r)
        for aid in [*scheduled_ids(seg), 10**6]:
            expected = activity_settled(seg, aid) is not None or current_lease_terminal(seg) is not None
            assert activity_settled_or_run_ended(prefix, r, aid) == expected
    # The recorder's incremental index (RunState, fed the history as it grows in place,
    # in uneven batches) answers the same question after every batch.
    for r in [*run_ids(h.events), rid(10**6)]:
        grown: list[Event] = []
        state = RunState(r, grown)
        at = 0
        while at < len(h.events):
            at = min(len(h.events), at + data.draw(st.integers(1, 4)))
            grown.extend(h.events[len(grown) : at])
            state.sync()
            seg = run_segment(grown, r)
            assert state.ended == current_lease_terminal(seg)
            assert state.status == run_status(grown, r)
            for aid in [*scheduled_ids(seg), 10**6]:
                assert (aid in state.settled) == (activity_settled(seg, aid) is not None)
                assert state.settled.get(aid) == activity_settled(seg, aid)


def check_f_next_delivery_attempt(h: History, data: st.DataObject) -> None:
    for seg, snap in zip(ref_segments(h.events), h.runs, strict=True):
        for aid in scheduled_ids(seg):
            got = next_delivery_attempt(seg, aid)
            assert (got is None) == (activity_settled(seg, aid) is not None)
            assert got == ref_next_attempt(seg, aid)
            assert got == snap.next_attempts.get(aid)
        cut = data.draw(st.integers(1, len(seg)))
        for aid in scheduled_ids(seg[:cut]):
            assert next_delivery_attempt(seg[:cut], aid) == ref_next_attempt(seg[:cut], aid)
        assert next_delivery_attempt(seg, 10**6) is None  # never scheduled


def check_g_outstanding_timers(h: History, data: st.DataObject) -> None:
    for seg, snap in zip(ref_segments(h.events), h.runs, strict=True):
        got = outstanding_timers(seg)
        assert got == ref_outstanding(seg)
        assert {t.timer_id: t.fire_at for t in got} == snap.armed
        assert got == sorted(got, key=lambda t: (t.fire_at, t.timer_id))
        cut = data.draw(st.integers(1, len(seg)))
        assert outstanding_timers(seg[:cut]) == ref_outstanding(seg[:cut])
        # timer_resolved agrees: a timer is outstanding iff it is not resolved, outside torn-down ones.
        for timer_id in {e.body.timer_id for e in seg if isinstance(e.body, TimerStarted)}:
            resolved = timer_resolved(seg, timer_id)
            if timer_id in snap.armed:
                assert resolved is None or (
                    isinstance(resolved.body, TimerCancelled)
                    and resolved.body.cause is TimerCancelCause.CANCEL_TEARDOWN
                )
            else:
                assert resolved is not None


def check_h_retry_trail_attempts_strictly_increase_and_match_the_history(h: History) -> None:
    for seg in ref_segments(h.events):
        for aid in scheduled_ids(seg):
            trail = retry_trail(seg, aid)
            attempts = [r.attempt for r in trail]
            assert all(a < b for a, b in itertools.pairwise(attempts))
            recorded = {
                e.body.attempt
                for e in seg
                if _about(e, aid)
                and isinstance(
                    e.body, (ActivityStarted, ActivityFailed, ActivityCancelled, ActivityCompleted)
                )
            }
            assert set(attempts) == recorded
            for record in trail:
                if record.outcome == "running":
                    assert record.error is None
                    assert not record.final
                if record.outcome == "failed":
                    assert record.error is not None


def check_search_attributes_fold_the_start_and_upserts_of_the_run(h: History) -> None:
    for r, snap in zip(run_ids(h.events), h.runs, strict=True):
        assert search_attributes(h.events, r) == snap.search_attributes
    assert search_attributes(h.events) == h.runs[-1].search_attributes


@PROPERTY_SETTINGS
@given(h=histories(), data=st.data())
def test_run_and_status_properties(h: History, data: st.DataObject) -> None:
    check_history_is_valid(h)
    check_a_segments_partition_the_history(h)
    check_b_status_after_folded_over_any_split_equals_workflow_status(h, data)
    check_c_current_lease_terminal_is_none_iff_the_last_lifecycle_event_is_a_start_or_reopen(h)
    check_d_only_the_latest_run_can_be_running(h)
    check_search_attributes_fold_the_start_and_upserts_of_the_run(h)


@PROPERTY_SETTINGS
@given(h=histories(), data=st.data())
def test_activity_properties(h: History, data: st.DataObject) -> None:
    check_e_activity_settled_agrees_with_the_reference_and_the_model(h, data)
    check_f_next_delivery_attempt(h, data)
    check_h_retry_trail_attempts_strictly_increase_and_match_the_history(h)


@PROPERTY_SETTINGS
@given(h=histories(), data=st.data())
def test_timer_properties(h: History, data: st.DataObject) -> None:
    check_g_outstanding_timers(h, data)


# --------------------------------------------------------------------------
# Examples
# --------------------------------------------------------------------------

R1, R2 = rid(1), rid(2)


def start(run_id: str = R1, **kw: Any) -> WorkflowStarted:
    return WorkflowStarted(workflow_type="wf", input=NULL, run_id=run_id, **kw)


def sched(aid: int, kind: str = "charge") -> ActivityScheduled:
    return ActivityScheduled(activity_id=aid, activity_type=kind, input=NULL)


def failed(
    aid: int, attempt: int, final: bool, cause: FailureCause = FailureCause.RETRYABLE
) -> ActivityFailed:
    return ActivityFailed(
        activity_id=aid, error=aerr(cause, f"attempt {attempt}"), attempt=attempt, final=final
    )


WF_FAILED = WorkflowFailed(error=ErrorInfo(type="PaymentError", message="card declined"))


def test_run_segment_stops_at_the_next_start() -> None:
    events = envelope(
        [
            start(R1),
            sched(0),
            WorkflowContinuedAsNew(input=NULL, parent_run_id=R1),
            start(R2, parent_run_id=R1),
        ]
    )
    assert [e.seq for e in run_segment(events, R1)] == [1, 2, 3]
    assert [e.seq for e in run_segment(events, R2)] == [4]
    assert run_ids(events) == [R1, R2]
    assert latest_run_id(events) == R2
    assert latest_run_id([]) is None
    assert run_segment([], R1) == []


def test_current_lease_terminal_examples() -> None:
    seg = envelope([start(), WF_FAILED, WorkflowReopened(run_id=R1), sched(0)])
    assert current_lease_terminal(seg) is None
    assert current_lease_terminal(seg[:2]) == seg[1]
    seg = envelope([start(), WorkflowCompleted(result=NULL), SignalReceived(name="late", payload=NULL)])
    assert current_lease_terminal(seg) == seg[1]
    assert current_lease_terminal([]) is None


def test_cancel_requested_is_not_a_terminal() -> None:
    events = envelope([start(), WorkflowCancelRequested(reason="x")])
    assert workflow_status(events) is WorkflowStatus.RUNNING
    assert current_lease_terminal(events) is None


@pytest.mark.parametrize(
    ("status", "active"),
    [
        (None, False),
        (WorkflowStatus.RUNNING, True),
        (WorkflowStatus.CONTINUED_AS_NEW, True),
        (WorkflowStatus.COMPLETED, False),
        (WorkflowStatus.FAILED, False),
        (WorkflowStatus.CANCELLED, False),
        (WorkflowStatus.TIMED_OUT, False),
    ],
)
def test_is_active_status(status: WorkflowStatus | None, active: bool) -> None:
    assert is_active_status(status) is active


def test_status_follows_reopen_and_continue_as_new() -> None:
    events = envelope(
        [
            start(R1),
            WF_FAILED,
            WorkflowReopened(run_id=R1),
            WorkflowContinuedAsNew(input=NULL, parent_run_id=R1),
            start(R2, parent_run_id=R1),
        ]
    )
    statuses = [workflow_status(events[: i + 1]) for i in range(len(events))]
    assert statuses == [
        WorkflowStatus.RUNNING,
        WorkflowStatus.FAILED,
        WorkflowStatus.RUNNING,
        WorkflowStatus.CONTINUED_AS_NEW,
        WorkflowStatus.RUNNING,
    ]
    assert [is_active(events[: i + 1]) for i in range(len(events))] == [True, False, True, True, True]
    assert run_status(events, R1) is WorkflowStatus.CONTINUED_AS_NEW
    assert run_status(events, R2) is WorkflowStatus.RUNNING
    assert workflow_status([]) is None
    assert status_after(WorkflowStatus.COMPLETED, []) is WorkflowStatus.COMPLETED


def test_activity_settlement_examples() -> None:
    seg = envelope(
        [
            start(),
            sched(0),
            ActivityStarted(activity_id=0, attempt=1),
            failed(0, 1, final=False),
            ActivityStarted(activity_id=0, attempt=2),
            failed(0, 2, final=True, cause=FailureCause.TERMINAL),
            WF_FAILED,
            WorkflowReopened(run_id=R1, reopened_activity_ids=(0,)),
            ActivityStarted(activity_id=0, attempt=3),
            ActivityCompleted(activity_id=0, result=NULL, attempt=3),
        ]
    )
    assert activity_settled(seg[:4], 0) is None  # a non-final failure is a trail record
    assert next_delivery_attempt(seg[:4], 0) == 2
    assert next_delivery_attempt(seg[:5], 0) == 2  # started, no outcome: same number again
    assert activity_settled(seg[:6], 0) == seg[5]
    assert next_delivery_attempt(seg[:6], 0) is None
    assert activity_settled(seg[:8], 0) is None  # reopened
    assert next_delivery_attempt(seg[:8], 0) == 3
    assert activity_settled(seg, 0) == seg[9]
    assert next_delivery_attempt(seg[:2], 0) == 1
    assert next_delivery_attempt(seg, 5) is None  # never scheduled
    assert unsettled_activities(seg[:8]) == [0]
    assert unsettled_activities(seg) == []
    assert retry_trail(seg, 0) == [
        AttemptRecord(
            attempt=1, started_at=seg[2].recorded_at, outcome="failed", error=seg[3].body.error, final=False
        ),
        AttemptRecord(
            attempt=2, started_at=seg[4].recorded_at, outcome="failed", error=seg[5].body.error, final=True
        ),
        AttemptRecord(attempt=3, started_at=seg[8].recorded_at, outcome="completed", final=True),
    ]


def test_a_cancelled_activity_is_settled_and_a_reopen_only_unsettles_the_named_ones() -> None:
    seg = envelope(
        [
            start(),
            sched(0),
            sched(1),
            ActivityCancelled(activity_id=0, attempt=1),
            ActivityStarted(activity_id=1, attempt=1),
            ActivityCancelled(activity_id=1, attempt=1),
            WorkflowCancelled(reason="x"),
            WorkflowReopened(run_id=R1, reopened_activity_ids=(1,)),
        ]
    )
    assert activity_settled(seg, 0) == seg[3]
    assert activity_settled(seg, 1) is None
    assert next_delivery_attempt(seg, 1) == 2
    assert retry_trail(seg, 0) == [AttemptRecord(attempt=1, started_at=None, outcome="cancelled", final=True)]


def test_retry_trail_running_attempt_and_redelivery() -> None:
    seg = envelope(
        [
            start(),
            sched(0),
            ActivityStarted(activity_id=0, attempt=1),
            ActivityStarted(activity_id=0, attempt=1),
        ]
    )
    assert retry_trail(seg, 0) == [AttemptRecord(attempt=1, started_at=seg[3].recorded_at, outcome="running")]
    assert next_delivery_attempt(seg, 0) == 1
    assert retry_trail(seg, 1) == []


def test_outstanding_timers_examples() -> None:
    later, sooner = T0 + timedelta(hours=2), T0 + timedelta(hours=1)
    seg = envelope(
        [
            start(),
            TimerStarted(timer_id="named:b", fire_at=later),
            TimerStarted(timer_id="named:a", fire_at=later),
            TimerStarted(timer_id="anonymous:0", fire_at=sooner),
            TimerStarted(timer_id="anonymous:1", fire_at=sooner),
            TimerFired(timer_id="anonymous:1"),
        ]
    )
    # Ordered by fire time, then id.
    assert [t.timer_id for t in outstanding_timers(seg)] == ["anonymous:0", "named:a", "named:b"]
    assert timer_resolved(seg, "anonymous:1") == seg[5]
    assert timer_resolved(seg, "anonymous:0") is None
    assert timer_resolved(seg, "named:zzz") is None
    # A restart of a fired timer arms it again, with the new fire time.
    seg2 = [*seg, *envelope([TimerStarted(timer_id="anonymous:1", fire_at=later)], first_seq=7)]
    assert outstanding_timers(seg2)[-1] == OutstandingTimer(timer_id="named:b", fire_at=later)
    assert OutstandingTimer(timer_id="anonymous:1", fire_at=later) in outstanding_timers(seg2)
    assert timer_resolved(seg2, "anonymous:1") is None


def test_reopen_rearms_only_timers_retired_by_a_cancel_teardown() -> None:
    at = T0 + timedelta(hours=1)
    seg = envelope(
        [
            start(),
            TimerStarted(timer_id="named:torn", fire_at=at),
            TimerStarted(timer_id="named:intent", fire_at=at),
            TimerStarted(timer_id="named:fired", fire_at=at),
            TimerCancelled(timer_id="named:intent", cause=TimerCancelCause.WORKFLOW_INTENT),
            TimerFired(timer_id="named:fired"),
            TimerCancelled(timer_id="named:torn", cause=TimerCancelCause.CANCEL_TEARDOWN),
            WorkflowCancelled(reason="x"),
        ]
    )
    assert outstanding_timers(seg) == []
    reopened = [*seg, *envelope([WorkflowReopened(run_id=R1)], first_seq=9)]
    assert outstanding_timers(reopened) == [OutstandingTimer(timer_id="named:torn", fire_at=at)]
    # Torn down again and reopened again: re-armed again; once fired, gone for good.
    more = envelope(
        [
            TimerCancelled(timer_id="named:torn", cause=TimerCancelCause.CANCEL_TEARDOWN),
            WorkflowCancelled(reason="again"),
            WorkflowReopened(run_id=R1),
        ],
        first_seq=10,
    )
    assert [t.timer_id for t in outstanding_timers(reopened + more)] == ["named:torn"]
    fired = [*reopened, *more, *envelope([TimerFired(timer_id="named:torn")], first_seq=13)]
    assert outstanding_timers(fired) == []
    assert outstanding_timers([*fired, *envelope([WorkflowReopened(run_id=R1)], first_seq=14)]) == []


def test_a_timer_cancelled_intentionally_after_a_teardown_is_not_rearmed() -> None:
    seg = envelope(
        [
            start(),
            TimerStarted(timer_id="named:t", fire_at=T0),
            TimerCancelled(timer_id="named:t", cause=TimerCancelCause.CANCEL_TEARDOWN),
            TimerCancelled(timer_id="named:t", cause=TimerCancelCause.WORKFLOW_INTENT),
            WorkflowReopened(run_id=R1),
        ]
    )
    assert outstanding_timers(seg) == []


def test_failure_names_the_failed_step_and_the_reason() -> None:
    seg = envelope(
        [
            start(),
            sched(0, "reserve"),
            sched(1, "charge"),
            ActivityCompleted(activity_id=0, result=NULL, attempt=1),
            failed(1, 1, final=False),
            failed(1, 2, final=True, cause=FailureCause.TERMINAL),
            WF_FAILED,
        ]
    )
    summary = failure(seg)
    assert summary == FailureSummary(
        failed_step="activity:1 charge", reason="PaymentError: card declined", error=WF_FAILED.error
    )
    assert failure(seg[:-1]) is None  # not failed (yet)


def test_failure_without_a_failed_activity_has_no_step() -> None:
    seg = envelope([start(), sched(0), failed(0, 1, final=False), WF_FAILED])
    assert failure(seg) == FailureSummary(
        failed_step=None, reason="PaymentError: card declined", error=WF_FAILED.error
    )


def test_failure_is_none_for_other_terminals_and_after_a_reopen() -> None:
    assert failure(envelope([start(), WorkflowCompleted(result=NULL)])) is None
    assert failure(envelope([start(), WorkflowCancelled(reason="x")])) is None
    assert failure(envelope([start(), WF_FAILED, WorkflowReopened(run_id=R1)])) is None
    assert failure([]) is None


def test_failure_ignores_a_step_that_a_reopen_unsettled_and_that_later_succeeded() -> None:
    seg = envelope(
        [
            start(),
            sched(0, "charge"),
            sched(1, "ship"),
            failed(1, 1, final=True),
            failed(0, 1, final=True),
            WF_FAILED,
            WorkflowReopened(run_id=R1, reopened_activity_ids=(0,)),
            ActivityCompleted(activity_id=0, result=NULL, attempt=2),
            WorkflowFailed(error=ErrorInfo(type="Bug", message="late")),
        ]
    )
    summary = failure(seg)
    assert summary is not None
    # activity 0's final failure was undone by the reopen; activity 1's still stands.
    assert summary.failed_step == "activity:1 ship"
    assert summary.reason == "Bug: late"
    assert failure(seg[:6]) is not None
    assert failure(seg[:6]).failed_step == "activity:0 charge"  # type: ignore[union-attr]


def test_search_attributes_fold_start_then_upserts_per_run() -> None:
    events = envelope(
        [
            start(R1, search_attributes={"stage": "new", "n": 1}),
            SearchAttributesUpserted(attributes={"stage": "paid"}),
            SearchAttributesUpserted(attributes={"tags": ["x"], "n": 2}),
            WorkflowContinuedAsNew(input=NULL, parent_run_id=R1),
            start(R2, parent_run_id=R1, search_attributes={"stage": "again"}),
        ]
    )
    assert search_attributes(events, R1) == {"stage": "paid", "n": 2, "tags": ("x",)}
    assert search_attributes(events) == {"stage": "again"}
    assert search_attributes(events, R2) == {"stage": "again"}
    assert search_attributes(events, rid(99)) == {}
    assert search_attributes([]) == {}
    assert type(search_attributes(events)) is dict


# --------------------------------------------------------------------------
# Following a continue-as-new chain
# --------------------------------------------------------------------------

R3 = rid(3)


def continued(run_id: str, value: object = None) -> WorkflowContinuedAsNew:
    return WorkflowContinuedAsNew(input=Payload.of(value), parent_run_id=run_id)


def test_a_chain_of_three_runs_is_followed_to_its_last_run_at_every_step() -> None:
    events = envelope(
        [
            start(R1),
            continued(R1),
            start(R2, parent_run_id=R1),
            continued(R2),
            start(R3, parent_run_id=R2),
            WorkflowCompleted(result=Payload.of("done")),
        ]
    )
    positions = [follow_chain(events[:n], R1) for n in range(1, len(events) + 1)]
    assert [(p.state, p.run_id, p.status) for p in positions] == [
        (ChainState.RUNNING, R1, WorkflowStatus.RUNNING),
        (ChainState.SUCCESSOR_OWED, R1, WorkflowStatus.CONTINUED_AS_NEW),
        (ChainState.RUNNING, R2, WorkflowStatus.RUNNING),
        (ChainState.SUCCESSOR_OWED, R2, WorkflowStatus.CONTINUED_AS_NEW),
        (ChainState.RUNNING, R3, WorkflowStatus.RUNNING),
        (ChainState.SETTLED, R3, WorkflowStatus.COMPLETED),
    ]
    assert positions[1].terminal == events[1]
    assert positions[-1].terminal == events[-1]
    assert settled_result(WF, positions[-1]) == Payload.of("done")
    # Followed from a later run of the chain, it stands at the same place.
    assert follow_chain(events, R2) == follow_chain(events, R3) == positions[-1]
    # Not following continue-as-new, the first run's own terminal settles it.
    alone = follow_chain(events, R1, follow_continue_as_new=False)
    assert (alone.state, alone.run_id, alone.terminal) == (ChainState.SETTLED, R1, events[1])
    with pytest.raises(WorkflowFailure) as raised:
        settled_result(WF, alone)
    assert (raised.value.run_id, raised.value.status, raised.value.reason) == (R1, "continued_as_new", "")


def test_a_chain_whose_successor_is_not_recorded_yet_is_owed_not_settled() -> None:
    events = envelope([start(R1), continued(R1, 7)])
    position = follow_chain(events, R1)
    assert position == ChainPosition(
        state=ChainState.SUCCESSOR_OWED,
        run_id=R1,
        terminal=events[1],
        status=WorkflowStatus.CONTINUED_AS_NEW,
    )
    with pytest.raises(AionInternalError, match="not settled"):
        settled_result(WF, position)
    # A later run of the id that does not name R1 as its parent is not its successor.
    later = envelope([start(R1), continued(R1), start(R2)])
    assert follow_chain(later, R1).state is ChainState.SUCCESSOR_OWED
    assert successor_run_id(later, R1) is None
    assert follow_chain([], R1) == ChainPosition(state=ChainState.NOT_STARTED, run_id=R1)
    assert follow_chain(events, R2) == ChainPosition(state=ChainState.NOT_STARTED, run_id=R2)


def test_a_chain_broken_by_a_terminate_settles_there_until_a_reopen_runs_it_again() -> None:
    events = envelope(
        [
            start(R1),
            continued(R1),
            start(R2, parent_run_id=R1),
            WorkflowCancelled(reason="ops said stop", terminated=True),
            WorkflowReopened(run_id=R2),
            WF_FAILED,
        ]
    )
    terminated = follow_chain(events[:4], R1)
    assert (terminated.state, terminated.run_id, terminated.terminal) == (ChainState.SETTLED, R2, events[3])
    with pytest.raises(WorkflowFailure) as raised:
        settled_result(WF, terminated)
    assert (raised.value.run_id, raised.value.status, raised.value.reason) == (
        R2,
        "cancelled",
        "ops said stop",
    )
    reopened = follow_chain(events[:5], R1)
    assert (reopened.state, reopened.run_id, reopened.terminal) == (ChainState.RUNNING, R2, None)
    failed_again = follow_chain(events, R1)
    assert (failed_again.state, failed_again.run_id) == (ChainState.SETTLED, R2)
    with pytest.raises(WorkflowFailure) as raised:
        settled_result(WF, failed_again)
    assert (raised.value.status, raised.value.error) == ("failed", WF_FAILED.error)


# --------------------------------------------------------------------------
# Long histories: the scans that search a list of body types (above 64 events)
# agree with a walk over the events (what they replaced), on any event list.
# --------------------------------------------------------------------------

_SCAN_BODIES = st.sampled_from(
    [
        start(rid(1)),
        start(rid(2)),
        start(rid(3)),
        WorkflowReopened(run_id=rid(1)),
        WorkflowCompleted(result=NULL),
        WF_FAILED,
        WorkflowCancelled(reason="r"),
        WorkflowTimedOut(),
        WorkflowContinuedAsNew(input=NULL, parent_run_id=rid(1)),
        WorkflowCancelRequested(reason="r"),
        SearchAttributesUpserted(attributes={"a": 1}),
        sched(0),
        ActivityStarted(activity_id=0, attempt=1),
        ActivityCompleted(activity_id=0, result=NULL, attempt=1),
        MarkerRecorded(name="m", value=NULL),
    ]
)


def _walk_segment(events: Sequence[Event], run_id: str) -> list[Event]:
    out: list[Event] = []
    inside = False
    for event in events:
        if isinstance(event.body, WorkflowStarted):
            if inside:
                break
            inside = event.body.run_id == run_id
        if inside:
            out.append(event)
    return out


def _walk_status(previous: WorkflowStatus | None, events: Sequence[Event]) -> WorkflowStatus | None:
    status = previous
    for event in events:
        if isinstance(event.body, (WorkflowStarted, WorkflowReopened)):
            status = WorkflowStatus.RUNNING
        elif event.body.TERMINAL:
            status = {
                WorkflowCompleted: WorkflowStatus.COMPLETED,
                WorkflowFailed: WorkflowStatus.FAILED,
                WorkflowCancelled: WorkflowStatus.CANCELLED,
                WorkflowTimedOut: WorkflowStatus.TIMED_OUT,
                WorkflowContinuedAsNew: WorkflowStatus.CONTINUED_AS_NEW,
            }[type(event.body)]
    return status


def _walk_terminal(segment: Sequence[Event]) -> Event | None:
    for event in reversed(segment):
        if event.body.TERMINAL:
            return event
        if isinstance(event.body, (WorkflowStarted, WorkflowReopened)):
            return None
    return None


@settings(max_examples=300, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    bodies=st.lists(_SCAN_BODIES, max_size=300),
    previous=st.none() | st.sampled_from(list(WorkflowStatus)),
    long=st.booleans(),
)
def test_scans_of_long_histories_agree_with_a_walk(
    bodies: list[EventBody], previous: WorkflowStatus | None, long: bool
) -> None:
    if long:  # most draws are short: make half of them longer than 64 events
        bodies = bodies * (1 + 70 // (len(bodies) or 1))
    events = [Event(workflow_id=WF, seq=i + 1, recorded_at=T0, body=b) for i, b in enumerate(bodies)]
    starts = [e.body.run_id for e in events if isinstance(e.body, WorkflowStarted)]
    assert run_ids(events) == starts
    assert latest_run_id(events) == (starts[-1] if starts else None)
    for run_id in (rid(1), rid(2), rid(3)):
        segment = run_segment(events, run_id)
        assert segment == _walk_segment(events, run_id)
        assert current_lease_terminal(segment) is _walk_terminal(segment)
    assert current_lease_terminal(events) is _walk_terminal(events)
    assert status_after(previous, events) == _walk_status(previous, events)


_LATEST_RUN_BODIES = _SCAN_BODIES | st.sampled_from(
    [
        TimerStarted(timer_id="named:t1", fire_at=T0),
        TimerStarted(timer_id="named:t2", fire_at=T0 + timedelta(seconds=1)),
        TimerFired(timer_id="named:t1"),
        TimerCancelled(timer_id="named:t2", cause=TimerCancelCause.CANCEL_TEARDOWN),
        TimerCancelled(timer_id="named:t1", cause=TimerCancelCause.WORKFLOW_INTENT),
        SearchAttributesUpserted(attributes={"b": "x"}),
        start(rid(1), search_attributes={"a": 0, "b": "y"}),
    ]
)


@settings(max_examples=300, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bodies=st.lists(_LATEST_RUN_BODIES, max_size=300), long=st.booleans())
def test_latest_run_answers_as_each_projection_does(bodies: list[EventBody], long: bool) -> None:
    # Recovery and the visibility row ask these of one pass over the history (issue 17).
    if long:
        bodies = bodies * (1 + 70 // (len(bodies) or 1))
    events = [Event(workflow_id=WF, seq=i + 1, recorded_at=T0, body=b) for i, b in enumerate(bodies)]
    latest = latest_run(events)
    run_id = latest_run_id(events)
    if run_id is None:
        assert latest is None
        return
    assert latest is not None
    assert latest.run_id == run_id
    assert latest.segment == run_segment(events, run_id) == _walk_segment(events, run_id)
    assert latest.status is workflow_status(events)
    assert latest.terminal is current_lease_terminal(latest.segment)
    assert latest.kinds == [type(e.body) for e in latest.segment]
    # The folds over the segment give the same answers with its kinds as without them.
    assert search_attributes_of(latest.segment, latest.kinds) == search_attributes(events, run_id)
    assert outstanding_timers(latest.segment, latest.kinds) == outstanding_timers(latest.segment)


class _CountingEvents(list):  # type: ignore[type-arg]
    """A history that counts the walks over it (iterations and slices)."""

    walks = 0

    def __iter__(self) -> Any:
        self.walks += 1
        return super().__iter__()

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            self.walks += 1
        return super().__getitem__(index)


def test_latest_run_walks_a_long_history_once() -> None:
    # Recovery and each visibility row ask these of a history; the projections they
    # called one by one listed the body types of a 30,001-event history about ten times.
    bodies: list[EventBody] = [start(rid(1), search_attributes={"a": 1})]
    for aid in range(200):
        bodies += [
            sched(aid),
            ActivityStarted(activity_id=aid, attempt=1),
            ActivityCompleted(activity_id=aid, result=NULL, attempt=1),
        ]
    bodies += [SearchAttributesUpserted(attributes={"b": "x"}), TimerStarted(timer_id="named:t", fire_at=T0)]
    events = _CountingEvents(
        Event(workflow_id=WF, seq=i + 1, recorded_at=T0, body=b) for i, b in enumerate(bodies)
    )
    latest = latest_run(events)
    assert latest is not None
    assert (latest.run_id, latest.status, latest.terminal) == (rid(1), WorkflowStatus.RUNNING, None)
    assert search_attributes_of(latest.segment, latest.kinds) == {"a": 1, "b": "x"}
    assert outstanding_timers(latest.segment, latest.kinds) == [
        OutstandingTimer(timer_id="named:t", fire_at=T0)
    ]
    # Listing the body types once, then copying the run's segment: two walks in all.
    assert events.walks == 2
