"""Following a continue-as-new chain: from one run, through each ``WorkflowContinuedAsNew``
successor, to the run where the chain stands now.

One rule, read from one history snapshot; waiting for the history to grow is the caller's
(the client waits on its recorder or the cluster waker, the CLI polls the store, children
look once).  A run's successor is the run whose ``WorkflowStarted`` names it as
``parent_run_id``; until that start is recorded the chain is :attr:`ChainState.SUCCESSOR_OWED`.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import final

import attrs

from ._errors import AionInternalError, WorkflowFailure
from ._events import (
    Event,
    WorkflowCompleted,
    WorkflowContinuedAsNew,
    WorkflowFailed,
    WorkflowReset,
    WorkflowStarted,
    WorkflowStatus,
)
from ._payload import Payload
from ._projections import current_lease_terminal, run_segment, status_after


class ChainState(enum.Enum):
    """Where a chain stands in one history snapshot."""

    #: The run the chain was followed from is not in the history (not recorded, or not yet seen).
    NOT_STARTED = "not_started"
    #: A run of the chain runs (its current lease has no terminal).
    RUNNING = "running"
    #: A run of the chain continued as new and its successor's start is not recorded yet.
    SUCCESSOR_OWED = "successor_owed"
    #: The chain's last run ended with a terminal that does not continue it (or any
    #: terminal, when not following continue-as-new).
    SETTLED = "settled"


@final
@attrs.frozen(kw_only=True)
class ChainPosition:
    """The run a chain was followed to, and how it stands."""

    state: ChainState
    #: The run the follower stopped at: the running run, the settled run, the run whose
    #: successor is owed, or (``NOT_STARTED``) the run it was asked to follow from.
    run_id: str
    #: That run's terminal (``SETTLED`` and ``SUCCESSOR_OWED``), else ``None``.
    terminal: Event | None = None
    #: That run's status (``None`` when ``NOT_STARTED``).
    status: WorkflowStatus | None = None


def successor_run_id(history: Sequence[Event], run_id: str) -> str | None:
    """The run that continues ``run_id`` (its ``WorkflowStarted`` names it), or ``None``."""
    for event in history:
        body = event.body
        if isinstance(body, WorkflowStarted) and body.parent_run_id == run_id:
            return body.run_id
    return None


def follow_chain(
    history: Sequence[Event], run_id: str, *, follow_continue_as_new: bool = True
) -> ChainPosition:
    """Follow ``run_id`` through continue-as-new successors to where its chain stands in ``history``.

    A run ended by a reset (``WorkflowReset``) is followed to the run that replaced it
    (recorded in the same append), as a continued run is to its successor.
    With ``follow_continue_as_new=False`` the run itself is the chain: a
    ``WorkflowContinuedAsNew`` or ``WorkflowReset`` terminal settles it.  A run reopened
    after its terminal runs again (a reopen supersedes the terminal of its run).
    """
    current = run_id
    # Each step moves to a later run of the history; a chain has at most as many runs as events.
    for _ in range(len(history) + 1):
        segment = run_segment(history, current)
        if not segment:
            return ChainPosition(state=ChainState.NOT_STARTED, run_id=current)
        status = status_after(None, segment)
        terminal = current_lease_terminal(segment)
        if terminal is None:
            return ChainPosition(state=ChainState.RUNNING, run_id=current, status=status)
        if follow_continue_as_new and isinstance(terminal.body, WorkflowReset):
            current = terminal.body.new_run_id
            continue
        if not follow_continue_as_new or not isinstance(terminal.body, WorkflowContinuedAsNew):
            return ChainPosition(state=ChainState.SETTLED, run_id=current, terminal=terminal, status=status)
        successor = successor_run_id(history, current)
        if successor is None:
            return ChainPosition(
                state=ChainState.SUCCESSOR_OWED, run_id=current, terminal=terminal, status=status
            )
        current = successor
    raise AionInternalError(  # pragma: no cover - every successor starts after the run it continues
        f"the continue-as-new chain from run {run_id} does not end within its history"
    )


def settled_result(workflow_id: str, position: ChainPosition) -> Payload:
    """A settled chain's result; :class:`WorkflowFailure` if its last run ended without one."""
    terminal = position.terminal
    if position.state is not ChainState.SETTLED or terminal is None:
        raise AionInternalError(f"the chain of workflow {workflow_id!r} is not settled: {position!r}")
    body = terminal.body
    if isinstance(body, WorkflowCompleted):
        return body.result
    if isinstance(body, WorkflowFailed):
        raise WorkflowFailure(workflow_id, position.run_id, "failed", error=body.error)
    status = position.status
    raise WorkflowFailure(
        workflow_id, position.run_id, status.value if status else "closed", reason=getattr(body, "reason", "")
    )
