"""Order processing on the embedded SQLite store: retries, a durable timer, compensation.

    python examples/orders.py                 # 50 orders in ./orders.db
    python examples/orders.py --orders 200 --db /tmp/orders.db

Interrupt it (Ctrl-C, or kill -9) and run the same command again: the orders
already in the database resume where they stopped instead of starting over
(starts use ``IdReusePolicy.USE_EXISTING``, so a rerun re-attaches).
"""

from __future__ import annotations

import argparse
import logging
import time
from collections import Counter
from datetime import timedelta

import trio

import aion_trio as aion

RETRY = aion.RetryPolicy(max_attempts=4, backoff=aion.Exponential(initial=0.05, multiplier=2, maximum=1))


@aion.activity(retry=RETRY, timeout=timedelta(seconds=10))
async def reserve_stock(order: dict) -> str:
    # Fails transiently on the first attempt of every third order: the policy retries it.
    if order["id"] % 3 == 0 and aion.activity_info().attempt == 1:
        raise ConnectionError("inventory service busy")
    await trio.sleep(0.01)
    return f"reservation-{order['id']}"


@aion.activity(retry=RETRY)
def charge_card(order: dict) -> str:
    # A plain function: runs in a worker thread, never blocking the engine.
    time.sleep(0.005)
    if order["amount"] > 900:
        raise aion.TerminalError(f"card declined for {order['amount']}")
    return f"charge-{order['id']}"


@aion.activity
async def release_stock(reservation: str) -> str:
    return f"released {reservation}"


@aion.activity
async def ship(order: dict) -> str:
    return f"shipment-{order['id']}"


@aion.workflow
async def process_order(ctx: aion.WorkflowContext, order: dict) -> dict:
    reservation = await ctx.run(reserve_stock, order)
    try:
        charge = await ctx.run(charge_card, order)
    except aion.ActivityFailure as failure:
        # Compensation: undo the reservation, then report the failure.
        await ctx.run(release_stock, reservation)
        return {"order": order["id"], "status": "declined", "reason": failure.message}
    await ctx.sleep(timedelta(seconds=1))  # a durable timer: survives restarts
    shipment = await ctx.run(ship, order)
    return {"order": order["id"], "status": "shipped", "charge": charge, "shipment": shipment}


async def main(db: str, orders: int) -> None:
    started = time.monotonic()
    async with aion.open_engine(
        f"sqlite:///{db}",
        workflows=[process_order],
        activities=[reserve_stock, charge_card, release_stock, ship],
    ) as engine:
        resumed = await engine.count(status=aion.WorkflowStatus.RUNNING)
        if resumed:
            print(f"resuming {resumed} orders found running in {db}")
        handles = []
        for i in range(orders):
            order = {"id": i, "amount": 100 + (i * 37) % 1000}
            handles.append(
                await engine.start(
                    process_order, order, workflow_id=f"order-{i}", id_reuse=aion.IdReusePolicy.USE_EXISTING
                )
            )
        outcomes: Counter[str] = Counter()
        for handle in handles:
            outcomes[(await handle.result())["status"]] += 1
    print(
        f"{orders} orders in {time.monotonic() - started:.1f}s: "
        + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items()))
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", default="orders.db", help="SQLite file (created if missing)")
    parser.add_argument("--orders", type=int, default=50)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    trio.run(main, args.db, args.orders)
