"""The schedule window: freshly started activities' schedule records, held back and written late.

With ``EngineConfig.activity_schedule_window`` set, the records that schedule a
batch of activities (and start their first attempts) are not appended at once:
they ride along with the next append on the workflow's recorder (usually the
first outcome), or are written by the deferral service when the window closes
while the activity still runs, or at graceful shutdown.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

import trio

from .._clock import EngineClock
from .._epoch import EngineEpoch
from .._errors import BackendUnavailable, EngineEpochClosed, StoreError, WorkflowFenced
from .._events import ActivityScheduled, ActivityStarted, input_digest, trusted
from .._guard import unguarded
from .._ports import RunAborted, ScheduleActivity
from .._projections import RunState
from .._recorder import Recorder
from .._registry import Lease
from .config import EngineConfig
from .log import logger

#: Trio's clock without the determinism guard's check: these reads are the engine's,
#: made in tasks that inherit a workflow task's context.
_trio_time = unguarded(trio.current_time)


def schedule_bodies(p: ScheduleActivity) -> tuple[ActivityScheduled, ActivityStarted]:
    """A newly started activity's first records: scheduled, and its first attempt started."""
    # Built without re-validating: the ordinal is the engine's count, the name a checked
    # definition's, the payloads the codec's and the resolved options', the queue checked there.
    return (
        trusted(
            ActivityScheduled,
            activity_id=p.ordinal,
            activity_type=p.definition.name,
            input=p.input,
            task_queue=p.task_queue,
            options=p.options,
            input_digest=input_digest(p.input),
        ),
        trusted(ActivityStarted, activity_id=p.ordinal, attempt=1),
    )


class ScheduleWindow:
    """Deferred schedule records this engine owes, and the service that writes them."""

    def __init__(
        self,
        *,
        clock: EngineClock,
        epoch: EngineEpoch,
        config: EngineConfig,
        cluster_mode: bool,
        park_if_closing: Callable[[Lease, str], None],
    ) -> None:
        self._clock = clock
        self._epoch = epoch
        self._config = config
        #: Cluster mode: a write refused by the store's fence was logged where the workflow
        #: was relinquished.
        self._cluster_mode = cluster_mode
        self._park_if_closing = park_if_closing
        #: Recorders holding deferred schedule records, with the Trio time by which they
        #: must be written (FIFO: one window for all), served by :meth:`serve`.
        self._owed: collections.deque[tuple[float, Recorder]] = collections.deque()
        self._owed_lot = trio.lowlevel.ParkingLot()

    async def defer(self, lease: Lease, state: RunState, pending: Sequence[Any]) -> datetime | None:
        """Hold back the schedule records of freshly started activities (they are written
        with the first outcome, or by :meth:`serve` when the window closes).

        Returns the schedule time, or ``None`` when the ordinary path must record them
        (a stale history to re-read first).  Nothing here writes or fails transiently.
        """
        self._park_if_closing(lease, "record workflow commands")
        recorder = lease.recorder
        async with recorder.hold():
            if recorder.stale:
                return None
            state.sync()
            if state.ended is not None:
                raise RunAborted()  # ended elsewhere (terminate, deadline): record nothing more
            bodies = [body for p in pending for body in schedule_bodies(p)]
            at = self._clock.now()
            recorder.defer(bodies, at=at)
        return at

    def owe(self, recorder: Recorder, window: float) -> None:
        """``recorder``'s deferred records are due ``window`` seconds from now."""
        self._owed.append((_trio_time() + window, recorder))
        if len(self._owed) == 1:
            self._owed_lot.unpark_all()

    async def serve(self) -> None:
        """Write deferred schedule records whose window closed while their activity still runs.

        Wakes at most about four times per window: whatever came due meanwhile is
        handled in one pass (a record may so wait up to 1.25 windows, longer only
        while an append on its recorder is in progress, which writes it).
        """
        window = self._config.activity_schedule_window or 0.0
        owed = self._owed
        while True:
            if not owed:
                await self._owed_lot.park()
                continue
            await trio.sleep_until(owed[0][0] + window / 4)
            now = _trio_time()
            while owed and owed[0][0] <= now:
                _, recorder = owed.popleft()
                if recorder.deferred and recorder.busy:
                    # The holder's append writes them (or the holder decides, which writes
                    # them first): look again a window later rather than queue behind it.
                    owed.append((now + window, recorder))
                elif recorder.deferred:
                    try:
                        self._epoch.spawn(
                            self._write,
                            recorder,
                            name=f"deferred-records:{recorder.workflow_id}",
                            workflow_id=recorder.workflow_id,
                        )
                    except EngineEpochClosed:
                        return

    async def write_all(self) -> None:
        """Graceful shutdown: write every deferred schedule record (concurrently, so a
        group-committing store takes them in one transaction), so that history shows
        the attempts that were in flight."""
        owing = {id(r): r for _, r in self._owed if r.deferred}
        self._owed.clear()
        if owing:
            async with trio.open_nursery() as nursery:
                for recorder in owing.values():
                    nursery.start_soon(self._write, recorder)

    async def _write(self, recorder: Recorder) -> None:
        fields = {"workflow_id": recorder.workflow_id}
        try:
            async with recorder.lock:
                await recorder.flush_deferred()
        except EngineEpochClosed:
            pass  # replay schedules the activity again
        except BackendUnavailable as exc:
            logger.warning(
                "could not write deferred schedule records (retried with the next record): %s",
                exc,
                extra=fields,
            )
            self.owe(recorder, self._config.completion_retry.initial)
        except WorkflowFenced as exc:
            if not self._cluster_mode:
                logger.error("could not write deferred schedule records: %s", exc, extra=fields)
        except StoreError as exc:
            logger.error("could not write deferred schedule records: %s", exc, extra=fields)
