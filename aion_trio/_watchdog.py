"""A watchdog thread that notices a blocked Trio loop (issue 14, item 6).

An ``async def`` activity or workflow code that blocks the Trio thread (a
``time.sleep``, a synchronous HTTP call, a CPU-bound loop) stalls every run of
the engine, and its timeout cannot fire.  The watchdog is a thread: every
quarter of the threshold it hands the loop a no-op through
``TrioToken.run_sync_soon`` and waits for it to run.  An answer overdue by the
threshold means the loop is blocked: the thread then looks at the Trio
thread's current stack (``sys._current_frames``) and names the activity or
workflow being stepped, found from the engine's own frames on that stack
(:func:`register_step`), and the code line it is blocked in; once the loop
answers again it logs how long the block lasted.

Nothing runs on the hot path: the engine does not record a "current step";
the stack is read only when a block is seen.  The only cost is the loop
waking for the no-op a few times per threshold, and the thread itself.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable
from typing import Any, final

import trio

logger = logging.getLogger("aion_trio.watchdog")

#: code object of an engine function -> describe(its frame's locals): what it steps.
_STEPS: dict[types.CodeType, Callable[[dict[str, Any]], str | None]] = {}


def register_step(function: Callable[..., Any], describe: Callable[[dict[str, Any]], str | None]) -> None:
    """``function``'s frames on the blocked stack say what is being stepped: ``describe(locals)``."""
    code = getattr(function, "__code__", None)
    assert code is not None, function
    _STEPS[code] = describe


def describe_stack(frame: types.FrameType | None) -> tuple[str, str]:
    """(what is being stepped, where it is blocked) for a stack whose innermost frame is ``frame``."""
    where = "an unknown place"
    if frame is not None:
        summary = traceback.extract_stack(frame, limit=1)
        if summary:
            top = summary[-1]
            where = f"{top.name} ({top.filename}:{top.lineno})"
    current = frame
    while current is not None:
        describe = _STEPS.get(current.f_code)
        if describe is not None:
            try:
                step = describe(current.f_locals)
            except Exception:  # pragma: no cover - a describe bug must not kill the watchdog
                step = None
            if step is not None:
                return step, where
        current = current.f_back
    return "no activity or workflow step (the engine itself, or code it calls)", where


@final
class LoopWatchdog:
    """The watchdog thread of one engine (see the module docstring)."""

    def __init__(self, threshold: float) -> None:
        self._threshold = threshold
        self._interval = threshold / 4
        self._token = trio.lowlevel.current_trio_token()
        self._trio_thread = threading.get_ident()
        self._stop = threading.Event()
        self._answered_at = 0.0  # written by the Trio thread (a float store: atomic)
        self._thread = threading.Thread(target=self._run, name="aion_trio loop watchdog", daemon=True)
        #: Blocks seen so far (for tests and statistics).
        self.stalls = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """End the thread (idempotent); returns once it has."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _answer(self) -> None:
        self._answered_at = time.monotonic()

    def _run(self) -> None:
        while not self._stop.is_set():
            sent = time.monotonic()
            try:
                self._token.run_sync_soon(self._answer)
            except trio.RunFinishedError:
                return
            reported: str | None = None
            while self._answered_at < sent:
                if self._stop.wait(self._interval):
                    return
                blocked = time.monotonic() - sent
                if reported is None and blocked >= self._threshold:
                    reported = self._report(blocked)
            if reported is not None:
                logger.warning(
                    "the Trio loop was blocked for %.2fs in all by %s; every run of the engine waited",
                    self._answered_at - sent,
                    reported,
                    extra={"blocked_seconds": self._answered_at - sent},
                )
            if self._stop.wait(self._interval):
                return

    def _report(self, blocked: float) -> str:
        self.stalls += 1
        frame = sys._current_frames().get(self._trio_thread)
        step, where = describe_stack(frame)
        logger.warning(
            "the Trio loop has been blocked for %.2fs by %s, in %s: code in the Trio thread must not block "
            "(make the activity a plain def, which runs in a thread, or await the async form of the call)",
            blocked,
            step,
            where,
            extra={"blocked_seconds": blocked, "step": step},
        )
        return step
