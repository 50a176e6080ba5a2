"""The event types of a workflow's history and their fields (docs/concepts.md, "Histories and events").

Every event class lives here.  Most are also exported from ``aion_trio``
itself; ``WorkflowCancelled`` is not, because ``aion_trio.WorkflowCancelled``
is the exception a cancelled workflow sees — the event of that name is
``aion_trio.events.WorkflowCancelled``.
"""

from __future__ import annotations

from ._events import (
    ActivityAdvisoryExhausted as ActivityAdvisoryExhausted,
    ActivityCancelled as ActivityCancelled,
    ActivityCompleted as ActivityCompleted,
    ActivityError as ActivityError,
    ActivityFailed as ActivityFailed,
    ActivityFallbackRouted as ActivityFallbackRouted,
    ActivityScheduled as ActivityScheduled,
    ActivityStarted as ActivityStarted,
    ChildWorkflowCancelled as ChildWorkflowCancelled,
    ChildWorkflowCompleted as ChildWorkflowCompleted,
    ChildWorkflowFailed as ChildWorkflowFailed,
    ChildWorkflowStarted as ChildWorkflowStarted,
    ErrorInfo as ErrorInfo,
    Event as Event,
    EventBody as EventBody,
    FailureCause as FailureCause,
    MarkerRecorded as MarkerRecorded,
    SearchAttributesUpserted as SearchAttributesUpserted,
    SignalReceived as SignalReceived,
    TimeoutKind as TimeoutKind,
    TimerCancelCause as TimerCancelCause,
    TimerCancelled as TimerCancelled,
    TimerFired as TimerFired,
    TimerStarted as TimerStarted,
    UpdateAccepted as UpdateAccepted,
    UpdateCompleted as UpdateCompleted,
    WorkflowCancelled as WorkflowCancelled,
    WorkflowCancelRequested as WorkflowCancelRequested,
    WorkflowCompleted as WorkflowCompleted,
    WorkflowContinuedAsNew as WorkflowContinuedAsNew,
    WorkflowFailed as WorkflowFailed,
    WorkflowReopened as WorkflowReopened,
    WorkflowReset as WorkflowReset,
    WorkflowStarted as WorkflowStarted,
    WorkflowStatus as WorkflowStatus,
    WorkflowTimedOut as WorkflowTimedOut,
)
from ._util import fixup_module_metadata as _fixup_module_metadata

_fixup_module_metadata(__name__, globals())
del _fixup_module_metadata
