"""The failover workload: workflows and activities the engine processes, the remote
activity workers (``--activities failover_app:app``) and ``bench/pg_cluster.py`` import.

``flow(index, queue, timer)``: activity ``step`` 0 -> durable timer of ``timer``
seconds -> ``wait_signal("go")`` -> activity ``step`` 1 (on task queue
``queue``: ``"remote"`` sends it to the ``--activities-only`` workers).  Its
result is :func:`expected_result`.  Every execution of ``step`` first writes a
row to the side table :data:`SIDE_TABLE` (in the store's schema), so a test
counts executions, re-executions included, in SQL.

``spans(steps)`` (the partition workload) awaits ``span_step`` ``steps``
times; each execution of ``span_step`` writes its node and its wall-clock
span (``time.time()`` at its start and end) to :data:`SPAN_TABLE`, so a test
sees which node ran which attempt when, and that no two nodes ran one
activity at overlapping times.

``chain(steps)`` (the throughput workload) awaits ``increment`` ``steps``
times; ``nap(until)`` (the takeover workload) sleeps on a durable timer
until a Unix time, so every run's timer comes due at one moment.

The side table's connection comes from the environment: ``AIONFO_SIDE_URL``
(a libpq URL), ``AIONFO_SCHEMA`` and ``AIONFO_NODE`` (recorded per row).
"""

from __future__ import annotations

import os
import time
import types
from datetime import datetime, timezone
from typing import Any

import psycopg
import trio

import aion_trio as aion

SIDE_TABLE = "workload_executions"
SIGNAL = "go"
REMOTE_QUEUE = "remote"

# Connection losses (pg_terminate_backend) surface as failed attempts: retried.
RETRY = aion.RetryPolicy(max_attempts=20, backoff=aion.Fixed(0.2))

SQL_CREATE_SIDE = (
    f"CREATE TABLE IF NOT EXISTS {SIDE_TABLE} (workflow_id text NOT NULL, step integer NOT NULL,"
    " attempt integer NOT NULL, node text NOT NULL, pid integer NOT NULL,"
    " at timestamptz NOT NULL DEFAULT clock_timestamp())"
)
SPAN_TABLE = "workload_spans"
SQL_CREATE_SPANS = (
    f"CREATE TABLE IF NOT EXISTS {SPAN_TABLE} (workflow_id text NOT NULL, step integer NOT NULL,"
    " attempt integer NOT NULL, node text NOT NULL, started float8 NOT NULL, ended float8 NOT NULL)"
)
_SQL_SPAN = f"INSERT INTO {SPAN_TABLE} (workflow_id, step, attempt, node, started, ended) VALUES (%s, %s, %s, %s, %s, %s)"
#: How long one ``span_step`` works (seconds).
SPAN_WORK = 0.05

_SQL_RECORD = f"INSERT INTO {SIDE_TABLE} (workflow_id, step, attempt, node, pid) VALUES (%s, %s, %s, %s, %s)"


def signal_payload(index: int) -> int:
    return index % 7


def expected_result(index: int) -> int:
    return (index * 10) + (index * 10 + 1) + signal_payload(index)


def _record(workflow_id: str, step_no: int, attempt: int) -> None:
    with psycopg.connect(os.environ["AIONFO_SIDE_URL"], autocommit=True, connect_timeout=5) as conn:
        conn.execute("SELECT set_config('search_path', %s, false)", (os.environ["AIONFO_SCHEMA"],))
        conn.execute(
            _SQL_RECORD, (workflow_id, step_no, attempt, os.environ.get("AIONFO_NODE", "?"), os.getpid())
        )


@aion.activity(name="fo_step")
async def step(index: int, step_no: int) -> int:
    info = aion.activity_info()
    await trio.to_thread.run_sync(_record, info.workflow_id, step_no, info.attempt)
    return index * 10 + step_no


@aion.workflow(name="fo_flow")
async def flow(ctx: aion.WorkflowContext, index: int, queue: str, timer: float) -> int:
    first = await ctx.run(step, index, 0, retry=RETRY)
    await ctx.sleep(timer)
    bonus = await ctx.wait_signal(SIGNAL)
    second = await ctx.run(step, index, 1, retry=RETRY, task_queue=queue)
    return int(first + second + bonus)


def _record_span(workflow_id: str, step_no: int, attempt: int, started: float, ended: float) -> None:
    with psycopg.connect(os.environ["AIONFO_SIDE_URL"], autocommit=True, connect_timeout=5) as conn:
        conn.execute("SELECT set_config('search_path', %s, false)", (os.environ["AIONFO_SCHEMA"],))
        node = os.environ.get("AIONFO_NODE", "?")
        conn.execute(_SQL_SPAN, (workflow_id, step_no, attempt, node, started, ended))


@aion.activity(name="fo_span_step")
async def span_step(step_no: int) -> int:
    info = aion.activity_info()
    started = time.time()
    await trio.sleep(SPAN_WORK)
    await trio.to_thread.run_sync(_record_span, info.workflow_id, step_no, info.attempt, started, time.time())
    return step_no


@aion.workflow(name="fo_spans")
async def spans(ctx: aion.WorkflowContext, steps: int) -> int:
    done = 0
    for i in range(steps):
        done += int(await ctx.run(span_step, i, retry=RETRY) == i)
    return done


@aion.activity(name="fo_increment")
async def increment(x: int) -> int:
    return x + 1


@aion.workflow(name="fo_chain")
async def chain(ctx: aion.WorkflowContext, steps: int) -> int:
    value = 0
    for _ in range(steps):
        value = await ctx.run(increment, value)
    return int(value)


@aion.workflow(name="fo_nap")
async def nap(ctx: aion.WorkflowContext, until: float) -> str:
    """Sleep on a durable timer until ``until`` (Unix time, seconds), then return the id."""
    await ctx.sleep_until(datetime.fromtimestamp(until, tz=timezone.utc))
    return ctx.workflow_id


app = types.SimpleNamespace(workflows=[flow, chain, nap, spans], activities=[step, increment, span_step])
"""What ``aion-trio worker --activities failover_app:app`` and the node processes load."""


def describe(value: Any) -> str:
    return f"{type(value).__name__}: {value}"
