"""Workflow queues: ``engine.enqueue`` and the service admitting queued runs (docs/flow-control.md).

A queued run is an entry of the store's :class:`~aion_trio.FlowStore` (what to
start, its priority, partition and dedup id).  The service admits entries under
the queue's :class:`~aion_trio.FlowLimit` (the store decides, atomically, which
ones) and starts each admitted run through ``Engine.start`` — the one start
path — under the workflow id fixed at enqueue and one request id, so starting
it twice (two nodes, or again after a crash) starts it once.  An admitted entry
holds its queue's place until its workflow is closed.  Every pass also looks at
the admitted entries: one whose workflow closed is removed, one whose workflow
was never started (the engine died between admission and start) is started now,
so a crash never leaves a queue blocked.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Awaitable, Callable, Mapping
from datetime import timedelta
from typing import Any, Protocol, final

import trio

from .._admission import FlowLimit
from .._codecs import CodecChain
from .._commands import IdReusePolicy
from .._definitions import WorkflowDefinition
from .._errors import (
    FlowControlUnsupported,
    QueueDeduplicated,
    StoreError,
    UnknownQueue,
    WorkflowFailure,
    WorkflowNotFound,
)
from .._events import WorkflowStatus
from .._payload import Payload, PayloadCodec
from .._retry import duration_seconds
from .._store import ADMITTED, FlowStore, QueuedRun
from .log import logger


class QueueClient(Protocol):
    """What the queue service asks of the engine's client (``Engine``): the one start
    path, a workflow's description and its result."""

    async def start(
        self,
        workflow: str,
        *args: Any,
        workflow_id: str | None = ...,
        id_reuse: IdReusePolicy = ...,
        search_attributes: Mapping[str, Any] | None = ...,
        task_queue: str | None = ...,
        timeout: timedelta | float | None = ...,  # noqa: ASYNC109 - a durable workflow deadline
        request_id: str | None = ...,
    ) -> Any: ...

    async def describe(self, workflow_id: str) -> Any: ...

    async def result(
        self, workflow_id: str, *, run_id: str | None = ..., follow_continue_as_new: bool = ...
    ) -> Any: ...


@final
class QueuedHandle:
    """What ``engine.enqueue`` returns: the run's ``workflow_id`` and ``queue``, and
    :meth:`result`, which waits for the run to be admitted, started and ended."""

    def __init__(self, queues: WorkflowQueues, queue: str, workflow_id: str) -> None:
        self._queues = queues
        self.queue = queue
        self.workflow_id = workflow_id

    async def result(self) -> Any:
        """The run's result once it ran (it may wait in its queue first)."""
        while True:
            try:
                return await self._queues.client.result(self.workflow_id)
            except WorkflowNotFound:
                await self._queues.started_or_poll(self.workflow_id)

    def __repr__(self) -> str:
        return f"<QueuedHandle {self.workflow_id!r} in queue {self.queue!r}>"


@final
class WorkflowQueues:
    """The workflow queues of one engine: enqueue, and the service admitting runs."""

    def __init__(
        self,
        *,
        client: QueueClient,
        store: object,
        queues: Mapping[str, FlowLimit],
        codec: PayloadCodec,
        codecs: CodecChain | None,
        now: Callable[[], Any],
        poll_interval: float,
        workflow_definition: Callable[[WorkflowDefinition[Any] | str], WorkflowDefinition[Any]],
        spawn: Callable[..., None],
    ) -> None:
        self.client = client
        self.store = store if isinstance(store, FlowStore) else None
        self.location = type(store).__name__
        self.queues = dict(queues)
        self.codec = codec
        #: The payload codec chain (``EngineConfig.codecs``): queued arguments are stored
        #: through it as a history's payloads are.
        self.codecs = codecs
        self.now = now
        self.poll_interval = poll_interval
        self.workflow_definition = workflow_definition
        self.spawn = spawn
        self._wake = trio.Event()
        self._started: dict[str, trio.Event] = {}
        #: Runs this engine watches until they close (their entry is then removed).
        self._watched: set[str] = set()

    def _flow_store(self) -> FlowStore:
        if self.store is None:
            raise FlowControlUnsupported(self.location, "engine.enqueue")
        return self.store

    async def enqueue(
        self,
        workflow: WorkflowDefinition[Any] | str,
        *args: Any,
        queue: str,
        priority: int = 0,
        dedup_id: str | None = None,
        partition_key: str | None = None,
        workflow_id: str | None = None,
        search_attributes: Mapping[str, Any] | None = None,
        timeout: timedelta | float | None = None,  # noqa: ASYNC109 - a durable workflow deadline
    ) -> QueuedHandle:
        if queue not in self.queues:
            raise UnknownQueue(queue, sorted(self.queues))
        limit = self.queues[queue]
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise TypeError(f"enqueue(priority=...) must be an int (lower runs first), got {priority!r}")
        if limit.partitioned and not (isinstance(partition_key, str) and partition_key):
            raise ValueError(
                f"queue {queue!r} is partitioned: enqueue needs a partition_key (a non-empty str)"
            )
        if not limit.partitioned and partition_key is not None:
            raise ValueError(
                f"queue {queue!r} is not partitioned (FlowLimit(partitioned=True)); drop partition_key"
            )
        if dedup_id is not None and not (isinstance(dedup_id, str) and dedup_id):
            raise ValueError(f"enqueue(dedup_id=...) must be a non-empty str, got {dedup_id!r}")
        definition = self.workflow_definition(workflow)
        store = self._flow_store()
        wid = workflow_id if workflow_id is not None else str(uuid.uuid4())
        # Encoded now: arguments that cannot be stored are refused before anything is written.
        arguments = self.codec.encode(list(args), what="workflow input")
        if self.codecs is not None:
            arguments = await self.codecs.encode(arguments)
        data = json.dumps(
            {
                "workflow": definition.name,
                "args": arguments.json,
                "search_attributes": dict(search_attributes) if search_attributes else None,
                "timeout": None if timeout is None else duration_seconds(timeout, "enqueue(timeout=...)"),
            }
        )
        entry, created = await store.enqueue_flow_run(
            QueuedRun(
                queue=queue,
                workflow_id=wid,
                partition_key=partition_key or "",
                priority=priority,
                dedup_id=dedup_id,
                data=data,
            )
        )
        if not created:
            if dedup_id is not None and entry.dedup_id == dedup_id:
                raise QueueDeduplicated(queue, dedup_id, entry.workflow_id)
            raise QueueDeduplicated(queue, entry.dedup_id or "", entry.workflow_id)
        self._wake.set()
        return QueuedHandle(self, queue, wid)

    async def started_or_poll(self, workflow_id: str) -> None:
        """Wait until this engine started ``workflow_id``, or one poll interval."""
        event = self._started.setdefault(workflow_id, trio.Event())
        with trio.move_on_after(self.poll_interval):
            await event.wait()

    # -- the service ---------------------------------------------------------------

    async def serve(self) -> None:
        """Admit and start queued runs for as long as the engine runs."""
        if self.store is None or not self.queues:
            return
        while True:
            wake = self._wake = trio.Event()
            retry = math.inf
            for name, limit in self.queues.items():
                try:
                    retry = min(retry, await self._pass(self.store, name, limit))
                except StoreError as exc:
                    logger.warning("workflow queue %r: pass failed, retried: %s", name, exc)
            with trio.move_on_after(min(retry, self.poll_interval)):
                await wake.wait()

    async def _pass(self, store: FlowStore, name: str, limit: FlowLimit) -> float:
        """Reconcile the admitted entries, admit what the limit allows, start it; the
        seconds until the rate frees a start (inf: no wait)."""
        for entry in await store.flow_runs(name):
            if entry.state == ADMITTED and entry.workflow_id not in self._watched:
                await self._reconcile(store, entry)
        admitted, retry_after = await store.admit_flow_runs(
            name, concurrency=limit.concurrency, rate=limit.rate, period=limit.period, now=self.now()
        )
        for entry in admitted:
            await self._start(entry)
        return math.inf if retry_after is None else retry_after

    async def _reconcile(self, store: FlowStore, entry: QueuedRun) -> None:
        try:
            description = await self.client.describe(entry.workflow_id)
        except WorkflowNotFound:
            await self._start(entry)  # admitted, never started: the engine died in between
            return
        if description.status is WorkflowStatus.RUNNING:
            self._watch(entry)
        else:
            await store.finish_flow_run(entry.queue, entry.workflow_id)

    async def _start(self, entry: QueuedRun) -> None:
        data = json.loads(entry.data)
        arguments = Payload.from_json_text(data["args"])
        if self.codecs is not None:
            arguments = await self.codecs.decode(
                arguments, workflow_id=entry.workflow_id, seq=None, what="queued workflow input"
            )
        args = self.codec.decode(arguments)
        try:
            await self.client.start(
                data["workflow"],
                *args,
                workflow_id=entry.workflow_id,
                search_attributes=data.get("search_attributes"),
                timeout=data.get("timeout"),
                request_id=f"queue:{entry.queue}:{entry.seq}",
            )
        except Exception as exc:
            logger.warning(
                "workflow queue %r: could not start %r (retried on the next pass): %s",
                entry.queue,
                entry.workflow_id,
                exc,
            )
            return
        self._started.pop(entry.workflow_id, trio.Event()).set()
        self._watch(entry)

    def _watch(self, entry: QueuedRun) -> None:
        if entry.workflow_id in self._watched:
            return
        self._watched.add(entry.workflow_id)
        self.spawn(self._until_closed, entry, name=f"queue:{entry.queue}:{entry.workflow_id}")

    async def _until_closed(self, entry: QueuedRun) -> None:
        """Wait for the run's end, then give its place in the queue back."""
        store = self._flow_store()
        try:
            await _quietly(self.client.result(entry.workflow_id))
            await store.finish_flow_run(entry.queue, entry.workflow_id)
        finally:
            self._watched.discard(entry.workflow_id)
        self._wake.set()


async def _quietly(waiting: Awaitable[Any]) -> None:
    """Wait for a run's end, whatever it was."""
    try:
        await waiting
    except WorkflowFailure:
        pass
