"""The console's HTML, rendered on the server: the list, the workflow page and their live parts.

Every value from the store or the request goes through :func:`html.escape` (``e``).
"""

from __future__ import annotations

import html
import json
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import Any

from .._wire import format_datetime
from .data import STATUSES, ListPage, ListQuery, WorkflowPage


def e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _q(workflow_id: str) -> str:
    return urllib.parse.quote(workflow_id, safe="")


def _time(value: str | None) -> str:
    return e(value.replace("T", " ")[:23] if value else "-")


def _slot_wait(wait: Mapping[str, Any] | None, known: bool) -> str:
    """A pending activity's recorded wait for a flow-control slot (``show --json``'s ``slot_wait``)."""
    if wait is None:
        return "-" if known else "not known"
    return (
        f"{e(wait['pool'])} ({e(wait['limit'])}) since {_time(wait['since'])}, "
        f"priority {e(wait['priority'])}, attempt {e(wait['attempt'])}"
    )


def layout(title: str, body: str, *, store: str, read_only: bool) -> str:
    mode = '<span class="badge ro">read-only</span>' if read_only else ""
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        f"<title>{e(title)} · aion-trio console</title>"
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        '<link rel="stylesheet" href="/static/console.css"></head><body>'
        f'<header><a class="home" href="/">aion-trio console</a> <span class="store">{e(store)}</span> {mode}</header>'
        f"<main>{body}</main>"
        '<script src="/static/console.js"></script></body></html>'
    )


def list_body(query: ListQuery, page: ListPage | None, error: str | None) -> str:
    """The list page: the filter form (outside the live part) and the live part."""
    checked = {s.lower() for s in query.statuses}
    boxes = "".join(
        f'<label><input type="checkbox" name="status" value="{s}"{" checked" if s in checked else ""}> {s}</label>'
        for s in STATUSES
    )

    def field(name: str, label: str, value: str, hint: str) -> str:
        return (
            f'<label>{label} <input name="{name}" value="{e(value)}" placeholder="{e(hint)}" '
            f'id="f-{name}"></label>'
        )

    attr_boxes = "".join(
        f'<input name="attr" class="attr" id="f-attr-{i}" value="{e(value)}" placeholder="region=eu">'
        for i, value in enumerate([*query.attrs_, "", ""][: max(2, len(query.attrs_) + 1)])
    )
    form = (
        '<form id="filters" class="filters" method="get" action="/">'
        f"<fieldset><legend>Status</legend>{boxes}</fieldset>"
        + field("type", "Type", query.workflow_type, "checkout")
        + field("task_queue", "Task queue", query.task_queue, "default")
        + field("started_after", "Started after", query.started_after, "2026-11-30T08:00")
        + field("started_before", "Started before", query.started_before, "")
        + field("closed_after", "Closed after", query.closed_after, "")
        + field("closed_before", "Closed before", query.closed_before, "")
        + '<fieldset title="as aion-trio list --attr: KEY=VALUE, KEY&gt;VALUE, KEY&lt;VALUE or KEY~TEXT; '
        'all must hold"><legend>Search attributes</legend>' + attr_boxes + "</fieldset>"
        '<button type="submit" id="apply">Filter</button> <a href="/">clear</a></form>'
    )
    seen = [("seen", page.fingerprint())] if page is not None else []
    stream = "/live/list?" + urllib.parse.urlencode([*query.params(with_cursor=True), *seen])
    return f'{form}<div id="live" data-stream="{e(stream)}">{list_live(query, page, error)}</div>'


def list_live(query: ListQuery, page: ListPage | None, error: str | None) -> str:
    if error is not None or page is None:
        return f'<p class="error" id="filter-error">{e(error)}</p>'
    base = query.params()
    counts = "".join(
        f'<a class="count s-{s}" href="/?{e(urllib.parse.urlencode([*(p for p in base if p[0] != "status"), ("status", s)]))}">'
        f"{s} <b>{page.counts.get(s, 0)}</b></a>"
        for s in STATUSES
    )
    cluster = bool(page.owners)
    head = "<th>Workflow ID</th><th>Type</th><th>Status</th><th>Started (UTC)</th><th>Closed (UTC)</th>"
    head += "<th>Search attributes</th><th>Note</th>" + ("<th>Node</th>" if cluster else "")
    rows = []
    for row in page.rows:
        note = row.stuck_reason and f"stuck: {row.stuck_reason}"
        if note is None and row.failure_reason:
            note = f"{row.failed_step}: {row.failure_reason}" if row.failed_step else row.failure_reason
        attrs_text = json.dumps(
            {k: list(v) if isinstance(v, tuple) else v for k, v in row.search_attributes.items()},
            ensure_ascii=False,
        )
        rows.append(
            f'<tr data-id="{e(row.workflow_id)}"><td><a href="/workflows/{_q(row.workflow_id)}">{e(row.workflow_id)}</a></td>'
            f'<td>{e(row.workflow_type)}</td><td><span class="status s-{row.status.value}">{row.status.value}</span></td>'
            f"<td>{_time(format_datetime(row.start_time))}</td>"
            f"<td>{_time(format_datetime(row.close_time) if row.close_time else None)}</td>"
            f'<td class="attrs">{e(attrs_text) if row.search_attributes else ""}</td><td>{e(note or "")}</td>'
            + (f"<td>{e(page.owners.get(row.workflow_id, ''))}</td>" if cluster else "")
            + "</tr>"
        )
    pager = []
    if query.after:
        pager.append(f'<a href="/?{e(urllib.parse.urlencode(base))}">first page</a>')
    if page.next_cursor is not None:
        pager.append(
            f'<a id="next" href="/?{e(urllib.parse.urlencode([*base, ("after", page.next_cursor)]))}">next page</a>'
        )
    empty = "" if rows else '<p class="empty">No workflows match.</p>'
    return (
        f'<div class="counts">{counts}</div>'
        f'<p class="total"><span id="total">{page.total}</span> matching workflows</p>'
        f'<table class="list"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>{empty}'
        f'<nav class="pager">{" · ".join(pager)}</nav>'
    )


def _pre(value: Any) -> str:
    return f"<pre>{e(json.dumps(value, indent=2, ensure_ascii=False, default=str))}</pre>"


def workflow_body(page: WorkflowPage, *, actions: str, outcome: tuple[bool, str] | None) -> str:
    wid = str(page.show["workflow_id"])
    note = ""
    if outcome is not None:
        ok, message = outcome
        note = f'<p id="outcome" class="outcome {"ok" if ok else "bad"}">{e(message)}</p>'
    stream = f"/live/workflows/{_q(wid)}?" + urllib.parse.urlencode(
        [("run", page.run_id), ("seen", page.fingerprint())]
    )
    return (
        f'<h1>Workflow <span class="wid">{e(wid)}</span></h1>{note}'
        f'<div id="live" data-stream="{e(stream)}">{workflow_live(page)}</div>{actions}'
    )


def workflow_live(page: WorkflowPage) -> str:
    show = page.show
    wid = str(show["workflow_id"])
    status = str(show["status"])
    summary = [
        ("Type", e(show["workflow_type"])),
        ("Status", f'<span class="status s-{e(status)}" id="status">{e(status)}</span>'),
        ("Run", e(page.run_id)),
        ("Started", _time(show["start_time"])),
        ("Closed", _time(show["close_time"])),
        ("Task queue", e(show["task_queue"])),
        ("Events", str(show["history_length"])),
    ]
    if page.owner is not None:
        summary.append(("Node", e(page.owner)))
    if show["search_attributes"]:
        summary.append(("Search attributes", e(json.dumps(show["search_attributes"], ensure_ascii=False))))
    if show["stuck_reason"]:
        summary.append(("Stuck", f'<span class="bad">{e(show["stuck_reason"])}</span>'))
    if page.parent:
        summary.append(("Parent", f'<a href="/workflows/{_q(page.parent)}">{e(page.parent)}</a>'))
    runs = show["run_ids"]
    if len(runs) > 1:
        links = " → ".join(
            (
                f"<b>{e(r[:8])}</b>"
                if r == page.run_id
                else f'<a href="/workflows/{_q(wid)}?run={e(r)}">{e(r[:8])}</a>'
            )
            for r in runs
        )
        summary.append(("Runs", links))
    if page.reset_from is not None:
        run, seq = page.reset_from
        summary.append(
            (
                "Reset from",
                f'<a id="reset-from" href="/workflows/{_q(wid)}?run={e(run)}">{e(run[:8])}</a> at seq {seq}',
            )
        )
    if page.reset_to is not None:
        run, seq = page.reset_to
        summary.append(
            (
                "Reset to",
                f'<a id="reset-to" href="/workflows/{_q(wid)}?run={e(run)}">{e(run[:8])}</a> '
                f"(a new run replaying this one up to seq {seq})",
            )
        )
    parts = []
    if page.run_id != show["run_id"]:
        latest = f'<a href="/workflows/{_q(wid)}">the latest run</a>'
        parts.append(
            f'<p class="muted" id="older-run">An earlier run of the chain: the timeline is this run\'s; '
            f"the status, result and pending work are those of {latest}.</p>"
        )
    parts.append('<section class="summary"><dl>')
    parts += [f"<dt>{k}</dt><dd>{v}</dd>" for k, v in summary]
    parts.append("</dl></section>")
    if status == "completed":
        parts.append(f'<section><h2>Result</h2><div id="result">{_pre(show["result"])}</div></section>')
    if show["error"] is not None:
        error = show["error"]
        parts.append(
            f'<section class="failure"><h2>Failure</h2><p><b>{e(error["type"])}</b>: {e(error["message"])}</p>'
            f"<p>Failed step: {e(show['failed_step'] or '-')}</p>"
            + (
                f"<details><summary>traceback</summary><pre>{e(error['traceback'])}</pre></details>"
                if error["traceback"]
                else ""
            )
            + "</section>"
        )
    parts.append(f'<section><h2>Timeline</h2><div id="timeline">{page.timeline.svg()}</div></section>')
    if page.children:
        items = "".join(
            f'<li><a href="/workflows/{_q(c)}">{e(c)}</a> ({e(t)})</li>' for c, t in page.children
        )
        parts.append(f'<section><h2>Children</h2><ul id="children">{items}</ul></section>')
    pending = show["pending_activities"]
    if pending:
        rows = "".join(
            f"<tr><td>activity:{a['activity_id']}</td><td>{e(a['activity_type'])}</td><td>{a['attempt']}</td>"
            f"<td>{_time(a['scheduled_at'])}</td><td>{e(a['task_queue'])}</td>"
            f"<td>{_slot_wait(a['slot_wait'], show['slot_waits_known'])}</td></tr>"
            for a in pending
        )
        parts.append(
            "<section><h2>Pending activities</h2><table><thead><tr><th>Activity</th><th>Type</th>"
            "<th>Next attempt</th><th>Scheduled</th><th>Task queue</th><th>Waiting for a slot</th>"
            f"</tr></thead><tbody>{rows}</tbody></table></section>"
        )
    timers = show["pending_timers"]
    if timers:
        rows = "".join(f"<tr><td>{e(t['timer_id'])}</td><td>{_time(t['fire_at'])}</td></tr>" for t in timers)
        parts.append(
            "<section><h2>Pending timers</h2><table><thead><tr><th>Timer</th><th>Fires at</th></tr></thead>"
            f"<tbody>{rows}</tbody></table></section>"
        )
    parts.append(history_table(show["history"], wid))
    return "".join(parts)


def history_table(history: Sequence[Mapping[str, Any]], workflow_id: str) -> str:
    rows = []
    for event in history:
        data = event.get("data", {})
        # A reset's two ends link to each other, as the runs' list does.
        other = data.get("new_run_id") if event["type"] == "WorkflowReset" else data.get("reset_from_run_id")
        link = (
            f'<p><a class="run-link" href="/workflows/{_q(workflow_id)}?run={e(other)}">'
            f"{'to the new run' if event['type'] == 'WorkflowReset' else 'from run'} {e(str(other)[:8])}</a></p>"
            if isinstance(other, str)
            else ""
        )
        rows.append(
            f'<tr><td class="seq">{event["seq"]}</td><td>{_time(event["recorded_at"])}</td>'
            f"<td><b>{e(event['type'])}</b>{link}</td><td>{_pre(data) if data else ''}</td></tr>"
        )
    return (
        '<section><h2>History</h2><table class="history"><thead><tr><th>Seq</th><th>Time (UTC)</th>'
        f"<th>Event</th><th>Payload</th></tr></thead><tbody>{''.join(rows)}</tbody></table></section>"
    )


def actions_form(
    workflow_id: str,
    *,
    csrf: str,
    enabled: bool,
    why_not: str,
    reset_points: Sequence[tuple[int, str]] = (),
    default_reset: int | None = None,
) -> str:
    if not enabled:
        return f'<section class="actions"><h2>Actions</h2><p class="muted" id="actions-off">{e(why_not)}</p></section>'
    hidden = (
        f'<input type="hidden" name="csrf" value="{e(csrf)}">'
        f'<input type="hidden" name="workflow_id" value="{e(workflow_id)}">'
    )

    def button(action: str, label: str, extra: str = "") -> str:
        return (
            f'<form method="post" action="/actions/{action}" class="action" data-confirm="{e(label)} workflow '
            f'{e(workflow_id)}?">{hidden}{extra}<button type="submit" id="do-{action}">{e(label)}</button></form>'
        )

    reason = '<input name="reason" placeholder="reason (recorded)">'
    signal = (
        f'<form method="post" action="/actions/signal" class="action signal" id="signal-form" '
        f'data-confirm="Send this signal to workflow {e(workflow_id)}?">{hidden}'
        '<label>Signal name <input name="name" id="signal-name" required></label>'
        '<label>Payload (JSON) <textarea name="payload" id="signal-payload" rows="4" data-json>null</textarea></label>'
        '<span class="json-error" id="signal-json-error"></span>'
        '<button type="submit" id="do-signal">Send signal</button></form>'
    )
    return (
        '<section class="actions"><h2>Actions</h2>'
        + signal
        + button("cancel", "Cancel", reason)
        + button("terminate", "Terminate", reason)
        + button("reopen", "Reopen")
        + _reset_form(workflow_id, hidden, reset_points, default_reset)
        + "</section>"
    )


def _reset_form(workflow_id: str, hidden: str, points: Sequence[tuple[int, str]], default: int | None) -> str:
    """Reset the latest run to one of its reset points (the last step that did not fail first)."""
    if not points:
        return '<p class="muted" id="reset-off">Reset: the latest run has no reset point.</p>'
    options = "".join(
        f'<option value="{seq}"{" selected" if seq == default else ""}>'
        f"seq {seq}: {e(kind)}{' (last step)' if seq == default else ''}</option>"
        for seq, kind in points
    )
    return (
        f'<form method="post" action="/actions/reset" class="action reset" '
        f'data-confirm="Reset workflow {e(workflow_id)}?">{hidden}'
        f'<label>to <select name="to_seq" id="reset-to-seq">{options}</select></label>'
        '<input name="reason" placeholder="reason (recorded)">'
        '<button type="submit" id="do-reset">Reset</button></form>'
    )


def message_page(title: str, message: str) -> str:
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        f'<title>{e(title)}</title></head><body><h1>{e(title)}</h1><p id="message">{e(message)}</p></body></html>'
    )
