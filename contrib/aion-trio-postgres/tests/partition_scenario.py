"""One partition of a cluster node, end to end: the partition test's and ``bench/partition.py``'s scenario.

Two engine node processes (``failover_node.py``), ``n1`` and ``n2``, each
reaching PostgreSQL through a fault proxy of its own (``_faultproxy.py``).
``n1`` starts ``spans`` workflows (a chain of short activities, each logging
its node and wall-clock span straight to the server, not through the proxy:
the side effect reaches the outside world while the database is cut off).
Then:

1. ``n1``'s proxy turns into a blackhole both ways (the partition) for
   ``hold`` seconds, longer than the lease TTL; ``n2`` takes every one of
   ``n1``'s running workflows over.  Or (``fault``) the partition is
   asymmetric (``send_only``: requests arrive, answers never do) or the link
   flaps (``flap``: cut and healed every few hundred milliseconds);
2. the partition heals: ``n1`` renews its lease again and rejoins: it drops
   every workflow ``n2`` took over (it prints ``RELINQUISHED``), found by its
   rejoin check or, at the latest, by a fenced append;
3. ``n2`` is ``kill -9``'d, so the rejoined ``n1`` must claim everything and
   finish it: a node that came back from a partition works as any other.

Measured (seconds of wall clock; the proxy's switch is the partition's start):

``stopped``
    from the partition to the start of the last side effect on ``n1`` before
    the heal (none started later than the TTL, by its own clock);
``takeover``
    from the partition until ``n2`` owns every workflow ``n1`` was running;
``rejoin``
    from the heal until ``n1``'s lease is renewed again (database clock);
``dropped``
    from the heal until ``n1`` has dropped the last workflow ``n2`` took over
    (its ``RELINQUISHED`` lines; not measured for a flap, which may cause no
    takeover).

Checked after the run (:attr:`Outcome.problems`): the SQL invariants of
``_invariants.py`` with every workflow's expected result; every step ran;
no side effect started on ``n1`` between ``partition + TTL`` and the heal;
and no two nodes ran the same activity at overlapping times.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import failover_app
import psycopg
import psycopg.sql
from _faultproxy import ProxyControl, running_proxy
from _invariants import check_invariants

HERE = Path(__file__).resolve().parent


@attrs.frozen
class Outcome:
    stopped: float
    takeover: float
    rejoin: float
    relinquished: int
    problems: list[str]
    dropped: float = float("nan")


class ScenarioFailed(AssertionError):
    pass


@attrs.define(eq=False)
class _Run:
    base: str
    schema: str
    tmp: Path
    procs: dict[str, tuple[subprocess.Popen[bytes], Path]] = attrs.Factory(dict)
    side: str | None = None
    """The server the activities log their spans to (default: ``base``), in a schema of the same name."""

    def side_query(self, text: str, params: Any = None) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.side or self.base, autocommit=True) as conn:
            conn.execute("SELECT set_config('search_path', %s, false)", (self.schema,))
            cur = conn.execute(text, params)
            return cur.fetchall() if cur.description else []

    def query(self, text: str, params: Any = None) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.base, autocommit=True) as conn:
            conn.execute("SELECT set_config('search_path', %s, false)", (self.schema,))
            cur = conn.execute(text, params)
            return cur.fetchall() if cur.description else []

    def spawn(self, name: str, url: str, args: list[str]) -> None:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
            "AIONFO_SIDE_URL": f"{self.side or self.base}?application_name=aionfo-side",
            "AIONFO_SCHEMA": self.schema,
            "AIONFO_NODE": name,
        }
        log = self.tmp / f"{name}.log"
        command = [sys.executable, str(HERE / "failover_node.py"), "--url", url, "--schema", self.schema]
        with log.open("wb") as out:
            popen = subprocess.Popen(
                [*command, "--node", name, *args], cwd=HERE, env=env, stdout=out, stderr=subprocess.STDOUT
            )
        self.procs[name] = (popen, log)

    def text(self, name: str) -> str:
        return self.procs[name][1].read_text(errors="replace")

    def diagnostics(self) -> str:
        try:
            statuses = self.query("SELECT status, owner_node, count(*) FROM workflows GROUP BY 1, 2")
            nodes = self.query("SELECT node_id, incarnation, lease_expires_at, renewed_at FROM nodes")
        except psycopg.Error as exc:
            statuses, nodes = [], [("unreadable", str(exc))]
        logs = "\n".join(
            f"--- {name} (rc={popen.poll()})\n{self.text(name)[-3000:]}"
            for name, (popen, _log) in self.procs.items()
        )
        return f"statuses={statuses}\nnodes={nodes}\n{logs}"

    def wait_for(self, what: str, check: Callable[[], Any], seconds: float, step: float = 0.02) -> Any:
        deadline = time.monotonic() + seconds
        while True:
            found = check()
            if found:
                return found
            for name, (popen, _log) in self.procs.items():
                if popen.poll() is not None and name != "n2-killed":
                    raise ScenarioFailed(f"{name} exited while waiting for {what}\n{self.diagnostics()}")
            if time.monotonic() > deadline:
                raise ScenarioFailed(f"timed out after {seconds}s waiting for {what}\n{self.diagnostics()}")
            time.sleep(step)

    def stop(self) -> None:
        for popen, _log in self.procs.values():
            if popen.poll() is None:
                popen.terminate()
        for popen, _log in self.procs.values():
            try:
                popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                popen.kill()
                popen.wait(timeout=10)


def _host_port(base: str) -> tuple[str, int]:
    hostport = base.split("://", 1)[1].rpartition("@")[2].split("/", 1)[0]
    host, _, port = hostport.partition(":")
    return host or "127.0.0.1", int(port or 5432)


def overlapping_spans(rows: list[tuple[Any, ...]]) -> list[str]:
    """``rows`` of (workflow_id, step, node, started, ended): each activity run by two nodes at once."""
    by_activity: dict[tuple[str, int], list[tuple[float, float, str]]] = {}
    for wid, step, node, started, ended in rows:
        by_activity.setdefault((wid, step), []).append((started, ended, node))
    found = []
    for (wid, step), spans in sorted(by_activity.items()):
        spans.sort()
        for k, (s1, e1, n1) in enumerate(spans):
            for s2, e2, n2 in spans[k + 1 :]:
                if n1 != n2 and s2 < e1:
                    found.append(
                        f"{wid} step {step}: {n1} ran {s1:.3f}..{e1:.3f}, {n2} ran {s2:.3f}..{e2:.3f}"
                    )
    return found


FAULTS = ("blackhole", "send_only", "flap")


def _flap(proxy: ProxyControl, seconds: float, period: float) -> None:
    """Blackhole and heal ``proxy`` in turn every ``period`` seconds for ``seconds``; ends healed."""
    end = time.monotonic() + seconds
    cut = True
    while time.monotonic() < end:
        if cut:
            proxy.blackhole()
        else:
            proxy.passing()
        cut = not cut
        time.sleep(period)
    proxy.passing()


def run_partition(
    base: str,
    schema: str,
    tmp: Path,
    *,
    ttl: float = 1.5,
    sweep: float = 0.3,
    poll: float = 0.3,
    workflows: int = 12,
    steps: int = 100,
    hold: float | None = None,
    fault: str = "blackhole",
    flap_period: float = 0.3,
) -> Outcome:
    """Run the scenario in the (migrated, empty) ``schema``; raise :class:`ScenarioFailed` on a stall.

    ``fault``: ``blackhole`` (both ways), ``send_only`` (the node's bytes reach
    the server, no answer comes back: its writes may commit unseen) or
    ``flap`` (blackhole and heal every ``flap_period`` seconds for ``hold``
    seconds; a takeover may or may not happen: ``takeover`` is NaN if not).
    """
    if fault not in FAULTS:
        raise ValueError(f"fault must be one of {FAULTS}, got {fault!r}")
    hold = 2 * ttl if hold is None else hold
    run = _Run(base=base, schema=schema, tmp=tmp)
    run.side_query(failover_app.SQL_CREATE_SPANS)
    host, port = _host_port(base)
    common = ["--lease-ttl", str(ttl), "--sweep-interval", str(sweep), "--poll-interval", str(poll)]
    with running_proxy(host, port) as p1, running_proxy(host, port) as p2:
        proxies: dict[str, ProxyControl] = {"n1": p1, "n2": p2}
        try:
            run.spawn("n2", proxies["n2"].url(base), common)
            run.spawn(
                "n1", proxies["n1"].url(base), [*common, "--spans", f"0:{workflows}:1", "--steps", str(steps)]
            )
            run.wait_for("n1 to start its workflows", lambda: "SPANNING" in run.text("n1"), 30)
            run.wait_for("n2 to be ready", lambda: "READY" in run.text("n2"), 30)
            spans_sql = f"SELECT count(DISTINCT workflow_id) FROM {failover_app.SPAN_TABLE}"
            run.wait_for(
                "every workflow to run a step", lambda: run.side_query(spans_sql)[0][0] >= workflows, 30
            )
            held = {
                wid
                for (wid,) in run.query(
                    "SELECT workflow_id FROM workflows WHERE owner_node = 'n1' AND status = 'running'"
                )
            }
            if not held:
                raise ScenarioFailed(f"n1 owns no running workflow to take over\n{run.diagnostics()}")

            partition_at = time.time()
            if fault == "flap":
                _flap(proxies["n1"], hold, flap_period)
            elif fault == "send_only":
                proxies["n1"].send_only()
            else:
                proxies["n1"].blackhole()

            def taken() -> bool:
                owners = dict(
                    run.query(
                        "SELECT workflow_id, owner_node FROM workflows WHERE workflow_id = ANY(%s)",
                        (list(held),),
                    )
                )
                return all(owners[wid] == "n2" for wid in held)

            if fault == "flap":
                # A flapping link may keep the lease alive: a takeover is allowed, not required.
                takeover = time.time() - partition_at if taken() else float("nan")
            else:
                run.wait_for("n2 to take n1's workflows over", taken, 10 * ttl + 10)
                takeover = time.time() - partition_at
            remaining = partition_at + hold - time.time()
            if remaining > 0:
                time.sleep(remaining)
            heal_at = time.time()
            proxies["n1"].passing()

            def renewed() -> bool:
                rows = run.query(
                    "SELECT renewed_at > to_timestamp(%s) AND lease_expires_at > clock_timestamp()"
                    " FROM nodes WHERE node_id = 'n1'",
                    (heal_at,),
                )
                return bool(rows and rows[0][0])

            run.wait_for("n1 to renew its lease after the heal", renewed, 10 * ttl + 10)
            rejoin = time.time() - heal_at
            dropped = float("nan")
            if fault != "flap":
                lost = set(held)

                def all_dropped() -> float | None:
                    at: dict[str, float] = {}
                    for line in run.text("n1").splitlines():
                        parts = line.split(" ", 3)
                        if len(parts) >= 3 and parts[0] == "RELINQUISHED" and parts[1] in lost:
                            at.setdefault(parts[1], float(parts[2]))
                    return max(at.values()) if len(at) == len(lost) else None

                dropped = (
                    run.wait_for("n1 to drop every workflow it lost", all_dropped, 10 * ttl + 10) - heal_at
                )

            # The rejoined node must be a working node: it finishes what n2 leaves behind.
            popen, log = run.procs.pop("n2")
            popen.kill()
            popen.wait(timeout=10)
            run.procs["n2-killed"] = (popen, log)

            def finished() -> bool:
                return run.query("SELECT count(*) FROM workflows WHERE status = 'completed'") == [
                    (workflows,)
                ]

            run.wait_for("every workflow to complete", finished, 60)
            relinquished = run.text("n1").count("RELINQUISHED ")
        finally:
            run.stop()

    problems: list[str] = []
    with psycopg.connect(base, autocommit=True) as conn:
        expected = {f"s-{i}": steps for i in range(workflows)}
        problems += [str(v) for v in check_invariants(conn, schema, expected_results=expected)]
    rows = run.side_query(f"SELECT workflow_id, step, node, started, ended FROM {failover_app.SPAN_TABLE}")
    ran = {(wid, step) for wid, step, *_rest in rows}
    missing = {(f"s-{i}", s) for i in range(workflows) for s in range(steps)} - ran
    if missing:
        problems.append(f"{len(missing)} steps never ran, e.g. {sorted(missing)[:5]}")
    problems += [f"overlap: {text}" for text in overlapping_spans(rows)]
    cut_off = [
        started for _w, _s, node, started, _e in rows if node == "n1" and partition_at <= started < heal_at
    ]
    # While the link flaps the node may run work between outages: the bound is for a lasting cut.
    late = [s - partition_at for s in cut_off if s > partition_at + ttl] if fault != "flap" else []
    if late:
        problems.append(
            f"n1 started {len(late)} side effects later than the TTL into the partition: {late[:5]}"
        )
    stopped = max(cut_off) - partition_at if cut_off else 0.0
    return Outcome(
        stopped=stopped,
        takeover=takeover,
        rejoin=rejoin,
        relinquished=relinquished,
        problems=problems,
        dropped=dropped,
    )


def _span_problems(run: _Run, workflows: int, steps: int) -> list[str]:
    problems: list[str] = []
    with psycopg.connect(run.base, autocommit=True) as conn:
        expected = {f"s-{i}": steps for i in range(workflows)}
        problems += [str(v) for v in check_invariants(conn, run.schema, expected_results=expected)]
    rows = run.side_query(f"SELECT workflow_id, step, node, started, ended FROM {failover_app.SPAN_TABLE}")
    ran = {(wid, step) for wid, step, *_rest in rows}
    missing = {(f"s-{i}", s) for i in range(workflows) for s in range(steps)} - ran
    if missing:
        problems.append(f"{len(missing)} steps never ran, e.g. {sorted(missing)[:5]}")
    problems += [f"overlap: {text}" for text in overlapping_spans(rows)]
    return problems


@attrs.frozen
class RestartOutcome:
    resumed: float
    """From the server's restart until every workflow completed (seconds)."""
    problems: list[str]
    nodes_resumed: float
    """From the server's restart until every node had renewed its lease (seconds)."""
    completed_before: int = 0
    """Workflows already completed when the server was stopped."""


def run_restart(
    server: Any,
    side: str,
    schema: str,
    tmp: Path,
    *,
    outage: float,
    nodes: int = 3,
    ttl: float = 2.0,
    sweep: float = 0.3,
    poll: float = 0.3,
    workflows: int = 30,
    steps: int = 40,
    finish_within: float = 90.0,
) -> RestartOutcome:
    """``nodes`` node processes on ``server`` (an ``_ownserver.OwnServer``, running, schema
    migrated) run ``spans`` workflows; the server is stopped for ``outage`` seconds and
    started again; every node must resume by itself (renew its lease) and every workflow
    finish, within ``finish_within`` seconds of the restart.  The activities log to
    ``side`` (another server), so the outage fails no side effect."""
    tmp.mkdir(parents=True, exist_ok=True)
    run = _Run(base=server.url, schema=schema, tmp=tmp, side=side)
    with psycopg.connect(side, autocommit=True) as conn:
        conn.execute(psycopg.sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(psycopg.sql.Identifier(schema)))
    run.side_query(failover_app.SQL_CREATE_SPANS)
    common = ["--lease-ttl", str(ttl), "--sweep-interval", str(sweep), "--poll-interval", str(poll)]
    names = [f"n{k + 1}" for k in range(nodes)]
    try:
        for k, name in enumerate(names):
            run.spawn(
                name, server.url, [*common, "--spans", f"{k}:{workflows}:{nodes}", "--steps", str(steps)]
            )
        for name in names:
            run.wait_for(f"{name} to start its workflows", lambda name=name: "SPANNING" in run.text(name), 60)
        spans_sql = f"SELECT count(DISTINCT workflow_id) FROM {failover_app.SPAN_TABLE}"
        run.wait_for(
            "every workflow to run a step",
            lambda: run.side_query(spans_sql)[0][0] >= workflows,
            max(30.0, 0.1 * workflows),
        )
        completed_sql = "SELECT count(*) FROM workflows WHERE status = 'completed'"
        completed_before = int(run.query(completed_sql)[0][0])
        server.stop("fast")
        time.sleep(outage)
        server.start()
        restarted = time.monotonic()
        restarted_wall = time.time()
        seen: dict[str, float] = {}  # "nodes" / "workflows": seconds after the restart

        def finished() -> bool:
            try:
                if "nodes" not in seen:  # every node renewed its lease since the restart
                    rows = run.query(
                        "SELECT count(*) FROM nodes WHERE renewed_at > to_timestamp(%s)"
                        " AND lease_expires_at > clock_timestamp()",
                        (restarted_wall,),
                    )
                    if rows == [(nodes,)]:
                        seen["nodes"] = time.monotonic() - restarted
                if "workflows" not in seen:
                    done = run.query("SELECT count(*) FROM workflows WHERE status = 'completed'")
                    if done == [(workflows,)]:
                        seen["workflows"] = time.monotonic() - restarted
            except psycopg.OperationalError:
                return False
            return len(seen) == 2

        run.wait_for("every node to resume and every workflow to complete", finished, finish_within, step=0.1)
    finally:
        run.stop()
    return RestartOutcome(
        resumed=seen["workflows"],
        nodes_resumed=seen["nodes"],
        completed_before=completed_before,
        problems=_span_problems(run, workflows, steps),
    )


@attrs.frozen
class SlowOutcome:
    seconds: float
    """From the start until every workflow completed."""
    taken_over: int
    """Workflows whose owner epoch passed 1 (a lease lost and the workflow claimed again)."""
    relinquished: int
    problems: list[str]


def run_slow(
    base: str,
    schema: str,
    tmp: Path,
    *,
    latency: float,
    ttl: float = 2.0,
    sweep: float = 0.3,
    poll: float = 0.3,
    workflows: int = 6,
    steps: int = 8,
) -> SlowOutcome:
    """Two nodes, each behind a proxy adding ``latency`` seconds per round trip, run ``spans``
    workflows to the end; no lease may be lost (no workflow claimed twice)."""
    run = _Run(base=base, schema=schema, tmp=tmp)
    run.side_query(failover_app.SQL_CREATE_SPANS)
    host, port = _host_port(base)
    common = ["--lease-ttl", str(ttl), "--sweep-interval", str(sweep), "--poll-interval", str(poll)]
    with running_proxy(host, port) as p1, running_proxy(host, port) as p2:
        p1.passing(latency=latency)
        p2.passing(latency=latency)
        began = time.monotonic()
        try:
            half = workflows // 2
            run.spawn("n1", p1.url(base), [*common, "--spans", f"0:{half}:1", "--steps", str(steps)])
            run.spawn(
                "n2", p2.url(base), [*common, "--spans", f"{half}:{workflows}:1", "--steps", str(steps)]
            )

            def finished() -> bool:
                return run.query("SELECT count(*) FROM workflows WHERE status = 'completed'") == [
                    (workflows,)
                ]

            run.wait_for("every workflow to complete", finished, 120, step=0.1)
            seconds = time.monotonic() - began
            relinquished = run.text("n1").count("RELINQUISHED ") + run.text("n2").count("RELINQUISHED ")
        finally:
            run.stop()
    taken = run.query("SELECT count(*) FROM workflows WHERE owner_epoch > 1")[0][0]
    return SlowOutcome(
        seconds=seconds,
        taken_over=int(taken),
        relinquished=relinquished,
        problems=_span_problems(run, workflows, steps),
    )
