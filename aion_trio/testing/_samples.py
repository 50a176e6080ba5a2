"""Sample data the conformance scenarios write and read back.

Times are far from "now" (2041) so no scenario depends on the wall clock.
Values carry the awkward cases a backend gets wrong: microseconds, non-UTC
offsets, quotes and SQL text, non-ASCII text, integers beyond float precision.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta, timezone

from .._events import (
    EVENT_TYPES,
    ActivityAdvisoryExhausted,
    ActivityCancelled,
    ActivityCompleted,
    ActivityError,
    ActivityFailed,
    ActivityFallbackRouted,
    ActivityScheduled,
    ActivityStarted,
    ChildWorkflowCancelled,
    ChildWorkflowCompleted,
    ChildWorkflowFailed,
    ChildWorkflowStarted,
    ErrorInfo,
    Event,
    EventBody,
    FailureCause,
    MarkerRecorded,
    SearchAttributesUpserted,
    SignalReceived,
    TimeoutKind,
    TimerCancelCause,
    TimerCancelled,
    TimerFired,
    TimerStarted,
    UpdateAccepted,
    UpdateCompleted,
    WorkflowCancelled,
    WorkflowCancelRequested,
    WorkflowCompleted,
    WorkflowContinuedAsNew,
    WorkflowFailed,
    WorkflowReopened,
    WorkflowReset,
    WorkflowStarted,
    WorkflowTimedOut,
)
from .._payload import Payload

UTC = timezone.utc
BASE_TIME = datetime(2041, 3, 4, 5, 6, 7, 123456, tzinfo=UTC)
"""Every sample time is an offset from this instant (microsecond precision)."""

PLUS_0530 = timezone(timedelta(hours=5, minutes=30))
MINUS_0700 = timezone(timedelta(hours=-7))

RUN_A = "6f1c2a3e-0000-4000-8000-00000000000a"
RUN_B = "6f1c2a3e-0000-4000-8000-00000000000b"
RUN_C = "6f1c2a3e-0000-4000-8000-00000000000c"

TRICKY_TEXT = 'it\'s "quoted"; DROP TABLE events; -- 100% _under_ back\\slash žluťoučký 🐍'
BIG_INT = 2**53 + 1  # not representable as a float: catches numbers stored as REAL

_PAYLOAD = Payload.of(
    {
        "text": TRICKY_TEXT,
        "nested": [1, 2.5, None, True, {"k": []}],
        "big": BIG_INT,
        "empty": "",
    }
)


def at(seconds: float = 0.0, *, tz: timezone = UTC) -> datetime:
    """``BASE_TIME`` plus ``seconds``, expressed in ``tz`` (same instant whatever ``tz``)."""
    return (BASE_TIME + timedelta(seconds=seconds)).astimezone(tz)


def full_bodies() -> list[EventBody]:
    """One body of every event type, every field set (optional ones too, non-default enums)."""
    error = ErrorInfo(
        type="ValueError",
        message=TRICKY_TEXT,
        details=Payload.of({"code": 7, "why": "it's"}),
        traceback='Traceback (most recent call last):\n  File "x.py", line 1\nValueError: boom\n',
    )
    activity_error = ActivityError(
        cause=FailureCause.POLICY_REFUSED,
        type="RefusedError",
        message="queue 'a' refused",
        details=Payload.of(["detail", 1]),
        traceback="Traceback ...\n",
    )
    bodies: list[EventBody] = [
        WorkflowStarted(
            workflow_type="order.checkout",
            input=_PAYLOAD,
            run_id=RUN_A,
            parent_run_id=RUN_B,
            parent_workflow_id="parent-'wf'",
            task_queue="queue-a",
            search_attributes={
                "CustomerId": "c'1",
                "Amount": 12.5,
                "Count": BIG_INT,
                "Vip": True,
                "Tags": ("a", "b'c"),
            },
            timeout=timedelta(hours=1, seconds=30, microseconds=500),
            request_id="start-'a'",
            reset_from_run_id=RUN_C,
            reset_to_seq=7,
            headers={
                "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                "x'y": TRICKY_TEXT,
            },
        ),
        WorkflowCompleted(result=Payload.of({"ok": True, "n": BIG_INT})),
        WorkflowFailed(error=error),
        WorkflowCancelRequested(reason="operator asked; it's late", request_id="cancel-1"),
        WorkflowCancelled(reason="cancelled by 'ops'", request_id="inbox:4"),
        WorkflowTimedOut(timeout_kind=TimeoutKind.DEADLINE),
        WorkflowContinuedAsNew(input=Payload.of([1, 2, 3]), workflow_type="order.v2", parent_run_id=RUN_A),
        WorkflowReset(new_run_id=RUN_C, to_seq=3, reason="redo 'ship'", request_id="reset-1"),
        WorkflowReopened(run_id=RUN_C, reopened_activity_ids=(0, 2), request_id="reopen-1"),  # type: ignore[arg-type,unused-ignore]
        SearchAttributesUpserted(attributes={"Stage": "paid", "Retries": 0, "Ratio": -0.25, "Done": False}),
        ActivityScheduled(
            activity_id=0,
            activity_type="charge",
            input=_PAYLOAD,
            task_queue="payments",
            options=Payload.of({"retry": {"max_attempts": 5}, "timeout": 30.0}),
            input_digest="9f86d081884c7d659a2feaa0c55ad015",
        ),
        ActivityStarted(activity_id=0, attempt=1),
        ActivityCompleted(activity_id=0, result=Payload.of("receipt-1"), attempt=1),
        ActivityFailed(
            activity_id=1, error=activity_error, attempt=2, final=False, retry_at=at(60.25, tz=PLUS_0530)
        ),
        ActivityCancelled(activity_id=3, attempt=4, by_workflow=True),
        ActivityFallbackRouted(
            activity_id=1, attempt=2, from_task_queue="payments", to_task_queue="payments-b", fallback_index=1
        ),
        ActivityAdvisoryExhausted(activity_id=1, activity_type="charge", reason="spent 5 of 5", attempt=5),
        TimerStarted(timer_id="named:reminder", fire_at=at(86400.5, tz=PLUS_0530)),
        TimerFired(timer_id="anonymous:0"),
        TimerCancelled(timer_id="scope:1", cause=TimerCancelCause.CANCEL_TEARDOWN),
        SignalReceived(
            name="approve", payload=Payload.of({"by": "o'brien"}), command_id=7, request_id="sig-'7'"
        ),
        ChildWorkflowStarted(
            child_workflow_id="child-1",
            workflow_type="ship",
            input=Payload.of({"to": "Brno"}),
            input_digest="3e23e8160039594a33894f6564e1b134",
        ),
        ChildWorkflowCompleted(child_workflow_id="child-1", result=Payload.of(None)),
        ChildWorkflowFailed(child_workflow_id="child-2", error=error),
        ChildWorkflowCancelled(child_workflow_id="child-3", reason="parent closed"),
        MarkerRecorded(name="version:checkout", value=Payload.of(2)),
        UpdateAccepted(update_id="upd-'1'", name="set_language", payload=Payload.of(["fr", {"n": BIG_INT}])),
        UpdateCompleted(update_id="upd-'1'", result=Payload.of("en"), error=error),
    ]
    return bodies


def minimal_bodies() -> list[EventBody]:
    """Variants with optional fields absent or ``None`` and the other enum/bool values."""
    return [
        WorkflowStarted(workflow_type="t", input=Payload.of(None), run_id=RUN_B),
        WorkflowFailed(error=ErrorInfo(type="E", message="")),
        WorkflowContinuedAsNew(input=Payload.of({}), parent_run_id=RUN_B),
        WorkflowReset(new_run_id=RUN_A, to_seq=1),
        WorkflowReopened(run_id=RUN_B),
        SearchAttributesUpserted(attributes={}),
        ActivityScheduled(activity_id=7, activity_type="a", input=Payload.of("")),
        ActivityFailed(
            activity_id=7,
            error=ActivityError(cause=FailureCause.RETRYABLE, type="E", message="m"),
            attempt=1,
            final=True,
        ),
        TimerCancelled(timer_id="named:x", cause=TimerCancelCause.WORKFLOW_INTENT),
        SignalReceived(name="s", payload=Payload.of(None)),
        UpdateCompleted(update_id="u"),
    ]


def covered_types() -> set[str]:
    return {type(b).__name__ for b in full_bodies()}


def missing_types() -> list[str]:
    """Event types with no full sample (a kit bug; a test pins this is empty)."""
    return sorted(set(EVENT_TYPES) - covered_types())


def batch(
    workflow_id: str, first_seq: int, bodies: Sequence[EventBody], *, start: float = 0.0
) -> list[Event]:
    """Envelope ``bodies`` with contiguous seqs; each event one second (and some µs) after the last.

    Every third event's ``recorded_at`` is expressed in a non-UTC offset: the
    instant is what a store must keep.
    """
    out = []
    for i, body in enumerate(bodies):
        seq = first_seq + i
        tz = (UTC, PLUS_0530, MINUS_0700)[seq % 3]
        out.append(
            Event(
                workflow_id=workflow_id,
                seq=seq,
                recorded_at=at(start + seq + seq / 1_000_000, tz=tz),
                body=body,
            )
        )
    return out


def markers(workflow_id: str, first_seq: int, count: int, *, tag: str = "m") -> list[Event]:
    """``count`` small ``MarkerRecorded`` events (cheap filler with distinguishable values)."""
    return batch(
        workflow_id,
        first_seq,
        [MarkerRecorded(name=tag, value=Payload.of(f"{tag}-{first_seq + i}")) for i in range(count)],
    )
