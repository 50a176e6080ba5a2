"""Sample events for tests: one of EVERY event body type, all fields set.

``FULL_BODIES`` populates every field, optional ones included, with values
that are not the defaults.  ``MINIMAL_BODIES`` covers each type that has
optional or defaulted fields, with those left out.  Both are keyed by wire
type name; :func:`sample_events` envelopes them into one contiguous history
(not a meaningful workflow: a vocabulary sample for wire and store tests).

Other test modules import this (``from _samples import ...``); keep it free of
pytest imports so it is usable from anywhere.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from aion_trio import (
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
    Payload,
    SearchAttributesUpserted,
    SignalReceived,
    TimeoutKind,
    TimerCancelCause,
    TimerCancelled,
    TimerFired,
    TimerStarted,
    UpdateAccepted,
    UpdateCompleted,
    WorkflowCancelRequested,
    WorkflowCompleted,
    WorkflowContinuedAsNew,
    WorkflowFailed,
    WorkflowReopened,
    WorkflowReset,
    WorkflowStarted,
    WorkflowTimedOut,
)
from aion_trio._events import make_batch
from aion_trio.events import WorkflowCancelled

WORKFLOW_ID = "order-7"
RUN_ID = "3f1c2a9e-5b7d-4c1e-8f20-6a9b0c1d2e3f"
PARENT_RUN_ID = "0a1b2c3d-4e5f-4a6b-9c7d-8e9f0a1b2c3d"
RECORDED_AT = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=timezone.utc)
# Not UTC on purpose: the wire form normalises to UTC, decoding gives the same instant.
FIRE_AT = datetime(2026, 1, 4, 5, 6, 7, 1, tzinfo=timezone(timedelta(hours=2)))

ERROR_INFO = ErrorInfo(
    type="ValueError",
    message="amount must be positive (got -3 €)",
    details=Payload.of({"field": "amount", "value": -3, "hints": ["check input", None, 1.5]}),
    traceback='Traceback (most recent call last):\n  File "shop.py", line 3\nValueError: …\n',
)
ACTIVITY_ERROR = ActivityError(
    cause=FailureCause.RETRYABLE,
    type="ConnectionError",
    message="payment gateway reset the connection",
    details=Payload.of({"host": "gw.example", "port": 443}),
    traceback="Traceback (most recent call last):\nConnectionError\n",
)

FULL_BODIES: dict[str, EventBody] = {
    type(b).__name__: b
    for b in (
        WorkflowStarted(
            workflow_type="checkout",
            input=Payload.of({"id": 7, "items": ["book", "pen"], "gift": True, "note": "ünïcödé ✓"}),
            run_id=RUN_ID,
            parent_run_id=PARENT_RUN_ID,
            parent_workflow_id="parent-order",
            task_queue="orders",
            search_attributes={"customer": "c-42", "total": 12.5, "rank": 3, "vip": True, "tags": ["a", "b"]},
            timeout=timedelta(days=2, microseconds=5),
            request_id="cli-start-7",
            reset_from_run_id=PARENT_RUN_ID,
            reset_to_seq=9,
        ),
        WorkflowCompleted(result=Payload.of({"receipt": "r-1", "stock": [1, 2]})),
        WorkflowFailed(error=ERROR_INFO),
        WorkflowCancelRequested(reason="customer asked", request_id="cancel-7"),
        WorkflowCancelled(reason="customer asked", terminated=True, request_id="inbox:12"),
        WorkflowTimedOut(timeout_kind=TimeoutKind.DEADLINE),
        WorkflowContinuedAsNew(
            input=Payload.of({"cursor": 100}), workflow_type="checkout_v2", parent_run_id=RUN_ID
        ),
        WorkflowReopened(run_id=RUN_ID, reopened_activity_ids=(0, 2), request_id="reopen-ünï"),
        WorkflowReset(new_run_id=RUN_ID, to_seq=4, reason="redo ünï", request_id="reset-7"),
        SearchAttributesUpserted(attributes={"stage": "shipping", "progress": 0.75, "tags": ["x"]}),
        ActivityScheduled(
            activity_id=2,
            activity_type="charge",
            input=Payload.of([{"amount": 12.5, "currency": "EUR"}]),
            task_queue="payments",
            options=Payload.of({"retry": {"max_attempts": 5}, "timeout": 30.0}),
            input_digest="5d0f0d3c9a4e7b1f2c6a8e0b4d2f6a19",
        ),
        ActivityStarted(activity_id=2, attempt=3),
        ActivityCompleted(activity_id=2, result=Payload.of("ok"), attempt=3),
        ActivityFailed(activity_id=2, error=ACTIVITY_ERROR, attempt=2, final=False, retry_at=FIRE_AT),
        ActivityCancelled(activity_id=2, attempt=4, by_workflow=True),
        ActivityFallbackRouted(
            activity_id=2, attempt=2, from_task_queue="payments", to_task_queue="payments-b", fallback_index=1
        ),
        ActivityAdvisoryExhausted(activity_id=2, activity_type="charge", reason="5 attempts used", attempt=5),
        TimerStarted(timer_id="named:reminder", fire_at=FIRE_AT),
        TimerFired(timer_id="anonymous:3"),
        TimerCancelled(timer_id="scope:1", cause=TimerCancelCause.CANCEL_TEARDOWN),
        SignalReceived(
            name="approve", payload=Payload.of({"by": "alice", "ok": True}), command_id=3, request_id="sig-1"
        ),
        ChildWorkflowStarted(
            child_workflow_id="order-7/ship",
            workflow_type="ship",
            input=Payload.of({"id": 7}),
            input_digest="0b1c2d3e4f5a6b7c8d9e0f1a2b3c4d5e",
        ),
        ChildWorkflowCompleted(child_workflow_id="order-7/ship", result=Payload.of({"tracking": "T1"})),
        ChildWorkflowFailed(child_workflow_id="order-7/ship", error=ERROR_INFO),
        ChildWorkflowCancelled(child_workflow_id="order-7/ship", reason="parent cancelled"),
        MarkerRecorded(name="version:checkout", value=Payload.of(2)),
        UpdateAccepted(update_id="upd-1", name="set_language", payload=Payload.of(["fr", {"n": 2**63}])),
        UpdateCompleted(update_id="upd-1", result=Payload.of("en"), error=ERROR_INFO),
    )
}

MINIMAL_ERROR_INFO = ErrorInfo(type="RuntimeError", message="")
MINIMAL_ACTIVITY_ERROR = ActivityError(cause=FailureCause.TIMEOUT, type="TimeoutError", message="")

MINIMAL_BODIES: dict[str, EventBody] = {
    type(b).__name__: b
    for b in (
        WorkflowStarted(workflow_type="checkout", input=Payload.of(None), run_id=RUN_ID),
        WorkflowFailed(error=MINIMAL_ERROR_INFO),
        WorkflowCancelled(reason=""),
        WorkflowTimedOut(),
        WorkflowContinuedAsNew(input=Payload.of([]), parent_run_id=RUN_ID),
        WorkflowReopened(run_id=RUN_ID),
        WorkflowReset(new_run_id=RUN_ID, to_seq=1),
        SearchAttributesUpserted(attributes={}),
        ActivityScheduled(activity_id=0, activity_type="charge", input=Payload.of({})),
        ActivityFailed(activity_id=0, error=MINIMAL_ACTIVITY_ERROR, attempt=1, final=False),
        ChildWorkflowFailed(child_workflow_id="child", error=MINIMAL_ERROR_INFO),
        SignalReceived(name="approve", payload=Payload.of({"by": "alice", "ok": True})),
        WorkflowCancelRequested(reason="customer asked"),
        ActivityCancelled(activity_id=0, attempt=1),  # cancelled by the engine (no by_workflow)
        # Recorded before commands carried their arguments' digest: it still decodes.
        ChildWorkflowStarted(child_workflow_id="order-7/ship", workflow_type="ship", input=Payload.of({})),
        UpdateCompleted(update_id="upd-2"),
    )
}


#: Variants pinned after the first two sets (each appended, so earlier lines stay byte-exact).
LATER_BODIES: tuple[EventBody, ...] = (
    # A settling failure (the full sample is a retry-trail record with retry_at since that field came).
    ActivityFailed(activity_id=2, error=ACTIVITY_ERROR, attempt=2, final=True),
)


#: Event types added after the first two sets, in the order they were added: each one's
#: full and minimal samples come after the later variants and the types added before it
#: (appended, so earlier lines of the golden file stay byte-exact).  A new type goes last.
ADDED_TYPES: tuple[str, ...] = ("WorkflowReset", "UpdateAccepted", "UpdateCompleted")

#: Variants of existing types for fields added to them later (a field that is off the wire
#: when empty keeps the earlier samples byte-exact), after every added type's samples.
ADDED_VARIANTS: tuple[EventBody, ...] = (
    WorkflowStarted(
        workflow_type="checkout",
        input=Payload.of(None),
        run_id=RUN_ID,
        headers={
            "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "tenant": "ünï 'a'",
        },
    ),
)


def sample_bodies() -> list[EventBody]:
    """Every full sample, then every minimal one, then the later variants, then for each
    type added since (in order) its full sample and its minimal one, then the variants of
    fields added since."""
    return [
        *(b for name, b in FULL_BODIES.items() if name not in ADDED_TYPES),
        *(b for name, b in MINIMAL_BODIES.items() if name not in ADDED_TYPES),
        *LATER_BODIES,
        *(
            body
            for name in ADDED_TYPES
            for body in (FULL_BODIES[name], *((MINIMAL_BODIES[name],) if name in MINIMAL_BODIES else ()))
        ),
        *ADDED_VARIANTS,
    ]


def sample_events(workflow_id: str = WORKFLOW_ID, first_seq: int = 1) -> list[Event]:
    """:func:`sample_bodies` enveloped with contiguous seqs (one batch's worth)."""
    return make_batch(workflow_id, first_seq, RECORDED_AT, sample_bodies())
