"""Calls a type checker must accept and refuse (tests/test_typed_calls.py runs mypy on it).

Each refused line ends with ``# E``; the test compares mypy's whole output with the
expected lines, so a call that stops being checked (or a new false alarm) fails it.
Not imported by the suite: it is only type-checked (``reveal_type`` is mypy's).
"""

# ruff: noqa: F821

from __future__ import annotations

import aion_trio as aion


@aion.activity
async def charge(order_id: int, amount: float) -> str:
    return f"receipt-{order_id}-{amount}"


@aion.activity
def read_label(path: str) -> bytes:
    return path.encode()


@aion.workflow
async def ship(ctx: aion.WorkflowContext, order_id: int) -> list[str]:
    return [str(order_id)]


@aion.workflow
async def checkout(ctx: aion.WorkflowContext, order_id: int, note: str = "") -> dict[str, int]:
    receipt = await ctx.run(charge, order_id, 2.5)
    reveal_type(receipt)
    label = await ctx.run(read_label, "label.txt", timeout=30)
    reveal_type(label)
    handle = ctx.start(charge, order_id, 1)
    reveal_type(handle)
    urgent = ctx.start(charge, order_id, 1, priority=-1, timeout=10)
    reveal_type(urgent)
    reveal_type(await handle)
    parcels = await ctx.child(ship, order_id)
    reveal_type(parcels)
    child = ctx.start_child(ship, order_id, workflow_id="parcel-7")
    reveal_type(child)
    reveal_type(await ctx.run("charge", order_id, 2.5))
    await ctx.run(charge, "seven", 2.5)  # E
    await ctx.run(charge, order_id)  # E
    ctx.start(read_label, 1)  # E
    await ctx.child(ship)  # E
    return {"parcels": len(parcels)}


async def main(engine: aion.Engine) -> None:
    run = await engine.start(checkout, 7, workflow_id="order-7")
    reveal_type(run)
    reveal_type(await run.result())
    await engine.start(checkout, 7, "gift wrap")
    reveal_type(await engine.start("checkout", 7))
    await engine.start(checkout, "7")  # E
    await engine.start(checkout)  # E
    await engine.start(checkout, 7, "gift", "extra")  # E
