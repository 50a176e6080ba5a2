"""Rows <-> domain values, and visibility filters -> SQL.

Datetimes are stored as integer microseconds since the Unix epoch (UTC):
exact, sortable, and read back as aware UTC datetimes.  Event bodies use the
wire codec (``body_data_json``), the one place JSON conversion lives.

Search predicates are evaluated in SQL with exactly the semantics of
:meth:`SearchPredicate.matches`: each operator and value kind selects one of
the constant condition texts below, values are bound.  Integers outside
SQLite's 64-bit range cannot be bound; they are stored as text (kind
``bigint``) and compared by ``aion_search_match``, a SQL function that runs
the reference ``matches`` itself.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta, timezone
from typing import Any

from aion_trio.plugin import (
    Event,
    EventDecodeError,
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

_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_MICROSECOND = timedelta(microseconds=1)
_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1


def _dumps(value: object) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def to_us(value: datetime) -> int:
    """Microseconds since the Unix epoch of an aware datetime."""
    return (value - _EPOCH) // _MICROSECOND


def from_us(value: int) -> datetime:
    """The aware UTC datetime ``value`` microseconds after the Unix epoch."""
    return _EPOCH + timedelta(microseconds=value)


# --------------------------------------------------------------------------
# Events
# --------------------------------------------------------------------------

EventRow = tuple[str, int, int, str, str]


def event_rows(workflow_id: str, events: Sequence[Event]) -> list[EventRow]:
    """The ``events`` table rows of a validated batch."""
    rows: list[EventRow] = []
    # The events of one batch usually share their timestamp: convert it once.
    last_at: datetime | None = None
    last_us = 0
    for event in events:
        try:
            type_name, data = body_data_json(event.body)
        except (TypeError, ValueError) as exc:
            raise StoreEncodeError(workflow_id, event.seq, f"cannot encode the event: {exc}") from exc
        at = event.recorded_at
        if at is not last_at:
            last_at = at
            last_us = to_us(at)
        rows.append((workflow_id, event.seq, last_us, type_name, data))
    return rows


def _recorded_at(value: object) -> datetime:
    if not isinstance(value, int):
        raise EventDecodeError(f"recorded_at is {value!r}, not integer microseconds")
    return from_us(value)


def decode_events(workflow_id: str, rows: Sequence[Sequence[Any]], location: str) -> list[Event]:
    """Events from ``(seq, recorded_at, type, data)`` rows; a bad row is a :class:`StoreDecodeError`."""
    return events_from_rows(workflow_id, rows, _recorded_at, location)


# --------------------------------------------------------------------------
# Visibility rows and search attributes
# --------------------------------------------------------------------------

VISIBILITY_COLUMNS = (
    "workflow_id, run_id, workflow_type, status, start_time, close_time, task_queue,"
    " failed_step, failure_reason, stuck_reason, search_attributes"
)


def visibility_params(row: VisibilityRow) -> tuple[Any, ...]:
    attributes = {k: list(v) if isinstance(v, tuple) else v for k, v in row.search_attributes.items()}
    return (
        row.workflow_id,
        row.run_id,
        row.workflow_type,
        row.status.value,
        to_us(row.start_time),
        None if row.close_time is None else to_us(row.close_time),
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
            start_time=from_us(start),
            close_time=None if close is None else from_us(close),
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


SearchRow = tuple[str, str, int, str, Any, Any]


def _list_text(value: Sequence[str]) -> str:
    return _dumps(list(value))


def search_rows(workflow_id: str, attributes: Mapping[str, SearchValue]) -> list[SearchRow]:
    """``search_attrs`` rows: ``(workflow_id, key, part, kind, num, txt)``."""
    rows: list[SearchRow] = []
    for key, value in attributes.items():
        if isinstance(value, bool):
            rows.append((workflow_id, key, 0, "bool", int(value), None))
        elif isinstance(value, int):
            if _INT64_MIN <= value <= _INT64_MAX:
                rows.append((workflow_id, key, 0, "int", value, None))
            else:
                rows.append((workflow_id, key, 0, "bigint", None, str(value)))
        elif isinstance(value, float):
            rows.append((workflow_id, key, 0, "float", value, None))
        elif isinstance(value, str):
            rows.append((workflow_id, key, 0, "str", None, value))
        else:
            rows.append((workflow_id, key, 0, "list", None, _list_text(value)))
            rows.extend((workflow_id, key, i, "elem", None, item) for i, item in enumerate(value, 1))
    return rows


@functools.lru_cache(maxsize=256)
def _predicate(op: str, value_json: str) -> SearchPredicate:
    return SearchPredicate(key="k", op=SearchOp(op), value=json.loads(value_json))


def search_match(kind: str, num: Any, txt: Any, op: str, value_json: str) -> int:
    """SQL function ``aion_search_match``: the reference semantics on one stored attribute."""
    have: SearchValue
    if kind == "bigint":
        have = int(txt)
    elif kind in ("int", "float"):
        have = num
    else:  # pragma: no cover - the SQL only calls this for numbers
        return 0
    return int(_predicate(op, value_json).matches({"k": have}))


SQL_FUNCTIONS = {"aion_search_match": (search_match, 5)}

_MATCH = "aion_search_match(s.kind, s.num, s.txt, ?, ?)"
# (operator, kind of the wanted value) -> condition on one search_attrs row ``s``.
_CONDITIONS = {
    ("equals", "bool"): "s.kind = 'bool' AND s.num = ?",
    ("equals", "num"): f"(s.kind IN ('int', 'float') AND s.num = ?) OR (s.kind = 'bigint' AND {_MATCH})",
    ("greater", "num"): f"(s.kind IN ('int', 'float') AND s.num > ?) OR (s.kind = 'bigint' AND {_MATCH})",
    ("less", "num"): f"(s.kind IN ('int', 'float') AND s.num < ?) OR (s.kind = 'bigint' AND {_MATCH})",
    ("equals", "bignum"): f"s.kind IN ('int', 'float', 'bigint') AND {_MATCH}",
    ("greater", "bignum"): f"s.kind IN ('int', 'float', 'bigint') AND {_MATCH}",
    ("less", "bignum"): f"s.kind IN ('int', 'float', 'bigint') AND {_MATCH}",
    ("equals", "str"): "s.kind = 'str' AND s.txt = ?",
    ("greater", "str"): "s.kind = 'str' AND s.txt > ?",
    ("less", "str"): "s.kind = 'str' AND s.txt < ?",
    ("equals", "list"): "s.kind = 'list' AND s.txt = ?",
    ("contains", "str"): "(s.kind = 'elem' AND s.txt = ?) OR (s.kind = 'str' AND instr(s.txt, ?) > 0)",
}
_SEARCH = "v.workflow_id IN (SELECT s.workflow_id FROM search_attrs AS s WHERE s.key = ? AND ({}))"
_SEARCH_SQL = {k: _SEARCH.format(c) for k, c in _CONDITIONS.items()}


def _predicate_sql(p: SearchPredicate) -> tuple[str, list[Any]]:
    op = p.op.value
    want = p.value
    value_json = _dumps(list(want) if isinstance(want, tuple) else want)
    if isinstance(want, bool):
        return _SEARCH_SQL[(op, "bool")], [p.key, int(want)]
    if isinstance(want, (int, float)):
        if isinstance(want, int) and not _INT64_MIN <= want <= _INT64_MAX:
            return _SEARCH_SQL[(op, "bignum")], [p.key, op, value_json]
        return _SEARCH_SQL[(op, "num")], [p.key, want, op, value_json]
    if isinstance(want, str):
        if p.op is SearchOp.CONTAINS:
            return _SEARCH_SQL[(op, "str")], [p.key, want, want]
        return _SEARCH_SQL[(op, "str")], [p.key, want]
    return _SEARCH_SQL[(op, "list")], [p.key, _list_text(want)]


def where_clause(f: VisibilityFilter) -> tuple[str, list[Any]]:
    """``WHERE`` text (constant fragments joined) and its bound parameters."""
    parts: list[str] = []
    params: list[Any] = []
    if f.workflow_type is not None:
        parts.append("v.workflow_type = ?")
        params.append(f.workflow_type)
    if f.status is not None:
        statuses = sorted(s.value for s in f.status)
        parts.append("v.status IN (" + ", ".join("?" for _ in statuses) + ")")
        params.extend(statuses)
    if f.task_queue is not None:
        parts.append("v.task_queue = ?")
        params.append(f.task_queue)
    if f.started_after is not None:
        parts.append("v.start_time >= ?")
        params.append(to_us(f.started_after))
    if f.started_before is not None:
        parts.append("v.start_time <= ?")
        params.append(to_us(f.started_before))
    if f.closed_after is not None:
        parts.append("v.close_time >= ?")
        params.append(to_us(f.closed_after))
    if f.closed_before is not None:
        parts.append("v.close_time <= ?")
        params.append(to_us(f.closed_before))
    for predicate in f.search:
        sql, values = _predicate_sql(predicate)
        parts.append(sql)
        params.extend(values)
    return (" AND ".join(parts) or "1"), params


def list_query(f: VisibilityFilter) -> tuple[str, list[Any]]:
    where, params = where_clause(f)
    order = (
        "v.start_time DESC, v.workflow_id ASC" if f.newest_first else "v.start_time ASC, v.workflow_id ASC"
    )
    sql = f"SELECT {VISIBILITY_COLUMNS} FROM visibility AS v WHERE {where} ORDER BY {order} LIMIT ? OFFSET ?"
    return sql, [*params, -1 if f.limit is None else f.limit, f.offset]


def count_query(f: VisibilityFilter) -> tuple[str, list[Any]]:
    where, params = where_clause(f)
    return f"SELECT count(*) FROM visibility AS v WHERE {where}", params
