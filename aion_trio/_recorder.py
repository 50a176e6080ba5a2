"""The recorder: the single writer of one workflow's history (docs/architecture.md, "One writer per history").

One recorder per workflow in an engine, shared by every run and lease of that
workflow.  It owns the tracked head, the history it has read and appended, and
a ``trio.Lock``.  Check-then-append decisions are made under the lock from the
in-memory history, so a long workflow costs O(events), not O(events²).

It never re-reads the store to resolve a ``SequenceConflict`` (that means a
second writer, and is reported).  When an append fails in any other way the
outcome is unknown — the commit may have landed and only the acknowledgement
been lost — so the history is marked stale and re-read before the next
decision; that re-read is how a retried completion finds its own earlier
terminal and takes the resume path instead of writing a second one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, final

import trio

from ._clock import EngineClock
from ._epoch import EngineEpoch
from ._errors import AionInternalError, NotOwner, SequenceConflict
from ._events import Event, EventBody, has_lifecycle, make_batch
from ._ids import validate_workflow_id
from ._logs import ContextLogger
from ._projections import RunState
from ._store import EventStore

if TYPE_CHECKING:
    from ._observe import ObservedLock, ObserverHub

logger = ContextLogger("aion_trio.recorder")


@final
class Recorder:
    """Serialises every append to one workflow's history."""

    def __init__(
        self,
        workflow_id: str,
        store: EventStore,
        epoch: EngineEpoch,
        clock: EngineClock,
        history: Sequence[Event] = (),
        *,
        observers: ObserverHub | None = None,
        on_fenced: Callable[[Recorder, NotOwner], None] | None = None,
        on_stale: Callable[[Recorder, SequenceConflict], None] | None = None,
    ) -> None:
        #: Checked once here: every batch this recorder envelopes carries it unchecked.
        self.workflow_id = validate_workflow_id(workflow_id)
        #: Called (synchronously, no checkpoint) when the store refuses an append with
        #: ``NotOwner``: the one place a fenced workflow is noticed (cluster mode).
        self.on_fenced = on_fenced
        #: Called likewise on ``SequenceConflict``: this copy of the history is stale, another
        #: node appended meanwhile (cluster mode; a store's lone writer never sees one).
        self.on_stale = on_stale
        #: The engine's observers (``None``: nobody observes, nothing is built).
        self.observers = observers
        #: Called (no checkpoint) after each append that landed: set on a recorder the engine
        #: dropped (its run evicted), so an append through a copy a caller still held wakes it.
        self.after_append: Callable[[Recorder], None] | None = None
        #: Set when the engine dropped this recorder (its run evicted): a holder that records
        #: later asks the engine for the workflow's current recorder instead.
        self.dropped = False
        self._store = store
        self._epoch = epoch
        self._clock = clock
        self._history: list[Event] = list(history)
        self._head = self._history[-1].seq if self._history else 0
        self._lock = trio.Lock()
        self._stale = False
        self._pending: list[Event] | None = None
        #: Records held back to share the next append (see :meth:`defer`): chunks of
        #: (recorded_at, bodies), oldest first.
        self._deferred: list[tuple[datetime, tuple[EventBody, ...]]] = []
        #: How many deferred chunks the append in flight carries.
        self._pending_deferred = 0
        # Made when someone waits and dropped when set, so that a recorder nobody waits
        # on holds none (a sleeping run waits on ``_changed`` only).
        self._changed: trio.Event | None = None
        self._lifecycle: trio.Event | None = None
        self._run_states: dict[str, RunState] = {}
        self.appends = 0
        self.rereads = 0

    @classmethod
    async def load(
        cls,
        workflow_id: str,
        store: EventStore,
        epoch: EngineEpoch,
        clock: EngineClock,
        *,
        observers: ObserverHub | None = None,
        on_fenced: Callable[[Recorder, NotOwner], None] | None = None,
        on_stale: Callable[[Recorder, SequenceConflict], None] | None = None,
    ) -> Recorder:
        """A recorder resumed at the stored head, with the stored history."""
        history = await store.read_history(workflow_id)
        return cls(
            workflow_id,
            store,
            epoch,
            clock,
            history,
            observers=observers,
            on_fenced=on_fenced,
            on_stale=on_stale,
        )

    @classmethod
    def resume_at(
        cls,
        workflow_id: str,
        store: EventStore,
        epoch: EngineEpoch,
        clock: EngineClock,
        history: Sequence[Event],
        *,
        observers: ObserverHub | None = None,
    ) -> Recorder:
        return cls(workflow_id, store, epoch, clock, history, observers=observers)

    # -- state -------------------------------------------------------------

    @property
    def lock(self) -> trio.Lock | ObservedLock:
        """The lock (``async with recorder.lock:``).  With observers, a wrapper whose
        release delivers what the holder observed meanwhile (never under the lock)."""
        if self.observers is None:
            return self._lock
        return self.observers.lock(self._lock)

    def hold(self) -> _Hold | ObservedLock:
        """``async with recorder.hold():`` -- the lock, taken without a scheduler
        round trip when it is free (the append that follows is the checkpoint);
        a cancelled caller still raises here, and a busy lock waits as usual."""
        if self.observers is None:
            return _Hold(self._lock)
        return self.observers.lock(self._lock, nowait=True)

    @property
    def head(self) -> int:
        return self._head

    @property
    def history(self) -> Sequence[Event]:
        """The history as this recorder knows it (append-only; treat as read-only)."""
        return self._history

    @property
    def stale(self) -> bool:
        return self._stale

    @property
    def clock(self) -> EngineClock:
        return self._clock

    @property
    def epoch(self) -> EngineEpoch:
        return self._epoch

    def run_state(self, run_id: str) -> RunState:
        """The incremental index of ``run_id``'s segment of :attr:`history`, synced to it.

        One per run, shared by the run's context and every guarded append: each
        event is indexed once, so a step's checks cost O(new events), not a scan
        of the history (the history only grows in place, so the cursor stays valid).
        """
        state = self._run_states.get(run_id)
        if state is None:
            state = self._run_states[run_id] = RunState(run_id, self._history)
        state.sync()
        return state

    def _require_lock(self) -> None:
        if self._lock.statistics().owner is not trio.lowlevel.current_task():
            raise AionInternalError(
                f"recorder of {self.workflow_id!r} used without holding its lock; please report this"
            )

    # -- reading -----------------------------------------------------------

    async def current_history(self, *, keep_deferred: bool = False) -> Sequence[Event]:
        """The history for a decision: re-read from the store first if stale.  Hold the lock.

        Deferred records (:meth:`defer`) are written first, so that the decision sees
        them, unless ``keep_deferred``: a caller whose decision they cannot change (an
        activity's own records, new commands) lets them share its own append instead.
        Once the epoch is closed nothing can be written and they stay unwritten.
        """
        self._require_lock()
        if self._stale:
            await self._reread()
        if self._deferred and not keep_deferred and self._epoch.is_open:
            await self.flush_deferred()
        return self._history

    async def _reread(self) -> None:
        stored = await self._store.read_history(self.workflow_id)
        self.rereads += 1
        stored_head = stored[-1].seq if stored else 0
        if stored_head == self._head:
            # The append of unknown outcome had not landed: its deferred records are still owed.
            self._stale = False
            self._pending = None
            self._pending_deferred = 0
            return
        pending = self._pending
        extra = stored[len(self._history) :]
        own_commit_landed = (
            pending is not None
            and stored_head == self._head + len(pending)
            and [e.body for e in extra] == [e.body for e in pending]
            and stored[: len(self._history)] == self._history
        )
        if not own_commit_landed:
            # Something other than this recorder wrote: a second writer.
            raise SequenceConflict(self.workflow_id, self._head, stored_head)
        logger.info(
            "append of unknown outcome had landed: adopting seqs %d..%d",
            self._head + 1,
            stored_head,
            extra={"workflow_id": self.workflow_id},
        )
        self._history.extend(extra)
        self._head = stored_head
        self._stale = False
        self._pending = None
        self._settle_deferred()
        self._grew(extra)
        if self.observers is not None:
            self.observers.appended(self._history, extra)

    # -- writing -----------------------------------------------------------

    async def append(
        self,
        bodies: Sequence[EventBody],
        *,
        action: str,
        run_id: str | None = None,
        at: datetime | None = None,
    ) -> list[Event]:
        """Append ``bodies`` as one batch.  Hold the lock.

        The epoch gate is checked here, under the lock, immediately before the
        write: every durable write of the engine passes this point.
        ``at`` overrides ``recorded_at`` (a terminal reuses its exit time).
        """
        self._require_lock()
        self._epoch.gate(self.workflow_id, run_id, action)
        if self._stale:
            await self._reread()
            self._epoch.gate(self.workflow_id, run_id, action)
        recorded_at = at if at is not None else self._clock.now()
        if self._deferred:
            events = self._deferred_events()
            events.extend(
                make_batch(
                    self.workflow_id, self._head + 1 + len(events), recorded_at, list(bodies), checked_id=True
                )
            )
        else:
            events = make_batch(self.workflow_id, self._head + 1, recorded_at, list(bodies), checked_id=True)
        if not events:
            return events
        self._pending = events
        try:
            await self._store.append(self.workflow_id, events, self._head)
        except SequenceConflict as exc:
            self._pending = None
            self._pending_deferred = 0
            if self.on_stale is not None:
                self.on_stale(self, exc)
            raise
        except NotOwner as exc:
            if self.on_fenced is None:
                self._stale = True  # as for any other failure: the outcome is treated as unknown
                raise
            # A fencing store refuses the whole batch: nothing was written.
            self._pending = None
            self._pending_deferred = 0
            self.on_fenced(self, exc)
            raise
        except trio.Cancelled:
            # Store contract: a cancelled append wrote nothing.
            self._pending = None
            self._pending_deferred = 0
            raise
        except BaseException:
            # Outcome unknown: the commit may have landed.
            self._stale = True
            raise
        self._pending = None
        self._settle_deferred()
        self._history.extend(events)
        self._head = events[-1].seq
        self.appends += 1
        self._grew(events)
        if self.observers is not None:
            self.observers.appended(self._history, events)
        if self.after_append is not None:
            self.after_append(self)
        return events

    # -- deferred records ------------------------------------------------------

    @property
    def busy(self) -> bool:
        """Whether the lock is held (an append in progress writes any deferred records)."""
        return self._lock.locked()

    @property
    def deferred(self) -> bool:
        """Whether records are held back, owed to the next append (:meth:`defer`)."""
        return bool(self._deferred)

    def defer(self, bodies: Sequence[EventBody], *, at: datetime) -> None:
        """Hold ``bodies`` back: they are written, stamped ``at``, at the front of this
        recorder's next append, whoever makes it.  Hold the lock.

        Only for records whose loss in a crash is harmless because replay re-creates
        them (the engine defers a just-scheduled activity's ``ActivityScheduled`` and
        first ``ActivityStarted`` so that they share one commit with its outcome).
        Nothing that a workflow observes may be deferred: an observation is
        recorded before it is observed.  The owner must see that they are written
        within a bounded time (:meth:`flush_deferred`).
        """
        self._require_lock()
        if bodies:
            self._deferred.append((at, tuple(bodies)))

    async def flush_deferred(self) -> list[Event]:
        """Write the deferred records now (one append; nothing if none are owed).  Hold the lock."""
        self._require_lock()
        if not self._deferred:
            return []
        return await self.append((), action="record deferred records")

    def _deferred_events(self) -> list[Event]:
        events: list[Event] = []
        for at, bodies in self._deferred:
            events.extend(
                make_batch(self.workflow_id, self._head + 1 + len(events), at, bodies, checked_id=True)
            )
        self._pending_deferred = len(self._deferred)
        return events

    def _settle_deferred(self) -> None:
        """The append that carried the deferred chunks landed: they are no longer owed."""
        if self._pending_deferred:
            del self._deferred[: self._pending_deferred]
            self._pending_deferred = 0

    # -- waiting -----------------------------------------------------------

    def _grew(self, events: Sequence[Event]) -> None:
        changed = self._changed
        if changed is not None:
            self._changed = None
            changed.set()
        lifecycle = self._lifecycle
        if lifecycle is not None and has_lifecycle(events):
            self._lifecycle = None
            lifecycle.set()

    async def wait_changed(self) -> None:
        """Park until the history grows (or the caller is cancelled)."""
        changed = self._changed
        if changed is None:
            changed = self._changed = trio.Event()
        await changed.wait()

    async def wait_lifecycle(self) -> None:
        """Park until a lifecycle event (a terminal, a start or a reopen) is appended,
        or :meth:`notify` is called: what a wait for a run's end needs, without
        waking for every activity record."""
        lifecycle = self._lifecycle
        if lifecycle is None:
            lifecycle = self._lifecycle = trio.Event()
        await lifecycle.wait()

    def notify(self) -> None:
        """Wake everything parked in :meth:`wait_changed` or :meth:`wait_lifecycle`
        (e.g. a status mark changed)."""
        changed, lifecycle = self._changed, self._lifecycle
        self._changed = self._lifecycle = None
        if changed is not None:
            changed.set()
        if lifecycle is not None:
            lifecycle.set()


@final
class _Hold:
    __slots__ = ("_lock",)

    def __init__(self, lock: trio.Lock) -> None:
        self._lock = lock

    async def __aenter__(self) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            self._lock.acquire_nowait()
        except trio.WouldBlock:
            await self._lock.acquire()

    async def __aexit__(self, *exc: object) -> None:
        self._lock.release()
