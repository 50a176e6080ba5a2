"""Rendering for people (rich tables, plain text when piped) and for machines (JSON)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Any

from rich.console import Console, RenderableType
from rich.table import Table
from rich.text import Text

from .._codecs import ENVELOPE_KEY, describe_encoded, is_encoded
from .._engine import WorkflowDescription
from .._events import (
    ActivityCompleted,
    ActivityFailed,
    ActivityScheduled,
    ActivityStarted,
    Event,
    EventBody,
    SignalReceived,
    TimerStarted,
    WorkflowCompleted,
    WorkflowFailed,
    WorkflowStarted,
    WorkflowStatus,
)
from .._payload import Payload
from .._projections import outstanding_timers, run_segment
from .._store import FlowWaiter, VisibilityRow
from .._wire import body_to_wire, event_to_wire, format_datetime

#: Columns of the tables when stdout is not a terminal (a terminal: its width; $COLUMNS: that).
PIPED_WIDTH = 100

_STATUS_STYLE = {
    WorkflowStatus.RUNNING: "cyan",
    WorkflowStatus.COMPLETED: "green",
    WorkflowStatus.FAILED: "red",
    WorkflowStatus.CANCELLED: "yellow",
    WorkflowStatus.TIMED_OUT: "red",
    WorkflowStatus.CONTINUED_AS_NEW: "blue",
    WorkflowStatus.RESET: "magenta",
}


def make_console() -> Console:
    console = Console(highlight=False)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        # Piped or redirected: a fixed width that fits a review tool or an e-mail.
        console = Console(highlight=False, width=PIPED_WIDTH)
    return console


def status_text(status: WorkflowStatus) -> Text:
    return Text(status.value, style=_STATUS_STYLE.get(status, ""))


def when(value: datetime | None, *, precise: bool = False) -> str:
    if value is None:
        return "-"
    utc = value.astimezone(timezone.utc)
    return utc.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z" if precise else utc.strftime("%Y-%m-%d %H:%M:%SZ")


def short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _payload_text(payload: Payload, limit: int = 60) -> str:
    if is_encoded(payload):  # written through codecs this command was not given
        return describe_encoded(payload)
    return short(payload.json, limit)


def _wire_value_text(value: Any) -> str:
    if isinstance(value, dict) and ENVELOPE_KEY in value:
        return describe_encoded(Payload.of(value))
    return json_text(value, 40)


def json_text(value: Any, limit: int = 60) -> str:
    return short(json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str), limit)


def event_detail(body: EventBody) -> str:
    """A short, one-line description of an event body, for people."""
    if isinstance(body, WorkflowStarted):
        text = f"{body.workflow_type}({_payload_text(body.input)}) run {body.run_id}"
        if body.parent_run_id:
            text += f" continues {body.parent_run_id}"
        return text
    if isinstance(body, WorkflowCompleted):
        return f"result {_payload_text(body.result)}"
    if isinstance(body, WorkflowFailed):
        return short(f"{body.error.type}: {body.error.message}", 80)
    if isinstance(body, ActivityScheduled):
        return f"activity:{body.activity_id} {body.activity_type}({_payload_text(body.input)})"
    if isinstance(body, ActivityStarted):
        return f"activity:{body.activity_id} attempt {body.attempt}"
    if isinstance(body, ActivityCompleted):
        return f"activity:{body.activity_id} attempt {body.attempt} -> {_payload_text(body.result)}"
    if isinstance(body, ActivityFailed):
        settles = "final" if body.final else "will retry"
        return short(
            f"activity:{body.activity_id} attempt {body.attempt} {body.error.cause.value}, {settles}: "
            f"{body.error.type}: {body.error.message}",
            100,
        )
    if isinstance(body, TimerStarted):
        return f"{body.timer_id} fires at {when(body.fire_at, precise=True)}"
    if isinstance(body, SignalReceived):
        return f"{body.name} {_payload_text(body.payload)}"
    # Every other event: its wire fields, shortened.
    _, data = body_to_wire(body)
    parts = [f"{k}={_wire_value_text(v)}" for k, v in data.items() if k not in ("traceback", "details")]
    return short(" ".join(parts), 100)


def history_table(events: Sequence[Event], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("Seq", justify="right", no_wrap=True)
    table.add_column("Time (UTC)", no_wrap=True)
    table.add_column("Event", no_wrap=True, style="bold")
    table.add_column("Detail")
    for event in events:
        table.add_row(
            str(event.seq),
            when(event.recorded_at, precise=True),
            type(event.body).__name__,
            Text(event_detail(event.body)),
        )
    return table


def row_json(row: VisibilityRow) -> dict[str, Any]:
    return {
        "workflow_id": row.workflow_id,
        "run_id": row.run_id,
        "workflow_type": row.workflow_type,
        "status": row.status.value,
        "start_time": format_datetime(row.start_time),
        "close_time": format_datetime(row.close_time) if row.close_time is not None else None,
        "task_queue": row.task_queue,
        "failed_step": row.failed_step,
        "failure_reason": row.failure_reason,
        "stuck_reason": row.stuck_reason,
        "search_attributes": _attributes_json(row.search_attributes),
    }


def row_note(row: VisibilityRow) -> str:
    """The Note column of ``list``: why a run is stuck, else where and why it failed."""
    note = row.stuck_reason and f"stuck: {row.stuck_reason}"
    if note is None and row.failure_reason:
        note = f"{row.failed_step}: {row.failure_reason}" if row.failed_step else row.failure_reason
    return short(note or "", 80)


def workflows_table(rows: Sequence[VisibilityRow], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    # Narrow output (PIPED_WIDTH) wraps the times and folds the type; an id stays whole.
    table.add_column("Workflow ID", no_wrap=True, style="bold")
    table.add_column("Type", overflow="fold")
    table.add_column("Status", no_wrap=True)
    table.add_column("Started (UTC)", overflow="fold")
    table.add_column("Closed (UTC)", overflow="fold")
    table.add_column("Note", overflow="fold")
    for row in rows:
        table.add_row(
            Text(row.workflow_id),
            Text(row.workflow_type),
            status_text(row.status),
            when(row.start_time),
            when(row.close_time),
            Text(row_note(row)),
        )
    return table


def row_line(row: VisibilityRow) -> str:
    """One row of ``list`` as one plain line (``list --follow`` when piped)."""
    parts = [row.workflow_id, row.workflow_type, row.status.value, when(row.start_time), when(row.close_time)]
    note = row_note(row)
    return " ".join([*parts, note] if note else parts)


def event_line(event: Event) -> str:
    """One event of a history as one plain line (``show --follow`` when piped)."""
    return f"{event.seq} {when(event.recorded_at, precise=True)} {type(event.body).__name__} {event_detail(event.body)}"


def _attributes_json(attributes: Mapping[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in attributes.items()}


SlotWaits = Mapping[tuple[str, int], FlowWaiter]
"""The recorded waits for a flow-control slot of a workflow, by (run id, activity id)."""


def print_show(
    console: Console, events: list[Event], description: WorkflowDescription, slot_waits: SlotWaits | None
) -> None:
    for part in show_parts(events, description, slot_waits):
        console.print(part)


SLOT_WAITS_NOT_KNOWN = (
    "not known from the store (it does not record waits for a flow-control slot; the engine "
    "serving the run has them: engine.describe(), engine.statistics())"
)
"""What ``show`` says of a running run's slot waits when its store does not record them."""


def _waiting(description: WorkflowDescription, slot_waits: SlotWaits) -> list[tuple[int, FlowWaiter]]:
    """The current run's pending activities whose attempt waits for a slot, as recorded."""
    found = []
    for activity in description.pending_activities:
        waiter = slot_waits.get((description.run_id, activity.activity_id))
        if waiter is not None:
            found.append((activity.activity_id, waiter))
    return found


RESIDENCY_NOT_KNOWN = (
    "not known from the store (the engine serving the run has it: engine.describe(), engine.statistics())"
)
"""What ``show`` says of a running run's residency when it only read the store."""


def show_parts(
    events: list[Event], description: WorkflowDescription, slot_waits: SlotWaits | None
) -> list[RenderableType]:
    """What ``show`` prints, part by part (``show --follow`` redraws them as one group).

    ``slot_waits``: what the store recorded of attempts waiting for a flow-control
    slot (``None``: the store records none, so whether one waits is not known)."""
    parts: list[RenderableType] = []
    summary = Table.grid(padding=(0, 2))
    summary.add_column(style="bold", no_wrap=True)
    summary.add_column()
    summary.add_row("Workflow", Text(description.workflow_id))
    summary.add_row("Type", Text(description.workflow_type))
    summary.add_row("Run", Text(description.run_id))
    if len(description.run_ids) > 1:
        summary.add_row("Runs", str(len(description.run_ids)))
    summary.add_row("Status", status_text(description.status))
    summary.add_row("Started", when(description.start_time, precise=True))
    summary.add_row("Closed", when(description.close_time, precise=True))
    summary.add_row("Task queue", Text(description.task_queue))
    if description.search_attributes:
        summary.add_row("Search attributes", Text(json_text(dict(description.search_attributes), 200)))
    if description.stuck_reason:
        summary.add_row("Stuck", Text(description.stuck_reason, style="red"))
    if description.status is WorkflowStatus.RUNNING:
        # Residency lives in the serving engine's memory, never in the store: a reader
        # of the store says so rather than guess.
        summary.add_row("Residency", Text(description.residency or RESIDENCY_NOT_KNOWN))
        if slot_waits is None:
            summary.add_row("Slot waits", Text(SLOT_WAITS_NOT_KNOWN))
        else:
            count = len(_waiting(description, slot_waits))
            summary.add_row("Slot waits", f"{count} waiting for a flow-control slot" if count else "none")
    if description.status is WorkflowStatus.COMPLETED:
        summary.add_row("Result", Text(json_text(description.result, 200)))
    summary.add_row("Events", str(description.history_length))
    parts.append(summary)

    if description.pending_activities:
        table = Table(title="Pending activities", title_justify="left")
        for column in ("Activity", "Type", "Next attempt", "Scheduled (UTC)", "Task queue"):
            table.add_column(column, no_wrap=True)
        for a in description.pending_activities:
            table.add_row(
                f"activity:{a.activity_id}",
                Text(a.activity_type),
                str(a.attempt),
                when(a.scheduled_at, precise=True),
                Text(a.task_queue),
            )
        parts.append(table)
    waiting = _waiting(description, slot_waits or {}) if description.status is WorkflowStatus.RUNNING else []
    if waiting:
        # The recording engine and when its record lapses are in show --json.
        table = Table(title="Waiting for a flow-control slot", title_justify="left")
        table.add_column("Activity", no_wrap=True)
        table.add_column("Pool (limit)")
        table.add_column("Since (UTC)", no_wrap=True)
        table.add_column("Priority", no_wrap=True)
        for activity_id, w in waiting:
            table.add_row(
                f"activity:{activity_id}",
                Text(f"{w.pool} ({w.limit})" if w.limit else w.pool),
                when(w.since, precise=True),
                str(w.priority),
            )
        parts.append(table)
    timers = outstanding_timers(run_segment(events, description.run_id))
    if timers and description.status is WorkflowStatus.RUNNING:
        table = Table(title="Pending timers", title_justify="left")
        table.add_column("Timer", no_wrap=True)
        table.add_column("Fires at (UTC)", no_wrap=True)
        for t in timers:
            table.add_row(Text(t.timer_id), when(t.fire_at, precise=True))
        parts.append(table)
    if description.error is not None:
        failure = Table.grid(padding=(0, 2))
        failure.add_column(style="bold red", no_wrap=True)
        failure.add_column()
        failure.add_row("Failure", Text(description.error.type))
        failure.add_row("Message", Text(description.error.message))
        failure.add_row("Failed step", Text(description.failed_step or "-"))
        parts.append(failure)
    parts.append(history_table(events, "History"))
    return parts


def _slot_wait_json(waiter: FlowWaiter | None) -> dict[str, Any] | None:
    if waiter is None:
        return None
    return {
        "pool": waiter.pool,
        "limit": waiter.limit,
        "since": format_datetime(waiter.since),
        "priority": waiter.priority,
        "attempt": waiter.attempt,
        "holder": waiter.holder,
        "lapses_at": format_datetime(waiter.expires_at) if waiter.expires_at else None,
    }


def show_json(
    events: list[Event], description: WorkflowDescription, slot_waits: SlotWaits | None
) -> dict[str, Any]:
    """What ``show`` prints, as one JSON object; ``history`` holds the events' wire form.

    Each pending activity's ``slot_wait`` is its recorded wait for a flow-control
    slot, or null; ``slot_waits_known`` says whether the store records them (false:
    a null ``slot_wait`` means not known, not "not waiting")."""
    error = description.error
    running = description.status is WorkflowStatus.RUNNING
    waiting = dict(_waiting(description, slot_waits or {})) if running else {}
    return {
        "workflow_id": description.workflow_id,
        "run_id": description.run_id,
        "run_ids": list(description.run_ids),
        "workflow_type": description.workflow_type,
        "status": description.status.value,
        "start_time": format_datetime(description.start_time),
        "close_time": format_datetime(description.close_time) if description.close_time else None,
        "task_queue": description.task_queue,
        "search_attributes": _attributes_json(description.search_attributes),
        "stuck_reason": description.stuck_reason,
        # null: not known (a running run's residency is in its engine's memory, not the store).
        "residency": description.residency,
        "slot_waits_known": slot_waits is not None,
        "result": description.result if description.status is WorkflowStatus.COMPLETED else None,
        "error": None
        if error is None
        else {"type": error.type, "message": error.message, "traceback": error.traceback},
        "failed_step": description.failed_step,
        "pending_activities": [
            {
                "activity_id": a.activity_id,
                "activity_type": a.activity_type,
                "attempt": a.attempt,
                "scheduled_at": format_datetime(a.scheduled_at),
                "task_queue": a.task_queue,
                "slot_wait": _slot_wait_json(waiting.get(a.activity_id)),
            }
            for a in description.pending_activities
        ],
        "pending_timers": [
            {"timer_id": t.timer_id, "fire_at": format_datetime(t.fire_at)}
            for t in (outstanding_timers(run_segment(events, description.run_id)) if running else ())
        ],
        "history_length": description.history_length,
        "history": [event_to_wire(event) for event in events],
    }
