"""The timer service: armed timers in a heap, fired by appending ``TimerFired`` (history decides).

The store's timer index is a hint for the next engine (recovery reads it); this
engine's heap is its schedule.  The service asks the rest of the engine only for
a workflow's recorder and, for a run's deadline, its teardown.
"""

from __future__ import annotations

import heapq
from collections.abc import Awaitable, Callable, Iterable
from datetime import datetime, timedelta

import trio

from .._clock import EngineClock
from .._epoch import EngineEpoch
from .._errors import BackendUnavailable, EngineEpochClosed, NotOwner, StoreError
from .._events import TimerFired
from .._ids import deadline_timer_id
from .._projections import current_lease_terminal, outstanding_timers, run_segment, timer_resolved
from .._recorder import Recorder
from .._store import EventStore
from .config import EngineConfig
from .log import logger


class Timers:
    """This engine's armed timers and the task that fires them."""

    def __init__(
        self,
        *,
        events: EventStore,
        clock: EngineClock,
        epoch: EngineEpoch,
        config: EngineConfig,
        cluster_mode: bool,
        recorder_for: Callable[[str], Awaitable[Recorder]],
        deadline_teardown: Callable[[Recorder, str], Awaitable[bool]],
    ) -> None:
        self._events = events
        self._clock = clock
        self._epoch = epoch
        self._config = config
        #: Cluster mode: a fire refused by the store's fence was logged where the workflow
        #: was relinquished.
        self._cluster_mode = cluster_mode
        self._recorder_for = recorder_for
        self._deadline_teardown = deadline_teardown
        self._timers: list[tuple[datetime, int, str, str, str]] = []
        self._timer_seq = 0
        self._timers_changed = trio.Event()

    async def arm(self, workflow_id: str, run_id: str, timer_id: str, fire_at: datetime) -> None:
        """Make the timer service fire this timer at ``fire_at`` (and note it in the store's index)."""
        self._timer_seq += 1
        heapq.heappush(self._timers, (fire_at, self._timer_seq, workflow_id, run_id, timer_id))
        self._timers_changed.set()
        try:
            await self._events.schedule_timer(workflow_id, timer_id, fire_at)
        except StoreError as exc:
            logger.warning(
                "not written to the timer index (it fires anyway): %s",
                exc,
                extra={"workflow_id": workflow_id, "run_id": run_id, "timer": timer_id},
            )

    def schedule_indexed(self, due: Iterable[tuple[datetime, str, str, str]]) -> None:
        """Fire timers already in the store's index (``(fire_at, workflow_id, run_id, timer_id)``):
        into the heap only, nothing written."""
        for fire_at, workflow_id, run_id, timer_id in due:
            self._timer_seq += 1
            heapq.heappush(self._timers, (fire_at, self._timer_seq, workflow_id, run_id, timer_id))
        self._timers_changed.set()

    def drop_workflow(self, workflow_id: str) -> None:
        """Forget this engine's timers of ``workflow_id`` (it is no longer served here)."""
        kept = [t for t in self._timers if t[2] != workflow_id]
        if len(kept) != len(self._timers):
            heapq.heapify(kept)
            self._timers = kept
            self._timers_changed.set()

    def armed_for(self, workflow_id: str) -> bool:
        """Whether a timer of ``workflow_id`` waits in this engine's heap."""
        return any(t[2] == workflow_id for t in self._timers)

    async def serve(self) -> None:
        """Fire due timers by appending ``TimerFired`` (history decides; the heap is a schedule)."""
        while True:
            self._timers_changed = trio.Event()
            if not self._timers:
                await self._timers_changed.wait()
                continue
            fire_at = self._timers[0][0]
            with trio.move_on_at(self._clock.trio_deadline(fire_at)):
                await self._timers_changed.wait()
                continue
            now = self._clock.now()
            while self._timers and self._timers[0][0] <= now:
                _, _, workflow_id, run_id, timer_id = heapq.heappop(self._timers)
                await self.fire(workflow_id, run_id, timer_id)

    async def fire(self, workflow_id: str, run_id: str, timer_id: str) -> bool:
        """Append ``TimerFired`` unless the timer fired, was cancelled or its run ended."""
        fields = {"workflow_id": workflow_id, "run_id": run_id, "timer": timer_id}
        try:
            recorder = await self._recorder_for(workflow_id)
            if timer_id == deadline_timer_id(run_id):
                return await self._deadline_teardown(recorder, run_id)
            async with recorder.lock:
                self._epoch.gate(workflow_id, run_id, f"fire timer {timer_id}")
                history = await recorder.current_history()
                segment = run_segment(history, run_id)
                if (
                    current_lease_terminal(segment) is not None
                    or timer_resolved(segment, timer_id) is not None
                ) or not any(t.timer_id == timer_id for t in outstanding_timers(segment)):
                    fired = False
                else:
                    await recorder.append(
                        [TimerFired(timer_id=timer_id)], action=f"fire timer {timer_id}", run_id=run_id
                    )
                    fired = True
        except EngineEpochClosed:
            return False
        except NotOwner as exc:
            if not self._cluster_mode:
                logger.error("could not fire timer: %s", exc, extra=fields)
            return False  # cluster mode: the workflow was relinquished (logged there)
        except BackendUnavailable as exc:
            logger.warning("could not fire timer (retrying): %s", exc, extra=fields)
            retry_at = self._clock.now() + timedelta(seconds=self._config.completion_retry.initial)
            self._timer_seq += 1
            heapq.heappush(self._timers, (retry_at, self._timer_seq, workflow_id, run_id, timer_id))
            return False
        except StoreError as exc:
            logger.error("could not fire timer: %s", exc, extra=fields)
            return False
        await self.forget(workflow_id, timer_id)
        return fired

    async def forget(self, workflow_id: str, timer_id: str) -> None:
        """Remove the timer from the store's index (the index is a hint; history decides)."""
        try:
            await self._events.remove_timer(workflow_id, timer_id)
        except StoreError as exc:
            logger.warning(
                "could not remove it from the timer index (harmless): %s",
                exc,
                extra={"workflow_id": workflow_id, "timer": timer_id},
            )
