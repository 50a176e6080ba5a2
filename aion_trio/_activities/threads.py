"""Activity threads: slots taken before a thread starts, and the book of threads in flight
(the ones the engine stopped waiting for are logged)."""

from __future__ import annotations

import threading
import time
from typing import Any, final

import attrs
import trio

from .._logs import ContextLogger
from .context import ActivityInfo

logger = ContextLogger("aion_trio.activity")


@final
class HeldSlot:
    """A thread-limiter slot taken before the thread starts (so its wait is not the attempt's
    time), handed to ``trio.to_thread.run_sync``, which gives it back when the thread returns."""

    __slots__ = ("_limiter", "taken")

    def __init__(self, limiter: trio.CapacityLimiter) -> None:
        self._limiter = limiter
        self.taken = False

    async def acquire_on_behalf_of(self, borrower: object) -> None:
        self.taken = True  # already held; no checkpoint, so no cancellation can lose it

    def release_on_behalf_of(self, borrower: object) -> None:
        self._limiter.release_on_behalf_of(self)


@final
@attrs.define(eq=False)
class _ActivityThread:
    info: ActivityInfo
    started: float  # time.monotonic()
    done: bool = False
    abandoned_at: float | None = None


@final
class ThreadBook:
    """Every activity thread in flight; the ones the engine stopped waiting for are logged."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[int, _ActivityThread] = {}

    def started(self, info: ActivityInfo) -> _ActivityThread:
        thread = _ActivityThread(info=info, started=time.monotonic())
        with self._lock:
            self._running[id(thread)] = thread
        return thread

    def returned(self, thread: _ActivityThread) -> None:
        # In the activity's thread, as it returns.
        with self._lock:
            thread.done = True
            self._running.pop(id(thread), None)
        if thread.abandoned_at is not None:
            logger.info(
                "its abandoned thread returned %.3fs after it was told to stop; its thread slot is free",
                time.monotonic() - thread.abandoned_at,
                extra=_thread_fields(thread),
            )

    def abandoned(self, thread: _ActivityThread) -> None:
        with self._lock:
            if thread.done:
                return
            thread.abandoned_at = time.monotonic()
        logger.warning(
            "the attempt was stopped while running in a thread; the thread runs on (told through "
            "aion_trio.heartbeat() / activity_cancelled()) and holds one of max_activity_threads "
            "until it returns",
            extra=_thread_fields(thread),
        )

    def abandoned_count(self) -> int:
        with self._lock:
            return sum(1 for t in self._running.values() if t.abandoned_at is not None)

    def log_unaccounted(self) -> None:
        """At engine close: name every activity thread still running."""
        with self._lock:
            running = list(self._running.values())
        if not running:
            return
        now = time.monotonic()
        logger.warning(
            "the engine closed with %d activity thread(s) still running (told to stop; their results "
            "are discarded): %s",
            len(running),
            "; ".join(
                f"{t.info.workflow_id} activity:{t.info.activity_id} {t.info.activity_type} "
                f"attempt {t.info.attempt}, running {now - t.started:.1f}s"
                for t in running
            ),
            extra={"threads": len(running)},
        )


def _thread_fields(thread: _ActivityThread) -> dict[str, Any]:
    info = thread.info
    return {
        "workflow_id": info.workflow_id,
        "run_id": info.run_id,
        "activity": info.activity_id,
        "activity_type": info.activity_type,
        "attempt": info.attempt,
    }
