"""A workflow that continues as new, for the CLI tests that follow a chain of runs
(``tests.procs.relay_app:app``)."""

from __future__ import annotations

import types

import aion_trio as aion


@aion.workflow
async def relay(ctx: aion.WorkflowContext, left: int, run: int = 1) -> str:
    if left:
        raise ctx.continue_as_new(left - 1, run + 1)
    return f"finished in run {run}"


workflows = [relay]
app = types.SimpleNamespace(workflows=workflows, activities=[])
