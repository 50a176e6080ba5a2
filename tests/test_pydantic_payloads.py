"""pydantic models as typed payloads (issue 20, item 2): when the user's code uses pydantic
(the ``pydantic`` extra), a model is encoded to its JSON form and decoded to the model the
function annotates, through a real engine and its replay; a validation error is a
:class:`aion_trio.PayloadDecodeError` naming the path.  aion_trio never imports pydantic itself.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from datetime import date

import pydantic
import pytest
import trio
import trio.testing

import aion_trio as aion
from aion_trio._convert import decode


class Line(pydantic.BaseModel):
    sku: str
    quantity: int = pydantic.Field(gt=0)


class Invoice(pydantic.BaseModel):
    number: int
    issued: date
    lines: list[Line]


class Receipt(pydantic.BaseModel):
    number: int
    total_items: int


seen: list[object] = []


@aion.activity
async def bill(invoice: Invoice) -> Receipt:
    seen.append(invoice)
    return Receipt(number=invoice.number, total_items=sum(line.quantity for line in invoice.lines))


@aion.workflow
async def invoicing(ctx: aion.WorkflowContext, invoice: Invoice) -> Receipt:
    seen.append(invoice)
    receipt = await ctx.run(bill, invoice)
    seen.append(receipt)
    await ctx.sleep(5)  # a restart may come here: the replay decodes the same models
    return receipt


INVOICE = Invoice(
    number=7, issued=date(2026, 1, 2), lines=[Line(sku="a", quantity=2), Line(sku="b", quantity=3)]
)


async def test_pydantic_models_are_decoded_to_the_annotated_model_through_the_engine_and_its_replay(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    url = store_url()
    seen.clear()
    async with aion.open_engine(url, workflows=[invoicing], activities=[bill]) as engine:
        run = await engine.start(invoicing, INVOICE, workflow_id="inv-7")
        with trio.fail_after(5):
            while len(seen) < 3:
                await trio.testing.wait_all_tasks_blocked()
                await trio.lowlevel.checkpoint()
    assert [type(v) for v in seen] == [Invoice, Invoice, Receipt]
    assert seen[0] == INVOICE
    assert seen[1] == INVOICE
    seen.clear()
    # A restart replays the recorded history: the workflow sees the very same models again.
    async with aion.open_engine(url, workflows=[invoicing], activities=[bill]) as engine:
        with trio.fail_after(30):
            result = await engine.result("inv-7")
    assert result == {"number": 7, "total_items": 5}  # a client without hints gets plain data
    assert type(seen[0]) is Invoice
    assert seen[0] == INVOICE
    assert type(seen[-1]) is Receipt
    assert seen[-1] == Receipt(number=7, total_items=5)
    assert run.workflow_id == "inv-7"


async def test_an_invalid_model_input_fails_the_run_naming_the_path(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    bad = {
        "number": 8,
        "issued": "2026-01-02",
        "lines": [{"sku": "a", "quantity": 1}, {"sku": "b", "quantity": 0}],
    }
    async with aion.open_engine(store_url(), workflows=[invoicing], activities=[bill]) as engine:
        run = await engine.start(invoicing, bad, workflow_id="inv-8")
        with trio.fail_after(5), pytest.raises(aion.WorkflowFailure) as failure:
            await run.result()
    assert failure.value.error.type == "PayloadDecodeError"
    assert "invoice.lines[1].quantity" in failure.value.error.message
    assert "greater than 0" in failure.value.error.message


@pytest.mark.parametrize(
    ("value", "path", "detail"),
    [
        ({"number": "x", "issued": "2026-01-02", "lines": []}, "number", "valid integer"),
        (
            {"number": 1, "issued": "2026-01-02", "lines": [{"sku": 5, "quantity": 1}]},
            "lines[0].sku",
            "valid string",
        ),
        ({"number": 1, "lines": []}, "issued", "Field required"),
    ],
)
def test_validation_errors_name_the_path_inside_the_model(value: object, path: str, detail: str) -> None:
    with pytest.raises(aion.PayloadDecodeError) as raised:
        decode(value, Invoice, what="input of activity 'bill'", path="invoice")
    assert raised.value.path == f"invoice.{path}"
    assert detail in raised.value.detail


def test_models_nested_in_containers_decode_and_encode() -> None:
    encoded = aion.PayloadCodec().encode({"batch": [INVOICE]})
    assert encoded.value() == {"batch": [INVOICE.model_dump(mode="json")]}
    assert decode(encoded.value()["batch"], list[Invoice], what="x", path="") == [INVOICE]
    with pytest.raises(aion.PayloadDecodeError) as raised:
        decode([{"number": 1}], list[Invoice], what="x", path="batch")
    assert raised.value.path.startswith("batch[0].")


def test_aion_trio_does_not_import_pydantic() -> None:
    code = "import sys, aion_trio, aion_trio._convert, aion_trio._payload; print('pydantic' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
