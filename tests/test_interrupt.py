"""Ctrl-C for the command line (``aion_trio._interrupt``): SIGINT cancels the command's code
at its next checkpoint, and ``Interrupted`` comes out of the run.

Left to Trio's default, a SIGINT raised ``KeyboardInterrupt`` wherever the main
thread was: about one Ctrl-C in 40 to ``aion-trio start`` printed a "coroutine
was never awaited" warning or a ``TrioInternalError`` instead of one
``Error: interrupted`` line.
"""

from __future__ import annotations

import os
import signal

import pytest
import trio
import trio.lowlevel

from aion_trio._interrupt import Interrupted, run_interruptible


def test_a_sigint_cancels_the_code_at_its_next_checkpoint_never_inside_synchronous_code() -> None:
    seen: list[str] = []

    async def command() -> None:
        os.kill(os.getpid(), signal.SIGINT)
        total = 0
        for i in range(200_000):  # synchronous code: a KeyboardInterrupt used to land in here
            total += i
        seen.append("synchronous code finished")
        try:
            await trio.sleep_forever()
        finally:
            seen.append("unwound")

    with pytest.raises(Interrupted):
        run_interruptible(command)
    assert seen == ["synchronous code finished", "unwound"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored


def test_a_command_that_finishes_returns_its_result_and_its_errors_come_out_as_they_are() -> None:
    async def answer() -> int:
        await trio.lowlevel.checkpoint()
        return 42

    async def broken() -> None:
        await trio.lowlevel.checkpoint()
        raise LookupError("no such thing")

    assert run_interruptible(answer) == 42
    with pytest.raises(LookupError, match="no such thing"):  # not wrapped in an exception group
        run_interruptible(broken)


async def test_a_command_run_from_another_thread_runs_without_a_signal_handler() -> None:
    # Python delivers signals to the main thread only; a receiver cannot be opened elsewhere.
    async def answer() -> int:
        await trio.lowlevel.checkpoint()
        return 7

    with trio.fail_after(30):
        assert await trio.to_thread.run_sync(run_interruptible, answer) == 7
