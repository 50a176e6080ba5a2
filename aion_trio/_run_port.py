"""A run's :class:`~aion_trio._ports.WorkflowPort`, served through its lease.

The context asks its port for a handful of things; :class:`LeasePort` answers
them from the run's lease (identity, the recorder's history), looks up
definitions through :class:`Definitions`, and hands the writes to the engine's
step recorder (:class:`Steps`) with the lease and the run's index attached.
It needs of the engine only these two protocols, so it never imports it.

:class:`HistoryPort` serves a throwaway replay of a recorded history that never
grows: a query of a closed run, and the replayer (:mod:`aion_trio.testing`).  It
records nothing; where the code would take a step history does not hold it
unwinds the code with :class:`HistoryEnded`, and its settle checks (a cancel, a
scope's expiry) answer from history as the engine's do under its lock.  Its
``read_only`` flag says what the end of a finished history means: a stop (a
query) or a divergence to report (the replayer).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol, final

import trio

from ._ports import RunAborted
from ._projections import RunState

if TYPE_CHECKING:
    from ._definitions import ActivityDefinition, WorkflowDefinition
    from ._events import Event
    from ._payload import Payload, PayloadCodec
    from ._ports import ExternalMessage, WorkflowCommand
    from ._registry import Lease


class HistoryEnded(RunAborted):
    """The code went past the end of a history that never grows: the live run would take its
    next step here (a :class:`HistoryPort` unwinds the code with it)."""


class Lookups(Protocol):
    """How a run's port looks definitions up: the engine's, or the replayer's given ones."""

    @property
    def codec(self) -> PayloadCodec: ...

    @property
    def workflows(self) -> Mapping[str, WorkflowDefinition[Any]]: ...

    def activity_definition(self, activity: ActivityDefinition[Any] | str) -> ActivityDefinition[Any]: ...

    def workflow_definition(self, workflow: WorkflowDefinition[Any] | str) -> WorkflowDefinition[Any]: ...


class Definitions(Lookups, Protocol):
    """What a run's port asks of the engine's definitions: lookups and an activity call's options."""

    def resolved_activity_options(
        self, definition: ActivityDefinition[Any], call_layer: Mapping[str, Any]
    ) -> tuple[str, Payload]: ...


class Steps(Protocol):
    """What a run's port asks of the engine's step recorder: the recording of its steps."""

    async def record_commands(
        self, lease: Lease, state: RunState, pending: Sequence[WorkflowCommand]
    ) -> None: ...

    async def record_marker(self, lease: Lease, name: str, value: Payload) -> None: ...

    async def record_activities_cancelled(
        self, lease: Lease, state: RunState, activity_ids: Sequence[int], *, by_workflow: bool = False
    ) -> None: ...

    async def record_activity_scope_timeout(
        self, lease: Lease, state: RunState, activity_id: int, scope_timer: str
    ) -> Event: ...

    async def record_timer_scope_timeout(
        self, lease: Lease, state: RunState, timer_id: str, scope_timer: str
    ) -> Event: ...

    async def cancel_recorded_child(self, lease: Lease, ordinal: int) -> None: ...

    async def deliver_external(self, lease: Lease, ordinal: int, message: ExternalMessage) -> None: ...

    async def look_up_event(self, workflow_id: str, key: str) -> dict[str, Any] | None: ...

    def watch_event(
        self, lease: Lease, ordinal: int, workflow_id: str, key: str, until: datetime
    ) -> None: ...


@final
class LeasePort:
    """The port of one execution of a run's code (its lease's)."""

    def __init__(
        self,
        definitions: Definitions,
        steps: Steps,
        lease: Lease,
        on_parked: Callable[[Lease], None] | None = None,
    ) -> None:
        self._definitions = definitions
        #: Told each time the run parks between steps (the engine's residency service).
        self._on_parked = on_parked
        self._steps = steps
        self._lease = lease
        self._recorder = lease.recorder
        self._state = lease.recorder.run_state(lease.run_id)
        self.workflow_id = lease.workflow_id
        self.run_id = lease.run_id
        self.workflow_type = lease.workflow_type
        self.start_head = lease.start_head
        self.read_only = False
        self.codec = definitions.codec

    def run_state(self) -> RunState:
        self._state.sync()
        return self._state

    def history_length(self) -> int:
        return len(self._recorder.history)

    def wait_changed(self) -> Coroutine[Any, Any, None]:
        # The recorder's own wait, handed through: no frame of ours stays parked with it.
        return self._recorder.wait_changed()

    def parked(self) -> None:
        if self._lease.query_waiters:
            self._recorder.notify()  # queries wait for this moment
        if self._on_parked is not None:
            self._on_parked(self._lease)

    def activity_definition(self, activity: ActivityDefinition[Any] | str) -> ActivityDefinition[Any]:
        return self._definitions.activity_definition(activity)

    def workflow_definition(self, workflow: WorkflowDefinition[Any] | str) -> WorkflowDefinition[Any]:
        return self._definitions.workflow_definition(workflow)

    def registered_workflow(self, workflow_type: str) -> WorkflowDefinition[Any] | None:
        return self._definitions.workflows.get(workflow_type)

    def resolved_activity_options(
        self, definition: ActivityDefinition[Any], call_layer: Mapping[str, Any]
    ) -> tuple[str, Payload]:
        return self._definitions.resolved_activity_options(definition, call_layer)

    async def record_commands(self, commands: Sequence[WorkflowCommand]) -> None:
        await self._steps.record_commands(self._lease, self._state, commands)

    async def record_marker(self, name: str, value: Payload) -> None:
        await self._steps.record_marker(self._lease, name, value)

    async def record_activities_cancelled(
        self, activity_ids: Sequence[int], *, by_workflow: bool = False
    ) -> None:
        await self._steps.record_activities_cancelled(
            self._lease, self._state, activity_ids, by_workflow=by_workflow
        )

    async def record_activity_scope_timeout(self, activity_id: int, scope_timer: str) -> Event:
        return await self._steps.record_activity_scope_timeout(
            self._lease, self._state, activity_id, scope_timer
        )

    async def record_timer_scope_timeout(self, timer_id: str, scope_timer: str) -> Event:
        return await self._steps.record_timer_scope_timeout(self._lease, self._state, timer_id, scope_timer)

    async def cancel_recorded_child(self, ordinal: int) -> None:
        await self._steps.cancel_recorded_child(self._lease, ordinal)

    async def deliver_external(self, ordinal: int, message: ExternalMessage) -> None:
        await self._steps.deliver_external(self._lease, ordinal, message)

    async def look_up_event(self, workflow_id: str, key: str) -> dict[str, Any] | None:
        return await self._steps.look_up_event(workflow_id, key)

    async def watch_event(self, ordinal: int, workflow_id: str, key: str, until: datetime) -> None:
        self._steps.watch_event(self._lease, ordinal, workflow_id, key, until)


@final
class HistoryPort:
    """The port of a replay of a recorded history that never grows: it records nothing.

    ``read_only`` says what the end of a finished history means: ``True`` (a query
    of a closed run) stops the code there; ``False`` (the replayer) makes going
    past it a divergence.  Any step history does not hold (a command, a marker, a
    wait that history does not resolve) unwinds the code with :class:`HistoryEnded`.
    Settle checks (a cancel, a scope's expiry) answer from history as the engine's
    step recorder does under its lock, so code that cancels or leaves a timeout
    scope replays as it ran.
    """

    def __init__(
        self,
        lookups: Lookups,
        history: Sequence[Event],
        *,
        workflow_id: str,
        run_id: str,
        workflow_type: str,
        read_only: bool,
    ) -> None:
        self._lookups = lookups
        self._history = list(history)
        self._state = RunState(run_id, self._history)
        self.workflow_id = workflow_id
        self.run_id = run_id
        self.workflow_type = workflow_type
        self.start_head = self._history[-1].seq if self._history else 0
        self.read_only = read_only
        self.codec = lookups.codec

    def run_state(self) -> RunState:
        self._state.sync()
        return self._state

    def history_length(self) -> int:
        return len(self._history)

    async def wait_changed(self) -> None:
        raise HistoryEnded()  # history never grows here: nothing would wake the code

    def parked(self) -> None:
        pass

    def activity_definition(self, activity: ActivityDefinition[Any] | str) -> ActivityDefinition[Any]:
        return self._lookups.activity_definition(activity)

    def workflow_definition(self, workflow: WorkflowDefinition[Any] | str) -> WorkflowDefinition[Any]:
        return self._lookups.workflow_definition(workflow)

    def registered_workflow(self, workflow_type: str) -> WorkflowDefinition[Any] | None:
        return self._lookups.workflows.get(workflow_type)

    def resolved_activity_options(
        self, definition: ActivityDefinition[Any], call_layer: Mapping[str, Any]
    ) -> tuple[str, Payload]:
        raise HistoryEnded()  # asked only for an activity history does not hold

    # Nothing is recorded: a write is a step history does not hold.

    async def record_commands(self, commands: Sequence[WorkflowCommand]) -> None:
        raise HistoryEnded()

    async def record_marker(self, name: str, value: Payload) -> None:
        raise HistoryEnded()

    # Settle checks: answered from history, as the step recorder answers them under its lock.

    async def record_activities_cancelled(
        self, activity_ids: Sequence[int], *, by_workflow: bool = False
    ) -> None:
        state = self.run_state()
        if any(i not in state.settled and i in state.scheduled for i in activity_ids):
            raise HistoryEnded()  # its cancel would be written now
        await trio.lowlevel.checkpoint()

    async def record_activity_scope_timeout(self, activity_id: int, scope_timer: str) -> Event:
        settled = self.run_state().settled.get(activity_id)
        if settled is None:
            raise HistoryEnded()
        await trio.lowlevel.checkpoint()
        return settled

    async def record_timer_scope_timeout(self, timer_id: str, scope_timer: str) -> Event:
        resolved = self.run_state().timer_resolutions.get(timer_id)
        if resolved is None:
            raise HistoryEnded()
        await trio.lowlevel.checkpoint()
        return resolved

    async def cancel_recorded_child(self, ordinal: int) -> None:
        await trio.lowlevel.checkpoint()  # the child's cancel was delivered when it was recorded

    async def deliver_external(self, ordinal: int, message: ExternalMessage) -> None:
        raise HistoryEnded()  # its delivery would be done (and recorded) now

    async def look_up_event(self, workflow_id: str, key: str) -> dict[str, Any] | None:
        raise HistoryEnded()  # its answer would be recorded now

    async def watch_event(self, ordinal: int, workflow_id: str, key: str, until: datetime) -> None:
        raise HistoryEnded()
