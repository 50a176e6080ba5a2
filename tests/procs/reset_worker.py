"""A process for the reset crash test (tests/test_reset.py).

Usage: python -m tests.procs.reset_worker STORE_PATH CALLS_PATH (run | reset-die)

``run`` starts workflow ``job-1`` (steps a, b, c; each appends its name to
CALLS_PATH) and waits for it to complete.  ``reset-die`` calls ``engine.reset``
on it to just after step a, with request id ``r-1``; the store's ``append`` is
wrapped: once the batch holding ``WorkflowReset`` is committed, the process
SIGKILLs itself before the new run can take a step or the call can return.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import trio

import aion_trio as aion

CALLS = Path(sys.argv[2]) if len(sys.argv) > 2 else Path("calls.txt")


@aion.activity
async def step(name: str) -> str:
    with CALLS.open("a", encoding="utf-8") as f:
        f.write(name + "\n")
    return name


@aion.workflow
async def job(ctx: aion.WorkflowContext) -> list[str]:
    return [str(await ctx.run(step, n)) for n in ("a", "b", "c")]


async def main(path: str, mode: str) -> None:
    async with aion.open_store(f"sqlite:///{path}") as store:
        if mode == "reset-die":
            real_append = store.events.append

            async def append(workflow_id: str, events: Sequence[aion.Event], expected_seq: int) -> None:
                await real_append(workflow_id, events, expected_seq)
                if any(isinstance(e.body, aion.WorkflowReset) for e in events):
                    print(f"COMMITTED {[e.type for e in events]}", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)

            store.events.append = append  # type: ignore[method-assign]
        async with aion.open_engine(store, workflows=[job], activities=[step]) as engine:
            if mode == "run":
                run = await engine.start(job, workflow_id="job-1")
                print(f"RESULT {await run.result()}", flush=True)
                return
            history = await engine.history("job-1")
            point = next(e.seq for e in history if isinstance(e.body, aion.ActivityCompleted))
            handle = await engine.reset("job-1", to_seq=point, reason="redo b, c", request_id="r-1")
            print(f"RETURNED {handle.run_id}", flush=True)


if __name__ == "__main__":
    trio.run(main, sys.argv[1], sys.argv[3])
