"""The timer service: armed timers in a heap, fired by appending ``TimerFired`` (history decides).

The store's timer index is a hint for the next engine (recovery reads it); this
engine's heap is its schedule.  The service asks the rest of the engine only for
a workflow's recorder and, for a run's deadline, its teardown.  A fire that fails
transiently is retried in the epoch, so the service goes on firing other timers.
"""

from __future__ import annotations

import heapq
from collections.abc import Awaitable, Callable, Iterable
from datetime import datetime

import trio

from .._clock import EngineClock
from .._epoch import EngineEpoch
from .._errors import BackendUnavailable, EngineEpochClosed, StoreError, WorkflowFenced
from .._events import TimerFired
from .._ids import deadline_timer_id
from .._projections import current_lease_terminal, outstanding_timers, run_segment, timer_resolved
from .._recorder import Recorder
from .._store import EventStore
from .._transient import RetryAbandoned, Transient
from .log import logger


class Timers:
    """This engine's armed timers and the task that fires them."""

    def __init__(
        self,
        *,
        events: EventStore,
        clock: EngineClock,
        epoch: EngineEpoch,
        transient: Transient,
        cluster_mode: bool,
        recorder_for: Callable[[str], Awaitable[Recorder]],
        deadline_teardown: Callable[[Recorder, str], Awaitable[bool]],
    ) -> None:
        self._events = events
        self._clock = clock
        self._epoch = epoch
        self._transient = transient
        #: Cluster mode: a fire refused by the store's fence was logged where the workflow
        #: was relinquished.
        self._cluster_mode = cluster_mode
        self._recorder_for = recorder_for
        self._deadline_teardown = deadline_teardown
        self._timers: list[tuple[datetime, int, str, str, str]] = []
        self._timer_seq = 0
        self._timers_changed = trio.Event()
        #: Fires being retried in the epoch after a transient failure, as ``(workflow_id,
        #: run_id, timer_id)``; a workflow dropped from this engine leaves it (its retry stops).
        self._retrying: set[tuple[str, str, str]] = set()

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
        self._retrying = {key for key in self._retrying if key[0] != workflow_id}

    def armed_for(self, workflow_id: str) -> bool:
        """Whether a timer of ``workflow_id`` waits in this engine's heap (or its fire is retried)."""
        return any(t[2] == workflow_id for t in self._timers) or any(
            key[0] == workflow_id for key in self._retrying
        )

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
        """Append ``TimerFired`` unless the timer fired, was cancelled or its run ended.

        A transient failure retries the fire in the epoch (``False`` now); any other
        failure is logged and the fire dropped (the next engine's recovery fires it)."""
        fields = {"workflow_id": workflow_id, "run_id": run_id, "timer": timer_id}
        try:
            return await self._fire_once(workflow_id, run_id, timer_id)
        except BackendUnavailable as exc:
            key = (workflow_id, run_id, timer_id)
            try:
                self._epoch.spawn(
                    self._fire_retried,
                    key,
                    exc,
                    name=f"retry:fire timer {timer_id}",
                    workflow_id=workflow_id,
                    run_id=run_id,
                )
            except EngineEpochClosed:
                return False  # shutting down: the next engine fires it
            self._retrying.add(key)
        except (EngineEpochClosed, StoreError) as exc:
            self._not_fired(exc, fields)
        return False

    async def _fire_once(self, workflow_id: str, run_id: str, timer_id: str) -> bool:
        recorder = await self._recorder_for(workflow_id)
        if timer_id == deadline_timer_id(run_id):
            return await self._deadline_teardown(recorder, run_id)
        async with recorder.lock:
            self._epoch.gate(workflow_id, run_id, f"fire timer {timer_id}")
            history = await recorder.current_history()
            segment = run_segment(history, run_id)
            if (
                current_lease_terminal(segment) is not None or timer_resolved(segment, timer_id) is not None
            ) or not any(t.timer_id == timer_id for t in outstanding_timers(segment)):
                fired = False
            else:
                await recorder.append(
                    [TimerFired(timer_id=timer_id)], action=f"fire timer {timer_id}", run_id=run_id
                )
                fired = True
        await self.forget(workflow_id, timer_id)
        return fired

    async def _fire_retried(self, key: tuple[str, str, str], first: BackendUnavailable) -> None:
        workflow_id, run_id, timer_id = key
        fields = {"workflow_id": workflow_id, "run_id": run_id, "timer": timer_id}

        def dropped() -> str | None:
            return None if key in self._retrying else "the workflow is no longer served by this engine"

        try:
            await self._transient.call(
                f"fire timer {timer_id}",
                lambda: self._fire_once(workflow_id, run_id, timer_id),
                logger,
                fields,
                after=first,
                stop=dropped,
            )
        except RetryAbandoned:
            pass
        except (EngineEpochClosed, StoreError) as exc:
            self._not_fired(exc, fields)
        finally:
            self._retrying.discard(key)

    def _not_fired(self, exc: EngineEpochClosed | StoreError, fields: dict[str, str]) -> None:
        if isinstance(exc, EngineEpochClosed):
            return  # shutting down: the next engine fires it
        if isinstance(exc, WorkflowFenced) and self._cluster_mode:
            return  # the workflow was relinquished (logged there)
        logger.error("could not fire timer: %s", exc, extra=fields)

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
