"""Child workflows: ids, starting them, delivering their outcome, parent-close policy.

Ids.  A child's workflow id is the ``workflow_id`` given to ``ctx.start_child``,
else derived from the command: ``"{parent_workflow_id}/{parent_run_id}/{ordinal}"``
(``ordinal`` is the zero-based per-run child-command ordinal; if that text would
exceed the workflow-id length limit, ``"child:"`` plus the SHA-256 of the three
parts).  The child's *first run id* is derived from the same three parts (a
UUID 5), so the command and the run it started are linked without recording
anything extra: "already started" means the child's history holds a
``WorkflowStarted`` with exactly that run id.  Replay derives the same ids.

What is recorded.  The parent records ``ChildWorkflowStarted`` and, in the
same batch, a ``MarkerRecorded`` named ``child:N`` holding the options the
engine needs later without the parent's code (parent-close policy, task queue,
timeout).  Then the engine starts the child: ``WorkflowStarted`` with
``parent_workflow_id`` set, through the child's recorder, idempotently.  When
the child's chain of runs (it may continue-as-new) reaches its final terminal,
the outcome is recorded in the parent as ``ChildWorkflowCompleted`` /
``ChildWorkflowFailed`` / ``ChildWorkflowCancelled`` through the parent's
recorder, under its lock, with a settle check: nothing is written if the
parent run is terminal or the child is already settled there.

Repairs.  Every step is idempotent, so recovery simply redoes them: for a
running parent it starts recorded children that never started and delivers
outcomes of children that ended while the engine was down; for a running child
whose parent run already ended it applies the parent-close policy.  A step that
fails transiently is retried in the epoch with a doubling backoff capped at
``EngineConfig.completion_retry.ceiling`` until it lands or the epoch closes;
whatever is left then is redone by the next engine's recovery.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, final

import attrs

from ._chain import ChainState, follow_chain
from ._childspec import (
    CHILD_MARKER_PREFIX,
    STATUS_NOT_STARTED,
    STATUS_TIMED_OUT,
    ChildOptions,
    ParentClosePolicy,
    derive_child_run_id,
)
from ._errors import AionInternalError, NotRunning, WorkflowNotFound
from ._events import (
    ChildWorkflowCancelled,
    ChildWorkflowCompleted,
    ChildWorkflowFailed,
    ChildWorkflowStarted,
    ErrorInfo,
    Event,
    EventBody,
    MarkerRecorded,
    WorkflowCancelled,
    WorkflowCompleted,
    WorkflowContinuedAsNew,
    WorkflowFailed,
    WorkflowReset,
    WorkflowStarted,
    WorkflowTimedOut,
)
from ._logs import ContextLogger
from ._observe import RunStart, run_headers
from ._payload import Payload
from ._projections import (
    current_lease_terminal,
    is_active_status,
    latest_run_id,
    run_ids,
    run_segment,
    workflow_status,
)

if TYPE_CHECKING:
    from ._hub import ChildrenHub
    from ._recorder import Recorder

logger = ContextLogger("aion_trio.children")


@final
@attrs.frozen(kw_only=True)
class OpenChild:
    """A child command of a run whose outcome is not recorded in that run."""

    ordinal: int
    started: ChildWorkflowStarted
    options: ChildOptions
    first_run_id: str

    @property
    def workflow_id(self) -> str:
        return self.started.child_workflow_id


_SETTLES = (ChildWorkflowCompleted, ChildWorkflowFailed, ChildWorkflowCancelled)


def open_children(history: Sequence[Event], parent_workflow_id: str, run_id: str) -> list[OpenChild]:
    """The run's child commands not yet settled in its segment, in ordinal order."""
    segment = run_segment(history, run_id)
    if not segment:
        return []
    start = segment[0].body
    assert isinstance(start, WorkflowStarted)
    started: dict[int, ChildWorkflowStarted] = {}
    options: dict[int, Payload] = {}
    open_by_id: dict[str, int] = {}
    for event in segment:
        body = event.body
        if isinstance(body, ChildWorkflowStarted):
            ordinal = len(started)
            started[ordinal] = body
            open_by_id[body.child_workflow_id] = ordinal
        elif isinstance(body, _SETTLES):
            open_by_id.pop(body.child_workflow_id, None)
        elif isinstance(body, MarkerRecorded) and body.name.startswith(CHILD_MARKER_PREFIX):
            suffix = body.name.removeprefix(CHILD_MARKER_PREFIX)
            if suffix.isdigit():
                options[int(suffix)] = body.value
    return [
        OpenChild(
            ordinal=n,
            started=started[n],
            options=ChildOptions.from_payload(options.get(n), start.task_queue),
            first_run_id=derive_child_run_id(parent_workflow_id, run_id, n),
        )
        for n in sorted(open_by_id.values())
    ]


def outcome_body(child_workflow_id: str, terminal: Event) -> EventBody:
    """What a child's final terminal is recorded as in its parent."""
    body = terminal.body
    if isinstance(body, WorkflowCompleted):
        return ChildWorkflowCompleted(child_workflow_id=child_workflow_id, result=body.result)
    if isinstance(body, WorkflowFailed):
        return ChildWorkflowFailed(child_workflow_id=child_workflow_id, error=body.error)
    if isinstance(body, WorkflowTimedOut):
        return ChildWorkflowFailed(
            child_workflow_id=child_workflow_id,
            error=ErrorInfo(
                type="WorkflowTimedOut",
                message=f"child workflow {child_workflow_id!r} timed out ({body.timeout_kind.value})",
                details=Payload.of({"status": STATUS_TIMED_OUT}),
            ),
        )
    if isinstance(body, WorkflowCancelled):
        reason = f"terminated: {body.reason}" if body.terminated else body.reason
        return ChildWorkflowCancelled(child_workflow_id=child_workflow_id, reason=reason)
    raise AssertionError(f"not a final terminal: {terminal!r}")  # pragma: no cover


# -- the steps (each idempotent; store errors propagate to ``guarded``) ------------------


async def settle_in_parent(
    core: ChildrenHub, parent_workflow_id: str, parent_run_id: str, child_workflow_id: str, body: EventBody
) -> bool:
    """Record a child's outcome in the parent run: under the parent's lock, standing down
    (writing nothing) if the parent run is terminal or the child is already settled there."""
    recorder = await core.recorder_for(parent_workflow_id)
    async with recorder.lock:
        core.epoch.gate(parent_workflow_id, parent_run_id, "record a child workflow's outcome")
        history = await recorder.current_history()
        segment = run_segment(history, parent_run_id)
        if not segment or current_lease_terminal(segment) is not None:
            return False
        if not any(
            c.workflow_id == child_workflow_id
            for c in open_children(history, parent_workflow_id, parent_run_id)
        ):
            return False
        await recorder.append(
            [body], action=f"record the outcome of child workflow {child_workflow_id!r}", run_id=parent_run_id
        )
        return True


async def deliver_to_parent(core: ChildrenHub, parent_workflow_id: str, child_workflow_id: str) -> bool:
    """If the child's chain ended, record its outcome in the parent's latest run (settle-checked)."""
    parent = await core.recorder_for(parent_workflow_id)
    run_id = latest_run_id(parent.history)
    if run_id is None:
        return False
    child = next(
        (
            c
            for c in open_children(parent.history, parent_workflow_id, run_id)
            if c.workflow_id == child_workflow_id
        ),
        None,
    )
    if child is None:
        return False
    recorder = await core.recorder_for(child_workflow_id)
    position = follow_chain(recorder.history, child.first_run_id)
    terminal = position.terminal
    if position.state is not ChainState.SETTLED or terminal is None:
        return False
    return await settle_in_parent(
        core, parent_workflow_id, run_id, child_workflow_id, outcome_body(child_workflow_id, terminal)
    )


def _parent_headers(core: ChildrenHub, parent_workflow_id: str, parent_run_id: str) -> Mapping[str, str]:
    """The parent run's headers, which its children inherit (none if its history is not loaded here)."""
    parent = core.loaded_recorder(parent_workflow_id)
    if parent is None:
        return {}
    segment = run_segment(parent.history, parent_run_id)
    start = segment[0].body if segment else None
    return start.headers if isinstance(start, WorkflowStarted) else {}


async def start_child_run(
    core: ChildrenHub, parent_workflow_id: str, parent_run_id: str, child: OpenChild
) -> None:
    """Start the child's first run unless it started already (then append nothing).

    An id held by another active workflow settles the command in the parent as
    ``ChildWorkflowFailed`` (status ``not_started``).
    """
    child_id = child.workflow_id
    run_id = child.first_run_id
    recorder = await core.recorder_for(child_id)
    conflict: str | None = None
    started = False
    async with recorder.lock:
        core.epoch.gate(child_id, run_id, "start a child workflow")
        history = await recorder.current_history()
        if any(isinstance(e.body, WorkflowStarted) and e.body.run_id == run_id for e in history):
            return
        status = workflow_status(history)
        if is_active_status(status):
            assert status is not None
            conflict = (
                f"workflow id {child_id!r} is already used by run {latest_run_id(history)}, which is "
                f"{status.value}; give the child another workflow_id"
            )
        else:
            timeout = timedelta(seconds=child.options.timeout) if child.options.timeout is not None else None
            fields = {"workflow_id": child_id, "run_id": run_id, "parent_workflow_id": parent_workflow_id}

            async def until_answered(attempt: Callable[[], Awaitable[None]]) -> None:
                await core.transient.call("start a child workflow", attempt, logger, fields)

            # Retried here, under the lock, until the store answers: a try whose commit landed
            # with its acknowledgement lost is then found, and this call runs the child it
            # recorded (a later call finding the start recorded could not tell it from a child
            # that something else runs).
            await core.runner.start_run_locked(
                recorder,
                WorkflowStarted(
                    workflow_type=child.started.workflow_type,
                    input=child.started.input,
                    run_id=run_id,
                    parent_workflow_id=parent_workflow_id,
                    task_queue=child.options.task_queue,
                    timeout=timeout,
                    headers=run_headers(
                        core.observers,
                        RunStart(
                            kind="child",
                            workflow_id=child_id,
                            workflow_type=child.started.workflow_type,
                            headers=_parent_headers(core, parent_workflow_id, parent_run_id),
                            parent_workflow_id=parent_workflow_id,
                            parent_run_id=parent_run_id,
                        ),
                    ),
                ),
                now=core.clock.now(),
                action="start a child workflow",
                retry=until_answered,
            )
            started = True
    if conflict is not None:
        await settle_in_parent(
            core,
            parent_workflow_id,
            parent_run_id,
            child_id,
            ChildWorkflowFailed(
                child_workflow_id=child_id,
                error=ErrorInfo(
                    type="WorkflowAlreadyStarted",
                    message=conflict,
                    details=Payload.of({"status": STATUS_NOT_STARTED}),
                ),
            ),
        )
        return
    if started:
        logger.info(
            "child workflow started",
            extra={"workflow_id": child_id, "run_id": run_id, "parent_workflow_id": parent_workflow_id},
        )
        await core.upsert_visibility_quietly(child_id)
    # The parent may have ended while its child was being started: its policy applies now.
    parent = core.loaded_recorder(parent_workflow_id)
    if parent is not None and current_lease_terminal(run_segment(parent.history, parent_run_id)) is not None:
        await close_children(core, parent_workflow_id, parent_run_id)


async def _close_child(core: ChildrenHub, parent_workflow_id: str, child: OpenChild) -> None:
    if core.cluster is not None and not core.drives(child.workflow_id):
        # Cluster mode, a child another node may drive: its history as the store holds it
        # (no local copy loaded for a workflow this node does not own).
        history: Sequence[Event] = await core.events.read_history(child.workflow_id)
    else:
        history = (await core.recorder_for(child.workflow_id)).history
    if follow_chain(history, child.first_run_id).state is not ChainState.RUNNING:
        return
    policy = child.options.parent_close_policy
    reason = f"parent workflow {parent_workflow_id!r} closed (parent_close_policy={policy.value})"
    await _ask_child(core, child, reason, terminate=policy is ParentClosePolicy.TERMINATE)


async def _ask_child(core: ChildrenHub, child: OpenChild, reason: str, *, terminate: bool) -> None:
    # As any client command: in cluster mode it reaches the node owning the child.
    client = core.client_commands
    if client is None:
        raise AionInternalError("no client commands were wired into the engine; please report this")
    try:
        if terminate:
            await client.terminate(child.workflow_id, reason)
        else:
            await client.cancel(child.workflow_id, reason)
    except (NotRunning, WorkflowNotFound):
        pass  # it ended meanwhile


async def cancel_child(core: ChildrenHub, parent_workflow_id: str, child: OpenChild) -> None:
    """The parent's code cancelled the child's handle: ask the child to cancel."""
    await _ask_child(core, child, f"cancelled by its parent workflow {parent_workflow_id!r}", terminate=False)


async def close_children(core: ChildrenHub, parent_workflow_id: str, run_id: str) -> None:
    """Apply the parent-close policy to every open child of an ended parent run."""
    recorder = await core.recorder_for(parent_workflow_id)
    history = recorder.history
    if current_lease_terminal(run_segment(history, run_id)) is None:
        return
    for child in open_children(history, parent_workflow_id, run_id):
        if child.options.parent_close_policy is ParentClosePolicy.ABANDON:
            continue
        await guarded(
            core,
            f"apply the parent-close policy to child workflow {child.workflow_id!r}",
            {"workflow_id": parent_workflow_id, "run_id": run_id},
            _close_child,
            core,
            parent_workflow_id,
            child,
        )


# -- hooks -----------------------------------------------------------------------


async def run_closed(core: ChildrenHub, workflow_id: str, run_id: str) -> None:
    """A run's terminal is durable: apply its children's parent-close policy, and if it is
    a child's final run, deliver its outcome to the parent.  Idempotent; never raises."""
    recorder = core.loaded_recorder(workflow_id)
    if recorder is None:
        return
    state = recorder.run_state(run_id)
    terminal = state.ended
    if terminal is None or state.start is None:
        return
    fields = {"workflow_id": workflow_id, "run_id": run_id}
    if state.children:
        await guarded(
            core, "close the children of an ended run", fields, close_children, core, workflow_id, run_id
        )
    start = state.start.body
    assert isinstance(start, WorkflowStarted)
    # A continued or reset run is not the child's end: the run that replaced it ends it.
    if start.parent_workflow_id is not None and not isinstance(
        terminal.body, (WorkflowContinuedAsNew, WorkflowReset)
    ):
        await guarded(
            core,
            "deliver a child workflow's outcome to its parent",
            fields,
            deliver_to_parent,
            core,
            start.parent_workflow_id,
            workflow_id,
        )


async def repair_children(core: ChildrenHub, recorder: Recorder, run_id: str) -> None:
    """Recovery (and reopen) of a running parent run: start recorded children that never
    started, deliver outcomes of children that ended meanwhile.  Never raises."""
    workflow_id = recorder.workflow_id
    if not recorder.run_state(run_id).open_children:
        return  # the run's index: no child left open (most runs start none)
    for child in open_children(recorder.history, workflow_id, run_id):
        fields = {"workflow_id": workflow_id, "run_id": run_id, "child_workflow_id": child.workflow_id}
        await guarded(
            core, "start a child workflow", fields, start_child_run, core, workflow_id, run_id, child
        )
        await guarded(
            core,
            "deliver a child workflow's outcome",
            fields,
            deliver_to_parent,
            core,
            workflow_id,
            child.workflow_id,
        )


async def close_if_orphaned(core: ChildrenHub, recorder: Recorder, run_id: str) -> None:
    """Recovery of a running child: if the parent run that started it has ended (the engine
    stopped before applying the policy), apply the parent-close policy now.  Never raises."""
    history = recorder.history
    started = recorder.run_state(run_id).start  # the run's index: no walk of its history
    if started is None:
        return
    start = started.body
    assert isinstance(start, WorkflowStarted)
    parent_workflow_id = start.parent_workflow_id
    if parent_workflow_id is None:
        return
    root = run_id
    for _ in range(len(history)):
        first = run_segment(history, root)[0].body
        assert isinstance(first, WorkflowStarted)
        if first.parent_run_id is None:
            break
        root = first.parent_run_id
    await guarded(
        core,
        "apply the close policy of a child's parent",
        {"workflow_id": parent_workflow_id, "child_workflow_id": recorder.workflow_id},
        _close_if_parent_ended,
        core,
        parent_workflow_id,
        recorder.workflow_id,
        root,
    )


async def _close_if_parent_ended(
    core: ChildrenHub, parent_workflow_id: str, child_workflow_id: str, root: str
) -> None:
    """Idempotent: the parent's history (loaded here, so a read fault is retried) says
    whether the child is still open under an ended run."""
    parent = await core.recorder_for(parent_workflow_id)
    for parent_run in run_ids(parent.history):
        for child in open_children(parent.history, parent_workflow_id, parent_run):
            if child.workflow_id == child_workflow_id and child.first_run_id == root:
                await close_children(core, parent_workflow_id, parent_run)
                return


# -- retrying transient failures in the epoch ---------------------------------------


async def guarded(
    core: ChildrenHub,
    what: str,
    fields: Mapping[str, Any],
    fn: Callable[..., Awaitable[Any]],
    *args: Any,
) -> None:
    """One attempt of an idempotent child step.  A transient failure retries it in the
    epoch (backoff doubling up to the completion-retry ceiling, until it lands or the
    epoch closes); anything else is logged and left to the next engine's recovery."""

    async def attempt() -> None:
        await fn(*args)

    await core.transient.now_or_in_background(what, attempt, logger, fields)
