"""Recovery: resuming every active workflow from its history when an engine opens.

:class:`Recovery` runs the startup sweep: it lists the workflows to resume
(a transient fault is retried through the engine's one retry primitive until
the store answers), counts them for the poison-run guard, and recovers each
one (replay its run, re-dispatch unsettled activities, arm its timers, start
recorded children and successors that never started), then finishes
interrupted deadline teardowns and reconciles visibility.  One workflow's
failure is logged and marks it stuck; it does not stop the others.  What it
needs of the rest of the engine it is given.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, final

import attrs
import trio

from .. import _children as children
from .._activities import ActivityRequest
from .._codec_store import BulkRead
from .._definitions import WorkflowDefinition
from .._epoch import EngineEpoch
from .._errors import BackendUnavailable, EngineEpochClosed, NotOwner
from .._events import (
    ChildWorkflowStarted,
    Event,
    MarkerRecorded,
    TimerStarted,
    WorkflowContinuedAsNew,
    WorkflowStarted,
    WorkflowStatus,
)
from .._hub import ChildrenHub, RecoveryHub
from .._ids import EVENT_READ_MARKER_PREFIX, EVENT_READ_RESULT_MARKER_PREFIX, deadline_timer_id
from .._observe import ObserverHub, RecoveryFinished, RunRecovered
from .._poison import RecoveryGuard, poison_reason
from .._projections import latest_run, outstanding_timers, unsettled_activities
from .._recorder import Recorder
from .._registry import EvictedRun, Lease, Registry, Residency
from .._store import ClusterStore, EventStore, VisibilityRow
from .._transient import Transient
from .config import EngineConfig
from .dispatch import ActivityDispatch
from .log import logger
from .recorders import Recorders
from .runner import Runner
from .teardown import RunTeardown
from .timers import Timers
from .visibility import VisibilityRows


@final
class Recovery:
    """The startup sweep and the recovery of one workflow."""

    def __init__(
        self,
        *,
        events: EventStore,
        read_histories: BulkRead | None,
        cluster: ClusterStore | None,
        epoch: EngineEpoch,
        config: EngineConfig,
        observers: ObserverHub | None,
        transient: Transient,
        workflows: Mapping[str, WorkflowDefinition[Any]],
        stuck: dict[str, str],
        registry: Registry,
        recorders: Recorders,
        runner: Runner,
        timers: Timers,
        activity_dispatch: ActivityDispatch,
        visibility_rows: VisibilityRows,
        teardown: RunTeardown,
        hub: RecoveryHub,
        children_hub: ChildrenHub,
    ) -> None:
        self._events = events
        #: Reads many histories in one call (the store's ``BulkHistoryReads``, through the
        #: codec chain if any; ``None``: one read per workflow).
        self._read_histories = read_histories
        self._cluster = cluster
        self._epoch = epoch
        self._config = config
        self._observers = observers
        self._transient = transient
        self._workflows = workflows
        self._stuck = stuck
        self._registry = registry
        self._recorders = recorders
        self._runner = runner
        self._timers = timers
        self._dispatch = activity_dispatch
        self._visibility = visibility_rows
        self._teardown = teardown
        self._hub = hub
        self._children_hub = children_hub
        #: The startup sweep's poison-run bookkeeping (``None``: the store cannot count).
        self.guard: RecoveryGuard | None = None

    def held(self, recorder: Recorder, request: ActivityRequest, resume: bool) -> bool:
        """Whether the poison-run guard holds this dispatch back (the dispatch service's hook)."""
        return self.guard is not None and self.guard.hold(recorder, request, resume)

    async def recover(self) -> None:
        """The startup sweep: resume every active workflow; one failure does not stop the others.

        Cluster mode: the active workflows this node owns (re-claimed) and the
        orphans it can claim now, not every active workflow of the store.

        The histories are read before the sweep goes through them: in batches from a store
        with :class:`~aion_trio.BulkHistoryReads`, else ``EngineConfig.recovery_concurrency``
        at a time.  Lazy: a run parked on a timer with nothing else
        outstanding is left evicted (its timers armed, not replayed) until something
        wakes it; the rest are replayed in the background.  A visibility row is
        written only where it differs from the stored one.
        """
        began = trio.current_time()
        active = await self._list_recoverable()
        guard = self.guard = RecoveryGuard.for_core(self._hub)
        if guard is not None:
            await guard.count(active)
        running = await self._visibility.running_rows()
        sweep = _Sweep(running if running is not None else None)
        if self._cluster is None:
            await self._prefetch(active, sweep)
        resumed = 0
        try:
            for workflow_id in active:
                if await self.recover_one(workflow_id, sweep=sweep):
                    resumed += 1
        finally:
            sweep.done = True
            if guard is not None:
                await guard.release()
        if sweep.queued:
            try:
                self._epoch.spawn(self._resume_queued, sweep.queued, name="recovery-resume")
            except EngineEpochClosed:
                pass  # closing already: the next engine recovers them
        if active:
            logger.info(
                "recovery resumed %d of %d active workflows (%d left evicted until woken, %d replayed "
                "in the background)",
                resumed,
                len(active),
                sweep.evicted,
                len(sweep.queued),
                extra={
                    "active": len(active),
                    "resumed": resumed,
                    "evicted": sweep.evicted,
                    "background": len(sweep.queued),
                },
            )
        await self._teardown.resume(set(active))
        await self._visibility.reconcile(set(active), running)
        if self._observers is not None:
            self._observers.emit(
                RecoveryFinished(active=len(active), resumed=resumed, seconds=trio.current_time() - began)
            )

    async def _resume_queued(self, queued: list[str]) -> None:
        """Lazy recovery: make the runs the sweep left for later resident (the wake path:
        ``recorder_for`` replays an evicted run), ``recovery_concurrency`` replays at a time,
        each until it parks or ends.  A wake that comes first replays a run sooner."""
        limiter = trio.CapacityLimiter(self._config.recovery_concurrency)
        guard = self.guard

        async def resume(workflow_id: str) -> None:
            async with limiter:
                try:
                    await self._recorders.recorder_for(workflow_id)
                except Exception as exc:
                    logger.error(
                        "could not resume workflow: %s: %s",
                        type(exc).__name__,
                        exc,
                        extra={"workflow_id": workflow_id},
                    )
                    return
                for lease in self._registry.leases_of(workflow_id):
                    await _until_parked(lease)
                    if guard is not None:
                        try:
                            self._epoch.spawn(guard.settle, lease, name=f"recovery-settle:{workflow_id}")
                        except EngineEpochClosed:
                            return  # closing: the count stays for the next engine

        async with trio.open_nursery() as nursery:
            for workflow_id in queued:
                nursery.start_soon(resume, workflow_id)

    async def _prefetch(self, active: list[str], sweep: _Sweep) -> None:
        """Load the histories of ``active``: ``_HISTORY_BATCH`` per call from a store with
        :class:`~aion_trio.BulkHistoryReads`, else ``recovery_concurrency`` reads at a time.
        A transient fault is left for the sweep to retry; any other is kept for it to report
        (a batch that failed otherwise is read again one workflow at a time, so the fault
        is pinned on the workflow that has it)."""
        read_histories = self._read_histories
        if read_histories is None:
            await self._prefetch_each(active, sweep)
            return
        for start in range(0, len(active), _HISTORY_BATCH):
            batch = active[start : start + _HISTORY_BATCH]
            try:
                await self._recorders.load_many(batch, read_histories)
            except BackendUnavailable:
                continue
            except Exception:
                await self._prefetch_each(batch, sweep)

    async def _prefetch_each(self, active: list[str], sweep: _Sweep) -> None:
        """Load the histories of ``active`` one workflow per read, ``recovery_concurrency``
        at a time."""
        limiter = trio.CapacityLimiter(self._config.recovery_concurrency)

        async def load(workflow_id: str) -> None:
            async with limiter:
                try:
                    await self._recorders.recorder_for(workflow_id)
                except BackendUnavailable:
                    return
                except Exception as exc:
                    sweep.failed[workflow_id] = exc

        async with trio.open_nursery() as nursery:
            for workflow_id in active:
                nursery.start_soon(load, workflow_id)

    async def _list_recoverable(self) -> list[str]:
        """The workflows the sweep resumes.  A transient read fault is retried (the
        engine's one retry, loud) until the store answers: recovery needs the list."""
        cluster = self._cluster

        async def listing() -> list[str]:
            if cluster is None:
                return await self._events.list_active()
            active = await cluster.owned_active()
            return active + await cluster.claim_orphans(self._config.sweep_batch)

        return await self._transient.call("list the active workflows for recovery", listing, logger)

    async def recover_one(self, workflow_id: str, *, sweep: _Sweep | None = None) -> bool:
        """Recover one workflow; returns whether it was resumed now.

        A transient fault loading its history (nothing has been done for it yet) is
        retried in the epoch with backoff until it loads or the epoch closes, while
        the sweep goes on; any other failure is logged and marks it stuck.
        """
        resumed: list[bool] = []
        await children.guarded(
            self._children_hub,
            "load a workflow's history for recovery",
            {"workflow_id": workflow_id},
            self._recover_loaded,
            workflow_id,
            resumed,
            sweep,
        )
        return bool(resumed)

    async def _recover_loaded(self, workflow_id: str, resumed: list[bool], sweep: _Sweep | None) -> None:
        """Raises only ``BackendUnavailable``, and only before anything was done."""
        failed = sweep.failed.pop(workflow_id, None) if sweep is not None else None
        if failed is not None:
            self._recovery_failed(workflow_id, failed)
            return
        try:
            recorder = await self._recorders.recorder_for(workflow_id)
        except BackendUnavailable:
            raise
        except Exception as exc:
            self._recovery_failed(workflow_id, exc)
            return
        try:
            await self.recover_workflow(recorder, sweep=sweep)
        except Exception as exc:
            self._recovery_failed(workflow_id, exc)
            return
        resumed.append(True)

    async def revive(self, recorder: Recorder, run: EvictedRun) -> None:
        """Make an evicted run resident again (the residency service's wake path)."""
        await self.recover_workflow(recorder, revive=run)

    def _recovery_failed(self, workflow_id: str, exc: Exception) -> None:
        if isinstance(exc, NotOwner):
            return  # claimed by another node meanwhile: relinquished (logged there)
        reason = f"recovery failed: {type(exc).__name__}: {exc}"
        self._stuck[workflow_id] = reason
        logger.error("could not recover workflow: %s", reason, extra={"workflow_id": workflow_id})

    async def recover_workflow(
        self, recorder: Recorder, *, sweep: _Sweep | None = None, revive: EvictedRun | None = None
    ) -> None:
        """Resume one loaded workflow from its history alone.

        ``sweep``: the startup sweep's (a quiet run stays evicted; the row is written only
        if it changed).  ``revive``: the evicted run a wake makes resident again; nothing of
        it is outstanding but its timers (still armed) and what woke it, so it is only
        replayed (its lease installed, its task spawned)."""
        workflow_id = recorder.workflow_id
        history = recorder.history
        latest = latest_run(history)  # one pass over a long history for all of these
        if latest is None:
            return
        run_id, status, segment = latest.run_id, latest.status, latest.segment
        start = segment[0].body
        assert isinstance(start, WorkflowStarted)
        runner = self._runner
        if status is WorkflowStatus.RUNNING:
            current = self._registry.get(workflow_id, run_id)
            if (
                current is not None
                and current.residency is Residency.RESIDENT
                and not current.completion.is_set
            ):
                return  # already running here (made resident by a wake meanwhile)
            lease = runner.new_lease(recorder, run_id, start.workflow_type)
            registered = start.workflow_type in self._workflows
            if revive is not None and revive.run_id == run_id and registered:
                runner.spawn_run(lease)
                return
            guard = self.guard
            unfinished = guard.poisoned(lease) if guard is not None else None
            if unfinished is not None:
                await runner.mark_stuck(lease, poison_reason(unfinished))
                return
            if sweep is not None and not sweep.done and registered and self._config.lazy_recovery:
                quiet = _quiet(history, segment, workflow_id, run_id)
                if quiet or _only_waits(segment, run_id):
                    # Left evicted, its timers armed as an evicted run's are (they stay armed
                    # through its reload: a signal it has yet to consume does not make a
                    # pending timer moot).
                    self._timers.schedule_indexed(
                        (timer.fire_at, workflow_id, run_id, timer.timer_id)
                        for timer in outstanding_timers(segment, latest.kinds)
                    )
                    self._registry.evict(
                        workflow_id, EvictedRun(run_id, start.workflow_type, recovering=True)
                    )
                    if quiet:
                        # Parked on a timer with nothing else outstanding: not replayed.
                        self._recorders.drop(workflow_id)
                        sweep.evicted += 1
                        if guard is not None:
                            guard.quiet.append(workflow_id)
                    else:
                        # Maybe parked, maybe with a signal or a cancel to consume: replayed
                        # in the background after the sweep (its history stays loaded), or
                        # sooner if woken.
                        sweep.queued.append(workflow_id)
                        if guard is not None:
                            guard.defer(workflow_id)  # its replay may run activities: counted until then
                    await self._visibility.upsert_if_changed(workflow_id, history, sweep.known(workflow_id))
                    return
            if guard is not None:
                guard.watch(lease)
            if not registered:
                await runner.mark_stuck(
                    lease,
                    f"workflow type {start.workflow_type!r} is not registered with this engine; register it "
                    "and restart, or terminate the run",
                )
                return
            runner.spawn_run(lease)
            if self._observers is not None:
                self._observers.emit(
                    RunRecovered(
                        workflow_id=workflow_id,
                        run_id=run_id,
                        workflow_type=start.workflow_type,
                        headers=start.headers,
                    )
                )
            await self._dispatch.redispatch_unsettled(recorder, run_id)
            for timer in outstanding_timers(segment, latest.kinds):
                await self._timers.arm(workflow_id, run_id, timer.timer_id, timer.fire_at)
            await children.repair_children(self._children_hub, recorder, run_id)
            await children.close_if_orphaned(self._children_hub, recorder, run_id)
        elif status is WorkflowStatus.CONTINUED_AS_NEW:
            terminal = latest.terminal
            if terminal is not None and isinstance(terminal.body, WorkflowContinuedAsNew):
                lease = runner.new_lease(recorder, run_id, start.workflow_type)
                lease.residency = Residency.SUSPENDED
                lease.cached_status = WorkflowStatus.CONTINUED_AS_NEW
                await runner.start_successor(lease, terminal.body)
        if sweep is not None:
            await self._visibility.upsert_if_changed(workflow_id, recorder.history, sweep.known(workflow_id))
        else:
            await self._visibility.upsert_quietly(workflow_id)


@attrs.define(eq=False)
class _Sweep:
    """One startup sweep's state: the visibility rows read at its start, how many it left evicted."""

    rows: Mapping[str, VisibilityRow] | None
    evicted: int = 0
    #: Histories whose load failed (not transiently) while prefetching, by workflow id.
    failed: dict[str, Exception] = attrs.Factory(dict)
    #: Lazy recovery: runs left evicted for the background to replay after the sweep.
    queued: list[str] = attrs.Factory(list)
    #: The sweep went through every workflow: a load retried after it (a transient fault)
    #: recovers its run eagerly (the background replay of ``queued`` has begun).
    done: bool = False

    def known(self, workflow_id: str) -> VisibilityRow | None:
        """The stored row (``None``: none, or the rows could not be read: write it)."""
        return self.rows.get(workflow_id) if self.rows is not None else None


#: Workflows per bulk history read at recovery (a store with ``BulkHistoryReads``).
_HISTORY_BATCH = 500


#: How long (Trio seconds) a background resume waits for one replay to park before it
#: goes on with the next (a replay normally takes milliseconds).
_REPLAY_WAIT = 10.0


async def _until_parked(lease: Lease) -> None:
    """Wait until the run's code parks between steps, ends, is stuck or evicted (bounded)."""
    lease.query_waiters += 1  # the run's port then wakes the recorder's waiters when it parks
    try:
        with trio.move_on_after(_REPLAY_WAIT):
            while lease.residency is Residency.RESIDENT and not lease.completion.is_set:
                activation = lease.activation
                if activation is not None and activation.answerable:
                    return
                await lease.recorder.wait_changed()
    finally:
        lease.query_waiters -= 1


def _only_waits(segment: Sequence[Event], run_id: str) -> bool:
    """Whether nothing of a running run needs the engine but its own code: no unsettled
    activity, no open child, not a child (whose parent may have ended)."""
    start = segment[0].body
    assert isinstance(start, WorkflowStarted)
    return (
        start.parent_workflow_id is None
        and not unsettled_activities(segment)
        and not any(isinstance(e.body, ChildWorkflowStarted) for e in segment)
    )


def _quiet(history: Sequence[Event], segment: Sequence[Event], workflow_id: str, run_id: str) -> bool:
    """Whether a running run can stay evicted at recovery: its last step was to start a timer
    (not its deadline) and park, and nothing else of it is outstanding (no unsettled activity,
    no open child, not a child itself, no ``ctx.get_event`` read waiting: its watch of the
    other workflow lives in the run's code, so the run is replayed to watch again)."""
    start = segment[0].body
    assert isinstance(start, WorkflowStarted)
    last = segment[-1].body
    return (
        isinstance(last, TimerStarted)
        and last.timer_id != deadline_timer_id(run_id)
        and start.parent_workflow_id is None
        and not unsettled_activities(segment)
        and not children.open_children(history, workflow_id, run_id)
        and not _event_read_waiting(segment)
    )


def _event_read_waiting(segment: Sequence[Event]) -> bool:
    """Whether the run recorded a ``ctx.get_event`` read (``get-event:N``) with no answer yet
    (no ``get-event-result:N``; its timeout's timer may still be pending)."""
    reads: set[str] = set()
    answered: set[str] = set()
    for event in segment:
        body = event.body
        if isinstance(body, MarkerRecorded):
            if body.name.startswith(EVENT_READ_MARKER_PREFIX):
                reads.add(body.name[len(EVENT_READ_MARKER_PREFIX) :])
            elif body.name.startswith(EVENT_READ_RESULT_MARKER_PREFIX):
                answered.add(body.name[len(EVENT_READ_RESULT_MARKER_PREFIX) :])
    return bool(reads - answered)
