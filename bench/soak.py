"""The soak: engines killed or faulted at random moments, then every history checked.

Usage::

    python bench/soak.py [--store sqlite|flaky|postgres] [--kills N] [--seed S]
        [--workflows W] [--pg-url URL] [--dir DIR] [--seconds S]

``sqlite`` (the default): an engine subprocess (this file, ``--engine-process``)
on one SQLite file runs ``--workflows`` workflows of five kinds: sequential
activities with retries (a first attempt of some steps fails), a fan-out of
four activities gathered, a durable timer then a signal, a child workflow, and
a chain of continue-as-new runs.  The driver (this process) SIGKILLs it
``--kills`` times at seeded random moments (some during its start-up and
recovery, most while it works), starts it again each time, and meanwhile
queues each signal once in the store's command inbox, as ``aion-trio signal``
does.  A last engine runs to the end.  Then, read from the store: every
workflow finished once with the right result, seqs are ``1..n``, each run
has exactly one terminal event, no activity completed twice, each signal was
recorded once (and its command acknowledged).

``flaky``: the same workload and checks in one process, the engine on a
``FlakyStoreBundle`` over a SQLite file; instead of kills, ``--kills``
transient faults armed at random moments (failed appends, appends that commit
and then fail, failed reads and timer scans); the signals are sent with
``engine.signal`` and resent only when the history shows none.

``postgres``: two engine nodes in cluster mode on one schema (the failover
test's ``contrib/aion-trio-postgres/tests/failover_node.py`` and its workload
``failover_app.flow``: activity, durable timer, signal, activity with
retries); one of them SIGKILLed at random moments and restarted under its
node id, the signals queued in the inbox; afterwards the SQL invariant
checker of those tests (``_invariants.py``) with every expected result.

Prints one JSON line per result (``figures``; ``violation`` lines, at most 30,
if any check failed) and exits 1 if one did.  ``--seconds S`` (tox's bench
smoke) caps the kills at about ``S`` seconds' worth.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import trio
from _common import emitter, run_in_scratch

import aion_trio as aion

ROOT = Path(__file__).resolve().parent.parent
NODE_DIR = ROOT / "contrib" / "aion-trio-postgres" / "tests"
DEFAULT_PG_URL = "postgresql://postgres@127.0.0.1:5432/test"
SIGNAL = "go"

emit = emitter("soak")

# --------------------------------------------------------------------------
# The workload (the engine process, and the flaky variant in this process)
# --------------------------------------------------------------------------

KINDS = ("seq", "fan", "signal", "child", "continue")
RETRY = aion.RetryPolicy(max_attempts=6, backoff=aion.Fixed(0.01))
CONTINUE_RUNS = 3
_side: sqlite3.Connection | None = None
_generation = 0


def kind_of(index: int) -> str:
    return KINDS[index % len(KINDS)]


def step_result(index: int, k: int) -> int:
    return index * 10 + k


def signal_payload(index: int) -> int:
    return index % 7


def expected_result(index: int) -> int:
    kind = kind_of(index)
    if kind == "seq":
        return sum(step_result(index, k) for k in range(3))
    if kind == "fan":
        return sum(step_result(index, k) for k in range(4))
    if kind == "signal":
        return step_result(index, 0) + signal_payload(index)
    if kind == "child":
        return 2 * step_result(index, 5)
    return sum(step_result(index, k) for k in range(CONTINUE_RUNS + 1))


def workflow_id(index: int) -> str:
    return f"soak-{index}"


@aion.activity(name="soak_step", retry=RETRY)
async def step(index: int, k: int) -> int:
    info = aion.activity_info()
    if _side is not None:  # every execution, before its result: re-executions are counted
        _side.execute(
            "INSERT INTO executions (workflow_id, step, attempt, generation) VALUES (?, ?, ?, ?)",
            (info.workflow_id, k, info.attempt, _generation),
        )
    await trio.sleep(0.002 * ((index * 7 + k * 3) % 5))  # in flight for a while: kills land mid-activity
    if info.attempt == 1 and (index + k) % 4 == 0:
        raise RuntimeError(f"transient failure of step {k} of {index} (attempt 1)")
    return step_result(index, k)


@aion.workflow(name="soak_seq")
async def seq_flow(ctx: aion.WorkflowContext, index: int) -> int:
    total = 0
    for k in range(3):
        total += await ctx.run(step, index, k)
    return total


@aion.workflow(name="soak_fan")
async def fan_flow(ctx: aion.WorkflowContext, index: int) -> int:
    handles = [ctx.start(step, index, k) for k in range(4)]
    return sum(await ctx.gather(*handles))


@aion.workflow(name="soak_signal")
async def signal_flow(ctx: aion.WorkflowContext, index: int) -> int:
    await ctx.sleep(0.05 * (1 + index % 4))
    bonus = await ctx.wait_signal(SIGNAL)
    return int(await ctx.run(step, index, 0)) + int(bonus)


@aion.workflow(name="soak_leaf")
async def leaf_flow(ctx: aion.WorkflowContext, index: int) -> int:
    await ctx.sleep(0.02)
    return int(await ctx.run(step, index, 5))


@aion.workflow(name="soak_parent")
async def parent_flow(ctx: aion.WorkflowContext, index: int) -> int:
    return 2 * int(await ctx.child(leaf_flow, index))


@aion.workflow(name="soak_continue")
async def continue_flow(ctx: aion.WorkflowContext, index: int, run: int, total: int) -> int:
    total += await ctx.run(step, index, run)
    if run < CONTINUE_RUNS:
        raise ctx.continue_as_new(index, run + 1, total)
    return total


WORKFLOWS = [seq_flow, fan_flow, signal_flow, leaf_flow, parent_flow, continue_flow]
_BY_KIND = {"seq": seq_flow, "fan": fan_flow, "signal": signal_flow, "child": parent_flow}


async def start_one(engine: aion.Engine, index: int) -> aion.RunHandle:
    kind = kind_of(index)
    args: tuple[Any, ...] = (index, 0, 0) if kind == "continue" else (index,)
    definition = continue_flow if kind == "continue" else _BY_KIND[kind]
    return await engine.start(
        definition, *args, workflow_id=workflow_id(index), id_reuse=aion.IdReusePolicy.USE_EXISTING
    )


def open_side(path: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute(
        "CREATE TABLE IF NOT EXISTS executions (workflow_id TEXT, step INTEGER, attempt INTEGER,"
        " generation INTEGER)"
    )
    return conn


async def engine_process(url: str, workflows: int) -> None:
    """One generation: start (or attach to) every workflow, wait for all, print ``ALL DONE``."""
    config = aion.EngineConfig(inbox_poll_interval=0.05)
    async with aion.open_engine(url, workflows=WORKFLOWS, activities=[step], config=config) as engine:
        print("READY", flush=True)
        handles = [await start_one(engine, i) for i in range(workflows)]
        print("STARTED", flush=True)
        for handle in handles:
            await handle.result()
    print("ALL DONE", flush=True)


# --------------------------------------------------------------------------
# The checks (sqlite and flaky)
# --------------------------------------------------------------------------


def check_histories(
    histories: dict[str, list[aion.Event]], workflows: int, signals: dict[str, int]
) -> list[str]:
    """Every violation found (empty: all hold).  ``signals``: workflow id -> signals sent."""
    problems: list[str] = []
    for wid, history in sorted(histories.items()):
        if [e.seq for e in history] != list(range(1, len(history) + 1)):
            problems.append(f"{wid}: seqs are not 1..{len(history)}")
        runs: list[list[aion.Event]] = []
        for event in history:
            if isinstance(event.body, aion.WorkflowStarted) or not runs:
                runs.append([])
            runs[-1].append(event)
        for number, run in enumerate(runs):
            terminals = [e for e in run if e.is_terminal]
            if len(terminals) != 1:
                problems.append(f"{wid} run {number}: {len(terminals)} terminal events")
            elif terminals[0] is not run[-1]:
                problems.append(f"{wid} run {number}: events after its terminal event")
            completed = [e.body.activity_id for e in run if isinstance(e.body, aion.ActivityCompleted)]
            if len(completed) != len(set(completed)):
                problems.append(f"{wid} run {number}: an activity completed twice ({sorted(completed)})")
        last = history[-1].body if history else None
        if not isinstance(last, aion.WorkflowCompleted):
            tail = ", ".join(f"{e.seq}:{e.type}" for e in history[-4:])
            problems.append(f"{wid}: did not complete (last events {tail})")
        received = [e.body for e in history if isinstance(e.body, aion.SignalReceived)]
        if len(received) != signals.get(wid, 0):
            problems.append(f"{wid}: {len(received)} signals recorded, {signals.get(wid, 0)} sent")
    for index in range(workflows):
        wid = workflow_id(index)
        history = histories.get(wid)
        if not history:
            problems.append(f"{wid}: missing")
            continue
        last = history[-1].body
        if isinstance(last, aion.WorkflowCompleted) and last.result.value() != expected_result(index):
            problems.append(f"{wid}: result {last.result.value()!r}, expected {expected_result(index)}")
        runs = sum(isinstance(e.body, aion.WorkflowStarted) for e in history)
        if runs != (CONTINUE_RUNS + 1 if kind_of(index) == "continue" else 1):
            problems.append(f"{wid}: {runs} runs")
        if kind_of(index) == "signal":
            values = [e.body.payload.value() for e in history if isinstance(e.body, aion.SignalReceived)]
            if values != [signal_payload(index)]:
                problems.append(f"{wid}: signals {values}, expected [{signal_payload(index)}]")
    children = {wid for wid in histories if "/" in wid}  # "{parent id}/{parent run id}/{n}"
    parents = sum(kind_of(i) == "child" for i in range(workflows))
    if len(children) != parents:
        problems.append(f"{len(children)} child workflows for {parents} parents")
    return problems


def executions_figures(side: Path) -> dict[str, int]:
    with sqlite3.connect(side) as conn:
        total, distinct = conn.execute(
            "SELECT count(*), count(DISTINCT workflow_id || '/' || step || '/' || attempt) FROM executions"
        ).fetchone()
    return {"activity_executions": total, "attempts_executed_again": total - distinct}


async def read_store(url: str) -> dict[str, list[aion.Event]]:
    async with aion.open_store(url) as store:
        return {wid: await store.events.read_history(wid) for wid in await store.events.list_workflow_ids()}


async def signal_targets(store: aion.Store, candidates: Sequence[int]) -> list[int]:
    """The signal workflows among ``candidates`` whose run has started (a signal needs a run)."""
    return [i for i in candidates if await store.events.read_history(workflow_id(i), 1)]


# --------------------------------------------------------------------------
# The sqlite soak: kills
# --------------------------------------------------------------------------


class Engine:
    """One engine subprocess and its output lines (read without blocking the driver)."""

    def __init__(self, command: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.log = log
        self.out = log.open("wb")
        self.popen = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=self.out)
        assert self.popen.stdout is not None
        os.set_blocking(self.popen.stdout.fileno(), False)
        self.buffer = b""

    def seen(self, marker: bytes) -> bool:
        assert self.popen.stdout is not None
        try:
            while chunk := self.popen.stdout.read(65536):
                self.buffer += chunk
        except BlockingIOError:
            pass
        return marker in self.buffer

    def kill(self) -> bool:
        """SIGKILL it (``False``: it had already exited) and read the rest of its output."""
        alive = self.popen.poll() is None
        if alive:
            os.kill(self.popen.pid, signal.SIGKILL)
        self.popen.wait()
        self.seen(b"")
        self.close()
        return alive

    def close(self) -> None:
        assert self.popen.stdout is not None
        self.popen.stdout.close()
        self.out.close()

    def tail(self) -> str:
        """The end of its stderr (the scratch directory is removed at the end)."""
        return self.log.read_text(errors="replace")[-3000:]


async def soak_sqlite(args: argparse.Namespace, directory: str) -> list[str]:
    rng = random.Random(args.seed)
    store_path, side = Path(directory, "soak.db"), Path(directory, "side.db")
    url = f"sqlite:///{store_path}"
    open_side(str(side)).close()
    signal_indices = [i for i in range(args.workflows) if kind_of(i) == "signal"]
    sent: dict[str, int] = {}
    figures: dict[str, Any] = {"store": "sqlite", "seed": args.seed, "workflows": args.workflows}
    kills = before_ready = finished_early = 0
    began = time.monotonic()

    def command(generation: int) -> list[str]:
        this = str(Path(__file__).resolve())
        options = [f"--url={url}", f"--side={side}", f"--generation={generation}"]
        return [sys.executable, this, "--engine-process", *options, f"--workflows={args.workflows}"]

    async def queue_signals(store: aion.Store) -> None:
        waiting = [i for i in signal_indices if workflow_id(i) not in sent]
        for index in await signal_targets(store, waiting):
            payload = aion.Payload.of(signal_payload(index))
            command_id = await store.enqueue_command(  # type: ignore[attr-defined]
                aion.SignalCommand(workflow_id=workflow_id(index), name=SIGNAL, payload=payload)
            )
            sent[workflow_id(index)] = 1
            commands.append(command_id)

    commands: list[int] = []
    async with aion.open_store(url) as store:
        for generation in range(args.kills + 1):
            final = generation == args.kills
            engine = Engine(command(generation), Path(directory, f"engine.{generation}.log"))
            if final:
                last_began = time.monotonic()
                deadline = last_began + args.patience
                while engine.popen.poll() is None and time.monotonic() < deadline:
                    await queue_signals(store)
                    await trio.sleep(0.05)
                if engine.kill():  # the checks below name what is unfinished
                    emit({"kind": "note", "what": f"the last engine was unfinished after {args.patience} s"})
                elif engine.popen.returncode != 0 or b"ALL DONE" not in engine.buffer:
                    return [f"the last engine exited {engine.popen.returncode}: {engine.tail()}"]
                figures["last_engine_seconds"] = round(time.monotonic() - last_began, 1)
                break
            # A kill during start-up and recovery, or while it works (after READY).
            early = rng.random() < 0.15
            delay = rng.uniform(0.0, 0.3) if early else rng.uniform(0.0, 0.4)
            if not early:
                ready_by = time.monotonic() + 60
                while not engine.seen(b"READY") and engine.popen.poll() is None:
                    if time.monotonic() > ready_by:
                        engine.kill()
                        return [f"engine generation {generation} never got ready: {engine.tail()}"]
                    await trio.sleep(0.005)
            kill_at = time.monotonic() + delay
            while time.monotonic() < kill_at:
                if not early:
                    await queue_signals(store)
                await trio.sleep(min(0.01, max(0.0, kill_at - time.monotonic())))
            if engine.kill():
                kills += 1
                before_ready += b"READY" not in engine.buffer
            else:
                finished_early += 1
                if engine.popen.returncode != 0:
                    return [
                        f"engine generation {generation} exited {engine.popen.returncode}: {engine.tail()}"
                    ]
        outcomes = [await store.command_outcome(c) for c in commands]  # type: ignore[attr-defined]
    problems = [
        f"signal command #{c}: {o}" for c, o in zip(commands, outcomes, strict=True) if o is None or not o.ok
    ]
    histories = await read_store(url)
    problems += check_histories(histories, args.workflows, sent)
    figures.update(
        kills=kills,
        kills_before_ready=before_ready,
        generations_that_finished_before_their_kill=finished_early,
        signals_queued=len(commands),
        histories=len(histories),
        events=sum(len(h) for h in histories.values()),
        seconds=round(time.monotonic() - began, 1),
        **executions_figures(side),
    )
    emit({"kind": "figures", **figures, "violations": len(problems)})
    return problems


# --------------------------------------------------------------------------
# The flaky soak: transient store faults instead of kills
# --------------------------------------------------------------------------


def arm_fault(flaky: Any, rng: random.Random) -> str:
    """Arm one transient fault of a random kind on the bundle; its name."""
    kind = rng.choice(["append", "commit_then_fail", "read", "timers", "visibility"])
    n = rng.randint(1, 3)
    if kind == "append":
        flaky.events.fail_appends_after(rng.randint(0, 5), n)
    elif kind == "commit_then_fail":
        flaky.events.commit_then_fail_appends_after(rng.randint(0, 5), n)
    elif kind == "read":
        flaky.events.fail_reads_after(rng.randint(0, 5), n)
    elif kind == "timers":
        flaky.events.fail_next("expired_timers", n)
    else:
        flaky.visibility.fail_next("upsert", n)
    return kind


async def soak_flaky(args: argparse.Namespace, directory: str) -> list[str]:
    from aion_trio.testing import FlakyStoreBundle

    global _side
    logging.getLogger("aion_trio").setLevel(logging.ERROR)  # the injected faults are logged as warnings
    rng = random.Random(args.seed)
    url, side = f"sqlite:///{directory}/soak.db", Path(directory, "side.db")
    _side = open_side(str(side))
    sent: dict[str, int] = {}
    armed: dict[str, int] = {}
    began = time.monotonic()
    config = aion.EngineConfig(inbox_poll_interval=0.05)
    try:
        async with aion.open_store(url) as store:
            flaky = FlakyStoreBundle(store)
            async with aion.open_engine(
                flaky, workflows=WORKFLOWS, activities=[step], config=config
            ) as engine:
                handles = []
                for i in range(args.workflows):
                    while True:  # a start refused by an injected fault is started again (it is idempotent)
                        try:
                            handles.append(await start_one(engine, i))
                            break
                        except aion.BackendUnavailable:
                            await trio.sleep(0.01)
                    if (
                        i % max(1, args.workflows // max(1, args.kills)) == 0
                        and sum(armed.values()) < args.kills
                    ):
                        kind = arm_fault(flaky, rng)
                        armed[kind] = armed.get(kind, 0) + 1

                async def faults() -> None:
                    while sum(armed.values()) < args.kills:
                        await trio.sleep(rng.uniform(0.0, 0.05))
                        kind = arm_fault(flaky, rng)
                        armed[kind] = armed.get(kind, 0) + 1

                async def signals() -> None:
                    waiting = {i for i in range(args.workflows) if kind_of(i) == "signal"}
                    while waiting:
                        for index in sorted(waiting):
                            wid = workflow_id(index)
                            try:
                                await engine.signal(wid, SIGNAL, signal_payload(index))
                            except aion.BackendUnavailable:
                                # Its commit may have landed: resend only if the history has none.
                                history = await store.events.read_history(wid)
                                if not any(isinstance(e.body, aion.SignalReceived) for e in history):
                                    continue
                            sent[wid] = 1
                            waiting.discard(index)
                        await trio.sleep(0.02)

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(faults)
                    nursery.start_soon(signals)
                    with trio.move_on_after(args.patience):  # the checks name whatever is unfinished
                        for handle in handles:
                            await handle.result()
                    nursery.cancel_scope.cancel()
                injected = {
                    op: n for op, n in {**flaky.events.faults, **flaky.visibility.faults}.items() if n
                }
                flaky.events.disarm()
                flaky.visibility.disarm()
        histories = await read_store(url)
    finally:
        _side.close()
        _side = None
    problems = check_histories(histories, args.workflows, sent)
    emit(
        {
            "kind": "figures",
            "store": "flaky",
            "seed": args.seed,
            "workflows": args.workflows,
            "faults_armed": armed,
            "faults_injected": injected,
            "signals_sent": len(sent),
            "histories": len(histories),
            "events": sum(len(h) for h in histories.values()),
            "seconds": round(time.monotonic() - began, 1),
            **executions_figures(side),
            "violations": len(problems),
        }
    )
    return problems


# --------------------------------------------------------------------------
# The PostgreSQL soak: two cluster nodes, one killed at random moments
# --------------------------------------------------------------------------


def pg_query(base: str, schema: str, text: str, params: Any = None) -> list[tuple[Any, ...]]:
    import psycopg

    with psycopg.connect(base, autocommit=True) as conn:
        conn.execute("SELECT set_config('search_path', %s, false)", (schema,))
        cur = conn.execute(text, params)
        return cur.fetchall() if cur.description else []


async def soak_postgres(args: argparse.Namespace, directory: str) -> list[str]:
    import psycopg
    from aion_trio_postgres import open_postgres_store
    from psycopg import sql

    sys.path.insert(0, str(NODE_DIR))
    import failover_app  # the failover tests' workload
    from _invariants import check_invariants  # and their SQL checker

    rng = random.Random(args.seed)
    base = args.pg_url
    schema = f"aion_soak_{uuid.uuid4().hex[:12]}"
    url = f"{base}?schema={schema}"
    nodes = ("n1", "n2")
    procs: dict[str, Engine] = {}
    began = time.monotonic()
    kills = 0

    def env(node: str) -> dict[str, str]:
        return {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(NODE_DIR), os.environ.get("PYTHONPATH", "")]),
            "AIONFO_SIDE_URL": f"{base}?application_name=aionfo-side",
            "AIONFO_SCHEMA": schema,
            "AIONFO_NODE": node,
        }

    def spawn(node: str, generation: int, start: str | None) -> Engine:
        command = [sys.executable, str(NODE_DIR / "failover_node.py"), "--url", base, "--schema", schema]
        command += ["--node", node, "--lease-ttl", "1.5", "--sweep-interval", "0.3", "--poll-interval", "0.3"]
        command += ["--timer", "0.3"] + (["--start", start] if start else [])
        os.environ.update(
            {k: v for k, v in env(node).items() if k.startswith("AIONFO_") or k == "PYTHONPATH"}
        )
        return Engine(command, Path(directory, f"{node}.{generation}.log"))

    # A node identity gives the store its command inbox; no engine runs on it, so it claims nothing.
    async with open_postgres_store(f"{url}&node=soak-driver") as store:  # migrates; queues the signals
        pg_query(base, schema, failover_app.SQL_CREATE_SIDE)
        try:
            for k, node in enumerate(nodes):
                procs[node] = spawn(node, 0, f"{k}:{args.workflows}:{len(nodes)}")
            # Kills begin once both started their share (a restarted node starts nothing).
            started_by = time.monotonic() + 120
            while not all(proc.seen(b"STARTED") for proc in procs.values()):
                if time.monotonic() > started_by or any(p.popen.poll() is not None for p in procs.values()):
                    return [
                        "the nodes did not start their workflows: "
                        + " | ".join(p.tail() for p in procs.values())
                    ]
                await trio.sleep(0.05)
            signalled: set[int] = set()
            commands: list[int] = []

            async def queue_signals() -> None:
                started = {wid for (wid,) in pg_query(base, schema, "SELECT workflow_id FROM workflows")}
                for index in range(args.workflows):
                    if index not in signalled and f"wf-{index}" in started:
                        payload = aion.Payload.of(failover_app.signal_payload(index))
                        commands.append(
                            await store.enqueue_command(
                                aion.SignalCommand(
                                    workflow_id=f"wf-{index}", name=failover_app.SIGNAL, payload=payload
                                )
                            )
                        )
                        signalled.add(index)

            for generation in range(1, args.kills + 1):
                victim = rng.choice(nodes)
                kill_at = time.monotonic() + rng.uniform(0.2, 1.5)
                while time.monotonic() < kill_at:
                    await queue_signals()
                    await trio.sleep(0.05)
                kills += procs[victim].kill()
                procs[victim] = spawn(victim, generation, None)  # under its node id: takes its workflows back
            deadline = time.monotonic() + 300
            while True:
                await queue_signals()
                done = pg_query(base, schema, "SELECT count(*) FROM workflows WHERE status = 'completed'")
                if done == [(args.workflows,)] or time.monotonic() > deadline:
                    break
                await trio.sleep(0.2)
        finally:
            for proc in procs.values():
                proc.kill()
    with psycopg.connect(base, autocommit=True) as conn:
        expected = {f"wf-{i}": failover_app.expected_result(i) for i in range(args.workflows)}
        violations = check_invariants(conn, schema, expected_results=expected)
        problems = [str(v) for v in violations]
        received = pg_query(
            base, schema, "SELECT workflow_id, count(*) FROM events WHERE type = 'SignalReceived' GROUP BY 1"
        )
        problems += [f"{wid}: {n} signals recorded, 1 sent" for wid, n in received if n != 1]
        executions = pg_query(base, schema, f"SELECT count(*) FROM {failover_app.SIDE_TABLE}")[0][0]
        events = pg_query(base, schema, "SELECT count(*) FROM events")[0][0]
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
    emit(
        {
            "kind": "figures",
            "store": "postgres",
            "nodes": len(nodes),
            "seed": args.seed,
            "workflows": args.workflows,
            "kills": kills,
            "signals_queued": len(commands),
            "events": events,
            "activity_executions": executions,
            "seconds": round(time.monotonic() - began, 1),
            "violations": len(problems),
        }
    )
    return problems


# --------------------------------------------------------------------------


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", choices=["sqlite", "flaky", "postgres"], default="sqlite")
    parser.add_argument("--kills", type=int, default=20, help="kills (flaky: faults armed); default 20")
    parser.add_argument("--seed", type=int, default=None, help="default: random (printed)")
    parser.add_argument("--workflows", type=int, help="default: 4 per kill, at least 20")
    parser.add_argument("--pg-url", default=os.environ.get("AION_TRIO_TEST_PG_URL") or DEFAULT_PG_URL)
    parser.add_argument("--patience", type=float, default=120, help="seconds the last engine may take")
    parser.add_argument("--dir", help="parent of the scratch directory (default: the system's)")
    parser.add_argument("--seconds", type=float, help="smoke run: at most about this many seconds of kills")
    # The engine subprocess of the sqlite soak:
    parser.add_argument("--engine-process", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--side", help=argparse.SUPPRESS)
    parser.add_argument("--generation", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.seconds is not None:
        args.kills = min(args.kills, max(1, math.ceil(args.seconds / 0.5)))
    if args.workflows is None:
        args.workflows = max(20, 4 * args.kills)
    if args.seed is None:
        args.seed = random.randrange(2**32)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    global _side, _generation
    args = parse(argv)
    if args.engine_process:
        _side, _generation = open_side(args.side), args.generation
        trio.run(engine_process, args.url, args.workflows)
        return 0
    soak = {"sqlite": soak_sqlite, "flaky": soak_flaky, "postgres": soak_postgres}[args.store]
    problems: list[str] = []

    def body(directory: str) -> None:
        problems.extend(trio.run(soak, args, directory))

    run_in_scratch("aion-soak-", args.dir, body, emit)
    for problem in problems[:30]:
        emit({"kind": "violation", "what": problem})
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
