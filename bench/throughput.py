"""Workflow throughput and single-workflow latency, aion_trio against DBOS Transact.

Usage::

    python bench/throughput.py [--workflows 1000] [--steps 10] [--concurrency 100]
                               [--latency-runs 200] [--latency-block 20]
                               [--dir DIR] [--skip-dbos]

Workload: ``--workflows`` runs of one workflow that awaits ``--steps`` trivial
async activities in sequence (each returns its input + 1), at most
``--concurrency`` runs in flight (start and result inside one limiter slot).

In one run, on one machine, on fresh database files in a fresh directory
under ``--dir`` (default: the system temporary directory; removed at the end):

1. throughput on aion_trio ``memory://``, SQLite ``synchronous=FULL`` (the
   durable default) and SQLite ``synchronous=NORMAL``, and the same workload
   on DBOS Transact (``@DBOS.workflow`` + ``@DBOS.step`` async functions,
   ``asyncio.Semaphore``) with its SQLite system database, once as DBOS ships
   it (rollback journal, ``synchronous=FULL``) and once with the file switched
   to WAL beforehand (the journal mode aion_trio uses); each DBOS setup runs
   in a subprocess (asyncio, and DBOS is a process-wide singleton), with
   ``--dbos-python`` (default: this interpreter);
2. latency of one run alone (p50/p99 over ``--latency-runs`` sequential runs
   after ``--warmup`` runs) on aion_trio SQLite FULL and on both DBOS setups.

Both are interleaved: every engine stays up (the DBOS processes idle between
their turns) and they take turns, ``--throughput-block`` workflows (250) or
``--latency-block`` runs (20) each, the order rotating every round, until
each has done ``--workflows`` or ``--latency-runs``.  On a shared VM the
CPU speed and the fsync latency drift by tens of percent over minutes, and
aion_trio's throughput follows the CPU while DBOS's follows fsync: timed one
after the other, the engines met different machines and the ratio moved with
the drift.  Throughput is completed runs over the summed time of a side's
blocks (each block starts with an empty pipeline and drains to empty).

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


class AionSide:
    """One aion_trio engine on ``url``, kept open while it serves blocks of work on request."""

    def __init__(self, label: str, url: str, steps: int) -> None:
        self.label = label
        self.url = url
        self.steps = steps
        self._runs = 0

    async def serve(self, warmup: int, task_status: Any) -> None:
        """Open the engine, run ``warmup`` untimed runs, then serve blocks until cancelled."""
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
        run = await self._engine.start(self._chain, self.steps, workflow_id=f"wf-{self._runs}")
        if await run.result() != self.steps:
            raise RuntimeError(f"workflow wf-{self._runs} of {self.label} returned a wrong result")
        return time.perf_counter() - start


class AionLatency(AionSide):
    """Single runs one after another: each block adds ``n`` samples."""

    def __init__(self, label: str, url: str, steps: int) -> None:
        super().__init__(label, url, steps)
        self.samples: list[float] = []

    async def block(self, runs: int) -> None:
        for _ in range(runs):
            self.samples.append(await self._one())


class AionThroughput(AionSide):
    """Each block runs ``n`` workflows, at most ``concurrency`` in flight, none started after
    ``cap`` seconds from the block's start (``None``: no cap); adds up completed runs and time."""

    def __init__(self, label: str, url: str, steps: int, concurrency: int, cap: float | None) -> None:
        super().__init__(label, url, steps)
        self.concurrency = concurrency
        self.cap = cap
        self.done = 0
        self.seconds = 0.0

    async def block(self, workflows: int) -> None:
        import trio

        limiter = trio.CapacityLimiter(self.concurrency)
        start = time.perf_counter()
        deadline = math.inf if self.cap is None else start + self.cap

        async def one() -> None:
            async with limiter:
                if time.perf_counter() < deadline:
                    await self._one()
                    self.done += 1

        async with trio.open_nursery() as nursery:
            for _ in range(workflows):
                nursery.start_soon(one)
        self.seconds += time.perf_counter() - start


class DbosSide:
    """A DBOS subprocess (``--dbos-worker MODE``) kept running, idle between the blocks
    it serves on request: one line ``N`` on its stdin, one JSON line back."""

    def __init__(self, label: str, command: list[str], journal: str) -> None:
        self.label = label
        self.command = command
        self.journal = journal
        self.info: dict[str, Any] = {}
        self._buffer = b""

    async def _line(self) -> dict[str, Any]:
        while b"\n" not in self._buffer:
            chunk = await self._proc.stdout.receive_some()
            if not chunk:
                raise RuntimeError(f"DBOS worker {self.label} exited early")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return dict(json.loads(line))

    async def serve(self, warmup: int, task_status: Any) -> None:
        import trio

        proc = await trio.lowlevel.open_process(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._proc = proc
        try:
            await self._line()  # {"ready": true}: launched (and warmed up)
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
            raise RuntimeError(f"DBOS worker {self.label} failed with exit {proc.returncode}")

    async def request(self, n: int) -> dict[str, Any]:
        await self._proc.stdin.send_all(b"%d\n" % n)
        return await self._line()


class DbosLatency(DbosSide):
    def __init__(self, label: str, command: list[str], journal: str) -> None:
        super().__init__(label, command, journal)
        self.samples: list[float] = []

    async def block(self, runs: int) -> None:
        self.samples.extend((await self.request(runs))["samples"])


class DbosThroughput(DbosSide):
    def __init__(self, label: str, command: list[str], journal: str) -> None:
        super().__init__(label, command, journal)
        self.done = 0
        self.seconds = 0.0

    async def block(self, workflows: int) -> None:
        reply = await self.request(workflows)
        self.done += int(reply["done"])
        self.seconds += float(reply["seconds"])


async def interleave(sides: list[Any], total: int, block: int, warmup: int, cap: float | None) -> None:
    """Give every side ``total`` units of work in blocks of ``block``, the sides taking turns
    (the order rotating every round), so that every engine is measured across the same
    stretch of the machine's life: a drift of fsync latency or CPU speed during the
    minutes of measurement lands on all of them alike, not on whichever ran last.
    ``cap``: no new round after that many seconds (a smoke run)."""
    import trio

    deadline = math.inf if cap is None else time.perf_counter() + cap
    async with trio.open_nursery() as nursery:
        for side in sides:
            await nursery.start(side.serve, warmup)
        done = 0
        turn = 0
        while done < total:
            n = min(block, total - done)
            order = sides[turn % len(sides) :] + sides[: turn % len(sides)]
            for side in order:
                await side.block(n)
            done += n
            turn += 1
            if time.perf_counter() >= deadline:
                break
        nursery.cancel_scope.cancel()


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
        # Served in blocks: one line "N" on stdin runs N workflows (at most
        # --concurrency in flight) and answers how many completed in how long.
        print(json.dumps({"ready": True}), flush=True)
        while True:
            line = sys.stdin.readline().strip()
            if not line or line == "end":
                return {}
            done, elapsed = await run_chains(
                chain_workflow, int(line), args.steps, args.concurrency, args.seconds
            )
            print(json.dumps({"done": done, "seconds": elapsed}), flush=True)

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

    # 1. Throughput: the three aion_trio stores and the two DBOS setups, each on a
    #    fresh file, interleaved in blocks of --throughput-block workflows.
    tp_sides: list[Any] = [
        AionThroughput(
            store, url_for(fresh(directory, f"aion-tp-{store}")), args.steps, args.concurrency, args.seconds
        )
        for store, url_for in AION_STORES
    ]
    if skip_reason is None:
        tp_sides += [
            DbosThroughput(
                f"sqlite-{j}", dbos_command(args, fresh(directory, f"dbos-tp-{j}"), "throughput", j), j
            )
            for j in DBOS_JOURNALS
        ]
    trio.run(interleave, tp_sides, args.workflows, args.throughput_block, 0, args.seconds)
    tp: dict[str, dict[str, Any]] = {}
    for side in tp_sides:
        result = throughput_summary(side.done, args.steps, side.seconds)
        engine = "aion_trio" if isinstance(side, AionThroughput) else "dbos"
        tp[f"{engine}:{side.label}"] = result
        method = {"interleaved_block": args.throughput_block}
        emit(
            {
                "kind": "throughput",
                "engine": engine,
                "store": side.label,
                **workload,
                **method,
                **result,
                **getattr(side, "info", {}),
            }
        )
    for store, _ in AION_STORES:
        for journal in DBOS_JOURNALS if skip_reason is None else ():
            mine, peer = tp[f"aion_trio:{store}"], tp[f"dbos:sqlite-{journal}"]
            record: dict[str, Any] = {
                "kind": "throughput_ratio",
                "aion_store": store,
                "dbos_store": f"sqlite-{journal}",
                "workflows_ratio": round(mine["workflows_per_s"] / peer["workflows_per_s"], 2),
                "steps_ratio": round(mine["steps_per_s"] / peer["steps_per_s"], 2),
            }
            if store == "sqlite-full":
                record["target"] = f"steps_ratio >= {THROUGHPUT_TARGET:g}"
                record["target_met"] = record["steps_ratio"] >= THROUGHPUT_TARGET
            emit(record)

    # 2. Latency of one run alone, aion_trio SQLite FULL and both DBOS setups, interleaved
    #    in blocks of --latency-block runs.
    aion_lat = AionLatency("sqlite-full", AION_STORES[1][1](fresh(directory, "aion-latency")), args.steps)
    lat_sides: list[Any] = [aion_lat]
    if skip_reason is None:
        lat_sides += [
            DbosLatency(f"sqlite-{j}", dbos_command(args, fresh(directory, f"dbos-lat-{j}"), "latency", j), j)
            for j in DBOS_JOURNALS
        ]
    trio.run(interleave, lat_sides, args.latency_runs, args.latency_block, args.warmup, args.seconds)
    method = {"steps": args.steps, "warmup": args.warmup, "interleaved_block": args.latency_block}
    mine_lat = latency_summary(aion_lat.samples)
    emit({"kind": "latency", "engine": "aion_trio", "store": "sqlite-full", **method, **mine_lat})
    for peer in lat_sides[1:]:
        peer_lat = latency_summary(peer.samples)
        emit({"kind": "latency", "engine": "dbos", "store": peer.label, **method, **peer_lat, **peer.info})
        ratio = mine_lat["p50_ms"] / peer_lat["p50_ms"]
        emit(
            {
                "kind": "latency_ratio",
                "aion_store": "sqlite-full",
                "dbos_store": peer.label,
                "p50_aion_over_dbos": round(ratio, 3),
                "p99_aion_over_dbos": round(mine_lat["p99_ms"] / peer_lat["p99_ms"], 3),
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
        "--throughput-block",
        type=int,
        default=250,
        help="throughput workflows per turn: every aion_trio store and DBOS setup takes turns, this many each",
    )
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
    for name in ("workflows", "steps", "concurrency", "latency_runs", "latency_block", "throughput_block"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.dbos_worker is not None:
        return dbos_worker(args)
    run_in_scratch("aion-bench-throughput-", args.dir, lambda directory: run_all(args, directory), emit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
