"""A process for the signal-with-start crash test (tests/test_signal_with_start.py).

Usage: python -m tests.procs.signal_with_start_worker STORE_PATH [die-after-append]

Opens an engine on the SQLite store and calls ``signal_with_start`` for workflow
``cart-1`` with request id ``add-tea``, then prints ``RETURNED <run_id> <created>``
and exits.  With ``die-after-append`` the store's ``append`` is wrapped: once a
batch holding a ``SignalReceived`` is committed, the process SIGKILLs itself
before the call can return -- the start and the signal are durable, and the
caller never heard.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence

import trio

import aion_trio as aion


@aion.workflow
async def cart(ctx: aion.WorkflowContext) -> list[str]:
    items: list[str] = []
    ctx.set_signal_handler("add", items.append)
    await ctx.wait_condition(lambda: "checkout" in items)
    return items


async def main(path: str, die: bool) -> None:
    async with aion.open_store(f"sqlite:///{path}") as store:
        if die:
            real_append = store.events.append

            async def append(workflow_id: str, events: Sequence[aion.Event], expected_seq: int) -> None:
                await real_append(workflow_id, events, expected_seq)
                if any(isinstance(e.body, aion.SignalReceived) for e in events):
                    print(f"COMMITTED {[e.type for e in events]}", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)

            store.events.append = append  # type: ignore[method-assign]
        async with aion.open_engine(store, workflows=[cart]) as engine:
            handle = await engine.signal_with_start(
                cart, workflow_id="cart-1", signal="add", payload="tea", request_id="add-tea"
            )
            print(f"RETURNED {handle.run_id} {handle.created}", flush=True)


if __name__ == "__main__":
    trio.run(main, sys.argv[1], sys.argv[2:] == ["die-after-append"])
