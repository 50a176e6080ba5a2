"""History invariants of a PostgreSQL store schema, checked in SQL.

Used by the failover tests and by ``bench/pg_cluster.py`` after a run with
faults.  :func:`check_invariants` reads one schema and returns every
violation it finds (an empty list: all hold):

``seq_gap``
    a workflow's events are not exactly seqs ``1..head`` (``workflows.head``).
``duplicate_seq``
    two events share one ``(workflow_id, seq)``: a forked history.  The
    primary key forbids it; checked anyway, so a schema change cannot hide it.
``orphan_events``
    events of a workflow id that has no ``workflows`` row.
``epoch_decreased``
    an event carries a lower ``owner_epoch`` than the event before it: a
    writer fenced by a takeover wrote after the new owner.
``epoch_ahead``
    an event carries a higher ``owner_epoch`` than the workflow row holds.
``terminal_count``
    a run segment (from a ``WorkflowStarted`` or ``WorkflowReopened`` to the
    next) holds more than one terminal event, or a segment other than the last
    holds none.
``event_after_terminal``
    an event follows its segment's terminal event inside the segment.
``duplicate_completion``
    one activity (workflow, run, activity id) has more than one
    ``ActivityCompleted``, or more than one settling event in all (completed,
    finally failed, cancelled).
``completion_unscheduled``
    an ``ActivityCompleted`` with no ``ActivityScheduled`` of that id before
    it in its run.
``unfinished``
    the workflow's status is not terminal, or its last event is not a terminal
    event.
``wrong_result`` / ``missing_workflow``
    only with ``expected_results``: a workflow's final ``WorkflowCompleted``
    result differs from the expected JSON value, or the workflow is absent.

Every query is constant text; the schema is chosen with ``set_config``
(``search_path``) on a connection of the caller's, restored afterwards.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import attrs
import psycopg

from aion_trio import EventBody

# Every event body type subclasses EventBody directly.
TERMINAL_NAMES = sorted(cls.__name__ for cls in EventBody.__subclasses__() if cls.TERMINAL)


@attrs.frozen(kw_only=True)
class Violation:
    """One broken invariant: which check, which workflow, and what was found."""

    check: str
    workflow_id: str
    detail: str

    def __str__(self) -> str:
        return f"[{self.check}] {self.workflow_id}: {self.detail}"


# Per event: its run number (WorkflowStarted count so far) and its segment
# number (WorkflowStarted or WorkflowReopened count so far).
_NUMBERED = """
    SELECT workflow_id, seq, type, data, owner_epoch,
        sum(CASE WHEN type = 'WorkflowStarted' THEN 1 ELSE 0 END)
            OVER (PARTITION BY workflow_id ORDER BY seq) AS run_no,
        sum(CASE WHEN type IN ('WorkflowStarted', 'WorkflowReopened') THEN 1 ELSE 0 END)
            OVER (PARTITION BY workflow_id ORDER BY seq) AS segment_no
    FROM events
"""

_SQL_SEQ_GAPS = """
SELECT w.workflow_id, w.head, count(e.seq), min(e.seq), max(e.seq)
FROM workflows w LEFT JOIN events e ON e.workflow_id = w.workflow_id
GROUP BY w.workflow_id, w.head
HAVING count(e.seq) <> w.head OR coalesce(max(e.seq), 0) <> w.head OR coalesce(min(e.seq), 1) <> 1
ORDER BY w.workflow_id
"""

_SQL_DUPLICATE_SEQ = """
SELECT workflow_id, seq, count(*), array_agg(owner_epoch ORDER BY owner_epoch)
FROM events GROUP BY workflow_id, seq HAVING count(*) > 1 ORDER BY workflow_id, seq
"""

_SQL_ORPHAN_EVENTS = """
SELECT e.workflow_id, count(*) FROM events e
WHERE NOT EXISTS (SELECT 1 FROM workflows w WHERE w.workflow_id = e.workflow_id)
GROUP BY e.workflow_id ORDER BY e.workflow_id
"""

_SQL_EPOCH_DECREASED = """
SELECT workflow_id, seq, owner_epoch, previous FROM (
    SELECT workflow_id, seq, owner_epoch,
        lag(owner_epoch) OVER (PARTITION BY workflow_id ORDER BY seq) AS previous
    FROM events
) AS x WHERE owner_epoch < previous ORDER BY workflow_id, seq
"""

_SQL_EPOCH_AHEAD = """
SELECT e.workflow_id, max(e.owner_epoch), w.owner_epoch
FROM events e JOIN workflows w ON w.workflow_id = e.workflow_id
GROUP BY e.workflow_id, w.owner_epoch HAVING max(e.owner_epoch) > w.owner_epoch
ORDER BY e.workflow_id
"""

_SQL_TERMINALS = f"""
WITH numbered AS ({_NUMBERED}),
segments AS (
    SELECT workflow_id, segment_no,
        count(*) FILTER (WHERE type = ANY (%(terminal)s)) AS terminals,
        min(seq) FILTER (WHERE type = ANY (%(terminal)s)) AS first_terminal,
        max(seq) AS last_seq,
        max(segment_no) OVER (PARTITION BY workflow_id) AS last_segment
    FROM numbered GROUP BY workflow_id, segment_no
)
SELECT workflow_id, segment_no, terminals, first_terminal, last_seq, last_segment FROM segments
WHERE terminals > 1 OR (terminals = 0 AND segment_no < last_segment) OR first_terminal < last_seq
ORDER BY workflow_id, segment_no
"""

_SQL_COMPLETIONS = f"""
WITH numbered AS ({_NUMBERED}),
settled AS (
    SELECT workflow_id, run_no, (data::jsonb ->> 'activity_id')::bigint AS activity_id,
        count(*) FILTER (WHERE type = 'ActivityCompleted') AS completed,
        count(*) AS settled,
        array_agg(type || '#' || seq ORDER BY seq) AS events
    FROM numbered
    WHERE type = 'ActivityCompleted' OR type = 'ActivityCancelled'
        OR (type = 'ActivityFailed' AND (data::jsonb ->> 'final')::boolean)
    GROUP BY workflow_id, run_no, activity_id
)
SELECT workflow_id, run_no, activity_id, completed, settled, events FROM settled
WHERE completed > 1 OR settled > 1 ORDER BY workflow_id, run_no, activity_id
"""

_SQL_UNSCHEDULED = f"""
WITH numbered AS ({_NUMBERED})
SELECT c.workflow_id, c.seq, c.data::jsonb ->> 'activity_id' FROM numbered c
WHERE c.type = 'ActivityCompleted' AND NOT EXISTS (
    SELECT 1 FROM numbered s
    WHERE s.workflow_id = c.workflow_id AND s.run_no = c.run_no AND s.seq < c.seq
        AND s.type = 'ActivityScheduled' AND s.data::jsonb -> 'activity_id' = c.data::jsonb -> 'activity_id'
)
ORDER BY c.workflow_id, c.seq
"""

_SQL_UNFINISHED = """
SELECT w.workflow_id, w.status, e.type FROM workflows w
LEFT JOIN events e ON e.workflow_id = w.workflow_id AND e.seq = w.head
WHERE w.status IS NULL OR w.status IN ('running', 'continued_as_new')
    OR e.type IS NULL OR NOT e.type = ANY (%(terminal)s)
ORDER BY w.workflow_id
"""

_SQL_RESULTS = """
SELECT w.workflow_id, e.type, e.data FROM workflows w
LEFT JOIN events e ON e.workflow_id = w.workflow_id AND e.seq = w.head
"""


def check_invariants(
    conn: psycopg.Connection[Any],
    schema: str,
    *,
    expected_results: Mapping[str, Any] | None = None,
) -> list[Violation]:
    """Every invariant violation in ``schema``'s histories (see the module docstring).

    ``conn`` is any open connection to the server; its ``search_path`` is set
    to ``schema`` for the duration and restored.  ``expected_results`` maps
    workflow ids to the JSON value each workflow's ``WorkflowCompleted``
    result must equal (every id must exist).  Reads only; in autocommit mode
    each query sees its own snapshot, so check a quiet schema.
    """
    params = {"terminal": TERMINAL_NAMES}
    previous = conn.execute("SELECT current_setting('search_path')").fetchone()
    conn.execute("SELECT set_config('search_path', %s, false)", (schema,))
    try:
        found: list[Violation] = []

        def add(check: str, workflow_id: str, detail: str) -> None:
            found.append(Violation(check=check, workflow_id=workflow_id, detail=detail))

        for wid, head, count, low, high in conn.execute(_SQL_SEQ_GAPS):
            add("seq_gap", wid, f"head {head} but {count} events with seqs {low}..{high}")
        for wid, seq, count, epochs in conn.execute(_SQL_DUPLICATE_SEQ):
            add("duplicate_seq", wid, f"seq {seq} written {count} times (owner epochs {epochs})")
        for wid, count in conn.execute(_SQL_ORPHAN_EVENTS):
            add("orphan_events", wid, f"{count} events but no workflows row")
        for wid, seq, epoch, previous_epoch in conn.execute(_SQL_EPOCH_DECREASED):
            add("epoch_decreased", wid, f"seq {seq} has owner epoch {epoch} after epoch {previous_epoch}")
        for wid, event_epoch, row_epoch in conn.execute(_SQL_EPOCH_AHEAD):
            add("epoch_ahead", wid, f"an event carries owner epoch {event_epoch}; the row holds {row_epoch}")
        for wid, segment, terminals, first, last, _last_segment in conn.execute(_SQL_TERMINALS, params):
            if terminals > 1:
                add("terminal_count", wid, f"run segment {segment} has {terminals} terminal events")
            elif terminals == 0:
                add("terminal_count", wid, f"run segment {segment} ended without a terminal event")
            if first is not None and first < last:
                add(
                    "event_after_terminal",
                    wid,
                    f"segment {segment}: terminal at seq {first}, events up to {last}",
                )
        for wid, run, activity, completed, settled, events in conn.execute(_SQL_COMPLETIONS):
            add(
                "duplicate_completion",
                wid,
                f"run {run} activity {activity}: {completed} completions, {settled} settlements ({events})",
            )
        for wid, seq, activity in conn.execute(_SQL_UNSCHEDULED):
            add("completion_unscheduled", wid, f"seq {seq} completes activity {activity}, never scheduled")
        for wid, status, last_type in conn.execute(_SQL_UNFINISHED, params):
            add("unfinished", wid, f"status {status!r}, last event {last_type}")
        if expected_results is not None:
            results = {wid: (kind, data) for wid, kind, data in conn.execute(_SQL_RESULTS)}
            for wid, expected in sorted(expected_results.items()):
                if wid not in results:
                    add("missing_workflow", wid, "expected a result, found no workflow")
                    continue
                kind, data = results[wid]
                got = json.loads(data).get("result") if kind == "WorkflowCompleted" else None
                if kind != "WorkflowCompleted" or got != expected:
                    add("wrong_result", wid, f"expected {expected!r}, last event {kind} with {data}")
        return found
    finally:
        assert previous is not None
        conn.execute("SELECT set_config('search_path', %s, false)", (previous[0],))
