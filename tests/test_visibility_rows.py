"""Visibility rows are written only when they change (issue 17, item 2).

A reopened engine's recovery used to rewrite the row of every active workflow,
unchanged, and on SQLite each such lone write waited the writer's rider window
for company that never came.  Store calls are counted through the observer
hook (a ``StoreOperation`` per call).
"""

from __future__ import annotations

from collections.abc import Callable

import trio

import aion_trio as aion


@aion.workflow
async def waits_for_go(ctx: aion.WorkflowContext) -> str:
    return str(await ctx.wait_signal("go"))


def upserts(seen: list[aion.ObserverEvent]) -> int:
    return sum(
        1
        for op in seen
        if isinstance(op, aion.StoreOperation) and (op.store, op.operation) == ("visibility", "upsert")
    )


async def test_a_reopened_engine_rewrites_no_unchanged_row_and_writes_a_changed_one(
    store_url: Callable[[], str],
) -> None:
    url = store_url()
    first: list[aion.ObserverEvent] = []
    async with aion.open_engine(url, workflows=[waits_for_go], observers=[first.append]) as engine:
        for n in range(3):
            await engine.start(waits_for_go, workflow_id=f"wf-{n}")
        await engine.list()  # waits for the background refreshes owed
    assert upserts(first) >= 3, "control: the first engine wrote each row"

    seen: list[aion.ObserverEvent] = []
    with trio.fail_after(30):
        async with aion.open_engine(url, workflows=[waits_for_go], observers=[seen.append]) as engine:
            rows = await engine.list()
            assert [(r.workflow_id, r.status) for r in rows] == [
                (f"wf-{n}", aion.WorkflowStatus.RUNNING) for n in range(3)
            ]
            # Recovery resumed all three and found their stored rows already right.
            assert upserts(seen) == 0
            await engine.signal("wf-1", "go", "ok")
            assert await engine.result("wf-1") == "ok"
    # The closed engine finished the terminal's bookkeeping: the changed row was written.
    assert upserts(seen) == 1
    statuses = {r.workflow_id: r.status for r in await _rows(url)}
    assert statuses["wf-1"] is aion.WorkflowStatus.COMPLETED
    assert statuses["wf-0"] is aion.WorkflowStatus.RUNNING


async def _rows(url: str) -> list[aion.VisibilityRow]:
    async with aion.open_store(url) as store:
        return await store.visibility.list()
