"""Workflow queues: ``engine.enqueue`` and the service admitting queued runs (docs/flow-control.md).

A queued run is an entry of the store's :class:`~aion_trio.FlowStore` (what to
start and under which id reuse policy, its priority, partition and dedup id).
The service admits entries under the queue's :class:`~aion_trio.FlowLimit` (the
store decides, atomically, which ones) and starts each admitted run through
``Engine.start`` — the one start path — under the workflow id fixed at enqueue
and one request id (``queue:QUEUE:SEQ``), so starting it twice (two nodes, or
again after a crash) starts it once.  An admitted entry holds its queue's place
until its run is closed; one whose start the id reuse policy refuses (or, under
``use_existing``, attaches to a run it did not start) ends at once.  Every pass
also looks at the admitted entries: one whose run closed is removed, one whose
run was never started (the engine died between admission and start) is started
now, so a crash never leaves a queue blocked.
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
from .._commands import IdReusePolicy, reuse_decision
from .._definitions import WorkflowDefinition
from .._errors import (
    FlowControlUnsupported,
    QueueDeduplicated,
    StoreError,
    UnknownQueue,
    WorkflowAlreadyStarted,
    WorkflowFailure,
    WorkflowFenced,
    WorkflowNotFound,
)
from .._events import Event
from .._ids import validate_workflow_id
from .._payload import Payload, PayloadCodec
from .._projections import is_active, latest_run_id, recorded_request, workflow_status
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

    async def history(self, workflow_id: str) -> list[Event]: ...

    async def result(
        self, workflow_id: str, *, run_id: str | None = ..., follow_continue_as_new: bool = ...
    ) -> Any: ...


@final
class QueuedHandle:
    """What ``engine.enqueue`` returns: the run's ``workflow_id`` and ``queue``, and
    :meth:`result`, which waits for the run to be admitted, started and ended.

    ``created`` is true when the enqueue put an entry into the queue; false when,
    under ``IdReusePolicy.USE_EXISTING``, it found the workflow existing and wrote
    nothing (the handle then stands for that workflow's latest run).
    """

    def __init__(
        self,
        queues: WorkflowQueues,
        queue: str,
        workflow_id: str,
        *,
        seq: int | None,
        id_reuse: IdReusePolicy = IdReusePolicy.ALLOW_DUPLICATE,
    ) -> None:
        self._queues = queues
        self.queue = queue
        self.workflow_id = workflow_id
        self.created = seq is not None
        #: The entry's ``seq`` (its start's request id is ``queue:QUEUE:SEQ``); ``None``: none written.
        self._seq = seq
        self._id_reuse = id_reuse

    async def result(self) -> Any:
        """The run's result once it ran (it may wait in its queue first).

        Raises :class:`WorkflowAlreadyStarted` if the entry's id reuse policy refused
        its start at admission (the workflow id was taken meanwhile: nothing started).
        """
        run_id = None if self._seq is None else await self._queues.run_of(self, self._seq, self._id_reuse)
        return await self._queues.client.result(self.workflow_id, run_id=run_id)

    def __repr__(self) -> str:
        existing = "" if self.created else " (existing)"
        return f"<QueuedHandle {self.workflow_id!r} in queue {self.queue!r}{existing}>"


def _request_id(queue: str, seq: int) -> str:
    """The request id an entry's start carries: a start repeated (two nodes, a restart) is one."""
    return f"queue:{queue}:{seq}"


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
        id_reuse: IdReusePolicy = IdReusePolicy.ALLOW_DUPLICATE,
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
        if not isinstance(id_reuse, IdReusePolicy):
            raise TypeError(f"enqueue(id_reuse=...) must be an IdReusePolicy, got {id_reuse!r}")
        if workflow_id is not None:
            validate_workflow_id(workflow_id)
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
                # Applied again at admission: the id may be taken between now and then.
                "id_reuse": id_reuse.value,
            }
        )
        if workflow_id is not None:
            # The policy first applies now: a refused enqueue writes nothing.
            history = await self._history(wid)
            status = workflow_status(history)
            if status is not None:
                run_id = latest_run_id(history)
                assert run_id is not None
                decision = reuse_decision(id_reuse, status)
                if decision is None:
                    return QueuedHandle(self, queue, wid, seq=None)
                if not decision:
                    # A run this queue's own entry started still holds the id: that is
                    # the queue's refusal (as for an entry still queued, below).
                    for held in await store.flow_runs(queue):
                        if held.workflow_id == wid:
                            raise QueueDeduplicated(queue, held.dedup_id or "", wid)
                    raise WorkflowAlreadyStarted(wid, run_id, status.value, id_reuse.value)
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
        return QueuedHandle(self, queue, wid, seq=entry.seq, id_reuse=id_reuse)

    async def _history(self, workflow_id: str) -> list[Event]:
        try:
            return await self.client.history(workflow_id)
        except WorkflowNotFound:
            return []

    async def _held(self, queue: str, workflow_id: str, seq: int) -> bool:
        """Whether the entry ``seq`` is still in its queue (queued or admitted)."""
        return any(
            e.workflow_id == workflow_id and e.seq == seq for e in await self._flow_store().flow_runs(queue)
        )

    async def run_of(self, handle: QueuedHandle, seq: int, id_reuse: IdReusePolicy) -> str | None:
        """The run the entry ``seq`` started, once it started; ``None`` for the run it was
        attached to at admission (``use_existing``: the workflow's latest).  Raises
        :class:`WorkflowAlreadyStarted` if its policy refused its start at admission."""
        wid = handle.workflow_id
        request_id = _request_id(handle.queue, seq)
        while True:
            history = await self._history(wid)
            found = recorded_request(history, request_id)
            if found is not None:
                return found.run_id
            # The id holds another run: the entry may have ended at admission without a
            # start of its own.  Its start is recorded before its entry is removed, so once
            # the entry is gone the history read after shows that start, if it happened.
            if history and not await self._held(handle.queue, wid, seq):
                history = await self._history(wid)
                found = recorded_request(history, request_id)
                if found is not None:
                    return found.run_id
                if id_reuse is IdReusePolicy.USE_EXISTING:
                    return None
                status = workflow_status(history)
                run_id = latest_run_id(history)
                if status is None or run_id is None:
                    raise WorkflowNotFound(wid)  # deleted meanwhile
                raise WorkflowAlreadyStarted(wid, run_id, status.value, id_reuse.value)
            await self.started_or_poll(wid)

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
            name, concurrency=_admitted_bound(limit), rate=limit.rate, period=limit.period, now=self.now()
        )
        for entry in admitted:
            await self._start(entry)
        return math.inf if retry_after is None else retry_after

    async def _reconcile(self, store: FlowStore, entry: QueuedRun) -> None:
        history = await self._history(entry.workflow_id)
        if recorded_request(history, _request_id(entry.queue, entry.seq)) is None:
            # Admitted, never started (the engine died in between): start it now (its
            # id reuse policy decides, as at any admission).  A run of the same id that
            # it did not start is not its own.
            await self._start(entry)
        elif is_active(history):
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
            # Entries written before the policy was stored start as they always did.
            id_reuse = IdReusePolicy(data.get("id_reuse", IdReusePolicy.ALLOW_DUPLICATE.value))
            handle = await self.client.start(
                data["workflow"],
                *args,
                workflow_id=entry.workflow_id,
                id_reuse=id_reuse,
                search_attributes=data.get("search_attributes"),
                timeout=data.get("timeout"),
                request_id=_request_id(entry.queue, entry.seq),
            )
        except WorkflowAlreadyStarted as refused:
            # The id was taken between enqueue and admission and the policy refuses a new
            # run: the entry ends (its handle raises this) rather than hold its place.
            logger.info("workflow queue %r: %s; the entry ends", entry.queue, refused)
            await self._end_unstarted(entry)
            return
        except WorkflowFenced:
            # Cluster mode: another node started it first (every node starts an admitted
            # entry it finds unstarted); the next pass finds it running and watches it.
            logger.info("workflow queue %r: %r was started by another node", entry.queue, entry.workflow_id)
            return
        except Exception as exc:
            logger.warning(
                "workflow queue %r: could not start %r (retried on the next pass): %s",
                entry.queue,
                entry.workflow_id,
                exc,
            )
            return
        if not handle.created:
            # use_existing found a run it did not start: the entry ends, its handle follows that run.
            await self._end_unstarted(entry)
            return
        self._started.pop(entry.workflow_id, trio.Event()).set()
        self._watch(entry)

    async def _end_unstarted(self, entry: QueuedRun) -> None:
        """An admitted entry that started no run of its own: give its place back now."""
        await self._flow_store().finish_flow_run(entry.queue, entry.workflow_id)
        self._started.pop(entry.workflow_id, trio.Event()).set()
        self._wake.set()

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


def _admitted_bound(limit: FlowLimit) -> int | None:
    """How many runs of a queue (of one partition) may be admitted at once.

    The store counts a queue's admitted entries, which every engine on it shares: a
    queue's ``concurrency`` already bounds the runs of every node, and
    ``cluster_concurrency`` names the same bound; with both, the smaller holds."""
    bounds = [b for b in (limit.concurrency, limit.cluster_concurrency) if b is not None]
    return min(bounds) if bounds else None


async def _quietly(waiting: Awaitable[Any]) -> None:
    """Wait for a run's end, whatever it was."""
    try:
        await waiting
    except WorkflowFailure:
        pass
