"""A periodic job: one run per day, chained with continue-as-new.

    python examples/periodic.py                 # 5 nightly runs
    python examples/periodic.py --runs 30

The ``nightly_cleanup`` workflow does one day's work (an activity), sleeps on a
durable timer until the next day, then ``raise ctx.continue_as_new(...)``: the
run ends and a fresh run of the same workflow id starts with the new input.
All runs are kept in the workflow's one append-only history, but a run's code
only ever reads its own segment of it: after a crash on day 300 the engine
replays that day's run, not 300 days of decisions, which a loop of
``ctx.sleep`` inside one run would make it do.  State carried from run to run
travels in the arguments (here the day number and a running total).

After ``--runs`` runs it returns, and ``engine.result(...)`` (which follows
the chain) gives the last run's result.  The script then prints the run chain
from the workflow's history: every run, when it started (durable time) and
how it ended.

It runs under Trio's ``MockClock`` with autojump on the memory store, so the
days between runs pass instantly: when every task is blocked on a timer, time
jumps to the next deadline.  (The SQLite store does its I/O in a worker
thread, and autojump would also let time jump while it works; with the real
clock and the SQLite store, the same code really waits a day.)
"""

from __future__ import annotations

import argparse
from datetime import timedelta
from typing import Any

import trio
import trio.testing

import aion_trio as aion
from aion_trio import projections


@aion.activity
async def clean_up(day: int) -> int:
    """One day's work; returns how many stale records it removed (made up: 10 + day)."""
    return 10 + day


@aion.workflow
async def nightly_cleanup(ctx: aion.WorkflowContext, day: int, runs: int, removed: int) -> dict[str, Any]:
    removed += await ctx.run(clean_up, day)
    if day == runs:
        return {"days": day, "removed": removed}
    await ctx.sleep(timedelta(days=1))  # durable: survives restarts
    # End this run; a new run (same workflow id, fresh history segment) starts with these arguments.
    raise ctx.continue_as_new(day + 1, runs, removed)


async def main(runs: int) -> None:
    async with aion.open_engine("memory://", workflows=[nightly_cleanup], activities=[clean_up]) as engine:
        await engine.start(nightly_cleanup, 1, runs, 0, workflow_id="nightly-cleanup")
        result = await engine.result("nightly-cleanup")  # follows the chain to its last run
        history = await engine.history("nightly-cleanup")
    chain = projections.run_ids(history)
    first_start = projections.start_event(history, chain[0])
    assert first_start is not None
    print(f"{len(chain)} run(s) of nightly-cleanup, one history of {len(history)} events:")
    for number, run_id in enumerate(chain, 1):
        start = projections.start_event(history, run_id)
        assert start is not None
        day = (start.recorded_at - first_start.recorded_at) / timedelta(days=1)
        status = projections.run_status(history, run_id)
        assert status is not None
        events = len(projections.run_segment(history, run_id))
        parent = start.body.parent_run_id if isinstance(start.body, aion.WorkflowStarted) else None
        after = f"after run {chain.index(parent) + 1}" if parent else "first"
        print(f"  run {number} ({after}): started on day {day:.0f}, {events} events, {status.value}")
    print(f"result: removed {result['removed']} records over {result['days']} day(s)")


def cli() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=5, help="how many daily runs before the job stops")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    trio.run(main, args.runs, clock=trio.testing.MockClock(autojump_threshold=0))


if __name__ == "__main__":
    cli()
