"""Hello world: one workflow, one activity, on the embedded SQLite store.

    python examples/hello.py                          # a fresh database in a temporary directory
    python examples/hello.py --db hello.db --name Ann # keep the database; run it twice

The workflow calls one activity and returns what it said.  Every step is
recorded in the workflow's event history in the SQLite file, and the script
prints that history.  Run it twice with the same ``--db``: the second run finds
the workflow already completed and prints the recorded result without running
the activity again (the start uses ``IdReusePolicy.USE_EXISTING``, so it
re-attaches to the existing workflow instead of starting a new one).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import trio

import aion_trio as aion


# An activity does the real work (I/O, calls to other systems).  It runs at least
# once, so make it idempotent; its result is recorded and never recomputed.
@aion.activity
async def greet(name: str) -> str:
    return f"Hello, {name}!"


# A workflow decides what happens, and must be deterministic: it only talks to the
# outside world through ctx (activities, timers, signals), so a replay after a
# crash takes exactly the same path.
@aion.workflow
async def hello(ctx: aion.WorkflowContext, name: str) -> str:
    return await ctx.run(greet, name)


async def main(db: Path, name: str) -> None:
    async with aion.open_engine(f"sqlite:///{db}", workflows=[hello], activities=[greet]) as engine:
        workflow_id = f"hello-{name.lower()}"
        try:
            await engine.describe(workflow_id)
            existed = True
        except aion.WorkflowNotFound:
            existed = False
        run = await engine.start(
            hello, name, workflow_id=workflow_id, id_reuse=aion.IdReusePolicy.USE_EXISTING
        )
        result = await run.result()
        history = await engine.history(workflow_id)
    if existed:
        print(f"{workflow_id} was already in {db.name}: the recorded result, nothing re-run")
    print(f"result: {result}")
    print("history: " + " -> ".join(event.type for event in history))


def cli() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--db", type=Path, help="SQLite file (default: one in a new temporary directory)")
    parser.add_argument("--name", default="World")
    args = parser.parse_args()
    if args.db is not None:
        trio.run(main, args.db, args.name)
        return
    with tempfile.TemporaryDirectory() as tmp:
        trio.run(main, Path(tmp) / "hello.db", args.name)


if __name__ == "__main__":
    cli()
