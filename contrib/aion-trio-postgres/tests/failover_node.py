"""One engine node of the failover tests and ``bench/pg_cluster.py``: a process to SIGKILL.

Usage::

    python failover_node.py --url URL --schema S --node N [--lease-ttl T] [--sweep-interval S]
        [--poll-interval P] [--start first:stop:step] [--timer SECONDS] [--remote]
        [--nap first:stop:step --nap-until UNIX_TIME]
        [--chain first:stop:step --steps K --concurrency C [--cap SECONDS]]
        [--spans first:stop:step --steps K]

Opens an engine in cluster mode on ``URL?schema=S&node=N&lease_ttl=T`` (the
libpq ``application_name`` is ``aionfo-N``, so a test can find this node's
connections in ``pg_stat_activity``), with the workload of
:mod:`failover_app`.  ``--remote``: task queue ``remote`` goes to the
``--activities-only`` workers through the PostgreSQL task dispatcher.

Prints ``READY <pid>`` once the engine is open, ``STARTED <n>`` after starting
``flow`` workflows ``wf-<i>`` for ``i`` in ``range(first, stop, step)`` (only
when ``--start`` is given: a restarted node starts nothing), ``NAPPING``
after starting ``nap`` workflows ``nap-<i>`` (``--nap``), ``SPANNING``
after starting ``spans`` workflows ``s-<i>`` of ``--steps`` steps, and one
``RELINQUISHED <workflow_id> <unix time> <reason>`` line each time this node
stopped a workflow another node claimed (a fenced append, or found on
rejoining after its lease lapsed).  Runs until SIGTERM or
SIGINT, then closes the engine and prints ``STOPPED``.

``--chain`` (throughput mode): after ``READY``, waits for a line on stdin,
runs ``chain`` workflows ``c-<i>`` (``--concurrency`` in flight), prints
``CHAIN {json}`` (completed, seconds) and exits.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from typing import Any

import failover_app
import trio
from aion_trio_postgres import open_postgres_store, open_task_dispatcher

import aion_trio as aion


def _range(text: str) -> range:
    first, stop, step = (int(x) for x in text.split(":"))
    return range(first, stop, step)


def _observer(event: object) -> None:
    if isinstance(event, aion.WorkflowRelinquished):
        print(f"RELINQUISHED {event.workflow_id} {time.time():.3f} {event.reason}", flush=True)


async def _run_chains(
    engine: aion.Engine, indices: range, steps: int, concurrency: int, cap: float | None
) -> None:
    await trio.to_thread.run_sync(sys.stdin.readline)
    limiter = trio.CapacityLimiter(concurrency)
    done = 0
    deadline = time.perf_counter() + cap if cap is not None else float("inf")

    async def one(i: int) -> None:
        nonlocal done
        async with limiter:
            if time.perf_counter() >= deadline:
                return
            run = await engine.start(failover_app.chain, steps, workflow_id=f"c-{i}")
            if await run.result() != steps:
                raise RuntimeError(f"c-{i} returned a wrong result")
            done += 1

    began = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in indices:
            nursery.start_soon(one, i)
    print("CHAIN " + json.dumps({"completed": done, "seconds": time.perf_counter() - began}), flush=True)


async def main(args: argparse.Namespace) -> None:
    url = (
        f"{args.url}?schema={args.schema}&node={args.node}&lease_ttl={args.lease_ttl}"
        f"&poll_interval={args.poll_interval}&application_name=aionfo-{args.node}"
    )
    config = aion.EngineConfig(sweep_interval=args.sweep_interval)
    async with (
        open_postgres_store(url) as store,
        open_task_dispatcher(store, queues=[failover_app.REMOTE_QUEUE] if args.remote else []) as dispatcher,
        aion.open_engine(
            store,
            workflows=failover_app.app.workflows,
            activities=failover_app.app.activities,
            config=config,
            dispatcher=dispatcher,
            observers=[_observer],
        ) as engine,
    ):
        print(f"READY {os.getpid()}", flush=True)
        if args.chain is not None:
            await _run_chains(engine, _range(args.chain), args.steps, args.concurrency, args.cap)
            return
        if args.start is not None:
            started = 0
            queue = failover_app.REMOTE_QUEUE if args.remote else "default"
            for i in _range(args.start):
                await engine.start(
                    failover_app.flow,
                    i,
                    queue if i % 2 == 0 else "default",
                    args.timer,
                    workflow_id=f"wf-{i}",
                )
                started += 1
            print(f"STARTED {started}", flush=True)
        if args.nap is not None:
            for i in _range(args.nap):
                await engine.start(failover_app.nap, args.nap_until, workflow_id=f"nap-{i}")
            print("NAPPING", flush=True)
        if args.spans is not None:
            for i in _range(args.spans):
                await engine.start(failover_app.spans, args.steps, workflow_id=f"s-{i}")
            print("SPANNING", flush=True)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                break
    print("STOPPED", flush=True)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="libpq URL without query (postgresql://...)")
    parser.add_argument("--schema", required=True)
    parser.add_argument("--node", required=True)
    parser.add_argument("--lease-ttl", type=float, default=1.5)
    parser.add_argument("--sweep-interval", type=float, default=0.5)
    parser.add_argument("--poll-interval", type=float, default=0.3)
    parser.add_argument("--start", help="first:stop:step of the flow workflows this node starts")
    parser.add_argument("--nap", help="first:stop:step of the nap workflows this node starts")
    parser.add_argument("--nap-until", type=float, default=0.0, help="Unix time the nap timers come due")
    parser.add_argument("--timer", type=float, default=1.5, help="durable timer seconds (flow)")
    parser.add_argument("--remote", action="store_true", help="even-numbered flows run step 1 remotely")
    parser.add_argument("--chain", help="first:stop:step of the chain workflows (throughput mode)")
    parser.add_argument("--spans", help="first:stop:step of the spans workflows this node starts")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--concurrency", type=int, default=100)
    parser.add_argument("--cap", type=float, help="chain mode: start no workflow after this many seconds")
    return parser.parse_args(argv)


def run(argv: list[str]) -> Any:
    args = parse(argv)
    os.environ.setdefault("AIONFO_NODE", args.node)
    trio.run(main, args)


if __name__ == "__main__":
    run(sys.argv[1:])
