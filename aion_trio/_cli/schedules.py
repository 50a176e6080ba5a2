"""``aion-trio schedule``: create, list, show, pause, unpause, trigger, backfill and delete
durable schedules (docs/schedules.md).

The commands change the stored schedules directly, by compare-and-set (a
schedule is not a history: no engine needs to be opened, and the store's
owner needs no inbox command); the engine that owns the store sees the change
at its next look (``EngineConfig.schedule_poll_interval``) and fires from it.
``show`` lists the recent actions and the next ten fire times.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta
from typing import Any, TypeVar

import click
from rich.table import Table

from .._engine.schedules import ScheduleBook, ScheduleDescription, build_schedule, describe_schedule
from .._errors import InvalidSchedule
from .._ownership import wall_now
from .._plugins import open_store
from .._schedules import Overlap, Schedule, iso, schedule_to_json
from .._store import ScheduleStore
from .._urls import redact_url
from .errors import UsageProblem, run
from .options import json_argument, parse_time, resolve_store, store_option
from .render import make_console, when
from .stores import load_registry, open_for_reading

T = TypeVar("T")
_OVERLAPS = [o.value for o in Overlap]


@contextlib.asynccontextmanager
async def _book(url: str, *, write: bool) -> AsyncIterator[ScheduleBook]:
    opener = open_store(url, registry=load_registry()) if write else open_for_reading(url)
    async with opener as opened:
        yield ScheduleBook(
            store=opened if isinstance(opened, ScheduleStore) else None,
            location=redact_url(url),
            now=wall_now,
        )


def _with_book(store: str | None, write: bool, fn: Callable[[ScheduleBook], Awaitable[T]]) -> T:
    url = resolve_store(store)

    async def go() -> T:
        async with _book(url, write=write) as book:
            return await fn(book)

    return run(url, go)


def _description_json(description: ScheduleDescription) -> dict[str, Any]:
    schedule = description.schedule
    data: dict[str, Any] = json.loads(schedule_to_json(schedule))
    data["version"] = schedule.version
    data["next_times"] = [iso(t) for t in description.next_times]
    return data


def _spec_text(schedule: Schedule) -> str:
    spec = schedule.spec
    if spec.cron is not None:
        return f"cron {spec.cron!r} ({spec.time_zone})"
    assert spec.interval is not None
    offset = f" + {spec.offset}" if spec.offset else ""
    return f"every {spec.interval}{offset}"


def _print_list(descriptions: list[ScheduleDescription], url: str) -> None:
    console = make_console()
    if not descriptions:
        console.print(f"No schedules in {redact_url(url)}.")
        return
    table = Table(title=f"Schedules in {redact_url(url)}", title_justify="left")
    for column in ("schedule", "workflow", "spec", "state", "next", "started", "skipped"):
        table.add_column(column, overflow="fold")
    for d in descriptions:
        s = d.schedule
        table.add_row(
            s.schedule_id,
            s.action.workflow_type,
            _spec_text(s),
            f"paused: {s.state.note}" if s.state.paused else "active",
            when(d.next_times[0]) if d.next_times else "-",
            str(s.state.started_count),
            str(s.state.skipped_count),
        )
    console.print(table)


def _print_show(d: ScheduleDescription) -> None:
    console = make_console()
    s = d.schedule
    console.print(f"[bold]Schedule[/bold] {s.schedule_id}")
    console.print(f"  workflow:   {s.action.workflow_type} {json.dumps(list(s.action.args))}")
    console.print(f"  spec:       {_spec_text(s)}")
    if s.spec.jitter:
        console.print(f"  jitter:     {s.spec.jitter}")
    if s.spec.start_at or s.spec.end_at:
        console.print(f"  between:    {when(s.spec.start_at)} and {when(s.spec.end_at)}")
    console.print(f"  overlap:    {s.policy.overlap.value}; catch-up window {s.policy.catchup_window}")
    console.print(
        f"  state:      {'paused' if s.state.paused else 'active'}{': ' + s.state.note if s.state.note else ''}"
    )
    console.print(f"  counts:     {s.state.started_count} started, {s.state.skipped_count} skipped")
    if s.state.pending:
        console.print(f"  waiting:    {', '.join(when(p.nominal_time) for p in s.state.pending)}")
    recent = Table(title="Recent actions", title_justify="left")
    for column in ("nominal time", "action", "workflow", "reason"):
        recent.add_column(column, overflow="fold")
    for r in d.recent:
        recent.add_row(when(r.nominal_time), r.kind.value, r.workflow_id or "-", r.reason or "-")
    console.print(recent if d.recent else "Recent actions: none yet")
    console.print("Next actions: " + (", ".join(when(t) for t in d.next_times) if d.next_times else "none"))


def _overlap_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--overlap", type=click.Choice(_OVERLAPS), default=None, help="The overlap policy.")(
        fn
    )


@click.group("schedule")
def schedule() -> None:
    """Durable schedules: create, list, show, pause, unpause, trigger, backfill, delete.

    \b
    Examples:
      aion-trio schedule create nightly report --cron '0 2 * * *' --tz Europe/Paris --args '["eu"]'
      aion-trio schedule show nightly
      aion-trio schedule pause nightly --note 'migration tonight'
    """


@schedule.command("create")
@store_option
@click.argument("schedule_id")
@click.argument("workflow")
@click.option(
    "--args", "args_json", default="[]", metavar="JSON", help="The workflow's arguments, a JSON list."
)
@click.option("--cron", default=None, help="A five-field cron expression (minute hour day month weekday).")
@click.option(
    "--tz", "time_zone", default="UTC", show_default=True, help="The cron expression's IANA time zone."
)
@click.option("--interval", type=float, default=None, metavar="SECONDS", help="Fire every SECONDS instead.")
@click.option("--offset", type=float, default=0.0, metavar="SECONDS", help="The interval's offset.")
@click.option("--jitter", type=float, default=0.0, metavar="SECONDS", help="Fire up to SECONDS late.")
@click.option("--start", "start_at", default=None, metavar="TIME", help="No tick before TIME (ISO-8601).")
@click.option("--end", "end_at", default=None, metavar="TIME", help="No tick after TIME (ISO-8601).")
@_overlap_option
@click.option("--catchup-window", type=float, default=60.0, show_default=True, metavar="SECONDS")
@click.option("--memo", "memo_json", default="{}", metavar="JSON", help="A JSON object passed to each run.")
@click.option("--attrs", "attrs_json", default="{}", metavar="JSON", help="Search attributes of each run.")
@click.option("--task-queue", default=None)
@click.option("--paused", is_flag=True, help="Create it paused.")
@click.option("--note", default="", help="A note (why it is paused).")
def create(
    store: str | None,
    schedule_id: str,
    workflow: str,
    args_json: str,
    cron: str | None,
    time_zone: str,
    interval: float | None,
    offset: float,
    jitter: float,
    start_at: str | None,
    end_at: str | None,
    overlap: str | None,
    catchup_window: float,
    memo_json: str,
    attrs_json: str,
    task_queue: str | None,
    paused: bool,
    note: str,
) -> None:
    """Create schedule SCHEDULE_ID starting WORKFLOW (a workflow type name) at each tick.

    The engine that owns the store fires it; a WORKFLOW that engine does not
    have is recorded as a skipped tick."""
    args = json_argument(args_json, "--args")
    if not isinstance(args, list):
        raise click.BadParameter("must be a JSON list", param_hint="--args")
    options: dict[str, Any] = {
        "cron": cron,
        "interval": None if interval is None else timedelta(seconds=interval),
        "offset": timedelta(seconds=offset),
        "time_zone": time_zone,
        "jitter": timedelta(seconds=jitter),
        "start_at": parse_time(start_at, "--start"),
        "end_at": parse_time(end_at, "--end"),
        "catchup_window": timedelta(seconds=catchup_window),
        "memo": json_argument(memo_json, "--memo"),
        "search_attributes": json_argument(attrs_json, "--attrs"),
        "task_queue": task_queue,
        "paused": paused,
        "note": note,
    }
    if overlap is not None:
        options["overlap"] = overlap
    try:
        new = build_schedule(schedule_id, workflow, args, now=wall_now(), options=options)
    except InvalidSchedule as exc:
        raise UsageProblem(str(exc)) from None

    async def go(book: ScheduleBook) -> ScheduleDescription:
        return describe_schedule(await book.create(new), wall_now())

    description = _with_book(store, True, go)
    first = when(description.next_times[0]) if description.next_times else "never"
    click.echo(f"created schedule {schedule_id!r}: {_spec_text(description.schedule)}, first tick {first}")


@schedule.command("list")
@store_option
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of objects instead of a table.")
def list_schedules(store: str | None, as_json: bool) -> None:
    """List the schedules with their next fire time."""

    async def go(book: ScheduleBook) -> list[ScheduleDescription]:
        now = wall_now()
        return [describe_schedule(s, now, 1) for s in await book.list()]

    descriptions = _with_book(store, False, go)
    if as_json:
        click.echo(json.dumps([_description_json(d) for d in descriptions], indent=2, ensure_ascii=False))
        return
    _print_list(descriptions, resolve_store(store))


@schedule.command("show")
@store_option
@click.argument("schedule_id")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def show_schedule(store: str | None, schedule_id: str, as_json: bool) -> None:
    """Show a schedule: its spec, state, recent actions and next ten fire times."""

    async def go(book: ScheduleBook) -> ScheduleDescription:
        return describe_schedule(await book.read(schedule_id), wall_now())

    description = _with_book(store, False, go)
    if as_json:
        click.echo(json.dumps(_description_json(description), indent=2, ensure_ascii=False))
        return
    _print_show(description)


def _changed(store: str | None, fn: Callable[[ScheduleBook], Awaitable[Schedule]], message: str) -> None:
    _with_book(store, True, fn)
    click.echo(message)


@schedule.command("pause")
@store_option
@click.argument("schedule_id")
@click.option("--note", default="", help="Why it is paused (shown by 'show').")
def pause(store: str | None, schedule_id: str, note: str) -> None:
    """Pause a schedule: its ticks are recorded as skipped until it is unpaused."""
    _changed(store, lambda book: book.pause(schedule_id, note), f"paused schedule {schedule_id!r}")


@schedule.command("unpause")
@store_option
@click.argument("schedule_id")
@click.option("--note", default="", help="A note.")
def unpause(store: str | None, schedule_id: str, note: str) -> None:
    """Unpause a schedule: it fires again from its next tick."""
    _changed(store, lambda book: book.unpause(schedule_id, note), f"unpaused schedule {schedule_id!r}")


@schedule.command("trigger")
@store_option
@click.argument("schedule_id")
@_overlap_option
def trigger(store: str | None, schedule_id: str, overlap: str | None) -> None:
    """Ask for a run now; the engine owning the store starts it at its next look."""
    _changed(store, lambda book: book.trigger(schedule_id, overlap), f"triggered schedule {schedule_id!r}")


@schedule.command("backfill")
@store_option
@click.argument("schedule_id")
@click.option("--start", "start", required=True, metavar="TIME", help="From TIME (ISO-8601, inclusive).")
@click.option("--end", "end", required=True, metavar="TIME", help="To TIME (ISO-8601, inclusive).")
@_overlap_option
def backfill(store: str | None, schedule_id: str, start: str, end: str, overlap: str | None) -> None:
    """Ask for the ticks between --start and --end (a tick that ran already does not run again)."""
    begin = parse_time(start, "--start")
    finish = parse_time(end, "--end")
    assert begin is not None
    assert finish is not None
    _changed(
        store,
        lambda book: book.backfill(schedule_id, begin, finish, overlap),
        f"backfill of schedule {schedule_id!r} from {when(begin)} to {when(finish)} queued",
    )


@schedule.command("delete")
@store_option
@click.argument("schedule_id")
def delete(store: str | None, schedule_id: str) -> None:
    """Delete a schedule (the runs it started go on)."""

    async def go(book: ScheduleBook) -> None:
        await book.delete(schedule_id)

    _with_book(store, True, go)
    click.echo(f"deleted schedule {schedule_id!r}")
