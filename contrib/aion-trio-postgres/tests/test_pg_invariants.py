"""The SQL invariant checker (``_invariants.py``) against deliberately broken rows.

Two clean histories are written straight into a fresh schema: ``a`` (two
activities, the second retried, taken over by another node mid-history, so
its owner epoch steps from 1 to 2) and ``b`` (continued as new once: two
runs, each with its own activity 0).  The checker finds nothing in them (the
control); each case then breaks the rows one way and must be reported by
exactly the checks named.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
import trio
from _invariants import Violation, check_invariants
from aion_trio_postgres import open_postgres_store

Conn = psycopg.Connection[Any]

A = [
    ("WorkflowStarted", {"run_id": "r-a"}, 1),
    ("ActivityScheduled", {"activity_id": 0}, 1),
    ("ActivityCompleted", {"activity_id": 0, "result": 1, "attempt": 1}, 1),
    ("ActivityScheduled", {"activity_id": 1}, 2),
    ("ActivityFailed", {"activity_id": 1, "attempt": 1, "final": False}, 2),
    ("ActivityCompleted", {"activity_id": 1, "result": 2, "attempt": 2}, 2),
    ("WorkflowCompleted", {"result": 3}, 2),
]
B = [
    ("WorkflowStarted", {"run_id": "r-b1"}, 1),
    ("ActivityScheduled", {"activity_id": 0}, 1),
    ("ActivityCompleted", {"activity_id": 0, "result": 5, "attempt": 1}, 1),
    ("WorkflowContinuedAsNew", {"parent_run_id": "r-b1"}, 1),
    ("WorkflowStarted", {"run_id": "r-b2"}, 1),
    ("ActivityScheduled", {"activity_id": 0}, 1),
    ("ActivityCompleted", {"activity_id": 0, "result": 6, "attempt": 1}, 1),
    ("WorkflowCompleted", {"result": 6}, 1),
]
RESULTS = {"a": 3, "b": 6}


def insert(conn: Conn, wid: str, seq: int, kind: str, data: dict[str, Any], epoch: int) -> None:
    conn.execute(
        "INSERT INTO events (workflow_id, seq, recorded_at, type, data, owner_epoch)"
        " VALUES (%s, %s, clock_timestamp(), %s, %s, %s)",
        (wid, seq, kind, json.dumps(data), epoch),
    )


def set_event(conn: Conn, wid: str, seq: int, kind: str, data: dict[str, Any]) -> None:
    conn.execute(
        "UPDATE events SET type = %s, data = %s WHERE workflow_id = %s AND seq = %s",
        (kind, json.dumps(data), wid, seq),
    )


@pytest.fixture
def seeded(
    fresh_store_url: Callable[..., str], schema_of: Callable[[str], str]
) -> Iterator[tuple[Conn, str]]:
    """A migrated schema holding the clean histories ``a`` and ``b``, and a connection to it."""
    url = fresh_store_url()

    async def migrate() -> None:
        async with open_postgres_store(url):
            pass

    trio.run(migrate)
    schema = schema_of(url)
    with psycopg.connect(url.split("?", 1)[0], autocommit=True) as conn:
        conn.execute("SELECT set_config('search_path', %s, false)", (schema,))
        for wid, events, owner, epoch in (("a", A, "n2", 2), ("b", B, "n1", 1)):
            conn.execute(
                "INSERT INTO workflows (workflow_id, head, status, owner_node, owner_epoch)"
                " VALUES (%s, %s, 'completed', %s, %s)",
                (wid, len(events), owner, epoch),
            )
            for seq, (kind, data, event_epoch) in enumerate(events, 1):
                insert(conn, wid, seq, kind, data, event_epoch)
        conn.execute("SELECT set_config('search_path', 'public', false)")
        yield conn, schema


def checks(found: list[Violation]) -> set[str]:
    return {v.check for v in found}


def test_clean_histories_have_no_violations(seeded: tuple[Conn, str]) -> None:
    conn, schema = seeded
    assert check_invariants(conn, schema, expected_results=RESULTS) == []
    # The caller's search_path is restored.
    assert conn.execute("SHOW search_path").fetchone() == ("public",)


def _drop_pk_and_duplicate(conn: Conn) -> None:
    conn.execute("ALTER TABLE events DROP CONSTRAINT events_pkey")
    # A fenced writer's seq 5 beside the new owner's: a fork, written under the old epoch.
    insert(conn, "a", 5, "MarkerRecorded", {"name": "zombie"}, 1)


BREAKAGES: dict[str, tuple[Callable[[Conn], object], set[str]]] = {
    "missing seq": (
        lambda c: c.execute("DELETE FROM events WHERE workflow_id = 'a' AND seq = 5"),
        {"seq_gap"},
    ),
    "head beyond the events": (
        lambda c: c.execute("UPDATE workflows SET head = 9 WHERE workflow_id = 'b'"),
        {"seq_gap", "unfinished", "wrong_result"},
    ),
    "forked seq": (_drop_pk_and_duplicate, {"duplicate_seq", "epoch_decreased", "seq_gap"}),
    "events without a workflow row": (
        lambda c: insert(c, "ghost", 1, "WorkflowStarted", {"run_id": "r-g"}, 1),
        {"orphan_events"},
    ),
    "old epoch after a takeover": (
        lambda c: c.execute("UPDATE events SET owner_epoch = 1 WHERE workflow_id = 'a' AND seq = 6"),
        {"epoch_decreased"},
    ),
    "event epoch beyond the row": (
        lambda c: c.execute("UPDATE events SET owner_epoch = 3 WHERE workflow_id = 'a' AND seq = 7"),
        {"epoch_ahead"},
    ),
    "two terminals in one run": (
        lambda c: set_event(c, "a", 6, "WorkflowFailed", {"error": {}}),
        {"terminal_count", "event_after_terminal"},
    ),
    "a run that ended without a terminal": (
        lambda c: set_event(c, "b", 4, "MarkerRecorded", {"name": "m"}),
        {"terminal_count"},
    ),
    "an event after the terminal": (
        lambda c: (
            insert(c, "a", 8, "MarkerRecorded", {"name": "late"}, 2),
            c.execute("UPDATE workflows SET head = 8 WHERE workflow_id = 'a'"),
        ),
        {"event_after_terminal", "unfinished", "wrong_result"},
    ),
    "an activity completed twice": (
        lambda c: set_event(c, "a", 5, "ActivityCompleted", {"activity_id": 1, "result": 2, "attempt": 1}),
        {"duplicate_completion"},
    ),
    "an activity failed finally and completed": (
        lambda c: set_event(c, "a", 5, "ActivityFailed", {"activity_id": 1, "attempt": 1, "final": True}),
        {"duplicate_completion"},
    ),
    "a completion never scheduled": (
        lambda c: set_event(c, "a", 4, "ActivityScheduled", {"activity_id": 7}),
        {"completion_unscheduled"},
    ),
    "a workflow still running": (
        lambda c: c.execute("UPDATE workflows SET status = 'running' WHERE workflow_id = 'b'"),
        {"unfinished"},
    ),
    "a history without its terminal": (
        lambda c: (
            c.execute("DELETE FROM events WHERE workflow_id = 'a' AND seq = 7"),
            c.execute("UPDATE workflows SET head = 6 WHERE workflow_id = 'a'"),
        ),
        {"unfinished", "wrong_result"},
    ),
    "a wrong result": (lambda c: set_event(c, "a", 7, "WorkflowCompleted", {"result": 4}), {"wrong_result"}),
}


@pytest.mark.parametrize("case", sorted(BREAKAGES))
def test_each_breakage_is_reported_by_its_checks(seeded: tuple[Conn, str], case: str) -> None:
    conn, schema = seeded
    breakage, expected = BREAKAGES[case]
    conn.execute("SELECT set_config('search_path', %s, false)", (schema,))
    breakage(conn)
    found = check_invariants(conn, schema, expected_results=RESULTS)
    assert checks(found) == expected, "\n".join(map(str, found))
    assert all(v.workflow_id in ("a", "b", "ghost") and v.detail for v in found)


def test_a_missing_expected_workflow_is_reported(seeded: tuple[Conn, str]) -> None:
    conn, schema = seeded
    found = check_invariants(conn, schema, expected_results={**RESULTS, "c": 1})
    assert found == [Violation(check="missing_workflow", workflow_id="c", detail=found[0].detail)]
