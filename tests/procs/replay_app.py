"""Versions of one workflow for the replayer's tests (``tests/test_replayer.py``): ``v1``
records histories, the others are changes of it the replayer must accept or refuse.

Each ``vN`` is an app (``.workflows``, ``.activities``) the CLI loads as
``tests.procs.replay_app:vN``.  Every version registers its workflow as ``checkout``.
"""

from __future__ import annotations

import types

import aion_trio as aion


@aion.activity
async def charge(order: int) -> str:
    return f"receipt-{order}"


@aion.activity
async def refund(order: int) -> str:
    return f"refund-{order}"


@aion.activity
async def ship(order: int) -> str:
    return f"parcel-{order}"


@aion.workflow(name="checkout")
async def checkout_v1(ctx: aion.WorkflowContext, order: int) -> str:
    receipt = await ctx.run(charge, order)
    if order < 0:
        raise ValueError("a negative order fails after charging")
    await ctx.wait_signal("approve")
    parcel = await ctx.run(ship, order)
    return f"{receipt} {parcel}"


@aion.workflow(name="checkout")
async def checkout_renamed(ctx: aion.WorkflowContext, order: int) -> str:
    receipt = await ctx.run(refund, order)  # another activity where 'charge' was recorded
    if order < 0:
        raise ValueError("a negative order fails after charging")
    await ctx.wait_signal("approve")
    parcel = await ctx.run(ship, order)
    return f"{receipt} {parcel}"


@aion.workflow(name="checkout")
async def checkout_reordered(ctx: aion.WorkflowContext, order: int) -> str:
    await ctx.wait_signal("approve")  # the approval first: the shipment moves up
    parcel = await ctx.run(ship, order)
    receipt = await ctx.run(charge, order)
    if order < 0:
        raise ValueError("a negative order fails after charging")
    return f"{receipt} {parcel}"


@aion.workflow(name="checkout")
async def checkout_patched(ctx: aion.WorkflowContext, order: int) -> str:
    receipt = await ctx.run(charge, order)
    if order < 0:
        raise ValueError("a negative order fails after charging")
    await ctx.wait_signal("approve")
    if await ctx.patched("refund-first"):
        await ctx.run(refund, order)
    parcel = await ctx.run(ship, order)
    return f"{receipt} {parcel}"


@aion.workflow
async def other(ctx: aion.WorkflowContext) -> None:
    return None


ACTIVITIES = [charge, refund, ship]
v1 = types.SimpleNamespace(workflows=[checkout_v1], activities=ACTIVITIES)
renamed = types.SimpleNamespace(workflows=[checkout_renamed], activities=ACTIVITIES)
reordered = types.SimpleNamespace(workflows=[checkout_reordered], activities=ACTIVITIES)
patched = types.SimpleNamespace(workflows=[checkout_patched], activities=ACTIVITIES)
unrelated = types.SimpleNamespace(workflows=[other], activities=[])
