"""The recorder cache and its fencing: one recorder per workflow this engine holds.

:class:`Recorders` loads each workflow's history once and hands every caller
the same :class:`~aion_trio._recorder.Recorder` (its lock serialises the
workflow's appends).  It is also where a workflow leaves this engine: a store
fence refusing an append (another node claimed it), a stale copy (another node
appended meanwhile) and a re-claim that must start from the store all drop the
recorder here, and the engine's ``forget`` callback stops what else runs of it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import final

import trio

from .._clock import EngineClock
from .._epoch import EngineEpoch
from .._errors import EngineEpochClosed, NotOwner, SequenceConflict, StoreError
from .._events import Event
from .._ids import check_text
from .._observe import ObserverHub, WorkflowRelinquished
from .._recorder import Recorder
from .._registry import Registry
from .._store import ClusterStore, EventStore
from .log import logger


@final
class Recorders:
    """This engine's recorders by workflow id, and the one way a workflow is dropped from it.

    ``forget(workflow_id)`` stops what else this engine runs of a dropped
    workflow (its runs, in-flight attempts, timers, stuck mark); ``recover``
    recovers a workflow from the store (a stale copy this node still owns).
    Both are called without the recorder lock and ``forget`` without a checkpoint.
    """

    def __init__(
        self,
        *,
        events: EventStore,
        epoch: EngineEpoch,
        clock: EngineClock,
        registry: Registry,
        forget: Callable[[str], None],
        recover: Callable[[str], Awaitable[object]],
        observers: ObserverHub | None = None,
        cluster: ClusterStore | None = None,
    ) -> None:
        self._events = events
        self._epoch = epoch
        self._clock = clock
        self._registry = registry
        self._forget = forget
        self._recover = recover
        self._observers = observers
        self._cluster = cluster
        self._recorders: dict[str, Recorder] = {}
        self._loading: dict[str, trio.Event] = {}
        #: Owned stores: told when the store's fence refused a write (the claim was taken over).
        self.on_store_fenced: Callable[[NotOwner], None] | None = None
        #: Cluster mode: workflows this engine stopped because another node claimed them.
        self.relinquished = 0
        #: Makes an evicted run resident again before its recorder is handed out (the
        #: residency service's ``ensure_resident``; set once it exists).
        self.ensure_resident: Callable[[str], Awaitable[None]] | None = None
        #: Waiters for a workflow's recorder to be installed or dropped, by workflow id.
        self._watches: dict[str, trio.Event] = {}

    @property
    def count(self) -> int:
        """How many recorders this engine holds now."""
        return len(self._recorders)

    def snapshot(self) -> tuple[Recorder, ...]:
        """The recorders this engine holds now."""
        return tuple(self._recorders.values())

    async def recorder_for(self, workflow_id: str) -> Recorder:
        """This engine's one recorder for ``workflow_id`` (loaded from the store once).

        The writer's door: an evicted run of the workflow is made resident first
        (replayed from the store), so what the caller appends wakes a resident run.
        Readers that must not wake it use :meth:`history_of`."""
        while True:
            if self.ensure_resident is not None:
                await self.ensure_resident(workflow_id)
            recorder = await self._recorder_for(workflow_id)
            # No checkpoint from this check to the caller's ``async with recorder.lock``:
            # a run evicted meanwhile is made resident first (go round).
            if self._recorders.get(workflow_id) is recorder and self._registry.evicted(workflow_id) is None:
                return recorder

    async def history_of(self, workflow_id: str) -> Sequence[Event]:
        """The workflow's history for a reader: the loaded recorder's, else the store's.
        Wakes nothing and caches nothing; a load or a start on a new id in flight is waited for."""
        if not isinstance(workflow_id, str):
            raise TypeError(f"workflow_id must be str, got {type(workflow_id).__name__}")
        check_text(workflow_id, "workflow_id")
        while True:
            found = self._recorders.get(workflow_id)
            if found is not None:
                await trio.lowlevel.checkpoint()
                return found.history
            loading = self._loading.get(workflow_id)
            if loading is None:
                return await self._events.read_history(workflow_id)
            await loading.wait()

    def watch(self, workflow_id: str) -> trio.Event:
        """An event set the next time ``workflow_id``'s recorder is installed here or dropped."""
        event = self._watches.get(workflow_id)
        if event is None:
            event = self._watches[workflow_id] = trio.Event()
        return event

    def _changed(self, workflow_id: str) -> None:
        event = self._watches.pop(workflow_id, None)
        if event is not None:
            event.set()

    def drop(self, workflow_id: str) -> None:
        """Drop the workflow's recorder from the cache (evicted or released: nothing else of it
        is stopped).  Its waiters are woken, so they look again.  No checkpoint."""
        recorder = self._recorders.pop(workflow_id, None)
        if recorder is not None:
            recorder.dropped = True
            recorder.after_append = self._appended_after_drop
            recorder.notify()
        self._changed(workflow_id)

    def _appended_after_drop(self, recorder: Recorder) -> None:
        """An append landed through a recorder dropped meanwhile (a caller held it across the
        eviction): make the run resident again so it consumes what was appended."""
        ensure = self.ensure_resident
        if ensure is None or self._registry.evicted(recorder.workflow_id) is None:
            return
        try:
            self._epoch.spawn(ensure, recorder.workflow_id, name=f"wake:{recorder.workflow_id}")
        except EngineEpochClosed:
            pass  # shutting down: the next engine recovers it

    async def load_many(
        self,
        workflow_ids: Sequence[str],
        read: Callable[[list[str]], Awaitable[Mapping[str, Sequence[Event]]]],
    ) -> int:
        """Load the recorders of ``workflow_ids`` from one bulk read (``read(ids)``, a
        :class:`~aion_trio.BulkHistoryReads` store's ``read_histories``); returns how many
        it installed.  Ids already loaded or loading here are left alone; the others count
        as loading while the read is in flight, as for :meth:`recorder_for`.  A failed read
        installs nothing and is raised."""
        ids = [w for w in dict.fromkeys(workflow_ids) if w not in self._recorders and w not in self._loading]
        if not ids:
            await trio.lowlevel.checkpoint()
            return 0
        done = trio.Event()
        for workflow_id in ids:
            self._loading[workflow_id] = done
        try:
            histories = await read(ids)
            for workflow_id in ids:
                self._recorders[workflow_id] = Recorder(
                    workflow_id,
                    self._events,
                    self._epoch,
                    self._clock,
                    histories.get(workflow_id, ()),
                    observers=self._observers,
                    on_fenced=self._on_fenced,
                    on_stale=self._on_stale,
                )
                self._changed(workflow_id)
            return len(ids)
        finally:
            for workflow_id in ids:
                del self._loading[workflow_id]
            done.set()

    async def _recorder_for(self, workflow_id: str) -> Recorder:
        while True:
            found = self._recorders.get(workflow_id)
            if found is not None:
                await trio.lowlevel.checkpoint()
                return found
            loading = self._loading.get(workflow_id)
            if loading is None:
                break
            await loading.wait()
        # An id no store can hold (a lone surrogate): say so instead of asking the
        # store, whose encoder would fail on it.
        if not isinstance(workflow_id, str):
            raise TypeError(f"workflow_id must be str, got {type(workflow_id).__name__}")
        check_text(workflow_id, "workflow_id")
        done = trio.Event()
        self._loading[workflow_id] = done
        try:
            recorder = await Recorder.load(
                workflow_id,
                self._events,
                self._epoch,
                self._clock,
                observers=self._observers,
                on_fenced=self._on_fenced,
                on_stale=self._on_stale,
            )
            self._recorders[workflow_id] = recorder
            self._changed(workflow_id)
            return recorder
        finally:
            del self._loading[workflow_id]
            done.set()

    @property
    def _on_fenced(self) -> Callable[[Recorder, NotOwner], None] | None:
        if self._cluster is not None:
            return self.relinquish
        return self._store_fenced if self.on_store_fenced is not None else None

    @property
    def _on_stale(self) -> Callable[[Recorder, SequenceConflict], None] | None:
        return self.relinquish_stale if self._cluster is not None else None

    def _store_fenced(self, recorder: Recorder, error: NotOwner) -> None:
        # An owned store refused a write: the engine lost the store, not one workflow.
        assert self.on_store_fenced is not None
        self.on_store_fenced(error)

    def relinquish(self, recorder: Recorder, error: NotOwner) -> None:
        """Cluster mode's one choke point for a fenced workflow: stop it on this node.

        Called by the recorder when the store refuses an append with
        ``NotOwner`` (another node claimed the workflow).  No checkpoint: the
        run's task and in-flight activity attempts are cancelled (parked, they
        record nothing), its timers leave the heap, its recorder and leases
        leave the registry, and it is logged once and reported to observers.
        Never retried here: the new owner's recovery carries the workflow on.
        """
        if not self._stop_locally(recorder):
            return  # a recorder already dropped (another of its tasks was fenced first)
        self._report_relinquished(
            recorder.workflow_id,
            "workflow relinquished: another node claimed it, so this node stopped it (nothing retried "
            "here): %s",
            error,
        )

    def held(self) -> list[str]:
        """The workflows this engine holds now: loaded, or with an evicted run (a snapshot)."""
        return [*self._recorders, *(w for w in self._registry.evicted_ids() if w not in self._recorders)]

    def relinquish_lost(self, workflow_id: str, error: NotOwner) -> None:
        """Cluster mode: drop a workflow this node found another node owns (after its lease
        lapsed), loaded or evicted, before it writes to it or starts a side effect for it.
        The same stop as :meth:`relinquish`; nothing is recorded.  No checkpoint."""
        recorder = self._recorders.get(workflow_id)
        if recorder is not None:
            self.relinquish(recorder, error)
            return
        if self._registry.evicted(workflow_id) is None:
            return  # dropped meanwhile
        self._forget(workflow_id)
        self._changed(workflow_id)
        self._report_relinquished(
            workflow_id,
            "evicted workflow relinquished: another node claimed it while this node's lease had lapsed: %s",
            error,
        )

    def _report_relinquished(self, workflow_id: str, message: str, error: StoreError) -> None:
        """Count a workflow this node stopped running, log ``message`` (``%s``: ``error``) and
        tell the observers."""
        self.relinquished += 1
        node = self._cluster.node_id if self._cluster is not None else ""
        logger.warning(message, error, extra={"workflow_id": workflow_id, "node": node, "reason": str(error)})
        if self._observers is not None:
            self._observers.emit(
                WorkflowRelinquished(workflow_id=workflow_id, node_id=node, reason=str(error))
            )

    def relinquish_stale(self, recorder: Recorder, error: SequenceConflict) -> None:
        """Cluster mode: an append found another head than this node's copy holds (another
        node appended meanwhile, e.g. while this one was fenced and before it claimed the
        workflow back).  Not a reason to mark the run stuck: the stale copy is dropped like
        a fenced workflow's, and if this node owns the workflow it recovers it from the store."""
        if not self._stop_locally(recorder):
            return
        workflow_id = recorder.workflow_id
        self._report_relinquished(
            workflow_id,
            "workflow relinquished: this node's copy of its history was stale (%s); it is recovered "
            "from the store by its owner",
            error,
        )
        try:
            self._epoch.spawn(self._recover_if_owned, workflow_id, name=f"recover-stale:{workflow_id}")
        except EngineEpochClosed:
            pass  # shutting down: the next engine recovers it

    async def _recover_if_owned(self, workflow_id: str) -> None:
        assert self._cluster is not None
        if await self._cluster.command_target(workflow_id) is not None:
            return  # another node owns it (its recovery carries it on)
        if workflow_id in self._recorders or workflow_id in self._loading:
            return  # recovered meanwhile (a sweep claimed it back): that copy is fresh
        await self._recover(workflow_id)

    async def take_fresh(self, workflow_id: str) -> None:
        """Cluster mode, before recovering a workflow this node has just claimed: forget
        what this node held of it.

        A node that was stopped (or cut off) past its lease can claim back a
        workflow another node owned meanwhile; its in-memory run and recorder
        are then stale, and its recovery must start from the store.  The old
        run and its attempts are cancelled (recording nothing) and an append
        already in flight under the recorder's lock is waited out.  An evicted run of it is
        forgotten too: its recovery starts from the store."""
        self._registry.take_evicted(workflow_id)
        recorder = self._recorders.get(workflow_id)
        if recorder is None:
            return
        if self._stop_locally(recorder):
            logger.info(
                "re-claimed a workflow this node was running: its run restarts from the store",
                extra={"workflow_id": workflow_id},
            )
        async with recorder.lock:
            pass

    def _stop_locally(self, recorder: Recorder) -> bool:
        """Drop ``recorder``'s workflow from this node: its recorder, and (``forget``) its
        runs, attempts and timers.  ``False``: it was already dropped."""
        workflow_id = recorder.workflow_id
        if self._recorders.get(workflow_id) is not recorder:
            return False
        del self._recorders[workflow_id]
        self._forget(workflow_id)
        recorder.notify()
        self._changed(workflow_id)
        return True

    def loaded_recorder(self, workflow_id: str) -> Recorder | None:
        return self._recorders.get(workflow_id)

    def drives(self, workflow_id: str) -> bool:
        """Whether a run of ``workflow_id`` is registered here, resident or evicted (this
        engine drives it)."""
        return bool(self._registry.leases_of(workflow_id)) or self._registry.evicted(workflow_id) is not None

    def claim_unloaded(self, workflow_id: str) -> Recorder | None:
        """An empty recorder for an id this engine has neither loaded nor is loading, or ``None``.

        For a start that expects a brand-new id: it appends at expected seq 0
        instead of reading a history that is almost always empty.  Until
        :meth:`release_unloaded`, :meth:`recorder_for` callers wait as for a load.
        """
        if workflow_id in self._recorders or workflow_id in self._loading:
            return None
        self._loading[workflow_id] = trio.Event()
        return Recorder(
            workflow_id,
            self._events,
            self._epoch,
            self._clock,
            observers=self._observers,
            on_fenced=self._on_fenced,
            # A conflict before release_unloaded (the id has history) drops nothing: not installed.
            on_stale=self._on_stale,
        )

    def release_unloaded(self, recorder: Recorder, *, adopt: bool) -> None:
        """End a :meth:`claim_unloaded`: install the recorder (its append landed) or drop it.

        Dropped, the next :meth:`recorder_for` loads the stored history.
        """
        if adopt:
            self._recorders[recorder.workflow_id] = recorder
            self._changed(recorder.workflow_id)
        self._loading.pop(recorder.workflow_id).set()
