"""An activity written for asyncio, run by the Trio engine through trio-asyncio.

    python examples/asyncio_activity.py
    python examples/asyncio_activity.py --skus widget,gizmo,sprocket,bolt --busy gizmo

Many client libraries are asyncio-only.  Declare such an activity with
``@aion.activity(loop="asyncio")``: the engine opens one trio-asyncio loop
and runs the coroutine on it, so inside the activity plain asyncio code works
(here ``asyncio.open_connection``, ``asyncio.wait_for`` and asyncio streams),
while workflows and the engine stay on Trio.  It needs the ``asyncio`` extra
(``pip install 'aion-trio[asyncio]'``; the ``test`` extra includes it).

The other side is a small asyncio TCP price service on 127.0.0.1 that the
script starts in its own thread and event loop: it stands in for a remote
system.  It answers ``BUSY`` to the first request for the ``--busy`` item,
so that activity raises ``ConnectionError`` once and its retry policy runs
it again: retries work the same for asyncio activities.  The workflow asks
for every price at once (``ctx.start`` + ``ctx.gather``) and adds them up.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import trio

import aion_trio as aion

# -- the remote system: an asyncio server in its own thread -------------------------------


def price_cents(sku: str) -> int:
    """The service's price list: a made-up, fixed price per item."""
    return 100 + sum(map(ord, sku)) % 900


@contextlib.contextmanager
def price_service(busy: str) -> Iterator[int]:
    """Serve ``PRICE <sku>`` on 127.0.0.1 in a background thread's asyncio loop; yields the port."""
    refused: set[str] = set()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sku = (await reader.readline()).decode().removeprefix("PRICE ").strip()
        if sku == busy and sku not in refused:
            refused.add(sku)  # only once: the retry gets an answer
            writer.write(b"BUSY\n")
        else:
            writer.write(f"{sku} {price_cents(sku)}\n".encode())
        await writer.drain()
        writer.close()

    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(asyncio.start_server(handle, "127.0.0.1", 0))
    thread = threading.Thread(target=loop.run_forever, name="price-service", daemon=True)
    thread.start()
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        server.close()
        loop.run_until_complete(server.wait_closed())
        loop.close()


# -- the workflow side -------------------------------------------------------------------


@aion.activity(
    loop="asyncio",  # an asyncio coroutine: the engine runs it through trio-asyncio
    retry=aion.RetryPolicy(max_attempts=3, backoff=aion.Fixed(delay=0.05)),
    timeout=timedelta(seconds=10),
)
async def fetch_price(port: int, sku: str) -> dict[str, Any]:
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), timeout=5)
    try:
        writer.write(f"PRICE {sku}\n".encode())
        await writer.drain()
        reply = (await asyncio.wait_for(reader.readline(), timeout=5)).decode().split()
    finally:
        writer.close()
        await writer.wait_closed()
    if reply == ["BUSY"]:
        raise ConnectionError("the price service is busy")  # transient: retried by the policy
    return {"sku": sku, "cents": int(reply[1]), "attempt": aion.activity_info().attempt}


@aion.workflow
async def quote(ctx: aion.WorkflowContext, port: int, skus: list[str]) -> dict[str, Any]:
    prices = await ctx.gather(*(ctx.start(fetch_price, port, sku) for sku in skus))
    return {"prices": prices, "total_cents": sum(p["cents"] for p in prices)}


async def main(port: int, skus: list[str]) -> dict[str, Any]:
    async with aion.open_engine("memory://", workflows=[quote], activities=[fetch_price]) as engine:
        run = await engine.start(quote, port, skus)
        result: dict[str, Any] = await run.result()
        return result


def cli() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--skus", default="widget,gizmo,sprocket", help="comma-separated items to price")
    parser.add_argument("--busy", default="gizmo", help="the item whose first request finds the service busy")
    args = parser.parse_args()
    skus = [s for s in args.skus.split(",") if s]
    if not skus:
        parser.error("--skus needs at least one item")
    with price_service(args.busy) as port:
        print("asyncio price service listening on 127.0.0.1 (its own thread and event loop)")
        result = trio.run(main, port, skus)
    for price in result["prices"]:
        retried = f"attempt {price['attempt']}, the first found the service busy"
        note = retried if price["attempt"] > 1 else f"attempt {price['attempt']}"
        print(f"{price['sku']}: {price['cents'] / 100:.2f} ({note})")
    print(f"total for {len(skus)} items: {result['total_cents'] / 100:.2f}")


if __name__ == "__main__":
    cli()
