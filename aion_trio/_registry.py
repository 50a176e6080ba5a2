"""Runs, leases and the registry.

A lease is one incarnation of a run in this engine.  The registry maps
``(workflow_id, run_id)`` to the current lease; a reopen installs a *new*
lease under the same key, and a stale lease is recognised by its lease id.
Every change of a run's lease happens inside the recorder critical section
that appends the event causing it.
"""

from __future__ import annotations

import enum
import itertools
from typing import TYPE_CHECKING, Any, final

import attrs
import trio

from ._events import Event, WorkflowStatus

if TYPE_CHECKING:
    from ._ports import ActiveRun
    from ._recorder import Recorder


class Residency(enum.Enum):
    RESIDENT = "resident"
    #: Terminal: the run's code has ended (the entry is kept until the workflow is released).
    SUSPENDED = "suspended"
    STUCK = "stuck"
    #: Parked on something durable and dropped from memory: only what wakes it stays
    #: (its timers, the inbox, child and activity completions); a wake replays it.
    EVICTED = "evicted"


@final
class CompletionNotifier:
    """Rung once, when a run's terminal is decided (before any bookkeeping)."""

    def __init__(self) -> None:
        self._event = trio.Event()
        self.terminal: Event | None = None

    def notify(self, terminal: Event) -> None:
        if self.terminal is None:
            self.terminal = terminal
        self._event.set()

    @property
    def is_set(self) -> bool:
        return self._event.is_set()

    async def wait(self) -> Event:
        await self._event.wait()
        assert self.terminal is not None
        return self.terminal


_lease_ids = itertools.count(1)


def next_lease_id() -> int:
    return next(_lease_ids)


@final
@attrs.define(eq=False)
class Lease:
    """One incarnation of a run in this engine."""

    workflow_id: str
    run_id: str
    workflow_type: str
    recorder: Recorder
    lease_id: int = attrs.field(factory=next_lease_id)
    completion: CompletionNotifier = attrs.field(factory=CompletionNotifier)
    cached_status: WorkflowStatus = WorkflowStatus.RUNNING
    residency: Residency = Residency.RESIDENT
    #: The head of history when this lease began: events at or below it were
    #: recorded by an earlier incarnation (replay is silent up to here).
    start_head: int = 0
    stuck_reason: str | None = None
    #: The run's Trio task while its workflow code executes.
    task: trio.lowlevel.Task | None = None
    cancel_scope: trio.CancelScope | None = None
    #: The run's code while it executes (queries read it).
    activation: ActiveRun | None = None
    #: Queries waiting for the run to park between steps; while non-zero, the
    #: run's port wakes the recorder's waiters when it parks.
    query_waiters: int = 0
    extra: dict[str, Any] = attrs.field(factory=dict)

    @property
    def key(self) -> tuple[str, str]:
        return (self.workflow_id, self.run_id)


@final
@attrs.frozen
class EvictedRun:
    """What stays of an evicted run: enough to replay it when something wakes it."""

    run_id: str
    workflow_type: str
    #: Left evicted by lazy recovery: this engine has not replayed it yet (its first
    #: replay here is reported as :class:`~aion_trio.RunRecovered`, not ``RunReloaded``).
    recovering: bool = False


@final
class Registry:
    """``(workflow_id, run_id) -> current Lease``, and the evicted runs by workflow id."""

    def __init__(self) -> None:
        self._leases: dict[tuple[str, str], Lease] = {}
        # The same leases by workflow id, then run id.
        self._by_workflow: dict[str, dict[str, Lease]] = {}
        self._evicted: dict[str, EvictedRun] = {}

    def get(self, workflow_id: str, run_id: str) -> Lease | None:
        return self._leases.get((workflow_id, run_id))

    def install(self, lease: Lease) -> Lease | None:
        """Make ``lease`` current for its key; returns the lease it replaced."""
        previous = self._leases.get(lease.key)
        self._leases[lease.key] = lease
        self._by_workflow.setdefault(lease.workflow_id, {})[lease.run_id] = lease
        return previous

    def remove(self, workflow_id: str, run_id: str) -> Lease | None:
        removed = self._leases.pop((workflow_id, run_id), None)
        runs = self._by_workflow.get(workflow_id)
        if runs is not None:
            runs.pop(run_id, None)
            if not runs:
                del self._by_workflow[workflow_id]
        return removed

    def evict(self, workflow_id: str, run: EvictedRun) -> None:
        """Drop every lease of ``workflow_id`` and keep ``run`` in their place (no checkpoint)."""
        for lease in self.leases_of(workflow_id):
            self.remove(workflow_id, lease.run_id)
        self._evicted[workflow_id] = run

    def evicted(self, workflow_id: str) -> EvictedRun | None:
        return self._evicted.get(workflow_id)

    def take_evicted(self, workflow_id: str) -> EvictedRun | None:
        """Forget the evicted entry of ``workflow_id`` (it is being made resident again)."""
        return self._evicted.pop(workflow_id, None)

    def evicted_ids(self) -> list[str]:
        """The workflow ids whose run is evicted (a snapshot)."""
        return list(self._evicted)

    @property
    def evicted_count(self) -> int:
        return len(self._evicted)

    def leases(self) -> list[Lease]:
        return list(self._leases.values())

    def leases_of(self, workflow_id: str) -> list[Lease]:
        """The leases of ``workflow_id``'s runs (no scan of the others)."""
        return list(self._by_workflow.get(workflow_id, {}).values())

    def __len__(self) -> int:
        return len(self._leases)
