"""Running activities and recording their outcomes (docs/architecture.md, "Activities").

Dispatch goes through an :class:`ActivityDispatcher` (``protocol``); the default,
:class:`InProcessDispatcher` (``inprocess``), runs registered activities in this process, plain
``def`` ones in worker threads (``threads``).  What a running activity sees (its identity,
``heartbeat()``, ``activity_cancelled()``) is ``context``.  :class:`ActivityDriver` (``driver``)
takes one activity to its final outcome; every record it makes goes through
:func:`record_activity_event` (``records``).  An attempt that completes later
(:func:`complete_async`) is named by a :class:`TaskToken` (``tokens``); what callers bring
by token reaches its driver through :class:`AwaitingAttempts` (``awaiting``).
"""

from .awaiting import AwaitingAttempts as AwaitingAttempts, command_outcome as command_outcome
from .codec import (
    DecodingDispatcher as DecodingDispatcher,
    EncodingDispatcher as EncodingDispatcher,
    decoding_executor as decoding_executor,
)
from .context import (
    ActivityInfo as ActivityInfo,
    activity_cancelled as activity_cancelled,
    activity_info as activity_info,
    heartbeat as heartbeat,
    report_heartbeat_details as report_heartbeat_details,
)
from .driver import ActivityDriver as ActivityDriver
from .inprocess import InProcessDispatcher as InProcessDispatcher
from .protocol import (
    ActivityDispatcher as ActivityDispatcher,
    ActivityExecutor as ActivityExecutor,
    ActivityOutcome as ActivityOutcome,
    ActivityRequest as ActivityRequest,
    DelegatingDispatcher as DelegatingDispatcher,
    OutcomeKind as OutcomeKind,
)
from .records import RecordOutcome as RecordOutcome, record_activity_event as record_activity_event
from .tokens import CompleteAsync as CompleteAsync, TaskToken as TaskToken, complete_async as complete_async
