"""The client API: ``Engine`` and ``RunHandle``."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Generic, TypeVar, final, overload

import attrs
import trio

from .._activities import InProcessDispatcher, TaskToken
from .._chain import ChainState, follow_chain, settled_result
from .._cluster import ClusterServices, outcome_error, query_answer
from .._commands import (
    ActivityCommand,
    CancelCommand,
    Command,
    CommandOutcome,
    IdReusePolicy,
    QueryCommand,
    ReopenCommand,
    ResetCommand,
    SignalCommand,
    SignalWithStartCommand,
    TerminateCommand,
    UpdateCommand,
)
from .._definitions import WorkflowDefinition
from .._epoch import EngineEpoch
from .._errors import (
    TerminalError,
    UpdateFailed,
    UpdateUnavailable,
    WorkflowFenced,
    WorkflowNotFound,
    epoch_closed,
)
from .._events import (
    Event,
    UpdateCompleted,
    WorkflowStatus,
    has_lifecycle,
)
from .._ids import (
    check_text,
    validate_caller_request_id,
    validate_workflow_id,
)
from .._inbox import InboxDrainer, Ownership
from .._ownership import OwnerClaim
from .._projections import (
    accepted_update,
    is_active,
    latest_run_id,
    published_event,
    run_status,
    update_outcome,
)
from .._recorder import Recorder
from .._registry import Residency
from .._retry import duration_seconds
from .._store import (
    Store,
    VisibilityFilter,
    VisibilityRow,
)
from .config import EngineStatistics, WorkflowDescription
from .core import EngineCore
from .describe import describe_history
from .local import LocalCommands, Started
from .queues import QueuedHandle, WorkflowQueues
from .schedules import Schedules, open_schedules

if TYPE_CHECKING:
    from typing_extensions import TypeVarTuple, Unpack

    from .._context import WorkflowContext

    #: A workflow's parameters after ``ctx``: what ``start`` checks its arguments against.
    Ts = TypeVarTuple("Ts")

R = TypeVar("R")


@final
class RunHandle(Generic[R]):
    """A started run: ``await handle.result()``.

    Generic in the workflow's result type: ``engine.start(checkout, order)`` of an
    ``async def checkout(ctx, order: dict) -> str`` gives a ``RunHandle[str]``.

    ``created`` is true when the call that returned the handle recorded the run's
    start (a retry with the same ``request_id`` returns the first call's handle,
    so it is true there too); false when it attached to a run that existed
    (``IdReusePolicy.USE_EXISTING``) or reopened one.
    """

    def __init__(
        self,
        engine: Engine,
        workflow_id: str,
        run_id: str,
        *,
        created: bool = False,
        definition: WorkflowDefinition[Any] | None = None,
    ) -> None:
        self._engine = engine
        self.workflow_id = workflow_id
        self.run_id = run_id
        self.created = created
        #: The started workflow's registered definition: its return type decodes the result.
        self._definition = definition

    async def result(self, *, follow_continue_as_new: bool = True) -> R:
        """The run's result, decoded to the workflow's annotated return type when the handle
        came from starting a registered workflow (:meth:`Engine.result` gives plain JSON data)."""
        value = await self._engine.result(
            self.workflow_id, run_id=self.run_id, follow_continue_as_new=follow_continue_as_new
        )
        definition = self._definition
        if definition is None:
            return value  # type: ignore[no-any-return]
        return definition.hints.decode_result(  # type: ignore[no-any-return]
            value, what=f"result of workflow {definition.name!r}"
        )

    async def describe(self) -> WorkflowDescription:
        """The workflow's current state (``Engine.describe`` of this handle's workflow)."""
        return await self._engine.describe(self.workflow_id)

    def __repr__(self) -> str:
        return f"<RunHandle {self.workflow_id!r} run {self.run_id}{'' if self.created else ' (existing)'}>"


@final
class Engine:
    """A running engine.  Obtain one with :func:`open_engine`."""

    def __init__(
        self,
        core: EngineCore,
        *,
        local: LocalCommands,
        ownership: Ownership | None = None,
        threads: InProcessDispatcher | None = None,
    ) -> None:
        self._core = core
        #: The commands applied on this node (the table the inbox drainer applies too).
        self._local = local
        self._ownership = ownership
        self._threads = threads
        self._inbox: InboxDrainer | None = None
        #: Cluster mode's services (``None``: a single-owner store): every client built
        #: on this core routes commands for workflows other nodes own the same way.
        self._cluster: ClusterServices | None = core.cluster_services
        #: Durable schedules (docs/schedules.md); the service that fires them runs in the epoch.
        self.schedules: Schedules = open_schedules(
            self,
            store=core.store,
            location=type(core.store).__name__,
            clock=core.clock,
            workflow_definition=core.workflow_definition,
            node=None if core.cluster is None else core.cluster.node_id,
            claim_ttl=core.config.schedule_claim_ttl,
            poll_interval=core.config.schedule_poll_interval,
            # Its own thread for the wall-clock poll, so it never holds a slot the heartbeats need.
            limiter=trio.CapacityLimiter(1),
        )

        #: Workflow queues (docs/flow-control.md); the service admitting runs runs in the epoch.
        self.queues = WorkflowQueues(
            client=self,
            store=core.store,
            queues=core.config.workflow_queues,
            codec=core.codec,
            codecs=core.config.codecs,
            now=core.clock.now,
            poll_interval=core.config.queue_poll_interval,
            workflow_definition=core.workflow_definition,
            spawn=core.epoch.spawn,
        )

    async def enqueue(
        self,
        workflow: WorkflowDefinition[Any] | str,
        *args: Any,
        queue: str,
        priority: int = 0,
        dedup_id: str | None = None,
        partition_key: str | None = None,
        workflow_id: str | None = None,
        search_attributes: Mapping[str, Any] | None = None,
        timeout: timedelta | float | None = None,  # noqa: ASYNC109 - a durable workflow deadline
        id_reuse: IdReusePolicy = IdReusePolicy.ALLOW_DUPLICATE,
    ) -> QueuedHandle:
        """Put a run of ``workflow`` into the workflow queue ``queue`` (one of
        ``EngineConfig.workflow_queues``); it starts, through :meth:`start`, once its
        queue's limit admits it: by ``priority`` (lower first), then in order of arrival,
        each ``partition_key`` bounded on its own in a partitioned queue.

        Returns at once, once the entry is durable, with a :class:`QueuedHandle`
        (``await handle.result()``).  ``dedup_id``: while a run with the same id is
        queued or running in this queue, the enqueue is refused with
        :class:`QueueDeduplicated` (naming that run's workflow id) and writes nothing.
        Bad input (an unknown queue or workflow, arguments that cannot be encoded, a
        missing or needless ``partition_key``) raises before anything is written.

        ``id_reuse`` (with a ``workflow_id``) means what it means for :meth:`start`, and
        applies twice: now, against the workflow as it is (a refusal raises
        :class:`WorkflowAlreadyStarted` and writes nothing; ``USE_EXISTING`` returns a
        handle of the existing run, ``created`` false, and writes nothing), and again at
        admission, when the run starts: if the id was taken meanwhile and the policy
        refuses, the entry ends without a run and gives its place back, and its
        handle's ``result()`` raises :class:`WorkflowAlreadyStarted`
        (``USE_EXISTING``: the entry ends, its handle gives the existing run's result).
        The policy is stored with the entry, so it survives a restart.
        """
        return await self.queues.enqueue(
            workflow,
            *args,
            queue=queue,
            priority=priority,
            dedup_id=dedup_id,
            partition_key=partition_key,
            workflow_id=workflow_id,
            search_attributes=search_attributes,
            timeout=timeout,
            id_reuse=id_reuse,
        )

    @property
    def epoch(self) -> EngineEpoch:
        """The engine's epoch: its nursery and the latch background writes check."""
        return self._core.epoch

    @property
    def owner_claim(self) -> OwnerClaim | None:
        """This engine's claim on its store (``None``: the store has no ownership capability)."""
        return self._ownership.claim if self._ownership is not None else None

    async def drain_inbox(self) -> int:
        """Apply the store inbox's pending commands now, in order; returns how many were acked.

        The engine also drains at open and every ``EngineConfig.inbox_poll_interval``
        seconds.  Each command is applied here as the matching client method
        applies it (``start``, ``signal``, ``cancel``, ``terminate``, ``reopen``,
        ``query``: the same local commands) and is acked
        with its outcome: ok, or the typed error's one-line message.  A store
        without an inbox: 0.
        """
        if self._inbox is None:
            await trio.lowlevel.checkpoint()
            return 0
        return await self._inbox.drain()

    @property
    def store(self) -> Store:
        """The store this engine runs on (opened by ``open_engine`` when given a URL)."""
        return self._core.store

    def statistics(self) -> EngineStatistics:
        """A snapshot of the engine's bookkeeping now (``EngineStatistics``); sync, reads memory only."""
        leases = self._core.registry.leases()
        services = self._core.cluster_services
        return EngineStatistics(
            registered_leases=len(leases),
            resident_runs=sum(1 for lease in leases if lease.task is not None),
            stuck_runs=sum(1 for lease in leases if lease.residency is Residency.STUCK),
            loaded_recorders=self._core.recorders.count,
            epoch=self._core.epoch.statistics(),
            abandoned_activity_threads=0 if self._threads is None else self._threads.abandoned_threads(),
            owner_renewals=0 if self._ownership is None else self._ownership.renewals,
            evicted_runs=self._core.registry.evicted_count,
            evictions=self._core.residency.evictions,
            reloads=self._core.residency.reloads,
            released_workflows=self._core.residency.released,
            relinquished_workflows=self._core.recorders.relinquished,
            rejoins=0 if services is None else services.rejoins,
            lost_on_rejoin=0 if services is None else services.lost_on_rejoin,
            flow_pools=tuple(pool.statistics() for pool in self._core.activity_dispatch.pools.all()),
        )

    @overload
    async def start(
        self,
        workflow: WorkflowDefinition[Callable[[WorkflowContext, Unpack[Ts]], Awaitable[R]]],
        *args: Unpack[Ts],
        workflow_id: str | None = None,
        id_reuse: IdReusePolicy = IdReusePolicy.ALLOW_DUPLICATE,
        search_attributes: Mapping[str, Any] | None = None,
        task_queue: str | None = None,
        timeout: timedelta | float | None = None,  # noqa: ASYNC109 - a durable workflow deadline
        request_id: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> RunHandle[R]: ...

    @overload
    async def start(
        self,
        workflow: str,
        *args: Any,
        workflow_id: str | None = None,
        id_reuse: IdReusePolicy = IdReusePolicy.ALLOW_DUPLICATE,
        search_attributes: Mapping[str, Any] | None = None,
        task_queue: str | None = None,
        timeout: timedelta | float | None = None,  # noqa: ASYNC109 - a durable workflow deadline
        request_id: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> RunHandle[Any]: ...

    async def start(
        self,
        workflow: WorkflowDefinition[Any] | str,
        *args: Unpack[Ts],
        workflow_id: str | None = None,
        id_reuse: IdReusePolicy = IdReusePolicy.ALLOW_DUPLICATE,
        search_attributes: Mapping[str, Any] | None = None,
        task_queue: str | None = None,
        timeout: timedelta | float | None = None,  # noqa: ASYNC109 - a durable workflow deadline
        request_id: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> RunHandle[Any]:
        """Start a workflow run; returns once ``WorkflowStarted`` is durable.

        ``request_id``: an idempotency key (needs ``workflow_id``).  A start whose
        key is already recorded in the workflow's history records nothing and
        returns the first start's handle, whatever ``id_reuse`` says, so a call
        that failed with :class:`BackendUnavailable` can be retried safely.

        ``timeout`` is the run's deadline (a durable timer from its start): when it
        passes, the run is stopped and ends ``TimedOut``, its activities cancelled.

        ``headers``: context the run carries in its history (``str`` to ``str``, e.g.
        a tenant, or a trace's ``traceparent``), with what the engine's header hooks
        (``aion_trio_start_headers``, asked in this task) add on top.

        Bad input (unknown workflow, unserialisable or oversized arguments,
        bad search attributes) raises before anything is recorded.  Type checkers
        check ``args`` against the workflow function's parameters (after ``ctx``)
        and give the handle its result type; a workflow named by string is untyped.
        """
        if request_id is not None:
            validate_caller_request_id(request_id)
        started = await self._local.start(
            workflow,
            args,
            workflow_id=workflow_id,
            id_reuse=id_reuse,
            search_attributes=search_attributes,
            task_queue=task_queue,
            timeout=timeout,
            request_id=request_id,
            headers=headers,
        )
        return RunHandle(
            self,
            started.workflow_id,
            started.run_id,
            created=started.created,
            definition=self._core.workflows.get(workflow if isinstance(workflow, str) else workflow.name),
        )

    async def _look(
        self, workflow_id: str, fresh: list[Event] | None
    ) -> tuple[trio.Event, Recorder | None, Sequence[Event]]:
        """What a waiter looks at now: a watch set when the workflow's recorder is loaded
        or dropped here, that recorder (``None``: not in memory here, e.g. evicted or
        closed and released), and its history (``fresh``, the store's copy, if given).
        Reads wake no evicted run."""
        core = self._core
        watch = core.recorders.watch(workflow_id)
        recorder = core.loaded_recorder(workflow_id)
        history: Sequence[Event]
        if fresh is not None:
            history = fresh
        elif recorder is not None:
            history = recorder.history
        elif self._cluster is not None and not core.drives(workflow_id):
            # Cluster mode, a workflow another node drives: a copy is read (and kept) here.
            recorder = await self._local.existing_recorder(workflow_id)
            history = recorder.history
        else:
            history = await core.recorders.history_of(workflow_id)
            recorder = core.loaded_recorder(workflow_id)
            if recorder is not None:  # loaded meanwhile: its history is as new or newer
                history = recorder.history
        return watch, recorder, history

    async def _await_history(
        self, workflow_id: str, recorder: Recorder | None, watch: trio.Event, *, any_append: bool
    ) -> list[Event] | None:
        """Wait until ``workflow_id``'s history may hold something new: any append
        (``any_append``), or only a lifecycle event (a start, a terminal, a reopen).

        ``None``: look again (:meth:`_look`).  In cluster mode, for a workflow driven
        elsewhere (or relinquished while waiting), the history freshly read from the
        store.  ``recorder``: the workflow's loaded recorder, which wakes its waiters
        when it is dropped too (``None``: not in memory here: an evicted run is waited
        for until a wake loads it again, ``watch``)."""
        cluster = self._cluster
        core = self._core
        if recorder is not None and (cluster is None or core.drives(workflow_id)):
            await (recorder.wait_changed() if any_append else recorder.wait_lifecycle())
            if cluster is None or core.loaded_recorder(workflow_id) is recorder:
                return None
        elif cluster is not None and not core.drives(workflow_id):
            await cluster.woken()
        else:
            await watch.wait()  # evicted here: its next wake loads it (or it is released)
            return None
        return await core.events.read_history(workflow_id)

    async def get_event(
        self,
        workflow_id: str,
        key: str,
        *,
        timeout: timedelta | float = 60.0,  # noqa: ASYNC109 - a bound on the wait, as DBOS's
    ) -> Any:
        """The value the workflow last published under ``key`` with ``ctx.set_event``, waiting up
        to ``timeout`` seconds for it to be published.

        Returns ``None`` if the wait times out, and at once (without waiting) if the
        workflow is closed and never published ``key`` (nothing can publish it any
        more; a reopen or a new run could, and a later call sees it).  Raises
        :class:`WorkflowNotFound` if no workflow ``workflow_id`` exists.  Read-only:
        nothing is recorded.  In cluster mode a workflow another node drives is
        re-read from the store when the cluster waker wakes.
        """
        if not isinstance(key, str) or not key:
            raise ValueError(f"event key must be a non-empty str, got {key!r}")
        seconds = duration_seconds(timeout, "timeout")
        fresh: list[Event] | None = None
        if self._cluster is not None and not self._core.drives(workflow_id):
            # Another node drives it: the store's history now, not a copy read earlier here.
            fresh = await self._core.events.read_history(workflow_id)
        with trio.move_on_after(seconds):
            while True:
                # Looked up afresh each time round: the run may be evicted (or loaded
                # again) while this waits, and a dropped recorder's history grows no more.
                watch, recorder, history = await self._look(workflow_id, fresh)
                fresh = None
                if not history:
                    raise WorkflowNotFound(workflow_id)
                published = published_event(history, key)
                if published is not None:
                    return self._core.codec.decode(published)
                if not is_active(history):
                    return None
                fresh = await self._await_history(workflow_id, recorder, watch, any_append=True)
        return None

    async def result(
        self, workflow_id: str, *, run_id: str | None = None, follow_continue_as_new: bool = True
    ) -> Any:
        """Wait for the run's terminal and return its result (following continue-as-new,
        and a reset to the run that replaced it).

        Raises :class:`WorkflowFailure` if the run failed, was cancelled or timed out
        (or, with ``follow_continue_as_new=False``, was reset: status ``"reset"``).
        Reads what this engine holds, or the store for a workflow not in memory here
        (closed and released, or evicted): waiting wakes no evicted run.
        """
        current = run_id
        checked = 0
        # Cluster mode: a workflow another node drives grows in the store, not in
        # this node's recorder; it is re-read after each wake-up of the cluster
        # waker (a notification, or every sweep_interval).
        fresh: list[Event] | None = None
        while True:
            watch, recorder, history = await self._look(workflow_id, fresh)
            fresh = None
            if not history:
                raise WorkflowNotFound(workflow_id)
            if current is None:
                current = latest_run_id(history)
                if current is None:
                    raise WorkflowNotFound(workflow_id)
            if not checked or has_lifecycle(history, checked):
                checked = len(history)
                position = follow_chain(history, current, follow_continue_as_new=follow_continue_as_new)
                if position.state is ChainState.NOT_STARTED:
                    raise WorkflowNotFound(workflow_id, current)
                if position.state is ChainState.SETTLED:
                    return self._core.codec.decode(settled_result(workflow_id, position))
                # Running, or its successor's start is owed: wait, following on from where it stands.
                current = position.run_id
            # Nothing that could end (or continue) the run was appended: keep waiting.
            checked = len(history)
            fresh = await self._await_history(workflow_id, recorder, watch, any_append=False)

    async def signal(
        self, workflow_id: str, name: str, payload: Any = None, *, request_id: str | None = None
    ) -> None:
        """Record a signal for the workflow's running run and wake it.

        Refused with a typed error, recording nothing, if the workflow does not
        exist (:class:`WorkflowNotFound`) or is not running (:class:`NotRunning`);
        an unserialisable or oversized payload is refused before anything is recorded.
        ``request_id``: an idempotency key; a signal whose key is already recorded
        is not recorded again (and not refused, even if the run ended since).
        """
        core = self._core
        if not isinstance(name, str) or not name:
            raise ValueError(f"signal name must be a non-empty str, got {name!r}")
        check_text(name, "signal name")
        if request_id is not None:
            validate_caller_request_id(request_id)
        encoded = core.codec.encode(payload, what=f"payload of signal {name!r}")
        if not core.epoch.admitting:
            raise epoch_closed(workflow_id, None, "record a signal")
        await self._here_or_owner(
            workflow_id,
            lambda: self._local.signal(workflow_id, name, encoded, request_id),
            lambda: SignalCommand(workflow_id=workflow_id, name=name, payload=encoded, request_id=request_id),
        )

    async def signal_with_start(
        self,
        workflow: WorkflowDefinition[Any] | str,
        *args: Any,
        workflow_id: str,
        signal: str,
        payload: Any = None,
        id_reuse: IdReusePolicy = IdReusePolicy.ALLOW_DUPLICATE,
        search_attributes: Mapping[str, Any] | None = None,
        task_queue: str | None = None,
        timeout: timedelta | float | None = None,  # noqa: ASYNC109 - a durable workflow deadline
        request_id: str | None = None,
    ) -> RunHandle[Any]:
        """Signal the workflow's running run, or start it with the signal: one atomic call.

        If a run of ``workflow_id`` is running, ``signal`` (with ``payload``) is
        recorded for it, as :meth:`signal` does.  Otherwise a new run of ``workflow``
        with ``args`` is started (``id_reuse`` decides whether a closed workflow may
        start again; ``use_existing`` is refused) and its ``WorkflowStarted`` and the
        ``SignalReceived`` are recorded in one append, so the run's code finds the
        signal from its first step and no crash can leave one without the other.
        The decision is made under the workflow's recorder lock; in cluster mode a
        workflow another node owns gets the command through the inbox.

        Returns the handle of the run that took the signal (``created``: this call,
        or the first call with its ``request_id``, started it).  ``request_id``: an
        idempotency key; a retry finds what the first call recorded and records
        nothing.  Bad input raises before anything is recorded.
        """
        core = self._core
        if not isinstance(signal, str) or not signal:
            raise ValueError(f"signal name must be a non-empty str, got {signal!r}")
        check_text(signal, "signal name")
        validate_workflow_id(workflow_id)
        if request_id is not None:
            validate_caller_request_id(request_id)
        encoded = core.codec.encode(payload, what=f"payload of signal {signal!r}")
        definition = core.workflow_definition(workflow)
        definition.check_arguments(args)
        if not isinstance(id_reuse, IdReusePolicy):
            raise TypeError(f"id_reuse must be an IdReusePolicy, got {id_reuse!r}")
        if not core.epoch.admitting:
            raise epoch_closed(workflow_id, None, f"signal-with-start {signal!r}")
        found = await self._here_or_owner(
            workflow_id,
            lambda: self._local.signal_with_start(
                definition,
                args,
                signal,
                encoded,
                workflow_id=workflow_id,
                id_reuse=id_reuse,
                search_attributes=search_attributes,
                task_queue=task_queue,
                timeout=timeout,
                request_id=request_id,
            ),
            lambda: SignalWithStartCommand(
                workflow_id=workflow_id,
                workflow_type=definition.name,
                args=core.codec.encode(list(args), what=f"input of workflow {definition.name!r}"),
                signal_name=signal,
                payload=encoded,
                id_reuse=id_reuse.value,
                task_queue=task_queue,
                search_attributes={} if search_attributes is None else search_attributes,
                timeout=None
                if timeout is None
                else timedelta(seconds=duration_seconds(timeout, "timeout", allow_zero=False)),
                request_id=request_id,
            ),
        )
        if isinstance(found, CommandOutcome):
            assert found.run_id is not None
            # The owner's outcome says whether it started the run (signal_with_start_outcome).
            return RunHandle(
                self,
                workflow_id,
                found.run_id,
                created=found.message.startswith("started "),
                definition=definition,
            )
        return RunHandle(self, workflow_id, found.run_id, created=found.created, definition=definition)

    # -- cluster mode: commands for workflows another node owns ------------------

    async def _here_or_owner(
        self, workflow_id: str, here: Callable[[], Any], command: Callable[[], Command]
    ) -> Any:
        """Apply locally (``await here()``), or, in cluster mode for a workflow another
        node owns, send ``command()`` through the inbox and return its outcome
        (a refusal is raised as the owner raised it).  A local attempt fenced by the
        store (the workflow was claimed meanwhile) is sent to the owner instead."""
        cluster = self._cluster
        if cluster is None:
            return await here()
        if await cluster.cluster.command_target(workflow_id) is None:
            try:
                return await here()
            except WorkflowFenced:
                pass  # claimed by another node meanwhile (relinquished here): ask the owner
        outcome: CommandOutcome = await cluster.send(command())
        if not outcome.ok:
            raise outcome_error(outcome, workflow_id)
        return outcome

    async def cancel(self, workflow_id: str, reason: str = "", *, request_id: str | None = None) -> None:
        """Ask the running run to cancel: records ``WorkflowCancelRequested`` and wakes it.

        The workflow sees :class:`aion_trio.WorkflowCancelled` at its next await
        (outside ``ctx.cleanup()``); it may compensate, and ends ``Cancelled`` when
        the exception leaves it.  A second request while one is pending records
        nothing.  Unknown or terminal workflows are refused with a typed error.
        ``request_id``: an idempotency key; a cancel whose key is recorded records
        nothing and is not refused.
        """
        if not isinstance(reason, str):
            raise TypeError(f"reason must be a str, got {reason!r}")
        check_text(reason, "reason")
        if request_id is not None:
            validate_caller_request_id(request_id)
        if not self._core.epoch.admitting:
            raise epoch_closed(workflow_id, None, "cancel a workflow")
        await self._here_or_owner(
            workflow_id,
            lambda: self._local.cancel(workflow_id, reason, request_id),
            lambda: CancelCommand(workflow_id=workflow_id, reason=reason, request_id=request_id),
        )

    async def terminate(self, workflow_id: str, reason: str = "", *, request_id: str | None = None) -> None:
        """End the running run at once, without running its code: records
        ``WorkflowCancelled(terminated=True)`` with its in-flight activities cancelled
        and its timers retired in the same batch, then stops the run's task.
        ``request_id``: an idempotency key; a terminate whose key is recorded records
        nothing and is not refused."""
        if not isinstance(reason, str):
            raise TypeError(f"reason must be a str, got {reason!r}")
        check_text(reason, "reason")
        if request_id is not None:
            validate_caller_request_id(request_id)
        if not self._core.epoch.admitting:
            raise epoch_closed(workflow_id, None, "terminate a workflow")
        await self._here_or_owner(
            workflow_id,
            lambda: self._local.terminate(workflow_id, reason, request_id),
            lambda: TerminateCommand(workflow_id=workflow_id, reason=reason, request_id=request_id),
        )

    async def reopen(self, workflow_id: str, *, request_id: str | None = None) -> RunHandle[Any]:
        """Reopen a Failed or Cancelled run: ``WorkflowReopened`` supersedes its terminal and
        a new lease replays it (fixed code can now pass where the old failed); activities
        and timers the teardown cancelled are re-dispatched and re-armed.

        Refused with :class:`CannotReopen` for other statuses, and for a cancelled run whose
        code reacted to the cancellation (it recorded commands after the request: replaying
        without the cancellation would take another path).

        ``request_id``: an idempotency key; a reopen whose key is recorded records
        nothing and returns the first reopen's handle.
        """
        if request_id is not None:
            validate_caller_request_id(request_id)
        if not self._core.epoch.admitting:
            raise epoch_closed(workflow_id, None, "reopen a workflow")
        found = await self._here_or_owner(
            workflow_id,
            lambda: self._local.reopen(workflow_id, request_id),
            lambda: ReopenCommand(workflow_id=workflow_id, request_id=request_id),
        )
        if isinstance(found, CommandOutcome):
            assert found.run_id is not None
            return RunHandle(self, workflow_id, found.run_id)
        assert isinstance(found, Started)
        return RunHandle(self, workflow_id, found.run_id)

    async def reset(
        self,
        workflow_id: str,
        *,
        to_seq: int | None = None,
        reason: str = "",
        request_id: str | None = None,
    ) -> RunHandle[Any]:
        """Start a new run of the workflow that replays its latest run's history up to the
        event ``to_seq`` and goes on from there with the current code: what came after
        runs again.  The old run ends ``WorkflowReset`` (naming the new run; if it was
        running, its in-flight activities are cancelled as ``terminate`` does), and the new
        run's ``WorkflowStarted`` names it back (``reset_from_run_id``, ``reset_to_seq``).
        Signals the old run received after the point are delivered to the new run too.
        A waiter on the old run (``result()``) follows the reset to the new run.

        Works on a running or closed run.  ``to_seq`` must be a reset point: the run's
        start, or a step boundary (an activity settled, a timer fired, a signal arrived)
        with nothing in flight, before any cancel request or child start; anything else is
        refused with :class:`CannotReset` naming the valid seqs, and nothing is recorded.
        ``to_seq=None`` resets to the run's last step that did not end in a failure: the
        one-command recovery of a run failed by a bug, once the fix is deployed.

        ``request_id``: an idempotency key; a reset whose key is recorded records nothing
        and returns the first reset's handle.
        """
        if request_id is not None:
            validate_caller_request_id(request_id)
        if not self._core.epoch.admitting:
            raise epoch_closed(workflow_id, None, "reset a workflow")
        found = await self._here_or_owner(
            workflow_id,
            lambda: self._local.reset(workflow_id, to_seq, reason, request_id),
            lambda: ResetCommand(
                workflow_id=workflow_id, to_seq=to_seq, reason=reason, request_id=request_id
            ),
        )
        if isinstance(found, CommandOutcome):
            assert found.run_id is not None
            return RunHandle(self, workflow_id, found.run_id, created=True)
        assert isinstance(found, Started)
        return RunHandle(self, workflow_id, found.run_id, created=found.created)

    async def fork(
        self,
        workflow_id: str,
        *,
        new_workflow_id: str,
        to_seq: int | None = None,
        request_id: str | None = None,
    ) -> RunHandle[Any]:
        """Start a new workflow ``new_workflow_id`` whose first run replays the history of
        ``workflow_id``'s latest run up to the event ``to_seq`` and goes on from there with
        the current code, as :meth:`reset` does, but under a new workflow id: the source
        is read from the store and left untouched (running or closed).

        ``to_seq`` is a reset point as for :meth:`reset` (``None``: the last step that did
        not fail); anything else raises :class:`CannotReset`.  ``new_workflow_id`` must not
        exist yet (:class:`WorkflowAlreadyStarted`).  ``request_id``: an idempotency key
        on the new workflow; a fork whose key is recorded returns the first fork's handle.
        The new workflow is started here, as :meth:`start` starts one.
        """
        if request_id is not None:
            validate_caller_request_id(request_id)
        if not self._core.epoch.admitting:
            raise epoch_closed(new_workflow_id, None, "fork a workflow")
        found = await self._local.fork(workflow_id, to_seq, new_workflow_id, request_id)
        return RunHandle(self, found.workflow_id, found.run_id, created=found.created)

    async def query(self, workflow_id: str, name: str, *args: Any) -> Any:
        """Ask the workflow's latest run a question: its handler ``name`` answers from its state.

        The handler (registered by the workflow code with
        ``ctx.set_query_handler``) runs while the run is parked between
        steps; a run that is replaying history or in the middle of a step is
        waited for.  A closed run (completed, failed, cancelled, timed out) is
        answered by replaying its history with this engine's code in a
        throwaway execution, then asking the handler: every command resolves
        from history, and the replay stops where history ends (nothing is
        executed).  Nothing is ever recorded.  ``args`` and the result pass
        through the payload codec, so they must be JSON-serialisable
        (:class:`PayloadNotSerializable` / :class:`PayloadTooLarge` otherwise).

        The query goes to the workflow's latest run (a run that continued as
        new is answered by its successor).

        Raises :class:`WorkflowNotFound` (no such workflow), :class:`UnknownQuery` (no handler of that
        name), :class:`QueryFailed` (the handler raised; original in
        ``__cause__``), :class:`QueryReadOnly` (the handler issued a command),
        :class:`QueryUnavailable` (Running, but stuck or not resident in this
        engine: nothing here can answer, so it fails at once rather than
        waiting; or closed, and its type is not registered here or replaying
        it with this code diverged), :class:`EngineEpochClosed` (the engine is shutting down).
        The run is unaffected by every failure.  Cancellation simply abandons
        the wait.
        """
        core = self._core
        if not isinstance(name, str) or not name:
            raise ValueError(f"query name must be a non-empty str, got {name!r}")
        arguments = core.codec.encode(list(args), what=f"arguments of query {name!r}")
        found = await self._here_or_owner(
            workflow_id,
            lambda: self._local.query(workflow_id, name, arguments),
            lambda: QueryCommand(workflow_id=workflow_id, name=name, args=arguments),
        )
        return query_answer(found) if isinstance(found, CommandOutcome) else found

    async def update(self, workflow_id: str, name: str, *args: Any, update_id: str | None = None) -> Any:
        """Send update ``name`` to the workflow's running run and return its handler's result.

        The handler (registered by the workflow code with ``ctx.set_update_handler``)
        is a request/response into the run: its validator, if any, runs first
        against the live state and a rejection raises :class:`UpdateRejected`
        with nothing recorded.  An accepted update is recorded
        (``UpdateAccepted``) before its handler runs, at the run's next await in
        the order recorded; the handler's result or failure is recorded
        (``UpdateCompleted``) and returned, or raised as :class:`UpdateFailed`.
        ``update_id`` (default: a fresh one) makes the call idempotent: a call
        with an id already accepted records nothing and waits for (or returns)
        that update's recorded outcome, so the handler never runs twice, also
        when the first caller or the engine died meanwhile.

        Raises :class:`WorkflowNotFound`, :class:`NotRunning` (the workflow is
        closed: nothing recorded), :class:`UpdateUnavailable` (its code is not
        executing here, or the run closed after accepting the update and
        before its handler finished), :class:`EngineEpochClosed`.  In cluster mode
        the update goes to the owning node through the inbox like a signal.
        Cancellation abandons the wait; the update, once accepted, still runs.
        """
        core = self._core
        if not isinstance(name, str) or not name:
            raise ValueError(f"update name must be a non-empty str, got {name!r}")
        check_text(name, "update name")
        if update_id is None:
            update_id = f"update-{uuid.uuid4().hex}"
        else:
            validate_caller_request_id(update_id)
        arguments = core.codec.encode(list(args), what=f"arguments of update {name!r}")
        if not core.epoch.admitting:
            raise epoch_closed(workflow_id, None, f"record update {name!r}")
        await self._here_or_owner(
            workflow_id,
            lambda: self._local.accept_update(workflow_id, name, arguments, update_id),
            lambda: UpdateCommand(workflow_id=workflow_id, name=name, update_id=update_id, args=arguments),
        )
        fresh: list[Event] | None = None
        while True:
            watch, recorder, history = await self._look(workflow_id, fresh)
            fresh = None
            if not history:
                raise WorkflowNotFound(workflow_id)
            outcome = update_outcome(history, update_id)
            if outcome is not None:
                body = outcome.body
                assert isinstance(body, UpdateCompleted)
                if body.error is not None:
                    raise UpdateFailed(workflow_id, name, update_id, body.error.type, body.error.message)
                assert body.result is not None
                return core.codec.decode(body.result)
            accepted = accepted_update(history, update_id)
            status = run_status(history, accepted.run_id) if accepted is not None else None
            if accepted is not None and status is not WorkflowStatus.RUNNING:
                what = status.value if status is not None else "unknown"
                raise UpdateUnavailable(
                    workflow_id,
                    name,
                    f"the run ended ({what}) after update {update_id!r} was accepted and before its "
                    "handler finished (the workflow returned without awaiting again, or while its "
                    "async handler still ran: wait with ctx.wait_condition(ctx.all_handlers_finished))",
                )
            fresh = await self._await_history(workflow_id, recorder, watch, any_append=True)

    # -- async activity completion (a task token from activity_info().task_token) ----

    async def complete_activity(self, token: str, result: Any = None) -> None:
        """Complete the activity attempt ``token`` names with ``result``, durably.

        For an activity that called :func:`aion_trio.complete_async`: its attempt stays
        open until this (or :meth:`fail_activity`, or one of its timeouts) settles it.
        Returns once ``ActivityCompleted`` is recorded and the workflow woken.  Raises
        :class:`InvalidActivityToken` (not a token), :class:`WorkflowNotFound`,
        :class:`ActivityAttemptClosed` (the attempt is not open: it timed out or failed,
        a later attempt runs, the activity or run settled; nothing recorded; a
        completion of an attempt whose recorded outcome is a completion returns
        quietly instead, so a retried call is safe), :class:`EngineEpochClosed`; an
        unserialisable result is refused before anything is recorded.  In cluster mode
        the completion goes to the owning node through the inbox.
        """
        named = TaskToken.parse(token)
        encoded = self._core.codec.encode(result, what="result of an activity completed by token")
        await self._by_token(
            named,
            ActivityCommand(workflow_id=named.workflow_id, token=token, action="complete", payload=encoded),
        )

    async def fail_activity(
        self,
        token: str,
        error: BaseException | str,
        *,
        non_retryable: bool = False,
        error_type: str | None = None,
    ) -> None:
        """Fail the activity attempt ``token`` names, durably (see :meth:`complete_activity`).

        ``error`` (an exception, or a message) becomes the attempt's failure: its type
        name (``error_type`` overrides it; a message alone: ``ActivityFailed``) and message.  The activity's retry policy then decides as for any failed
        attempt: another attempt (which runs the activity's code again) or the final
        failure.  ``non_retryable=True`` (or an :class:`aion_trio.TerminalError`) makes
        it final at once.  Returns once the failure is recorded; a failure of an attempt
        whose recorded outcome is a failure returns quietly.
        """
        named = TaskToken.parse(token)
        if isinstance(error, str):
            default_type, message = "ActivityFailed", error
        elif isinstance(error, BaseException):
            default_type, message = type(error).__qualname__, str(error)
            non_retryable = non_retryable or isinstance(error, TerminalError)
        else:
            raise TypeError(f"error must be an exception or a str, got {error!r}")
        if error_type is not None:
            if not isinstance(error_type, str) or not error_type:
                raise ValueError(f"error_type must be a non-empty str, got {error_type!r}")
            check_text(error_type, "error type")
        check_text(message, "error message")
        await self._by_token(
            named,
            ActivityCommand(
                workflow_id=named.workflow_id,
                token=token,
                action="fail",
                error_type=error_type or default_type,
                message=message,
                non_retryable=non_retryable,
            ),
        )

    async def heartbeat_activity(self, token: str, details: Any = None) -> None:
        """Heartbeat the open activity attempt ``token`` names (one completing asynchronously).

        Resets its ``heartbeat_timeout``; ``details`` (if not ``None``) are kept for the
        next attempt (``activity_info().heartbeat_details``) and recorded, throttled, as
        an in-process heartbeat's are.  Raises as :meth:`complete_activity` does (an
        attempt that is not open: :class:`ActivityAttemptClosed`).
        """
        named = TaskToken.parse(token)
        encoded = self._core.codec.encode(details, what="heartbeat details")
        await self._by_token(
            named,
            ActivityCommand(workflow_id=named.workflow_id, token=token, action="heartbeat", payload=encoded),
        )

    async def _by_token(self, token: TaskToken, command: ActivityCommand) -> None:
        if not self._core.epoch.admitting:
            raise epoch_closed(token.workflow_id, token.run_id, f"{command.action} an activity attempt")
        await self._here_or_owner(
            token.workflow_id, lambda: self._local.activity_by_token(command), lambda: command
        )

    async def history(self, workflow_id: str) -> list[Event]:
        """The workflow's full event history, read from the store."""
        events = await self._core.events.read_history(workflow_id)
        if not events:
            raise WorkflowNotFound(workflow_id)
        return events

    async def describe(self, workflow_id: str) -> WorkflowDescription:
        """The workflow's current state projected from its history; ``WorkflowNotFound`` if it has none."""
        core = self._core
        if self._cluster is not None and not core.drives(workflow_id):
            # Another node drives it (cluster mode): what the store holds now.
            history: Sequence[Event] = await self.history(workflow_id)
        else:
            history = await core.recorders.history_of(workflow_id)
            if not history:
                raise WorkflowNotFound(workflow_id)
        description = describe_history(
            workflow_id, history, codec=core.codec, stuck_reason=core.stuck.get(workflow_id)
        )
        if description.status is WorkflowStatus.RUNNING:
            waiting = core.activity_dispatch.pools.waiting_for
            if waiting:
                pending = tuple(
                    attrs.evolve(p, waiting_for=waiting.get((workflow_id, description.run_id, p.activity_id)))
                    for p in description.pending_activities
                )
                description = attrs.evolve(description, pending_activities=pending)
            residency = core.residency.residency_of(workflow_id, description.run_id)
            if residency is not None:
                description = attrs.evolve(description, residency=residency)
        return description

    async def list(self, filter: VisibilityFilter | None = None, **criteria: Any) -> list[VisibilityRow]:
        """Visibility rows matching ``filter`` (or ``VisibilityFilter(**criteria)``).

        Rows this engine owes (a start's row is written in the background) are
        written first, so a run this engine started is always listed.
        """
        query = _filter(filter, criteria)
        await self._core.visibility_settled()
        return await self._core.visibility.list(query)

    async def count(self, filter: VisibilityFilter | None = None, **criteria: Any) -> int:
        """How many visibility rows match (after the rows this engine owes are written)."""
        query = _filter(filter, criteria)
        await self._core.visibility_settled()
        return await self._core.visibility.count(query)


def serve_inbox(engine: Engine, drainer: InboxDrainer) -> None:
    """Route ``engine.drain_inbox`` to ``drainer`` (``open_engine`` builds it after recovery)."""
    engine._inbox = drainer


def _filter(filter: VisibilityFilter | None, criteria: Mapping[str, Any]) -> VisibilityFilter:
    if filter is not None and criteria:
        raise TypeError("pass either a VisibilityFilter or keyword criteria, not both")
    return filter if filter is not None else VisibilityFilter(**criteria)
