"""The client API: ``Engine`` and ``RunHandle``."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any, final

import trio

from .. import _children as children
from .._activities import InProcessDispatcher
from .._chain import ChainState, follow_chain, settled_result
from .._cluster import ClusterServices, outcome_error, query_answer
from .._commands import (
    CancelCommand,
    Command,
    CommandOutcome,
    IdReusePolicy,
    QueryCommand,
    ReopenCommand,
    SignalCommand,
    TerminateCommand,
)
from .._completion import (
    forget_retired,
    teardown_bodies,
)
from .._definitions import WorkflowDefinition
from .._epoch import EngineEpoch
from .._errors import (
    CannotReopen,
    NotRunning,
    QueryUnavailable,
    SequenceConflict,
    WorkflowAlreadyStarted,
    WorkflowFenced,
    WorkflowNotFound,
    epoch_closed,
)
from .._events import (
    ActivityCancelled,
    ActivityScheduled,
    Event,
    EventBody,
    MarkerRecorded,
    SignalReceived,
    TimerStarted,
    WorkflowCancelled as CancelledEvent,
    WorkflowCancelRequested,
    WorkflowFailed,
    WorkflowReopened,
    WorkflowStarted,
    WorkflowStatus,
    validate_search_attributes,
)
from .._ids import (
    check_text,
    new_run_id,
    new_workflow_id,
    validate_caller_request_id,
    validate_request_id,
    validate_task_queue,
    validate_workflow_id,
)
from .._inbox import InboxDrainer, Ownership
from .._ownership import OwnerClaim
from .._payload import Payload
from .._projections import (
    RecordedRequest,
    RunState,
    current_lease_terminal,
    failures_ending_the_run,
    latest_run_id,
    outstanding_timers,
    recorded_request,
    run_segment,
    workflow_status,
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
from .log import logger


@final
class RunHandle:
    """A started run: ``await handle.result()``.

    ``created`` is true when the call that returned the handle recorded the run's
    start (a retry with the same ``request_id`` returns the first call's handle,
    so it is true there too); false when it attached to a run that existed
    (``IdReusePolicy.USE_EXISTING``) or reopened one.
    """

    def __init__(self, engine: Engine, workflow_id: str, run_id: str, *, created: bool = False) -> None:
        self._engine = engine
        self.workflow_id = workflow_id
        self.run_id = run_id
        self.created = created

    async def result(self, *, follow_continue_as_new: bool = True) -> Any:
        return await self._engine.result(
            self.workflow_id, run_id=self.run_id, follow_continue_as_new=follow_continue_as_new
        )

    async def describe(self) -> WorkflowDescription:
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
        ownership: Ownership | None = None,
        threads: InProcessDispatcher | None = None,
    ) -> None:
        self._core = core
        self._ownership = ownership
        self._threads = threads
        self._inbox: InboxDrainer | None = None
        #: Cluster mode's services (``None``: a single-owner store): every client built
        #: on this core routes commands for workflows other nodes own the same way.
        self._cluster: ClusterServices | None = core.cluster_services

    @property
    def epoch(self) -> EngineEpoch:
        return self._core.epoch

    @property
    def owner_claim(self) -> OwnerClaim | None:
        """This engine's claim on its store (``None``: the store has no ownership capability)."""
        return self._ownership.claim if self._ownership is not None else None

    async def drain_inbox(self) -> int:
        """Apply the store inbox's pending commands now, in order; returns how many were acked.

        The engine also drains at open and every ``EngineConfig.inbox_poll_interval``
        seconds.  Each command goes through the matching client method
        (``start``, ``signal``, ``cancel``, ``terminate``, ``reopen``) and is acked
        with its outcome: ok, or the typed error's one-line message.  A store
        without an inbox: 0.
        """
        if self._inbox is None:
            await trio.lowlevel.checkpoint()
            return 0
        return await self._inbox.drain()

    @property
    def store(self) -> Store:
        return self._core.store

    def statistics(self) -> EngineStatistics:
        leases = self._core.registry.leases()
        return EngineStatistics(
            registered_leases=len(leases),
            resident_runs=sum(1 for lease in leases if lease.task is not None),
            stuck_runs=sum(1 for lease in leases if lease.residency is Residency.STUCK),
            loaded_recorders=self._core.recorders.count,
            epoch=self._core.epoch.statistics(),
            abandoned_activity_threads=0 if self._threads is None else self._threads.abandoned_threads(),
        )

    async def start(
        self,
        workflow: WorkflowDefinition[Any] | str,
        *args: Any,
        workflow_id: str | None = None,
        id_reuse: IdReusePolicy = IdReusePolicy.ALLOW_DUPLICATE,
        search_attributes: Mapping[str, Any] | None = None,
        task_queue: str | None = None,
        timeout: timedelta | float | None = None,  # noqa: ASYNC109 - a durable workflow deadline
        request_id: str | None = None,
    ) -> RunHandle:
        """Start a workflow run; returns once ``WorkflowStarted`` is durable.

        ``request_id``: an idempotency key (needs ``workflow_id``).  A start whose
        key is already recorded in the workflow's history records nothing and
        returns the first start's handle, whatever ``id_reuse`` says, so a call
        that failed with :class:`BackendUnavailable` can be retried safely.

        ``timeout`` is the run's deadline (a durable timer from its start): when it
        passes, the run is stopped and ends ``TimedOut``, its activities cancelled.

        Bad input (unknown workflow, unserialisable or oversized arguments,
        bad search attributes) raises before anything is recorded.
        """
        if request_id is not None:
            validate_caller_request_id(request_id)
        return await self._start(
            workflow,
            *args,
            workflow_id=workflow_id,
            id_reuse=id_reuse,
            search_attributes=search_attributes,
            task_queue=task_queue,
            timeout=timeout,
            request_id=request_id,
        )

    async def _start(
        self,
        workflow: WorkflowDefinition[Any] | str,
        *args: Any,
        workflow_id: str | None = None,
        id_reuse: IdReusePolicy = IdReusePolicy.ALLOW_DUPLICATE,
        search_attributes: Mapping[str, Any] | None = None,
        task_queue: str | None = None,
        timeout: timedelta | float | None = None,  # noqa: ASYNC109 - a durable workflow deadline
        request_id: str | None = None,
    ) -> RunHandle:
        """``start`` for a key already vetted: the caller's, or the inbox's ``inbox:N``."""
        core = self._core
        definition = core.workflow_definition(workflow)
        definition.check_arguments(args)
        wid = validate_workflow_id(workflow_id) if workflow_id is not None else new_workflow_id()
        payload = core.codec.encode(list(args), what=f"input of workflow {definition.name!r}")
        attributes = validate_search_attributes({} if search_attributes is None else search_attributes)
        queue = validate_task_queue(core.config.default_task_queue if task_queue is None else task_queue)
        if not isinstance(id_reuse, IdReusePolicy):
            raise TypeError(f"id_reuse must be an IdReusePolicy, got {id_reuse!r}")
        deadline_after = _deadline(timeout)
        if request_id is not None:
            validate_request_id(request_id)
            if workflow_id is None:
                raise ValueError(
                    "a start with a request_id needs an explicit workflow_id: a retry must name the same workflow"
                )
        if not core.epoch.admitting:
            raise epoch_closed(wid, None, "start a workflow")

        def started(run_id: str) -> WorkflowStarted:
            return WorkflowStarted(
                workflow_type=definition.name,
                input=payload,
                run_id=run_id,
                task_queue=queue,
                search_attributes=attributes,
                timeout=deadline_after,
                request_id=request_id,
            )

        fresh = core.recorders.claim_unloaded(wid)
        if fresh is not None:
            # Most starts name a new id: append at expected seq 0 without reading
            # first.  A conflict means the id has history: load it and decide below.
            adopted = False

            def adopt() -> None:
                nonlocal adopted
                core.recorders.release_unloaded(fresh, adopt=True)
                adopted = True

            try:
                async with fresh.lock:
                    run_id = new_run_id()
                    try:
                        await core.runner.start_run_locked(
                            fresh,
                            started(run_id),
                            now=core.clock.now(),
                            action="start a workflow",
                            resume_if_unknown=True,
                            landed=adopt,
                        )
                    except SequenceConflict:
                        pass
            finally:
                if not adopted:
                    core.recorders.release_unloaded(fresh, adopt=False)
            if adopted:
                await core.refresh_visibility_soon(wid)
                return RunHandle(self, wid, run_id, created=True)
        recorder = await core.recorder_for(wid)
        if request_id is not None:
            async with recorder.lock:
                found = _recorded(await recorder.current_history(), wid, request_id, WorkflowStarted, "start")
            if found is not None:
                await core.resume_idle(wid)
                return RunHandle(self, wid, found.run_id, created=True)
        async with recorder.lock:
            history = await recorder.current_history()
            found = _recorded(history, wid, request_id, WorkflowStarted, "start")
            if found is not None:  # a concurrent call with the same key started it meanwhile
                return RunHandle(self, wid, found.run_id, created=True)
            existing_run = latest_run_id(history)
            if existing_run is not None:
                status = workflow_status(history)
                assert status is not None
                reuse = _reuse_allowed(id_reuse, status)
                if reuse is None:
                    return RunHandle(self, wid, existing_run)
                if not reuse:
                    raise WorkflowAlreadyStarted(wid, existing_run, status.value, id_reuse.value)
            run_id = new_run_id()
            await core.runner.start_run_locked(
                recorder,
                started(run_id),
                now=core.clock.now(),
                action="start a workflow",
                resume_if_unknown=True,
            )
        await core.refresh_visibility_soon(wid)
        return RunHandle(self, wid, run_id, created=True)

    async def _await_lifecycle(self, workflow_id: str, recorder: Recorder) -> list[Event] | None:
        """Wait until ``workflow_id``'s history may hold a new lifecycle event.

        ``None``: look at ``recorder`` (this engine drives the workflow).  In
        cluster mode, for a workflow driven elsewhere (or relinquished while
        waiting), the history freshly read from the store."""
        cluster = self._cluster
        core = self._core
        if cluster is None or (core.loaded_recorder(workflow_id) is recorder and core.drives(workflow_id)):
            await recorder.wait_lifecycle()
            if cluster is None or core.loaded_recorder(workflow_id) is recorder:
                return None
        else:
            await cluster.woken()
        return await core.events.read_history(workflow_id)

    async def _existing_recorder(self, workflow_id: str) -> Recorder:
        recorder = await self._core.recorder_for(workflow_id)
        if not recorder.history:
            raise WorkflowNotFound(workflow_id)
        return recorder

    async def result(
        self, workflow_id: str, *, run_id: str | None = None, follow_continue_as_new: bool = True
    ) -> Any:
        """Wait for the run's terminal and return its result (following continue-as-new).

        Raises :class:`WorkflowFailure` if the run failed, was cancelled or timed out.
        """
        recorder = await self._existing_recorder(workflow_id)
        current = run_id or latest_run_id(recorder.history)
        assert current is not None
        checked = 0
        # Cluster mode: a workflow another node drives grows in the store, not in
        # this node's recorder; it is re-read after each wake-up of the cluster
        # waker (a notification, or every sweep_interval).
        fresh: list[Event] | None = None
        while True:
            history = recorder.history if fresh is None else fresh
            if checked and not any(_ends_or_starts(e) for e in history[checked:]):
                # Nothing that could end (or continue) the run was appended: keep waiting.
                checked = len(history)
                fresh = await self._await_lifecycle(workflow_id, recorder)
                continue
            checked = len(history)
            position = follow_chain(history, current, follow_continue_as_new=follow_continue_as_new)
            if position.state is ChainState.NOT_STARTED:
                raise WorkflowNotFound(workflow_id, current)
            if position.state is ChainState.SETTLED:
                return self._core.codec.decode(settled_result(workflow_id, position))
            # Running, or its successor's start is owed: wait, following on from where it stands.
            current = position.run_id
            fresh = await self._await_lifecycle(workflow_id, recorder)

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
            lambda: self._signal_here(workflow_id, name, encoded, request_id),
            lambda: SignalCommand(workflow_id=workflow_id, name=name, payload=encoded, request_id=request_id),
        )

    async def _signal_here(
        self, workflow_id: str, name: str, encoded: Payload, request_id: str | None = None
    ) -> None:
        """Record the signal through this engine's recorder, unless ``request_id`` is recorded."""
        if not self._core.epoch.admitting:
            raise epoch_closed(workflow_id, None, "record a signal")
        recorder = await self._existing_recorder(workflow_id)
        async with recorder.lock:
            history = await recorder.current_history()
            if _recorded(history, workflow_id, request_id, SignalReceived, f"signal {name!r}") is not None:
                return
            status = workflow_status(history)
            run_id = latest_run_id(history)
            if status is not WorkflowStatus.RUNNING or run_id is None:
                raise NotRunning(workflow_id, status.value if status else "unknown", f"signal {name!r} to")
            await recorder.append(
                [SignalReceived(name=name, payload=encoded, request_id=request_id)],
                action=f"record signal {name!r}",
                run_id=run_id,
            )

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

    async def _running_run(self, recorder: Recorder, operation: str) -> tuple[str, list[Event]]:
        """Under the lock: the running run's id and segment, or :class:`NotRunning`."""
        history = await recorder.current_history()
        status = workflow_status(history)
        run_id = latest_run_id(history)
        if status is not WorkflowStatus.RUNNING or run_id is None:
            raise NotRunning(recorder.workflow_id, status.value if status else "unknown", operation)
        return run_id, run_segment(history, run_id)

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
            lambda: self._cancel_here(workflow_id, reason, request_id),
            lambda: CancelCommand(workflow_id=workflow_id, reason=reason, request_id=request_id),
        )

    async def _cancel_here(self, workflow_id: str, reason: str, request_id: str | None = None) -> None:
        if not self._core.epoch.admitting:
            raise epoch_closed(workflow_id, None, "cancel a workflow")
        recorder = await self._existing_recorder(workflow_id)
        async with recorder.lock:
            history = await recorder.current_history()
            if _recorded(history, workflow_id, request_id, WorkflowCancelRequested, "cancel") is not None:
                return
            run_id, segment = await self._running_run(recorder, "cancel")
            state = RunState(run_id, segment)
            state.sync()
            if state.cancel_request is not None:
                logger.info(
                    "cancel already requested; nothing recorded",
                    extra={"workflow_id": workflow_id, "run_id": run_id},
                )
                return
            await recorder.append(
                [WorkflowCancelRequested(reason=reason, request_id=request_id)],
                action="request cancellation",
                run_id=run_id,
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
            lambda: self._terminate_here(workflow_id, reason, request_id),
            lambda: TerminateCommand(workflow_id=workflow_id, reason=reason, request_id=request_id),
        )

    async def _terminate_here(self, workflow_id: str, reason: str, request_id: str | None = None) -> None:
        core = self._core
        if not core.epoch.admitting:
            raise epoch_closed(workflow_id, None, "terminate a workflow")
        recorder = await self._existing_recorder(workflow_id)
        async with recorder.lock:
            history = await recorder.current_history()
            found = _recorded(history, workflow_id, request_id, CancelledEvent, "terminate")
            if found is not None:
                # Recorded by a first attempt whose acknowledgement was lost: finish what it
                # left undone, unless the run was reopened since.
                run_id = found.run_id
                if current_lease_terminal(run_segment(history, run_id)) != found.event:
                    return
                core.stop_run_locally(workflow_id, run_id, found.event)
            else:
                run_id, segment = await self._running_run(recorder, "terminate")
                bodies: list[Any] = [
                    CancelledEvent(reason=reason, terminated=True, request_id=request_id),
                    *teardown_bodies(segment, run_id, retire_timers=True),
                ]
                events = await recorder.append(bodies, action="terminate the workflow", run_id=run_id)
                core.stop_run_locally(workflow_id, run_id, events[0])
                await forget_retired(core, workflow_id, bodies)
        logger.warning(
            "workflow run terminated: %s",
            reason or "(no reason given)",
            extra={"workflow_id": workflow_id, "run_id": run_id},
        )
        with trio.CancelScope(shield=True), trio.move_on_after(core.config.bookkeeping_timeout):
            await core.upsert_visibility(workflow_id)
        await core.run_closed(workflow_id, run_id)

    async def reopen(self, workflow_id: str, *, request_id: str | None = None) -> RunHandle:
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
            lambda: self._reopen_here(workflow_id, request_id),
            lambda: ReopenCommand(workflow_id=workflow_id, request_id=request_id),
        )
        if isinstance(found, CommandOutcome):
            assert found.run_id is not None
            return RunHandle(self, workflow_id, found.run_id)
        assert isinstance(found, RunHandle)
        return found

    async def _reopen_here(self, workflow_id: str, request_id: str | None = None) -> RunHandle:
        core = self._core
        if not core.epoch.admitting:
            raise epoch_closed(workflow_id, None, "reopen a workflow")
        recorder = await self._existing_recorder(workflow_id)
        async with recorder.lock:
            history = await recorder.current_history()
            found = _recorded(history, workflow_id, request_id, WorkflowReopened, "reopen")
        if found is not None:
            await core.resume_idle(workflow_id)
            return RunHandle(self, workflow_id, found.run_id)
        async with recorder.lock:
            history = await recorder.current_history()
            found = _recorded(history, workflow_id, request_id, WorkflowReopened, "reopen")
            if found is not None:  # a concurrent call with the same key reopened it meanwhile
                return RunHandle(self, workflow_id, found.run_id)
            run_id = latest_run_id(history)
            assert run_id is not None
            segment = run_segment(history, run_id)
            terminal = current_lease_terminal(segment)
            if terminal is None:
                raise CannotReopen(workflow_id, run_id, "it is running")
            body = terminal.body
            if not isinstance(body, (WorkflowFailed, CancelledEvent)):
                status = workflow_status(segment)
                raise CannotReopen(
                    workflow_id,
                    run_id,
                    f"it is {status.value if status else 'closed'}; only failed or cancelled runs can be reopened",
                )
            if isinstance(body, CancelledEvent) and not body.terminated:
                reacted = _commands_after_cancel(segment, terminal.seq)
                if reacted:
                    raise CannotReopen(
                        workflow_id,
                        run_id,
                        f"its code reacted to the cancellation ({reacted} command(s) recorded after the "
                        "request); replaying it without the cancellation would take another path — "
                        "start a new run instead",
                    )
            start = segment[0].body
            assert isinstance(start, WorkflowStarted)
            # Activities the teardown cancelled are re-dispatched; so are those whose final
            # failure ended a failed run (the fix is deployed: a fresh attempt, not the
            # recorded failure replayed).
            reopened = sorted(
                {
                    e.body.activity_id
                    for e in segment
                    if isinstance(e.body, ActivityCancelled) and e.seq > terminal.seq
                }
                | set(failures_ending_the_run(segment, terminal) if isinstance(body, WorkflowFailed) else ())
            )
            lease = await core.reopen_locked(recorder, run_id, start.workflow_type, reopened, request_id)
            core.spawn_run(lease)
            await core.redispatch_unsettled(recorder, run_id)
            for timer in outstanding_timers(run_segment(recorder.history, run_id)):
                await core.arm_timer(workflow_id, run_id, timer.timer_id, timer.fire_at)
        logger.info("workflow run reopened", extra={"workflow_id": workflow_id, "run_id": run_id})
        # Children that ended while the run was closed (their outcome stood down) are delivered now.
        await children.repair_children(core, recorder, run_id)
        await core.upsert_visibility_quietly(workflow_id)
        return RunHandle(self, workflow_id, run_id)

    async def query(self, workflow_id: str, name: str, *args: Any) -> Any:
        """Ask the workflow's running run a question: its handler ``name`` answers from its state.

        The handler (registered by the workflow code with
        ``ctx.set_query_handler``) runs while the run is parked between
        steps; a run that is replaying history or in the middle of a step is
        waited for.  Nothing is ever recorded.  ``args`` and the result pass
        through the payload codec, so they must be JSON-serialisable
        (:class:`PayloadNotSerializable` / :class:`PayloadTooLarge` otherwise).

        The query goes to the workflow's latest run (a run that continued as
        new is answered by its successor).

        Raises :class:`WorkflowNotFound` (no such workflow), :class:`NotRunning`
        (the latest run ended), :class:`UnknownQuery` (no handler of that
        name), :class:`QueryFailed` (the handler raised; original in
        ``__cause__``), :class:`QueryReadOnly` (the handler issued a command),
        :class:`QueryUnavailable` (Running, but stuck or not resident in this
        engine: nothing here can answer, so it fails at once rather than
        waiting), :class:`EngineEpochClosed` (the engine is shutting down).
        The run is unaffected by every failure.  Cancellation simply abandons
        the wait.
        """
        core = self._core
        if not isinstance(name, str) or not name:
            raise ValueError(f"query name must be a non-empty str, got {name!r}")
        arguments = core.codec.encode(list(args), what=f"arguments of query {name!r}")
        found = await self._here_or_owner(
            workflow_id,
            lambda: self._query_here(workflow_id, name, arguments),
            lambda: QueryCommand(workflow_id=workflow_id, name=name, args=arguments),
        )
        return query_answer(found) if isinstance(found, CommandOutcome) else found

    async def _query_here(self, workflow_id: str, name: str, arguments: Payload) -> Any:
        core = self._core
        recorder = await self._existing_recorder(workflow_id)
        while True:
            history = recorder.history
            status = workflow_status(history)
            run_id = latest_run_id(history)
            lease = core.registry.get(workflow_id, run_id) if run_id is not None else None
            if status is WorkflowStatus.CONTINUED_AS_NEW and lease is not None and core.epoch.admitting:
                # This engine is starting the successor right now: the query goes to it.
                await recorder.wait_changed()
                continue
            if status is not WorkflowStatus.RUNNING or run_id is None:
                raise NotRunning(
                    workflow_id, status.value if status else "unknown", f"query {name!r}", writes=False
                )
            if lease is None or lease.residency is Residency.SUSPENDED:
                reason = core.stuck.get(workflow_id)
                raise QueryUnavailable(
                    workflow_id,
                    run_id,
                    f"this engine could not resume it ({reason}); fix the cause and restart the engine"
                    if reason
                    else "it is not resident in this engine (another engine started it after this one "
                    "opened the store); query it through the engine that runs it, or restart this one "
                    "to resume it",
                )
            if lease.residency is Residency.STUCK:
                raise QueryUnavailable(
                    workflow_id,
                    run_id,
                    f"it is stuck, its code is not executing ({lease.stuck_reason}); deploy compatible "
                    "code and restart the engine, or terminate the run",
                )
            activation = lease.activation
            if activation is not None and activation.answerable:
                # Synchronous from here to the return: the run cannot take a step meanwhile.
                value = activation.answer_query(name, core.codec.decode(arguments))
                return core.codec.decode(core.codec.encode(value, what=f"result of query {name!r}"))
            if not core.epoch.admitting:
                raise epoch_closed(workflow_id, run_id, f"answer query {name!r}")
            # Starting, replaying, mid-step or ending: wait for it to park (the context
            # wakes us) or for history to change (a terminal, a stuck mark, a reopen).
            lease.query_waiters += 1
            try:
                await recorder.wait_changed()
            finally:
                lease.query_waiters -= 1

    async def history(self, workflow_id: str) -> list[Event]:
        """The workflow's full event history, read from the store."""
        events = await self._core.events.read_history(workflow_id)
        if not events:
            raise WorkflowNotFound(workflow_id)
        return events

    async def describe(self, workflow_id: str) -> WorkflowDescription:
        core = self._core
        if self._cluster is not None and not core.drives(workflow_id):
            # Another node drives it (cluster mode): what the store holds now.
            history: Sequence[Event] = await self.history(workflow_id)
        else:
            history = (await self._existing_recorder(workflow_id)).history
        return describe_history(
            workflow_id, history, codec=core.codec, stuck_reason=core.stuck.get(workflow_id)
        )

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


def _commands_after_cancel(segment: Sequence[Event], terminal_seq: int) -> int:
    """Commands the run's code recorded between its last cancel request and its terminal."""
    request = None
    for event in segment:
        if isinstance(event.body, WorkflowReopened):
            request = None
        elif isinstance(event.body, WorkflowCancelRequested) and request is None:
            request = event.seq
    if request is None:
        return 0
    return sum(
        1
        for e in segment
        if request < e.seq < terminal_seq
        and (
            isinstance(e.body, (ActivityScheduled, MarkerRecorded))
            or (isinstance(e.body, TimerStarted) and not e.body.timer_id.startswith("deadline:"))
        )
    )


def _deadline(timeout: timedelta | float | None) -> timedelta | None:
    if timeout is None:
        return None
    return timedelta(seconds=duration_seconds(timeout, "timeout", allow_zero=False))


def _ends_or_starts(event: Event) -> bool:
    body = event.body
    return body.TERMINAL or isinstance(body, (WorkflowStarted, WorkflowReopened))


def _filter(filter: VisibilityFilter | None, criteria: Mapping[str, Any]) -> VisibilityFilter:
    if filter is not None and criteria:
        raise TypeError("pass either a VisibilityFilter or keyword criteria, not both")
    return filter if filter is not None else VisibilityFilter(**criteria)


def _recorded(
    history: Sequence[Event], workflow_id: str, request_id: str | None, kind: type[EventBody], what: str
) -> RecordedRequest | None:
    """The event ``request_id`` already recorded (a retried call: record nothing), or ``None``.

    A key already spent on another kind of call is refused: one key names one call."""
    if request_id is None:
        return None
    found = recorded_request(history, request_id)
    if found is None:
        return None
    body = found.event.body
    if not isinstance(body, kind) or (isinstance(body, CancelledEvent) and not body.terminated):
        raise ValueError(
            f"request_id {request_id!r} was already used on workflow {workflow_id!r} for a "
            f"{type(body).__name__} (seq {found.event.seq}); give each distinct call its own request_id"
        )
    logger.info(
        "%s with request id %r is already recorded (seq %d); nothing recorded again",
        what,
        request_id,
        found.event.seq,
        extra={"workflow_id": workflow_id, "run_id": found.run_id, "request_id": request_id},
    )
    return found


def _reuse_allowed(policy: IdReusePolicy, status: WorkflowStatus) -> bool | None:
    """True: start a new run; False: refuse; None: return the existing run."""
    if policy is IdReusePolicy.USE_EXISTING:
        return None
    if policy is IdReusePolicy.REJECT_DUPLICATE:
        return False
    if status in (WorkflowStatus.RUNNING, WorkflowStatus.CONTINUED_AS_NEW):
        return False
    if policy is IdReusePolicy.ALLOW_IF_FAILED:
        return status in (WorkflowStatus.FAILED, WorkflowStatus.CANCELLED, WorkflowStatus.TIMED_OUT)
    return True
