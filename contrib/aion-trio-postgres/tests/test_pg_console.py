"""The web console's reads on a PostgreSQL cluster: opened with a node id of its own, the
console shows which node owns each running workflow (``ClusterStore.command_target``)."""

from __future__ import annotations

from collections.abc import Callable

import trio

import aion_trio as aion
from aion_trio._console import ListQuery, list_page, workflow_page


@aion.workflow
async def approval(ctx: aion.WorkflowContext, order: int) -> dict[str, object]:
    decision = await ctx.wait_signal("approve")
    return {"order": order, "decision": decision}


async def test_the_console_shows_the_node_owning_each_running_workflow(
    fresh_store_url: Callable[..., str],
) -> None:
    url = fresh_store_url()
    config = aion.EngineConfig(sweep_interval=0.05)
    async with (
        aion.open_engine(f"{url}&node=a", workflows=[approval], config=config) as a,
        aion.open_engine(f"{url}&node=b", workflows=[approval], config=config) as b,
    ):
        await a.start(approval, 1, workflow_id="from-a")
        await b.start(approval, 2, workflow_id="from-b")
        await b.start(approval, 3, workflow_id="done")
        await a.signal("done", "approve", "yes")  # routed to b, its owner
        with trio.fail_after(10):
            assert await b.result("done") == {"order": 3, "decision": "yes"}
        async with aion.open_store(f"{url}&node=console") as store:
            page = await list_page(store, ListQuery())
            assert {r.workflow_id: r.status for r in page.rows} == {
                "from-a": aion.WorkflowStatus.RUNNING,
                "from-b": aion.WorkflowStatus.RUNNING,
                "done": aion.WorkflowStatus.COMPLETED,
            }
            assert page.owners == {"from-a": "a", "from-b": "b"}
            assert (await workflow_page(store, "from-b")).owner == "b"
            assert (await workflow_page(store, "done")).owner is None
        async with aion.open_store(url) as plain:  # no node id: no cluster view, no owners
            assert (await list_page(plain, ListQuery())).owners == {}
