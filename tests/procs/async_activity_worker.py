"""A process for the async-completion tests (tests/test_async_completion_procs.py).

Usage: python -m tests.procs.async_activity_worker STORE_PATH MODE

Opens an engine on the SQLite store and starts workflow ``approval-1`` unless it
runs already.  Its activity ``ask_approval`` appends a line to ``STORE_PATH.asked``
per call (the activity's code running twice would show), writes its task token
to ``STORE_PATH.token`` and calls ``aion.complete_async()``.  Once the attempt's
async-completion marker is recorded the process prints ``TOKEN <token>``, then:

* ``die``: SIGKILLs itself (the attempt stays open in the store);
* ``serve``: owns the store, applying queued commands, until the run ends, and
  prints ``RESULT <json>``.

Module-level ``workflows`` and ``activities`` make it an app for the CLI
(``-m tests.procs.async_activity_worker``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import trio

import aion_trio as aion

STORE = Path()


@aion.activity(timeout=3600)
def ask_approval(order: str) -> Any:
    with Path(f"{STORE}.asked").open("a", encoding="utf-8") as ledger:
        ledger.write(f"{order}\n")
    Path(f"{STORE}.token").write_text(aion.activity_info().task_token, encoding="utf-8")
    aion.complete_async()


@aion.workflow
async def approval(ctx: aion.WorkflowContext, order: str) -> Any:
    return await ctx.run(ask_approval, order)


workflows = [approval]
activities = [ask_approval]


def _awaiting(history: list[aion.Event]) -> bool:
    return any(
        isinstance(e.body, aion.MarkerRecorded) and e.body.name.startswith("async-completion:")
        for e in history
    )


async def main(mode: str) -> None:
    config = aion.EngineConfig(inbox_poll_interval=0.05)
    async with aion.open_engine(
        f"sqlite:///{STORE}", workflows=workflows, activities=activities, config=config
    ) as engine:
        run = await engine.start(
            approval, "order-1", workflow_id="approval-1", id_reuse=aion.IdReusePolicy.USE_EXISTING
        )
        with trio.fail_after(60):
            # Another process waits on this one's output: nothing to wait on but the store.
            while not _awaiting(await engine.history("approval-1")):  # noqa: ASYNC110
                await trio.sleep(0.01)
        token = await trio.Path(f"{STORE}.token").read_text(encoding="utf-8")
        print(f"TOKEN {token}", flush=True)
        if mode == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        with trio.fail_after(60):
            result = await run.result()
        print(f"RESULT {json.dumps(result)}", flush=True)


if __name__ == "__main__":
    STORE = Path(sys.argv[1])
    trio.run(main, sys.argv[2])
