"""A workflow's description, projected from its history."""

from __future__ import annotations

from collections.abc import Sequence

from .._events import (
    ActivityScheduled,
    Event,
    WorkflowCompleted,
    WorkflowFailed,
    WorkflowStarted,
    WorkflowStatus,
)
from .._payload import PayloadCodec
from .._projections import (
    current_lease_terminal,
    failure,
    latest_run_id,
    next_delivery_attempt,
    run_segment,
    scheduled_activities,
    search_attributes,
    unsettled_activities,
    workflow_status,
)
from .config import PendingActivity, WorkflowDescription


def describe_history(
    workflow_id: str, history: Sequence[Event], *, codec: PayloadCodec, stuck_reason: str | None = None
) -> WorkflowDescription:
    """Project a workflow's description from its (non-empty) history.

    ``stuck_reason`` is what the engine serving it knows (or a visibility row
    says); it is reported only while the workflow is Running.
    """
    run_id = latest_run_id(history)
    assert run_id is not None
    segment = run_segment(history, run_id)
    start = segment[0]
    assert isinstance(start.body, WorkflowStarted)
    status = workflow_status(history) or WorkflowStatus.RUNNING
    terminal = current_lease_terminal(segment)
    result = None
    error = None
    if terminal is not None and isinstance(terminal.body, WorkflowCompleted):
        result = codec.decode(terminal.body.result)
    if terminal is not None and isinstance(terminal.body, WorkflowFailed):
        error = terminal.body.error
    scheduled = scheduled_activities(segment)
    scheduled_at = {
        e.body.activity_id: e.recorded_at for e in segment if isinstance(e.body, ActivityScheduled)
    }
    pending = tuple(
        PendingActivity(
            activity_id=a,
            activity_type=scheduled[a].activity_type,
            attempt=next_delivery_attempt(segment, a) or 1,
            scheduled_at=scheduled_at[a],
            task_queue=scheduled[a].task_queue,
        )
        for a in unsettled_activities(segment)
    )
    failed = failure(segment)
    return WorkflowDescription(
        workflow_id=workflow_id,
        run_id=run_id,
        workflow_type=start.body.workflow_type,
        status=status,
        start_time=start.recorded_at,
        close_time=terminal.recorded_at if terminal is not None else None,
        task_queue=start.body.task_queue,
        search_attributes=search_attributes(history, run_id),
        result=result,
        error=error,
        failed_step=failed.failed_step if failed else None,
        pending_activities=pending,
        stuck_reason=stuck_reason if status is WorkflowStatus.RUNNING else None,
        history_length=len(history),
        run_ids=tuple(e.body.run_id for e in history if isinstance(e.body, WorkflowStarted)),
    )
