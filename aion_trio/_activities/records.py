"""Recording an activity's events: every record goes through :func:`record_activity_event`
(recorder lock, epoch gate, settle check on the run's segment, append), retried while the store
fails transiently."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .._errors import EngineEpochClosed
from .._events import Event, EventBody
from .._logs import ContextLogger
from .._projections import run_segment
from .._transient import Transient
from .protocol import ActivityRequest

if TYPE_CHECKING:
    from .._recorder import Recorder

logger = ContextLogger("aion_trio.activity")


class RecordOutcome(enum.Enum):
    RECORDED = "recorded"
    #: The activity or its run already has a terminal: stop, record nothing.
    SETTLED_ELSEWHERE = "settled_elsewhere"
    #: The epoch is closed: nothing may be written by this engine any more.
    EPOCH_CLOSED = "epoch_closed"


async def record_activity_event(
    recorder: Recorder, run_id: str, activity_id: int, body: EventBody, *, retried: bool = False
) -> RecordOutcome:
    """The guarded append every activity record goes through.

    Under the recorder lock: epoch gate first, then the run's segment (re-read
    if stale): if the activity or the run already has a terminal, stand down.
    ``retried``: an earlier try of this very record failed with an unknown
    outcome, so first look whether it landed (then it is not written twice).
    Store errors propagate (the caller decides whether to retry).
    """
    action = f"record {type(body).__name__}"
    async with recorder.hold():
        try:
            recorder.epoch.gate(recorder.workflow_id, run_id, action)
        except EngineEpochClosed:
            return RecordOutcome.EPOCH_CLOSED
        # The activity's own deferred schedule (if any) shares this append.
        history = await recorder.current_history(keep_deferred=True)
        if retried and _landed(history, run_id, body):
            return RecordOutcome.RECORDED
        state = recorder.run_state(run_id)
        if activity_id in state.settled or state.ended is not None:
            return RecordOutcome.SETTLED_ELSEWHERE
        try:
            await recorder.append((body,), action=action, run_id=run_id)
        except EngineEpochClosed:
            return RecordOutcome.EPOCH_CLOSED
        return RecordOutcome.RECORDED


def _record_key(body: EventBody) -> tuple[Any, ...]:
    """What tells one activity record apart from every other of its run."""
    value = getattr(body, "value", None)  # a marker: its name and value tell it apart
    return (
        type(body),
        getattr(body, "activity_id", None),
        getattr(body, "attempt", None),
        getattr(body, "final", None),
        getattr(body, "name", None),
        getattr(value, "json", None),
    )


def _landed(history: Sequence[Event], run_id: str, body: EventBody) -> bool:
    """Whether ``body`` is already in ``run_id``'s segment (an append of unknown outcome landed)."""
    key = _record_key(body)
    return any(_record_key(event.body) == key for event in run_segment(history, run_id))


class RecordFailed(Exception):
    """A required retry-trail record could not be written (the store failed)."""


async def record_retrying(
    recorder: Recorder,
    request: ActivityRequest,
    body: EventBody,
    transient: Transient,
    log_extra: dict[str, Any],
    what: str,
) -> RecordOutcome:
    """``record_activity_event``, retried on ``BackendUnavailable`` until it lands
    (a try whose commit landed unacknowledged is found, not written twice) or the
    epoch closes."""
    tries = 0

    async def record() -> RecordOutcome:
        nonlocal tries
        tries += 1
        return await record_activity_event(
            recorder, request.run_id, request.activity_id, body, retried=tries > 1
        )

    try:
        return await transient.call(what, record, logger, log_extra)
    except EngineEpochClosed:
        return RecordOutcome.EPOCH_CLOSED


async def record_outcome(
    recorder: Recorder,
    request: ActivityRequest,
    body: EventBody,
    transient: Transient,
    log_extra: dict[str, Any],
) -> RecordOutcome:
    what = f"record the outcome of attempt {request.attempt}"  # the line's prefix names the activity
    result = await record_retrying(recorder, request, body, transient, log_extra, what)
    if result is RecordOutcome.EPOCH_CLOSED:
        logger.info(
            "outcome not recorded: the engine is shutting down; recovery re-dispatches it",
            extra={**log_extra, "attempt": request.attempt},
        )
    elif result is RecordOutcome.SETTLED_ELSEWHERE:
        logger.debug(
            "settled elsewhere; this outcome is dropped", extra={**log_extra, "attempt": request.attempt}
        )
    return result
