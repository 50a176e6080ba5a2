"""What each of the engine's services asks of the engine, written down as protocols.

The completion path, the poison-run guard, the cluster services, the child
workflows and the inbox drainer are callbacks of the engine: they are handed the
engine (its ``EngineCore``, which hands each call to the service that does it,
or for the inbox its local commands) and call back into it.  Each names here the
handful of things it uses, so it never imports the engine, at runtime or for
typing; the engine satisfies every protocol structurally.  The settings they
read are likewise named (:class:`Settings`), not the engine's configuration
class.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import trio

    from ._activities import ActivityRequest
    from ._clock import EngineClock
    from ._commands import ActivityCommand, IdReusePolicy
    from ._epoch import EngineEpoch
    from ._errors import NotOwner
    from ._events import WorkflowContinuedAsNew, WorkflowStarted
    from ._observe import ObserverHub
    from ._payload import Payload
    from ._recorder import Recorder
    from ._registry import Lease, Registry
    from ._store import ClusterStore, EventStore, Store
    from ._transient import Ladder, Transient


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

    def workflow_closed(self, workflow_id: str) -> None: ...

    async def upsert_visibility(self, workflow_id: str) -> None: ...

    async def start_successor(self, lease: Lease, terminal: WorkflowContinuedAsNew) -> Lease | None: ...


class RecoveryHub(Protocol):
    """What the poison-run guard (``_poison``) asks of the engine."""

    @property
    def transient(self) -> Transient: ...

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

    def held_workflows(self) -> list[str]: ...

    def relinquish_lost(self, workflow_id: str, error: NotOwner) -> None: ...

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


class ClientCommands(Protocol):
    """Commands sent as any client sends them: applied here, or in cluster mode sent to
    the node owning the workflow (``Engine`` provides them)."""

    async def cancel(self, workflow_id: str, reason: str = "", *, request_id: str | None = None) -> None: ...

    async def signal(
        self, workflow_id: str, name: str, payload: Any = None, *, request_id: str | None = None
    ) -> None: ...

    async def terminate(
        self, workflow_id: str, reason: str = "", *, request_id: str | None = None
    ) -> None: ...


class ChildrenHub(Protocol):
    """What child workflows (``_children``) ask of the engine."""

    @property
    def transient(self) -> Transient: ...

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

    @property
    def client_commands(self) -> ClientCommands | None: ...

    async def upsert_visibility_quietly(self, workflow_id: str) -> None: ...


class StartedRun(Protocol):
    """A run a local start or reopen made current."""

    @property
    def workflow_id(self) -> str: ...

    @property
    def run_id(self) -> str: ...

    @property
    def created(self) -> bool:
        """True: this call (or the first call with its request id) recorded the start."""
        ...


class InboxHub(Protocol):
    """What the inbox drainer (``_inbox``) asks of the engine: the commands applied on this
    node, with no routing (``_engine/local.py``'s ``LocalCommands`` provides them).

    Each is applied under its request id (a key already recorded records nothing and
    answers as the first call did); a refusal is raised as its typed error."""

    @property
    def admitting(self) -> bool: ...

    def decode(self, payload: Payload) -> Any: ...

    async def start(
        self,
        workflow: str,
        args: Sequence[Any],
        *,
        workflow_id: str | None,
        id_reuse: IdReusePolicy,
        task_queue: str | None,
        request_id: str | None,
    ) -> StartedRun: ...

    async def signal(self, workflow_id: str, name: str, payload: Payload, request_id: str | None) -> None: ...

    async def signal_with_start(
        self,
        workflow: str,
        args: Sequence[Any],
        signal_name: str,
        encoded: Payload,
        *,
        workflow_id: str,
        id_reuse: IdReusePolicy,
        task_queue: str | None,
        search_attributes: Mapping[str, Any] | None,
        timeout: timedelta | None,  # noqa: ASYNC109 - a durable workflow deadline
        request_id: str | None,
    ) -> StartedRun: ...

    async def cancel(self, workflow_id: str, reason: str, request_id: str | None) -> None: ...

    async def terminate(self, workflow_id: str, reason: str, request_id: str | None) -> None: ...

    async def reopen(self, workflow_id: str, request_id: str | None) -> StartedRun: ...

    async def reset(
        self, workflow_id: str, to_seq: int | None, reason: str, request_id: str | None
    ) -> StartedRun: ...

    async def query(self, workflow_id: str, name: str, arguments: Payload) -> Any: ...

    async def accept_update(self, workflow_id: str, name: str, encoded: Payload, update_id: str) -> None: ...

    async def activity_by_token(self, command: ActivityCommand) -> None: ...
