"""A cluster node cut off from PostgreSQL: how long until it stops, is taken over, rejoins.

Usage::

    python bench/partition.py [--pg-url URL] [--repetitions 10] [--lease-ttl 2]
        [--sweep-interval 0.3] [--poll-interval 0.3] [--workflows 12] [--steps 100] [--dir DIR]
        [--fault blackhole|send_only|flap|restart] [--hold H] [--outage S] [--nodes N] [--seconds S]

Each repetition runs the partition test's scenario
(``contrib/aion-trio-postgres/tests/partition_scenario.py``) in a fresh
schema of ``--pg-url`` (default ``$AION_TRIO_TEST_PG_URL`` or
``postgresql://postgres@127.0.0.1:5432/test``): two engine node processes,
each behind a fault proxy of its own; node ``n1``'s proxy blackholes its
connections both ways for twice the lease TTL (``--fault send_only``: only
the answers are lost; ``flap``: cut and healed every 0.3 s for ``--hold``
seconds, 6 by default, 60 for the full-scale run), then heals; then ``n2`` is
``kill -9``'d and ``n1`` finishes everything.  Per repetition it measures
*stopped* (partition to the start of ``n1``'s last side effect), *takeover*
(partition until ``n2`` owns every workflow ``n1`` ran), *rejoin* (heal
until ``n1``'s lease is renewed) and *dropped* (heal until ``n1`` dropped the
last workflow ``n2`` took over), and checks the invariants (histories, one
completion per attempt, no overlapping runs of one activity on two nodes).

Prints one JSON line per repetition, then per measure p50 and max beside
the bound ``lease_ttl + sweep_interval + poll_interval`` (the replay of the
claimed histories comes on top: the scenario's histories are short), and
the number of repetitions whose checks found a problem.

``--fault restart`` runs the database restart scenario instead (the restart
test's, at full scale by default): ``--nodes`` (3) node processes run
``--workflows`` (500) workflows of ``--steps`` (20) steps on a PostgreSQL
server of the bench's own (``_ownserver.py``: initdb and pg_ctl on a free
port and a fresh data directory, never the shared server; the activities log
their spans to ``--pg-url``), which is stopped for ``--outage`` (30) seconds
and started again.  Per repetition it prints the seconds from the restart
until every node renewed its lease (*nodes_resumed*) and until every
workflow finished (*finished*; *completed_before_outage* says how many had
finished before the stop), and the count of invariant problems.

``--seconds S`` (smoke run): one repetition of 4 workflows, whatever S.
Not part of the test run.
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from pathlib import Path

from _common import emitter, percentile, run_in_scratch

ROOT = Path(__file__).resolve().parent.parent
NODE_DIR = ROOT / "contrib" / "aion-trio-postgres" / "tests"
DEFAULT_PG_URL = "postgresql://postgres@127.0.0.1:5432/test"

emit = emitter("partition")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pg-url", default=os.environ.get("AION_TRIO_TEST_PG_URL") or DEFAULT_PG_URL)
    parser.add_argument("--repetitions", type=int, help="10 (restart: 1)")
    parser.add_argument("--lease-ttl", type=float, default=2.0)
    parser.add_argument("--sweep-interval", type=float, default=0.3)
    parser.add_argument("--poll-interval", type=float, default=0.3)
    parser.add_argument("--workflows", type=int, help="12 (restart: 500)")
    parser.add_argument("--steps", type=int, help="100 (restart: 20)")
    parser.add_argument(
        "--fault", default="blackhole", help="blackhole (default), send_only, flap or restart"
    )
    parser.add_argument("--hold", type=float, help="seconds the fault lasts (flap: 6; others: twice the TTL)")
    parser.add_argument("--outage", type=float, default=30.0, help="restart: seconds the server is down")
    parser.add_argument("--nodes", type=int, default=3, help="restart: node processes")
    parser.add_argument("--dir", help="parent of the scratch directory (node logs)")
    parser.add_argument("--seconds", type=float, help="smoke run: one repetition of 4 workflows")
    args = parser.parse_args(argv)
    restart = args.fault == "restart"
    if args.repetitions is None:
        args.repetitions = 1 if restart else 10
    if args.workflows is None:
        args.workflows = 500 if restart else 12
    if args.steps is None:
        args.steps = 20 if restart else 100
    if args.hold is None and args.fault == "flap":
        args.hold = 6.0
    if args.seconds is not None:
        args.repetitions, args.workflows = 1, 4
    sys.path.insert(0, str(NODE_DIR))
    if restart:
        run_in_scratch("aion-restart-", args.dir, lambda directory: restarts(args, directory), emit)
        return
    import psycopg
    import trio
    from aion_trio_postgres import open_postgres_store
    from partition_scenario import run_partition

    base = args.pg_url.split("?", 1)[0]

    def body(directory: str) -> None:
        measures: dict[str, list[float]] = {"stopped": [], "takeover": [], "rejoin": [], "dropped": []}
        failed = 0
        for rep in range(args.repetitions):
            schema = f"aion_pb_{uuid.uuid4().hex[:12]}"

            async def migrate(url: str) -> None:
                async with open_postgres_store(url):
                    pass

            trio.run(migrate, f"{base}?schema={schema}")
            tmp = Path(directory) / f"rep{rep}"
            tmp.mkdir()
            try:
                outcome = run_partition(
                    base,
                    schema,
                    tmp,
                    ttl=args.lease_ttl,
                    sweep=args.sweep_interval,
                    poll=args.poll_interval,
                    workflows=args.workflows,
                    steps=args.steps,
                    fault=args.fault,
                    hold=args.hold,
                )
            finally:
                with psycopg.connect(base, autocommit=True) as conn:
                    conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
            failed += bool(outcome.problems)
            for name in measures:
                measures[name].append(getattr(outcome, name))
            emit(
                {
                    "kind": "repetition",
                    "fault": args.fault,
                    "rep": rep,
                    "hold_s": args.hold if args.hold is not None else 2 * args.lease_ttl,
                    "stopped_s": round(outcome.stopped, 3),
                    "takeover_s": round(outcome.takeover, 3)
                    if outcome.takeover == outcome.takeover
                    else None,
                    "rejoin_s": round(outcome.rejoin, 3),
                    "dropped_s": round(outcome.dropped, 3) if outcome.dropped == outcome.dropped else None,
                    "relinquished": outcome.relinquished,
                    "problems": outcome.problems[:5],
                }
            )
        bound = args.lease_ttl + args.sweep_interval + args.poll_interval
        for name, values in measures.items():
            ordered = sorted(v for v in values if v == v)  # a flap may cause no takeover (NaN)
            if not ordered:
                emit({"kind": name, "repetitions": 0, "fault": args.fault})
                continue
            emit(
                {
                    "kind": name,
                    "fault": args.fault,
                    "repetitions": len(ordered),
                    "p50_s": round(percentile(ordered, 0.5), 3),
                    "max_s": round(ordered[-1], 3),
                    "bound_ttl_sweep_poll_s": round(bound, 3),
                    "lease_ttl_s": args.lease_ttl,
                }
            )
        emit({"kind": "checks", "repetitions": args.repetitions, "with_problems": failed})

    run_in_scratch("aion-partition-", args.dir, body, emit)


def restarts(args: argparse.Namespace, directory: str) -> None:
    """``--fault restart``: the database restart scenario on a server of the bench's own."""
    import psycopg
    import trio
    from _ownserver import OwnServer
    from aion_trio_postgres import open_postgres_store
    from partition_scenario import run_restart

    side = args.pg_url.split("?", 1)[0]
    failed = 0
    for rep in range(args.repetitions):
        schema = f"aion_rb_{uuid.uuid4().hex[:12]}"
        server = OwnServer()
        try:
            server.start()

            async def migrate(url: str) -> None:
                async with open_postgres_store(url):
                    pass

            trio.run(migrate, f"{server.url}?schema={schema}")
            outcome = run_restart(
                server,
                side,
                schema,
                Path(directory) / f"rep{rep}",
                outage=args.outage,
                nodes=args.nodes,
                ttl=args.lease_ttl,
                sweep=args.sweep_interval,
                poll=args.poll_interval,
                workflows=args.workflows,
                steps=args.steps,
                finish_within=max(90.0, 0.5 * args.workflows),
            )
        finally:
            server.destroy()
            with psycopg.connect(side, autocommit=True) as conn:
                conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        failed += bool(outcome.problems)
        emit(
            {
                "kind": "restart",
                "rep": rep,
                "nodes": args.nodes,
                "workflows": args.workflows,
                "steps": args.steps,
                "outage_s": args.outage,
                "lease_ttl_s": args.lease_ttl,
                "nodes_resumed_s": round(outcome.nodes_resumed, 3),
                "completed_before_outage": outcome.completed_before,
                "finished_s": round(outcome.resumed, 3),
                "problems": len(outcome.problems),
                "first_problems": outcome.problems[:5],
            }
        )
    emit({"kind": "checks", "repetitions": args.repetitions, "with_problems": failed})


if __name__ == "__main__":
    main(sys.argv[1:])
