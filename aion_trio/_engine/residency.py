"""Residency: which runs this engine keeps in memory, and making an evicted run resident again.

A run parked on something durable (a timer, a signal, a child, a cancel) and
idle past ``EngineConfig.evict_after`` seconds, or the oldest parked runs once
more than ``EngineConfig.max_resident_runs`` runs execute here, is *evicted*:
its task is cancelled (a cancelled run records nothing), its lease and its
workflow's recorder leave memory, and only a small entry stays in the
registry.  What wakes it is kept where it always is: its timers in the timer
service's heap, the command inbox, child and activity completions.  Each of
those reaches the workflow through ``Recorders.recorder_for``, which calls
:meth:`ResidencyService.ensure_resident` first: the recorder is re-created
from the store and the run replayed by the recovery path (``revive``), then
the wake appends through that recorder and the replayed run consumes it, so a
wake is still recorded before it is observed.

A closed workflow (its terminal durable and its bookkeeping done) is
*released* ``EngineConfig.release_closed_after`` seconds later: its leases and
recorder go; handles and ``result()`` read the store.

The service keeps two FIFOs (runs by the moment they parked, closed workflows
by the moment they closed): each has one constant delay, so the head is always
the next one due, and the service sleeps until then.  Times are Trio's clock,
so ``MockClock`` drives eviction like every other wait of the engine.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping
from typing import final

import trio

from .._epoch import EngineEpoch
from .._events import WorkflowStarted
from .._guard import unguarded
from .._observe import ObserverHub, RunEvicted, RunRecovered, RunReloaded
from .._projections import is_active, run_segment
from .._recorder import Recorder
from .._registry import EvictedRun, Lease, Registry, Residency
from .config import EngineConfig
from .dispatch import InflightAttempts
from .log import logger
from .recorders import Recorders

#: Trio's clock without the determinism guard's check: these reads are the engine's,
#: made in tasks that inherit a workflow task's context.
_trio_time = unguarded(trio.current_time)


@final
class ResidencyService:
    """Evicts idle parked runs and releases closed workflows; makes an evicted run resident again.

    ``revive(recorder, run)`` replays an evicted run from its history (the
    recovery path); ``inflight`` is the dispatch service's running attempts by
    ``(workflow_id, run_id, activity_id)``; ``holds_run(workflow_id)`` whether one of them
    keeps the run resident (all but those awaiting a remote worker's outcome); ``watching`` the event watches
    (``ctx.get_event``) in flight by reading workflow; ``live_runs()`` how many
    runs' code executes here now.
    """

    def __init__(
        self,
        *,
        config: EngineConfig,
        epoch: EngineEpoch,
        registry: Registry,
        recorders: Recorders,
        inflight: InflightAttempts,
        holds_run: Callable[[str], bool],
        watching: Mapping[str, int],
        live_runs: Callable[[], int],
        revive: Callable[[Recorder, EvictedRun], Awaitable[None]],
        observers: ObserverHub | None,
    ) -> None:
        self._evict_after = config.evict_after
        self._max_resident = config.max_resident_runs
        self._release_after = config.release_closed_after
        self._epoch = epoch
        self._registry = registry
        self._recorders = recorders
        self._inflight = inflight
        self._holds_run = holds_run
        self._watching = watching
        self._live_runs = live_runs
        self._revive = revive
        self._observers = observers
        #: Parked runs by the Trio time they parked at, oldest first.
        self._parked: dict[tuple[str, str], tuple[float, Lease]] = {}
        #: Closed workflows by the Trio time their bookkeeping ended, oldest first.
        self._closed: dict[str, float] = {}
        self._changed = trio.Event()
        #: Evicted runs whose task is still unwinding (not counted against the cap).
        self._unwinding: set[tuple[str, str]] = set()
        #: Workflows being made resident now: the event set when done, and the task doing it.
        self._reviving: dict[str, tuple[trio.Event, trio.lowlevel.Task]] = {}
        #: Runs evicted, runs made resident again, closed workflows released (since open).
        self.evictions = 0
        self.reloads = 0
        self.released = 0

    # -- notes from the rest of the engine -------------------------------------------

    def parked(self, lease: Lease) -> None:
        """The run's code parked between steps, caught up with history (no checkpoint)."""
        if self._evict_after is None and self._max_resident is None:
            return
        key = lease.key
        self._parked.pop(key, None)
        self._parked[key] = (_trio_time(), lease)
        if len(self._parked) == 1 or (
            self._max_resident is not None and self._resident() > self._max_resident
        ):
            self._changed.set()

    def _resident(self) -> int:
        return self._live_runs() - len(self._unwinding)

    def left(self, lease: Lease) -> None:
        """The run's code stopped executing here (no checkpoint)."""
        self._parked.pop(lease.key, None)
        self._unwinding.discard(lease.key)

    def closed(self, workflow_id: str) -> None:
        """The workflow's terminal is durable and its bookkeeping done (no checkpoint)."""
        if self._release_after is None:
            return
        self._closed.pop(workflow_id, None)
        self._closed[workflow_id] = _trio_time()
        if len(self._closed) == 1:
            self._changed.set()

    # -- the service -------------------------------------------------------------------

    async def serve(self) -> None:
        """Evict what is due (idle, or over the cap) and release closed workflows, forever."""
        while True:
            self._changed = trio.Event()
            now = _trio_time()
            self._evict_over_cap()
            wake = min(self._evict_idle(now), self._release_closed(now))
            with trio.move_on_at(wake):
                await self._changed.wait()

    def _evict_over_cap(self) -> None:
        cap = self._max_resident
        if cap is None:
            return
        excess = self._resident() - cap
        while excess > 0 and self._parked:
            key = next(iter(self._parked))
            _, lease = self._parked.pop(key)
            if self._evictable(lease):
                self._evict(lease, "capacity")
                excess -= 1

    def _evict_idle(self, now: float) -> float:
        """Evict the runs idle past the threshold; returns when the next one is due."""
        after = self._evict_after
        if after is None:
            return math.inf
        later: list[Lease] = []
        due = math.inf
        while self._parked:
            key = next(iter(self._parked))
            since, lease = self._parked[key]
            if since + after > now:
                due = since + after
                break
            del self._parked[key]
            if self._evictable(lease):
                self._evict(lease, "idle")
            elif lease.task is not None and lease.activation is not None and lease.activation.answerable:
                later.append(lease)  # still parked, busy now (a query, an attempt): look again later
        for lease in later:
            self._parked[lease.key] = (now, lease)
        if later:
            due = min(due, now + after)
        return due

    def _release_closed(self, now: float) -> float:
        after = self._release_after
        if after is None:
            return math.inf
        retry: list[str] = []
        due = math.inf
        while self._closed:
            workflow_id = next(iter(self._closed))
            since = self._closed[workflow_id]
            if since + after > now:
                due = since + after
                break
            del self._closed[workflow_id]
            if self._release(workflow_id) is None:
                retry.append(workflow_id)
        for workflow_id in retry:  # busy now: look again one delay later
            self._closed[workflow_id] = now
        if retry and due is math.inf:
            due = now + after
        return due

    # -- evicting ---------------------------------------------------------------------

    def _evictable(self, lease: Lease) -> bool:
        """Whether the run waits only on something durable, with nothing of it in flight here."""
        workflow_id = lease.workflow_id
        activation = lease.activation
        recorder = lease.recorder
        if (
            not self._epoch.admitting
            or lease.residency is not Residency.RESIDENT
            or lease.task is None
            or lease.query_waiters
            or lease.completion.is_set
            or activation is None
            or not activation.answerable
            or self._registry.get(workflow_id, lease.run_id) is not lease
            or self._recorders.loaded_recorder(workflow_id) is not recorder
            or recorder.busy
            or recorder.deferred
            or workflow_id in self._reviving
        ):
            return False
        if any(
            other is not lease and other.task is not None for other in self._registry.leases_of(workflow_id)
        ):
            return False
        if self._watching.get(workflow_id):
            return False
        # An attempt awaiting a remote worker's outcome does not hold the run: the outcome
        # is recorded through the workflow's current recorder, which replays it.
        return not self._holds_run(workflow_id)

    def _evict(self, lease: Lease, reason: str) -> None:
        """Drop the run from memory (no checkpoint): only its registry entry stays."""
        workflow_id = lease.workflow_id
        lease.residency = Residency.EVICTED
        self._registry.evict(workflow_id, EvictedRun(lease.run_id, lease.workflow_type))
        self._recorders.drop(workflow_id)
        if lease.cancel_scope is not None:
            lease.cancel_scope.cancel()
            self._unwinding.add(lease.key)
        self.evictions += 1
        logger.debug(
            "run evicted (%s): it is replayed when something wakes it",
            reason,
            extra={"workflow_id": workflow_id, "run_id": lease.run_id},
        )
        if self._observers is not None:
            self._observers.emit(
                RunEvicted(
                    workflow_id=workflow_id,
                    run_id=lease.run_id,
                    workflow_type=lease.workflow_type,
                    reason=reason,
                )
            )

    # -- releasing closed workflows -----------------------------------------------------

    def _release(self, workflow_id: str) -> bool | None:
        """Release a closed workflow: ``True`` released, ``False`` not closed (any more),
        ``None`` busy now (look again later)."""
        recorder = self._recorders.loaded_recorder(workflow_id)
        if recorder is None:
            return False
        if is_active(recorder.history):
            return False  # reopened, or a successor runs: it is no longer closed
        leases = self._registry.leases_of(workflow_id)
        if (
            recorder.busy
            or recorder.deferred
            or workflow_id in self._reviving
            or any(lease.task is not None or lease.query_waiters for lease in leases)
            or self._inflight.holds(workflow_id)
            or self._watching.get(workflow_id)
        ):
            return None
        for lease in leases:
            self._registry.remove(workflow_id, lease.run_id)
        self._recorders.drop(workflow_id)
        self.released += 1
        return True

    # -- making a run resident again --------------------------------------------------

    async def ensure_resident(self, workflow_id: str) -> None:
        """If ``workflow_id``'s run is evicted, replay it from the store now (the recovery
        path) so what follows is delivered to a resident run.  Concurrent callers wait for
        the one replaying it; nothing happens for a run that is resident or not here.  An
        engine that stops admitting leaves it evicted (the next engine recovers it)."""
        busy = self._reviving.get(workflow_id)
        if busy is not None:
            done, task = busy
            if task is not trio.lowlevel.current_task():
                await done.wait()
            return
        run = self._registry.evicted(workflow_id)
        if run is None or not self._epoch.admitting:
            return
        done = trio.Event()
        self._reviving[workflow_id] = (done, trio.lowlevel.current_task())
        self._registry.take_evicted(workflow_id)
        try:
            try:
                recorder = await self._recorders.recorder_for(workflow_id)
            except BaseException:
                if self._registry.evicted(workflow_id) is None and not self._registry.leases_of(workflow_id):
                    self._registry.evict(workflow_id, run)  # still evicted: the next wake tries again
                raise
            await self._revive(recorder, run)
            self.reloads += 1
            if self._observers is not None:
                segment = run_segment(recorder.history, run.run_id)
                start = segment[0].body if segment else None
                # A run lazy recovery left evicted is replayed here for the first time.
                reported = RunRecovered if run.recovering else RunReloaded
                self._observers.emit(
                    reported(
                        workflow_id=workflow_id,
                        run_id=run.run_id,
                        workflow_type=run.workflow_type,
                        headers=start.headers if isinstance(start, WorkflowStarted) else {},
                    )
                )
        finally:
            del self._reviving[workflow_id]
            done.set()

    def residency_of(self, workflow_id: str, run_id: str) -> str | None:
        """``"resident"``, ``"evicted"`` or ``None`` (not running here) for a run."""
        evicted = self._registry.evicted(workflow_id)
        if evicted is not None and evicted.run_id == run_id:
            return "evicted"
        lease = self._registry.get(workflow_id, run_id)
        if lease is not None and lease.residency is not Residency.SUSPENDED:
            return "resident"
        return None
