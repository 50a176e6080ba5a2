"""Watching from the terminal: ``list --follow`` and ``show ID --follow``.

On a terminal the table (or the whole ``show`` page) is redrawn in place every
``--interval`` seconds. Piped, or with ``--json``, only what changed is printed,
one line per change, so a script can read it as it comes: for ``list`` a row that
appeared or changed (``--json``: its JSON object), for ``show`` each new event
(``--json``: its wire form, as ``history --json`` prints it). ``show`` ends when
the workflow's latest run has ended, ``list`` when Ctrl-C stops it; Ctrl-C ends
either with exit status 0 (stopping to watch is not a failure).
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import click
import trio
from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from .._engine import describe_history
from .._events import WorkflowStatus
from .._payload import PayloadCodec
from .._store import VisibilityFilter
from .._urls import redact_url
from .._wire import event_to_json
from .errors import CommandInterrupted, UsageProblem, run
from .render import event_line, make_console, row_json, row_line, show_parts, workflows_table
from .stores import open_for_reading, read_history, read_slot_waits

#: Seconds between two reads of the store when ``--interval`` is not given.
DEFAULT_INTERVAL = 1.0

F = TypeVar("F", bound=Callable[..., Any])


def follow_options(fn: F) -> F:
    fn = click.option(
        "--interval",
        type=click.FloatRange(min=0, min_open=True),
        metavar="SECONDS",
        help=f"With --follow: seconds between two reads of the store (default {DEFAULT_INTERVAL:g}).",
    )(fn)
    return click.option(
        "--follow",
        "-f",
        is_flag=True,
        help="Keep watching: redraw on a terminal; piped or with --json, print one line per change.",
    )(fn)


def follow_interval(follow: bool, interval: float | None) -> float | None:
    """The seconds between reads when following, ``None`` when not (``--interval`` alone is refused)."""
    if not follow:
        if interval is not None:
            raise UsageProblem("--interval is only for --follow")
        return None
    return DEFAULT_INTERVAL if interval is None else interval


def _emit(line: str) -> None:
    click.echo(line)
    sys.stdout.flush()  # piped stdout is block-buffered: a reader sees each change as it happens


@contextlib.contextmanager
def _screen(console: Console, live: bool) -> Iterator[Live | None]:
    if not live:
        yield None
        return
    # Redrawn by the loop after each read, not by a refresh thread of rich's.
    with Live(console=console, auto_refresh=False, redirect_stdout=False, redirect_stderr=False) as screen:
        yield screen


def _until_ctrl_c(url: str, fn: Callable[[], Awaitable[None]]) -> None:
    try:
        run(url, fn)
    except CommandInterrupted:
        return  # Ctrl-C is how a watch ends: the command's code has unwound, the store is closed


def follow_list(url: str, page: VisibilityFilter, *, as_json: bool, interval: float) -> None:
    console = make_console()
    title = f"Workflows in {redact_url(url)}"

    async def watch() -> None:
        seen: dict[str, dict[str, Any]] = {}
        async with open_for_reading(url) as opened:
            with _screen(console, console.is_terminal and not as_json) as screen:
                while True:
                    rows = await opened.visibility.list(page)
                    if screen is not None:
                        total = await opened.visibility.count(page)
                        footer = (
                            f"{len(rows)} of {total} matching workflows; every {interval:g}s; Ctrl-C stops"
                        )
                        screen.update(Group(workflows_table(rows, title), Text(footer)), refresh=True)
                    else:
                        for row in reversed(rows):  # oldest first: the lines read in the order things began
                            data = row_json(row)
                            if seen.get(row.workflow_id) != data:
                                seen[row.workflow_id] = data
                                _emit(json.dumps(data, ensure_ascii=False) if as_json else row_line(row))
                    await trio.sleep(interval)

    _until_ctrl_c(url, watch)


def follow_show(url: str, workflow_id: str, *, as_json: bool, interval: float) -> None:
    console = make_console()

    async def watch() -> None:
        printed = 0
        async with open_for_reading(url) as opened:
            with _screen(console, console.is_terminal and not as_json) as screen:
                while True:
                    events = await read_history(opened, workflow_id)
                    row = await opened.visibility.get(workflow_id)
                    description = describe_history(
                        workflow_id,
                        events,
                        codec=PayloadCodec(),
                        stuck_reason=row.stuck_reason if row else None,
                    )
                    if screen is not None:
                        waits = await read_slot_waits(opened, workflow_id)
                        screen.update(Group(*show_parts(events, description, waits)), refresh=True)
                    else:
                        for event in events[printed:]:
                            _emit(event_to_json(event) if as_json else event_line(event))
                        printed = len(events)
                    if description.status is not WorkflowStatus.RUNNING:
                        return
                    await trio.sleep(interval)

    _until_ctrl_c(url, watch)
