"""Poison runs: a run whose recovery keeps killing the process is not run again (issue 14 item 5).

A recovery is *counted* in the store (the optional :class:`RecoveryCounts`
capability) when the startup sweep resumes a workflow's running run, and the
count is *cleared* once the recovery's risky part is over: the replay has
caught up with history, and every activity attempt the recovery started (the
re-dispatched ones and those the replay itself went on to start) has
recorded its end, or the run ended.  A process that dies in between leaves
the count behind; when a sweep finds a count above
``EngineConfig.max_recovery_attempts``, the run is marked stuck instead.

So that one run's death is not charged to another, nothing is dispatched
until the sweep's replays have caught up and the counts of the runs already
past their risky part are cleared durably.  A run merely waiting (a timer, a
signal, a child) is past it as soon as its replay catches up: sleeping
through any number of crashes never makes it stuck.  The price is paid at
recovery only: one write counting the sweep's runs and one clearing them;
a healthy engine's steps pay nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
import trio

from ._errors import StoreError
from ._events import ActivityCancelled, ActivityCompleted, ActivityFailed, ActivityFallbackRouted
from ._registry import Lease, Residency
from ._store import RecoveryCounts

if TYPE_CHECKING:
    from ._activities import ActivityRequest
    from ._hub import RecoveryHub
    from ._recorder import Recorder

logger = logging.getLogger("aion_trio.recovery")

#: How long (Trio seconds) the sweep waits for its replays to catch up before it
#: dispatches anyway (a replay normally takes milliseconds).
REPLAY_WAIT = 10.0

_ATTEMPT_ENDS = (ActivityCompleted, ActivityFailed, ActivityCancelled, ActivityFallbackRouted)


@attrs.define(eq=False)
class _Watched:
    lease: Lease
    #: Activity ids whose attempt, started by this recovery, has not recorded its end.
    risky: set[int] = attrs.Factory(set)


def poison_reason(unfinished: int) -> str:
    return (
        f"{unfinished} recoveries of this run in a row never finished (the process stopped each time "
        "while replaying it or re-running its in-flight activities: a crash, os._exit, an OOM kill?); "
        "it is not run again: inspect it and fix the cause, then clear its count "
        "(store.clear_recoveries([workflow_id])) and restart, or terminate it"
    )


@attrs.define(eq=False)
class RecoveryGuard:
    """One sweep's poison-run bookkeeping (see the module notes)."""

    core: RecoveryHub
    store: RecoveryCounts
    limit: int
    counts: dict[str, int] = attrs.Factory(dict)
    #: Dispatches held back until the sweep's replays caught up (``None``: released).
    held: list[tuple[Recorder, ActivityRequest, bool]] | None = attrs.Factory(list)
    watched: dict[str, _Watched] = attrs.Factory(dict)
    #: Workflows whose count this engine holds and has not cleared.
    counted: set[str] = attrs.Factory(set)
    #: Those marked stuck for their count: it stays until the run ends (terminated).
    poisoned_ids: set[str] = attrs.Factory(set)
    #: Runs the sweep left evicted without replaying them (parked on a timer or a child):
    #: nothing risky ran, so their counts are cleared with the others at release.
    quiet: list[str] = attrs.Factory(list)
    #: Lazy recovery: runs the sweep left for the background to replay, each with the
    #: activity ids its replay dispatched since (their attempts are its risky part).
    background: dict[str, set[int]] = attrs.Factory(dict)

    @classmethod
    def for_core(cls, core: RecoveryHub) -> RecoveryGuard | None:
        limit = core.config.max_recovery_attempts
        store = core.store
        if limit is None or not isinstance(store, RecoveryCounts):
            return None
        return cls(core=core, store=store, limit=limit)

    async def count(self, workflow_ids: Sequence[str]) -> None:
        """Count one recovery of each workflow the sweep resumes (one durable write)."""
        if not workflow_ids:
            return
        try:
            known = await self.core.transient.call(
                "read the recovery counts", self.store.recovery_counts, logger
            )
            # A run already past the limit is not counted again: it stays at limit + 1
            # until an operator clears it (or it is terminated).
            sweep = set(workflow_ids)
            over = {wid: n for wid, n in known.items() if n > self.limit and wid in sweep}
            ids = [wid for wid in workflow_ids if wid not in over]
            counted = await self.core.transient.call(
                "count the recoveries of the active workflows",
                lambda: self.store.count_recoveries(ids),
                logger,
            )
        except StoreError as exc:
            logger.error("could not count recoveries; poison runs go undetected this time: %s", exc)
            return
        self.counts = {**counted, **over}
        self.counted.update(self.counts)

    def poisoned(self, lease: Lease) -> int | None:
        """How many recoveries of the run never finished, if that is past the limit; the
        count then stays until the run ends (an operator terminates it), and goes then."""
        count = self.counts.get(lease.workflow_id, 0)
        if count <= self.limit:
            return None
        self.poisoned_ids.add(lease.workflow_id)
        self.core.epoch.spawn(
            self._clear_when_ended,
            lease,
            name=f"recovery-count:{lease.workflow_id}",
            workflow_id=lease.workflow_id,
            run_id=lease.run_id,
        )
        return count - 1

    def watch(self, lease: Lease) -> None:
        if lease.workflow_id in self.counted:
            self.watched[lease.workflow_id] = _Watched(lease=lease)

    def hold(self, recorder: Recorder, request: ActivityRequest, resume: bool) -> bool:
        """Dispatch hook: ``True`` if the dispatch is held back for :meth:`release`."""
        deferred = self.background.get(request.workflow_id)
        if deferred is not None:
            deferred.add(request.activity_id)
        if self.held is None:
            return False
        self.held.append((recorder, request, resume))
        watched = self.watched.get(request.workflow_id)
        if watched is not None and watched.lease.run_id == request.run_id:
            watched.risky.add(request.activity_id)
        return True

    async def release(self) -> None:
        """End of the sweep: let the replays catch up, clear the counts of the runs past
        their risky part (durably), then dispatch what was held and watch the rest."""
        with trio.move_on_after(REPLAY_WAIT):
            for watched in list(self.watched.values()):
                await self._caught_up(watched.lease)
        done = [wid for wid, w in self.watched.items() if not w.risky and self._past_replay(w.lease)]
        for wid in done:
            del self.watched[wid]
        done += self.quiet
        self.quiet = []
        await self._clear(done)
        held, self.held = self.held or [], None
        for recorder, request, resume in held:
            self.core.dispatch(recorder, request, resume=resume)
        for watched in self.watched.values():
            self.core.epoch.spawn(
                self._watch,
                watched,
                name=f"recovery-watch:{watched.lease.workflow_id}",
                workflow_id=watched.lease.workflow_id,
                run_id=watched.lease.run_id,
            )
        self.watched = {}

    def defer(self, workflow_id: str) -> None:
        """Lazy recovery: the run is replayed in the background after the sweep; its count
        stays until :meth:`settle` saw that replay past its risky part."""
        if workflow_id in self.counted:
            self.background[workflow_id] = set()

    async def settle(self, lease: Lease) -> None:
        """A deferred run's background replay parked: once it is past replay and the
        attempts it dispatched have recorded their end, its count is cleared (as a
        watched run's at the sweep)."""
        risky = self.background.pop(lease.workflow_id, None)
        if risky is None:
            return
        await self._watch(_Watched(lease=lease, risky=risky))

    async def close(self) -> None:
        """Graceful shutdown: the process survived its recoveries, so their counts go
        (not those of the runs marked stuck for theirs)."""
        await self._clear(sorted(self.counted - self.poisoned_ids))

    async def _clear_when_ended(self, lease: Lease) -> None:
        while lease.recorder.run_state(lease.run_id).ended is None:
            await lease.recorder.wait_lifecycle()
        self.poisoned_ids.discard(lease.workflow_id)
        await self._clear([lease.workflow_id])

    def _past_replay(self, lease: Lease) -> bool:
        if lease.residency is Residency.STUCK:
            return True
        if lease.recorder.run_state(lease.run_id).ended is not None:
            return True
        activation = lease.activation
        return activation is not None and not activation.is_replaying

    async def _caught_up(self, lease: Lease) -> None:
        lease.query_waiters += 1  # the run's port then wakes the recorder's waiters when it parks
        try:
            while not self._past_replay(lease):
                await lease.recorder.wait_changed()
        finally:
            lease.query_waiters -= 1

    async def _watch(self, watched: _Watched) -> None:
        lease = watched.lease
        recorder = lease.recorder
        position = lease.start_head
        await self._caught_up(lease)
        while True:
            history = recorder.history
            for event in history[position:]:
                if isinstance(event.body, _ATTEMPT_ENDS):
                    watched.risky.discard(event.body.activity_id)
            position = len(history)
            if not watched.risky or recorder.run_state(lease.run_id).ended is not None:
                break
            await recorder.wait_changed()
        await self._clear([lease.workflow_id])

    async def _clear(self, workflow_ids: Sequence[str]) -> None:
        ids = [wid for wid in workflow_ids if wid in self.counted]
        if not ids:
            return
        try:
            await self.core.transient.call(
                "clear the recovery counts of recovered workflows",
                lambda: self.store.clear_recoveries(ids),
                logger,
            )
        except StoreError as exc:
            logger.warning("could not clear recovery counts (they count once more): %s", exc)
            return
        self.counted.difference_update(ids)
