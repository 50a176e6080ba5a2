"""Admission: named pools of slots that bound the work in flight (flow control).

A pool has a name, a capacity (how many may hold one of its slots at once;
``None``: no bound) and a waiting policy: a caller that finds every slot taken
waits for one, as long as it takes (``timeout=None``) or at most ``timeout``
seconds, after which :class:`~aion_trio.AdmissionTimeout` is raised (``0``:
refused at once).  Waiters are admitted by priority (lower number first) and
first come, first served within a priority.  The engine keeps one pool for
starts (``EngineConfig.max_inflight_starts``), one for activity attempts
(``max_inflight_activities``) and one per :class:`FlowLimit` it is configured
with (per task queue, per activity type: ``EngineConfig.flow_limits``).

A pool built from a :class:`FlowLimit` may also hold, beside its local slot,
a *permit* from a :class:`Permits` source (the store's
:class:`~aion_trio.FlowStore`): a start counted against a rate (``rate``
starts per ``period``, durable, so a restart does not reset it) and a slot
counted across every engine of a store (``cluster_concurrency``, leased so a
dead node's slots come back).  The head waiter alone asks for the permit, so a
refusal never lets a later or lower-priority waiter pass it.

A caller whose own clock should stop while it waits (an activity attempt's
``timeout`` counts from the moment it really starts) passes a
:class:`Waiting`: ``queued()`` is called when it has to wait, ``started()``
once it holds the slot.  A caller whose wait a reader of the store should see
passes a :class:`WaitRecord`: ``begin()`` is awaited once, when the wait
blocks (a slot free at once records nothing), ``end()`` when it ends, however
it ends.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import math
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from datetime import datetime, timedelta
from typing import Protocol, final

import attrs
import trio

from ._errors import AdmissionTimeout, EngineEpochClosed, StoreError
from ._store import FlowStore, FlowWaiter

logger = logging.getLogger("aion_trio.admission")


class Waiting(Protocol):
    """Told when a caller has to wait for a slot, and when it got one."""

    def queued(self) -> None: ...

    def started(self) -> None: ...


class WaitRecord(Protocol):
    """Records a wait that blocks where others can see it (the store), and removes it."""

    async def begin(self) -> None: ...

    async def end(self) -> None: ...


def _seconds(value: object) -> float:
    return value.total_seconds() if isinstance(value, timedelta) else value  # type: ignore[return-value]


def _optional_bound(name: str) -> Callable[[object, attrs.Attribute[int | None], int | None], None]:
    def check(_: object, __: attrs.Attribute[int | None], value: int | None) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"FlowLimit.{name} must be an int >= 1 or None (no bound), got {value!r}")

    return check


@final
@attrs.frozen(kw_only=True)
class FlowLimit:
    """A bound on how much of one kind of work runs (docs/flow-control.md).

    ``concurrency``: at most this many at once in this engine.
    ``cluster_concurrency``: at most this many at once across every engine and
    remote worker on the store (needs a store with :class:`~aion_trio.FlowStore`;
    a node that dies gives its slots back after ``EngineConfig.flow_permit_ttl``).
    A workflow queue counts its admitted runs in the store, so there both bound
    the runs of every engine on it (the smaller holds).
    ``rate`` per ``period`` (seconds or a ``timedelta``): at most ``rate`` starts
    in any window of ``period``, counted in the store when it has
    :class:`~aion_trio.FlowStore` (a restart does not reset it).
    ``partitioned`` (workflow queues only): the limits apply per partition key.
    """

    concurrency: int | None = attrs.field(default=None, validator=_optional_bound("concurrency"))
    cluster_concurrency: int | None = attrs.field(
        default=None, validator=_optional_bound("cluster_concurrency")
    )
    rate: int | None = attrs.field(default=None, validator=_optional_bound("rate"))
    period: float = attrs.field(default=1.0, converter=_seconds)
    partitioned: bool = False

    @period.validator
    def _check_period(self, _: attrs.Attribute[float], value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise ValueError(f"FlowLimit.period must be a finite number of seconds > 0, got {value!r}")

    @property
    def needs_permit(self) -> bool:
        """Whether a start under it asks the permit source (a rate or a cluster bound)."""
        return self.rate is not None or self.cluster_concurrency is not None


@attrs.frozen(kw_only=True)
class Grant:
    """A permit source's answer: granted (``permit_id``, ``None`` when it holds
    nothing to release) or refused, with the seconds until a rate start frees up
    (``retry_after``; ``None``: wait for a release)."""

    granted: bool
    permit_id: str | None = None
    retry_after: float | None = None


class Permits(Protocol):
    """Where a pool's permits come from (the engine's adapter over the store)."""

    async def acquire(self, key: str, limit: FlowLimit) -> Grant: ...

    async def release(self, key: str, permit_id: str) -> None: ...


@final
class LocalRate:
    """A rate counted in memory (a store without :class:`~aion_trio.FlowStore`): at most
    ``limit.rate`` starts in any window of ``limit.period`` seconds of Trio time."""

    def __init__(self) -> None:
        self._starts: dict[str, deque[float]] = {}

    async def acquire(self, key: str, limit: FlowLimit) -> Grant:
        await trio.lowlevel.checkpoint()
        assert limit.rate is not None
        now = trio.current_time()
        starts = self._starts.setdefault(key, deque())
        while starts and starts[0] <= now - limit.period:
            starts.popleft()
        if len(starts) >= limit.rate:
            return Grant(granted=False, retry_after=starts[0] + limit.period - now)
        starts.append(now)
        return Grant(granted=True)

    async def release(self, key: str, permit_id: str) -> None:
        await trio.lowlevel.checkpoint()


@attrs.frozen(kw_only=True)
class PoolStatistics:
    """One admission pool now: ``held`` slots, ``waiting`` callers, its ``capacity``."""

    name: str
    capacity: int | None
    held: int
    waiting: int


@final
class _Waiter:
    """A caller waiting for a slot: ordered by (priority, arrival); its event wakes it.

    ``left``: it stopped waiting (timed out, cancelled) while not at the head; it stays
    in the heap, skipped, until it reaches the head or the heap is compacted.
    """

    __slots__ = ("event", "key", "left")

    def __init__(self, priority: int, arrival: int) -> None:
        self.key = (priority, arrival)
        self.event = trio.Event()
        self.left = False

    def __lt__(self, other: _Waiter) -> bool:
        return self.key < other.key


#: Seconds between two asks of a refused cluster-wide permit (a release elsewhere
#: wakes no one here).
PERMIT_POLL = 0.5


@final
class AdmissionPool:
    """A named bound on work in flight, with its waiting policy (see the module docstring).

    ``setting`` names what configures it (for the error's message), e.g.
    ``"EngineConfig.max_inflight_starts"``.  ``limit`` and ``permits``: the
    rate and cluster-wide bound asked of the permit source, under ``key``.
    """

    __slots__ = (
        "_heap",
        "_left",
        "_order",
        "_permit_busy",
        "bounds",
        "capacity",
        "held",
        "key",
        "limit",
        "name",
        "permits",
        "setting",
        "timeout",
    )

    def __init__(
        self,
        name: str,
        capacity: int | None,
        *,
        timeout: float | None = None,
        setting: str = "",
        limit: FlowLimit | None = None,
        permits: Permits | None = None,
        key: str = "",
    ) -> None:
        if capacity is not None and (
            isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1
        ):
            raise ValueError(
                f"the capacity of admission pool {name!r} must be an int >= 1 or None, got {capacity!r}"
            )
        if timeout is not None and not (
            isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and 0 <= timeout < math.inf
        ):
            raise ValueError(
                f"the timeout of admission pool {name!r} must be a finite number >= 0 or None, got {timeout!r}"
            )
        self.name = name
        self.capacity = capacity
        self.timeout = timeout
        self.setting = setting or name
        self.limit = limit if limit is not None and limit.needs_permit else None
        self.permits = permits if self.limit is not None else None
        self.key = key or name
        #: The pool's bounds as text, e.g. ``"concurrency=1, rate=2 per 10s"`` (what
        #: a recorded wait names).
        self.bounds = _bounds(capacity, limit)
        self.held = 0
        # Waiters: (priority, arrival) in a heap; the head is the next admitted and is
        # always one still waiting.  A waiter that leaves from elsewhere in the heap is
        # marked and counted in ``_left`` (O(1)); it is dropped when it reaches the head,
        # or with every other marked one when they outnumber the waiters still there.
        self._heap: list[_Waiter] = []
        self._left = 0
        self._order = itertools.count()
        self._permit_busy = False

    @property
    def waiting(self) -> int:
        """Callers waiting for a slot now."""
        return len(self._heap) - self._left

    def statistics(self) -> PoolStatistics:
        return PoolStatistics(name=self.name, capacity=self.capacity, held=self.held, waiting=self.waiting)

    def _free(self) -> bool:
        return self.capacity is None or self.held < self.capacity

    def _leave(self, entry: _Waiter) -> None:
        """Take ``entry`` out of the waiters: O(log n), amortised (no scan of the heap)."""
        heap = self._heap
        if heap[0] is entry:
            heapq.heappop(heap)
            while heap and heap[0].left:  # the head is always one still waiting
                heapq.heappop(heap)
                self._left -= 1
            return
        entry.left = True
        self._left += 1
        if self._left > len(heap) // 2:
            # More marked than waiting: rebuild from those still waiting, O(n) once per
            # n/2 departures.  The keys are unique, so the order is the same.
            self._heap = [waiter for waiter in heap if not waiter.left]
            heapq.heapify(self._heap)
            self._left = 0

    def _wake(self) -> None:
        """Wake the head waiter (it looks again whether it may go)."""
        if self._heap:
            self._heap[0].event.set()

    @contextlib.asynccontextmanager
    async def slot(
        self, waiting: Waiting | None = None, *, priority: int = 0, record: WaitRecord | None = None
    ) -> AsyncIterator[None]:
        """Hold one slot for the body of ``async with``.

        Takes a free slot without a scheduler round trip when no one waits and no
        permit is needed (the work it admits is the checkpoint); otherwise waits its
        turn by ``priority`` (lower first), then arrival.  Raises
        :class:`AdmissionTimeout` if the policy's ``timeout`` passes first.
        Cancelled while waiting: nothing is held.  An unbounded pool without a
        limit admits at once.  ``record``: its ``begin()`` is awaited when the
        wait first blocks, its ``end()`` when the wait ends (a slot taken at once
        records nothing).
        """
        if self.capacity is None and self.limit is None:
            yield
            return
        permit: str | None = None
        if not self._heap and self._free() and self.limit is None:  # the head is never a left one
            self.held += 1
        else:
            # Only the head waiter is woken (a release, the head leaving): one wake-up
            # per admission, however many wait.
            entry = _Waiter(priority, next(self._order))
            heapq.heappush(self._heap, entry)
            told = recorded = False
            # No cancel scope at all without a timeout: a waiting start costs its park only.
            bounded = None if self.timeout is None else trio.move_on_after(self.timeout)
            try:
                with bounded if bounded is not None else contextlib.nullcontext():
                    while True:
                        if self._heap[0] is entry and self._free() and not self._permit_busy:
                            got, permit, retry = await self._ask_permit()
                            if got:
                                break
                            if self._heap[0] is not entry:
                                self._wake()  # a waiter ahead came meanwhile: its turn to ask
                        else:
                            retry = math.inf
                        if not told and waiting is not None:
                            waiting.queued()
                            told = True
                        if entry.event.is_set():
                            entry.event = trio.Event()
                        if record is not None and not recorded:
                            # After the event is ready: a wake-up while it is written is not lost.
                            recorded = True
                            await record.begin()
                        if retry == math.inf:  # one cheap park: woken by the release
                            await entry.event.wait()
                        else:
                            with trio.move_on_after(retry):
                                await entry.event.wait()
                    self.held += 1  # before the next head is woken: it must see the slot taken
                if bounded is not None and bounded.cancelled_caught:
                    raise AdmissionTimeout(self.name, self.capacity or 0, self.timeout or 0.0, self.setting)
            finally:
                self._leave(entry)
                if self._free():
                    # The next head may go now (or wait its turn for a permit); with no
                    # slot left it is not woken: the next release wakes it.
                    self._wake()
                if recorded:
                    assert record is not None
                    await record.end()
            if told and waiting is not None:
                waiting.started()
        try:
            yield
        finally:
            self.held -= 1
            if permit is not None and self.permits is not None:
                with trio.CancelScope(shield=True), contextlib.suppress(Exception):
                    await self.permits.release(self.key, permit)
            self._wake()

    async def _ask_permit(self) -> tuple[bool, str | None, float]:
        """The head asks the permit source (if any): granted, its id, or seconds to wait."""
        if self.permits is None or self.limit is None:
            return True, None, 0.0
        self._permit_busy = True
        try:
            grant = await self.permits.acquire(self.key, self.limit)
        finally:
            self._permit_busy = False
        if grant.granted:
            return True, grant.permit_id, 0.0
        return False, None, PERMIT_POLL if grant.retry_after is None else max(grant.retry_after, 0.0)


def _bounds(capacity: int | None, limit: FlowLimit | None) -> str:
    """A pool's bounds as text: its local capacity, and its limit's cluster bound and rate."""
    parts = [] if capacity is None else [f"concurrency={capacity}"]
    if limit is not None:
        if limit.cluster_concurrency is not None:
            parts.append(f"cluster_concurrency={limit.cluster_concurrency}")
        if limit.rate is not None:
            parts.append(f"rate={limit.rate} per {limit.period:g}s")
    return ", ".join(parts)


def flow_key(kind: str, name: str) -> str:
    """The key a limit's permits are counted under in the store: ``kind:name``."""
    return f"{kind}:{name}"


@final
class FlowPools:
    """The engine's activity pools: one per configured limit (task queue, activity type)
    and the engine-wide ``max_inflight_activities`` pool, held in that order."""

    def __init__(
        self,
        engine_wide: AdmissionPool,
        *,
        task_queues: Mapping[str, FlowLimit] = {},
        activity_types: Mapping[str, FlowLimit] = {},
        permits: StorePermits | None = None,
    ) -> None:
        self.engine_wide = engine_wide
        self.permits = permits
        #: Whether some limit holds leased permits (a cluster-wide bound) to renew.
        self.leases_permits = any(
            limit.cluster_concurrency is not None
            for limit in (*task_queues.values(), *activity_types.values())
        )
        if permits is not None:
            permits.leases = self.leases_permits
        self.by_type = {
            name: _limit_pool(flow_key("activity", name), limit, permits, f"activity_limits[{name!r}]")
            for name, limit in activity_types.items()
        }
        #: What each waiting caller waits for now: ``who`` -> the pool's name.
        self.waiting_for: dict[object, str] = {}
        self.by_queue = {
            name: _limit_pool(flow_key("task_queue", name), limit, permits, f"task_queue_limits[{name!r}]")
            for name, limit in task_queues.items()
        }

    def pools(self, task_queue: str, activity_type: str) -> list[AdmissionPool]:
        """The pools an attempt of ``activity_type`` on ``task_queue`` holds, in order."""
        found = []
        pool = self.by_type.get(activity_type)
        if pool is not None:
            found.append(pool)
        pool = self.by_queue.get(task_queue)
        if pool is not None:
            found.append(pool)
        if self.engine_wide.capacity is not None:
            found.append(self.engine_wide)
        return found

    @property
    def bounded(self) -> bool:
        """Whether an attempt may ever wait here (some limit, or an engine-wide bound)."""
        return bool(self.by_type or self.by_queue or self.engine_wide.capacity is not None)

    def all(self) -> Iterable[AdmissionPool]:
        yield self.engine_wide
        yield from self.by_type.values()
        yield from self.by_queue.values()

    @contextlib.asynccontextmanager
    async def slots(
        self,
        task_queue: str,
        activity_type: str,
        waiting: Waiting | None,
        *,
        priority: int = 0,
        who: tuple[str, str, int] | None = None,
        attempt: int = 0,
    ) -> AsyncIterator[None]:
        """Hold a slot of every pool of the attempt (the same order for everyone: no
        deadlock); while ``who`` (workflow id, run id, activity id) waits,
        :attr:`waiting_for` names the pool, and a wait that blocks is recorded in
        the store (when it has :class:`~aion_trio.FlowStore`) for readers of it."""
        async with contextlib.AsyncExitStack() as stack:
            for pool in self.pools(task_queue, activity_type):
                noted = _Noted(self.waiting_for, who, pool.name, waiting)
                record = None
                if self.permits is not None and who is not None:
                    record = _StoreWait(self.permits, who, attempt, pool, priority)
                try:
                    await stack.enter_async_context(pool.slot(noted, priority=priority, record=record))
                finally:
                    self.waiting_for.pop(who, None)
            yield


@final
class _Noted:
    """A :class:`Waiting` that also notes, while its caller waits, which pool it waits for."""

    __slots__ = ("book", "inner", "pool", "who")

    def __init__(self, book: dict[object, str], who: object, pool: str, inner: Waiting | None) -> None:
        self.book = book
        self.who = who
        self.pool = pool
        self.inner = inner

    def queued(self) -> None:
        self.book[self.who] = self.pool
        if self.inner is not None:
            self.inner.queued()

    def started(self) -> None:
        self.book.pop(self.who, None)
        if self.inner is not None:
            self.inner.started()


@final
class _StoreWait:
    """A :class:`WaitRecord` writing the wait of an activity attempt to the store
    (:class:`~aion_trio.FlowWaiter`), renewed with the engine's permits.  A store
    error is logged, not raised: the attempt still waits for its slot."""

    __slots__ = ("attempt", "permits", "pool", "priority", "who")

    def __init__(
        self,
        permits: StorePermits,
        who: tuple[str, str, int],
        attempt: int,
        pool: AdmissionPool,
        priority: int,
    ) -> None:
        self.permits = permits
        self.who = who
        self.attempt = attempt
        self.pool = pool
        self.priority = priority

    async def begin(self) -> None:
        permits = self.permits
        workflow_id, run_id, activity_id = self.who
        now = permits.now()
        waiter = FlowWaiter(
            workflow_id=workflow_id,
            run_id=run_id,
            activity_id=activity_id,
            attempt=self.attempt,
            pool=self.pool.name,
            limit=self.pool.bounds,
            priority=self.priority,
            since=now,
            holder=permits.holder,
        )
        permits.waits += 1
        try:
            await permits.store.record_flow_waiter(waiter, ttl=permits.ttl, now=now)
        except (StoreError, trio.ClosedResourceError) as exc:
            logger.warning("could not record that an attempt waits for a flow slot: %s", exc)

    async def end(self) -> None:
        permits = self.permits
        permits.waits -= 1
        if permits.spawn is not None:
            # In the background: the admitted attempt does not wait for the write (at a
            # bound of 1 the slot would be held through it).  Submitted now, so it is
            # written before any later wait of this activity (a retry) is recorded.
            with contextlib.suppress(EngineEpochClosed):
                permits.spawn(self._remove, name="flow-wait-removal")
                return
        await self._remove()

    async def _remove(self) -> None:
        # Shielded and bounded: a cancelled wait still removes its record, a hung store
        # does not hold the attempt (the record lapses with its ttl anyway).
        permits = self.permits
        with trio.CancelScope(shield=True), trio.move_on_after(permits.ttl):
            try:
                await permits.store.remove_flow_waiter(*self.who)
            except (StoreError, trio.ClosedResourceError) as exc:
                logger.warning("could not remove the record of a flow wait that ended: %s", exc)


def _limit_pool(key: str, limit: FlowLimit, permits: Permits | None, setting: str) -> AdmissionPool:
    return AdmissionPool(
        key,
        limit.concurrency,
        setting=f"EngineConfig.{setting}",
        limit=limit,
        permits=permits if permits is not None else (LocalRate() if limit.rate is not None else None),
        key=key,
    )


@final
class StorePermits:
    """Permits counted in the store (its :class:`~aion_trio.FlowStore`), held by
    ``holder`` (this engine) for ``ttl`` seconds and renewed by :meth:`keep_alive`,
    so the slots of an engine that died come back once its permits expire."""

    def __init__(
        self,
        store: FlowStore,
        *,
        holder: str,
        ttl: float,
        now: Callable[[], datetime],
        spawn: Callable[..., None] | None = None,
    ) -> None:
        self.store = store
        self.holder = holder
        self.ttl = ttl
        self.now = now
        #: Starts a background task (the engine epoch's ``spawn``): where the record of a
        #: wait that ended is removed; ``None``: removed inline.
        self.spawn = spawn
        #: Waits of this engine's attempts recorded in the store now (renewed with the permits).
        self.waits = 0
        #: Whether a limit holds leased permits (a cluster-wide bound) to renew.
        self.leases = False

    async def acquire(self, key: str, limit: FlowLimit) -> Grant:
        grant = await self.store.acquire_flow_permit(
            key,
            holder=self.holder,
            concurrency=limit.cluster_concurrency,
            rate=limit.rate,
            period=limit.period,
            ttl=self.ttl,
            now=self.now(),
        )
        return Grant(granted=grant.granted, permit_id=grant.permit_id, retry_after=grant.retry_after)

    async def release(self, key: str, permit_id: str) -> None:
        await self.store.release_flow_permit(key, permit_id)

    async def keep_alive(self) -> None:
        """Renew this engine's permits and recorded waits at a third of their ttl, for
        as long as it runs (a store error is retried at the next beat: they last a
        ttl); a beat with neither leased permits nor recorded waits writes nothing."""
        while True:
            await trio.sleep(self.ttl / 3)
            if self.leases or self.waits:
                with contextlib.suppress(StoreError):
                    await self.store.renew_flow_permits(self.holder, ttl=self.ttl, now=self.now())
