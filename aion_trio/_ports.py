"""The engine's ports: what one layer may ask of another, written down as protocols.

The bottom of the engine's layers, beside the domain model: protocols and plain
records, no behaviour.  A module that needs something of the engine names it
here and is handed an implementation; it never imports the engine.

* :class:`WorkflowPort` -- all that a run's workflow code (the
  :class:`~aion_trio.WorkflowContext`) may ask of the engine.  One port per
  execution of a run's code; a test drives a context against a fake one.
* The commands workflow code issues (:class:`ScheduleActivity`,
  :class:`StartTimer`, :class:`CancelTimer`, :class:`StartChild`,
  :class:`UpsertSearchAttributes`, :class:`CompleteUpdate`): the context
  queues them, the port records them as one batch.
* :class:`ActiveRun` -- what the engine's services read of a run's code while
  it executes (queries, the recovery watch).
* :class:`RunAborted` -- how the port unwinds workflow code without a terminal.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal, Protocol, Union, final

import attrs

from ._childspec import ChildOptions
from ._payload import Payload

if TYPE_CHECKING:
    from ._definitions import ActivityDefinition, WorkflowDefinition
    from ._events import ErrorInfo, Event, SearchValue
    from ._payload import PayloadCodec
    from ._projections import RunState


class RunAborted(BaseException):
    """Unwinds workflow code without recording a terminal (epoch closed, double writer, ...).

    A ``BaseException`` so ``except Exception`` in workflow code cannot swallow
    it.  The run stays Running in the store; the next engine's recovery (or an
    operator) takes it from there.
    """


# -- the commands a run's code issues ------------------------------------------------


@final
@attrs.define(eq=False)
class ScheduleActivity:
    """Schedule activity ``ordinal`` (its first attempt starts once it is recorded)."""

    ordinal: int
    definition: ActivityDefinition[Any]
    input: Payload
    task_queue: str
    options: Payload


@final
@attrs.define(eq=False)
class StartTimer:
    timer_id: str
    fire_at: datetime


@final
@attrs.define(eq=False)
class CancelTimer:
    """Retire ``timer_id`` (nothing is recorded if it already fired)."""

    timer_id: str


@final
@attrs.define(eq=False)
class StartChild:
    """Start child ``ordinal`` (recorded with its options marker, then started)."""

    ordinal: int
    child_workflow_id: str
    workflow_type: str
    input: Payload
    options: ChildOptions


@final
@attrs.define(eq=False)
class UpsertSearchAttributes:
    """Record the run's ``ordinal``-th search-attribute upsert (``ctx.upsert_search_attributes``)."""

    ordinal: int
    attributes: Mapping[str, SearchValue]


@final
@attrs.frozen
class ExternalMessage:
    """A message the run's code sends another workflow (``ctx.signal_external``,
    ``ctx.cancel_external``), recorded as its ``ordinal``-th before it is delivered."""

    kind: Literal["signal", "cancel"]
    workflow_id: str
    #: The signal's name and payload (as the code passed it); a cancel's reason.
    name: str = ""
    payload: Any = None
    reason: str = ""


@attrs.define(eq=False)
class CompleteUpdate:
    """Record the outcome of accepted update ``update_id``'s handler (``UpdateCompleted``)."""

    update_id: str
    result: Payload | None
    error: ErrorInfo | None


WorkflowCommand = Union[
    ScheduleActivity, StartTimer, CancelTimer, StartChild, UpsertSearchAttributes, CompleteUpdate
]
"""A command workflow code issued, queued until its next await records the batch."""


# -- what workflow code may ask of the engine ---------------------------------------------


class WorkflowPort(Protocol):
    """One execution of a run's code, as the engine serves it.

    The context reads history only through :meth:`run_state` (the run's
    segment of its recorder's history, a prefix that only grows) and writes
    only through the ``record_*`` calls, each of which appends under the
    recorder's lock with a settle check.  Any ``record_*`` call may raise
    :class:`RunAborted`.
    """

    @property
    def workflow_id(self) -> str: ...

    @property
    def run_id(self) -> str: ...

    @property
    def workflow_type(self) -> str: ...

    @property
    def start_head(self) -> int:
        """The head of history when this execution began: what is at or below it replays."""
        ...

    @property
    def read_only(self) -> bool:
        """A replay that only rebuilds the code's state (a query of a closed run): at the
        end of history the code is unwound with :class:`RunAborted`, nothing is executed.
        ``False`` for a live run and for the replayer, where code that goes past the end of
        a finished history is a divergence."""
        ...

    @property
    def codec(self) -> PayloadCodec: ...

    def run_state(self) -> RunState:
        """The run's index of its history (one object for the whole execution)."""
        ...

    def history_length(self) -> int:
        """How many events the workflow's history holds now (every run's)."""
        ...

    async def wait_changed(self) -> None:
        """Park until history grows or the run is woken (a stuck mark, a query)."""
        ...

    def parked(self) -> None:
        """The code is parked between steps, caught up with history (queries may read it)."""
        ...

    def activity_definition(self, activity: ActivityDefinition[Any] | str) -> ActivityDefinition[Any]:
        """The registered activity (raises ``UnknownActivityType``)."""
        ...

    def workflow_definition(self, workflow: WorkflowDefinition[Any] | str) -> WorkflowDefinition[Any]:
        """The registered workflow (raises ``UnknownWorkflowType``)."""
        ...

    def registered_workflow(self, workflow_type: str) -> WorkflowDefinition[Any] | None: ...

    def resolved_activity_options(
        self, definition: ActivityDefinition[Any], call_layer: Mapping[str, Any]
    ) -> tuple[str, Payload]:
        """A live call's task queue and recorded options (raises if they do not fit)."""
        ...

    async def record_commands(self, commands: Sequence[WorkflowCommand]) -> None:
        """Record the commands as one batch, then start what they start."""
        ...

    async def record_marker(self, name: str, value: Payload) -> None: ...

    async def record_activities_cancelled(
        self, activity_ids: Sequence[int], *, by_workflow: bool = False
    ) -> None:
        """Settle the unsettled ones as cancelled and stop their running attempts."""
        ...

    async def record_activity_scope_timeout(self, activity_id: int, scope_timer: str) -> Event:
        """A scope expired while awaiting the activity: its final failure, or what settled it first."""
        ...

    async def record_timer_scope_timeout(self, timer_id: str, scope_timer: str) -> Event:
        """A scope expired while awaiting the timer: its cancel, or the fire that came first."""
        ...

    async def cancel_recorded_child(self, ordinal: int) -> None:
        """Deliver the cancel the run recorded for child ``ordinal`` (idempotent)."""
        ...

    async def deliver_external(self, ordinal: int, message: ExternalMessage) -> None:
        """Deliver the run's recorded message ``ordinal`` to its target (idempotent: its
        request id makes a redelivery a no-op), then record how it was received."""
        ...

    async def look_up_event(self, workflow_id: str, key: str) -> dict[str, Any] | None:
        """What ``workflow_id`` published under ``key`` now (``_projections.event_answer``)."""
        ...

    async def watch_event(self, ordinal: int, workflow_id: str, key: str, until: datetime) -> None:
        """Until ``until``, wait in the background for ``workflow_id`` to publish ``key`` (or
        close), then record the run's read ``ordinal``'s result marker."""
        ...


# -- what the engine's services read of a run's executing code --------------------------------


class ActiveRun(Protocol):
    """A run's code while it executes in this engine (``Lease.activation``)."""

    @property
    def is_replaying(self) -> bool: ...

    @property
    def answerable(self) -> bool:
        """Parked between steps with nothing new to consume: a query may read the state now."""
        ...

    def answer_query(self, name: str, args: Sequence[Any]) -> Any:
        """Run the handler for ``name`` synchronously (only while :attr:`answerable`)."""
        ...

    def validate_update(self, name: str, args: Sequence[Any]) -> None:
        """Run update ``name``'s validator synchronously (only while :attr:`answerable`):
        raises what it raised, or :class:`~aion_trio.UpdateRejected` if no handler is registered."""
        ...
