"""Running activities and recording their outcomes (DESIGN §8).

Dispatch goes through an :class:`ActivityDispatcher`; the default runs
registered activities in this process: ``async def`` as Trio tasks (really
cancellable), plain ``def`` in worker threads (so a slow synchronous activity
never blocks the engine's Trio thread), asyncio coroutine functions through
trio-asyncio.

Every record the driver makes goes through :func:`record_activity_event`:
recorder lock, epoch gate, settle check on the run's segment, append.
"""

from __future__ import annotations

import contextvars
import enum
import logging
import traceback
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol, final

import attrs
import trio

from ._definitions import ActivityDefinition, ActivityLoop
from ._errors import (
    BackendUnavailable,
    EngineEpochClosed,
    PayloadError,
    TerminalError,
    UnknownActivityType,
)
from ._events import (
    ActivityCompleted,
    ActivityError,
    ActivityFailed,
    EventBody,
    FailureCause,
)
from ._payload import Payload, PayloadCodec
from ._projections import activity_settled, current_lease_terminal, run_segment

if TYPE_CHECKING:
    from ._recorder import Recorder

logger = logging.getLogger("aion_trio.activity")


@final
@attrs.frozen(kw_only=True)
class ActivityInfo:
    """What an activity can learn about the attempt it is running (``aion_trio.activity_info()``)."""

    workflow_id: str
    run_id: str
    activity_id: int
    activity_type: str
    attempt: int
    task_queue: str


_current_info: contextvars.ContextVar[ActivityInfo | None] = contextvars.ContextVar(
    "aion_trio_activity_info", default=None
)


def activity_info() -> ActivityInfo:
    """The running activity attempt's identity; raises ``RuntimeError`` outside an activity."""
    info = _current_info.get()
    if info is None:
        raise RuntimeError("aion_trio.activity_info() was called outside an activity")
    return info


@final
@attrs.frozen(kw_only=True)
class ActivityRequest:
    """One attempt of one activity, as handed to a dispatcher."""

    workflow_id: str
    run_id: str
    activity_id: int
    activity_type: str
    input: Payload
    attempt: int
    task_queue: str
    options: Payload


@final
@attrs.frozen(kw_only=True)
class ActivityOutcome:
    """What an attempt produced: a result, or an error."""

    result: Payload | None = None
    error: ActivityError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class ActivityDispatcher(Protocol):
    """Runs one activity attempt and reports its outcome.

    Cancellation: a cancelled ``dispatch`` means the attempt was *parked* (the
    engine is shutting down or the run stopped waiting): nothing is recorded.
    """

    async def dispatch(self, request: ActivityRequest) -> ActivityOutcome: ...


def error_from_exception(exc: BaseException, cause: FailureCause) -> ActivityError:
    return ActivityError(
        cause=cause,
        type=type(exc).__qualname__,
        message=str(exc),
        traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
    )


@final
class InProcessDispatcher:
    """Runs registered activities in this process."""

    def __init__(
        self,
        activities: Mapping[str, ActivityDefinition[Any]],
        codec: PayloadCodec,
        asyncio_loop: Any = None,
        thread_limiter: trio.CapacityLimiter | None = None,
    ) -> None:
        self._activities = activities
        self._codec = codec
        self._asyncio_loop = asyncio_loop
        self._limiter = thread_limiter

    async def dispatch(self, request: ActivityRequest) -> ActivityOutcome:
        definition = self._activities.get(request.activity_type)
        if definition is None:
            error = UnknownActivityType(request.activity_type, sorted(self._activities))
            return ActivityOutcome(error=error_from_exception(error, FailureCause.TERMINAL))
        args = self._codec.decode(request.input)
        if not isinstance(args, list):
            args = [args]
        info = ActivityInfo(
            workflow_id=request.workflow_id,
            run_id=request.run_id,
            activity_id=request.activity_id,
            activity_type=request.activity_type,
            attempt=request.attempt,
            task_queue=request.task_queue,
        )
        token = _current_info.set(info)
        try:
            with trio.move_on_after(definition.timeout if definition.timeout else float("inf")) as scope:
                try:
                    value = await self._call(definition, args)
                except TerminalError as exc:
                    return ActivityOutcome(error=error_from_exception(exc, FailureCause.TERMINAL))
                except Exception as exc:
                    return ActivityOutcome(error=error_from_exception(exc, FailureCause.RETRYABLE))
        finally:
            _current_info.reset(token)
        if scope.cancelled_caught:
            return ActivityOutcome(
                error=ActivityError(
                    cause=FailureCause.TIMEOUT,
                    type="ActivityTimeout",
                    message=f"attempt {request.attempt} timed out after {definition.timeout}s",
                )
            )
        try:
            payload = self._codec.encode(value, what=f"result of activity {definition.name!r}")
        except PayloadError as exc:
            return ActivityOutcome(error=error_from_exception(exc, FailureCause.TERMINAL))
        return ActivityOutcome(result=payload)

    async def _call(self, definition: ActivityDefinition[Any], args: list[Any]) -> Any:
        if definition.loop is ActivityLoop.TRIO:
            return await definition.fn(*args)
        if definition.loop is ActivityLoop.THREAD:
            # abandon_on_cancel: a timed-out thread activity is abandoned; its
            # late result is discarded (threads cannot be interrupted).
            return await trio.to_thread.run_sync(
                lambda: definition.fn(*args), abandon_on_cancel=True, limiter=self._limiter
            )
        import trio_asyncio

        if self._asyncio_loop is None:  # pragma: no cover - the engine opens one when needed
            raise RuntimeError("no asyncio loop is open for asyncio activities")
        return await trio_asyncio.aio_as_trio(definition.fn, loop=self._asyncio_loop)(*args)


class RecordOutcome(enum.Enum):
    RECORDED = "recorded"
    #: The activity or its run already has a terminal: stop, record nothing.
    SETTLED_ELSEWHERE = "settled_elsewhere"
    #: The epoch is closed: nothing may be written by this engine any more.
    EPOCH_CLOSED = "epoch_closed"


async def record_activity_event(
    recorder: Recorder, run_id: str, activity_id: int, body: EventBody
) -> RecordOutcome:
    """The guarded append every activity record goes through.

    Under the recorder lock: epoch gate first, then the run's segment (re-read
    if stale): if the activity or the run already has a terminal, stand down.
    Store errors propagate (the caller decides whether to retry).
    """
    async with recorder.lock:
        try:
            recorder.epoch.gate(recorder.workflow_id, run_id, f"record {type(body).__name__}")
        except EngineEpochClosed:
            return RecordOutcome.EPOCH_CLOSED
        history = await recorder.current_history()
        segment = run_segment(history, run_id)
        if activity_settled(segment, activity_id) is not None or current_lease_terminal(segment) is not None:
            return RecordOutcome.SETTLED_ELSEWHERE
        try:
            await recorder.append([body], action=f"record {type(body).__name__}", run_id=run_id)
        except EngineEpochClosed:
            return RecordOutcome.EPOCH_CLOSED
        return RecordOutcome.RECORDED


def outcome_body(request: ActivityRequest, outcome: ActivityOutcome) -> EventBody:
    if outcome.error is None:
        assert outcome.result is not None
        return ActivityCompleted(
            activity_id=request.activity_id, result=outcome.result, attempt=request.attempt
        )
    return ActivityFailed(
        activity_id=request.activity_id, error=outcome.error, attempt=request.attempt, final=True
    )


async def drive_activity(
    recorder: Recorder,
    dispatcher: ActivityDispatcher,
    request: ActivityRequest,
    *,
    record_backoff: tuple[float, float],
) -> RecordOutcome | None:
    """Run one attempt and record its final outcome (single attempt: no retry policy).

    Returns ``None`` if the attempt was parked (cancelled: nothing recorded).
    A transient failure to record the outcome is retried on the given ladder
    until it lands, the activity is settled elsewhere, or the epoch closes.
    """
    epoch = recorder.epoch
    log_extra = {
        "workflow_id": request.workflow_id,
        "run_id": request.run_id,
        "activity": request.activity_id,
        "attempt": request.attempt,
    }
    # In flight (for the drain) until the outcome is recorded, not merely produced.
    epoch.attempt_started()
    try:
        outcome = await dispatcher.dispatch(request)
        return await _record_outcome(recorder, request, outcome_body(request, outcome), record_backoff, log_extra)
    finally:
        epoch.attempt_finished()


async def _record_outcome(
    recorder: Recorder,
    request: ActivityRequest,
    body: EventBody,
    record_backoff: tuple[float, float],
    log_extra: dict[str, Any],
) -> RecordOutcome:
    delay, ceiling = record_backoff
    attempts = 0
    while True:
        attempts += 1
        try:
            result = await record_activity_event(recorder, request.run_id, request.activity_id, body)
        except BackendUnavailable as exc:
            if attempts & (attempts - 1) == 0:
                logger.warning(
                    "could not record the outcome of activity:%d %s (attempt %d); retrying: %s",
                    request.activity_id,
                    request.activity_type,
                    request.attempt,
                    exc,
                    extra={**log_extra, "record_attempts": attempts},
                )
            await trio.sleep(delay)
            delay = min(delay * 2, ceiling)
            continue
        if result is RecordOutcome.EPOCH_CLOSED:
            logger.info(
                "activity:%d outcome not recorded: the engine is shutting down; recovery re-dispatches it",
                request.activity_id,
                extra=log_extra,
            )
        elif result is RecordOutcome.SETTLED_ELSEWHERE:
            logger.debug(
                "activity:%d was settled elsewhere; this outcome is dropped", request.activity_id, extra=log_extra
            )
        return result
