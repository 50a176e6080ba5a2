"""One engine node of ``test_pg_flow_queues.py``: a process to SIGKILL.

Usage::

    python flow_queue_node.py --url URL --schema S --node N --go PATH --scenario jobs|order
        [--priorities 7,1,4]

Opens an engine in cluster mode on ``URL?schema=S&node=N`` with three workflow
queues: ``jobs`` (``FlowLimit(cluster_concurrency=LIMIT)``), ``serial``
(``FlowLimit(concurrency=1)``) and ``paced`` (``FlowLimit(rate=RATE,
period=PERIOD)``).  Prints ``READY``, waits for the file ``--go`` (so the nodes
enqueue at the same moment), enqueues its runs, recording each outcome in
``queue_enqueues``, prints ``ENQUEUED`` and runs until SIGTERM.

Scenario ``jobs``: first every dedup id of ``DEDUPS`` (the other nodes enqueue
the same ids at the same moment), then ``JOBS`` runs with priorities 0..2, all
into ``jobs``.  Scenario ``order``: one run into ``serial`` per priority of
``--priorities``, then ``PACED`` runs into ``paced``.

Each run's one activity logs its start and end (the database clock) in
``queue_side``, and whether it ran to its end (``done``; an attempt cancelled
because another node took the run over logs its end too).  A run given a gate (the dedup holders, the ``serial`` runs) waits
for a row of that name in ``queue_gate`` (the test writes it) before it ends, so
it holds its place until then; each node's first job (``HANGING``) waits for
``KILLED_GATE``, so it is running when the test kills the node that runs it.
"""

from __future__ import annotations

import argparse
import os
import signal

import trio
from aion_trio_postgres import open_postgres_store
from flow_node import side

import aion_trio as aion

LIMIT = 3
JOBS = 8
DEDUPS = ("shared-0", "shared-1")
DEDUP_GATE = "dedup-decided"
#: Runs whose workflow id ends so (each node's first job) hold their place until the
#: test killed a node running one of them.
HANGING = "-job-0"
KILLED_GATE = "killed"
SERIAL_GATE = "serial-go"
PACED = 2
RATE = 2
PERIOD = 2.0
HOLD = {"jobs": 0.4, "serial": 0.1, "paced": 0.05}
SQL_CREATE_SIDE = (
    "CREATE TABLE queue_side (id bigserial PRIMARY KEY, node text NOT NULL, queue text NOT NULL,"
    " workflow_id text NOT NULL, began timestamptz NOT NULL DEFAULT clock_timestamp(), ended timestamptz,"
    " done boolean NOT NULL DEFAULT false)",
    "CREATE TABLE queue_enqueues (node text NOT NULL, queue text NOT NULL, workflow_id text NOT NULL,"
    " dedup_id text, priority int NOT NULL, accepted boolean NOT NULL, holder text,"
    " at timestamptz NOT NULL DEFAULT clock_timestamp())",
    "CREATE TABLE queue_gate (name text PRIMARY KEY)",
)


@aion.activity
async def step(queue: str, gate: str | None) -> str:
    info = aion.activity_info()
    row = await trio.to_thread.run_sync(
        side,
        "INSERT INTO queue_side (node, queue, workflow_id) VALUES (%s, %s, %s) RETURNING id",
        (os.environ["FLOW_NODE"], queue, info.workflow_id),
    )
    done = False
    try:
        while gate is not None and not await trio.to_thread.run_sync(  # noqa: ASYNC110 - the test writes it
            side, "SELECT count(*) FROM queue_gate WHERE name = %s", (gate,)
        ):
            await trio.sleep(0.1)
        while info.workflow_id.endswith(HANGING) and not await trio.to_thread.run_sync(  # noqa: ASYNC110 - the test writes it
            side, "SELECT count(*) FROM queue_gate WHERE name = %s", (KILLED_GATE,)
        ):
            await trio.sleep(0.1)
        await trio.sleep(HOLD[queue])
        done = True
    finally:
        # Also when cancelled (this node lost the run to another): the attempt ends here.
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(
                side,
                "UPDATE queue_side SET ended = clock_timestamp(), done = %s WHERE id = %s RETURNING id",
                (done, row),
            )
    return info.workflow_id


@aion.workflow
async def job(ctx: aion.WorkflowContext, queue: str, gate: str | None) -> str:
    return await ctx.start(step, queue, gate)


async def put(
    engine: aion.Engine,
    node: str,
    queue: str,
    wid: str,
    priority: int,
    dedup_id: str | None,
    gate: str | None,
) -> None:
    try:
        await engine.enqueue(
            job, queue, gate, queue=queue, priority=priority, dedup_id=dedup_id, workflow_id=wid
        )
        accepted, holder = True, None
    except aion.QueueDeduplicated as refused:
        accepted, holder = False, refused.workflow_id
    await trio.to_thread.run_sync(
        side,
        "INSERT INTO queue_enqueues (node, queue, workflow_id, dedup_id, priority, accepted, holder)"
        " VALUES (%s, %s, %s, %s, %s, %s, %s) RETURNING 1",
        (node, queue, wid, dedup_id, priority, accepted, holder),
    )


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--schema", required=True)
    parser.add_argument("--node", required=True)
    parser.add_argument("--go", required=True)
    parser.add_argument("--scenario", choices=("jobs", "order"), required=True)
    parser.add_argument("--priorities", default="")
    args = parser.parse_args()
    config = aion.EngineConfig(
        workflow_queues={
            "jobs": aion.FlowLimit(cluster_concurrency=LIMIT),
            "serial": aion.FlowLimit(concurrency=1),
            "paced": aion.FlowLimit(rate=RATE, period=PERIOD),
        },
        queue_poll_interval=0.2,
        sweep_interval=0.2,
        loop_stall_warning=None,
    )
    node = args.node
    url = f"{args.url}?schema={args.schema}&node={node}&lease_ttl=1.0&application_name=queue-{node}"
    async with (
        open_postgres_store(url) as store,
        aion.open_engine(store, workflows=[job], activities=[step], config=config) as engine,
    ):
        print("READY", flush=True)
        go = trio.Path(args.go)
        while not await go.exists():  # noqa: ASYNC110 - the test writes it
            await trio.sleep(0.02)
        if args.scenario == "jobs":
            for dedup_id in DEDUPS:
                await put(engine, node, "jobs", f"{node}-{dedup_id}", 0, dedup_id, DEDUP_GATE)
            for i in range(JOBS):
                await put(engine, node, "jobs", f"{node}-job-{i}", i % 3, None, None)
        else:
            for priority in (int(p) for p in args.priorities.split(",")):
                await put(engine, node, "serial", f"{node}-serial-{priority}", priority, None, SERIAL_GATE)
            for i in range(PACED):
                await put(engine, node, "paced", f"{node}-paced-{i}", 0, None, None)
        print("ENQUEUED", flush=True)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                break
    print("STOPPED", flush=True)


if __name__ == "__main__":
    trio.run(main)
