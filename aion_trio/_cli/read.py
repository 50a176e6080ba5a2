"""The read-only commands: ``stores``, ``list``, ``show``, ``history`` and ``event get``."""

from __future__ import annotations

import json
from typing import Any

import click
import trio
from rich.table import Table
from rich.text import Text

from .._engine import describe_history
from .._errors import InvalidQuery
from .._events import Event
from .._payload import PayloadCodec
from .._projections import is_active, published_event
from .._store import VisibilityRow
from .._urls import redact_url
from .._wire import event_to_json
from ..plugin import ENTRY_POINT_GROUP
from .errors import UsageProblem, run
from .options import filter_options, resolve_store, store_option, visibility_filter
from .render import (
    SlotWaits,
    history_table,
    make_console,
    print_show,
    row_json,
    show_json,
    workflows_table,
)
from .stores import load_registry, open_for_reading, read_history, read_slot_waits
from .watch import follow_interval, follow_list, follow_options, follow_show


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of objects instead of a table.")
def stores(as_json: bool) -> None:
    """List the store URL schemes that installed plugins register.

    Plugins are found through the 'aion_trio' entry-point group; set
    AION_TRIO_DISABLE_PLUGINS=name[,name...] (or '*') to skip some.
    """
    schemes = load_registry().schemes()
    if as_json:
        data = [{"scheme": s.scheme, "plugin": s.plugin, "description": s.description} for s in schemes]
        click.echo(json.dumps(data, indent=2))
        return
    console = make_console()
    if not schemes:
        console.print(
            Text(
                f"No store plugins are registered (entry-point group {ENTRY_POINT_GROUP!r}).", style="yellow"
            )
        )
        return
    table = Table(title="Store schemes")
    table.add_column("Scheme", no_wrap=True, style="bold")
    table.add_column("Plugin", no_wrap=True)
    table.add_column("Description")
    for s in schemes:
        # Text, not markup: a description is plugin-supplied and may contain '[...]'.
        table.add_row(Text(f"{s.scheme}://"), Text(s.plugin), Text(s.description))
    console.print(table)


@click.command("list")
@store_option
@filter_options
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print a JSON list of objects instead of a table (JSON lines with --follow).",
)
@follow_options
def list_(
    store: str | None,
    statuses: tuple[str, ...],
    workflow_type: str | None,
    task_queue: str | None,
    started_after: str | None,
    started_before: str | None,
    closed_after: str | None,
    closed_before: str | None,
    attrs_: tuple[str, ...],
    limit: int,
    offset: int,
    as_json: bool,
    follow: bool,
    interval: float | None,
) -> None:
    """List workflows, newest first, with filters.

    \b
    Examples:
      aion-trio list --status running --type checkout
      aion-trio list --started-after 2026-11-30T08:00 --attr region=eu --attr 'amount>100'
      aion-trio list --status running --follow
    """
    url = resolve_store(store)
    every = follow_interval(follow, interval)
    try:
        page = visibility_filter(
            statuses=statuses,
            workflow_type=workflow_type,
            task_queue=task_queue,
            started_after=started_after,
            started_before=started_before,
            closed_after=closed_after,
            closed_before=closed_before,
            attrs_=attrs_,
            limit=limit,
            offset=offset,
        )
    except InvalidQuery as exc:
        raise UsageProblem(f"bad filter: {exc}") from None
    if every is not None:
        follow_list(url, page, as_json=as_json, interval=every)
        return

    async def query() -> tuple[list[VisibilityRow], int]:
        async with open_for_reading(url) as opened:
            return await opened.visibility.list(page), await opened.visibility.count(page)

    rows, total = run(url, query)
    if as_json:
        click.echo(json.dumps([row_json(r) for r in rows], indent=2, ensure_ascii=False))
        return
    console = make_console()
    if not rows:
        console.print(f"No workflows match ({total} in total match the filters; offset {offset}).")
        return
    console.print(workflows_table(rows, f"Workflows in {redact_url(url)}"))
    console.print(f"{offset + 1}-{offset + len(rows)} of {total} matching workflows")


@click.command()
@store_option
@click.argument("workflow_id")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print one JSON object (the summary, and the history's events); with --follow, each new event as JSON.",
)
@follow_options
def show(store: str | None, workflow_id: str, as_json: bool, follow: bool, interval: float | None) -> None:
    """Show one workflow: summary, pending work, failure, and its history.

    With --follow it keeps watching until the workflow's latest run ends (or Ctrl-C).
    """
    url = resolve_store(store)
    every = follow_interval(follow, interval)
    if every is not None:
        follow_show(url, workflow_id, as_json=as_json, interval=every)
        return

    async def read() -> tuple[list[Event], VisibilityRow | None, SlotWaits | None]:
        async with open_for_reading(url) as opened:
            events = await read_history(opened, workflow_id)
            row = await opened.visibility.get(workflow_id)
            return events, row, await read_slot_waits(opened, workflow_id)

    events, row, slot_waits = run(url, read)
    description = describe_history(
        workflow_id, events, codec=PayloadCodec(), stuck_reason=row.stuck_reason if row else None
    )
    if as_json:
        click.echo(json.dumps(show_json(events, description, slot_waits), indent=2, ensure_ascii=False))
        return
    print_show(make_console(), events, description, slot_waits)


@click.command()
@store_option
@click.argument("workflow_id")
@click.option("--json", "as_json", is_flag=True, help="Print the events as JSON lines (the wire form).")
def history(store: str | None, workflow_id: str, as_json: bool) -> None:
    """Print a workflow's event history (a table, or JSON lines with --json)."""
    url = resolve_store(store)

    async def read() -> list[Event]:
        async with open_for_reading(url) as opened:
            return await read_history(opened, workflow_id)

    events = run(url, read)
    if as_json:
        for event in events:
            click.echo(event_to_json(event))
        return
    make_console().print(history_table(events, f"History of {workflow_id}"))


EVENT_POLL_SECONDS = 0.2
"""How often ``aion-trio event get --timeout`` re-reads the store while it waits."""


@click.group()
def event() -> None:
    """Read the durable events workflows publish with ctx.set_event."""


@event.command("get")
@store_option
@click.argument("workflow_id")
@click.argument("key")
@click.option(
    "--timeout",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    metavar="SECONDS",
    help="Wait up to SECONDS for the workflow to publish KEY (re-reading the store).",
)
def event_get(store: str | None, workflow_id: str, key: str, timeout: float) -> None:
    """Print the JSON value workflow WORKFLOW_ID last published under KEY.

    Prints null if it has not (within --timeout), and at once if the workflow is
    closed without publishing it, as engine.get_event returns None.
    """
    url = resolve_store(store)

    async def read() -> Any:
        async with open_for_reading(url) as opened:
            events = await read_history(opened, workflow_id)
            with trio.move_on_after(timeout):
                while True:
                    published = published_event(events, key)
                    if published is not None:
                        return published.value()
                    if not is_active(events):
                        return None
                    await trio.sleep(EVENT_POLL_SECONDS)
                    events = await read_history(opened, workflow_id)
            return None

    click.echo(json.dumps(run(url, read), ensure_ascii=False, separators=(",", ":")))
