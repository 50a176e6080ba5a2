"""Ctrl-C for the command line: SIGINT cancels the running command cleanly.

Left to Trio's default, a SIGINT raises ``KeyboardInterrupt`` wherever the
main thread happens to be.  In a process with store threads and an engine
that can be between creating a task's coroutine and awaiting it (a
"coroutine was never awaited" warning on the user's terminal), or inside
Trio's own bookkeeping (``TrioInternalError``, and a thread's wake-up then
writing to a closed socket).  :func:`run_interruptible` takes the signal as
a message instead: the first SIGINT cancels the command's code, which
unwinds through every ``finally`` and ``async with`` as any cancellation
does (the engine closes its epoch, the stores close), and then
:class:`Interrupted` is raised out of ``trio.run``.

A command with its own handling of SIGINT (the worker's drain) opens its
own receiver inside; the most recently opened receiver gets the signal.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import trio

T = TypeVar("T")


class Interrupted(Exception):
    """SIGINT (Ctrl-C) arrived while the command ran; its code was cancelled and unwound."""


def run_interruptible(fn: Callable[[], Awaitable[T]]) -> T:
    """``trio.run(fn)``, with SIGINT cancelling ``fn`` and raising :class:`Interrupted`.

    In the main thread a SIGINT handler is installed while ``fn`` runs (the
    previous one restored afterwards).  In any other thread (a command run from
    a worker thread of an application) this is ``trio.run(fn)``: Python delivers
    signals to the main thread only, so none can interrupt this one.
    """
    if threading.current_thread() is not threading.main_thread():
        return trio.run(fn)
    return trio.run(_until_interrupted, fn)


async def _until_interrupted(fn: Callable[[], Awaitable[T]]) -> T:
    # ``fn`` runs in this (the main) task, not in a nursery, so what it raises comes out
    # of ``trio.run`` as it is; the listener is a system task, stopped before its receiver
    # closes (whether or not it got to wait on it yet).
    done: list[T] = []
    listening = trio.CancelScope()
    with trio.open_signal_receiver(signal.SIGINT) as signals:
        try:
            with trio.CancelScope() as command:
                trio.lowlevel.spawn_system_task(
                    _cancel_on_first, signals, command, listening, name="aion_trio: Ctrl-C"
                )
                done.append(await fn())
        finally:
            listening.cancel()
    if not done:  # only the listener cancels the command's scope
        raise Interrupted("interrupted")
    return done[0]


async def _cancel_on_first(
    signals: AsyncIterator[int], command: trio.CancelScope, listening: trio.CancelScope
) -> None:
    with listening:
        await trio.lowlevel.checkpoint()  # stopped already: never touch the closed receiver
        async for _ in signals:
            command.cancel()
            return
