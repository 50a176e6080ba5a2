"""A process for the update crash test (tests/test_updates.py).

Usage: python -m tests.procs.update_worker STORE_PATH [die-after-accept]

Opens an engine on the SQLite store, starts workflow ``tally-1`` unless it runs
already, then calls ``engine.update("tally-1", "add", 5, update_id="add-5")``
and prints ``RETURNED <result>``.  With ``die-after-accept`` the store's
``append`` is wrapped: once a batch holding an ``UpdateAccepted`` is
committed, the process SIGKILLs itself -- the update is durable, its handler
has not run and the caller never heard.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence

import trio

import aion_trio as aion


@aion.workflow
async def tally(ctx: aion.WorkflowContext) -> int:
    total = 0
    closed = False

    @ctx.update_handler("add")
    def add(amount: int) -> int:
        nonlocal total
        total += amount
        return total

    @ctx.signal_handler("close")
    def close(_: object) -> None:
        nonlocal closed
        closed = True

    await ctx.wait_condition(lambda: closed)
    return total


async def main(path: str, die: bool) -> None:
    async with aion.open_store(f"sqlite:///{path}") as store:
        if die:
            real_append = store.events.append

            async def append(workflow_id: str, events: Sequence[aion.Event], expected_seq: int) -> None:
                await real_append(workflow_id, events, expected_seq)
                if any(isinstance(e.body, aion.UpdateAccepted) for e in events):
                    print(f"COMMITTED {[e.type for e in events]}", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)

            store.events.append = append  # type: ignore[method-assign]
        async with aion.open_engine(store, workflows=[tally]) as engine:
            await engine.start(tally, workflow_id="tally-1", id_reuse=aion.IdReusePolicy.USE_EXISTING)
            with trio.fail_after(60):
                result = await engine.update("tally-1", "add", 5, update_id="add-5")
            print(f"RETURNED {result}", flush=True)


if __name__ == "__main__":
    trio.run(main, sys.argv[1], sys.argv[2:] == ["die-after-accept"])
