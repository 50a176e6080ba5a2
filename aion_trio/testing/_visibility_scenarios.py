"""Conformance scenarios for :class:`~aion_trio.VisibilityStore`.

The oracle is the contract itself: ``VisibilityFilter.apply`` and
``VisibilityFilter.matches`` define what ``list`` and ``count`` return.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any

import trio
import trio.testing

from .._events import SearchValue, WorkflowStatus
from .._store import SearchOp, SearchPredicate, VisibilityFilter, VisibilityRow
from . import _samples as s
from ._kit import ConformanceError, ScenarioContext, short

RANDOM_SEED = 20410304
RANDOM_ROWS = 200
RANDOM_FILTERS = 100

_R = WorkflowStatus.RUNNING
_C = WorkflowStatus.COMPLETED
_F = WorkflowStatus.FAILED


def _row(
    workflow_id: str,
    *,
    workflow_type: str = "order",
    status: WorkflowStatus = _R,
    start: float = 0.0,
    close: float | None = None,
    task_queue: str = "default",
    search: dict[str, Any] | None = None,
    **extra: Any,
) -> VisibilityRow:
    return VisibilityRow(
        workflow_id=workflow_id,
        run_id=s.RUN_A,
        workflow_type=workflow_type,
        status=status,
        start_time=s.at(start),
        close_time=None if close is None else s.at(close),
        task_queue=task_queue,
        search_attributes=search or {},
        **extra,
    )


async def _upsert_all(ctx: ScenarioContext, store: Any, rows: Iterable[VisibilityRow]) -> list[VisibilityRow]:
    out = []
    for row in rows:
        try:
            await store.upsert(row)
        except Exception as exc:
            raise ConformanceError(
                ctx.name,
                f"upsert of {row.workflow_id!r} raised {type(exc).__name__}: {exc}; expected it to succeed",
            ) from exc
        out.append(row)
    return out


def _describe_filter(f: VisibilityFilter) -> str:
    default = VisibilityFilter()
    parts = []
    for name in (
        "workflow_type",
        "status",
        "task_queue",
        "started_after",
        "started_before",
        "closed_after",
        "closed_before",
        "search",
        "limit",
        "offset",
        "newest_first",
    ):
        value = getattr(f, name)
        if value != getattr(default, name):
            if isinstance(value, datetime):
                value = value.isoformat()
            elif name == "status" and value is not None:
                value = sorted(v.value for v in value)
            elif name == "search":
                value = [f"{p.key} {p.op.value} {p.value!r}" for p in value]
            parts.append(f"{name}={value!r}" if not isinstance(value, str) else f"{name}={value}")
    return f"VisibilityFilter({', '.join(parts)})"


async def _expect_listing(
    ctx: ScenarioContext,
    store: Any,
    rows: Sequence[VisibilityRow],
    f: VisibilityFilter | None,
    what: str = "",
) -> None:
    """``list(f)`` must equal ``f.apply(rows)`` and ``count(f)`` the number of matching rows."""
    oracle = f or VisibilityFilter()
    label = f"{what}: " if what else ""
    shown = "None" if f is None else _describe_filter(f)
    expected = oracle.apply(rows)
    observed = await store.list(f)
    observed_ids = [r.workflow_id for r in observed]
    expected_ids = [r.workflow_id for r in expected]
    if observed_ids != expected_ids:
        ctx.fail(
            f"{label}list({shown}) returned workflow ids {short(observed_ids)}, expected {short(expected_ids)}"
        )
    ctx.expect_equal(observed, expected, f"{label}rows returned by list({shown})")
    expected_count = sum(1 for r in rows if oracle.matches(r))
    observed_count = await store.count(f)
    ctx.expect_equal(observed_count, expected_count, f"{label}count({shown})")


def _expect_utc(ctx: ScenarioContext, row: VisibilityRow | None, what: str) -> None:
    if row is None:
        return
    for name in ("start_time", "close_time"):
        value = getattr(row, name)
        if value is not None and value.utcoffset() != timedelta(0):
            ctx.fail(
                f"{what}: {name} {value!r} of {row.workflow_id!r} must be returned as an aware UTC datetime"
            )


# --------------------------------------------------------------------------
# Rows in and out
# --------------------------------------------------------------------------


def _full_row(workflow_id: str) -> VisibilityRow:
    return VisibilityRow(
        workflow_id=workflow_id,
        run_id=s.RUN_C,
        workflow_type="order.checkout",
        status=_F,
        start_time=s.at(12.000001, tz=s.PLUS_0530),
        close_time=s.at(99.999999, tz=s.MINUS_0700),
        task_queue="queue-'a'",
        failed_step="activity:3 charge",
        failure_reason=f"RuntimeError: {s.TRICKY_TEXT}",
        search_attributes={
            "Text": s.TRICKY_TEXT,
            "Empty": "",
            "Int": s.BIG_INT,
            "Negative": -7,
            "Zero": 0,
            "Float": 2.5,
            "WholeFloat": 3.0,
            "NegativeFloat": -0.125,
            "True": True,
            "False": False,
            "Tags": ("a", "b'c", "a"),
            "NoTags": (),
            "under_score.dash-1": "key characters",
        },
        stuck_reason="NonDeterminism: step 4 changed",
    )


async def visibility_upsert_get_round_trip(ctx: ScenarioContext) -> None:
    """upsert then get returns the row unchanged: every field, every search attribute kind, UTC datetimes."""
    async with ctx.open() as store:
        full = _full_row("full-'row'")
        minimal = VisibilityRow(
            workflow_id="minimal",
            run_id=s.RUN_A,
            workflow_type="t",
            status=_R,
            start_time=s.at(0),
        )
        await _upsert_all(ctx, store, [full, minimal])
        for row in (full, minimal):
            observed = await store.get(row.workflow_id)
            ctx.expect(observed is not None, f"get({row.workflow_id!r}) returned None after upsert")
            ctx.expect_equal(observed, row, f"get({row.workflow_id!r}) after upsert")
            _expect_utc(ctx, observed, f"get({row.workflow_id!r})")
        for row in await store.list(None):
            _expect_utc(ctx, row, "list(None)")


async def visibility_upsert_replaces(ctx: ScenarioContext) -> None:
    """A second upsert of a workflow id replaces the whole row (dropped search attributes are gone)."""
    async with ctx.open() as store:
        first = _full_row("wf")
        second = _row(
            "wf",
            workflow_type="other",
            status=_R,
            start=500,
            task_queue="q2",
            search={"Text": "new", "Added": 1},
        )
        await _upsert_all(ctx, store, [first, second])
        ctx.expect_equal(await store.get("wf"), second, "get after the replacing upsert")
        await _expect_listing(ctx, store, [second], None, "after replacing")
        for p in (
            SearchPredicate(key="Int", op=SearchOp.EQUALS, value=s.BIG_INT),
            SearchPredicate(key="Tags", op=SearchOp.CONTAINS, value="a"),
            SearchPredicate(key="Text", op=SearchOp.EQUALS, value="new"),
            SearchPredicate(key="Added", op=SearchOp.GREATER, value=0),
        ):
            await _expect_listing(ctx, store, [second], VisibilityFilter(search=[p]), "after replacing")
        await _expect_listing(
            ctx,
            store,
            [second],
            VisibilityFilter(closed_before=s.at(10**6)),
            "the replacing row has no close_time",
        )
        third = _row("wf", status=_C, start=1, close=2)
        await _upsert_all(ctx, store, [third])
        ctx.expect_equal(await store.get("wf"), third, "get after a third upsert")
        ctx.expect_equal(await store.count(None), 1, "count(None) after three upserts of one workflow id")


async def visibility_get_unknown_is_none(ctx: ScenarioContext) -> None:
    """get of a workflow id with no row returns None, never a neighbour."""
    async with ctx.open() as store:
        ctx.expect_equal(await store.get("nobody"), None, "get on an empty store")
        await _upsert_all(ctx, store, [_row("a"), _row("ab")])
        for workflow_id in ("A", "a ", "b", "%", "a%", "'a'", ""):
            ctx.expect_equal(
                await store.get(workflow_id), None, f"get({workflow_id!r}) with only 'a' and 'ab' stored"
            )


# --------------------------------------------------------------------------
# Filters
# --------------------------------------------------------------------------


def _field_rows() -> list[VisibilityRow]:
    W = WorkflowStatus
    return [
        _row("a", workflow_type="order", status=W.RUNNING, start=1),
        _row("b", workflow_type="order", status=W.COMPLETED, start=2, close=3, task_queue="q1"),
        _row("c", workflow_type="ship", status=W.FAILED, start=3, close=4, task_queue="q1"),
        _row("d", workflow_type="ship", status=W.RUNNING, start=4, task_queue="q2"),
        _row("e", workflow_type="Order", status=W.CANCELLED, start=5, close=6),
        _row("f", workflow_type="order ", status=W.TIMED_OUT, start=6, close=7, task_queue="Q1"),
        _row("g", workflow_type="order", status=W.CONTINUED_AS_NEW, start=7, close=8, task_queue="q1"),
    ]


async def visibility_filters_by_field(ctx: ScenarioContext) -> None:
    """Filters by workflow_type, status (one or a set), task_queue and their combinations."""
    async with ctx.open() as store:
        rows = await _upsert_all(ctx, store, _field_rows())
        W = WorkflowStatus
        filters = [
            VisibilityFilter(),
            *(
                VisibilityFilter(workflow_type=t)
                for t in ("order", "ship", "Order", "ord", "order ", "missing")
            ),
            *(VisibilityFilter(status=st) for st in W),
            VisibilityFilter(status={W.RUNNING, W.FAILED}),
            VisibilityFilter(status={W.COMPLETED, W.CANCELLED, W.TIMED_OUT, W.CONTINUED_AS_NEW}),
            VisibilityFilter(status=frozenset()),
            *(VisibilityFilter(task_queue=q) for q in ("q1", "Q1", "q", "default")),
            VisibilityFilter(workflow_type="order", status=W.RUNNING),
            VisibilityFilter(workflow_type="ship", task_queue="q1"),
            VisibilityFilter(
                workflow_type="order", task_queue="q1", status={W.COMPLETED, W.CONTINUED_AS_NEW}
            ),
            VisibilityFilter(status={W.RUNNING, W.FAILED}, task_queue="q1"),
        ]
        for f in filters:
            await _expect_listing(ctx, store, rows, f)


async def visibility_time_ranges_inclusive(ctx: ScenarioContext) -> None:
    """start/close bounds are inclusive to the microsecond; close bounds exclude rows still open."""
    async with ctx.open() as store:
        rows = await _upsert_all(
            ctx,
            store,
            [
                _row("t0", start=0, close=10),
                _row("t1", start=1, close=11),
                _row("t2", start=2, close=12),
                _row("t2b", start=2),
                _row("t3", start=3, close=12),
                _row("t4", start=4),
                _row("t5", start=5, close=15.5),
            ],
        )
        us = timedelta(microseconds=1)
        t = s.at
        filters = [
            VisibilityFilter(started_after=t(2)),
            VisibilityFilter(started_after=t(2) + us),
            VisibilityFilter(started_before=t(2)),
            VisibilityFilter(started_before=t(2) - us),
            VisibilityFilter(started_after=t(2), started_before=t(2)),
            VisibilityFilter(
                started_after=t(2).astimezone(s.PLUS_0530), started_before=t(3).astimezone(s.MINUS_0700)
            ),
            VisibilityFilter(started_after=t(4), started_before=t(1)),
            VisibilityFilter(closed_after=t(12)),
            VisibilityFilter(closed_after=t(12) + us),
            VisibilityFilter(closed_before=t(12)),
            VisibilityFilter(closed_before=t(12) - us),
            VisibilityFilter(closed_after=t(12), closed_before=t(12)),
            VisibilityFilter(closed_after=t(-1000)),
            VisibilityFilter(closed_before=t(1000)),
            VisibilityFilter(started_after=t(2), closed_before=t(12)),
            VisibilityFilter(started_before=t(4), closed_after=t(11).astimezone(s.PLUS_0530)),
        ]
        for f in filters:
            await _expect_listing(ctx, store, rows, f)


def _search_rows() -> list[VisibilityRow]:
    return [
        _row("n-int", start=1, search={"n": 1, "s": "eu-west", "tags": ("a", "b"), "flag": True, "f": 2.5}),
        _row("n-float", start=2, search={"n": 1.0, "s": "EU-west", "tags": ("b",), "flag": False, "f": 2}),
        _row("n-bool", start=3, search={"n": True, "s": "us", "tags": (), "flag": 1, "f": 0.0}),
        _row("n-str", start=4, search={"n": "1", "s": "a%b_c", "tags": ("abc",), "flag": "true", "f": "2.5"}),
        _row("n-big", start=5, search={"n": s.BIG_INT, "s": "Zürich", "tags": ("a", "a"), "f": -3.5}),
        _row("n-big-1", start=6, search={"n": s.BIG_INT - 1, "s": "Z"}),
        _row("n-none", start=7),
        _row("n-list", start=8, search={"n": ("1",), "s": ("eu-west",), "tags": "a b", "flag": ("true",)}),
        _row("n-zero", start=9, search={"n": 0, "s": "", "f": -0.0, "flag": 0}),
    ]


def _search_predicates() -> list[list[SearchPredicate]]:
    E, G, L, C = SearchOp.EQUALS, SearchOp.GREATER, SearchOp.LESS, SearchOp.CONTAINS

    def p(key: str, op: SearchOp, value: SearchValue) -> SearchPredicate:
        return SearchPredicate(key=key, op=op, value=value)

    singles = [
        # equality: int and float compare numerically; bool is not a number; kinds never mix
        p("n", E, 1),
        p("n", E, 1.0),
        p("n", E, True),
        p("n", E, False),
        p("n", E, 0),
        p("n", E, "1"),
        p("n", E, ("1",)),
        p("n", E, s.BIG_INT),
        p("n", E, s.BIG_INT - 1),
        p("flag", E, True),
        p("flag", E, 1),
        p("flag", E, 0),
        p("flag", E, "true"),
        p("f", E, 2),
        p("f", E, 0),
        p("f", E, -0.0),
        p("tags", E, ("a", "b")),
        p("tags", E, ("b", "a")),
        p("tags", E, ()),
        p("tags", E, "a b"),
        p("s", E, "eu-west"),
        p("s", E, ""),
        # order: numbers with numbers (never bool), strings with strings by code point
        p("n", G, 0),
        p("n", G, 0.5),
        p("n", G, 1),
        p("n", L, 1),
        p("n", L, 1.5),
        p("n", G, s.BIG_INT - 1),
        p("n", G, "0"),
        p("f", G, 2),
        p("f", L, 2.5),
        p("f", L, 0),
        p("s", G, "Z"),
        p("s", L, "a"),
        p("s", G, ""),
        p("s", L, "eu-west"),
        p("tags", G, "a"),
        p("flag", G, 0),
        # contains: list element (exact) or substring (case-sensitive, wildcard characters literal)
        p("tags", C, "a"),
        p("tags", C, "ab"),
        p("s", C, "west"),
        p("s", C, "EU"),
        p("s", C, "eu"),
        p("s", C, "%"),
        p("s", C, "_"),
        p("s", C, "a%b"),
        p("s", C, "ü"),
        p("s", C, ""),
        p("n", C, "1"),
        p("flag", C, "true"),
        # a key the row lacks never matches
        *(p("absent", op, v) for op, v in ((E, 1), (G, 0), (L, 10), (C, ""))),
    ]
    out = [[x] for x in singles]
    out += [
        [p("n", E, 1), p("flag", E, True)],
        [p("s", C, "west"), p("tags", C, "b")],
        [p("n", G, 0), p("n", L, 2)],
        [p("n", E, 1), p("absent", E, 1)],
    ]
    return out


async def visibility_search_predicates(ctx: ScenarioContext) -> None:
    """Each SearchOp with the reference semantics: kinds, int/float, bool, lists, case, missing keys."""
    async with ctx.open() as store:
        rows = await _upsert_all(ctx, store, _search_rows())
        for predicates in _search_predicates():
            await _expect_listing(ctx, store, rows, VisibilityFilter(search=predicates))
        await _expect_listing(
            ctx,
            store,
            rows,
            VisibilityFilter(
                search=[SearchPredicate(key="n", op=SearchOp.EQUALS, value=1)], started_after=s.at(2)
            ),
            "search combined with a time bound",
        )


# --------------------------------------------------------------------------
# Ordering and paging
# --------------------------------------------------------------------------


def _ordering_rows() -> list[VisibilityRow]:
    # Inserted out of order; ties on start_time must break by workflow_id.
    plan = [
        ("m", 5),
        ("b", 5),
        ("z", 1),
        ("a", 9),
        ("c", 5),
        ("B", 5),
        ("y", 1),
        ("k", 3),
        ("a2", 9),
        ("x", 7),
        ("é", 5),
    ]
    return [
        _row(w, start=t, status=_C if t % 2 else _R, close=None if t % 2 == 0 else t + 1) for w, t in plan
    ]


async def visibility_ordering(ctx: ScenarioContext) -> None:
    """list orders by (start_time, workflow_id); newest_first reverses start_time but keeps ids ascending."""
    async with ctx.open() as store:
        rows = await _upsert_all(ctx, store, _ordering_rows())
        for f in (
            None,
            VisibilityFilter(),
            VisibilityFilter(newest_first=True),
            VisibilityFilter(status=_R),
            VisibilityFilter(status=_C, newest_first=True),
            VisibilityFilter(started_after=s.at(3), started_before=s.at(7), newest_first=True),
        ):
            await _expect_listing(ctx, store, rows, f)


async def visibility_paging(ctx: ScenarioContext) -> None:
    """limit/offset pages are stable and together list every matching row exactly once."""
    async with ctx.open() as store:
        rows = await _upsert_all(ctx, store, _ordering_rows())
        for base in (VisibilityFilter(), VisibilityFilter(newest_first=True), VisibilityFilter(status=_C)):
            full = base.apply(rows)
            for limit in (1, 2, 3, 4, len(full), len(full) + 5):
                pages: list[VisibilityRow] = []
                offset = 0
                while True:
                    f = VisibilityFilter(
                        workflow_type=base.workflow_type,
                        status=base.status,
                        newest_first=base.newest_first,
                        limit=limit,
                        offset=offset,
                    )
                    page = await store.list(f)
                    expected = f.apply(rows)
                    ctx.expect_equal(
                        [r.workflow_id for r in page],
                        [r.workflow_id for r in expected],
                        f"workflow ids of the page list({_describe_filter(f)})",
                    )
                    if not page:
                        break
                    pages.extend(page)
                    offset += limit
                    if offset > len(rows) + limit:  # a store that ignores offset would loop forever
                        ctx.fail(f"paging {_describe_filter(base)} with limit={limit} did not end")
                ctx.expect_equal(
                    [r.workflow_id for r in pages],
                    [r.workflow_id for r in full],
                    f"all pages of {_describe_filter(base)} with limit={limit}, concatenated",
                )
            for f in (
                VisibilityFilter(limit=0),
                VisibilityFilter(offset=3),
                VisibilityFilter(offset=len(rows)),
                VisibilityFilter(offset=len(rows) + 10),
                VisibilityFilter(limit=2, offset=len(rows) - 1),
                VisibilityFilter(limit=3, offset=4, newest_first=True),
            ):
                await _expect_listing(ctx, store, rows, f)


async def visibility_count_ignores_paging(ctx: ScenarioContext) -> None:
    """count(filter) counts every matching row, whatever limit, offset and newest_first say."""
    async with ctx.open() as store:
        rows = await _upsert_all(ctx, store, _ordering_rows())
        for f in (
            VisibilityFilter(limit=2),
            VisibilityFilter(limit=0),
            VisibilityFilter(offset=4),
            VisibilityFilter(limit=1, offset=100),
            VisibilityFilter(status=_C, limit=1, offset=1, newest_first=True),
        ):
            expected = sum(1 for r in rows if f.matches(r))
            ctx.expect_equal(await store.count(f), expected, f"count({_describe_filter(f)})")
        ctx.expect_equal(await store.count(None), len(rows), "count(None)")


# --------------------------------------------------------------------------
# Safety, randomized comparison
# --------------------------------------------------------------------------

_SQL = "x' OR '1'='1"


async def visibility_values_bound_safely(ctx: ScenarioContext) -> None:
    """Quotes, SQL text and LIKE wildcards in ids, types, queues and values are plain data."""
    async with ctx.open() as store:
        rows = await _upsert_all(
            ctx,
            store,
            [
                _row("o'brien", workflow_type=_SQL, task_queue="%", search={"k": _SQL, "t": ("%", "_")}),
                _row(
                    'x"; DROP TABLE visibility; --', workflow_type="t", task_queue="_", search={"k": "100%"}
                ),
                _row("plain", workflow_type="t", task_queue="q", search={"k": "a\\b", "t": ("x",)}),
                _row("like", workflow_type="t%", task_queue="q", search={"k": "ab", "t": ("%",)}),
                _row("nul-free ünïcode", workflow_type="t", task_queue="Q", search={"k": "naïve 🐍"}),
            ],
        )
        p = SearchPredicate
        E, C = SearchOp.EQUALS, SearchOp.CONTAINS
        for f in (
            None,
            VisibilityFilter(workflow_type=_SQL),
            VisibilityFilter(workflow_type="t%"),
            VisibilityFilter(workflow_type="%"),
            VisibilityFilter(task_queue="%"),
            VisibilityFilter(task_queue="_"),
            VisibilityFilter(task_queue="q"),
            VisibilityFilter(search=[p(key="k", op=E, value=_SQL)]),
            VisibilityFilter(search=[p(key="k", op=E, value="' OR 1=1 --")]),
            VisibilityFilter(search=[p(key="k", op=C, value="%")]),
            VisibilityFilter(search=[p(key="k", op=C, value="_")]),
            VisibilityFilter(search=[p(key="k", op=C, value="\\")]),
            VisibilityFilter(search=[p(key="k", op=C, value="'")]),
            VisibilityFilter(search=[p(key="t", op=C, value="%")]),
            VisibilityFilter(search=[p(key="t", op=C, value="_")]),
            VisibilityFilter(search=[p(key="k", op=C, value="🐍")]),
        ):
            await _expect_listing(ctx, store, rows, f)
        for row in rows:
            ctx.expect_equal(await store.get(row.workflow_id), row, f"get({row.workflow_id!r})")


_RANDOM_STRINGS = ["eu", "us", "EU", "e", "a%b", "a_b", "x'y", "", "Zed", "é"]
_RANDOM_INTS = [-3, 0, 1, 2, 7, 2**53 + 1]
_RANDOM_FLOATS = [0.0, 1.0, 1.5, 2.0, -3.5, 7.25]
_RANDOM_LISTS: list[tuple[str, ...]] = [(), ("eu",), ("eu", "us"), ("us", "eu"), ("a%b",), ("e", "e")]
_RANDOM_KEYS = ["region", "amount", "priority", "vip", "tags", "note"]


def _random_value(rng: random.Random) -> SearchValue:
    kind = rng.randrange(5)
    if kind == 0:
        return rng.choice(_RANDOM_STRINGS)
    if kind == 1:
        return rng.choice(_RANDOM_INTS)
    if kind == 2:
        return rng.choice(_RANDOM_FLOATS)
    if kind == 3:
        return rng.random() < 0.5
    return rng.choice(_RANDOM_LISTS)


_STARTS = [0, 1, 1, 2, 3, 5, 8, 13, 21, 34]
_CLOSES = [None, None, 40, 41, 42.5, 50, 60]
_TYPES = ["order", "ship", "Order", "refund"]
_QUEUES = ["default", "q1", "Q1", "q2"]


def random_rows(rng: random.Random, count: int = RANDOM_ROWS) -> list[VisibilityRow]:
    """``count`` upserts over fewer workflow ids (some ids are replaced), in a seeded order."""
    ids = [f"wf-{i:03d}" for i in range(count * 3 // 4)]
    out = []
    for _ in range(count):
        keys = rng.sample(_RANDOM_KEYS, rng.randrange(len(_RANDOM_KEYS) + 1))
        close = rng.choice(_CLOSES)
        status = rng.choice(list(WorkflowStatus)) if close is not None else _R
        out.append(
            _row(
                rng.choice(ids),
                workflow_type=rng.choice(_TYPES),
                status=status,
                start=rng.choice(_STARTS),
                close=close,
                task_queue=rng.choice(_QUEUES),
                search={k: _random_value(rng) for k in keys},
            )
        )
    return out


def _random_predicate(rng: random.Random) -> SearchPredicate:
    key = rng.choice([*_RANDOM_KEYS, "missing"])
    op = rng.choice(list(SearchOp))
    value: SearchValue
    if op is SearchOp.EQUALS:
        value = _random_value(rng)
    elif op is SearchOp.CONTAINS:
        value = rng.choice(_RANDOM_STRINGS)
    else:
        orderable: list[SearchValue] = [*_RANDOM_STRINGS, *_RANDOM_INTS, *_RANDOM_FLOATS]
        value = rng.choice(orderable)
    return SearchPredicate(key=key, op=op, value=value)


def random_filter(rng: random.Random) -> VisibilityFilter:
    kwargs: dict[str, Any] = {}
    if rng.random() < 0.3:
        kwargs["workflow_type"] = rng.choice(_TYPES)
    if rng.random() < 0.3:
        kwargs["status"] = rng.sample(list(WorkflowStatus), rng.randrange(1, 4))
    if rng.random() < 0.2:
        kwargs["task_queue"] = rng.choice(_QUEUES)
    if rng.random() < 0.3:
        kwargs["started_after"] = s.at(rng.choice(_STARTS))
    if rng.random() < 0.3:
        kwargs["started_before"] = s.at(rng.choice(_STARTS))
    if rng.random() < 0.2:
        kwargs["closed_after"] = s.at(rng.choice([c for c in _CLOSES if c is not None]))
    if rng.random() < 0.2:
        kwargs["closed_before"] = s.at(rng.choice([c for c in _CLOSES if c is not None]))
    kwargs["search"] = [_random_predicate(rng) for _ in range(rng.choice([0, 0, 1, 1, 1, 2]))]
    if rng.random() < 0.4:
        kwargs["limit"] = rng.randrange(0, 30)
    if rng.random() < 0.3:
        kwargs["offset"] = rng.randrange(0, 40)
    kwargs["newest_first"] = rng.random() < 0.3
    return VisibilityFilter(**kwargs)


async def visibility_randomized_against_oracle(ctx: ScenarioContext) -> None:
    """200 seeded random upserts and 100 random filters agree with VisibilityFilter.apply/matches."""
    async with ctx.open() as store:
        rng = random.Random(RANDOM_SEED)
        latest: dict[str, VisibilityRow] = {}
        for row in await _upsert_all(ctx, store, random_rows(rng)):
            latest[row.workflow_id] = row
        rows = list(latest.values())
        for index in range(RANDOM_FILTERS):
            await _expect_listing(
                ctx, store, rows, random_filter(rng), f"random filter #{index} (seed {RANDOM_SEED})"
            )


# --------------------------------------------------------------------------
# Checkpoints and close
# --------------------------------------------------------------------------


async def visibility_every_method_is_a_checkpoint(ctx: ScenarioContext) -> None:
    """upsert, get, list, count and aclose are cancel and schedule points, also when closed."""
    async with ctx.open() as store:
        row = _row("cp")
        calls: list[tuple[str, Any, type[BaseException] | None]] = [
            ("upsert", lambda: store.upsert(row), None),
            ("get", lambda: store.get("cp"), None),
            ("get of an unknown id", lambda: store.get("nope"), None),
            ("list", lambda: store.list(VisibilityFilter(workflow_type="order")), None),
            ("list(None)", lambda: store.list(None), None),
            ("count", lambda: store.count(VisibilityFilter(status=_C)), None),
            ("aclose", store.aclose, None),
            ("aclose again", store.aclose, None),
            ("upsert after aclose", lambda: store.upsert(row), trio.ClosedResourceError),
            ("get after aclose", lambda: store.get("cp"), trio.ClosedResourceError),
            ("list after aclose", lambda: store.list(None), trio.ClosedResourceError),
            ("count after aclose", lambda: store.count(None), trio.ClosedResourceError),
        ]
        for what, call, raises in calls:
            await ctx.expect_checkpoint(what, call, raises=raises)


async def visibility_use_after_close(ctx: ScenarioContext) -> None:
    """After aclose every method raises trio.ClosedResourceError; aclose itself is idempotent."""
    async with ctx.open() as store:
        await _upsert_all(ctx, store, [_row("closing")])
        await store.aclose()
        try:
            await store.aclose()
        except Exception as exc:
            ctx.fail(f"a second aclose() raised {type(exc).__name__}: {exc}; aclose must be idempotent")
        calls: list[tuple[str, Any]] = [
            ("upsert", lambda: store.upsert(_row("late"))),
            ("get", lambda: store.get("closing")),
            ("list", lambda: store.list(None)),
            ("list with a filter", lambda: store.list(VisibilityFilter(limit=1))),
            ("count", lambda: store.count(None)),
        ]
        for what, call in calls:
            with ctx.expect_raises(trio.ClosedResourceError, f"{what} after aclose()"):
                await call()
