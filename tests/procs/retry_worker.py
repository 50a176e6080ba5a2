"""A child process for the crash-mid-backoff test.

Usage: python -m tests.procs.retry_worker STORE_PATH SIDE_PATH

One workflow runs one activity under a policy with a one-second backoff.  The
activity writes each attempt number it sees, with the wall time, to a side
file and fails its first attempt.  Prints ``RESULT <value>`` and exits once the workflow is done.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import trio

import aion_trio as aion

SIDE = Path()


@aion.activity(retry=aion.RetryPolicy(max_attempts=3, backoff=aion.Fixed(1)))
async def flaky() -> str:
    attempt = aion.activity_info().attempt
    async with await trio.open_file(SIDE, "a") as f:
        await f.write(f"{attempt} {time.time()!r}\n")
    if attempt == 1:
        raise ConnectionError("first attempt always fails")
    return f"succeeded on attempt {attempt}"


@aion.workflow
async def retrying(ctx: aion.WorkflowContext) -> str:
    return str(await ctx.run(flaky))


async def main(store: str) -> None:
    async with aion.open_engine(f"sqlite:///{store}", workflows=[retrying], activities=[flaky]) as engine:
        run = await engine.start(retrying, workflow_id="retry-me", id_reuse=aion.IdReusePolicy.USE_EXISTING)
        print("RESULT", await run.result(), flush=True)


if __name__ == "__main__":
    SIDE = Path(sys.argv[2])
    trio.run(main, sys.argv[1])
