"""Rows <-> domain values, and visibility filters -> SQL.

Datetimes are ``timestamptz`` (microsecond resolution, the same as Python's)
and come back as aware UTC datetimes.  Event bodies use the wire codec
(``body_data_json``), the one place JSON conversion lives; the JSON text is
stored as ``text``, byte for byte.

Search predicates are evaluated in SQL with exactly the semantics of
:meth:`SearchPredicate.matches`: each operator and value kind selects one of
the constant condition texts below, values are bound.  Numbers are stored as
exact ``numeric`` values (a float as its exact binary value), so int/float
comparisons are exact, as in Python, for integers of any size.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from decimal import Decimal
from typing import Any

import attrs

from aion_trio import TimerCancelled, TimerFired, TimerStarted
from aion_trio.plugin import (
    Event,
    SearchOp,
    SearchPredicate,
    SearchValue,
    StoreDecodeError,
    StoreEncodeError,
    VisibilityFilter,
    VisibilityRow,
    WorkflowStatus,
    body_data_json,
    events_from_rows,
)


def _dumps(value: object) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def utc(value: datetime) -> datetime:
    return value.astimezone(timezone.utc)


# --------------------------------------------------------------------------
# Events
# --------------------------------------------------------------------------


@attrs.frozen
class EncodedBatch:
    """The arrays ``aion_append`` takes for one validated batch."""

    recorded_at: list[datetime]
    types: list[str]
    data: list[str]
    timer_ids: list[str]
    timer_fire_at: list[datetime]
    dropped_timers: list[str]


def encode_batch(workflow_id: str, events: Sequence[Event]) -> EncodedBatch:
    """Encode a validated batch; a body the codec refuses is a :class:`StoreEncodeError`."""
    recorded_at: list[datetime] = []
    types: list[str] = []
    data: list[str] = []
    # The timer index follows the batch: the last word on each timer id wins.
    timers: dict[str, datetime | None] = {}
    for event in events:
        try:
            type_name, text = body_data_json(event.body)
        except (TypeError, ValueError) as exc:
            raise StoreEncodeError(workflow_id, event.seq, f"cannot encode the event: {exc}") from exc
        recorded_at.append(event.recorded_at)
        types.append(type_name)
        data.append(text)
        body = event.body
        if isinstance(body, TimerStarted):
            timers[body.timer_id] = body.fire_at
        elif isinstance(body, (TimerFired, TimerCancelled)):
            timers[body.timer_id] = None
    started = {t: at for t, at in timers.items() if at is not None}
    return EncodedBatch(
        recorded_at=recorded_at,
        types=types,
        data=data,
        timer_ids=list(started),
        timer_fire_at=list(started.values()),
        dropped_timers=[t for t, at in timers.items() if at is None],
    )


def decode_events(workflow_id: str, rows: Sequence[Sequence[Any]], location: str) -> list[Event]:
    """Events from ``(seq, recorded_at, type, data)`` rows; a bad row is a :class:`StoreDecodeError`."""
    return events_from_rows(workflow_id, rows, utc, location)


# --------------------------------------------------------------------------
# Visibility rows and search attributes
# --------------------------------------------------------------------------

VISIBILITY_COLUMNS = (
    "workflow_id, run_id, workflow_type, status, start_time, close_time, task_queue,"
    " failed_step, failure_reason, stuck_reason, search_attributes"
)
_V_COLUMNS = ", ".join(f"v.{c.strip()}" for c in VISIBILITY_COLUMNS.split(","))


def visibility_params(row: VisibilityRow) -> tuple[Any, ...]:
    attributes = {k: list(v) if isinstance(v, tuple) else v for k, v in row.search_attributes.items()}
    return (
        row.workflow_id,
        row.run_id,
        row.workflow_type,
        row.status.value,
        row.start_time,
        row.close_time,
        row.task_queue,
        row.failed_step,
        row.failure_reason,
        row.stuck_reason,
        _dumps(attributes),
    )


def decode_visibility(values: Sequence[Any], location: str) -> VisibilityRow:
    (wid, run_id, wtype, status, start, close, queue, step, reason, stuck, attributes) = values
    try:
        return VisibilityRow(
            workflow_id=wid,
            run_id=run_id,
            workflow_type=wtype,
            status=WorkflowStatus(status),
            start_time=utc(start),
            close_time=None if close is None else utc(close),
            task_queue=queue,
            failed_step=step,
            failure_reason=reason,
            stuck_reason=stuck,
            search_attributes=json.loads(attributes),
        )
    except (ValueError, TypeError, OverflowError) as exc:
        raise StoreDecodeError(
            str(wid), None, f"cannot decode the visibility row: {exc}", location=location
        ) from exc


SearchRow = tuple[str, str, int, str, Decimal | None, str | None]


def _number(value: int | float) -> Decimal:
    # Decimal(float) is the float's exact binary value: comparisons with ints
    # stay exact, as they are in Python.
    return Decimal(value)


def search_rows(workflow_id: str, attributes: Mapping[str, SearchValue]) -> list[SearchRow]:
    """``search_attrs`` rows: ``(workflow_id, key, part, kind, num, txt)``."""
    rows: list[SearchRow] = []
    for key, value in attributes.items():
        if isinstance(value, bool):
            rows.append((workflow_id, key, 0, "bool", Decimal(int(value)), None))
        elif isinstance(value, (int, float)):
            rows.append((workflow_id, key, 0, "num", _number(value), None))
        elif isinstance(value, str):
            rows.append((workflow_id, key, 0, "str", None, value))
        else:
            rows.append((workflow_id, key, 0, "list", None, _dumps(list(value))))
            rows.extend((workflow_id, key, i, "elem", None, item) for i, item in enumerate(value, 1))
    return rows


# (operator, kind of the wanted value) -> condition on one search_attrs row ``s``.
_CONDITIONS = {
    ("equals", "bool"): "s.kind = 'bool' AND s.num = %s",
    ("equals", "num"): "s.kind = 'num' AND s.num = %s",
    ("greater", "num"): "s.kind = 'num' AND s.num > %s",
    ("less", "num"): "s.kind = 'num' AND s.num < %s",
    ("equals", "str"): "s.kind = 'str' AND s.txt = %s",
    ("greater", "str"): "s.kind = 'str' AND s.txt > %s",
    ("less", "str"): "s.kind = 'str' AND s.txt < %s",
    ("equals", "list"): "s.kind = 'list' AND s.txt = %s",
    ("contains", "str"): "((s.kind = 'elem' AND s.txt = %s) OR (s.kind = 'str' AND strpos(s.txt, %s) > 0))",
}
_SEARCH = "v.workflow_id IN (SELECT s.workflow_id FROM search_attrs AS s WHERE s.key = %s AND {})"
_SEARCH_SQL = {k: _SEARCH.format(c) for k, c in _CONDITIONS.items()}


def _predicate_sql(p: SearchPredicate) -> tuple[str, list[Any]]:
    op = p.op.value
    want = p.value
    if isinstance(want, bool):
        return _SEARCH_SQL[(op, "bool")], [p.key, Decimal(int(want))]
    if isinstance(want, (int, float)):
        return _SEARCH_SQL[(op, "num")], [p.key, _number(want)]
    if isinstance(want, str):
        if p.op is SearchOp.CONTAINS:
            return _SEARCH_SQL[(op, "str")], [p.key, want, want]
        return _SEARCH_SQL[(op, "str")], [p.key, want]
    return _SEARCH_SQL[(op, "list")], [p.key, _dumps(list(want))]


def where_clause(f: VisibilityFilter) -> tuple[str, list[Any]]:
    """``WHERE`` text (constant fragments joined) and its bound parameters."""
    parts: list[str] = []
    params: list[Any] = []
    if f.workflow_type is not None:
        parts.append("v.workflow_type = %s")
        params.append(f.workflow_type)
    if f.status is not None:
        parts.append("v.status = ANY (%s)")
        params.append(sorted(s.value for s in f.status))
    if f.task_queue is not None:
        parts.append("v.task_queue = %s")
        params.append(f.task_queue)
    if f.started_after is not None:
        parts.append("v.start_time >= %s")
        params.append(f.started_after)
    if f.started_before is not None:
        parts.append("v.start_time <= %s")
        params.append(f.started_before)
    if f.closed_after is not None:
        parts.append("v.close_time >= %s")
        params.append(f.closed_after)
    if f.closed_before is not None:
        parts.append("v.close_time <= %s")
        params.append(f.closed_before)
    for predicate in f.search:
        text, values = _predicate_sql(predicate)
        parts.append(text)
        params.extend(values)
    return (" AND ".join(parts) or "true"), params


def list_query(f: VisibilityFilter) -> tuple[str, list[Any]]:
    where, params = where_clause(f)
    order = (
        "v.start_time DESC, v.workflow_id ASC" if f.newest_first else "v.start_time ASC, v.workflow_id ASC"
    )
    text = f"SELECT {_V_COLUMNS} FROM visibility AS v WHERE {where} ORDER BY {order} LIMIT %s OFFSET %s"
    return text, [*params, f.limit, f.offset]


def count_query(f: VisibilityFilter) -> tuple[str, list[Any]]:
    where, params = where_clause(f)
    return f"SELECT count(*) FROM visibility AS v WHERE {where}", params
