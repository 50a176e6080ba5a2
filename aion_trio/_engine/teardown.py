"""Teardown: ending a run from outside its own task (terminate, the workflow deadline, a dropped workflow).

:class:`RunTeardown` stops a run locally right after a terminal recorded from
outside it (no checkpoint between the append and the stop, so the run's code
never observes the teardown batch), records the workflow deadline's
``WorkflowTimedOut`` and retires the deadline last (its resume anchor), finds
the deadline teardowns a crash interrupted, and stops everything of a
workflow this engine no longer serves.  What it needs of the rest of the
engine (timers, in-flight attempts, visibility, the completion path's
bookkeeping, the run-closed hook) it is given.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import final

import trio

from .._clock import EngineClock
from .._completion import forget_retired, reconcile_registry, teardown_bodies
from .._epoch import EngineEpoch
from .._errors import StoreError
from .._events import Event, EventBody, TimeoutKind, TimerFired, WorkflowTimedOut
from .._hub import CompletionHub
from .._ids import deadline_timer_id
from .._projections import current_lease_terminal, outstanding_timers, run_segment
from .._recorder import Recorder
from .._registry import Registry
from .._store import ClusterStore, EventStore
from .config import EngineConfig
from .dispatch import ActivityDispatch
from .log import logger
from .timers import Timers


@final
class RunTeardown:
    """Ends runs from outside their own task, and finishes the teardowns a crash interrupted."""

    def __init__(
        self,
        *,
        events: EventStore,
        epoch: EngineEpoch,
        config: EngineConfig,
        clock: EngineClock,
        registry: Registry,
        stuck: dict[str, str],
        cluster: ClusterStore | None,
        timers: Timers,
        activity_dispatch: ActivityDispatch,
        completion_hub: CompletionHub,
        run_closed: Callable[[str, str], Awaitable[None]],
        upsert_visibility: Callable[[str], Awaitable[None]],
    ) -> None:
        self._events = events
        self._epoch = epoch
        self._config = config
        self._clock = clock
        self._registry = registry
        self._stuck = stuck
        self._cluster = cluster
        self._timers = timers
        self._dispatch = activity_dispatch
        self._hub = completion_hub
        self._run_closed = run_closed
        self._upsert_visibility = upsert_visibility

    def stop_run_locally(self, workflow_id: str, run_id: str, terminal: Event) -> None:
        """After a terminal recorded from outside the run's task: wake waiters, stop the
        run's code and its in-flight dispatches.  No checkpoint: call it right after the
        append, so the run's code never observes the teardown batch."""
        lease = self._registry.get(workflow_id, run_id)
        if lease is not None:
            if lease.cancel_scope is not None:
                lease.cancel_scope.cancel()
            lease.completion.notify(terminal)
            reconcile_registry(self._hub, lease)
        self._dispatch.cancel_inflight(workflow_id, run_id)

    def forget_workflow(self, workflow_id: str) -> None:
        """A workflow's recorder was dropped: cancel its runs and attempts, drop its timers,
        leases and stuck mark.  No checkpoint."""
        for lease in self._registry.leases_of(workflow_id):
            self._registry.remove(workflow_id, lease.run_id)
            if lease.cancel_scope is not None:
                lease.cancel_scope.cancel()
        for scope in self._dispatch.inflight.of_workflow(workflow_id):
            scope.cancel()
        self._registry.take_evicted(workflow_id)
        self._timers.drop_workflow(workflow_id)
        self._stuck.pop(workflow_id, None)

    async def deadline_teardown(self, recorder: Recorder, run_id: str) -> bool:
        """The workflow deadline fired: record ``WorkflowTimedOut`` if no terminal exists,
        stop the run, upsert visibility, and retire the deadline **last** (it is the
        teardown's resume anchor: a teardown interrupted midway is redone by recovery)."""
        workflow_id = recorder.workflow_id
        deadline = deadline_timer_id(run_id)
        timed_out = False
        async with recorder.lock:
            self._epoch.gate(workflow_id, run_id, "time out the workflow")
            history = await recorder.current_history()
            segment = run_segment(history, run_id)
            if not any(t.timer_id == deadline for t in outstanding_timers(segment)):
                return False  # already retired
            if current_lease_terminal(segment) is None:
                bodies: list[EventBody] = [
                    WorkflowTimedOut(timeout_kind=TimeoutKind.DEADLINE),
                    *(
                        b
                        for b in teardown_bodies(segment, run_id, retire_timers=True)
                        if getattr(b, "timer_id", None) != deadline
                    ),
                ]
                events = await recorder.append(bodies, action="time out the workflow", run_id=run_id)
                self.stop_run_locally(workflow_id, run_id, events[0])
                timed_out = True
                await forget_retired(self._hub, workflow_id, bodies)
        if timed_out:
            logger.warning(
                "workflow run timed out (its deadline passed); the run was stopped",
                extra={"workflow_id": workflow_id, "run_id": run_id},
            )
        await self._run_closed(workflow_id, run_id)
        with trio.CancelScope(shield=True), trio.move_on_after(self._config.bookkeeping_timeout):
            await self._upsert_visibility(workflow_id)
        async with recorder.lock:
            self._epoch.gate(workflow_id, run_id, "retire the workflow deadline")
            history = await recorder.current_history()
            segment = run_segment(history, run_id)
            if any(t.timer_id == deadline for t in outstanding_timers(segment)):
                await recorder.append(
                    [TimerFired(timer_id=deadline)], action="retire the deadline", run_id=run_id
                )
        await self._timers.forget(workflow_id, deadline)
        return timed_out

    async def resume(self, active: set[str]) -> None:
        """Deadline teardowns interrupted by a crash (``WorkflowTimedOut`` recorded, deadline
        not yet retired) are finished; the store's timer index finds them."""
        try:
            due = await self._events.expired_timers(self._clock.now())
        except StoreError as exc:
            logger.warning("could not read the timer index to resume teardowns: %s", exc)
            return
        resumed: list[tuple[datetime, str, str, str]] = []
        for entry in due:
            if entry.workflow_id in active or not entry.timer_id.startswith("deadline:"):
                continue
            if self._cluster is not None:
                # Cluster mode: a teardown another live node owns is that node's to finish.
                try:
                    if await self._cluster.command_target(entry.workflow_id) is not None:
                        continue
                except StoreError as exc:
                    logger.warning("could not tell who finishes a deadline teardown: %s", exc)
                    continue
            run_id = entry.timer_id.removeprefix("deadline:")
            resumed.append((entry.fire_at, entry.workflow_id, run_id, entry.timer_id))
        self._timers.schedule_indexed(resumed)
