"""A run's timeline: the Gantt of its activity attempts (with their retries), timers, child
workflows and signals, projected from its history and drawn as SVG on the server."""

from __future__ import annotations

import html
from collections.abc import Sequence
from datetime import datetime

import attrs

from .._events import (
    ActivityCancelled,
    ActivityCompleted,
    ActivityFailed,
    ActivityScheduled,
    ActivityStarted,
    ChildWorkflowCancelled,
    ChildWorkflowCompleted,
    ChildWorkflowFailed,
    ChildWorkflowStarted,
    Event,
    SignalReceived,
    TimerCancelled,
    TimerFired,
    TimerStarted,
    UpdateAccepted,
    UpdateCompleted,
    WorkflowStarted,
)
from .._projections import current_lease_terminal, run_segment

#: The SVG's geometry (user units; the image scales to the page's width).
WIDTH = 1000
LABEL = 230
ROW = 22
BAR = 14
TOP = 24


@attrs.frozen
class Bar:
    start: datetime
    end: datetime | None
    """``None``: still open (drawn to the timeline's end)."""
    kind: str
    """The CSS class: ``completed``, ``failed``, ``retrying``, ``running``, ``cancelled``,
    ``timer``, ``child``, ``workflow``, ``signal`` (a point)."""
    title: str


@attrs.frozen
class Lane:
    label: str
    bars: tuple[Bar, ...]
    link: str | None = None
    """A child workflow's id: its lane links to its page."""


@attrs.frozen
class Timeline:
    start: datetime
    end: datetime
    lanes: tuple[Lane, ...]

    def svg(self) -> str:
        return render_svg(self)


def build_timeline(history: Sequence[Event], run_id: str) -> Timeline:
    """The lanes of run ``run_id``: the run, then one per activity, timer, child and update in
    the order they began, then the signals."""
    segment = run_segment(history, run_id)
    start = segment[0].recorded_at
    terminal = current_lease_terminal(segment)
    last = terminal.recorded_at if terminal is not None else segment[-1].recorded_at
    lanes: dict[str, list[Bar]] = {}
    labels: dict[str, str] = {}
    links: dict[str, str] = {}
    order: list[str] = []
    signals: list[Bar] = []
    open_at: dict[tuple[str, int], datetime] = {}
    ends: list[datetime] = [last]

    def lane(key: str, label: str) -> list[Bar]:
        if key not in lanes:
            lanes[key] = []
            labels[key] = label
            order.append(key)
        return lanes[key]

    for event in segment:
        body, at = event.body, event.recorded_at
        if isinstance(body, WorkflowStarted):
            continue
        if isinstance(body, ActivityScheduled):
            lane(f"a{body.activity_id}", f"activity:{body.activity_id} {body.activity_type}")
        elif isinstance(body, ActivityStarted):
            open_at[(f"a{body.activity_id}", body.attempt)] = at
        elif isinstance(body, (ActivityCompleted, ActivityFailed, ActivityCancelled)):
            key = f"a{body.activity_id}"
            began = open_at.pop((key, body.attempt), at)
            if isinstance(body, ActivityCompleted):
                kind, what = "completed", "completed"
            elif isinstance(body, ActivityFailed):
                kind = "failed" if body.final else "retrying"
                what = f"failed ({'final' if body.final else 'will retry'}): {body.error.type}: {body.error.message}"
            else:
                kind, what = "cancelled", "cancelled"
            lane(key, key).append(Bar(began, at, kind, f"attempt {body.attempt} {what}"))
        elif isinstance(body, TimerStarted):
            lane(f"t{body.timer_id}", f"timer {body.timer_id}").append(
                Bar(at, None, "timer", f"timer {body.timer_id}, fires at {body.fire_at.isoformat()}")
            )
            ends.append(body.fire_at)
        elif isinstance(body, (TimerFired, TimerCancelled)):
            _close(
                lanes.get(f"t{body.timer_id}"), at, "fired" if isinstance(body, TimerFired) else "cancelled"
            )
        elif isinstance(body, ChildWorkflowStarted):
            key = f"c{body.child_workflow_id}"
            lane(key, f"child {body.child_workflow_id} ({body.workflow_type})").append(
                Bar(at, None, "child", f"child {body.child_workflow_id} running")
            )
            links[key] = body.child_workflow_id
        elif isinstance(body, (ChildWorkflowCompleted, ChildWorkflowFailed, ChildWorkflowCancelled)):
            outcome = {ChildWorkflowCompleted: "completed", ChildWorkflowFailed: "failed"}.get(
                type(body), "cancelled"
            )
            _close(lanes.get(f"c{body.child_workflow_id}"), at, outcome)
        elif isinstance(body, SignalReceived):
            signals.append(Bar(at, at, "signal", f"signal {body.name} {body.payload.json[:80]}"))
        elif isinstance(body, UpdateAccepted):
            # From its acceptance to its handler's outcome (one lane per update).
            lane(f"u{body.update_id}", f"update {body.name}").append(
                Bar(at, None, "update", f"update {body.name} {body.payload.json[:80]} running")
            )
        elif isinstance(body, UpdateCompleted):
            _close(lanes.get(f"u{body.update_id}"), at, "failed" if body.error is not None else "completed")
    for (key, attempt), began in open_at.items():
        lanes[key].append(Bar(began, None, "running", f"attempt {attempt} running"))
    end = max(ends)
    result = [
        Lane(
            "run " + run_id[:8],
            (Bar(start, terminal.recorded_at if terminal else None, "workflow", "the run"),),
        )
    ]
    result += [Lane(labels[k], tuple(sorted(lanes[k], key=lambda b: b.start)), links.get(k)) for k in order]
    if signals:
        result.append(Lane("signals", tuple(signals)))
    return Timeline(start=start, end=end, lanes=tuple(result))


def _close(bars: list[Bar] | None, at: datetime, outcome: str) -> None:
    if not bars or bars[-1].end is not None:
        return
    bar = bars[-1]
    kind = (
        bar.kind if outcome in ("completed", "fired") else ("failed" if outcome == "failed" else "cancelled")
    )
    bars[-1] = attrs.evolve(
        bar, end=at, kind=kind, title=bar.title.replace("running", outcome) + f" ({outcome})"
    )


def _seconds(span: float) -> str:
    if span >= 120:
        return f"{span / 60:.1f} min"
    if span >= 1:
        return f"{span:.2f} s"
    return f"{span * 1000:.0f} ms"


def render_svg(timeline: Timeline) -> str:
    """The timeline as an inline SVG: time runs left to right, scaled to the run's span."""
    span = max((timeline.end - timeline.start).total_seconds(), 1e-3)
    scale = (WIDTH - LABEL - 10) / span
    height = TOP + ROW * len(timeline.lanes) + 6

    def x(at: datetime) -> float:
        return LABEL + max(0.0, (at - timeline.start).total_seconds()) * scale

    out = [
        f'<svg class="timeline" viewBox="0 0 {WIDTH} {height}" width="100%" role="img" '
        f'aria-label="timeline" xmlns="http://www.w3.org/2000/svg">'
    ]
    for i in range(5):
        gx = LABEL + (WIDTH - LABEL - 10) * i / 4
        out.append(f'<line class="grid" x1="{gx:.1f}" y1="{TOP - 6}" x2="{gx:.1f}" y2="{height}"/>')
        anchor = "end" if i == 4 else "start"
        out.append(
            f'<text class="tick" x="{gx:.1f}" y="{TOP - 10}" text-anchor="{anchor}">+{_seconds(span * i / 4)}</text>'
        )
    for row, lane in enumerate(timeline.lanes):
        y = TOP + row * ROW
        label = html.escape(lane.label if len(lane.label) <= 34 else lane.label[:33] + "…")
        if lane.link is not None:
            label = f'<a href="/workflows/{html.escape(lane.link)}">{label}</a>'
        out.append(f'<g class="lane" data-label="{html.escape(lane.label)}">')
        out.append(f'<text class="label" x="4" y="{y + BAR - 2}">{label}</text>')
        for bar in lane.bars:
            title = f"<title>{html.escape(bar.title)}</title>"
            if bar.kind == "signal":
                cx = x(bar.start)
                out.append(
                    f'<circle class="bar signal" cx="{cx:.1f}" cy="{y + BAR / 2}" r="5">{title}</circle>'
                )
                continue
            x0 = x(bar.start)
            x1 = x(bar.end if bar.end is not None else timeline.end)
            open_ = " open" if bar.end is None else ""
            out.append(
                f'<rect class="bar {bar.kind}{open_}" x="{x0:.1f}" y="{y}" width="{max(x1 - x0, 2):.1f}" '
                f'height="{BAR}" rx="2">{title}</rect>'
            )
        out.append("</g>")
    out.append("</svg>")
    return "".join(out)
