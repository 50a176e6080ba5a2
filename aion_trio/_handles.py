"""Handles and timeout scopes: what ``await`` on an activity, a child or a timer means.

Every handle belongs to one execution of a run's code (its :class:`Replay`);
awaiting it parks that execution until history holds the handle's resolution
and gives its value, or raises the recorded failure.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from datetime import datetime, timedelta
from typing import Any, Generic, TypeVar, Union, final

from ._childspec import STATUS_NOT_STARTED, STATUS_TIMED_OUT
from ._convert import Hints
from ._errors import ActivityFailure, ChildWorkflowFailure, Timeout
from ._events import (
    SCOPE_TIMEOUT_TYPE,
    ActivityCancelled,
    ActivityCompleted,
    ActivityError,
    ActivityFailed,
    ChildWorkflowCancelled,
    ChildWorkflowCompleted,
    ChildWorkflowFailed,
    Event,
    FailureCause,
    TimerCancelled,
    TimerFired,
)
from ._ids import CHILD_CANCEL_MARKER_PREFIX, scope_timer_id
from ._payload import Payload
from ._projections import COMMAND_ACTIVITY_CANCEL, COMMAND_CHILD_CANCEL, CommandKey
from ._replay import Replay

T = TypeVar("T")


@final
class ActivityHandle(Generic[T]):
    """A scheduled activity.  ``await handle`` gives its result or raises ``ActivityFailure``."""

    def __init__(
        self, replay: Replay, activity_id: int, activity_type: str, *, hints: Hints | None = None
    ) -> None:
        self._replay = replay
        self._hints = hints  # the activity's return type decodes its result
        self.activity_id = activity_id
        self.activity_type = activity_type

    def __await__(self) -> Generator[Any, None, T]:
        return self._result().__await__()

    async def _result(self) -> Any:
        replay = self._replay

        async def expire(scope_timer: str) -> Event:
            return await replay.port.record_activity_scope_timeout(self.activity_id, scope_timer)

        event = await replay.wait_until(
            lambda: replay.state.settled.get(self.activity_id), expire, (self.activity_id,)
        )
        replay.consume(event)
        return activity_value(self, event)

    async def cancel(self) -> bool:
        """Cancel the activity: ``ActivityCancelled`` is recorded, its running attempt is
        stopped (an async activity's task is cancelled, a thread activity is told through
        ``heartbeat()`` / ``activity_cancelled()``), and ``await handle`` raises
        :class:`aion_trio.ActivityFailure` (cause ``cancelled``).  ``True`` if this call
        cancelled it, ``False`` if it had already settled (its outcome stands)."""
        replay = self._replay
        replay.require_own_task("cancelling an activity")
        await replay.flush()  # its schedule is recorded before its cancel (program order)
        state = replay.state
        state.sync()
        activity_id = self.activity_id
        verdict = replay.resolve_cancel(
            CommandKey(COMMAND_ACTIVITY_CANCEL, str(activity_id)), state.settled.get(activity_id)
        )
        if verdict == "record":
            await replay.port.record_activities_cancelled([activity_id], by_workflow=True)
            state.sync()
            settled = state.settled.get(activity_id)
            return (
                settled is not None
                and isinstance(settled.body, ActivityCancelled)
                and bool(settled.body.by_workflow)
            )
        return verdict == "recorded"

    def __repr__(self) -> str:
        return f"<ActivityHandle activity:{self.activity_id} {self.activity_type}>"


@final
class TimerHandle:
    """A named durable timer from ``ctx.start_timer``.

    ``await timer`` waits until it fires and returns ``True``, or returns
    ``False`` if the workflow cancelled it first; ``await timer.cancel()``
    retires it (``TimerCancelled``) unless it already fired.
    """

    def __init__(self, replay: Replay, name: str, timer_id: str, fire_at: datetime) -> None:
        self._replay = replay
        self.name = name
        self.timer_id = timer_id
        self.fire_at = fire_at
        self._cancel_requested = False

    def __await__(self) -> Generator[Any, None, bool]:
        return self._fired().__await__()

    async def _fired(self) -> bool:
        replay = self._replay
        replay.require_own_task("awaiting a timer handle")
        event = await replay.await_timer_or_scope(self.timer_id)
        replay.consume(event)
        if isinstance(event.body, TimerFired):
            return True
        if self._cancel_requested:
            return False
        raise Timeout(f"a timeout scope expired while waiting for timer {self.name!r}")

    async def cancel(self) -> bool:
        """Cancel the timer; ``True`` if this cancelled it, ``False`` if it had already fired."""
        replay = self._replay
        replay.require_own_task("cancelling a timer")
        self._cancel_requested = True
        replay.retire_timer(self.timer_id)
        await replay.flush()
        replay.state.sync()
        resolution = replay.state.timer_resolutions.get(self.timer_id)
        assert resolution is not None
        replay.consume(resolution)
        return isinstance(resolution.body, TimerCancelled)

    def __repr__(self) -> str:
        return f"<TimerHandle {self.name!r} fires at {self.fire_at.isoformat()}>"


@final
class ChildHandle(Generic[T]):
    """A started child workflow.  ``await handle`` gives its result or raises
    :class:`aion_trio.ChildWorkflowFailure`; ``workflow_id`` is the child's id."""

    def __init__(
        self,
        replay: Replay,
        ordinal: int,
        workflow_id: str,
        workflow_type: str,
        *,
        hints: Hints | None = None,
    ) -> None:
        self._replay = replay
        self._hints = hints  # the child workflow's return type decodes its result
        self.ordinal = ordinal
        self.workflow_id = workflow_id
        self.workflow_type = workflow_type

    def __await__(self) -> Generator[Any, None, T]:
        return self._result().__await__()

    async def _result(self) -> Any:
        replay = self._replay

        def check() -> Event | None:
            # The child's outcome or an expired timeout scope: whichever was recorded first.
            candidates = replay.fired_scopes()
            outcome = replay.state.child_resolutions.get(self.ordinal)
            if outcome is not None:
                candidates.append(outcome)
            return min(candidates, key=lambda e: e.seq) if candidates else None

        event = await replay.wait_until(check)
        replay.consume(event)
        if isinstance(event.body, TimerFired):
            raise Timeout(f"a timeout scope expired while waiting for child workflow {self.workflow_id!r}")
        return child_value(self, event)

    async def cancel(self) -> bool:
        """Ask the child to cancel (recorded in this run's history, delivered to the child
        as ``engine.cancel`` would); ``await handle`` then gives its outcome, normally a
        :class:`aion_trio.ChildWorkflowFailure` with status ``cancelled``.  ``True`` if
        this call asked, ``False`` if the child's outcome was already recorded."""
        replay = self._replay
        replay.require_own_task("cancelling a child workflow")
        await replay.flush()  # its start is recorded (and the child started) before its cancel
        replay.state.sync()
        verdict = replay.resolve_cancel(
            CommandKey(COMMAND_CHILD_CANCEL, str(self.ordinal)),
            replay.state.child_resolutions.get(self.ordinal),
        )
        if verdict == "none":
            return False
        if verdict == "record":
            await replay.port.record_marker(f"{CHILD_CANCEL_MARKER_PREFIX}{self.ordinal}", Payload("true"))
        # Delivered on replay too (idempotent): a crash may have come between the record and the request.
        await replay.port.cancel_recorded_child(self.ordinal)
        return True

    def __repr__(self) -> str:
        return f"<ChildHandle child:{self.ordinal} {self.workflow_type} {self.workflow_id!r}>"


Handle = Union[ActivityHandle[Any], ChildHandle[Any], TimerHandle]
"""Any handle a workflow context returns (``ctx.gather`` / ``ctx.wait_first`` take them all)."""


def activity_value(handle: ActivityHandle[Any], event: Event) -> Any:
    """The activity's result, or its failure raised, from its recorded resolution."""
    body = event.body
    if isinstance(body, ActivityCompleted):
        value = handle._replay.port.codec.decode(body.result)
        if handle._hints is None:
            return value
        return handle._hints.decode_result(value, what=f"result of activity {handle.activity_type!r}")
    if isinstance(body, ActivityFailed):
        if body.error.type == SCOPE_TIMEOUT_TYPE:
            raise Timeout(body.error.message)
        raise ActivityFailure(handle.activity_id, handle.activity_type, body.error)
    if isinstance(body, ActivityCancelled):
        raise ActivityFailure(
            handle.activity_id,
            handle.activity_type,
            ActivityError(
                cause=FailureCause.CANCELLED,
                type="ActivityCancelled",
                message=f"attempt {body.attempt} was cancelled",
            ),
        )
    raise AssertionError(f"not an activity resolution: {event!r}")  # pragma: no cover


def child_value(handle: ChildHandle[Any], event: Event) -> Any:
    """The child's result, or its failure raised, from its recorded outcome."""
    body = event.body
    replay = handle._replay
    replay.unobserved_children.discard(handle.workflow_id)
    if isinstance(body, ChildWorkflowCompleted):
        value = replay.port.codec.decode(body.result)
        if handle._hints is None:
            return value
        return handle._hints.decode_result(value, what=f"result of child workflow {handle.workflow_type!r}")
    if isinstance(body, ChildWorkflowFailed):
        details = body.error.details.value() if body.error.details is not None else None
        status = details.get("status") if isinstance(details, dict) else None
        if status not in (STATUS_TIMED_OUT, STATUS_NOT_STARTED):
            status = "failed"
        raise ChildWorkflowFailure(handle.workflow_id, handle.workflow_type, str(status), error=body.error)
    assert isinstance(body, ChildWorkflowCancelled)
    raise ChildWorkflowFailure(handle.workflow_id, handle.workflow_type, "cancelled", reason=body.reason)


# -- any handle (gather, wait_first) -------------------------------------------------


def own_handles(replay: Replay, handles: Sequence[Any], what: str) -> list[Handle]:
    """``handles``, checked to be handles of this execution."""
    for h in handles:
        if not isinstance(h, (ActivityHandle, ChildHandle, TimerHandle)):
            raise TypeError(
                f"{what} takes handles from ctx.start(), ctx.start_child() or ctx.start_timer(), got {h!r}"
            )
        if h._replay is not replay:
            raise ValueError(f"{what}: {h!r} belongs to another workflow run")
    return list(handles)


def handle_resolution(handle: Handle) -> Event | None:
    state = handle._replay.state
    if isinstance(handle, ActivityHandle):
        return state.settled.get(handle.activity_id)
    if isinstance(handle, ChildHandle):
        return state.child_resolutions.get(handle.ordinal)
    return state.timer_resolutions.get(handle.timer_id)


def handle_value(handle: Handle, event: Event) -> Any:
    """What ``await handle`` gives for this recorded resolution (a failure is raised)."""
    if isinstance(handle, ActivityHandle):
        return activity_value(handle, event)
    if isinstance(handle, ChildHandle):
        return child_value(handle, event)
    return isinstance(event.body, TimerFired)


def handle_failed(event: Event) -> bool:
    return isinstance(
        event.body, (ActivityFailed, ActivityCancelled, ChildWorkflowFailed, ChildWorkflowCancelled)
    )


def awaited_activities(handles: Sequence[Handle]) -> list[int]:
    return [h.activity_id for h in handles if isinstance(h, ActivityHandle)]


@final
class TimeoutScope:
    """What ``ctx.timeout(d)`` returns; use with ``async with``."""

    def __init__(self, replay: Replay, seconds: float) -> None:
        self._replay = replay
        self._seconds = seconds
        self.timer_id = ""

    async def __aenter__(self) -> TimeoutScope:
        replay = self._replay
        replay.require_own_task("entering ctx.timeout()")
        replay.state.sync()
        self.timer_id = scope_timer_id(replay.next_scope)
        replay.next_scope += 1
        replay.issue_timer(self.timer_id, replay.now + timedelta(seconds=self._seconds))
        replay.scopes.append(self.timer_id)
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        replay = self._replay
        replay.scopes.remove(self.timer_id)
        # Left in time (or by an exception of its own): retire the scope's timer.
        if replay.retire_timer(self.timer_id) and exc_type is None:
            await replay.flush()
