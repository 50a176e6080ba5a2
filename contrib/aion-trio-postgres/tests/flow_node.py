"""One engine node of ``test_pg_flow.py``: a process to SIGKILL.

Usage::

    python flow_node.py --url URL --schema S --node N --start first:stop [--limit L]

Opens an engine in cluster mode on ``URL?schema=S&node=N`` whose activity
``limited`` is bound by ``FlowLimit(cluster_concurrency=L)`` across every
node.  Each attempt writes its start and its end (the database clock) into
the side table ``flow_side`` under this node's name, so the test can count
the attempts that ran at once.  Starts workflows ``fan-<i>`` for ``i`` in
``range(first, stop)`` (each runs ``FAN`` attempts of ``limited`` at once),
prints ``READY`` then ``STARTED``, and runs until SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading

import psycopg
import trio
from aion_trio_postgres import open_postgres_store

import aion_trio as aion

FAN = 4
HOLD = 0.3
SQL_CREATE_SIDE = (
    "CREATE TABLE flow_side (id bigserial PRIMARY KEY, node text NOT NULL, attempt text NOT NULL,"
    " began timestamptz NOT NULL DEFAULT clock_timestamp(), ended timestamptz)"
)


_threads = threading.local()


def side(sql: str, params: tuple[object, ...]) -> int:
    """Run ``sql`` on the side tables (this node's schema); the first column of its row (0: none).

    Called in worker threads: each keeps one connection (a new one per call forks a
    server process, which a loaded machine feels)."""
    conn = getattr(_threads, "conn", None)
    if conn is None:
        conn = _threads.conn = psycopg.connect(os.environ["FLOW_SIDE_URL"], autocommit=True)
        conn.execute("SELECT set_config('search_path', %s, false)", (os.environ["FLOW_SCHEMA"],))
    row = conn.execute(sql, params).fetchone()
    return 0 if row is None else int(row[0])


@aion.activity
async def limited(tag: str) -> str:
    info = aion.activity_info()
    name = f"{info.workflow_id}/{info.activity_id}/{info.attempt}"
    row = await trio.to_thread.run_sync(
        side,
        "INSERT INTO flow_side (node, attempt) VALUES (%s, %s) RETURNING id",
        (os.environ["FLOW_NODE"], name),
    )
    await trio.sleep(HOLD)
    await trio.to_thread.run_sync(
        side, "UPDATE flow_side SET ended = clock_timestamp() WHERE id = %s RETURNING id", (row,)
    )
    return tag


@aion.workflow
async def fan(ctx: aion.WorkflowContext, n: int) -> list[str]:
    handles = [ctx.start(limited, f"{ctx.workflow_id}-{i}") for i in range(n)]
    return [await h for h in handles]


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--schema", required=True)
    parser.add_argument("--node", required=True)
    parser.add_argument("--start", default="")
    parser.add_argument("--limit", type=int, default=5)
    args = parser.parse_args()
    config = aion.EngineConfig(
        activity_limits={"limited": aion.FlowLimit(cluster_concurrency=args.limit)},
        sweep_interval=0.2,
        flow_permit_ttl=2.0,
        loop_stall_warning=None,
    )
    url = f"{args.url}?schema={args.schema}&node={args.node}&lease_ttl=1.0&application_name=flow-{args.node}"
    async with (
        open_postgres_store(url) as store,
        aion.open_engine(store, workflows=[fan], activities=[limited], config=config) as engine,
    ):
        print("READY", flush=True)
        if args.start:
            first, stop = (int(x) for x in args.start.split(":"))
            for i in range(first, stop):
                await engine.start(fan, FAN, workflow_id=f"fan-{i}")
            print("STARTED", flush=True)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                break
    print("STOPPED", flush=True)


if __name__ == "__main__":
    trio.run(main)
