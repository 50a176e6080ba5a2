"""A child process for crash tests: N workflows x K activities on a SQLite file.

Usage: python -m tests.procs.crash_worker STORE_PATH SIDE_PATH GENERATION N K

Every activity execution is written to a side table (a separate SQLite file)
before the activity returns, so a test can count executions across SIGKILLs.
The process prints ``ALL DONE`` and exits 0 once every workflow has a result.
"""

from __future__ import annotations

import sqlite3
import sys
import time

import trio

import aion_trio as aion

SIDE: sqlite3.Connection | None = None
GENERATION = 0


def side() -> sqlite3.Connection:
    assert SIDE is not None
    return SIDE


@aion.activity
async def step(index: int, k: int) -> int:
    # Some time in flight, so kills land mid-activity.
    await trio.sleep(0.002 * ((index * 7 + k * 3) % 5))
    side().execute(
        "INSERT INTO executions (workflow, step, generation, at) VALUES (?, ?, ?, ?)",
        (f"wf-{index}", k, GENERATION, time.time()),
    )
    return index * 10 + k


@aion.workflow
async def chain(ctx: aion.WorkflowContext, index: int, steps: int) -> int:
    total = 0
    for k in range(steps):
        total += await ctx.run(step, index, k)
    return total


async def main(store_path: str, n: int, k: int) -> None:
    async with aion.open_engine(f"sqlite:///{store_path}", workflows=[chain], activities=[step]) as engine:
        handles = []
        for i in range(n):
            handles.append(
                await engine.start(
                    chain, i, k, workflow_id=f"wf-{i}", id_reuse=aion.IdReusePolicy.USE_EXISTING
                )
            )
        print("STARTED", flush=True)
        for handle in handles:
            await handle.result()
    print("ALL DONE", flush=True)


if __name__ == "__main__":
    store_path, side_path, generation, n, k = sys.argv[1:6]
    GENERATION = int(generation)
    SIDE = sqlite3.connect(side_path, isolation_level=None)
    SIDE.execute("PRAGMA journal_mode=WAL")
    SIDE.execute("PRAGMA synchronous=FULL")
    SIDE.execute(
        "CREATE TABLE IF NOT EXISTS executions (workflow TEXT, step INTEGER, generation INTEGER, at REAL)"
    )
    trio.run(main, store_path, int(n), int(k))
