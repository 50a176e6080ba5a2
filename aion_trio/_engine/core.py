"""``EngineCore``: the engine as its callers see it, the shared handles, the definitions and the services.

The engine's work is done by its services (runs, steps, timers, dispatch, the
recorder cache, the schedule window, visibility, teardown, recovery), built
and wired by ``open_engine`` (``_engine/wiring.py``).  ``EngineCore`` holds the
handles they share (the store, the epoch, the clock, the registry, ...),
looks up definitions, and answers the entry points the engine's callers name
as protocols (``_hub``'s hubs for completion, children, the cluster services
and the poison-run guard; ``_run_port``'s definitions for a run's port; the
calls of the client and the local commands), each by handing it to the
service that does it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import trio

from .. import _children as children
from .._activities import ActivityDispatcher, ActivityRequest
from .._clock import EngineClock
from .._cluster import ClusterServices
from .._definitions import ActivityDefinition, WorkflowDefinition
from .._epoch import EngineEpoch
from .._errors import NotOwner, UnknownActivityType, UnknownWorkflowType
from .._events import Event, WorkflowContinuedAsNew
from .._hub import ClientCommands
from .._observe import ObserverHub
from .._payload import Payload, PayloadCodec
from .._recorder import Recorder
from .._registry import Lease, Registry
from .._store import ClusterStore, EventStore, Store, VisibilityStore
from .._transient import Transient
from .config import EngineConfig
from .dispatch import ActivityDispatch
from .recorders import Recorders
from .recovery import Recovery
from .residency import ResidencyService
from .runner import Runner
from .steps import StepRecorder
from .teardown import RunTeardown
from .timers import Timers
from .visibility import VisibilityRows
from .window import ScheduleWindow


class EngineCore:
    """The shared handles, the definitions, and the engine's entry points for its callers."""

    def __init__(
        self,
        *,
        store: Store,
        events: EventStore,
        visibility: VisibilityStore,
        epoch: EngineEpoch,
        workflows: Mapping[str, WorkflowDefinition[Any]],
        activities: Mapping[str, ActivityDefinition[Any]],
        config: EngineConfig,
        clock: EngineClock,
        dispatcher: ActivityDispatcher,
        observers: ObserverHub | None,
        cluster: ClusterStore | None,
        registry: Registry,
        stuck: dict[str, str],
        transient: Transient,
        service_threads: trio.CapacityLimiter,
    ) -> None:
        self.store = store
        #: The store's event and visibility stores, wrapped for the observers if any.
        self.events = events
        self.visibility = visibility
        self.epoch = epoch
        self.workflows = workflows
        self.activities = activities
        self.config = config
        self.codec: PayloadCodec = config.codec
        self.clock = clock
        self.dispatcher = dispatcher
        #: The engine's observers; ``None`` (nobody observes) costs nothing.
        self.observers = observers
        #: Cluster mode: the store's node capability (``None``: a single-owner store).
        self.cluster = cluster
        self.registry = registry
        #: Why a workflow is stuck, by workflow id.
        self.stuck = stuck
        #: How every path of this engine retries a transient store fault.
        self.transient = transient
        #: Threads for wall-clock waits of the engine's services.
        self.service_threads = service_threads
        #: Cluster mode: the waker, sweeper and remote commands (set by ``open_engine``).
        self.cluster_services: ClusterServices | None = None
        #: Commands as a client sends them (set by ``open_engine``): children cancel and
        #: terminate a child through them, so in cluster mode they reach its owner.
        self.client_commands: ClientCommands | None = None

    def attach(
        self,
        *,
        residency: ResidencyService,
        recorders: Recorders,
        runner: Runner,
        timers: Timers,
        activity_dispatch: ActivityDispatch,
        visibility_rows: VisibilityRows,
        window: ScheduleWindow,
        steps: StepRecorder,
        teardown: RunTeardown,
        recovery: Recovery,
    ) -> None:
        """Take the services ``open_engine`` built (they call back into this core)."""
        self.residency = residency
        self.recorders = recorders
        self.runner = runner
        self.timers = timers
        self.activity_dispatch = activity_dispatch
        self.visibility_rows = visibility_rows
        self.window = window
        self.steps = steps
        self.teardown = teardown
        self.recovery = recovery

    # -- definitions -------------------------------------------------------

    def workflow_definition(self, workflow: WorkflowDefinition[Any] | str) -> WorkflowDefinition[Any]:
        name = workflow if isinstance(workflow, str) else getattr(workflow, "name", None)
        found = self.workflows.get(name) if isinstance(name, str) else None
        if found is None:
            raise UnknownWorkflowType(str(name if name is not None else workflow), sorted(self.workflows))
        return found

    def activity_definition(self, activity: ActivityDefinition[Any] | str) -> ActivityDefinition[Any]:
        name = activity if isinstance(activity, str) else getattr(activity, "name", None)
        found = self.activities.get(name) if isinstance(name, str) else None
        if found is None:
            raise UnknownActivityType(str(name if name is not None else activity), sorted(self.activities))
        return found

    def resolved_activity_options(
        self, definition: ActivityDefinition[Any], call_layer: Mapping[str, Any]
    ) -> tuple[str, Payload]:
        return self.activity_dispatch.resolved_options(definition, call_layer)

    # -- recorders (_engine/recorders.py) --------------------------------------

    async def recorder_for(self, workflow_id: str) -> Recorder:
        return await self.recorders.recorder_for(workflow_id)

    async def take_fresh(self, workflow_id: str) -> None:
        await self.recorders.take_fresh(workflow_id)

    def loaded_recorder(self, workflow_id: str) -> Recorder | None:
        return self.recorders.loaded_recorder(workflow_id)

    def held_workflows(self) -> list[str]:
        return self.recorders.held()

    def relinquish_lost(self, workflow_id: str, error: NotOwner) -> None:
        self.recorders.relinquish_lost(workflow_id, error)

    def drives(self, workflow_id: str) -> bool:
        return self.recorders.drives(workflow_id)

    # -- runs (_engine/runner.py) ------------------------------------------------

    async def resume_idle(self, workflow_id: str) -> None:
        await self.runner.resume_idle(workflow_id)

    async def reopen_locked(
        self,
        recorder: Recorder,
        run_id: str,
        workflow_type: str,
        activity_ids: Sequence[int] = (),
        request_id: str | None = None,
    ) -> Lease:
        return await self.runner.reopen_locked(recorder, run_id, workflow_type, activity_ids, request_id)

    def new_lease(self, recorder: Recorder, run_id: str, workflow_type: str) -> Lease:
        return self.runner.new_lease(recorder, run_id, workflow_type)

    def spawn_run(self, lease: Lease) -> None:
        self.runner.spawn_run(lease)

    async def start_successor(self, lease: Lease, terminal: WorkflowContinuedAsNew) -> Lease | None:
        return await self.runner.start_successor(lease, terminal)

    def workflow_closed(self, workflow_id: str) -> None:
        """Hook: a closed workflow's terminal is durable and its bookkeeping done; it leaves
        memory after ``EngineConfig.release_closed_after``.  No checkpoint."""
        self.residency.closed(workflow_id)

    async def run_closed(self, workflow_id: str, run_id: str) -> None:
        """Hook: the run's terminal is durable.  Applies its children's parent-close policy
        and delivers a child's final outcome to its parent.  Idempotent; never raises."""
        await children.run_closed(self, workflow_id, run_id)

    # -- ending a run from outside, recovery (_engine/teardown.py, recovery.py) ---

    def stop_run_locally(self, workflow_id: str, run_id: str, terminal: Event) -> None:
        self.teardown.stop_run_locally(workflow_id, run_id, terminal)

    async def recover_one(self, workflow_id: str) -> bool:
        return await self.recovery.recover_one(workflow_id)

    # -- timers and activities (_engine/timers.py, dispatch.py) ------------------

    async def arm_timer(self, workflow_id: str, run_id: str, timer_id: str, fire_at: datetime) -> None:
        await self.timers.arm(workflow_id, run_id, timer_id, fire_at)

    async def forget_timer(self, workflow_id: str, timer_id: str) -> None:
        await self.timers.forget(workflow_id, timer_id)

    def dispatch(self, recorder: Recorder, request: ActivityRequest, *, resume: bool = False) -> None:
        self.activity_dispatch.dispatch(recorder, request, resume=resume)

    def cancel_inflight(self, workflow_id: str, run_id: str) -> int:
        return self.activity_dispatch.cancel_inflight(workflow_id, run_id)

    async def redispatch_unsettled(self, recorder: Recorder, run_id: str) -> int:
        return await self.activity_dispatch.redispatch_unsettled(recorder, run_id)

    # -- visibility (_engine/visibility.py) ------------------------------------

    async def upsert_visibility(self, workflow_id: str) -> None:
        await self.visibility_rows.upsert(workflow_id)

    async def upsert_visibility_quietly(self, workflow_id: str) -> None:
        await self.visibility_rows.upsert_quietly(workflow_id)

    async def refresh_visibility_soon(self, workflow_id: str) -> None:
        await self.visibility_rows.refresh_soon(workflow_id)

    async def visibility_settled(self) -> None:
        await self.visibility_rows.settled()

    async def reconcile_visibility(self, active: set[str]) -> None:
        await self.visibility_rows.reconcile(active)
