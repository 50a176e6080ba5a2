"""Cluster mode: several engines on one store, each workflow owned by one node
(docs/architecture.md, "One writer per history").

The store (a :class:`~aion_trio.plugin.ClusterStore`) fences every append; this
module is the engine's side of it:

* :class:`ClusterServices` runs the waker (one task waiting on the store's
  notifications, bounded by ``EngineConfig.sweep_interval``) and the sweeper
  (claims orphaned workflows and recovers them), and sends commands for
  workflows another node owns through the store's inbox, waiting for their
  outcome.
* The sweeper also watches for this node's lease lapsing (seen invalid, or a
  wake-up far later than the sweep interval: the process was stopped or starved).
  Once the lease is valid again the node rejoins as a fresh node would: every
  workflow it holds, loaded or evicted, is checked against the store and the
  ones another node claimed meanwhile are dropped here before they write or
  start anything (``rejoin``).
* :class:`LeaseGatedDispatcher` holds every activity attempt back while this
  node's lease is not valid: a node that may have been taken for dead starts
  no side effect, and once its lease is renewed it runs a held attempt only if
  it still owns the workflow (else the workflow is relinquished).
"""

from __future__ import annotations

import builtins
import json
import time
from typing import TYPE_CHECKING, Any, final

import attrs
import trio

from . import _errors
from ._activities import ActivityDispatcher, ActivityOutcome, ActivityRequest
from ._commands import Command, CommandOutcome
from ._errors import AionError, CommandNotAnswered, EngineEpochClosed, StoreError, WorkflowFenced
from ._inbox import wall_sleep
from ._logs import ContextLogger
from ._projections import is_active_status, workflow_status
from ._store import ClusterStore, CommandInbox

if TYPE_CHECKING:
    from ._hub import ClusterHub, Settings

logger = ContextLogger("aion_trio.cluster")

#: How often a held-back activity attempt re-checks the lease (wall-clock seconds).
LEASE_RECHECK = 0.05


@final
@attrs.define(eq=False)
class LeaseGatedDispatcher:
    """Wraps a dispatcher: each attempt waits (re-checking) until the node's lease is valid.

    An attempt that had to wait runs only if this node still owns its workflow
    once the lease is renewed (``ClusterStore.command_target`` is ``None``): a
    lease that lapsed may have let another node claim the workflow meanwhile.
    If it does not, the attempt raises :class:`~aion_trio.WorkflowFenced`
    without running, and the dispatch relinquishes the workflow as for a fenced
    append (the new owner's recovery dispatches the activity again).
    """

    inner: ActivityDispatcher
    cluster: ClusterStore
    limiter: trio.CapacityLimiter
    held_back: int = 0
    """Attempts that had to wait for the lease (statistics, tests)."""
    not_owned: int = 0
    """Held-back attempts not run because another node owned the workflow by then."""

    async def dispatch(self, request: ActivityRequest) -> ActivityOutcome:
        if not self.cluster.lease_valid():
            self.held_back += 1
            logger.warning(
                "activity attempt held back: this node's lease is not valid (it dispatches once "
                "renewed, if this node still owns the workflow)",
                extra=self._log(request),
            )
            await self._until_owned(request)
        return await self.inner.dispatch(request)

    def _log(self, request: ActivityRequest) -> dict[str, object]:
        return {
            "workflow_id": request.workflow_id,
            "run_id": request.run_id,
            "activity": request.activity_id,
            "node": self.cluster.node_id,
        }

    async def _until_owned(self, request: ActivityRequest) -> None:
        """Wait for a valid lease, then return if this node owns the workflow; else raise
        ``WorkflowFenced`` (nothing ran).  A failed ownership look-up waits and asks again."""
        while True:
            while not self.cluster.lease_valid():
                await wall_sleep(LEASE_RECHECK, self.limiter)
            try:
                owner = await self.cluster.command_target(request.workflow_id)
            except StoreError as exc:
                logger.warning("looking up a held-back attempt's owner failed (will retry): %s", exc)
                await wall_sleep(LEASE_RECHECK, self.limiter)
                continue
            if owner is None:
                return
            self.not_owned += 1
            raise WorkflowFenced(
                request.workflow_id,
                f"a held-back attempt of activity:{request.activity_id} found the workflow owned by "
                f"{'node ' + repr(owner) if owner else 'no live node'} once this node's lease was renewed; "
                "not run here",
            )


def outcome_error(outcome: CommandOutcome, workflow_id: str) -> BaseException:
    """The exception a refused remote command stands for: the class the owner raised, same message.

    The owner sends the class name and its one-line message; the exception is
    rebuilt as an instance of that class (an aion_trio error, or ``ValueError``
    / ``TypeError`` / ``LookupError`` and their builtin subclasses) carrying the
    message and ``workflow_id``.  An unknown name becomes :class:`AionError`.
    """
    name = outcome.error_type or "AionError"
    cls = getattr(_errors, name, None)  # every public aion_trio error is defined there
    if not (isinstance(cls, type) and issubclass(cls, AionError)):
        builtin = getattr(builtins, name, None)
        cls = (
            builtin
            if isinstance(builtin, type) and issubclass(builtin, (ValueError, TypeError, LookupError))
            else AionError
        )
    exc = cls.__new__(cls)
    Exception.__init__(exc, outcome.message)
    if isinstance(exc, AionError):
        exc.workflow_id = workflow_id  # type: ignore[attr-defined]
    return exc


VISIBILITY_RECONCILE_SWEEPS = 100
"""Every this many sweeps (and after each that claimed workflows), visibility rows that say
Running for workflows this node owns and history says ended are rewritten."""

RECOVERY_CONCURRENCY = 16
"""How many claimed workflows a sweep recovers at once."""

REJOIN_CONCURRENCY = 16
"""How many held workflows a rejoin checks against the store at once."""


def late_wake_after(sweep_interval: float) -> float:
    """How long between two sweeper wake-ups (wall clock) counts as a lapse of its own: the
    process was stopped (``SIGSTOP``, a VM pause) or starved for long enough that its lease
    may have run out and been renewed before the sweeper saw it invalid."""
    return 2 * sweep_interval + 1.0


@final
class ClusterServices:
    """The waker, the sweeper and remote commands of an engine in cluster mode."""

    def __init__(self, core: ClusterHub, cluster: ClusterStore, inbox: CommandInbox | None) -> None:
        self.core = core
        self.cluster = cluster
        self.inbox = inbox
        self.config: Settings = core.config
        self._wake = trio.Event()
        self.sweeps = 0
        self._reconciled_at = 0  # the sweep count at the last visibility reconciliation
        self.claimed = 0
        self.remote_commands = 0
        #: The lease was seen invalid (or a wake-up came late) and no rejoin has run since.
        self._lapsed = False
        self._idle_since: float | None = None  # wall clock when the sweeper last began to wait
        #: Rejoins done, and the workflows they found claimed by another node and dropped.
        self.rejoins = 0
        self.lost_on_rejoin = 0
        #: Set by the engine: drains the inbox (the owner's side of remote commands).
        self.drain: Any = None

    # -- waking --------------------------------------------------------------

    async def waker(self) -> None:
        """Wake the sweeper, the drainer and remote waiters on each notification or every
        ``sweep_interval`` seconds (the store's wait is wall-clock bounded)."""
        interval = self.config.sweep_interval
        while True:
            try:
                await self.cluster.wait_for_work(interval)
            except (StoreError, trio.ClosedResourceError) as exc:
                logger.warning("waiting for cluster notifications failed (polling instead): %s", exc)
                await wall_sleep(interval, self.core.service_threads)
            wake, self._wake = self._wake, trio.Event()
            wake.set()

    async def woken(self) -> None:
        """Park until the waker fires next (a notification, or ``sweep_interval`` passed)."""
        await self._wake.wait()

    async def until_fenced_out(self) -> None:
        """Watch for this node being fenced out of everything (a newer incarnation of its node
        id took over): then close the epoch and raise the store's ``StoreTakenOver`` out of
        ``open_engine``, so the engine stops visibly instead of idling.  Checked on every
        wake-up (no I/O)."""
        while True:
            error = self.cluster.fenced_out()
            if error is not None:
                self.core.epoch.begin_close()
                logger.error(
                    "this node was fenced out of every workflow; the engine stops: %s",
                    error,
                    extra={"node": self.cluster.node_id},
                )
                raise error
            await self.woken()

    # -- the sweeper ------------------------------------------------------------

    async def sweep_once(self) -> list[str]:
        """Claim orphaned workflows (if the lease is valid) and recover each; returns the claimed ids."""
        if not self.cluster.lease_valid() or not self.core.epoch.admitting:
            return []
        claimed = await self.cluster.claim_orphans(self.config.sweep_batch)
        self.sweeps += 1
        if claimed:
            self.claimed += len(claimed)
            logger.info(
                "claimed %d orphaned workflow(s)",
                len(claimed),
                extra={"node": self.cluster.node_id, "claimed": len(claimed)},
            )
        # Recovered side by side (each reads its history and replays): a failover's
        # time is bounded by the batch's slowest replay, not by the sum of them all.
        limiter = trio.CapacityLimiter(RECOVERY_CONCURRENCY)

        async def recover(workflow_id: str) -> None:
            async with limiter:
                await self.core.take_fresh(workflow_id)
                await self.core.recover_one(workflow_id)

        async with trio.open_nursery() as nursery:
            for workflow_id in claimed:
                nursery.start_soon(recover, workflow_id)
        return claimed

    def lapse_seen(self) -> bool:
        """Note the lease's state at a sweeper wake-up (no I/O); ``True`` when a lapse ended:
        the lease is valid now, and since the last rejoin it was seen invalid or a wake-up came
        :func:`late_wake_after` late."""
        late = self._idle_since is not None and time.monotonic() - self._idle_since > late_wake_after(
            self.config.sweep_interval
        )
        if late:
            self._lapsed = True
        if not self.cluster.lease_valid():
            self._lapsed = True
            return False
        return self._lapsed

    async def rejoin(self) -> int:
        """After a lapse, drop every held workflow another node claimed meanwhile; returns how
        many.  Each is looked up with ``command_target`` (a failed look-up raises and the next
        wake-up tries the whole rejoin again); a workflow still owned here stays as it is: its
        writes are fenced by the store anyway, this only stops the ones that are lost before
        they write or start a side effect."""
        held = self.core.held_workflows()
        lost: list[tuple[str, str]] = []
        limiter = trio.CapacityLimiter(REJOIN_CONCURRENCY)

        async def check(workflow_id: str) -> None:
            async with limiter:
                owner = await self.cluster.command_target(workflow_id)
            if owner is not None:
                lost.append((workflow_id, owner))

        async with trio.open_nursery() as nursery:
            for workflow_id in held:
                nursery.start_soon(check, workflow_id)
        for workflow_id, owner in lost:
            self.core.relinquish_lost(
                workflow_id,
                WorkflowFenced(
                    workflow_id,
                    f"this node's lease lapsed and {'node ' + repr(owner) if owner else 'no live node'} "
                    "owns the workflow now; dropped here on rejoining",
                ),
            )
        self._lapsed = False
        self.rejoins += 1
        self.lost_on_rejoin += len(lost)
        logger.info(
            "rejoined after a lease lapse: %d of %d held workflow(s) were claimed by another node and dropped",
            len(lost),
            len(held),
            extra={"node": self.cluster.node_id, "held": len(held), "lost": len(lost)},
        )
        return len(lost)

    def _running_here(self) -> set[str]:
        """The workflows whose runs this node drives now (their rows are its own to write)."""
        running = set()
        for lease in self.core.registry.leases():
            recorder = self.core.loaded_recorder(lease.workflow_id)
            if recorder is not None and is_active_status(workflow_status(recorder.history)):
                running.add(lease.workflow_id)
        return running

    async def sweeper(self) -> None:
        """Sweep on every wake-up; then drain the commands the claimed workflows brought along."""
        while True:
            self._idle_since = time.monotonic()
            await self.woken()
            try:
                if self.lapse_seen():
                    await self.rejoin()
                claimed = await self.sweep_once()
                if claimed or self.sweeps - self._reconciled_at >= VISIBILITY_RECONCILE_SWEEPS:
                    self._reconciled_at = self.sweeps
                    # A claim follows a node that died or was fenced, maybe between a
                    # terminal and its index update: the rows this node owns are rewritten
                    # from history (also now and then, for rows a fenced write left).
                    await self.core.reconcile_visibility(self._running_here())
                if self.drain is not None:
                    await self.drain()
            except (StoreError, trio.ClosedResourceError) as exc:
                logger.warning("orphan sweep failed (will retry): %s", exc)
                continue
            except EngineEpochClosed:
                return
            if claimed and len(claimed) >= self.config.sweep_batch:
                # More may be waiting: go round again without waiting for the next interval.
                wake, self._wake = self._wake, trio.Event()
                wake.set()

    # -- remote commands ------------------------------------------------------

    async def send(self, command: Command) -> CommandOutcome:
        """Enqueue ``command`` for the owning node and wait for its outcome.

        Bounded by ``EngineConfig.remote_command_timeout`` seconds of wall time:
        :class:`CommandNotAnswered` then (the command stays queued and may still
        be applied).
        """
        if self.inbox is None:
            raise AionError(
                f"workflow {command.workflow_id!r} is owned by another node and this store has no "
                "command inbox to reach it"
            )
        command_id = await self.inbox.enqueue_command(command)
        self.remote_commands += 1
        timeout = self.config.remote_command_timeout
        deadline = time.monotonic() + timeout
        while True:
            outcome = await self.inbox.command_outcome(command_id)
            if outcome is not None:
                return outcome
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CommandNotAnswered(command_id, command.describe(), timeout)
            # The waker fires at least every sweep_interval (wall clock): a bounded wait.
            await self.woken()


def query_answer(outcome: CommandOutcome) -> Any:
    """A successful remote query's answer (the owner sends it as JSON text)."""
    return json.loads(outcome.message)
