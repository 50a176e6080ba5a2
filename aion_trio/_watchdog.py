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

import attrs
import trio

logger = logging.getLogger("aion_trio.watchdog")

#: code object of an engine function -> describe(its frame's locals): what it steps.
_STEPS: dict[types.CodeType, Callable[[dict[str, Any]], str | None]] = {}


def register_step(function: Callable[..., Any], describe: Callable[[dict[str, Any]], str | None]) -> None:
    """``function``'s frames on the blocked stack say what is being stepped: ``describe(locals)``."""
    code = getattr(function, "__code__", None)
    assert code is not None, function
    _STEPS[code] = describe


def describe_stack(frame: types.FrameType | None) -> tuple[types.FrameType | None, str, str]:
    """(the frame that holds the loop, what is being stepped, where it is) for a stack whose
    innermost frame is ``frame``.  The holder is the engine frame stepping an activity or a
    workflow when there is one on the stack, else the innermost frame."""
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
                return current, step, where
        current = current.f_back
    return frame, "no activity or workflow step (the engine itself, or code it calls)", where


@final
@attrs.frozen
class _Sample:
    holder: types.FrameType | None
    step: str
    where: str


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
        while True:
            sent = time.monotonic()
            try:
                self._token.run_sync_soon(self._answer)
            except trio.RunFinishedError:
                return
            # While the answer is overdue, the Trio thread's stack is sampled every interval.
            samples: list[_Sample] = []
            reported = False
            while True:
                if self._stop.wait(self._interval):
                    return
                if self._answered_at >= sent:
                    break
                samples.append(self._sample())
                waited = time.monotonic() - sent
                if not reported and waited >= self._threshold:
                    self._report(waited, samples)
                    reported = True
            if reported:
                self._report_end(self._answered_at - sent, samples)

    def _sample(self) -> _Sample:
        return _Sample(*describe_stack(sys._current_frames().get(self._trio_thread)))

    @staticmethod
    def _culprit(samples: list[_Sample]) -> _Sample | None:
        """The one step that held the loop in every sample, if there is one: a block.  Different
        holders mean a busy loop (a long turn of many short steps), which no single step caused."""
        first = samples[0]
        if first.holder is None or len(samples) < 2 or any(s.holder is not first.holder for s in samples):
            return None
        return first

    def _report(self, waited: float, samples: list[_Sample]) -> None:
        self.stalls += 1
        culprit = self._culprit(samples)
        if culprit is not None:
            logger.warning(
                "the Trio loop has been blocked for %.2fs by %s, in %s: code in the Trio thread must not "
                "block (make the activity a plain def, which runs in a thread, or await the async form of "
                "the call)",
                waited,
                culprit.step,
                culprit.where,
                extra={"blocked_seconds": waited, "step": culprit.step},
            )
            return
        steps = list(dict.fromkeys(s.step for s in samples))
        logger.warning(
            "the Trio loop has been busy for %.2fs without a pause, no single step held it throughout "
            "(seen: %s); every timer and I/O wait of the engine is late meanwhile",
            waited,
            "; ".join(steps[:5]) + ("; ..." if len(steps) > 5 else ""),
            extra={"blocked_seconds": waited},
        )

    def _report_end(self, lasted: float, samples: list[_Sample]) -> None:
        culprit = self._culprit(samples)
        if culprit is not None:
            logger.warning(
                "the Trio loop was blocked for %.2fs in all by %s; every run of the engine waited",
                lasted,
                culprit.step,
                extra={"blocked_seconds": lasted, "step": culprit.step},
            )
        else:
            logger.warning(
                "the Trio loop was busy for %.2fs in all without a pause; every run of the engine waited",
                lasted,
                extra={"blocked_seconds": lasted},
            )
