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

import contextlib
import functools
import logging
import math
import os
import shlex
import sys
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

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup  # type: ignore[import-not-found,unused-ignore]

from ._activities import activity_info
from ._context import WorkflowContext
from ._definitions import activity, workflow
from ._engine import Engine, IdReusePolicy, open_engine
from ._errors import ActivityFailure, NotRunning, QueryError, TerminalError, WorkflowFailure
from ._events import ActivityFailed, SignalReceived, WorkflowStarted, WorkflowStatus
from ._interrupt import Interrupted, run_interruptible
from ._plugins import open_store
from ._projections import workflow_status
from ._retry import Fixed, RetryPolicy
from ._store import Store

#: Seconds; the demo's own timings (kept short so a run takes a few seconds).
COOLING_OFF = 1.0
DEFAULT_ORDERS = 100
DEFAULT_DB = Path("aion-demo.db")
#: The shell's exit status for a process ended by SIGINT.
EXIT_INTERRUPTED = 130
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


class DemoMismatch(click.UsageError):
    """``--orders`` differs from the number of orders the database was started with."""


def _order_id(n: int) -> str:
    return f"demo-order-{n}"


async def _stored_plan(store: Store) -> int | None:
    """How many orders the demo in this database was started with (``None``: a new database).

    Every order's input carries the planned total (``of``), so a run killed before all
    orders arrived still resumes the whole plan, not just the orders already started.
    Read from the store before an engine opens it: an engine recovers the stored runs at
    once, and a refused count must leave the database as it found it.
    """
    history = await store.events.read_history(_order_id(1))
    if not history or not isinstance(history[0].body, WorkflowStarted):
        return None
    (order,) = history[0].body.input.value()
    return int(order["of"])


async def run_demo(db: Path, orders: int | None, console: Console) -> dict[str, Any]:
    started = time.monotonic()
    async with contextlib.AsyncExitStack() as stack:
        store = await stack.enter_async_context(open_store(f"sqlite:///{db}"))
        planned = await _stored_plan(store)
        if planned is not None and orders is not None and orders != planned:
            raise DemoMismatch(
                f"{db} holds a demo of {planned} orders, not {orders}: run 'aion-trio demo' without "
                f"--orders to resume it, or add --fresh to start over with {orders}"
            )
        engine = await stack.enter_async_context(
            open_engine(
                store,
                workflows=[demo_order, demo_shipment],
                activities=[demo_reserve, demo_charge, demo_release, demo_ship],
            )
        )
        orders = planned or orders or DEFAULT_ORDERS
        ids = [_order_id(n) for n in range(1, orders + 1)]
        existing = await engine.count(workflow_type="demo_order")
        if existing:
            finished = existing - await engine.count(
                workflow_type="demo_order", status=WorkflowStatus.RUNNING
            )
            console.print(
                f"Resuming from {db}: {existing} of {orders} orders found ({finished} finished); "
                "nothing that completed runs again.",
                soft_wrap=True,
            )
        else:
            console.print(
                f"Starting {orders} orders in {db} (interrupt any time, then run again to resume).",
                soft_wrap=True,
            )
        # Orders arrive over a few seconds (all at once when resuming), so there is time
        # to watch them, and to interrupt the demo mid-way.
        to_start = list(enumerate(ids, 1))
        per_tick = orders if existing else max(1, math.ceil(orders / 40))
        live_ids: list[str] = []
        signalled: set[str] = set()

        async def start_some() -> None:
            for _ in range(min(per_tick, len(to_start))):
                n, wid = to_start.pop(0)
                await engine.start(
                    demo_order, {"n": n, "of": orders}, workflow_id=wid, id_reuse=IdReusePolicy.USE_EXISTING
                )
                live_ids.append(wid)
                if any(isinstance(e.body, SignalReceived) for e in await engine.history(wid)):
                    signalled.add(wid)

        async def counts() -> tuple[dict[str, int], int]:
            # The orders of this demo only, from the histories just read: the database may
            # hold other workflows, and orders not started yet are in no column.
            statuses = Counter(workflow_status(engine_history[w]) for w in live_ids if w in engine_history)
            running = statuses[WorkflowStatus.RUNNING]
            completed = statuses[WorkflowStatus.COMPLETED]
            failed = sum(statuses.values()) - running - completed
            stages = await _stages(engine, [w for w in live_ids if w not in done])
            waiting = min(running, sum(stages[s] for s in WAITING_STAGES))
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


def _interrupted(exc: BaseException) -> bool:
    """A Ctrl-C, possibly inside the exception groups of the nurseries it crossed."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_interrupted(inner) for inner in exc.exceptions)
    return isinstance(exc, (KeyboardInterrupt, Interrupted))


@click.command("demo")
@click.option(
    "--db",
    type=click.Path(dir_okay=False, path_type=Path),
    default=DEFAULT_DB,
    show_default=True,
    help="The SQLite file the demo writes (run the same command again to resume).",
)
@click.option(
    "--orders",
    type=click.IntRange(1, 10_000),
    default=None,
    help=f"How many orders (default {DEFAULT_ORDERS}); a resumed demo keeps the number it started with.",
)
@click.option("--fresh", is_flag=True, help="Delete the demo database first and start over.")
def demo_command(db: Path, orders: int | None, fresh: bool) -> None:
    """Process ~100 orders durably on SQLite, live; interrupt and rerun to see them resume."""
    if fresh:
        for suffix in ("", "-wal", "-shm"):
            path = Path(f"{db}{suffix}")
            if path.exists():
                os.remove(path)
    console = Console(highlight=False)
    again = "aion-trio demo" + ("" if db == DEFAULT_DB else f" --db {shlex.quote(str(db))}")
    console.print(
        f"aion-trio demo: pid {os.getpid()}; stop it with Ctrl-C (or kill -9 {os.getpid()}), "
        f"then run '{again}' to resume.",
        soft_wrap=True,
    )
    # The live table counts retries; the per-attempt warnings would only scroll it away.
    package_log = logging.getLogger("aion_trio")
    level = package_log.level
    package_log.setLevel(logging.ERROR)
    try:
        summary = run_interruptible(functools.partial(run_demo, db, orders, console))
    except BaseException as exc:
        if not _interrupted(exc):
            raise
        console.print(
            f"Interrupted. Run '{again}' to resume: every order carries on from its last "
            "recorded step, and nothing that completed runs again.",
            soft_wrap=True,
        )
        sys.exit(EXIT_INTERRUPTED)
    finally:
        package_log.setLevel(level)
    console.print(summary_table(summary))
