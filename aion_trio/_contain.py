"""Which exceptions from user code are its own failure, and which are structural (issue 14, item 4).

Activity and workflow code may raise any ``BaseException``: ``SystemExit``,
``KeyboardInterrupt``, a custom subclass, ``asyncio.CancelledError`` from an
asyncio library.  Such an exception is the code's failure, recorded like any
other, so one bad run never takes the engine down (and again on every
restart).  Structural, and let through, are only:

- ``trio.Cancelled``: the engine's own cancellation (an attempt's timeout, a
  terminate, the epoch closing);
- ``GeneratorExit``: a coroutine being closed;
- a ``KeyboardInterrupt`` raised by Trio's SIGINT handler inside the code: the
  process is being interrupted (Ctrl-C), which is not the code's doing;
- a group holding any of these.

A ``KeyboardInterrupt`` that the code raised itself is its failure.  Threads
never receive signals, so a ``KeyboardInterrupt`` out of a plain ``def``
activity is always its own.
"""

from __future__ import annotations

import os
import sys

import trio

if sys.version_info < (3, 11):  # pragma: no cover - 3.11+ has it built in
    from exceptiongroup import BaseExceptionGroup  # type: ignore[import-not-found,unused-ignore]

# Trio raises a Ctrl-C's KeyboardInterrupt from its signal handler, a function
# named ``handler`` in this file: the innermost frame of such a traceback.
_TRIO_SIGINT_FILE = os.path.join("trio", "_core", "_ki.py")


def _from_sigint(exc: KeyboardInterrupt) -> bool:
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    return code.co_name == "handler" and code.co_filename.endswith(_TRIO_SIGINT_FILE)


def is_structural(exc: BaseException) -> bool:
    """Whether ``exc`` out of user code must propagate (see the module docstring)."""
    if isinstance(exc, Exception):
        return False
    if isinstance(exc, (trio.Cancelled, GeneratorExit)):
        return True
    if isinstance(exc, KeyboardInterrupt):
        return _from_sigint(exc)
    if isinstance(exc, BaseExceptionGroup):
        return any(is_structural(inner) for inner in exc.exceptions)
    return False


def being_cancelled() -> bool:
    """Whether the calling task is inside a cancelled scope (its next checkpoint raises ``Cancelled``)."""
    return trio.current_effective_deadline() == -float("inf")
