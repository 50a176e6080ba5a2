"""Human in the loop: an expense waits days for an approval signal, escalates on timeout.

    python examples/approval.py

Each expense asks the manager to approve it, then waits for a ``decision``
signal for at most two days (``ctx.wait_signal(..., timeout=...)``, a durable
timer).  If none comes, it escalates to the director, who has three more
days; after that it is rejected automatically.  A query handler exposes where
the expense stands, and the script itself plays the humans: it asks
(``engine.query``) and decides (``engine.signal``) at chosen moments:

* day 1: the manager approves ``exp-1``;
* day 2.5: ``exp-2`` and ``exp-3`` have been escalated; the director approves ``exp-2``;
* ``exp-3`` is never answered and is rejected at day 5 (its second timeout).

Why a mock clock and the memory store: the story spans five days.  It runs
under Trio's ``MockClock`` with autojump, so whenever every task is blocked
(each workflow waits for a signal or a timer, the script sleeps until its next
move) time jumps straight to the next deadline, and five days pass in
milliseconds.  The engine's durable time (``ctx.now()``, timer fire times)
follows Trio's clock, so the histories record days passing.  The memory store
does everything inside Trio; the SQLite store does its I/O in a worker thread,
and autojump would also let time jump while such a thread works.  This is how
to test workflows that wait for days.  In production the same workflow code
runs under the real clock on the SQLite store, and waits really are days.
"""

from __future__ import annotations

import argparse
import time
from datetime import timedelta
from typing import Any

import trio
import trio.testing

import aion_trio as aion

DAY = 86400.0  # seconds


@aion.activity
async def notify(who: str, expense: dict[str, Any]) -> str:
    return f"asked {who} to approve {expense['id']}"  # e.g. an e-mail or a chat message


@aion.activity
async def pay(expense: dict[str, Any]) -> str:
    return f"paid {expense['amount']:.2f}"


@aion.workflow
async def expense_approval(ctx: aion.WorkflowContext, expense: dict[str, Any]) -> dict[str, Any]:
    started = ctx.now()
    state = {"stage": "waiting for the manager"}

    # Queries read this state between the workflow's steps; they never change it.
    @ctx.query_handler
    def status() -> dict[str, Any]:
        return dict(state)

    await ctx.run(notify, "manager", expense)
    try:
        decision = await ctx.wait_signal("decision", timeout=timedelta(days=2))
    except aion.Timeout:
        # Two days without an answer: escalate.  The expiry is recorded, so a replay
        # after a crash takes this same branch.
        state["stage"] = "escalated to the director"
        await ctx.run(notify, "director", expense)
        try:
            decision = await ctx.wait_signal("decision", timeout=timedelta(days=3))
        except aion.Timeout:
            decision = {"approved": False, "by": "nobody (auto-rejected)"}
    state["stage"] = "approved" if decision["approved"] else "rejected"
    paid = await ctx.run(pay, expense) if decision["approved"] else "not paid"
    return {
        "outcome": state["stage"],
        "by": decision["by"],
        "days": (ctx.now() - started) / timedelta(days=1),  # durable time: recorded, replays alike
        "payment": paid,
    }


EXPENSES = [
    {"id": "exp-1", "amount": 120.0},
    {"id": "exp-2", "amount": 80.5},
    {"id": "exp-3", "amount": 42.0},
]


async def main() -> None:
    async with aion.open_engine(
        "memory://", workflows=[expense_approval], activities=[notify, pay]
    ) as engine:
        t0 = trio.current_time()

        def say(text: str) -> None:
            print(f"day {(trio.current_time() - t0) / DAY:.1f}: {text}")

        async def show(expense_id: str) -> None:
            say(f"{expense_id} is {(await engine.query(expense_id, 'status'))['stage']}")

        for expense in EXPENSES:
            await engine.start(expense_approval, expense, workflow_id=expense["id"])
        for expense in EXPENSES:
            await show(expense["id"])

        await trio.sleep(1 * DAY)  # mock time: jumps here at once
        say("the manager approves exp-1")
        await engine.signal("exp-1", "decision", {"approved": True, "by": "the manager"})

        await trio.sleep(1.5 * DAY)  # now day 2.5: exp-2 and exp-3 timed out at day 2
        await show("exp-2")
        await show("exp-3")
        say("the director approves exp-2")
        await engine.signal("exp-2", "decision", {"approved": True, "by": "the director"})

        for expense in EXPENSES:
            r = await engine.result(expense["id"])
            print(f"{expense['id']}: {r['outcome']} by {r['by']} after {r['days']:.1f} days, {r['payment']}")
        print(f"simulated time: {(trio.current_time() - t0) / DAY:.1f} days")


if __name__ == "__main__":
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()
    real_start = time.monotonic()
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    print(f"real time: {time.monotonic() - real_start:.2f} s")
