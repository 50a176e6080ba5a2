"""What the console reads from the store: pages of the workflow list (keyset paging over the
visibility rows), the counts per status, and one workflow's page data.

The filters are the ones ``aion-trio list`` takes, parsed by the CLI's own parsers, so
a filter means the same thing in both places.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import attrs
import click

from .._cli.options import parse_attr, parse_time
from .._cli.render import row_json, show_json
from .._cli.stores import read_history, read_slot_waits
from .._engine import describe_history
from .._errors import InvalidQuery
from .._events import ChildWorkflowStarted, Event, WorkflowReset, WorkflowStarted, WorkflowStatus
from .._payload import PayloadCodec
from .._projections import last_step, reset_points, run_segment
from .._store import ClusterStore, Store, VisibilityFilter, VisibilityRow
from .._wire import event_to_wire, format_datetime, parse_datetime
from .timeline import Timeline, build_timeline

PAGE_SIZE = 50
#: Rows read per query while skipping past a keyset cursor's own start time.
_SKIP_BATCH = 200
#: The list's query parameters that are filters (anything else is paging or display).
FILTER_PARAMS = (
    "status",
    "type",
    "task_queue",
    "started_after",
    "started_before",
    "closed_after",
    "closed_before",
    "attr",
)
STATUSES = tuple(s.value for s in WorkflowStatus)


class BadFilter(ValueError):
    """A list filter the user typed cannot be used; the message says which and why."""


@attrs.frozen
class ListQuery:
    """The list's filters, as ``aion-trio list`` would take them, plus the keyset cursor."""

    statuses: tuple[str, ...] = ()
    workflow_type: str = ""
    task_queue: str = ""
    started_after: str = ""
    started_before: str = ""
    closed_after: str = ""
    closed_before: str = ""
    attrs_: tuple[str, ...] = ()
    after: str = ""
    """Keyset cursor: ``START_TIME|WORKFLOW_ID`` of the last row of the previous page."""

    @classmethod
    def from_params(cls, params: Mapping[str, Sequence[str]]) -> ListQuery:
        def one(name: str) -> str:
            values = [v for v in params.get(name, ()) if v.strip()]
            return values[-1].strip() if values else ""

        def many(name: str) -> tuple[str, ...]:
            return tuple(v.strip() for v in params.get(name, ()) if v.strip())

        return cls(
            statuses=many("status"),
            workflow_type=one("type"),
            task_queue=one("task_queue"),
            started_after=one("started_after"),
            started_before=one("started_before"),
            closed_after=one("closed_after"),
            closed_before=one("closed_before"),
            attrs_=many("attr"),
            after=one("after"),
        )

    def params(self, *, with_cursor: bool = False) -> list[tuple[str, str]]:
        """The query string's pairs (the filters, and the cursor if asked)."""
        pairs = [("status", s) for s in self.statuses]
        for name, value in (
            ("type", self.workflow_type),
            ("task_queue", self.task_queue),
            ("started_after", self.started_after),
            ("started_before", self.started_before),
            ("closed_after", self.closed_after),
            ("closed_before", self.closed_before),
        ):
            if value:
                pairs.append((name, value))
        pairs += [("attr", a) for a in self.attrs_]
        if with_cursor and self.after:
            pairs.append(("after", self.after))
        return pairs

    def visibility_filter(self, **extra: Any) -> VisibilityFilter:
        """The store filter, parsed as ``aion-trio list`` parses its options; :class:`BadFilter` if not."""
        for status in self.statuses:
            if status.lower() not in STATUSES:
                raise BadFilter(f"status {status!r} is not one of {', '.join(STATUSES)}")
        try:
            criteria: dict[str, Any] = {
                "workflow_type": self.workflow_type or None,
                "task_queue": self.task_queue or None,
                "status": frozenset(WorkflowStatus(s.lower()) for s in self.statuses) or None,
                "started_after": parse_time(self.started_after or None, "started after"),
                "started_before": parse_time(self.started_before or None, "started before"),
                "closed_after": parse_time(self.closed_after or None, "closed after"),
                "closed_before": parse_time(self.closed_before or None, "closed before"),
                "search": tuple(parse_attr(a) for a in self.attrs_),
            }
            criteria.update(extra)
            return VisibilityFilter(**criteria, newest_first=True)
        except click.BadParameter as exc:
            hint = f"{exc.param_hint}: " if isinstance(exc.param_hint, str) else ""
            raise BadFilter(f"{hint}{exc.message}") from None
        except InvalidQuery as exc:
            raise BadFilter(str(exc)) from None

    def cursor(self) -> tuple[datetime, str] | None:
        if not self.after:
            return None
        when, sep, workflow_id = self.after.partition("|")
        try:
            if not sep or not workflow_id:
                raise ValueError(self.after)
            return parse_datetime(when), workflow_id
        except ValueError:
            raise BadFilter(f"the page cursor {self.after!r} is not START_TIME|WORKFLOW_ID") from None


@attrs.frozen
class ListPage:
    rows: tuple[VisibilityRow, ...]
    total: int
    """Rows matching the filters (all pages)."""
    counts: Mapping[str, int]
    """Rows matching the filters but the status one, per status."""
    next_cursor: str | None
    owners: Mapping[str, str] = attrs.field(factory=dict)

    def fingerprint(self) -> str:
        """Changes whenever what the page shows changes (the live refresh compares it)."""
        return _digest(
            (
                [(r.workflow_id, r.run_id, r.status.value, r.close_time, r.stuck_reason) for r in self.rows],
                sorted(self.counts.items()),
                self.total,
                sorted(self.owners.items()),
            )
        )


def cursor_of(row: VisibilityRow) -> str:
    return f"{format_datetime(row.start_time)}|{row.workflow_id}"


async def list_page(store: Store, query: ListQuery, *, page_size: int = PAGE_SIZE) -> ListPage:
    """One page of the newest-first list after ``query``'s cursor.

    Keyset paging: the page after row (T, id) is read with ``started_before=T``
    (an indexed bound, however deep the page) and the rows at T up to ``id``
    skipped, so page 2000 of 100k rows costs what page 1 does.
    """
    base = query.visibility_filter()
    cursor = query.cursor()
    rows: list[VisibilityRow] = []
    if cursor is None:
        rows = await store.visibility.list(attrs.evolve(base, limit=page_size + 1))
    else:
        at, last_id = cursor
        bound = at if base.started_before is None else min(at, base.started_before)
        offset = 0
        while len(rows) <= page_size:
            batch = await store.visibility.list(
                attrs.evolve(base, started_before=bound, limit=_SKIP_BATCH, offset=offset)
            )
            rows += [r for r in batch if not (r.start_time == at and r.workflow_id <= last_id)]
            if len(batch) < _SKIP_BATCH:
                break
            offset += len(batch)
        rows = rows[: page_size + 1]
    more = len(rows) > page_size
    rows = rows[:page_size]
    counts: dict[str, int] = {}
    for status in WorkflowStatus:
        counts[status.value] = await store.visibility.count(attrs.evolve(base, status=frozenset({status})))
    total = await store.visibility.count(base)
    owners = await owners_of(store, [r for r in rows if r.status is WorkflowStatus.RUNNING])
    return ListPage(
        rows=tuple(rows),
        total=total,
        counts=counts,
        next_cursor=cursor_of(rows[-1]) if more and rows else None,
        owners=owners,
    )


async def owners_of(store: Store, rows: Sequence[VisibilityRow]) -> dict[str, str]:
    """In a cluster (a store opened with a node identity), the node owning each running workflow."""
    if not isinstance(store, ClusterStore):
        return {}
    owners: dict[str, str] = {}
    for row in rows:
        target = await store.command_target(row.workflow_id)
        # None: no other live node (the console's own node owns nothing); "": the owner is gone.
        owners[row.workflow_id] = "-" if target is None else (target or "orphaned: the next claim takes it")
    return owners


@attrs.frozen
class WorkflowPage:
    show: Mapping[str, Any]
    """``aion-trio show --json``'s object for the workflow."""
    events: tuple[Event, ...]
    timeline: Timeline
    run_id: str
    """The run the page shows (the latest unless asked)."""
    children: tuple[tuple[str, str], ...]
    """(child workflow id, type) started by the shown run."""
    parent: str | None
    row: Mapping[str, Any] | None
    owner: str | None
    reset_points: tuple[tuple[int, str], ...] = ()
    """The latest run's reset points: (seq, the event's type), ascending."""
    default_reset: int | None = None
    """The point a reset takes by default: the latest run's last step that did not fail."""
    reset_to: tuple[str, int] | None = None
    """The shown run ended by a reset: (the new run, the seq of this run it replays up to)."""
    reset_from: tuple[str, int] | None = None
    """The shown run started by a reset: (the run it was reset from, that run's seq)."""

    def fingerprint(self) -> str:
        waits = [a["slot_wait"] for a in self.show["pending_activities"]]
        return _digest((len(self.events), self.show["status"], self.owner, self.show["stuck_reason"], waits))


def _digest(value: object) -> str:
    return hashlib.sha256(repr(value).encode()).hexdigest()[:16]


async def workflow_page(store: Store, workflow_id: str, run_id: str | None = None) -> WorkflowPage:
    """Everything the workflow page shows; :class:`~aion_trio.WorkflowNotFound` for an unknown id."""
    events = await read_history(store, workflow_id)
    row = await store.visibility.get(workflow_id)
    description = describe_history(
        workflow_id, events, codec=PayloadCodec(), stuck_reason=row.stuck_reason if row else None
    )
    shown = run_id if run_id in description.run_ids else description.run_id
    children: list[tuple[str, str]] = []
    parent: str | None = None
    reset_to: tuple[str, int] | None = None
    reset_from: tuple[str, int] | None = None
    segment_started = False
    for event in events:
        body = event.body
        if isinstance(body, WorkflowStarted):
            segment_started = body.run_id == shown
            if segment_started and body.parent_workflow_id:
                parent = body.parent_workflow_id
            if segment_started and body.reset_from_run_id and body.reset_to_seq is not None:
                reset_from = (body.reset_from_run_id, body.reset_to_seq)
        elif segment_started and isinstance(body, ChildWorkflowStarted):
            children.append((body.child_workflow_id, body.workflow_type))
        elif segment_started and isinstance(body, WorkflowReset):
            reset_to = (body.new_run_id, body.to_seq)
    latest = run_segment(events, description.run_id) if description.run_id else []
    by_seq = {event.seq: event for event in latest}
    points = tuple((seq, str(event_to_wire(by_seq[seq])["type"])) for seq in reset_points(latest))
    owners = await owners_of(store, [row] if row is not None and row.status is WorkflowStatus.RUNNING else [])
    return WorkflowPage(
        show=show_json(events, description, await read_slot_waits(store, workflow_id)),
        events=tuple(events),
        timeline=build_timeline(events, shown),
        run_id=shown,
        children=tuple(children),
        parent=parent,
        row=row_json(row) if row is not None else None,
        owner=owners.get(workflow_id),
        reset_points=points,
        default_reset=last_step(latest),
        reset_to=reset_to,
        reset_from=reset_from,
    )
