"""The workflows of the residency crash test (tests/procs/parked_worker.py)."""

from __future__ import annotations

import aion_trio as aion


@aion.workflow(name="parked")
async def parked(ctx: aion.WorkflowContext, index: int) -> int:
    return int(await ctx.wait_signal("go")) + index


@aion.workflow(name="nagged")
async def nagged(ctx: aion.WorkflowContext, index: int) -> int:
    ctx.start_timer("nag", 30 * 86400)
    return int(await ctx.wait_signal("go")) + index


WORKFLOWS = [parked, nagged]
