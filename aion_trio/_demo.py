"""``aion-trio demo``: order processing on the embedded SQLite store, shown live.

About 100 order workflows, each: reserve stock (fails transiently on the first
attempt of every fourth order: the retry policy retries it), charge the card
(every ninth is declined: compensation releases the stock), wait for the
"packed" signal the demo itself sends, a short durable cooling-off timer, then
a child workflow that ships the order.  A live table shows what is running,
waiting, done or failed and how many retries happened so far; a summary table
closes the run.

Interrupt it (Ctrl-C, or ``kill -9``) and run the same command again: the
workflows resume from the database instead of starting over, and the demo says
so.  ``--fresh`` starts over with a new database.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import Counter
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import click
import trio
from rich.console import Console
from rich.live import Live
from rich.table import Table

from ._activities import activity_info
from ._context import WorkflowContext
from ._definitions import activity, workflow
from ._engine import Engine, IdReusePolicy, open_engine
from ._errors import ActivityFailure, NotRunning, QueryError, TerminalError, WorkflowFailure
from ._events import ActivityFailed, SignalReceived, WorkflowStatus
from ._projections import workflow_status
from ._retry import Fixed, RetryPolicy

#: Seconds; the demo's own timings (kept short so a run takes a few seconds).
COOLING_OFF = 1.0
RETRY = RetryPolicy(max_attempts=4, backoff=Fixed(delay=0.3))


@activity(retry=RETRY)
async def demo_reserve(order: dict[str, Any]) -> str:
    if order["n"] % 4 == 0 and activity_info().attempt == 1:
        raise ConnectionError("inventory service busy")
    await trio.sleep(0.05)
    return f"reservation-{order['n']}"


@activity
async def demo_charge(order: dict[str, Any]) -> str:
    await trio.sleep(0.05)
    if order["n"] % 9 == 0:
        raise TerminalError(f"card declined for order {order['n']}")
    return f"charge-{order['n']}"


@activity
async def demo_release(reservation: str) -> str:
    return f"released {reservation}"


@activity
async def demo_ship(order: dict[str, Any]) -> str:
    await trio.sleep(0.1)
    return f"parcel-{order['n']}"


@workflow
async def demo_shipment(ctx: WorkflowContext, order: dict[str, Any]) -> str:
    return str(await ctx.run(demo_ship, order))


@workflow
async def demo_order(ctx: WorkflowContext, order: dict[str, Any]) -> dict[str, Any]:
    stage = "reserving"
    ctx.set_query_handler("stage", lambda: stage)
    reservation = await ctx.run(demo_reserve, order)
    stage = "charging"
    try:
        await ctx.run(demo_charge, order)
    except ActivityFailure as failure:
        stage = "compensating"
        await ctx.run(demo_release, reservation)
        return {"outcome": "declined, stock released", "reason": failure.error.message}
    stage = "waiting for packing"
    packed_by = await ctx.wait_signal("packed", timeout=timedelta(minutes=5))
    stage = "cooling off"
    await ctx.sleep(COOLING_OFF)
    stage = "shipping"
    parcel = await ctx.child(demo_shipment, order)
    return {"outcome": "shipped", "packed_by": packed_by, "parcel": parcel}


WAITING_STAGES = {"waiting for packing", "cooling off"}


async def _stages(engine: Engine, ids: Sequence[str]) -> Counter[str]:
    stages: Counter[str] = Counter()
    for wid in ids:
        try:
            stages[str(await engine.query(wid, "stage"))] += 1
        except (NotRunning, QueryError):
            stages["busy"] += 1
    return stages


def _progress_table(counts: dict[str, int], retries: int, elapsed: float) -> Table:
    table = Table(title=f"aion-trio demo — {elapsed:5.1f} s")
    for column in ("running", "waiting", "completed", "failed", "retries so far"):
        table.add_column(column, justify="right")
    table.add_row(
        str(counts["running"]),
        str(counts["waiting"]),
        str(counts["completed"]),
        str(counts["failed"]),
        str(retries),
    )
    return table


async def run_demo(db: Path, orders: int, console: Console) -> dict[str, Any]:
    ids = [f"demo-order-{n}" for n in range(1, orders + 1)]
    started = time.monotonic()
    async with open_engine(
        f"sqlite:///{db}",
        workflows=[demo_order, demo_shipment],
        activities=[demo_reserve, demo_charge, demo_release, demo_ship],
    ) as engine:
        existing = await engine.count(workflow_type="demo_order")
        if existing:
            finished = existing - await engine.count(
                workflow_type="demo_order", status=WorkflowStatus.RUNNING
            )
            console.print(
                f"Resuming from {db}: {existing} orders found ({finished} finished); "
                "nothing that completed runs again."
            )
        else:
            console.print(f"Starting {orders} orders in {db} (interrupt any time, then run again to resume).")
        # Orders arrive over a few seconds (all at once when resuming), so there is time
        # to watch them, and to interrupt the demo mid-way.
        to_start = list(enumerate(ids, 1))
        per_tick = orders if existing else max(1, math.ceil(orders / 40))
        live_ids: list[str] = []
        signalled: set[str] = set()

        async def start_some() -> None:
            for _ in range(min(per_tick, len(to_start))):
                n, wid = to_start.pop(0)
                await engine.start(demo_order, {"n": n}, workflow_id=wid, id_reuse=IdReusePolicy.USE_EXISTING)
                live_ids.append(wid)
                if any(isinstance(e.body, SignalReceived) for e in await engine.history(wid)):
                    signalled.add(wid)

        async def counts() -> tuple[dict[str, int], int]:
            running = await engine.count(workflow_type="demo_order", status=WorkflowStatus.RUNNING)
            completed = await engine.count(workflow_type="demo_order", status=WorkflowStatus.COMPLETED)
            failed = len(live_ids) - running - completed
            stages = await _stages(engine, [w for w in live_ids if w not in done])
            waiting = sum(stages[s] for s in WAITING_STAGES)
            retries = 0
            for wid in ids:
                retries += sum(
                    1
                    for e in engine_history.get(wid, [])
                    if isinstance(e.body, ActivityFailed) and not e.body.final
                )
            return {
                "running": running - waiting,
                "waiting": waiting,
                "completed": completed,
                "failed": failed,
            }, retries

        done: set[str] = set()
        engine_history: dict[str, list[Any]] = {}
        live_console = console if console.is_terminal else None
        last_plain: dict[str, int] = {}
        with (
            Live(console=console, auto_refresh=False, transient=False) if live_console else _NoLive() as live
        ):
            while True:
                await start_some()
                for wid in live_ids:
                    if wid in done:
                        continue
                    if wid not in signalled:
                        try:
                            if await engine.query(wid, "stage") == "waiting for packing":
                                await engine.signal(wid, "packed", "demo packer")
                                signalled.add(wid)
                        except (NotRunning, QueryError):
                            pass
                    history = engine_history[wid] = await engine.history(wid)
                    if workflow_status(history) is not WorkflowStatus.RUNNING:
                        done.add(wid)
                current, retries = await counts()
                elapsed = time.monotonic() - started
                if live_console is not None:
                    live.update(_progress_table(current, retries, elapsed), refresh=True)
                elif current != last_plain:
                    last_plain = current  # plain output: one line whenever a count changes
                    print(
                        "progress: "
                        + " ".join(f"{k}={v}" for k, v in current.items())
                        + f" retries={retries}",
                        flush=True,
                    )
                if len(done) == orders and not to_start:
                    break
                await trio.sleep(0.2)
        outcomes: Counter[str] = Counter()
        for wid in ids:
            try:
                outcomes[(await engine.result(wid))["outcome"]] += 1
            except WorkflowFailure as failure:
                outcomes[failure.status] += 1
        _, retries = await counts()
        return {
            "orders": orders,
            "resumed": existing,
            "outcomes": dict(sorted(outcomes.items())),
            "retries": retries,
            "seconds": round(time.monotonic() - started, 1),
        }


class _NoLive:
    def __enter__(self) -> _NoLive:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, *args: object, **kwargs: object) -> None:
        return None


def summary_table(summary: dict[str, Any]) -> Table:
    table = Table(title=f"{summary['orders']} orders in {summary['seconds']} s")
    table.add_column("outcome")
    table.add_column("orders", justify="right")
    for outcome, count in summary["outcomes"].items():
        table.add_row(outcome, str(count))
    table.add_row("retries (transient failures retried)", str(summary["retries"]))
    if summary["resumed"]:
        table.add_row("resumed from the database", str(summary["resumed"]))
    return table


@click.command("demo")
@click.option(
    "--db",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path("aion-demo.db"),
    show_default=True,
    help="The SQLite file the demo writes (run the same command again to resume).",
)
@click.option("--orders", type=click.IntRange(1, 10_000), default=100, show_default=True)
@click.option("--fresh", is_flag=True, help="Delete the demo database first and start over.")
def demo_command(db: Path, orders: int, fresh: bool) -> None:
    """Process ~100 orders durably on SQLite, live; interrupt and rerun to see them resume."""
    if fresh:
        for suffix in ("", "-wal", "-shm"):
            path = Path(f"{db}{suffix}")
            if path.exists():
                os.remove(path)
    console = Console(highlight=False)
    # The live table counts retries; the per-attempt warnings would only scroll it away.
    logging.getLogger("aion_trio").setLevel(logging.ERROR)
    summary = trio.run(run_demo, db, orders, console)
    console.print(summary_table(summary))
