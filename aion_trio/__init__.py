"""aion_trio: a durable workflow engine for Trio applications.

Implementation lives in private modules; this is the curated public surface
(pinned by ``tests/test_exports.py``).  Store authors also use
``aion_trio.plugin``; ``aion_trio.testing`` holds the conformance kit.
"""

from __future__ import annotations

from . import events as events, projections as projections
from ._activities import (
    ActivityDispatcher as ActivityDispatcher,
    ActivityInfo as ActivityInfo,
    ActivityOutcome as ActivityOutcome,
    ActivityRequest as ActivityRequest,
    CompleteAsync as CompleteAsync,
    DelegatingDispatcher as DelegatingDispatcher,
    OutcomeKind as OutcomeKind,
    activity_cancelled as activity_cancelled,
    activity_info as activity_info,
    complete_async as complete_async,
    heartbeat as heartbeat,
    report_heartbeat_details as report_heartbeat_details,
)
from ._admission import FlowLimit as FlowLimit, PoolStatistics as PoolStatistics
from ._childspec import ParentClosePolicy as ParentClosePolicy
from ._clock import EngineClock as EngineClock
from ._codecs import (
    AesGcmCodec as AesGcmCodec,
    Codec as Codec,
    CodecChain as CodecChain,
    ZlibCodec as ZlibCodec,
)
from ._commands import (
    ActivityCommand as ActivityCommand,
    CancelCommand as CancelCommand,
    Command as Command,
    CommandOutcome as CommandOutcome,
    IdReusePolicy as IdReusePolicy,
    PendingCommand as PendingCommand,
    QueryCommand as QueryCommand,
    ReopenCommand as ReopenCommand,
    ResetCommand as ResetCommand,
    SignalCommand as SignalCommand,
    SignalWithStartCommand as SignalWithStartCommand,
    StartCommand as StartCommand,
    TerminateCommand as TerminateCommand,
    UpdateCommand as UpdateCommand,
)
from ._context import WorkflowContext as WorkflowContext
from ._definitions import (
    ActivityDefinition as ActivityDefinition,
    WorkflowDefinition as WorkflowDefinition,
    activity as activity,
    workflow as workflow,
)
from ._engine import (
    Engine as Engine,
    EngineConfig as EngineConfig,
    EngineStatistics as EngineStatistics,
    PendingActivity as PendingActivity,
    QueuedHandle as QueuedHandle,
    RunHandle as RunHandle,
    ScheduleDescription as ScheduleDescription,
    Schedules as Schedules,
    WorkflowDescription as WorkflowDescription,
    open_engine as open_engine,
)
from ._errors import (
    ActivityAttemptClosed as ActivityAttemptClosed,
    ActivityFailure as ActivityFailure,
    AdmissionTimeout as AdmissionTimeout,
    AionError as AionError,
    AionInternalError as AionInternalError,
    AttemptCancelled as AttemptCancelled,
    BackendUnavailable as BackendUnavailable,
    CannotReopen as CannotReopen,
    CannotReset as CannotReset,
    ChildWorkflowFailure as ChildWorkflowFailure,
    CommandDecodeError as CommandDecodeError,
    CommandNotAnswered as CommandNotAnswered,
    DatabaseCorrupt as DatabaseCorrupt,
    DatabaseTooNew as DatabaseTooNew,
    EngineEpochClosed as EngineEpochClosed,
    EngineError as EngineError,
    EventDecodeError as EventDecodeError,
    FlowControlUnsupported as FlowControlUnsupported,
    FlowError as FlowError,
    InvalidActivityToken as InvalidActivityToken,
    InvalidArguments as InvalidArguments,
    InvalidBatch as InvalidBatch,
    InvalidHistory as InvalidHistory,
    InvalidQuery as InvalidQuery,
    InvalidSchedule as InvalidSchedule,
    InvalidStoreUrl as InvalidStoreUrl,
    NodeInUse as NodeInUse,
    NonDeterminismError as NonDeterminismError,
    NonDeterministicCall as NonDeterministicCall,
    NotAnAionDatabase as NotAnAionDatabase,
    NoTaskQueues as NoTaskQueues,
    NotFound as NotFound,
    NotOwner as NotOwner,
    NotRunning as NotRunning,
    PayloadCodecError as PayloadCodecError,
    PayloadDecodeError as PayloadDecodeError,
    PayloadError as PayloadError,
    PayloadNotSerializable as PayloadNotSerializable,
    PayloadTooLarge as PayloadTooLarge,
    PluginError as PluginError,
    PolicyRefused as PolicyRefused,
    QueryError as QueryError,
    QueryFailed as QueryFailed,
    QueryReadOnly as QueryReadOnly,
    QueryUnavailable as QueryUnavailable,
    QueueDeduplicated as QueueDeduplicated,
    ScheduleAlreadyExists as ScheduleAlreadyExists,
    ScheduleConflict as ScheduleConflict,
    ScheduleError as ScheduleError,
    ScheduleNotFound as ScheduleNotFound,
    SchedulesUnsupported as SchedulesUnsupported,
    SequenceConflict as SequenceConflict,
    SerializationError as SerializationError,
    StoreDecodeError as StoreDecodeError,
    StoreEncodeError as StoreEncodeError,
    StoreError as StoreError,
    StoreOpenError as StoreOpenError,
    StoreOwned as StoreOwned,
    StorePathError as StorePathError,
    StoreSchemeConflict as StoreSchemeConflict,
    StoreTakenOver as StoreTakenOver,
    TerminalError as TerminalError,
    Timeout as Timeout,
    UnknownActivityType as UnknownActivityType,
    UnknownQuery as UnknownQuery,
    UnknownQueue as UnknownQueue,
    UnknownStoreScheme as UnknownStoreScheme,
    UnknownWorkflowType as UnknownWorkflowType,
    UpdateError as UpdateError,
    UpdateFailed as UpdateFailed,
    UpdateRejected as UpdateRejected,
    UpdateUnavailable as UpdateUnavailable,
    WorkerLost as WorkerLost,
    WorkflowAlreadyStarted as WorkflowAlreadyStarted,
    WorkflowCancelled as WorkflowCancelled,
    WorkflowCommandError as WorkflowCommandError,
    WorkflowFailure as WorkflowFailure,
    WorkflowFenced as WorkflowFenced,
    WorkflowNotFound as WorkflowNotFound,
)
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
from ._guard import unsafe_nondeterminism as unsafe_nondeterminism
from ._handles import (
    ActivityHandle as ActivityHandle,
    ChildHandle as ChildHandle,
    TimeoutScope as TimeoutScope,
    TimerHandle as TimerHandle,
)
from ._observe import (
    ActivityAttemptEnded as ActivityAttemptEnded,
    ActivityAttemptStarted as ActivityAttemptStarted,
    Observer as Observer,
    ObserverEvent as ObserverEvent,
    RecoveryFinished as RecoveryFinished,
    RunEvicted as RunEvicted,
    RunRecovered as RunRecovered,
    RunReloaded as RunReloaded,
    RunStart as RunStart,
    RunStuck as RunStuck,
    StoreOperation as StoreOperation,
    TransientRetry as TransientRetry,
    WorkflowRelinquished as WorkflowRelinquished,
    WorkflowRunEnded as WorkflowRunEnded,
    WorkflowRunStarted as WorkflowRunStarted,
)
from ._ownership import OwnerClaim as OwnerClaim, OwnerIdentity as OwnerIdentity
from ._payload import Payload as Payload, PayloadCodec as PayloadCodec
from ._plugins import open_store as open_store
from ._retry import (
    ActivityOptions as ActivityOptions,
    Exponential as Exponential,
    Fixed as Fixed,
    Linear as Linear,
    RetryPolicy as RetryPolicy,
)
from ._schedules import (
    Overlap as Overlap,
    Schedule as Schedule,
    ScheduleAction as ScheduleAction,
    ScheduleActionKind as ScheduleActionKind,
    ScheduleActionRecord as ScheduleActionRecord,
    SchedulePolicy as SchedulePolicy,
    ScheduleSpec as ScheduleSpec,
    ScheduleState as ScheduleState,
    schedule_tick_time as schedule_tick_time,
)
from ._store import (
    BulkHistoryReads as BulkHistoryReads,
    CommandInbox as CommandInbox,
    EventStore as EventStore,
    FlowGrant as FlowGrant,
    FlowStore as FlowStore,
    FlowWaiter as FlowWaiter,
    OwnedStore as OwnedStore,
    QueuedRun as QueuedRun,
    RecoveryCounts as RecoveryCounts,
    ScheduleStore as ScheduleStore,
    SearchOp as SearchOp,
    SearchPredicate as SearchPredicate,
    Store as Store,
    StoredSchedule as StoredSchedule,
    VisibilityFilter as VisibilityFilter,
    VisibilityRow as VisibilityRow,
    VisibilityStore as VisibilityStore,
)
from ._taskqueues import ActivityTaskQueues as ActivityTaskQueues, run_activity_worker as run_activity_worker
from ._transient import CompletionRetryConfig as CompletionRetryConfig
from ._util import fixup_module_metadata as _fixup_module_metadata
from ._version import __version__ as __version__

# The plugin surface is imported while this package is (open_store needs its manager):
# what both export says aion_trio.
_fixup_module_metadata(__name__, globals(), reclaim=("aion_trio.plugin",))
del _fixup_module_metadata
