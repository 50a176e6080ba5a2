"""A cluster node cut off from PostgreSQL past its lease TTL (issue 23 items 2 and 3).

Real processes and a real partition: the node's fault proxy blackholes its
connections both ways (``partition_scenario.py`` says what is run, measured
and checked).  The cut-off node stops starting side effects within the TTL
by its own clock, the other node takes every workflow over, on heal the old
node is fenced (``NotOwner``: nothing written) and rejoins, then finishes
everything once the other node is killed; every history is whole and no
two nodes ran one activity at overlapping times.  The same holds when the
partition is asymmetric (the node's requests reach the server, its answers
never come back: writes commit unseen) and when the link flaps.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import trio
from aion_trio_postgres import open_postgres_store
from partition_scenario import overlapping_spans, run_partition

TTL = 2.0
SWEEP = 0.3
POLL = 0.3


def test_overlapping_spans_names_two_nodes_running_one_activity_at_once() -> None:
    rows = [
        ("s-0", 1, "n1", 10.0, 10.5),
        ("s-0", 1, "n2", 10.4, 10.6),  # overlaps n1's
        ("s-0", 2, "n1", 11.0, 11.1),
        ("s-0", 2, "n2", 11.2, 11.3),  # after it: a retry elsewhere, allowed
        ("s-1", 1, "n1", 1.0, 2.0),
        ("s-1", 1, "n1", 1.5, 2.5),  # one node twice: not a split
    ]
    assert overlapping_spans(rows) == ["s-0 step 1: n1 ran 10.000..10.500, n2 ran 10.400..10.600"]


@pytest.mark.slow
def test_a_partitioned_node_stops_is_taken_over_is_fenced_and_rejoins(
    fresh_store_url: Callable[..., str], schema_of: Callable[[str], str], tmp_path: Path
) -> None:
    url = fresh_store_url()

    async def migrate() -> None:
        async with open_postgres_store(url):
            pass

    trio.run(migrate)
    outcome = run_partition(url.split("?", 1)[0], schema_of(url), tmp_path, ttl=TTL, sweep=SWEEP, poll=POLL)
    assert outcome.problems == [], "\n".join(outcome.problems[:30])
    assert outcome.stopped <= TTL
    # Detection (the lease runs out by the database clock) + a sweep + a replay of short histories.
    assert outcome.takeover <= TTL + SWEEP + POLL + 2.0, outcome
    assert outcome.relinquished > 0, "the healed node was never fenced: it wrote nothing after the heal?"
    assert outcome.rejoin <= TTL, outcome
    # Rejoining drops what was lost at the first sweep with a valid lease, not at a later write.
    assert outcome.dropped <= outcome.rejoin + 2 * SWEEP + 1.0, outcome


@pytest.mark.slow
def test_an_asymmetric_partition_keeps_every_invariant(
    fresh_store_url: Callable[..., str], schema_of: Callable[[str], str], tmp_path: Path
) -> None:
    url = fresh_store_url()
    trio.run(_migrate, url)
    outcome = run_partition(
        url.split("?", 1)[0], schema_of(url), tmp_path, ttl=TTL, sweep=SWEEP, poll=POLL, fault="send_only"
    )
    assert outcome.problems == [], "\n".join(outcome.problems[:30])
    assert outcome.stopped <= TTL
    # A renewal sent into the partition still lands: the lease can last one TTL more.
    assert outcome.takeover <= 2 * TTL + SWEEP + POLL + 2.0, outcome
    assert outcome.relinquished > 0
    assert outcome.dropped <= outcome.rejoin + 2 * SWEEP + 1.0, outcome


@pytest.mark.slow
def test_a_flapping_link_keeps_every_invariant(
    fresh_store_url: Callable[..., str], schema_of: Callable[[str], str], tmp_path: Path
) -> None:
    url = fresh_store_url()
    trio.run(_migrate, url)
    outcome = run_partition(
        url.split("?", 1)[0],
        schema_of(url),
        tmp_path,
        ttl=TTL,
        sweep=SWEEP,
        poll=POLL,
        fault="flap",
        hold=6.0,
    )
    assert outcome.problems == [], "\n".join(outcome.problems[:30])


async def _migrate(url: str) -> None:
    async with open_postgres_store(url):
        pass
