"""Workflows the console's browser tests load as ``tests.procs.console_app:app``.

``order`` runs ``flaky`` (it fails its first two attempts, then succeeds: a retry trail),
sleeps on a timer, runs the ``shipping`` child workflow, then waits for the ``approve``
signal and returns what it carried.  ``charge`` greets, then runs ``debit``: the seed
ran it with a ``debit`` that always fails (the run failed there); this one, the fixed code,
succeeds, so a reset to the last step completes the new run.
"""

from __future__ import annotations

import types
from datetime import timedelta

import aion_trio as aion

RETRY = aion.RetryPolicy(max_attempts=5, backoff=aion.Fixed(delay=0.05))


@aion.activity(retry=RETRY)
async def flaky(item: str) -> str:
    info = aion.activity_info()
    if info.attempt < 3:
        raise RuntimeError(f"warehouse busy (attempt {info.attempt})")
    return f"reserved {item}"


@aion.activity
async def greet(name: str) -> str:
    return f"hello {name}"


@aion.workflow
async def shipping(ctx: aion.WorkflowContext, item: str) -> str:
    return await ctx.run(greet, item)


@aion.workflow
async def order(ctx: aion.WorkflowContext, item: str) -> dict[str, object]:
    reserved = await ctx.run(flaky, item)
    await ctx.sleep(timedelta(milliseconds=100))
    shipped = await ctx.child(shipping, item, workflow_id=f"{ctx.workflow_id}-shipping")
    decision = await ctx.wait_signal("approve")
    return {"reserved": reserved, "shipped": shipped, "decision": decision}


@aion.activity(name="debit", retry=aion.RetryPolicy(max_attempts=1))
async def debit(amount: int) -> str:
    return f"debited {amount}"


@aion.workflow
async def charge(ctx: aion.WorkflowContext, amount: int) -> str:
    greeting = await ctx.run(greet, "payer")
    return f"{greeting}: {await ctx.run(debit, amount)}"


@aion.workflow
async def hello(ctx: aion.WorkflowContext, name: str) -> str:
    return await ctx.run(greet, name)


workflows = [order, shipping, hello, charge]
activities = [flaky, greet, debit]
app = types.SimpleNamespace(workflows=workflows, activities=activities)
