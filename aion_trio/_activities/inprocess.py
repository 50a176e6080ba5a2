"""The in-process dispatcher: registered activities run here, ``async def`` as Trio tasks (really
cancellable), plain ``def`` in worker threads (so a slow synchronous activity never blocks the
engine's Trio thread), asyncio coroutine functions through trio-asyncio."""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Mapping
from typing import Any, cast, final

import trio

from .._clock import hold_mock_time
from .._contain import being_cancelled, is_structural
from .._definitions import ActivityDefinition, ActivityLoop
from .._errors import (
    PayloadDecodeError,
    PayloadError,
    PolicyRefused,
    TerminalError,
    UnknownActivityType,
    WorkerLost,
)
from .._events import ActivityError, FailureCause
from .._payload import Payload, PayloadCodec
from .._retry import ActivityOptions
from .._watchdog import register_step
from .context import (
    ActivityInfo,
    Heartbeat,
    current_attempt_clock,
    current_heartbeat,
    current_heartbeat_sink,
    current_info,
    watch_heartbeat,
)
from .protocol import ActivityOutcome, ActivityRequest, OutcomeKind, error_from_exception
from .threads import HeldSlot, ThreadBook
from .tokens import CompleteAsync


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
        self._threads = ThreadBook()

    def abandoned_threads(self) -> int:
        """Activity threads the engine stopped waiting for that have not returned yet
        (each holds a ``max_activity_threads`` slot until it does)."""
        return self._threads.abandoned_count()

    def log_unaccounted_threads(self) -> None:
        """Log every activity thread still running (the engine calls it when it closes)."""
        self._threads.log_unaccounted()

    async def dispatch(self, request: ActivityRequest) -> ActivityOutcome:
        return await self.execute(request)

    async def execute(
        self, request: ActivityRequest, on_heartbeat: Callable[[Payload | None], None] | None = None
    ) -> ActivityOutcome:
        """Run one attempt here; ``on_heartbeat(details)`` hears each of its heartbeats, the
        details encoded with the codec (``None``: none, or not encodable).

        An :data:`ActivityExecutor`: remote activity workers run the attempts
        they claim through it, so every kind of activity behaves as it does in
        an engine's own process.
        """
        definition = self._activities.get(request.activity_type)
        if definition is None:
            error = UnknownActivityType(request.activity_type, sorted(self._activities))
            return ActivityOutcome(error=error_from_exception(error, FailureCause.TERMINAL))
        options = request.resolved_options()
        args = self._codec.decode(request.input)
        if not isinstance(args, list):
            args = [args]
        try:
            args = definition.hints.decode_arguments(args, what=f"input of activity {definition.name!r}")
        except PayloadDecodeError as exc:  # retrying cannot make the recorded input fit
            return ActivityOutcome(error=error_from_exception(exc, FailureCause.TERMINAL))
        info = ActivityInfo(
            workflow_id=request.workflow_id,
            run_id=request.run_id,
            activity_id=request.activity_id,
            activity_type=request.activity_type,
            attempt=request.attempt,
            task_queue=request.task_queue,
            heartbeat_details=(
                None if request.heartbeat_details is None else self._codec.decode(request.heartbeat_details)
            ),
        )
        tracker = Heartbeat(options.heartbeat_timeout, self._details_sink(on_heartbeat), info)
        info_token = current_info.set(info)
        beat_token = current_heartbeat.set(tracker)
        scope: trio.CancelScope | None = None
        outcome: ActivityOutcome | None = None
        value: Any = None
        try:
            if options.heartbeat_timeout is None:
                # No watchdog can cancel the attempt: no scope needed.
                value, outcome = await self._guarded_call(definition, args, options)
            else:
                scope = trio.CancelScope()
                watch = trio.CancelScope()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(watch_heartbeat, tracker, scope, watch)
                    try:
                        with scope:
                            value, outcome = await self._guarded_call(definition, args, options)
                    finally:
                        watch.cancel()
        finally:
            current_heartbeat.reset(beat_token)
            current_info.reset(info_token)
        if outcome is not None:
            return outcome
        if scope is not None and scope.cancelled_caught and tracker.expired:
            return ActivityOutcome(
                error=ActivityError(
                    cause=FailureCause.TIMEOUT,
                    type="HeartbeatTimeout",
                    message=f"attempt {request.attempt} sent no heartbeat for {options.heartbeat_timeout}s",
                )
            )
        try:
            payload = self._codec.encode(value, what=f"result of activity {definition.name!r}")
        except PayloadError as exc:
            return ActivityOutcome(error=error_from_exception(exc, FailureCause.TERMINAL))
        return ActivityOutcome(result=payload)

    def _details_sink(
        self, on_heartbeat: Callable[[Payload | None], None] | None
    ) -> Callable[[Any], None] | None:
        """What hears each beat, given its details encoded with the codec: ``on_heartbeat``
        (a remote worker's: every beat, ``None`` without details), else the driver's sink (if
        it listens: beats with details).  Details the codec cannot encode are not kept."""
        sink = current_heartbeat_sink.get() if on_heartbeat is None else None
        if on_heartbeat is None and sink is None:
            return None
        codec = self._codec

        def keep(details: Any) -> None:
            encoded: Payload | None = None
            if details is not None:
                try:
                    encoded = codec.encode(details, what="heartbeat details")
                except PayloadError:
                    encoded = None
            if on_heartbeat is not None:
                on_heartbeat(encoded)
            elif encoded is not None and sink is not None:
                sink(encoded)

        return keep

    async def _guarded_call(
        self, definition: ActivityDefinition[Any], args: list[Any], options: ActivityOptions
    ) -> tuple[Any, ActivityOutcome | None]:
        """Run the activity; an exception becomes a classified outcome."""
        try:
            return await self._call(definition, args), None
        except TerminalError as exc:
            return None, ActivityOutcome(error=error_from_exception(exc, FailureCause.TERMINAL))
        except PolicyRefused as exc:
            return None, ActivityOutcome(error=error_from_exception(exc, FailureCause.POLICY_REFUSED))
        except WorkerLost as exc:
            return None, ActivityOutcome(
                error=error_from_exception(exc, FailureCause.RETRYABLE), kind=OutcomeKind.WORKER_LOST
            )
        except CompleteAsync:
            return None, ActivityOutcome(kind=OutcomeKind.ASYNC)
        except BaseException as exc:
            # Any exception of the code's own (SystemExit, a custom BaseException,
            # asyncio's CancelledError...) fails the attempt; only the engine's
            # cancellation and a Ctrl-C pass (see _contain).
            if is_structural(exc):
                raise
            if being_cancelled():
                # Raised while the engine cancels the attempt: that is the cancellation.
                await trio.lowlevel.checkpoint()
            retry = options.retry
            cause = (
                FailureCause.TERMINAL
                if retry is not None and retry.is_non_retryable(exc)
                else FailureCause.RETRYABLE
            )
            return None, ActivityOutcome(error=error_from_exception(exc, cause))

    async def _call_in_thread(self, definition: ActivityDefinition[Any], args: list[Any]) -> Any:
        """Run a plain ``def`` activity in a worker thread.

        Threads cannot be interrupted: a stopped attempt abandons its thread
        (its late result is discarded), tells it (``heartbeat()`` raises,
        ``activity_cancelled()`` is true) and logs it; the thread keeps its
        slot until it really returns.  The attempt's ``timeout`` starts once a
        slot is held.
        """
        tracker = current_heartbeat.get()
        info = current_info.get()
        assert tracker is not None
        assert info is not None
        limiter = self._limiter or trio.to_thread.current_default_thread_limiter()
        slot = HeldSlot(limiter)
        clock = current_attempt_clock.get()
        if clock is not None:
            clock.queued()
        await limiter.acquire_on_behalf_of(slot)
        if clock is not None:
            clock.started()
        thread = self._threads.started(info)
        context = contextvars.copy_context()
        book = self._threads

        def work() -> Any:
            try:
                return context.run(definition.fn, *args)
            finally:
                book.returned(thread)

        try:
            with hold_mock_time():  # a MockClock's autojump waits for the thread
                return await trio.to_thread.run_sync(
                    work,
                    abandon_on_cancel=True,
                    limiter=cast("trio.CapacityLimiter", slot),  # a limiter by protocol
                    thread_name=f"aion_trio activity {definition.name}",
                )
        except BaseException:
            # Stopped while the thread runs (cancel, terminate, a timeout, shutdown): tell it.
            tracker.stopped = True
            if slot.taken:  # else the thread never started
                book.abandoned(thread)
            raise
        finally:
            if not slot.taken:  # the thread never started: the slot is still ours
                book.returned(thread)
                limiter.release_on_behalf_of(slot)

    async def _call(self, definition: ActivityDefinition[Any], args: list[Any]) -> Any:
        if definition.loop is ActivityLoop.TRIO:
            return await definition.fn(*args)
        if definition.loop is ActivityLoop.THREAD:
            return await self._call_in_thread(definition, args)
        import trio_asyncio

        if self._asyncio_loop is None:  # pragma: no cover - the engine opens one when needed
            raise RuntimeError("no asyncio loop is open for asyncio activities")
        return await trio_asyncio.aio_as_trio(definition.fn, loop=self._asyncio_loop)(*args)


def _stepped_activity(frame_locals: dict[str, Any]) -> str | None:
    request = frame_locals.get("request")
    if not isinstance(request, ActivityRequest):
        return None
    return (
        f"activity:{request.activity_id} {request.activity_type} (attempt {request.attempt}) "
        f"of workflow {request.workflow_id!r} run {request.run_id}"
    )


# A blocked Trio loop names the activity on its stack (see _watchdog).
register_step(InProcessDispatcher.execute, _stepped_activity)
