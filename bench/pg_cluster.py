"""aion_trio cluster mode on one PostgreSQL: failover time, multi-process throughput, DBOS.

Usage::

    python bench/pg_cluster.py [--pg-url URL] [--failover-workflows 200] [--lease-ttl 2]
        [--sweep-interval 0.5] [--poll-interval 0.5] [--workflows 1000] [--steps 10]
        [--concurrency 100] [--processes 1,2,4] [--dbos-python PATH] [--skip-dbos] [--skip-failover]
        [--dir DIR] [--seconds S]

Engine processes are ``contrib/aion-trio-postgres/tests/failover_node.py``
(the failover test's node, workload ``failover_app``), each in a fresh schema
of the database ``--pg-url`` names (default ``$AION_TRIO_TEST_PG_URL`` or
``postgresql://postgres@127.0.0.1:5432/test``); schemas are dropped at the end.

1. **failover**: a node ("victim") starts ``--failover-workflows`` ``nap``
   workflows whose durable timers all come due at one moment; a second node
   ("taker") is up; the victim is ``kill -9``'d just before that moment, so
   no timer fires before its lease runs out.  Triggers (this schema only)
   stamp each event and each owner-epoch change with the database's
   ``clock_timestamp()``.  Per workflow: *takeover* = the first event written
   under the new owner epoch minus the kill (the database clock read right
   after ``kill``), split into *detection* (claim minus kill) and *recovery*
   (first new event minus claim: replay + the overdue timer).  p50/p99/max,
   printed beside the bound ``lease_ttl + sweep_interval + poll_interval +
   replay`` (replay: the measured recovery maximum), then the SQL invariants.
2. **throughput**: ``--workflows`` x ``--steps`` ``chain`` workflows
   (``--concurrency`` in flight in all), split over 1, 2 and 4 engine
   processes (``--processes``) on one schema; steps/s from a common start
   line to the last process's end.
3. **DBOS Transact** on the same PostgreSQL server (a database of its own,
   created and dropped here), the same workload in one process
   (``@DBOS.workflow`` + ``@DBOS.step``, asyncio), run in a subprocess with
   ``--dbos-python`` (DBOS is a bench-only dependency: see bench/README.md);
   then the aion/DBOS steps/s ratios.

Prints one JSON line per result.  ``--seconds S`` (smoke run) shrinks the
workloads and caps each measurement at about S seconds; the numbers are then
meaningless.  Not part of the test run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from _common import emitter, percentile, run_in_scratch
from _dbos_chain import dbos_available, define_chain, run_chains

ROOT = Path(__file__).resolve().parent.parent
NODE_DIR = ROOT / "contrib" / "aion-trio-postgres" / "tests"
DEFAULT_PG_URL = "postgresql://postgres@127.0.0.1:5432/test"


emit = emitter("pg_cluster")


def spread(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "p50_s": round(percentile(ordered, 0.50), 3),
        "p99_s": round(percentile(ordered, 0.99), 3),
        "max_s": round(ordered[-1], 3),
    }


# --------------------------------------------------------------------------
# DBOS Transact (runs in a subprocess: ``--dbos-worker``; imports only dbos)
# --------------------------------------------------------------------------


def dbos_worker(args: argparse.Namespace) -> int:
    """The throughput workload on DBOS with a PostgreSQL system database; print one JSON object."""
    import asyncio
    import importlib.metadata
    import logging

    from dbos import DBOS

    chain_workflow = define_chain()

    async def throughput() -> dict[str, Any]:
        done, elapsed = await run_chains(
            chain_workflow, args.workflows, args.steps, args.concurrency, args.seconds
        )
        return {
            "completed": done,
            "seconds": round(elapsed, 3),
            "steps_per_s": round(done * args.steps / elapsed, 1),
        }

    DBOS(config={"name": "aion-bench-pg", "system_database_url": args.dbos_worker, "log_level": "WARNING"})
    try:
        DBOS.launch()
        result = asyncio.run(throughput())
    finally:
        DBOS.destroy()
    logging.shutdown()
    result["dbos"] = importlib.metadata.version("dbos")
    print(json.dumps(result), flush=True)
    return 0


# --------------------------------------------------------------------------
# aion_trio engine processes
# --------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace, directory: str) -> None:
        self.args = args
        self.dir = Path(directory)
        self.base = args.pg_url
        self.schemas: list[str] = []
        self.procs: list[subprocess.Popen[bytes]] = []

    # -- SQL --------------------------------------------------------------------

    def query(self, schema: str | None, text: str, params: Any = None) -> list[tuple[Any, ...]]:
        import psycopg

        with psycopg.connect(self.base, autocommit=True) as conn:
            if schema is not None:
                conn.execute("SELECT set_config('search_path', %s, false)", (schema,))
            cur = conn.execute(text, params)
            return cur.fetchall() if cur.description else []

    def new_schema(self) -> str:
        import trio
        from aion_trio_postgres import open_postgres_store

        schema = f"aion_bench_{uuid.uuid4().hex[:12]}"
        self.schemas.append(schema)

        async def migrate() -> None:
            async with open_postgres_store(f"{self.base}?schema={schema}"):
                pass

        trio.run(migrate)
        return schema

    def drop_schemas(self) -> None:
        import psycopg
        from psycopg import sql

        with psycopg.connect(self.base, autocommit=True) as conn:
            for schema in self.schemas:
                conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))

    # -- processes ----------------------------------------------------------------

    def node(
        self, schema: str, node: str, *extra: str, stdin: bool = False
    ) -> tuple[subprocess.Popen[bytes], Path]:
        log = self.dir / f"{schema}-{node}.log"
        args = [sys.executable, str(NODE_DIR / "failover_node.py"), "--url", self.base, "--schema", schema]
        args += ["--node", node, *extra]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(NODE_DIR), os.environ.get("PYTHONPATH", "")]),
            "AIONFO_SIDE_URL": self.base,
            "AIONFO_SCHEMA": schema,
            "AIONFO_NODE": node,
        }
        with log.open("wb") as out:
            proc = subprocess.Popen(
                args,
                cwd=NODE_DIR,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            )
        self.procs.append(proc)
        return proc, log

    def wait_line(self, proc: subprocess.Popen[bytes], log: Path, marker: str, seconds: float = 60) -> str:
        deadline = time.monotonic() + seconds
        while True:
            text = log.read_text(errors="replace") if log.exists() else ""
            for line in text.splitlines():
                if line.startswith(marker):
                    return line
            if proc.poll() is not None:
                raise RuntimeError(f"{log.name}: exited ({proc.returncode}) before {marker}:\n{text[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{log.name}: no {marker} after {seconds}s:\n{text[-3000:]}")
            time.sleep(0.02)

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    # -- 1. failover ----------------------------------------------------------------

    def failover(self) -> None:
        sys.path.insert(0, str(NODE_DIR))
        import psycopg
        from _invariants import check_invariants

        args = self.args
        n = args.failover_workflows
        ttl, sweep, poll = args.lease_ttl, args.sweep_interval, args.poll_interval
        schema = self.new_schema()
        for statement in _INSTRUMENT:
            self.query(schema, statement)
        common = ["--lease-ttl", str(ttl), "--sweep-interval", str(sweep), "--poll-interval", str(poll)]
        taker, taker_log = self.node(schema, "taker", *common)
        self.wait_line(taker, taker_log, "READY")
        # Every timer comes due at one moment, after the victim has started them all.
        due = time.time() + 6.0 + n * 0.03
        victim, victim_log = self.node(
            schema, "victim", *common, "--nap", f"0:{n}:1", "--nap-until", str(due)
        )
        self.wait_line(victim, victim_log, "NAPPING", seconds=60)
        owned = self.query(schema, "SELECT count(*) FROM workflows WHERE owner_node = 'victim'")[0][0]
        if owned != n:
            raise RuntimeError(f"the victim owns {owned} of {n} workflows before the kill")
        pause = due - 0.3 - time.time()
        if pause < 0:
            raise RuntimeError("the victim started its workflows too slowly: raise the head start")
        time.sleep(pause)
        victim.send_signal(signal.SIGKILL)
        killed_at = self.query(None, "SELECT clock_timestamp()")[0][0]
        victim.wait()
        cap = 60.0 if args.seconds is None else max(30.0, args.seconds)
        deadline = time.monotonic() + cap + ttl
        while self.query(schema, "SELECT count(*) FROM workflows WHERE status = 'completed'")[0][0] < n:
            if time.monotonic() > deadline:
                raise RuntimeError(f"takeover incomplete after {cap}s:\n{taker_log.read_text()[-3000:]}")
            time.sleep(0.1)
        lease = self.query(schema, "SELECT lease_expires_at, renewed_at FROM nodes WHERE node_id = 'victim'")[
            0
        ]
        rows = self.query(schema, _SQL_TAKEOVERS, (killed_at, killed_at, killed_at))
        if len(rows) != n:
            raise RuntimeError(f"{len(rows)} of {n} workflows show a takeover")
        takeover = [float(r[1]) for r in rows]
        detection = [float(r[2]) for r in rows]
        recovery = [float(r[3]) for r in rows]
        since_expiry = [t - (lease[0] - killed_at).total_seconds() for t in takeover]
        # The bound must cover the slowest workflow: its replay term is the measured
        # recovery maximum (claim to first event under the new epoch: read + replay +
        # the overdue timer), not a percentile.
        replay = max(recovery)
        bound = ttl + sweep + poll + replay
        measured = spread(takeover)
        emit(
            {
                "kind": "failover",
                "workflows": n,
                "killed_after_last_renewal_s": round((killed_at - lease[1]).total_seconds(), 3),
                "lease_expired_after_kill_s": round((lease[0] - killed_at).total_seconds(), 3),
                "takeover": measured,
                "after_lease_expiry": spread(since_expiry),
                "detection": spread(detection),
                "recovery": spread(recovery),
                "bound_s": round(bound, 3),
                "bound_parts_s": {
                    "lease_ttl": ttl,
                    "sweep_interval": sweep,
                    "poll_interval": poll,
                    "replay_max": round(replay, 3),
                },
                "within_bound": measured["max_s"] <= bound,
            }
        )
        with psycopg.connect(self.base, autocommit=True) as conn:
            violations = check_invariants(
                conn, schema, expected_results={f"nap-{i}": f"nap-{i}" for i in range(n)}
            )
        emit(
            {
                "kind": "failover_invariants",
                "violations": len(violations),
                "first": [str(v) for v in violations[:3]],
            }
        )
        taker.terminate()
        taker.wait(timeout=15)

    # -- 2. throughput --------------------------------------------------------------

    def throughput(self, processes: int) -> dict[str, Any]:
        args = self.args
        schema = self.new_schema()
        per = max(1, args.concurrency // processes)
        started = []
        for k in range(processes):
            extra = ["--lease-ttl", "10", "--sweep-interval", "1", "--poll-interval", "1"]
            extra += ["--chain", f"{k}:{args.workflows}:{processes}", "--steps", str(args.steps)]
            extra += ["--concurrency", str(per)]
            if args.seconds is not None:
                extra += ["--cap", str(args.seconds)]
            started.append(self.node(schema, f"tp{k}", *extra, stdin=True))
        for proc, log in started:
            self.wait_line(proc, log, "READY")
        began = time.perf_counter()
        for proc, _log in started:
            assert proc.stdin is not None
            proc.stdin.write(b"go\n")
            proc.stdin.flush()
        results = []
        for proc, log in started:
            line = self.wait_line(proc, log, "CHAIN ", seconds=600)
            results.append(json.loads(line.split(" ", 1)[1]))
            proc.wait(timeout=30)
        elapsed = time.perf_counter() - began
        done = sum(r["completed"] for r in results)
        return {
            "processes": processes,
            "completed": done,
            "seconds": round(elapsed, 3),
            "workflows_per_s": round(done / elapsed, 1),
            "steps_per_s": round(done * args.steps / elapsed, 1),
        }

    # -- 3. DBOS --------------------------------------------------------------------

    def dbos(self) -> dict[str, Any]:
        import psycopg
        from psycopg import sql

        args = self.args
        database = f"aion_bench_dbos_{uuid.uuid4().hex[:10]}"
        with psycopg.connect(self.base, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database)))
            server = conn.execute("SHOW server_version").fetchone()
        try:
            url = self.base.rsplit("/", 1)[0] + "/" + database
            command = [args.dbos_python, str(Path(__file__).resolve()), "--dbos-worker", url]
            command += ["--workflows", str(args.workflows), "--steps", str(args.steps)]
            command += ["--concurrency", str(args.concurrency)]
            if args.seconds is not None:
                command += ["--seconds", str(args.seconds)]
            proc = subprocess.run(command, capture_output=True, text=True, check=False, timeout=900)
            if proc.returncode != 0:
                sys.stderr.write(proc.stderr)
                raise RuntimeError(f"DBOS failed with exit {proc.returncode}")
            result = dict(json.loads(proc.stdout.strip().splitlines()[-1]))
            result["postgres"] = server[0] if server else None
            return result
        finally:
            with psycopg.connect(self.base, autocommit=True) as conn:
                conn.execute(
                    sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(database))
                )


# Bench-only instrumentation of the failover schema: database-clock stamps of
# every event and every owner-epoch change (constant text; the schema is the
# search_path).
_INSTRUMENT = (
    "CREATE TABLE bench_event_times (workflow_id text, seq bigint, owner_epoch bigint,"
    " written_at timestamptz NOT NULL DEFAULT clock_timestamp())",
    "CREATE TABLE bench_claims (workflow_id text, owner_node text, owner_epoch bigint,"
    " claimed_at timestamptz NOT NULL DEFAULT clock_timestamp())",
    "CREATE FUNCTION bench_stamp_event() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
    " INSERT INTO bench_event_times (workflow_id, seq, owner_epoch)"
    " VALUES (NEW.workflow_id, NEW.seq, NEW.owner_epoch); RETURN NULL; END $$",
    "CREATE FUNCTION bench_stamp_claim() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
    " INSERT INTO bench_claims (workflow_id, owner_node, owner_epoch)"
    " VALUES (NEW.workflow_id, NEW.owner_node, NEW.owner_epoch); RETURN NULL; END $$",
    "CREATE TRIGGER bench_event_times AFTER INSERT ON events FOR EACH ROW EXECUTE FUNCTION bench_stamp_event()",
    "CREATE TRIGGER bench_claims AFTER UPDATE OF owner_epoch ON workflows FOR EACH ROW"
    " WHEN (OLD.owner_epoch IS DISTINCT FROM NEW.owner_epoch) EXECUTE FUNCTION bench_stamp_claim()",
)

# Per workflow: the first claim after the kill and the first event under that
# claim's epoch -> (id, takeover, detection, recovery) in seconds.
_SQL_TAKEOVERS = """
WITH claim AS (
    SELECT DISTINCT ON (workflow_id) workflow_id, owner_epoch, claimed_at FROM bench_claims
    WHERE claimed_at > %s ORDER BY workflow_id, claimed_at
), first_event AS (
    SELECT c.workflow_id, c.claimed_at, min(t.written_at) AS written_at FROM claim c
    JOIN bench_event_times t ON t.workflow_id = c.workflow_id AND t.owner_epoch = c.owner_epoch
    GROUP BY c.workflow_id, c.claimed_at
)
SELECT workflow_id, extract(epoch FROM written_at - %s), extract(epoch FROM claimed_at - %s),
    extract(epoch FROM written_at - claimed_at)
FROM first_event ORDER BY workflow_id
"""


def run_all(args: argparse.Namespace, directory: str) -> None:
    import psycopg
    import trio

    import aion_trio as aion

    with psycopg.connect(args.pg_url, autocommit=True) as conn:
        server = conn.execute("SHOW server_version").fetchone()
    emit(
        {
            "kind": "environment",
            "python": platform.python_version(),
            "aion_trio": aion.__version__,
            "trio": trio.__version__,
            "postgres": server[0] if server else None,
            "aion_trio_tree": str(Path(aion.__file__).resolve().parent.parent),
            "cpus": os.cpu_count(),
            "seconds_cap": args.seconds,
            "loadavg_1m": round(os.getloadavg()[0], 2),
            "workflows": args.workflows,
            "steps": args.steps,
            "concurrency": args.concurrency,
        }
    )
    bench = Bench(args, directory)
    try:
        if not args.skip_failover:
            bench.failover()
        tp: dict[int, dict[str, Any]] = {}
        for processes in args.processes:
            tp[processes] = bench.throughput(processes)
            emit({"kind": "throughput", "engine": "aion_trio", "store": "postgresql", **tp[processes]})
        skip = "--skip-dbos" if args.skip_dbos else dbos_available(args.dbos_python)
        if skip is not None:
            emit({"kind": "skipped", "engine": "dbos", "reason": skip})
            return
        peer = bench.dbos()
        emit({"kind": "throughput", "engine": "dbos", "store": "postgresql", "processes": 1, **peer})
        for processes, result in tp.items():
            emit(
                {
                    "kind": "throughput_ratio",
                    "aion_processes": processes,
                    "dbos_processes": 1,
                    "steps_ratio": round(result["steps_per_s"] / peer["steps_per_s"], 2),
                }
            )
    finally:
        bench.stop_all()
        bench.drop_schemas()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--pg-url", default=os.environ.get("AION_TRIO_TEST_PG_URL", "").strip() or DEFAULT_PG_URL
    )
    parser.add_argument("--failover-workflows", type=int, default=200)
    parser.add_argument("--lease-ttl", type=float, default=2.0)
    parser.add_argument("--sweep-interval", type=float, default=0.5)
    parser.add_argument("--poll-interval", type=float, default=0.5)
    parser.add_argument("--workflows", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--concurrency", type=int, default=100, help="runs in flight, over all processes")
    parser.add_argument(
        "--processes",
        default="1,2,4",
        type=lambda text: [int(x) for x in text.split(",")],
        help="engine process counts to measure",
    )
    parser.add_argument("--dbos-python", default=sys.executable, help="interpreter for the DBOS subprocess")
    parser.add_argument("--skip-dbos", action="store_true")
    parser.add_argument("--skip-failover", action="store_true", help="measure throughput (and DBOS) only")
    parser.add_argument("--dir", help="where the fresh temporary directory (process logs) goes")
    parser.add_argument("--seconds", type=float, help="smoke run: shrink the workloads, cap each measurement")
    parser.add_argument("--dbos-worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.dbos_worker is not None:
        return dbos_worker(args)
    if args.seconds is not None:
        args.failover_workflows = min(args.failover_workflows, 20)
        args.workflows = min(args.workflows, 40)
    for name in ("failover_workflows", "workflows", "steps", "concurrency"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    run_in_scratch("aion-bench-pg-cluster-", args.dir, lambda directory: run_all(args, directory), emit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
