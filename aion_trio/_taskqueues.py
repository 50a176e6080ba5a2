"""Remote activity workers: the store capability and the library entry.

A store with :class:`ActivityTaskQueues` (the PostgreSQL contrib store) holds
activity tasks that engines dispatch to named task queues; any number of
worker processes claim and run them.  :func:`run_activity_worker` opens such
a store and serves its queues with this process's activity definitions, run
exactly as an engine runs them in-process (the same execution code).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import trio

from ._activities import ActivityExecutor, InProcessDispatcher, decoding_executor
from ._codecs import Codec, CodecChain, chain_or_none
from ._definitions import ActivityDefinition, ActivityLoop, index_definitions
from ._errors import NoTaskQueues
from ._payload import PayloadCodec
from ._plugins import open_store
from ._store import Store
from ._urls import redact_url


@runtime_checkable
class ActivityTaskQueues(Protocol):
    """A store whose activity tasks remote workers claim and run.

    ``serve_activity_tasks`` claims tasks of ``queues`` (at most
    ``concurrency`` at once), runs each through ``execute``, reports
    heartbeats and outcomes, and returns after ``stop`` is set: no new claims,
    running attempts get ``drain_timeout`` seconds to finish, the rest go back
    to their queues for another worker (the same attempt, no retry budget
    spent).  Cancelled, it releases what it runs (shielded) and re-raises.
    ``task_status.started(worker_id)`` once it is claiming.
    """

    async def serve_activity_tasks(
        self,
        execute: ActivityExecutor,
        queues: Sequence[str],
        *,
        concurrency: int,
        drain_timeout: float,
        stop: trio.Event,
        task_status: trio.TaskStatus[str] = ...,
    ) -> None: ...


async def run_activity_worker(
    store: str | Store,
    activities: Iterable[ActivityDefinition[Any]],
    queues: Sequence[str],
    *,
    concurrency: int = 10,
    drain_timeout: float = 30.0,
    stop: trio.Event | None = None,
    codec: PayloadCodec | None = None,
    codecs: CodecChain | Codec | Sequence[Codec] | None = None,
    max_threads: int = 40,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the activity tasks of ``queues`` from ``store`` until ``stop`` is set (or cancelled).

    ``store`` is a URL (opened and closed here) or an opened store; it must
    have :class:`ActivityTaskQueues`, else :class:`NoTaskQueues`.  Attempts
    run as in an engine: ``async def`` as Trio tasks, plain ``def`` in up to
    ``max_threads`` threads, asyncio coroutines through trio-asyncio; each
    is bounded by its per-attempt ``timeout`` here too.  Setting ``stop``
    drains (see :class:`ActivityTaskQueues`); cancellation releases running
    attempts back to their queues.  ``task_status.started(worker_id)``.
    ``codecs``: the engines' ``EngineConfig.codecs`` (docs/payloads.md): a task's
    payloads arrive encoded and its result leaves encoded.
    """
    queue_list = list(queues)
    if not queue_list or not all(isinstance(q, str) and q for q in queue_list):
        raise ValueError(f"queues must be a non-empty sequence of non-empty str, got {queues!r}")
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency!r}")
    if drain_timeout < 0:
        raise ValueError(f"drain_timeout must be >= 0 seconds, got {drain_timeout!r}")
    _, activity_map = index_definitions((), activities)
    if not activity_map:
        raise ValueError("activities is empty: a worker needs @aion_trio.activity functions to run")
    stop = stop if stop is not None else trio.Event()
    chain = chain_or_none(codecs)
    async with contextlib.AsyncExitStack() as stack:
        if isinstance(store, str):
            opened: Store = await stack.enter_async_context(open_store(store))
            location = redact_url(store)
        else:
            opened = store
            location = type(store).__name__
        if not isinstance(opened, ActivityTaskQueues):
            raise NoTaskQueues(getattr(opened, "location", None) or location)
        asyncio_loop = None
        if any(a.loop is ActivityLoop.ASYNCIO for a in activity_map.values()):
            import trio_asyncio

            asyncio_loop = await stack.enter_async_context(trio_asyncio.open_loop())
        local = InProcessDispatcher(
            activity_map, codec or PayloadCodec(), asyncio_loop, trio.CapacityLimiter(max_threads)
        )
        execute: ActivityExecutor = local.execute
        if chain is not None:
            execute = decoding_executor(execute, chain)
        await opened.serve_activity_tasks(
            execute,
            queue_list,
            concurrency=concurrency,
            drain_timeout=drain_timeout,
            stop=stop,
            task_status=task_status,
        )
