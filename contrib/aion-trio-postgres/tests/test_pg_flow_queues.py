"""Workflow queues on PostgreSQL across processes (issue 18).

Three engine processes (``flow_queue_node.py``) share one schema and its
workflow queues; each enqueues runs at the same moment as the others.  Every
run's activity logs its start and end (the database clock) in a side table, and
every enqueue its outcome, so the checks below are SQL over what the nodes did:

* ``jobs`` (``FlowLimit(cluster_concurrency=3)``), through a SIGKILL of a node
  whose runs are running: never more than 3 runs at once across the cluster;
  each accepted run started once, ran its activity to its end once and
  completed once (the killed node's runs on the survivors); nothing left in
  the queue; a dedup id enqueued by all three nodes at once accepted once, the
  other two refused naming the run that holds it.
* ``serial`` (``FlowLimit(concurrency=1)``): one run at a time across the
  cluster, admitted by priority whichever node enqueued it.
* ``paced`` (``FlowLimit(rate=2, period=2.0)``): never more than 2 starts per
  period across the cluster.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import flow_queue_node as q
import pytest
from _flowcluster import Nodes, peak_overlap, wait_for

NODES = ("n1", "n2", "n3")
#: A window this much shorter than the rate's period holds at most ``RATE`` starts
#: even when a start is logged up to this long after its admission (a loaded machine).
MARGIN = 1.0


@pytest.fixture
def nodes(cluster_nodes: Nodes) -> Nodes:
    for sql in q.SQL_CREATE_SIDE:
        cluster_nodes.query(sql)
    return cluster_nodes


def count(nodes: Nodes, sql: str, params: object = None) -> int:
    return int(nodes.query(sql, params)[0][0])


async def enqueue_everywhere(nodes: Nodes, tmp_path: Path, scenario: str, **extra: list[str]) -> None:
    """Spawn the three nodes, let them enqueue at the same moment, wait until they did."""
    go = tmp_path / "go"
    for name in NODES:
        args = ["--go", str(go), "--scenario", scenario, *extra.get(name, [])]
        nodes.spawn(name, "flow_queue_node.py", *args)
    await wait_for("every node to open", lambda: all("READY" in nodes.log(n) for n in NODES), nodes)
    go.touch()
    await wait_for("every node to enqueue", lambda: all("ENQUEUED" in nodes.log(n) for n in NODES), nodes)


def accepted(nodes: Nodes, queue: str) -> set[str]:
    rows = nodes.query("SELECT workflow_id FROM queue_enqueues WHERE queue = %s AND accepted", (queue,))
    return {row[0] for row in rows}


def events_per_run(nodes: Nodes, kind: str) -> dict[str, int]:
    rows = nodes.query(
        "SELECT workflow_id, count(*) FROM events WHERE type = %s GROUP BY workflow_id", (kind,)
    )
    return {wid: int(n) for wid, n in rows}


async def wait_until_all_done(nodes: Nodes, runs: set[str]) -> None:
    def done() -> bool:
        return runs <= set(events_per_run(nodes, "WorkflowCompleted")) and not count(
            nodes, "SELECT count(*) FROM flow_runs"
        )

    await wait_for("every accepted run to complete and leave its queue", done, nodes, seconds=120)


@pytest.mark.slow
@pytest.mark.timeout(300)  # three node processes; the waits below are bounded well inside
async def test_a_queue_bound_and_dedup_hold_across_three_nodes_through_a_kill(
    nodes: Nodes, tmp_path: Path
) -> None:
    await enqueue_everywhere(nodes, tmp_path, "jobs")
    assert count(nodes, "SELECT count(*) FROM queue_enqueues") == len(NODES) * (len(q.DEDUPS) + q.JOBS)
    nodes.query("INSERT INTO queue_gate VALUES (%s)", (q.DEDUP_GATE,))

    # Each node's first job holds its place until a node running one is killed.
    def hanging() -> list[tuple[object, ...]]:
        return nodes.query(
            "SELECT node FROM queue_side WHERE workflow_id LIKE %s AND ended IS NULL GROUP BY node"
            " ORDER BY count(*) DESC, node",
            (f"%{q.HANGING}",),
        )

    await wait_for("a node to run a run that holds its place", hanging, nodes)
    victim = str(hanging()[0][0])
    killed_at = nodes.kill(victim)
    nodes.query("INSERT INTO queue_gate VALUES (%s)", (q.KILLED_GATE,))
    runs = accepted(nodes, "jobs")
    await wait_until_all_done(nodes, runs)

    # Dedup across nodes: each id accepted once, the others refused naming its holder.
    for dedup_id in q.DEDUPS:
        rows = nodes.query(
            "SELECT workflow_id, accepted, holder FROM queue_enqueues WHERE dedup_id = %s", (dedup_id,)
        )
        winners = [wid for wid, ok, _ in rows if ok]
        assert len(winners) == 1, f"dedup id {dedup_id!r} accepted {len(winners)} times across nodes: {rows}"
        assert [holder for _, ok, holder in rows if not ok] == winners * (len(NODES) - 1), rows
    assert len(runs) == len(NODES) * q.JOBS + len(q.DEDUPS)

    # The bound held across the cluster (counting runs: two attempts of one run's activity,
    # the second after another node took it over, are one run), and was reached.
    peak = peak_overlap(nodes, "queue_side", victim, killed_at, "queue = 'jobs'", per="o.workflow_id")
    assert peak <= q.LIMIT, f"{peak} runs of queue 'jobs' ran at once under cluster_concurrency={q.LIMIT}"
    assert peak == q.LIMIT, f"the bound was never reached (peak {peak}): the test did not exercise it"

    # Every accepted run started, ran its activity and completed once, in its history;
    # a refused one never started.
    for kind in ("WorkflowStarted", "ActivityCompleted", "WorkflowCompleted"):
        assert events_per_run(nodes, kind) == dict.fromkeys(runs, 1), kind
    # Its activity ran to its end: the killed node's runs (cut short there) on a survivor.
    done = {row[0] for row in nodes.query("SELECT workflow_id FROM queue_side WHERE done")}
    assert done == runs
    taken_over = nodes.query(
        "SELECT count(DISTINCT workflow_id) FROM queue_side s WHERE node = %s AND ended IS NULL AND EXISTS"
        " (SELECT 1 FROM queue_side o WHERE o.workflow_id = s.workflow_id AND o.node <> %s AND o.done)",
        (victim, victim),
    )
    assert taken_over[0][0] >= 1, "the killed node's runs did not finish on the survivors"


@pytest.mark.slow
@pytest.mark.timeout(300)  # three node processes; the waits below are bounded well inside
async def test_one_at_a_time_by_priority_and_a_rate_across_three_nodes(nodes: Nodes, tmp_path: Path) -> None:
    # Nine distinct priorities, spread so that no node holds a run of consecutive ones.
    priorities = {"n1": "6,0,3", "n2": "7,1,4", "n3": "8,2,5"}
    await enqueue_everywhere(
        nodes, tmp_path, "order", **{n: ["--priorities", p] for n, p in priorities.items()}
    )
    # The first serial run admitted holds the queue until every node enqueued.
    nodes.query("INSERT INTO queue_gate VALUES (%s)", (q.SERIAL_GATE,))
    runs = accepted(nodes, "serial") | accepted(nodes, "paced")
    assert len(runs) == (3 + q.PACED) * len(NODES)
    await wait_until_all_done(nodes, runs)
    never = nodes.query("SELECT clock_timestamp()")[0][0]

    # serial: one run at a time across the cluster, then the rest by priority.
    serial = nodes.query(
        "SELECT node, workflow_id, began, ended FROM queue_side WHERE queue = 'serial' ORDER BY began"
    )
    peak = peak_overlap(nodes, "queue_side", "", never, "queue = 'serial'", per="o.workflow_id")
    assert peak == 1, f"{peak} runs of queue 'serial' (concurrency=1) ran at once: {serial}"
    order = nodes.query(
        "SELECT e.priority FROM queue_side s JOIN queue_enqueues e USING (workflow_id)"
        " WHERE s.queue = 'serial' GROUP BY e.priority ORDER BY min(s.began)"
    )
    ran = [row[0] for row in order]
    assert sorted(ran) == list(range(9)), ran
    assert ran[1:] == sorted(ran[1:]), f"serial runs did not start by priority across nodes: {ran}"

    # paced: at most RATE starts in any window of (almost) PERIOD, and the rate was reached.
    first_starts = (
        "WITH starts AS (SELECT workflow_id, min(began) AS at FROM queue_side WHERE queue = 'paced'"
        " GROUP BY workflow_id) "
    )

    def most_starts(window: float) -> int:
        return count(
            nodes,
            first_starts
            + "SELECT max((SELECT count(*) FROM starts o WHERE o.at >= s.at AND o.at < s.at + %s))"
            " FROM starts s",
            (timedelta(seconds=window),),
        )

    busiest = most_starts(q.PERIOD - MARGIN)
    assert busiest <= q.RATE, f"{busiest} starts within {q.PERIOD - MARGIN}s under rate={q.RATE}/{q.PERIOD}s"
    assert most_starts(q.PERIOD) >= q.RATE
    span = count(nodes, first_starts + "SELECT extract(epoch FROM max(at) - min(at))::int FROM starts")
    assert span >= (-(-len(NODES) * q.PACED // q.RATE) - 1) * q.PERIOD - MARGIN, span
