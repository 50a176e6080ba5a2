"""The surface for store-plugin authors.

Everything a store needs and nothing of the engine: the event model, the wire
codec, the projections a store may use to keep a status column, the store
protocols and errors, and the registration hook (its specification, and the
other hooks', in :mod:`aion_trio.plugin.hookspecs`).
"""

from __future__ import annotations

from .._clock import hold_mock_time as hold_mock_time
from .._commands import (
    CancelCommand as CancelCommand,
    Command as Command,
    CommandOutcome as CommandOutcome,
    PendingCommand as PendingCommand,
    ReopenCommand as ReopenCommand,
    ResetCommand as ResetCommand,
    SignalCommand as SignalCommand,
    SignalWithStartCommand as SignalWithStartCommand,
    StartCommand as StartCommand,
    TerminateCommand as TerminateCommand,
    command_data_json as command_data_json,
    command_from_data_json as command_from_data_json,
    outcome_from_json as outcome_from_json,
    outcome_to_json as outcome_to_json,
    signal_recorded_outcome as signal_recorded_outcome,
)
from .._errors import (
    BackendUnavailable as BackendUnavailable,
    CommandDecodeError as CommandDecodeError,
    DatabaseCorrupt as DatabaseCorrupt,
    DatabaseTooNew as DatabaseTooNew,
    EventDecodeError as EventDecodeError,
    InvalidBatch as InvalidBatch,
    InvalidQuery as InvalidQuery,
    InvalidStoreUrl as InvalidStoreUrl,
    NodeInUse as NodeInUse,
    NotAnAionDatabase as NotAnAionDatabase,
    NotFound as NotFound,
    NotOwner as NotOwner,
    ScheduleAlreadyExists as ScheduleAlreadyExists,
    ScheduleConflict as ScheduleConflict,
    SequenceConflict as SequenceConflict,
    SerializationError as SerializationError,
    StoreDecodeError as StoreDecodeError,
    StoreEncodeError as StoreEncodeError,
    StoreError as StoreError,
    StoreOpenError as StoreOpenError,
    StoreOwned as StoreOwned,
    StorePathError as StorePathError,
    StoreTakenOver as StoreTakenOver,
    WorkflowFenced as WorkflowFenced,
)
from .._events import (
    Event as Event,
    EventBody as EventBody,
    SearchValue as SearchValue,
    WorkflowStatus as WorkflowStatus,
)
from .._ownership import (
    OwnerClaim as OwnerClaim,
    OwnerIdentity as OwnerIdentity,
    claim_is_live as claim_is_live,
    decide_claim as decide_claim,
    decide_renew as decide_renew,
    fenced_write as fenced_write,
    owner_alive as owner_alive,
    pid_alive as pid_alive,
    process_mark as process_mark,
    this_host as this_host,
)
from .._projections import (
    is_active_status as is_active_status,
    status_after as status_after,
)
from .._store import (
    ADMITTED as ADMITTED,
    QUEUED as QUEUED,
    BulkHistoryReads as BulkHistoryReads,
    ClusterStore as ClusterStore,
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
    ThreadRenewal as ThreadRenewal,
    TimerEntry as TimerEntry,
    VisibilityFilter as VisibilityFilter,
    VisibilityRow as VisibilityRow,
    VisibilityStore as VisibilityStore,
    rate_window as rate_window,
    validate_batch as validate_batch,
    validate_flow_key as validate_flow_key,
    validate_flow_waiter as validate_flow_waiter,
    validate_schedule_write as validate_schedule_write,
    validate_workflow_ids as validate_workflow_ids,
)
from .._urls import redact_url as redact_url
from .._util import fixup_module_metadata as _fixup_module_metadata
from .._wire import (
    body_data_json as body_data_json,
    body_from_data_json as body_from_data_json,
    event_from_json as event_from_json,
    event_to_json as event_to_json,
    events_from_rows as events_from_rows,
    format_datetime as format_datetime,
    parse_datetime as parse_datetime,
)
from ._manager import (
    DISABLE_ENV as DISABLE_ENV,
    PluginLoadError as PluginLoadError,
    build_registry as build_registry,
    make_plugin_manager as make_plugin_manager,
)
from ._registry import (
    ENTRY_POINT_GROUP as ENTRY_POINT_GROUP,
    StoreOpener as StoreOpener,
    StoreRegistry as StoreRegistry,
    StoreScheme as StoreScheme,
)
from .hookspecs import hookimpl as hookimpl, hookspec as hookspec

_fixup_module_metadata(__name__, globals())
del _fixup_module_metadata
