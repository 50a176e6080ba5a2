"""Workflow code sets its own search attributes: ``ctx.upsert_search_attributes``.

The scenario of Temporal's ``hello_search_attributes`` sample, carried over:
a workflow started with some attributes upserts more while it runs, and the
visibility queries (``engine.list`` / ``count`` / ``describe``) see the new
values.  The upsert is a recorded command: a restart replays it from history
(nothing recorded twice), other values on replay are non-determinism.  Every
test runs on the store ``AION_TRIO_TEST_STORE`` names.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import trio

import aion_trio as aion

LIMIT = 20  # seconds: every wait below is bounded by this


def _upserts(history: Sequence[aion.Event]) -> list[dict[str, Any]]:
    return [dict(e.body.attributes) for e in history if isinstance(e.body, aion.SearchAttributesUpserted)]


def _eq(key: str, value: Any) -> aion.SearchPredicate:
    return aion.SearchPredicate(key=key, op=aion.SearchOp.EQUALS, value=value)


async def _history_until(
    engine: aion.Engine, workflow_id: str, done: Callable[[list[aion.Event]], bool]
) -> list[aion.Event]:
    with trio.fail_after(LIMIT):
        while True:
            history = await engine.history(workflow_id)
            if done(history):
                return history
            await trio.sleep(0.005)


async def _row_closed(engine: aion.Engine, workflow_id: str) -> None:
    with trio.fail_after(LIMIT):
        while True:
            row = await engine.store.visibility.get(workflow_id)
            if row is not None and row.status is aion.WorkflowStatus.COMPLETED:
                return
            await trio.sleep(0.005)


async def _stuck(engine: aion.Engine, workflow_id: str) -> aion.WorkflowDescription:
    with trio.fail_after(LIMIT):
        while True:
            description = await engine.describe(workflow_id)
            if description.stuck_reason:
                return description
            await trio.sleep(0.005)


@aion.workflow(name="order")
async def order(ctx: aion.WorkflowContext) -> dict[str, Any]:
    ctx.query_handler("attributes")(lambda: dict(ctx.search_attributes))
    await ctx.upsert_search_attributes({"stage": "paid", "tags": ["vip", "eu"], "total": 42})
    await ctx.wait_signal("shipped")
    await ctx.upsert_search_attributes({"stage": "shipped"})
    return dict(ctx.search_attributes)


async def test_upserted_attributes_are_recorded_and_visibility_lists_them(
    store_url: Callable[[], str],
) -> None:
    async with aion.open_engine(store_url(), workflows=[order]) as engine:
        run = await engine.start(order, workflow_id="o-1", search_attributes={"customer": "c-7"})
        await engine.start(order, workflow_id="o-2", search_attributes={"customer": "c-8"})
        await _history_until(engine, "o-1", lambda h: len(_upserts(h)) == 1)
        await _history_until(engine, "o-2", lambda h: len(_upserts(h)) == 1)
        with trio.fail_after(LIMIT):
            assert await engine.query("o-1", "attributes") == {
                "customer": "c-7",
                "stage": "paid",
                "tags": ["vip", "eu"],
                "total": 42,
            }
        rows = await engine.list(search=[_eq("stage", "paid"), _eq("customer", "c-7")])
        assert [r.workflow_id for r in rows] == ["o-1"]
        assert await engine.count(search=[_eq("stage", "paid")]) == 2
        big = aion.SearchPredicate(key="total", op=aion.SearchOp.GREATER, value=40)
        assert await engine.count(search=[big]) == 2
        assert (await engine.describe("o-1")).search_attributes["stage"] == "paid"

        await engine.signal("o-1", "shipped")
        with trio.fail_after(LIMIT):
            result = await run.result()
        assert result == {"customer": "c-7", "stage": "shipped", "tags": ["vip", "eu"], "total": 42}
        history = await engine.history("o-1")
        assert _upserts(history) == [
            {"stage": "paid", "tags": ("vip", "eu"), "total": 42},
            {"stage": "shipped"},
        ]
        await _row_closed(engine, "o-1")  # the terminal's row is written right after the result
        rows = await engine.list(search=[_eq("stage", "shipped")])
        assert [(r.workflow_id, r.status) for r in rows] == [("o-1", aion.WorkflowStatus.COMPLETED)]
        assert await engine.count(search=[_eq("stage", "paid")]) == 1, "o-2 only: o-1 moved on"


async def test_a_restart_replays_the_upsert_from_history_and_records_it_once(
    store_url: Callable[[], str],
) -> None:
    url = store_url()
    async with aion.open_engine(url, workflows=[order]) as engine:
        await engine.start(order, workflow_id="o", search_attributes={"customer": "c-1"})
        before = await _history_until(engine, "o", lambda h: len(_upserts(h)) == 1)
    async with aion.open_engine(url, workflows=[order]) as engine:
        with trio.fail_after(LIMIT):
            assert (await engine.query("o", "attributes"))["stage"] == "paid", "replayed into the code's view"
        assert await engine.history("o") == before, "replay recorded nothing"
        assert await engine.count(search=[_eq("stage", "paid")]) == 1
        await engine.signal("o", "shipped")
        with trio.fail_after(LIMIT):
            assert (await engine.result("o"))["stage"] == "shipped"
        assert len(_upserts(await engine.history("o"))) == 2


@aion.workflow(name="order")
async def order_with_other_values(ctx: aion.WorkflowContext) -> dict[str, Any]:
    await ctx.upsert_search_attributes({"stage": "charged", "tags": ["vip", "eu"], "total": 42})
    await ctx.wait_signal("shipped")
    return {}


async def test_other_upserted_values_on_replay_are_non_determinism(store_url: Callable[[], str]) -> None:
    url = store_url()
    async with aion.open_engine(url, workflows=[order]) as engine:
        await engine.start(order, workflow_id="o")
        before = await _history_until(engine, "o", lambda h: len(_upserts(h)) == 1)
    async with aion.open_engine(url, workflows=[order_with_other_values]) as engine:
        description = await _stuck(engine, "o")
        assert description.status is aion.WorkflowStatus.RUNNING
        reason = description.stuck_reason or ""
        assert "search attributes command #0 was recorded as search-attribute upsert" in reason, reason
        assert "with other arguments" in reason, reason
        assert await engine.history("o") == before, "nothing recorded for the divergent upsert"


@aion.workflow
async def bad_upsert(ctx: aion.WorkflowContext, attributes: Any) -> str:
    try:
        await ctx.upsert_search_attributes(attributes)
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "accepted"


@pytest.mark.parametrize(
    ("attributes", "error"),
    [({"bad key": 1}, "search attribute name"), ({"n": [1, 2]}, "only str"), ([1], "mapping")],
)
async def test_a_bad_upsert_raises_in_the_workflow_and_records_nothing(
    store_url: Callable[[], str], attributes: Any, error: str
) -> None:
    async with aion.open_engine(store_url(), workflows=[bad_upsert]) as engine:
        run = await engine.start(bad_upsert, attributes, workflow_id="b")
        with trio.fail_after(LIMIT):
            assert error in await run.result()
        assert _upserts(await engine.history("b")) == []


@aion.workflow
async def upserts_from_a_query(ctx: aion.WorkflowContext) -> None:
    ctx.set_query_handler(
        "sneaky", lambda: ctx.upsert_search_attributes({"stage": "x"})
    )  # never awaited: refused
    await ctx.wait_signal("never")


async def test_a_query_handler_cannot_upsert(store_url: Callable[[], str]) -> None:
    async with aion.open_engine(store_url(), workflows=[upserts_from_a_query]) as engine:
        await engine.start(upserts_from_a_query, workflow_id="q")
        with trio.fail_after(LIMIT), pytest.raises(aion.QueryReadOnly):
            await engine.query("q", "sneaky")
        assert _upserts(await engine.history("q")) == []


@aion.workflow
async def rounds(ctx: aion.WorkflowContext, n: int) -> dict[str, Any]:
    if n == 0:
        await ctx.upsert_search_attributes({"stage": "first round done"})
        raise ctx.continue_as_new(1)
    return dict(ctx.search_attributes)


async def test_continue_as_new_carries_the_upserted_values_over(store_url: Callable[[], str]) -> None:
    async with aion.open_engine(store_url(), workflows=[rounds]) as engine:
        run = await engine.start(rounds, 0, workflow_id="r", search_attributes={"customer": "c-1"})
        with trio.fail_after(LIMIT):
            assert await run.result() == {"customer": "c-1", "stage": "first round done"}
        await _row_closed(engine, "r")
        assert await engine.count(search=[_eq("stage", "first round done")]) == 1
