"""An order saga in simulated time: reserve, charge, wait up to two days for the
shipping signal, and compensate on a declined card, a missed shipment or a cancel.

    python examples/order_saga.py                  # 30 orders in ./saga.db
    python examples/order_saga.py --orders 100 --db /tmp/saga.db

Time is Trio's ``MockClock``: whenever every task is blocked (all orders wait
for their shipping signal), time jumps ahead, so the two-day timeout passes in
milliseconds.  The clock waits ``--idle`` real seconds of quiet before each
jump, so the SQLite store's I/O (done in a worker thread) never lets time skip
ahead mid-step.  Kill it (``kill -9``) and run the same command again: the
orders resume from the database, timers included.

Which order does what is decided by its number, so a rerun asks the same:
every 5th order's card is declined, every 4th is never shipped (the two-day
timeout refunds it), every 7th is cancelled, the rest ship.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import Counter
from datetime import timedelta
from typing import Any

import trio
import trio.testing

import aion_trio as aion

RETRY = aion.RetryPolicy(max_attempts=3, backoff=aion.Fixed(delay=60))


@aion.activity(retry=RETRY)
async def reserve(order: dict[str, Any]) -> str:
    if aion.activity_info().attempt == 1 and order["n"] % 3 == 0:
        raise ConnectionError("inventory busy")  # transient: retried a minute later
    return f"reservation-{order['n']}"


@aion.activity
async def charge(order: dict[str, Any]) -> str:
    if order["n"] % 5 == 0:
        raise aion.TerminalError("card declined")
    return f"charge-{order['n']}"


@aion.activity
async def refund(charge_id: str) -> str:
    return f"refunded {charge_id}"


@aion.activity
async def release(reservation: str) -> str:
    return f"released {reservation}"


@aion.workflow
async def order_saga(ctx: aion.WorkflowContext, order: dict[str, Any]) -> dict[str, Any]:
    reserving = ctx.start(reserve, order)
    charging: aion.ActivityHandle[str] | None = None
    try:
        reservation = await reserving
        charging = ctx.start(charge, order)
        try:
            charge_id = await charging
        except aion.ActivityFailure as failure:
            released = await ctx.run(release, reservation)
            return {"outcome": "declined", "reason": failure.error.message, "compensation": [released]}
        try:
            tracking = await ctx.wait_signal("shipped", timeout=timedelta(days=2))
        except aion.Timeout:
            done = [await ctx.run(refund, charge_id), await ctx.run(release, reservation)]
            return {"outcome": "not shipped in time", "compensation": done}
        return {"outcome": "shipped", "tracking": tracking}
    except aion.WorkflowCancelled:
        with ctx.cleanup():  # these awaits are not interrupted by the cancellation
            await undo(ctx, reserving, charging)
        raise


async def undo(
    ctx: aion.WorkflowContext, reserving: aion.ActivityHandle[str], charging: aion.ActivityHandle[str] | None
) -> None:
    """Undo what happened: a handle awaited here gives its result, or raises if the step
    never completed (it was cancelled with the workflow, or failed)."""
    if charging is not None:
        try:
            await ctx.run(refund, await charging)
        except aion.ActivityFailure:
            pass  # never charged
    try:
        await ctx.run(release, await reserving)
    except aion.ActivityFailure:
        pass  # never reserved


def plan(n: int) -> str:
    """What the driver does with order ``n`` (and so what its outcome must be)."""
    if n % 5 == 0:
        return "declined"
    if n % 7 == 0:
        return "cancelled"
    if n % 4 == 0:
        return "not shipped in time"
    return "shipped"


async def drive(db: str, orders: int, pause: bool, clock: trio.testing.MockClock) -> dict[str, Any]:
    async with aion.open_engine(
        f"sqlite:///{db}", workflows=[order_saga], activities=[reserve, charge, refund, release]
    ) as engine:
        resumed = await engine.count()
        for n in range(1, orders + 1):
            wid = f"saga-{n}"
            await engine.start(
                order_saga, {"n": n}, workflow_id=wid, id_reuse=aion.IdReusePolicy.USE_EXISTING
            )
            history = await engine.history(wid)
            if plan(n) == "shipped" and not any(isinstance(e.body, aion.SignalReceived) for e in history):
                # Sent at once: recorded before the timeout can even start, so it always wins.
                await engine.signal(wid, "shipped", f"track-{n}")
            elif plan(n) == "cancelled" and not any(
                isinstance(e.body, aion.WorkflowCancelRequested) for e in history
            ):
                await engine.cancel(wid, "customer changed their mind")
        if pause:
            # Stop time (no more jumps) and wait to be killed; the test sends SIGKILL.
            clock.autojump_threshold = math.inf
            print("PAUSED", flush=True)
            await trio.sleep_forever()
        outcomes: Counter[str] = Counter()
        for n in range(1, orders + 1):
            try:
                outcomes[(await engine.result(f"saga-{n}"))["outcome"]] += 1
            except aion.WorkflowFailure as failure:
                outcomes[failure.status] += 1
        return {"orders": orders, "resumed": resumed, "outcomes": dict(sorted(outcomes.items()))}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--db", default="saga.db")
    parser.add_argument("--orders", type=int, default=30)
    parser.add_argument("--idle", type=float, default=0.05, help="real seconds of quiet before time jumps")
    parser.add_argument("--pause", action="store_true", help=argparse.SUPPRESS)  # for the crash test
    args = parser.parse_args()
    clock = trio.testing.MockClock(autojump_threshold=args.idle)
    summary = trio.run(drive, args.db, args.orders, args.pause, clock, clock=clock)
    if summary["resumed"]:
        print(f"resumed {summary['resumed']} orders from {args.db}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
