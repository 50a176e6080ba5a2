"""Workflow throughput and single-workflow latency, aion_trio against DBOS Transact.

Usage::

    python bench/throughput.py [--workflows 1000] [--steps 10] [--concurrency 100]
                               [--latency-runs 200] [--latency-block 20]
                               [--dir DIR] [--skip-dbos]

Workload: ``--workflows`` runs of one workflow that awaits ``--steps`` trivial
async activities in sequence (each returns its input + 1), at most
``--concurrency`` runs in flight (start and result inside one limiter slot).

In one run, on one machine, one after another on fresh database files in a
fresh directory under ``--dir`` (default: the system temporary directory;
removed at the end):

1. throughput on aion_trio ``memory://``, SQLite ``synchronous=FULL`` (the
   durable default) and SQLite ``synchronous=NORMAL``;
2. the same workload on DBOS Transact (``@DBOS.workflow`` + ``@DBOS.step``
   async functions, ``asyncio.Semaphore``) with its SQLite system database,
   once as DBOS ships it (rollback journal, ``synchronous=FULL``) and once with
   the file switched to WAL beforehand (the journal mode aion_trio uses);
   each DBOS measurement runs in a subprocess (asyncio, and DBOS is a
   process-wide singleton), with ``--dbos-python`` (default: this interpreter);
3. latency of one run alone (p50/p99 over ``--latency-runs`` sequential runs
   after ``--warmup`` runs) on aion_trio SQLite FULL and on both DBOS setups,
   interleaved: the three take turns, ``--latency-block`` runs each (the DBOS
   processes stay up and idle between their turns), so that a drift of the
   machine's fsync latency or CPU speed during the minutes of measurement
   lands on every engine alike instead of on whichever happened to run last.

Prints one JSON line per result, with aion/DBOS ratios.  Targets (SQLite FULL):
steps/s >= 10x DBOS's; p50 latency <= 1/5 of DBOS's.  ``--seconds S`` caps
each measurement at S seconds (tox's ``bench`` env passes a tiny S as a smoke
run; the numbers are then meaningless).  Not part of the test run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from _common import emitter, percentile, run_in_scratch
from _dbos_chain import dbos_available, define_chain, run_chains, run_one

THROUGHPUT_TARGET = 10.0  # aion SQLite FULL steps/s over DBOS steps/s
LATENCY_TARGET = 0.2  # aion SQLite FULL p50 over DBOS p50
DBOS_JOURNALS = ("delete", "wal")


emit = emitter("throughput")


def latency_summary(samples: list[float]) -> dict[str, Any]:
    ordered = sorted(samples)
    return {
        "runs": len(ordered),
        "p50_ms": round(percentile(ordered, 0.50) * 1000, 3),
        "p99_ms": round(percentile(ordered, 0.99) * 1000, 3),
        "mean_ms": round(sum(ordered) / len(ordered) * 1000, 3),
    }


def throughput_summary(done: int, steps: int, elapsed: float) -> dict[str, Any]:
    return {
        "completed": done,
        "seconds": round(elapsed, 3),
        "workflows_per_s": round(done / elapsed, 1),
        "steps_per_s": round(done * steps / elapsed, 1),
    }


# --------------------------------------------------------------------------
# aion_trio (imported lazily: the DBOS subprocess never loads it)
# --------------------------------------------------------------------------


def aion_definitions() -> tuple[Any, Any]:
    """The workflow and its activity: ``chain(steps)`` awaits ``increment`` ``steps`` times."""
    import aion_trio as aion

    @aion.activity(name="increment")
    async def increment(x: int) -> int:
        return x + 1

    @aion.workflow(name="chain")
    async def chain(ctx: aion.WorkflowContext, steps: int) -> int:
        value = 0
        for _ in range(steps):
            value = await ctx.run(increment, value)
        return int(value)

    return chain, increment


async def aion_throughput(url: str, workflows: int, steps: int, concurrency: int, cap: float | None) -> Any:
    import trio

    import aion_trio as aion

    chain, increment = aion_definitions()
    limiter = trio.CapacityLimiter(concurrency)
    done = 0
    async with aion.open_engine(url, workflows=[chain], activities=[increment]) as engine:

        async def one(i: int, deadline: float) -> None:
            nonlocal done
            async with limiter:
                if time.perf_counter() >= deadline:
                    return
                run = await engine.start(chain, steps, workflow_id=f"wf-{i}")
                result = await run.result()
                if result != steps:
                    raise RuntimeError(f"workflow wf-{i} returned {result!r}, expected {steps}")
                done += 1

        start = time.perf_counter()
        deadline = math.inf if cap is None else start + cap
        async with trio.open_nursery() as nursery:
            for i in range(workflows):
                nursery.start_soon(one, i, deadline)
        elapsed = time.perf_counter() - start
    return throughput_summary(done, steps, elapsed)


class AionLatency:
    """One aion_trio engine on a fresh SQLite FULL file, timing single runs in blocks."""

    def __init__(self, url: str, steps: int) -> None:
        self.url = url
        self.steps = steps
        self.samples: list[float] = []
        self._runs = 0

    async def serve(self, warmup: int, task_status: Any) -> None:
        """Open the engine, run the warm-up, then serve blocks until cancelled."""
        import trio

        import aion_trio as aion

        chain, increment = aion_definitions()
        async with aion.open_engine(self.url, workflows=[chain], activities=[increment]) as engine:
            self._engine, self._chain = engine, chain
            for _ in range(warmup):
                await self._one()
            task_status.started()
            await trio.sleep_forever()

    async def _one(self) -> float:
        self._runs += 1
        start = time.perf_counter()
        run = await self._engine.start(self._chain, self.steps, workflow_id=f"lat-{self._runs}")
        if await run.result() != self.steps:
            raise RuntimeError(f"workflow lat-{self._runs} returned a wrong result")
        return time.perf_counter() - start

    async def block(self, runs: int) -> None:
        for _ in range(runs):
            self.samples.append(await self._one())


class DbosLatency:
    """A DBOS latency subprocess (``--dbos-worker latency``) that times blocks on request."""

    def __init__(self, command: list[str], journal: str) -> None:
        self.command = command
        self.journal = journal
        self.samples: list[float] = []
        self.info: dict[str, Any] = {}
        self._buffer = b""

    async def _line(self) -> dict[str, Any]:
        while b"\n" not in self._buffer:
            chunk = await self._proc.stdout.receive_some()
            if not chunk:
                raise RuntimeError(f"DBOS latency worker ({self.journal}) exited early")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return dict(json.loads(line))

    async def serve(self, warmup: int, task_status: Any) -> None:
        import trio

        proc = await trio.lowlevel.open_process(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._proc = proc
        try:
            await self._line()  # {"ready": true}: launched and warmed up
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                with trio.CancelScope(shield=True):
                    await proc.stdin.send_all(b"end\n")
                    self.info = await self._line()
                    await proc.wait()
        finally:
            with trio.CancelScope(shield=True):
                if proc.returncode is None:
                    proc.kill()
                await proc.wait()
                await proc.stdin.aclose()
                await proc.stdout.aclose()
        if proc.returncode != 0:
            raise RuntimeError(f"DBOS latency worker ({self.journal}) failed with exit {proc.returncode}")

    async def block(self, runs: int) -> None:
        await self._proc.stdin.send_all(b"%d\n" % runs)
        self.samples.extend((await self._line())["samples"])


async def interleaved_latency(
    aion_url: str, dbos: list[DbosLatency], runs: int, warmup: int, steps: int, block: int, cap: float | None
) -> tuple[AionLatency, list[DbosLatency]]:
    """Time ``runs`` single runs of aion_trio and of each DBOS setup, in blocks of ``block``
    runs taken in turn (the order rotating every round), so that every engine is timed
    across the same stretch of the machine's life: a drift in fsync latency or CPU speed
    during the measurement lands on all of them alike, not on whichever ran last."""
    import trio

    aion_side = AionLatency(aion_url, steps)
    sides: list[Any] = [aion_side, *dbos]
    deadline = math.inf if cap is None else time.perf_counter() + cap
    async with trio.open_nursery() as nursery:
        for side in sides:
            await nursery.start(side.serve, warmup)
        done = 0
        turn = 0
        while done < runs:
            n = min(block, runs - done)
            order = sides[turn % len(sides) :] + sides[: turn % len(sides)]
            for side in order:
                await side.block(n)
            done += n
            turn += 1
            if time.perf_counter() >= deadline:
                break
        nursery.cancel_scope.cancel()
    return aion_side, dbos


# --------------------------------------------------------------------------
# DBOS Transact (runs in a subprocess: ``--dbos-worker MODE``)
# --------------------------------------------------------------------------


def dbos_worker(args: argparse.Namespace) -> int:
    """Run one DBOS measurement on a fresh SQLite file; print one JSON object."""
    import asyncio
    import importlib.metadata
    import logging

    from dbos import DBOS

    path = os.path.join(args.dir, f"dbos-{args.dbos_worker}-{args.dbos_journal}.db")
    if args.dbos_journal == "wal":
        # journal_mode=WAL is stored in the file, so DBOS's own connections inherit it.
        conn = sqlite3.connect(path)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.close()

    chain_workflow = define_chain()

    async def throughput() -> dict[str, Any]:
        done, elapsed = await run_chains(
            chain_workflow, args.workflows, args.steps, args.concurrency, args.seconds
        )
        return throughput_summary(done, args.steps, elapsed)

    async def latency() -> dict[str, Any]:
        # Served in blocks: one line "N" on stdin times N runs and answers their
        # samples; "end" (or end of input) stops.  The asyncio loop is idle while
        # it waits for the next line (the aion_trio side is being timed then).
        for _ in range(args.warmup):
            await run_one(chain_workflow, args.steps)
        print(json.dumps({"ready": True}), flush=True)
        while True:
            line = sys.stdin.readline().strip()
            if not line or line == "end":
                return {}
            samples: list[float] = []
            for _ in range(int(line)):
                start = time.perf_counter()
                await run_one(chain_workflow, args.steps)
                samples.append(time.perf_counter() - start)
            print(json.dumps({"samples": samples}), flush=True)

    DBOS(
        config={
            "name": "aion-bench",
            "system_database_url": f"sqlite:///{path}",
            "log_level": "WARNING",
        }
    )
    try:
        DBOS.launch()
        result = asyncio.run(throughput() if args.dbos_worker == "throughput" else latency())
    finally:
        DBOS.destroy()
    logging.shutdown()
    conn = sqlite3.connect(path)
    journal = conn.execute("PRAGMA journal_mode").fetchone()[0]
    conn.close()
    result.update(
        dbos=importlib.metadata.version("dbos"),
        sqlite=sqlite3.sqlite_version,
        journal_mode=journal,
        synchronous="FULL",  # DBOS sets none; FULL is SQLite's default
    )
    print(json.dumps(result), flush=True)
    return 0


def dbos_command(args: argparse.Namespace, directory: str, mode: str, journal: str) -> list[str]:
    command = [
        args.dbos_python,
        os.path.abspath(__file__),
        "--dbos-worker",
        mode,
        "--dbos-journal",
        journal,
        "--dir",
        directory,
        "--workflows",
        str(args.workflows),
        "--steps",
        str(args.steps),
        "--concurrency",
        str(args.concurrency),
        "--warmup",
        str(args.warmup),
    ]
    if args.seconds is not None:
        command += ["--seconds", str(args.seconds)]
    return command


def run_dbos(args: argparse.Namespace, directory: str, mode: str, journal: str) -> dict[str, Any]:
    command = dbos_command(args, directory, mode, journal)
    proc = subprocess.run(command, capture_output=True, text=True, check=False, timeout=600)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        raise RuntimeError(f"DBOS {mode} ({journal}) failed with exit {proc.returncode}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


# --------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------

AION_STORES: tuple[tuple[str, Callable[[str], str]], ...] = (
    ("memory", lambda d: "memory://"),
    ("sqlite-full", lambda d: "sqlite:///" + os.path.join(d, "x.db")),
    ("sqlite-normal", lambda d: "sqlite:///" + os.path.join(d, "y.db") + "?synchronous=NORMAL"),
)


def fresh(directory: str, name: str) -> str:
    path = os.path.join(directory, name)
    os.makedirs(path)
    return path


def run_all(args: argparse.Namespace, directory: str) -> None:
    import apsw
    import trio

    import aion_trio as aion

    workload = {"workflows": args.workflows, "steps": args.steps, "concurrency": args.concurrency}
    emit(
        {
            "kind": "environment",
            "python": platform.python_version(),
            "aion_trio": aion.__version__,
            "trio": trio.__version__,
            "sqlite_aion": apsw.sqlite_lib_version(),
            "cpus": os.cpu_count(),
            "dir": directory,
            "seconds_cap": args.seconds,
            "loadavg_1m": round(os.getloadavg()[0], 2),
            **workload,
        }
    )
    skip_reason = "--skip-dbos" if args.skip_dbos else dbos_available(args.dbos_python)
    if skip_reason is not None:
        emit({"kind": "skipped", "engine": "dbos", "reason": skip_reason})

    # 1. aion_trio throughput, each store on a fresh file.
    aion_tp: dict[str, dict[str, Any]] = {}
    for store, url_for in AION_STORES:
        url = url_for(fresh(directory, f"aion-tp-{store}"))
        result = trio.run(aion_throughput, url, args.workflows, args.steps, args.concurrency, args.seconds)
        aion_tp[store] = result
        emit({"kind": "throughput", "engine": "aion_trio", "store": store, **workload, **result})

    # 2. DBOS throughput, then the ratios.
    dbos_tp: dict[str, dict[str, Any]] = {}
    if skip_reason is None:
        for journal in DBOS_JOURNALS:
            result = run_dbos(args, fresh(directory, f"dbos-tp-{journal}"), "throughput", journal)
            dbos_tp[journal] = result
            emit({"kind": "throughput", "engine": "dbos", "store": f"sqlite-{journal}", **workload, **result})
        for store in aion_tp:
            for journal, peer in dbos_tp.items():
                record: dict[str, Any] = {
                    "kind": "throughput_ratio",
                    "aion_store": store,
                    "dbos_store": f"sqlite-{journal}",
                    "workflows_ratio": round(aion_tp[store]["workflows_per_s"] / peer["workflows_per_s"], 2),
                    "steps_ratio": round(aion_tp[store]["steps_per_s"] / peer["steps_per_s"], 2),
                }
                if store == "sqlite-full":
                    record["target"] = f"steps_ratio >= {THROUGHPUT_TARGET:g}"
                    record["target_met"] = record["steps_ratio"] >= THROUGHPUT_TARGET
                emit(record)

    # 3. Latency of one run alone, aion_trio and DBOS timed in interleaved blocks.
    url = AION_STORES[1][1](fresh(directory, "aion-latency"))
    peers = []
    if skip_reason is None:
        peers = [
            DbosLatency(dbos_command(args, fresh(directory, f"dbos-lat-{j}"), "latency", j), j)
            for j in DBOS_JOURNALS
        ]
    aion_side, peers = trio.run(
        interleaved_latency,
        url,
        peers,
        args.latency_runs,
        args.warmup,
        args.steps,
        args.latency_block,
        args.seconds,
    )
    method = {"steps": args.steps, "warmup": args.warmup, "interleaved_block": args.latency_block}
    aion_lat = latency_summary(aion_side.samples)
    emit({"kind": "latency", "engine": "aion_trio", "store": "sqlite-full", **method, **aion_lat})
    for peer in peers:
        peer_lat = latency_summary(peer.samples)
        emit(
            {
                "kind": "latency",
                "engine": "dbos",
                "store": f"sqlite-{peer.journal}",
                **method,
                **peer_lat,
                **peer.info,
            }
        )
        ratio = aion_lat["p50_ms"] / peer_lat["p50_ms"]
        emit(
            {
                "kind": "latency_ratio",
                "aion_store": "sqlite-full",
                "dbos_store": f"sqlite-{peer.journal}",
                "p50_aion_over_dbos": round(ratio, 3),
                "p99_aion_over_dbos": round(aion_lat["p99_ms"] / peer_lat["p99_ms"], 3),
                "p50_speedup": round(1 / ratio, 2),
                "target": f"p50_aion_over_dbos <= {LATENCY_TARGET:g}",
                "target_met": ratio <= LATENCY_TARGET,
            }
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--workflows", type=int, default=1000, help="workflow runs per throughput measurement"
    )
    parser.add_argument("--steps", type=int, default=10, help="sequential activity steps per workflow")
    parser.add_argument("--concurrency", type=int, default=100, help="runs in flight at most")
    parser.add_argument("--latency-runs", type=int, default=200, help="sequential runs timed for latency")
    parser.add_argument("--warmup", type=int, default=20, help="untimed runs before the latency runs")
    parser.add_argument(
        "--latency-block",
        type=int,
        default=20,
        help="latency runs per turn: aion_trio and each DBOS setup take turns, this many runs each",
    )
    parser.add_argument("--dir", help="where the fresh temporary directory goes (default: system temp)")
    parser.add_argument("--skip-dbos", action="store_true", help="measure aion_trio only")
    parser.add_argument("--dbos-python", default=sys.executable, help="interpreter for the DBOS subprocesses")
    parser.add_argument("--seconds", type=float, help="cap each measurement at this many seconds (smoke run)")
    parser.add_argument("--dbos-worker", choices=("throughput", "latency"), help=argparse.SUPPRESS)
    parser.add_argument("--dbos-journal", choices=DBOS_JOURNALS, default="delete", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("workflows", "steps", "concurrency", "latency_runs", "latency_block"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.dbos_worker is not None:
        return dbos_worker(args)
    run_in_scratch("aion-bench-throughput-", args.dir, lambda directory: run_all(args, directory), emit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
