"""What each of the engine's services asks of the engine, written down as protocols.

The completion path, the poison-run guard, the cluster services and the child
workflows are callbacks of the engine: they are handed the engine (today its
``EngineCore``) and call back into it.  Each names here the handful of things it
uses, so it never imports the engine, at runtime or for typing; the engine
satisfies every protocol structurally.  The settings they read are likewise
named (:class:`Settings`), not the engine's configuration class.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import trio

    from ._activities import ActivityRequest
    from ._clock import EngineClock
    from ._epoch import EngineEpoch
    from ._events import WorkflowContinuedAsNew, WorkflowStarted
    from ._observe import ObserverHub
    from ._recorder import Recorder
    from ._registry import Lease, Registry
    from ._store import ClusterStore, EventStore, Store
    from ._transient import Ladder


class Settings(Protocol):
    """The engine settings the services read (``EngineConfig`` provides them)."""

    @property
    def completion_retry(self) -> Ladder: ...

    @property
    def bookkeeping_timeout(self) -> float: ...

    @property
    def max_recovery_attempts(self) -> int | None: ...

    @property
    def sweep_interval(self) -> float: ...

    @property
    def sweep_batch(self) -> int: ...

    @property
    def remote_command_timeout(self) -> float: ...


class InboxSettings(Protocol):
    """The engine settings the inbox drainer reads."""

    @property
    def inbox_batch(self) -> int: ...

    @property
    def inbox_poll_interval(self) -> float | None: ...


class CompletionHub(Protocol):
    """What recording a run's terminal (``_completion``) asks of the engine."""

    @property
    def config(self) -> Settings: ...

    @property
    def epoch(self) -> EngineEpoch: ...

    @property
    def observers(self) -> ObserverHub | None: ...

    def loaded_recorder(self, workflow_id: str) -> Recorder | None: ...

    @property
    def registry(self) -> Registry: ...

    def cancel_inflight(self, workflow_id: str, run_id: str) -> int: ...

    async def forget_timer(self, workflow_id: str, timer_id: str) -> None: ...

    async def run_closed(self, workflow_id: str, run_id: str) -> None: ...

    async def upsert_visibility(self, workflow_id: str) -> None: ...

    async def start_successor(self, lease: Lease, terminal: WorkflowContinuedAsNew) -> Lease | None: ...


class RecoveryHub(Protocol):
    """What the poison-run guard (``_poison``) asks of the engine."""

    @property
    def config(self) -> Settings: ...

    @property
    def store(self) -> Store: ...

    @property
    def epoch(self) -> EngineEpoch: ...

    @property
    def observers(self) -> ObserverHub | None: ...

    def dispatch(self, recorder: Recorder, request: ActivityRequest, *, resume: bool = False) -> None: ...


class ClusterHub(Protocol):
    """What the cluster services (``_cluster``) ask of the engine."""

    @property
    def config(self) -> Settings: ...

    @property
    def epoch(self) -> EngineEpoch: ...

    @property
    def registry(self) -> Registry: ...

    @property
    def service_threads(self) -> trio.CapacityLimiter: ...

    def loaded_recorder(self, workflow_id: str) -> Recorder | None: ...

    async def take_fresh(self, workflow_id: str) -> None: ...

    async def recover_one(self, workflow_id: str) -> bool: ...

    async def reconcile_visibility(self, active: set[str]) -> None: ...


class StartRetry(Protocol):
    """Runs the tries of a start's append (``attempt``) until one lands or it gives up."""

    async def __call__(self, attempt: Callable[[], Awaitable[None]]) -> None: ...


class RunStarter(Protocol):
    """The one start path: record a run's start and run it here (``Runner.start_run_locked``)."""

    async def start_run_locked(
        self,
        recorder: Recorder,
        started: WorkflowStarted,
        *,
        now: datetime,
        action: str,
        arm_deadline: bool = True,
        retry: StartRetry | None = None,
        resume_if_unknown: bool = False,
        landed: Callable[[], None] | None = None,
    ) -> Lease: ...


class ChildrenHub(Protocol):
    """What child workflows (``_children``) ask of the engine."""

    @property
    def config(self) -> Settings: ...

    @property
    def epoch(self) -> EngineEpoch: ...

    @property
    def observers(self) -> ObserverHub | None: ...

    @property
    def clock(self) -> EngineClock: ...

    @property
    def events(self) -> EventStore: ...

    @property
    def cluster(self) -> ClusterStore | None: ...

    async def recorder_for(self, workflow_id: str) -> Recorder: ...

    def loaded_recorder(self, workflow_id: str) -> Recorder | None: ...

    def drives(self, workflow_id: str) -> bool: ...

    @property
    def runner(self) -> RunStarter: ...

    async def upsert_visibility_quietly(self, workflow_id: str) -> None: ...
