"""Runs: their leases, their tasks, and a run made current again after an append of unknown outcome.

:class:`Runner` installs a run's lease, spawns its task and drives the
workflow code through a :class:`~aion_trio._context.RunActivation` until it
exits; the exit is handed to the terminal path (``run_exit``).  A run whose
code diverged from history is marked stuck here.  What the runner needs of
the rest of the engine (a run's port, the terminal path, visibility,
recovery, retrying a step in the background) it is given as callbacks.
"""

from __future__ import annotations

import traceback
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import datetime
from typing import Any, Protocol, final

import trio

from .._clock import EngineClock
from .._completion import TerminalIntent
from .._contain import is_structural
from .._context import ContinueAsNew, RunActivation
from .._definitions import WorkflowDefinition
from .._epoch import EngineEpoch
from .._errors import EngineEpochClosed, NonDeterminismError, PayloadError, WorkflowCancelled
from .._events import (
    ErrorInfo,
    EventBody,
    TimerStarted,
    WorkflowCancelled as CancelledEvent,
    WorkflowCompleted,
    WorkflowContinuedAsNew,
    WorkflowFailed,
    WorkflowReopened,
    WorkflowStarted,
)
from .._guard import install as install_guard
from .._hub import StartRetry
from .._ids import deadline_timer_id, new_run_id
from .._observe import RunStart, RunStuck, run_headers
from .._payload import PayloadCodec
from .._ports import RunAborted, WorkflowPort
from .._projections import is_active, latest_run_id, run_segment, search_attributes
from .._recorder import Recorder
from .._registry import Lease, Registry, Residency
from .._watchdog import register_step
from .log import logger
from .recorders import Recorders


class Guard(Protocol):
    """Runs one attempt of an idempotent step now; a transient failure retries it in the
    background until it lands or the engine closes.  Never raises."""

    async def __call__(
        self, what: str, fields: Mapping[str, Any], fn: Callable[..., Awaitable[Any]], *args: Any
    ) -> None: ...


@final
class Runner:
    """Launches runs and drives their code: one task per live lease.

    ``stuck`` is the engine's map of workflows whose run is stuck, by id (read
    by visibility).  ``port_for(lease)`` is the port a run's code talks to;
    ``run_exit(lease, intent)`` records the terminal of a run whose code ended;
    ``upsert_visibility(workflow_id)`` writes its visibility row (never raises);
    ``recover(workflow_id)`` resumes a workflow as the recovery sweep does;
    ``guard`` runs a step that must land even if the store is briefly away;
    ``arm_timer(workflow_id, run_id, timer_id, fire_at)`` arms a run's deadline.
    """

    def __init__(
        self,
        *,
        recorders: Recorders,
        registry: Registry,
        epoch: EngineEpoch,
        clock: EngineClock,
        codec: PayloadCodec,
        workflows: Mapping[str, WorkflowDefinition[Any]],
        stuck: dict[str, str],
        port_for: Callable[[Lease], WorkflowPort],
        run_exit: Callable[[Lease, TerminalIntent], Awaitable[None]],
        upsert_visibility: Callable[[str], Awaitable[None]],
        recover: Callable[[str], Awaitable[object]],
        guard: Guard,
        arm_timer: Callable[[str, str, str, datetime], Awaitable[None]],
        left: Callable[[Lease], None] | None = None,
        determinism_guard: bool = True,
    ) -> None:
        self._recorders = recorders
        self._registry = registry
        self._epoch = epoch
        self._clock = clock
        self._codec = codec
        self._workflows = workflows
        self._stuck = stuck
        self._port_for = port_for
        self._run_exit = run_exit
        self._upsert_visibility = upsert_visibility
        self._recover = recover
        self._guard = guard
        self._arm_timer = arm_timer
        #: Told when a run's code stops executing here (the residency service).
        self._left = left
        #: How many runs' code executes here now.
        self.live_runs = 0
        self._determinism_guard = determinism_guard
        if determinism_guard:
            install_guard(d.fn for d in workflows.values())
        #: Workflows a :meth:`resume_idle` is looking at now (one at a time: no second run).
        self._resuming: set[str] = set()

    def resume_idle_soon(self, workflow_id: str) -> None:
        """After an append of unknown outcome that makes a run current (a start, a
        reopen): once the store answers, :meth:`resume_idle` looks at
        what landed and runs it.  Retried in the epoch while the store is unavailable."""
        try:
            self._epoch.spawn(
                self._guard,
                "resume a run recorded by an append of unknown outcome",
                {"workflow_id": workflow_id},
                self.resume_idle,
                workflow_id,
                name=f"resume-idle:{workflow_id}",
            )
        except EngineEpochClosed:
            pass  # shutting down: the next engine's recovery resumes it

    async def resume_idle(self, workflow_id: str) -> None:
        """Resume ``workflow_id``'s latest run if history records it active but no live lease
        here drives it, as the recovery sweep would.

        The one mechanism for a run recorded by an append whose acknowledgement was lost
        (a start, a reopen, a continue-as-new successor): the history is re-read first if
        the recorder is stale, so what actually landed decides.  Idempotent; raises
        ``BackendUnavailable`` while the store cannot be read."""
        if workflow_id in self._resuming:
            return  # another call is resuming it now
        self._resuming.add(workflow_id)
        try:
            recorder = await self._recorders.recorder_for(workflow_id)
            async with recorder.lock:
                history = await recorder.current_history()
                run_id = latest_run_id(history)
                if run_id is None or not is_active(history):
                    return
                lease = self._registry.get(workflow_id, run_id)
                if lease is not None and not lease.completion.is_set:
                    return
            await self._recover(workflow_id)
        finally:
            self._resuming.discard(workflow_id)

    async def reopen_locked(
        self,
        recorder: Recorder,
        run_id: str,
        workflow_type: str,
        activity_ids: Sequence[int] = (),
        request_id: str | None = None,
    ) -> Lease:
        """Append ``WorkflowReopened`` and install the run's new lease in the same critical
        section (hold the recorder lock), so no check made under the lock ever sees the
        reopen recorded without its lease, or the lease without its reopen."""
        try:
            await recorder.append(
                [
                    WorkflowReopened(
                        run_id=run_id,
                        reopened_activity_ids=tuple(int(a) for a in activity_ids),
                        request_id=request_id,
                    )
                ],
                action="reopen the run",
                run_id=run_id,
            )
        except Exception:
            if recorder.stale:  # the reopen may have landed: run it if it did
                self.resume_idle_soon(recorder.workflow_id)
            raise
        return self.new_lease(recorder, run_id, workflow_type)

    def new_lease(self, recorder: Recorder, run_id: str, workflow_type: str) -> Lease:
        """Create and install a lease.  Call inside the recorder critical section
        that appended the event making it current."""
        lease = Lease(
            workflow_id=recorder.workflow_id,
            run_id=run_id,
            workflow_type=workflow_type,
            recorder=recorder,
            start_head=recorder.head,
        )
        self._registry.install(lease)
        return lease

    def spawn_run(self, lease: Lease) -> None:
        self._epoch.spawn(
            self._run_workflow,
            lease,
            name=f"workflow:{lease.workflow_id}",
            workflow_id=lease.workflow_id,
            run_id=lease.run_id,
        )

    async def _run_workflow(self, lease: Lease) -> None:
        """A run's task: execute (or replay) the code, then record its terminal."""
        fields = {"workflow_id": lease.workflow_id, "run_id": lease.run_id, "lease": lease.lease_id}
        definition = self._workflows.get(lease.workflow_type)
        if definition is None:
            await self.mark_stuck(
                lease,
                f"workflow type {lease.workflow_type!r} is not registered with this engine; register it "
                "and restart, or terminate the run",
            )
            return
        activation = RunActivation(self._port_for(lease))
        lease.task = trio.lowlevel.current_task()
        lease.activation = activation
        intent: TerminalIntent
        self.live_runs += 1
        try:
            raw_args = self._codec.decode(activation.input)
            args = raw_args if isinstance(raw_args, list) else [raw_args]
            try:
                # Inputs that no longer fit the annotated types (PayloadDecodeError) fail the run.
                args = definition.hints.decode_arguments(args, what=f"input of workflow {definition.name!r}")
                with trio.CancelScope() as scope:
                    lease.cancel_scope = scope
                    value = await activation.run(definition.fn, *args, guarded=self._determinism_guard)
                    await activation.flush()
                if scope.cancelled_caught:
                    # Ended from outside (terminate, deadline teardown): that path
                    # recorded the terminal and does the bookkeeping.
                    return
            except RunAborted:
                return
            except NonDeterminismError as exc:
                await self.mark_stuck(lease, str(exc))
                return
            except WorkflowCancelled as cancelled:
                if await self._stuck_at_exit(
                    lease, activation, "the workflow to end cancelled", CancelledEvent
                ):
                    return
                intent = TerminalIntent.cancelled(cancelled.reason, self._clock.now())
            except ContinueAsNew as request:
                if await self._stuck_at_exit(
                    lease, activation, "the workflow to continue as new", WorkflowContinuedAsNew
                ):
                    return
                exit_time = self._clock.now()
                try:
                    payload = self._codec.encode(list(request.args_), what="continue-as-new input")
                    intent = TerminalIntent.continued_as_new(payload, request.workflow_type, exit_time)
                except PayloadError as exc:
                    intent = TerminalIntent.failed(error_info(exc), exit_time)
            except BaseException as exc:
                # SystemExit or any other BaseException of the code's own fails the
                # run; only the engine's cancellation and a Ctrl-C pass (see _contain).
                if is_structural(exc):
                    raise
                failing = f"the workflow to fail ({type(exc).__name__})"
                if await self._stuck_at_exit(lease, activation, failing, WorkflowFailed):
                    return
                intent = TerminalIntent.failed(error_info(exc), self._clock.now())
            else:
                if await self._stuck_at_exit(lease, activation, "the workflow to return", WorkflowCompleted):
                    return
                exit_time = self._clock.now()
                try:
                    payload = self._codec.encode(value, what=f"result of workflow {lease.workflow_type!r}")
                    intent = TerminalIntent.completed(payload, exit_time)
                except PayloadError as exc:
                    intent = TerminalIntent.failed(error_info(exc), exit_time)
        finally:
            self.live_runs -= 1
            lease.task = None
            lease.cancel_scope = None
            activation.detach()
            if lease.activation is activation:
                lease.activation = None
            if lease.query_waiters:
                lease.recorder.notify()
            if self._left is not None:
                self._left(lease)
        if lease.residency is Residency.EVICTED:
            return  # evicted while its code unwound: nothing is recorded (a wake replays it)
        try:
            await self._run_exit(lease, intent)
        except EngineEpochClosed as exc:
            logger.warning("workflow terminal not recorded: %s", exc, extra=fields)
        except Exception as exc:
            logger.error(
                "workflow completion hit an unretryable failure; the run stays as history shows it: %s: %s",
                type(exc).__name__,
                exc,
                extra=fields,
            )

    async def _stuck_at_exit(
        self, lease: Lease, activation: RunActivation, exit: str, terminal: type[EventBody]
    ) -> bool:
        """The code ended: mark the run stuck (``True``) if it diverged from history — a
        command of its own failed to match, history holds a command it never issued, or
        (replaying a finished run) the recorded end is of another kind than this exit.
        An evicted run's exit is not its end: ``True``, nothing marked."""
        if lease.residency is Residency.EVICTED:
            return True
        error = activation.exit_divergence(exit, terminal)
        if error is None:
            return False
        await self.mark_stuck(lease, str(error))
        return True

    async def mark_stuck(self, lease: Lease, reason: str) -> None:
        """Leave the run Running, marked stuck (visibility ``stuck_reason``), others unaffected."""
        lease.residency = Residency.STUCK
        lease.stuck_reason = reason
        self._stuck[lease.workflow_id] = reason
        logger.error(
            "workflow run is stuck and stays Running: %s",
            reason,
            extra={"workflow_id": lease.workflow_id, "run_id": lease.run_id, "lease": lease.lease_id},
        )
        lease.recorder.notify()
        observers = lease.recorder.observers
        if observers is not None:
            observers.emit(
                RunStuck(
                    workflow_id=lease.workflow_id,
                    run_id=lease.run_id,
                    workflow_type=lease.workflow_type,
                    reason=reason,
                )
            )
        await self._upsert_visibility(lease.workflow_id)

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
        delivered: Sequence[EventBody] = (),
        closing: Sequence[EventBody] = (),
    ) -> Lease:
        """Record a run's start and run it here: the one start path (hold the recorder lock).

        ``delivered``: what the run finds in history from its first step, recorded in
        the start's own append (signal-with-start's signal; a reset's copied history):
        all of it lands, or none.  ``closing``: the end of the run this start replaces
        (a reset's terminal and teardown), recorded ahead of the start in that append.

        Appends ``started`` and, if it has a ``timeout`` (and ``arm_deadline``), the
        deadline's ``TimerStarted`` at ``now + timeout``, as one batch recorded at
        ``now``; then, in the same critical section, installs the run's lease, spawns
        its task and arms its deadline.  Returns the lease.  The caller decides whether
        to start (request ids, the id reuse policy, a child or successor already
        recorded) and refreshes visibility after the lock.

        An append of unknown outcome looks for what landed: each try first re-reads a
        stale history and takes a start recorded with ``started.run_id`` as its own.
        ``retry(attempt)`` runs the tries (a child start: under the lock, until the store
        answers); without it one try is made and its error raised, after
        ``resume_if_unknown`` has had :meth:`resume_idle_soon` run what may have landed
        (a client start).  ``landed()`` is called once the start is recorded, before its
        lease (the client's fast path adopts its claimed recorder there).

        The continue-as-new successor passes ``arm_deadline=False``: it records its
        chain's ``timeout`` but no deadline timer of its own.
        """
        workflow_id = recorder.workflow_id
        run_id = started.run_id
        deadline = started.timeout if arm_deadline else None
        bodies: list[EventBody] = [*closing, started]
        if deadline is not None:
            bodies.append(TimerStarted(timer_id=deadline_timer_id(run_id), fire_at=now + deadline))
        bodies.extend(delivered)

        async def attempt() -> None:
            self._epoch.gate(workflow_id, run_id, action)
            if recorder.stale:  # an earlier try's outcome is unknown: look whether it landed
                history = await recorder.current_history()
                if any(isinstance(e.body, WorkflowStarted) and e.body.run_id == run_id for e in history):
                    return
            await recorder.append(bodies, action=action, run_id=run_id, at=now)

        if retry is not None:
            await retry(attempt)
        else:
            try:
                await attempt()
            except Exception:
                if resume_if_unknown and recorder.stale:  # the start may have landed: run it if it did
                    self.resume_idle_soon(workflow_id)
                raise
        if landed is not None:
            landed()
        lease = self.new_lease(recorder, run_id, started.workflow_type)
        self.spawn_run(lease)
        if deadline is not None:
            await self._arm_timer(workflow_id, run_id, deadline_timer_id(run_id), now + deadline)
        return lease

    async def start_successor(self, lease: Lease, terminal: WorkflowContinuedAsNew) -> Lease | None:
        """Start the successor of a continued run through the same recorder.

        Behind its own epoch gate (it spawns a run).  A successor already recorded
        appends nothing and returns ``None``; if no live lease drives it here (the
        append that recorded it lost its acknowledgement), it is resumed
        (:meth:`resume_idle`).  Otherwise :meth:`start_run_locked` records and runs it
        (an error is raised: the caller's retry finds the successor if it landed).
        """
        self._epoch.gate(lease.workflow_id, lease.run_id, "start the continue-as-new successor")
        recorder = lease.recorder
        async with recorder.lock:
            history = await recorder.current_history()
            recorded = any(
                isinstance(e.body, WorkflowStarted) and e.body.parent_run_id == lease.run_id for e in history
            )
            if not recorded:
                start = run_segment(history, lease.run_id)[0].body
                assert isinstance(start, WorkflowStarted)
                successor = await self.start_run_locked(
                    recorder,
                    WorkflowStarted(
                        workflow_type=terminal.workflow_type or lease.workflow_type,
                        input=terminal.input,
                        run_id=new_run_id(),
                        parent_run_id=lease.run_id,
                        parent_workflow_id=start.parent_workflow_id,
                        task_queue=start.task_queue,
                        # The values the run ended with: its start's, and its code's upserts.
                        search_attributes=search_attributes(history, lease.run_id),
                        timeout=start.timeout,
                        headers=run_headers(
                            recorder.observers,
                            RunStart(
                                kind="continue_as_new",
                                workflow_id=lease.workflow_id,
                                workflow_type=terminal.workflow_type or lease.workflow_type,
                                headers=start.headers,
                                parent_workflow_id=start.parent_workflow_id,
                                previous_run_id=lease.run_id,
                            ),
                        ),
                    ),
                    now=self._clock.now(),
                    action="start the continue-as-new successor",
                    arm_deadline=False,
                )
        if recorded:
            logger.debug(
                "continue-as-new successor already recorded; nothing appended",
                extra={"workflow_id": lease.workflow_id, "run_id": lease.run_id},
            )
            await self.resume_idle(lease.workflow_id)
            return None
        await self._upsert_visibility(lease.workflow_id)
        return successor


def _stepped_run(frame_locals: dict[str, Any]) -> str | None:
    lease = frame_locals.get("lease")
    if not isinstance(lease, Lease):
        return None
    return f"workflow {lease.workflow_id!r} run {lease.run_id} ({lease.workflow_type}), its workflow code"


# A blocked Trio loop names the run whose code is on its stack (see _watchdog).
register_step(Runner._run_workflow, _stepped_run)


def error_info(exc: BaseException) -> ErrorInfo:
    return ErrorInfo(
        type=type(exc).__qualname__,
        message=str(exc),
        traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
    )
