"""Typed payloads: arguments and results arrive as the types the functions annotate (issue 20, item 2).

Every value goes through a real engine (the selected store: memory, SQLite or PostgreSQL) and
is checked for its exact type at the far end: workflow inputs, activity arguments and results,
child workflow results, ``RunHandle.result()``, signal handlers' and query handlers' arguments.
A restart replays the recorded history and gives the same typed values.  Values that do not fit
raise :class:`aion_trio.PayloadDecodeError` naming the path; un-annotated parameters keep the
plain JSON data, as before.
"""

from __future__ import annotations

import dataclasses
import enum
import uuid
from collections.abc import Callable
from datetime import date, datetime, timezone
from decimal import Decimal
from typing import Any, TypedDict

import attrs
import pytest
import trio
import trio.testing

import aion_trio as aion


class Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Size(enum.IntEnum):
    S = 1
    L = 3


class Address(TypedDict):
    city: str
    zip: int


@dataclasses.dataclass(frozen=True)
class Item:
    sku: int
    price: Decimal
    colour: Colour = Colour.RED


@attrs.frozen
class Order:
    id: uuid.UUID
    placed: datetime
    due: date
    items: list[Item]
    ship_to: Address
    sizes: tuple[Size, ...]
    tags: frozenset[str]
    notes: dict[str, int | None]
    ref: int | str


@dataclasses.dataclass
class Receipt:
    order_id: uuid.UUID
    total: Decimal
    at: datetime
    items: list[Item]


ORDER = Order(
    id=uuid.UUID("12345678-1234-5678-1234-567812345678"),
    placed=datetime(2026, 3, 1, 12, 30, tzinfo=timezone.utc),
    due=date(2026, 3, 9),
    items=[Item(1, Decimal("2.50")), Item(2, Decimal("0.1"), Colour.BLUE)],
    ship_to={"city": "Brno", "zip": 60200},
    sizes=(Size.S, Size.L),
    tags=frozenset({"gift", "fragile"}),
    notes={"a": 1, "b": None},
    ref="web-7",
)

seen: list[Any] = []


@aion.activity
async def charge(order: Order, extra: Decimal) -> Receipt:
    seen.append(("charge", order, extra))
    total = sum((i.price for i in order.items), extra)
    return Receipt(order_id=order.id, total=total, at=order.placed, items=order.items)


@aion.activity
def charge_in_thread(order: Order) -> Receipt:
    seen.append(("thread", order))
    return Receipt(order_id=order.id, total=Decimal(0), at=order.placed, items=[])


@aion.workflow
async def ship(ctx: aion.WorkflowContext, order: Order) -> list[Item]:
    return list(reversed(order.items))


@aion.workflow
async def checkout(ctx: aion.WorkflowContext, order: Order) -> Receipt:
    seen.append(("workflow", order))
    receipt = await ctx.run(charge, order, Decimal("1.25"))
    seen.append(("activity result", receipt))
    seen.append(("thread result", await ctx.run(charge_in_thread, order)))
    shipped = await ctx.child(ship, order, workflow_id=f"ship-{ctx.workflow_id}")
    seen.append(("child result", shipped))
    await ctx.sleep(10)  # a restart may come here: the replay decodes the same values
    return receipt


def expected_receipt() -> Receipt:
    return Receipt(order_id=ORDER.id, total=Decimal("3.85"), at=ORDER.placed, items=ORDER.items)


def check_seen() -> None:
    assert [s[0] for s in seen] == [
        "workflow",
        "charge",
        "activity result",
        "thread",
        "thread result",
        "child result",
    ]
    assert seen[0] == ("workflow", ORDER)
    assert type(seen[0][1]) is Order
    assert type(seen[0][1].placed) is type(ORDER.placed)
    assert type(seen[0][1].items[1].colour) is Colour
    assert type(seen[0][1].sizes[1]) is Size
    assert seen[1] == ("charge", ORDER, Decimal("1.25"))
    assert type(seen[1][2]) is Decimal
    assert seen[2] == ("activity result", expected_receipt())
    assert type(seen[2][1]) is Receipt
    assert seen[3] == ("thread", ORDER)
    assert seen[4] == (
        "thread result",
        Receipt(order_id=ORDER.id, total=Decimal(0), at=ORDER.placed, items=[]),
    )
    assert seen[5] == ("child result", list(reversed(ORDER.items)))
    assert all(type(i) is Item and type(i.colour) is Colour for i in seen[5][1])


async def test_every_supported_type_round_trips_through_the_engine_and_its_replay(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    seen.clear()
    url = store_url()
    defs: dict[str, Any] = {"workflows": [checkout, ship], "activities": [charge, charge_in_thread]}
    async with aion.open_engine(url, **defs) as engine:
        await engine.start(checkout, ORDER, workflow_id="order-1")
        with trio.fail_after(5):
            while len(seen) < 6:
                await trio.testing.wait_all_tasks_blocked()
                await trio.sleep(1)
    check_seen()
    first = list(seen)
    seen.clear()
    # A restart replays the history: the code sees the very same typed values again.
    async with aion.open_engine(url, **defs) as engine:
        with trio.fail_after(60):
            plain = await engine.result("order-1")
        assert seen == [e for e in first if e[0] not in ("charge", "thread")]
        run = await engine.start(checkout, ORDER, workflow_id="order-2")
        with trio.fail_after(60):
            typed = await run.result()
    assert type(typed) is Receipt
    assert typed == expected_receipt()
    # The stored form is plain JSON data: Engine.result (no definition) gives it as is.
    assert plain == {
        "order_id": "12345678-1234-5678-1234-567812345678",
        "total": "3.85",
        "at": "2026-03-01T12:30:00+00:00",
        "items": [
            {"sku": 1, "price": "2.50", "colour": "red"},
            {"sku": 2, "price": "0.1", "colour": "blue"},
        ],
    }


def test_typed_values_encode_to_plain_json() -> None:
    codec = aion.PayloadCodec()
    text = codec.encode([ORDER]).json
    assert text == (
        '[{"id":"12345678-1234-5678-1234-567812345678","placed":"2026-03-01T12:30:00+00:00",'
        '"due":"2026-03-09","items":[{"sku":1,"price":"2.50","colour":"red"},'
        '{"sku":2,"price":"0.1","colour":"blue"}],"ship_to":{"city":"Brno","zip":60200},'
        '"sizes":[1,3],"tags":["fragile","gift"],"notes":{"a":1,"b":null},"ref":"web-7"}]'
    )
    with pytest.raises(aion.PayloadNotSerializable, match="cannot be sorted"):
        codec.encode({1, "a"})


@aion.activity(retry=aion.RetryPolicy(max_attempts=5))
async def pick(order: Order) -> int:
    return len(order.items)


@aion.workflow
async def picks(ctx: aion.WorkflowContext, raw: dict[str, Any]) -> object:
    try:
        return await ctx.run(pick, raw)  # the workflow passes plain data that does not fit
    except aion.ActivityFailure as exc:
        return {"type": exc.error.type, "message": exc.error.message, "cause": exc.error.cause.value}


@aion.workflow
async def takes_order(ctx: aion.WorkflowContext, order: Order) -> None:
    raise AssertionError("not reached: the input does not decode")


def bad_order() -> dict[str, Any]:
    data: dict[str, Any] = aion.Payload.of(ORDER).value()
    data["items"][1]["sku"] = "x"
    return data


async def test_an_activity_input_that_does_not_fit_fails_the_attempt_for_good_naming_the_path(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    async with aion.open_engine(store_url(), workflows=[picks], activities=[pick]) as engine:
        run = await engine.start(picks, bad_order())
        with trio.fail_after(60):
            outcome = await run.result()
        history = await engine.history(run.workflow_id)
    assert outcome == {
        "type": "PayloadDecodeError",
        "message": "input of activity 'pick': order.items[1].sku: expected int, got \"x\"",
        "cause": "terminal",
    }
    assert sum(type(e.body).__name__ == "ActivityStarted" for e in history) == 1  # never retried


async def test_a_workflow_input_that_does_not_fit_fails_the_run_naming_the_path(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    data = bad_order()
    data["ship_to"] = {"city": "Brno"}
    async with aion.open_engine(store_url(), workflows=[takes_order]) as engine:
        run = await engine.start(takes_order, data)
        with trio.fail_after(60), pytest.raises(aion.WorkflowFailure) as failed:
            await run.result()
    assert failed.value.error is not None
    assert failed.value.error.type == "PayloadDecodeError"
    # The first field that does not fit, in declaration order.
    assert (
        failed.value.error.message
        == "input of workflow 'takes_order': order.items[1].sku: expected int, got \"x\""
    )


@pytest.mark.parametrize(
    ("kind", "value", "message"),
    [
        (Order, {**aion.Payload.of(ORDER).value(), "ship_to": {"city": "Brno"}}, "x.ship_to.zip: missing"),
        (
            list[Item],
            [{"sku": 1, "price": "1"}, {"sku": 2, "price": "two"}],
            "x[1].price: expected a decimal str",
        ),
        (dict[str, Colour], {"a": "red", "b": "green"}, "x['b']: ValueError"),
        (datetime, "yesterday", 'x: expected an ISO 8601 datetime str, got "yesterday"'),
        (int, True, "x: expected int, got true"),
        (uuid.UUID | None, "nope", 'x: expected a UUID str, got "nope"'),
    ],
)
def test_decode_errors_name_the_path(kind: Any, value: Any, message: str) -> None:
    hints_of = aion.workflow(_with_param(kind)).hints
    with pytest.raises(aion.PayloadDecodeError) as raised:
        hints_of.decode_arguments([value], what="input of workflow 'w'")
    assert str(raised.value).startswith(f"input of workflow 'w': {message}")
    assert isinstance(raised.value, aion.PayloadError)


def _with_param(kind: Any) -> Callable[..., Any]:
    async def w(ctx: aion.WorkflowContext, x: Any) -> None:
        pass

    w.__annotations__ = {"ctx": aion.WorkflowContext, "x": kind, "return": None}
    return w


@aion.activity
async def echo_plain(a, b: Any, c: dict, d: list, when: date) -> Any:  # type: ignore[no-untyped-def]
    return [a, b, c, d, when]


@aion.workflow
async def plain(ctx, a, b: Any, when: date):  # type: ignore[no-untyped-def]
    got = await ctx.run(echo_plain, a, b, {"k": [1]}, [{"x": 1}], when)
    return {"types": [type(v).__name__ for v in (a, b, when, *got)], "got": got}


async def test_unannotated_and_any_parameters_keep_the_plain_json_data(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    async with aion.open_engine(store_url(), workflows=[plain], activities=[echo_plain]) as engine:
        run = await engine.start(
            plain, {"n": "2026-03-01"}, ["2026-03-01", "12345678-1234-5678-1234-567812345678"], "2026-03-01"
        )
        with trio.fail_after(60):
            result = await run.result()
    # The annotated parameter beside them is decoded (the control: decoding runs in this very call).
    assert result["types"] == ["dict", "list", "date", "dict", "list", "dict", "list", "str"]
    assert result["got"][:2] == [{"n": "2026-03-01"}, ["2026-03-01", "12345678-1234-5678-1234-567812345678"]]
    assert result["got"][4] == "2026-03-01"  # the un-annotated result: plain data, as stored


@dataclasses.dataclass
class Approval:
    by: str
    at: datetime


@aion.workflow
async def approvals(ctx: aion.WorkflowContext) -> list[Approval]:
    got: list[Approval] = []

    def on_approve(approval: Approval) -> None:
        assert type(approval) is Approval
        assert isinstance(approval.at, datetime)
        got.append(approval)

    def latest(after: date) -> Approval | None:
        assert type(after) is date
        return next((a for a in reversed(got) if a.at.date() >= after), None)

    ctx.set_signal_handler("approve", on_approve)
    ctx.set_query_handler("latest", latest)
    await ctx.wait_condition(lambda: len(got) >= 2)
    return got


async def test_signal_and_query_handlers_get_their_annotated_types(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    at = datetime(2026, 3, 2, 9, 0, tzinfo=timezone.utc)
    async with aion.open_engine(store_url(), workflows=[approvals]) as engine:
        run = await engine.start(approvals)
        await engine.signal(run.workflow_id, "approve", Approval("ann", at))
        await engine.signal(run.workflow_id, "approve", {"by": "bob", "at": "2026-03-03T10:00:00+00:00"})
        with trio.fail_after(60):
            result = await run.result()
            # A closed run's queries replay its history: the handlers get typed values there too.
            answer = await engine.query(run.workflow_id, "latest", date(2026, 3, 3))
            earlier = await engine.query(run.workflow_id, "latest", date(2026, 3, 1))
            with pytest.raises(aion.PayloadDecodeError, match="arguments of query 'latest': after: expected"):
                await engine.query(run.workflow_id, "latest", "soon")
    assert answer == {"by": "bob", "at": "2026-03-03T10:00:00+00:00"}
    assert earlier == answer
    assert result == [Approval("ann", at), Approval("bob", datetime(2026, 3, 3, 10, tzinfo=timezone.utc))]


def test_hints_are_read_once_per_definition(monkeypatch: pytest.MonkeyPatch) -> None:
    import typing

    calls: list[object] = []
    real = typing.get_type_hints

    def counting(obj: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(obj)
        return real(obj, *args, **kwargs)

    monkeypatch.setattr(typing, "get_type_hints", counting)
    definition = aion.activity(_plain_charge)
    for _ in range(3):
        assert definition.hints.decode_arguments([{"sku": 1, "price": "1"}], what="w") == [
            Item(1, Decimal(1))
        ]
        assert definition.hints.decode_result(["1"], what="w") == [Decimal(1)]
    assert calls == [_plain_charge]


async def _plain_charge(item: Item) -> list[Decimal]:
    return [item.price]
