"""Local commands: start, signal, cancel, terminate, reopen, query and activity completions by
task token applied on this node.

The one table of what each client command does once it is this node's to apply:
the client (``Engine``) calls it for a workflow this node drives (or, outside
cluster mode, for every workflow), and the inbox drainer calls it for each command
it applies (``_hub.InboxHub``; the wiring hands it in).  Every command but a query
is applied under its request id: a key already recorded records nothing and
answers as the first call did.  A refusal is raised as its typed error.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any, final

import attrs
import trio

from .. import _children as children
from .._activities import TaskToken, command_outcome
from .._admission import AdmissionPool
from .._commands import ActivityCommand, IdReusePolicy, reuse_decision
from .._completion import forget_retired, teardown_bodies
from .._contain import is_structural
from .._context import RunActivation
from .._definitions import WorkflowDefinition
from .._errors import (
    CannotReopen,
    CannotReset,
    NotRunning,
    QueryUnavailable,
    SequenceConflict,
    UpdateUnavailable,
    WorkflowAlreadyStarted,
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
    UpdateAccepted,
    WorkflowCancelled as CancelledEvent,
    WorkflowCancelRequested,
    WorkflowFailed,
    WorkflowReopened,
    WorkflowReset,
    WorkflowStarted,
    WorkflowStatus,
    freeze_headers,
    validate_search_attributes,
)
from .._ids import (
    DEADLINE_TIMER_PREFIX,
    new_run_id,
    new_workflow_id,
    validate_request_id,
    validate_task_queue,
    validate_workflow_id,
)
from .._observe import RunStart, run_headers
from .._payload import Payload
from .._ports import RunAborted
from .._projections import (
    RecordedRequest,
    RunState,
    accepted_update,
    current_lease_terminal,
    failures_ending_the_run,
    last_step,
    latest_run_id,
    outstanding_timers,
    recorded_request,
    reset_points,
    run_segment,
    workflow_status,
)
from .._recorder import Recorder
from .._registry import Residency
from .._retry import duration_seconds
from .._run_port import HistoryPort
from .core import EngineCore
from .log import logger


@final
@attrs.frozen
class Started:
    """The run a local start or reopen made current (``created``: this call, or the first
    call with its request id, recorded the start)."""

    workflow_id: str
    run_id: str
    created: bool = False


@final
class LocalCommands:
    """The commands applied on this node, through this engine's recorders."""

    def __init__(self, core: EngineCore) -> None:
        self._core = core
        config = core.config
        #: The admission pool of starts (``EngineConfig.max_inflight_starts``).
        self._starts = AdmissionPool(
            "starts",
            config.max_inflight_starts,
            timeout=config.admission_timeout,
            setting="EngineConfig.max_inflight_starts",
        )

    @property
    def admitting(self) -> bool:
        """Whether the engine still admits commands (it is not shutting down)."""
        return self._core.epoch.admitting

    def decode(self, payload: Payload) -> Any:
        """A command's payload (its arguments) decoded by the engine's codec."""
        return self._core.codec.decode(payload)

    async def activity_by_token(self, command: ActivityCommand) -> None:
        """Complete, fail or heartbeat the activity attempt the command's token names (see
        ``Engine.complete_activity``); a bad token raises :class:`InvalidActivityToken`."""
        named = TaskToken.parse(command.token)
        recorder = await self.existing_recorder(named.workflow_id)
        outcome, details = command_outcome(command)
        await self._core.activity_dispatch.by_token(recorder, named, outcome, details)

    async def existing_recorder(self, workflow_id: str) -> Recorder:
        """The workflow's recorder, or :class:`WorkflowNotFound` if it has no history."""
        recorder = await self._core.recorder_for(workflow_id)
        if not recorder.history:
            raise WorkflowNotFound(workflow_id)
        return recorder

    async def start(
        self,
        workflow: WorkflowDefinition[Any] | str,
        args: Sequence[Any],
        *,
        workflow_id: str | None = None,
        id_reuse: IdReusePolicy = IdReusePolicy.ALLOW_DUPLICATE,
        search_attributes: Mapping[str, Any] | None = None,
        task_queue: str | None = None,
        timeout: timedelta | float | None = None,  # noqa: ASYNC109 - a durable workflow deadline
        request_id: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Started:
        """Start a run here (see ``Engine.start``) under a key already vetted: the caller's,
        or the inbox's ``inbox:N``.  Decides by the request id and the id reuse policy, then
        records the start through the one start path (``Runner.start_run_locked``)."""
        core = self._core
        wid, started = self._start_event(
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
        if not core.epoch.admitting:
            raise epoch_closed(wid, None, "start a workflow")

        # Admission: bad input was refused at once; a valid start waits here for a slot
        # when max_inflight_starts are in flight (or is refused after admission_timeout).
        async with self._starts.slot():
            if not core.epoch.admitting:  # the engine began shutting down meanwhile
                raise epoch_closed(wid, None, "start a workflow")
            return await self._record_start(wid, started, id_reuse, request_id)

    async def _record_start(
        self,
        wid: str,
        started: Callable[[str], WorkflowStarted],
        id_reuse: IdReusePolicy,
        request_id: str | None,
    ) -> Started:
        """Decide by the request id and the id reuse policy, then record the start."""
        core = self._core
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
                return Started(wid, run_id, created=True)
        recorder = await core.recorder_for(wid)
        if request_id is not None:
            async with recorder.lock:
                found = _recorded(await recorder.current_history(), wid, request_id, WorkflowStarted, "start")
            if found is not None:
                await core.resume_idle(wid)
                return Started(wid, found.run_id, created=True)
        async with recorder.lock:
            history = await recorder.current_history()
            found = _recorded(history, wid, request_id, WorkflowStarted, "start")
            if found is not None:  # a concurrent call with the same key started it meanwhile
                return Started(wid, found.run_id, created=True)
            existing_run = latest_run_id(history)
            if existing_run is not None:
                status = workflow_status(history)
                assert status is not None
                reuse = reuse_decision(id_reuse, status)
                if reuse is None:
                    return Started(wid, existing_run)
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
        return Started(wid, run_id, created=True)

    def _start_event(
        self,
        workflow: WorkflowDefinition[Any] | str,
        args: Sequence[Any],
        *,
        workflow_id: str | None,
        id_reuse: IdReusePolicy,
        search_attributes: Mapping[str, Any] | None,
        task_queue: str | None,
        timeout: timedelta | float | None,
        request_id: str | None,
        headers: Mapping[str, str] | None = None,
    ) -> tuple[str, Callable[[str], WorkflowStarted]]:
        """Vet a start's input (raising before anything is recorded); returns the workflow id
        and how to build its ``WorkflowStarted`` for a new run id.  The header hooks are
        asked here, in the caller's task."""
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
        given = freeze_headers(headers) if headers is not None else {}
        carried = run_headers(
            core.observers,
            RunStart(kind="start", workflow_id=wid, workflow_type=definition.name, headers=given),
        )

        def started(run_id: str) -> WorkflowStarted:
            return WorkflowStarted(
                workflow_type=definition.name,
                input=payload,
                run_id=run_id,
                task_queue=queue,
                search_attributes=attributes,
                timeout=deadline_after,
                request_id=request_id,
                headers=carried,
            )

        return wid, started

    async def signal_with_start(
        self,
        workflow: WorkflowDefinition[Any] | str,
        args: Sequence[Any],
        signal_name: str,
        encoded: Payload,
        *,
        workflow_id: str,
        id_reuse: IdReusePolicy = IdReusePolicy.ALLOW_DUPLICATE,
        search_attributes: Mapping[str, Any] | None = None,
        task_queue: str | None = None,
        timeout: timedelta | float | None = None,  # noqa: ASYNC109 - a durable workflow deadline
        request_id: str | None = None,
    ) -> Started:
        """Signal the workflow's running run, or start one with the signal (see
        ``Engine.signal_with_start``), deciding under the recorder's lock.  A start records
        ``WorkflowStarted`` and ``SignalReceived`` in one append through the one start path
        (``Runner.start_run_locked``); both carry ``request_id``, so a retry finds what the
        first call did and records nothing."""
        core = self._core
        if id_reuse is IdReusePolicy.USE_EXISTING:
            raise ValueError(
                "signal-with-start signals the running run or starts one; id_reuse=use_existing has "
                "no meaning here (a closed run cannot take the signal)"
            )
        wid, started = self._start_event(
            workflow,
            args,
            workflow_id=workflow_id,
            id_reuse=id_reuse,
            search_attributes=search_attributes,
            task_queue=task_queue,
            timeout=timeout,
            request_id=request_id,
        )
        what = f"signal-with-start {signal_name!r}"
        if not core.epoch.admitting:
            raise epoch_closed(wid, None, what)
        signal = SignalReceived(name=signal_name, payload=encoded, request_id=request_id)
        found: RecordedRequest | None = None
        # It may start a run: admitted as a start is (max_inflight_starts).
        async with self._starts.slot():
            if not core.epoch.admitting:  # the engine began shutting down meanwhile
                raise epoch_closed(wid, None, what)
            recorder = await core.recorder_for(wid)
            async with recorder.lock:
                history = await recorder.current_history()
                if request_id is not None:
                    found = recorded_request(history, request_id)
                if found is None:
                    outcome = await self._signal_or_start_locked(recorder, started, signal, id_reuse)
        if found is None:
            if outcome.created:
                await core.refresh_visibility_soon(wid)
            return outcome
        if not isinstance(found.event.body, (WorkflowStarted, SignalReceived)):
            _recorded(history, wid, request_id, SignalReceived, what)  # raises: another call's key
        logger.info(
            "%s with request id %r is already recorded (seq %d); nothing recorded again",
            what,
            request_id,
            found.event.seq,
            extra={"workflow_id": wid, "run_id": found.run_id, "request_id": request_id},
        )
        if isinstance(found.event.body, SignalReceived):
            return Started(wid, found.run_id)
        await core.resume_idle(wid)  # its start may have landed unacknowledged: run it
        return Started(wid, found.run_id, created=True)

    async def _signal_or_start_locked(
        self,
        recorder: Recorder,
        started: Callable[[str], WorkflowStarted],
        signal: SignalReceived,
        id_reuse: IdReusePolicy,
    ) -> Started:
        """Under the lock: append the signal to the running run, or start a run with it."""
        core = self._core
        wid = recorder.workflow_id
        status = workflow_status(recorder.history)
        existing_run = latest_run_id(recorder.history)
        if status is WorkflowStatus.RUNNING and existing_run is not None:
            await recorder.append([signal], action=f"record signal {signal.name!r}", run_id=existing_run)
            return Started(wid, existing_run)
        if existing_run is not None:
            assert status is not None
            if not reuse_decision(id_reuse, status):
                raise WorkflowAlreadyStarted(wid, existing_run, status.value, id_reuse.value)
        run_id = new_run_id()
        await core.runner.start_run_locked(
            recorder,
            started(run_id),
            now=core.clock.now(),
            action=f"start a workflow with signal {signal.name!r}",
            resume_if_unknown=True,
            delivered=[signal],
        )
        return Started(wid, run_id, created=True)

    async def signal(
        self, workflow_id: str, name: str, encoded: Payload, request_id: str | None = None
    ) -> None:
        """Record the signal through this engine's recorder, unless ``request_id`` is recorded."""
        if not self._core.epoch.admitting:
            raise epoch_closed(workflow_id, None, "record a signal")
        recorder = await self.existing_recorder(workflow_id)
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

    async def accept_update(self, workflow_id: str, name: str, encoded: Payload, update_id: str) -> None:
        """Validate update ``name`` against the running run's code here and record
        ``UpdateAccepted`` (see ``Engine.update``), unless ``update_id`` is already accepted.

        Validation and the append happen under the recorder's lock while the run is
        parked with nothing new to consume, so the validator sees the state the
        handler will be given (nothing can be delivered in between)."""
        core = self._core
        if not core.epoch.admitting:
            raise epoch_closed(workflow_id, None, f"record update {name!r}")
        recorder = await self.existing_recorder(workflow_id)
        what = f"update {name!r}"
        while True:
            async with recorder.lock:
                history = await recorder.current_history()
                if accepted_update(history, update_id) is not None:
                    return  # a retried call: the first one was accepted
                status = workflow_status(history)
                run_id = latest_run_id(history)
                if status is not WorkflowStatus.RUNNING or run_id is None:
                    raise NotRunning(workflow_id, status.value if status else "unknown", f"{what} to")
                lease = core.registry.get(workflow_id, run_id)
                if lease is None or lease.residency is not Residency.RESIDENT:
                    reason = core.stuck.get(workflow_id) or (
                        lease.stuck_reason if lease is not None else None
                    )
                    raise UpdateUnavailable(
                        workflow_id,
                        name,
                        f"its code is not executing in this engine ({reason}); nothing was recorded"
                        if reason
                        else "it is not resident in this engine; nothing was recorded",
                    )
                activation = lease.activation
                if activation is not None and activation.answerable:
                    activation.validate_update(name, core.codec.decode(encoded))
                    await recorder.append(
                        [UpdateAccepted(update_id=update_id, name=name, payload=encoded)],
                        action=f"record {what}",
                        run_id=run_id,
                    )
                    return
            if not core.epoch.admitting:
                raise epoch_closed(workflow_id, run_id, f"record {what}")
            # Starting, replaying or mid-step: wait for it to park (the context wakes
            # query waiters) or for history to change.
            lease.query_waiters += 1
            try:
                await recorder.wait_changed()
            finally:
                lease.query_waiters -= 1

    async def cancel(self, workflow_id: str, reason: str, request_id: str | None = None) -> None:
        """Record a cancel request for the running run, unless one is pending or ``request_id`` is recorded."""
        if not self._core.epoch.admitting:
            raise epoch_closed(workflow_id, None, "cancel a workflow")
        recorder = await self.existing_recorder(workflow_id)
        async with recorder.lock:
            history = await recorder.current_history()
            if _recorded(history, workflow_id, request_id, WorkflowCancelRequested, "cancel") is not None:
                return
            run_id, segment = await _running_run(recorder, "cancel")
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

    async def terminate(self, workflow_id: str, reason: str, request_id: str | None = None) -> None:
        """End the running run at once (its teardown in the same batch) and stop it here."""
        core = self._core
        if not core.epoch.admitting:
            raise epoch_closed(workflow_id, None, "terminate a workflow")
        recorder = await self.existing_recorder(workflow_id)
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
                run_id, segment = await _running_run(recorder, "terminate")
                bodies: list[EventBody] = [
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

    async def reopen(self, workflow_id: str, request_id: str | None = None) -> Started:
        """Reopen a Failed or Cancelled run here (see ``Engine.reopen``)."""
        core = self._core
        if not core.epoch.admitting:
            raise epoch_closed(workflow_id, None, "reopen a workflow")
        recorder = await self.existing_recorder(workflow_id)
        async with recorder.lock:
            history = await recorder.current_history()
            found = _recorded(history, workflow_id, request_id, WorkflowReopened, "reopen")
        if found is not None:
            await core.resume_idle(workflow_id)
            return Started(workflow_id, found.run_id)
        async with recorder.lock:
            history = await recorder.current_history()
            found = _recorded(history, workflow_id, request_id, WorkflowReopened, "reopen")
            if found is not None:  # a concurrent call with the same key reopened it meanwhile
                return Started(workflow_id, found.run_id)
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
        return Started(workflow_id, run_id)

    async def reset(
        self, workflow_id: str, to_seq: int | None, reason: str, request_id: str | None = None
    ) -> Started:
        """Reset the workflow's latest run here (see ``Engine.reset``): one append records
        the old run's end (``WorkflowReset`` and, if it was running, its teardown) and the
        new run's start with the old history up to ``to_seq`` (``None``: its last step)."""
        core = self._core
        if not core.epoch.admitting:
            raise epoch_closed(workflow_id, None, "reset a workflow")
        recorder = await self.existing_recorder(workflow_id)
        async with recorder.lock:
            history = await recorder.current_history()
            found = _recorded(history, workflow_id, request_id, WorkflowReset, "reset")
            if found is not None:
                # Recorded by a first attempt whose acknowledgement was lost: stop the old
                # run here if that attempt could not.
                assert isinstance(found.event.body, WorkflowReset)
                new_run = found.event.body.new_run_id
                core.stop_run_locally(workflow_id, found.run_id, found.event)
            else:
                new_run, stopped = await self._reset_locked(recorder, history, to_seq, reason, request_id)
        if found is not None:
            await core.resume_idle(workflow_id)
            return Started(workflow_id, new_run)
        if stopped is not None:
            await core.run_closed(workflow_id, stopped)
        await core.upsert_visibility_quietly(workflow_id)
        return Started(workflow_id, new_run, created=True)

    async def _reset_locked(
        self,
        recorder: Recorder,
        history: Sequence[Event],
        to_seq: int | None,
        reason: str,
        request_id: str | None,
    ) -> tuple[str, str | None]:
        """Record the reset; the new run's id, and the old run's if this stopped it."""
        core = self._core
        workflow_id = recorder.workflow_id
        run_id = latest_run_id(history)
        assert run_id is not None
        segment = run_segment(history, run_id)
        point, start, copied = _history_to(workflow_id, run_id, segment, to_seq)
        running = current_lease_terminal(segment) is None
        new_run = new_run_id()
        closing: list[EventBody] = [
            WorkflowReset(new_run_id=new_run, to_seq=point, reason=reason, request_id=request_id)
        ]
        if running:
            closing.extend(teardown_bodies(segment, run_id, retire_timers=True))
        deadline = f"{DEADLINE_TIMER_PREFIX}{run_id}"
        # Signals that arrived after the point are delivered to the new run too.
        copied.extend(e.body for e in segment if e.seq > point and isinstance(e.body, SignalReceived))

        def landed() -> None:
            # No checkpoint since the append: the old run's code never sees its end.
            if running:
                ended = next(e for e in reversed(recorder.history) if isinstance(e.body, WorkflowReset))
                core.stop_run_locally(workflow_id, run_id, ended)

        await core.runner.start_run_locked(
            recorder,
            WorkflowStarted(
                workflow_type=start.workflow_type,
                input=start.input,
                run_id=new_run,
                parent_workflow_id=start.parent_workflow_id,
                task_queue=start.task_queue,
                # The start's values: the copied upserts (up to the point) replay on top.
                search_attributes=start.search_attributes,
                timeout=start.timeout,
                reset_from_run_id=run_id,
                reset_to_seq=point,
                headers=run_headers(
                    core.observers,
                    RunStart(
                        kind="reset",
                        workflow_id=workflow_id,
                        workflow_type=start.workflow_type,
                        headers=start.headers,
                        parent_workflow_id=start.parent_workflow_id,
                        previous_run_id=run_id,
                    ),
                ),
            ),
            now=core.clock.now(),
            action="reset the workflow",
            landed=landed,
            delivered=copied,
            closing=closing,
            resume_if_unknown=True,
        )
        logger.warning(
            "workflow run reset to seq %d: %s",
            point,
            reason or "(no reason given)",
            extra={"workflow_id": workflow_id, "run_id": run_id, "new_run_id": new_run},
        )
        if running:
            await forget_retired(
                core, workflow_id, [b for b in closing if getattr(b, "timer_id", None) == deadline]
            )
        return new_run, run_id if running else None

    async def fork(
        self, workflow_id: str, to_seq: int | None, new_workflow_id: str, request_id: str | None = None
    ) -> Started:
        """Start ``new_workflow_id`` with the history of ``workflow_id``'s latest run up to
        ``to_seq`` (see ``Engine.fork``); the source is read from the store, untouched."""
        core = self._core
        validate_workflow_id(new_workflow_id)
        if request_id is not None:
            validate_request_id(request_id)
        if not core.epoch.admitting:
            raise epoch_closed(new_workflow_id, None, "fork a workflow")
        history = await core.events.read_history(workflow_id)
        run_id = latest_run_id(history)
        if run_id is None:
            raise WorkflowNotFound(workflow_id)
        point, start, copied = _history_to(workflow_id, run_id, run_segment(history, run_id), to_seq)
        if new_workflow_id == workflow_id:
            raise ValueError(
                f"a fork needs a new workflow id, not {workflow_id!r} (reset a workflow in place)"
            )
        recorder = await core.recorder_for(new_workflow_id)
        async with recorder.lock:
            target = await recorder.current_history()
            found = _recorded(target, new_workflow_id, request_id, WorkflowStarted, "fork")
            if found is not None:
                return Started(new_workflow_id, found.run_id, created=True)
            existing = latest_run_id(target)
            if existing is not None:
                status = workflow_status(target)
                raise WorkflowAlreadyStarted(
                    new_workflow_id, existing, status.value if status else "unknown", "reject_duplicate"
                )
            new_run = new_run_id()
            await core.runner.start_run_locked(
                recorder,
                WorkflowStarted(
                    workflow_type=start.workflow_type,
                    input=start.input,
                    run_id=new_run,
                    task_queue=start.task_queue,
                    search_attributes=start.search_attributes,
                    timeout=start.timeout,
                    request_id=request_id,
                    headers=run_headers(
                        core.observers,
                        RunStart(
                            kind="start", workflow_id=new_workflow_id, workflow_type=start.workflow_type
                        ),
                    ),
                ),
                now=core.clock.now(),
                action="fork a workflow",
                delivered=copied,
                resume_if_unknown=True,
            )
        logger.info(
            "workflow forked at seq %d into %r",
            point,
            new_workflow_id,
            extra={"workflow_id": workflow_id, "run_id": run_id, "new_run_id": new_run},
        )
        await core.refresh_visibility_soon(new_workflow_id)
        return Started(new_workflow_id, new_run, created=True)

    async def query(self, workflow_id: str, name: str, arguments: Payload) -> Any:
        """Answer the query from the latest run's handler here (see ``Engine.query``)."""
        core = self._core
        recorder = await self.existing_recorder(workflow_id)
        while True:
            history = recorder.history
            status = workflow_status(history)
            run_id = latest_run_id(history)
            lease = core.registry.get(workflow_id, run_id) if run_id is not None else None
            if status is WorkflowStatus.CONTINUED_AS_NEW and lease is not None and core.epoch.admitting:
                # This engine is starting the successor right now: the query goes to it.
                await recorder.wait_changed()
                continue
            if run_id is None or status is None:
                raise NotRunning(workflow_id, "unknown", f"query {name!r}", writes=False)
            if status is not WorkflowStatus.RUNNING:
                return await self._query_closed(workflow_id, run_id, status, list(history), name, arguments)
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

    async def _query_closed(
        self,
        workflow_id: str,
        run_id: str,
        status: WorkflowStatus,
        history: Sequence[Event],
        name: str,
        arguments: Payload,
    ) -> Any:
        """Answer a query of a closed run: replay its history in a throwaway execution of its
        code (in this task), then ask the handler.  Read-only like every query: each command
        resolves from history, and where the code would go past the end of history it is
        unwound (nothing is recorded, started or executed)."""
        core = self._core
        start = run_segment(history, run_id)[0].body
        assert isinstance(start, WorkflowStarted)
        definition = core.workflows.get(start.workflow_type)
        if definition is None:
            raise QueryUnavailable(
                workflow_id,
                run_id,
                f"its workflow type {start.workflow_type!r} is not registered with this engine, so its "
                "history cannot be replayed to answer",
                status=status.value,
            )
        port = HistoryPort(
            core,
            history,
            workflow_id=workflow_id,
            run_id=run_id,
            workflow_type=start.workflow_type,
            read_only=True,
        )
        activation = RunActivation(port)
        raw_args = core.codec.decode(activation.input)
        args = raw_args if isinstance(raw_args, list) else [raw_args]
        try:
            args = definition.hints.decode_arguments(args, what=f"input of workflow {definition.name!r}")
            await activation.run(definition.fn, *args)
        except RunAborted:
            pass  # the end of history: the state is what the code had built by then
        except BaseException as exc:
            # How the run ended (a failure, a cancellation, continue-as-new) leaves its
            # state as it was; only the caller's cancellation and a Ctrl-C pass.
            if is_structural(exc):
                raise
        finally:
            activation.detach()
        if activation.poisoned is not None:
            raise QueryUnavailable(
                workflow_id,
                run_id,
                f"replaying its history with this engine's code diverged ({activation.poisoned})",
                status=status.value,
            )
        value = activation.answer_query(name, core.codec.decode(arguments))
        return core.codec.decode(core.codec.encode(value, what=f"result of query {name!r}"))


async def _running_run(recorder: Recorder, operation: str) -> tuple[str, list[Event]]:
    """Under the lock: the running run's id and segment, or :class:`NotRunning`."""
    history = await recorder.current_history()
    status = workflow_status(history)
    run_id = latest_run_id(history)
    if status is not WorkflowStatus.RUNNING or run_id is None:
        raise NotRunning(recorder.workflow_id, status.value if status else "unknown", operation)
    return run_id, run_segment(history, run_id)


def _history_to(
    workflow_id: str, run_id: str, segment: Sequence[Event], to_seq: int | None
) -> tuple[int, WorkflowStarted, list[EventBody]]:
    """A reset's or fork's point (``None``: the last step that did not fail), the run's
    start, and the bodies after the start up to the point (the deadline's timer left
    out: a new run arms its own), or :class:`CannotReset`."""
    points = reset_points(segment)
    point = last_step(segment) if to_seq is None else to_seq
    if point is None or point not in points:
        raise CannotReset(workflow_id, run_id, to_seq, points)
    start = segment[0].body
    assert isinstance(start, WorkflowStarted)
    deadline = f"{DEADLINE_TIMER_PREFIX}{run_id}"
    copied = [e.body for e in segment[1:] if e.seq <= point and getattr(e.body, "timer_id", None) != deadline]
    return point, start, copied


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
