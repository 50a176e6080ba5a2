"""The store contract (docs/writing-a-store-plugin.md, "The contract").

Stores never import the engine.  Every async method is a Trio checkpoint
(cancel point and schedule point); cancellation never leaves a half-done
write: an append either committed its whole batch or wrote nothing.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Protocol, runtime_checkable

import attrs

from ._commands import Command, CommandOutcome, PendingCommand
from ._errors import InvalidBatch, InvalidQuery, StoreTakenOver
from ._events import Event, SearchValue, WorkflowStatus, validate_search_attributes, validate_search_key
from ._ownership import OwnerClaim, OwnerIdentity


@attrs.frozen(kw_only=True, order=True)
class TimerEntry:
    """A row of the timer index: a hint of when to look; history decides whether it fired."""

    fire_at: datetime
    workflow_id: str
    timer_id: str


@runtime_checkable
class EventStore(Protocol):
    """Append-only per-workflow event histories plus a timer index.

    Contract (checked by :func:`aion_trio.testing.check_event_store`):

    * ``append(workflow_id, events, expected_seq)``: all or nothing.  If the
      stored head (0 when empty) is not ``expected_seq`` raise
      :class:`~aion_trio.SequenceConflict` and write nothing.  ``events`` must
      be non-empty, all of ``workflow_id``, with seqs ``expected_seq+1,
      expected_seq+2, ...`` or :class:`~aion_trio.InvalidBatch` is raised and
      nothing written.  Cancellation: the batch is either wholly committed or
      not at all.
    * ``read_history(workflow_id, from_seq=1)``: events in ascending seq;
      an unknown workflow or ``from_seq`` past the head gives ``[]``.
    * ``list_active()``: ids of workflows whose projected status is active
      (:func:`aion_trio.projections.is_active_status`).
    * ``list_workflow_ids()``: every workflow with at least one event.
    * ``schedule_timer`` upserts ``(workflow_id, timer_id) -> fire_at``;
      ``remove_timer`` deletes it (absent is fine); ``expired_timers(as_of)``
      returns entries with ``fire_at <= as_of`` ordered by
      ``(fire_at, workflow_id, timer_id)``.
    * ``aclose()`` is idempotent; any other call after it raises
      ``trio.ClosedResourceError``.
    """

    async def append(self, workflow_id: str, events: Sequence[Event], expected_seq: int) -> None: ...

    async def read_history(self, workflow_id: str, from_seq: int = 1) -> list[Event]: ...

    async def list_active(self) -> list[str]: ...

    async def list_workflow_ids(self) -> list[str]: ...

    async def schedule_timer(self, workflow_id: str, timer_id: str, fire_at: datetime) -> None: ...

    async def remove_timer(self, workflow_id: str, timer_id: str) -> None: ...

    async def expired_timers(self, as_of: datetime) -> list[TimerEntry]: ...

    async def aclose(self) -> None: ...


@attrs.frozen(kw_only=True)
class VisibilityRow:
    """What list/search operations see of a workflow (its latest run)."""

    workflow_id: str
    run_id: str
    workflow_type: str
    status: WorkflowStatus
    start_time: datetime = attrs.field()
    close_time: datetime | None = attrs.field(default=None)
    task_queue: str = "default"
    failed_step: str | None = None
    failure_reason: str | None = None
    search_attributes: Mapping[str, SearchValue] = attrs.field(
        factory=dict, converter=validate_search_attributes
    )
    stuck_reason: str | None = None

    @start_time.validator
    def _aware_start(self, attribute: attrs.Attribute[datetime], value: datetime) -> None:
        if value.tzinfo is None:
            raise ValueError("start_time must be timezone-aware")

    @close_time.validator
    def _aware_close(self, attribute: attrs.Attribute[datetime | None], value: datetime | None) -> None:
        if value is not None and value.tzinfo is None:
            raise ValueError("close_time must be timezone-aware")


class SearchOp(enum.Enum):
    """Search-attribute predicate operators.

    * ``EQUALS``: same kind and equal value (int and float compare
      numerically; bool only equals bool; a list equals a list of the same
      strings in the same order).
    * ``GREATER`` / ``LESS``: strict; both numbers (not bool), or both
      strings (code-point order).  Other kind pairs never match.
    * ``CONTAINS``: the attribute is a list holding the string, or a string
      containing it (case-sensitive).
    A predicate on an attribute the row lacks never matches.
    """

    EQUALS = "equals"
    GREATER = "greater"
    LESS = "less"
    CONTAINS = "contains"


def _predicate_value(value: object) -> SearchValue:
    if isinstance(value, list):
        value = tuple(value)
    if isinstance(value, tuple):
        if not all(isinstance(v, str) for v in value):
            raise InvalidQuery("a list value in a search predicate must hold only str")
        return value
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        raise InvalidQuery(f"search predicate value {value!r} is not a finite number")
    if isinstance(value, (str, int, float, bool)):
        return value
    raise InvalidQuery(
        f"search predicate value of type {type(value).__name__} is not supported "
        "(use str, int, float, bool or a list of str)"
    )


@attrs.frozen(kw_only=True)
class SearchPredicate:
    """One condition of a ``VisibilityFilter``: search attribute ``key`` compared with ``value`` by ``op``
    (``SearchOp``); bad input raises ``InvalidQuery``.
    """

    key: str
    op: SearchOp
    value: SearchValue = attrs.field(converter=_predicate_value)

    def __attrs_post_init__(self) -> None:
        try:
            validate_search_key(self.key)
        except ValueError as exc:
            raise InvalidQuery(str(exc)) from None
        if not isinstance(self.op, SearchOp):
            raise InvalidQuery(f"unknown search operator {self.op!r}")
        if self.op in (SearchOp.GREATER, SearchOp.LESS) and isinstance(self.value, (bool, tuple)):
            raise InvalidQuery(f"{self.op.value} needs a number or a string, got {self.value!r}")
        if self.op is SearchOp.CONTAINS and not isinstance(self.value, str):
            raise InvalidQuery(f"contains needs a string, got {self.value!r}")

    def matches(self, attributes: Mapping[str, SearchValue]) -> bool:
        """The reference semantics (the memory store uses this)."""
        if self.key not in attributes:
            return False
        have = attributes[self.key]
        want = self.value
        if self.op is SearchOp.EQUALS:
            if isinstance(have, bool) or isinstance(want, bool):
                return isinstance(have, bool) and isinstance(want, bool) and have == want
            if isinstance(have, (int, float)) and isinstance(want, (int, float)):
                return have == want
            if type(have) is not type(want):
                return False
            return have == want
        if self.op in (SearchOp.GREATER, SearchOp.LESS):
            if isinstance(have, (bool, tuple)):
                return False
            numbers = isinstance(have, (int, float)) and isinstance(want, (int, float))
            strings = isinstance(have, str) and isinstance(want, str)
            if not (numbers or strings):
                return False
            return have > want if self.op is SearchOp.GREATER else have < want  # type: ignore[operator]
        # CONTAINS
        assert isinstance(want, str)
        if isinstance(have, tuple):
            return want in have
        if isinstance(have, str):
            return want in have
        return False


def _statuses(
    value: WorkflowStatus | str | Iterable[WorkflowStatus | str] | None,
) -> frozenset[WorkflowStatus] | None:
    if value is None:
        return None
    if isinstance(value, (WorkflowStatus, str)):
        value = [value]
    try:
        items = list(value)
    except TypeError:
        raise InvalidQuery(
            f"status must be a WorkflowStatus, its name, or several of them, got {value!r}"
        ) from None
    return frozenset(_status(s) for s in items)


def _status(value: object) -> WorkflowStatus:
    if isinstance(value, WorkflowStatus):
        return value
    if isinstance(value, str):
        try:
            return WorkflowStatus(value.lower())
        except ValueError:
            pass
    known = ", ".join(repr(s.value) for s in WorkflowStatus)
    raise InvalidQuery(f"status filter values must be WorkflowStatus or one of {known}, got {value!r}")


def _predicates(value: Iterable[SearchPredicate]) -> tuple[SearchPredicate, ...]:
    out = tuple(value)
    for p in out:
        if not isinstance(p, SearchPredicate):
            raise InvalidQuery(f"search filters must be SearchPredicate, got {p!r}")
    return out


@attrs.frozen(kw_only=True)
class VisibilityFilter:
    """Which rows ``list``/``count`` return.  All conditions must hold.

    ``status`` takes a :class:`WorkflowStatus`, its value (``"running"``), or
    several of either.  Time bounds are inclusive and must be timezone-aware.  A close-time bound
    excludes rows that have not closed.  Rows are ordered by
    ``(start_time, workflow_id)`` ascending, or descending with
    ``newest_first``; ``limit``/``offset`` apply after ordering.
    ``count`` ignores ``limit`` and ``offset``.
    """

    workflow_type: str | None = None
    status: frozenset[WorkflowStatus] | None = attrs.field(default=None, converter=_statuses)
    task_queue: str | None = None
    started_after: datetime | None = None
    started_before: datetime | None = None
    closed_after: datetime | None = None
    closed_before: datetime | None = None
    search: tuple[SearchPredicate, ...] = attrs.field(default=(), converter=_predicates)
    limit: int | None = None
    offset: int = 0
    newest_first: bool = False

    def __attrs_post_init__(self) -> None:
        for name in ("started_after", "started_before", "closed_after", "closed_before"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, datetime) or value.tzinfo is None):
                raise InvalidQuery(f"{name} must be a timezone-aware datetime, got {value!r}")
        if self.limit is not None and (
            isinstance(self.limit, bool) or not isinstance(self.limit, int) or self.limit < 0
        ):
            raise InvalidQuery(f"limit must be an int >= 0 or None, got {self.limit!r}")
        if isinstance(self.offset, bool) or not isinstance(self.offset, int) or self.offset < 0:
            raise InvalidQuery(f"offset must be an int >= 0, got {self.offset!r}")

    def matches(self, row: VisibilityRow) -> bool:
        """The reference semantics of everything but ordering and paging."""
        if self.workflow_type is not None and row.workflow_type != self.workflow_type:
            return False
        if self.status is not None and row.status not in self.status:
            return False
        if self.task_queue is not None and row.task_queue != self.task_queue:
            return False
        if self.started_after is not None and row.start_time < self.started_after:
            return False
        if self.started_before is not None and row.start_time > self.started_before:
            return False
        if self.closed_after is not None and (row.close_time is None or row.close_time < self.closed_after):
            return False
        if self.closed_before is not None and (row.close_time is None or row.close_time > self.closed_before):
            return False
        return all(p.matches(row.search_attributes) for p in self.search)

    def apply(self, rows: Iterable[VisibilityRow]) -> list[VisibilityRow]:
        """Filter, order and page ``rows`` (the reference implementation)."""
        chosen = sorted((r for r in rows if self.matches(r)), key=lambda r: (r.start_time, r.workflow_id))
        if self.newest_first:
            # Stable: workflow_id stays ascending within one start_time.
            chosen.sort(key=lambda r: r.start_time, reverse=True)
        end = None if self.limit is None else self.offset + self.limit
        return chosen[self.offset : end]


@runtime_checkable
class VisibilityStore(Protocol):
    """Rows for listing and searching workflows, one per workflow id (latest run).

    ``upsert`` replaces the row of ``row.workflow_id``; ``get`` returns it or
    ``None``; ``list``/``count`` follow :class:`VisibilityFilter`.  Every value
    is bound as a parameter.  Same checkpoint and close rules as
    :class:`EventStore`.
    """

    async def upsert(self, row: VisibilityRow) -> None: ...

    async def get(self, workflow_id: str) -> VisibilityRow | None: ...

    async def list(self, filter: VisibilityFilter | None = None) -> list[VisibilityRow]: ...

    async def count(self, filter: VisibilityFilter | None = None) -> int: ...

    async def aclose(self) -> None: ...


@runtime_checkable
class Store(Protocol):
    """What a store plugin's opener yields: an event store and a visibility store."""

    @property
    def events(self) -> EventStore: ...

    @property
    def visibility(self) -> VisibilityStore: ...

    async def aclose(self) -> None: ...


@runtime_checkable
class OwnedStore(Protocol):
    """Optional capability: one owning engine per store (docs/architecture.md, "One writer per history").

    Implemented by the object a store plugin's opener yields (next to
    ``events`` and ``visibility``); the engine detects it at runtime and a
    store without it simply has no ownership.  The takeover rule is
    :mod:`aion_trio._ownership`'s (:func:`~aion_trio.plugin.decide_claim`).

    * ``claim_owner(identity, now=, stale_after=)``: atomically read the
      claim and, per the rule, store and return ``identity``'s claim, or raise
      :class:`~aion_trio.StoreOwned` naming the live owner and write nothing.
      Of concurrent claimants (other handles, other processes) exactly one wins.
    * ``renew_owner(claim, now=)``: the heartbeat; returns the renewed claim,
      or raises :class:`~aion_trio.StoreTakenOver` when the stored claim is no longer
      ``claim``'s (taken over, or released).
    * ``release_owner(claim)``: drop the claim if it is still ``claim``'s
      (otherwise do nothing); idempotent.
    * ``current_owner()``: the stored claim or ``None``, live or not.

    The claim survives closing and reopening the store (a crashed owner
    leaves it behind).  Every method is a checkpoint; same close rules as
    :class:`EventStore`.  A store shared between processes should also
    fence (refuse with ``StoreTakenOver``, writing nothing, every write made through
    a handle whose claim is no longer the stored one) and offer
    :class:`ThreadRenewal`.
    """

    async def claim_owner(
        self, identity: OwnerIdentity, *, now: datetime, stale_after: timedelta
    ) -> OwnerClaim: ...

    async def renew_owner(self, claim: OwnerClaim, *, now: datetime) -> OwnerClaim: ...

    async def release_owner(self, claim: OwnerClaim) -> None: ...

    async def current_owner(self) -> OwnerClaim | None: ...


@runtime_checkable
class ThreadRenewal(Protocol):
    """Optional, with :class:`OwnedStore`: the heartbeat without Trio.

    ``renew_owner_blocking(claim, now=)`` does what ``renew_owner`` does, but
    blocks: the engine calls it from its heartbeat thread, so heartbeats go on
    while the Trio loop is blocked (an activity that never yields).  It must
    be safe to call from any thread while the store is in use, and after it
    closed (then it may raise ``BackendUnavailable``).
    """

    def renew_owner_blocking(self, claim: OwnerClaim, *, now: datetime) -> OwnerClaim: ...


@runtime_checkable
class CommandInbox(Protocol):
    """Optional capability: commands for the store's owner from processes that are not it.

    * ``enqueue_command(command)``: store it durably; returns its id, an int
      larger than every id given before (the inbox is FIFO by id).  A command
      whose ``request_id`` is set and already queued (pending or acked) is not
      added again: the first one's id is returned.
    * ``pending_commands(limit=100)``: un-acked commands, oldest first, at
      most ``limit``.
    * ``ack_command(command_id, outcome)``: mark it done with ``outcome``;
      it leaves ``pending_commands``.  Acking an acked command keeps the first
      outcome; an unknown id raises :class:`~aion_trio.NotFound`.
    * ``command_outcome(command_id)``: the outcome, ``None`` while pending,
      :class:`~aion_trio.NotFound` for an unknown id.

    Commands and outcomes survive closing and reopening the store.  Every
    method is a checkpoint; same close rules as :class:`EventStore`.
    """

    async def enqueue_command(self, command: Command) -> int: ...

    async def pending_commands(self, limit: int = 100) -> list[PendingCommand]: ...

    async def ack_command(self, command_id: int, outcome: CommandOutcome) -> None: ...

    async def command_outcome(self, command_id: int) -> CommandOutcome | None: ...


@runtime_checkable
class RecoveryCounts(Protocol):
    """Optional capability: how often each workflow's recovery began without finishing.

    The engine counts a recovery when it resumes a workflow's running run and
    clears the count once the recovery's risky part (replaying the code and
    re-running the activity attempts that were in flight) is over, or the run
    ends.  A count that keeps growing means the process dies while it recovers
    that run (a poison run); past ``EngineConfig.max_recovery_attempts`` the
    engine marks it stuck instead of running it again.  A store without this
    capability has no poison-run detection.

    * ``count_recoveries(workflow_ids)``: add one to the count of each id (an
      absent count is 0), all in one durable write; returns the new counts.
    * ``clear_recoveries(workflow_ids)``: drop those counts (an absent one is
      no error), in one write.
    * ``recovery_counts()``: every count that is not zero.

    Counts survive closing and reopening the store.  Every method is a
    checkpoint; same close rules as :class:`EventStore`.
    """

    async def count_recoveries(self, workflow_ids: Sequence[str]) -> dict[str, int]: ...

    async def clear_recoveries(self, workflow_ids: Sequence[str]) -> None: ...

    async def recovery_counts(self) -> dict[str, int]: ...


@runtime_checkable
class BulkHistoryReads(Protocol):
    """Optional capability: the histories of many workflows in one call.

    The engine's recovery reads every active workflow's history when it opens;
    a store with this capability answers a batch of ids at once (one query per
    batch, not one round trip per workflow).  A store without it is read one
    workflow at a time through :meth:`EventStore.read_history`.

    * ``read_histories(workflow_ids)``: a dict with one key per distinct id of
      ``workflow_ids``, each holding what ``read_history(workflow_id)`` returns
      (the whole history in ascending seq; ``[]`` for an unknown workflow).  A
      sequence that is one str, or an id that is not a non-empty str, raises
      ``TypeError``/``ValueError`` (:func:`~aion_trio.plugin.validate_workflow_ids`)
      and reads nothing.  Each history is read whole at one moment; different
      workflows' histories may be read at different moments (a store may split
      a large batch).

    Implemented by the object a store plugin's opener yields (next to
    ``events`` and ``visibility``).  Every call is a checkpoint; same close
    rules as :class:`EventStore`.
    """

    async def read_histories(self, workflow_ids: Sequence[str]) -> dict[str, list[Event]]: ...


@runtime_checkable
class ClusterStore(Protocol):
    """Optional capability: several engines share one store, each workflow owned by one node.

    Offered by a store opened with a node identity (PostgreSQL with
    ``?node=NAME``); the engine detects it at runtime and runs in cluster
    mode.  Ownership is per workflow and fenced by the store: an append for
    a workflow another node has claimed raises :class:`~aion_trio.WorkflowFenced`
    and writes nothing.

    * ``node_id``: this node's identity.
    * ``owned_active()``: active workflows owned by this node id, re-claimed
      (their fencing epoch bumped) so an engine restarted under the same id
      takes them back and fences its previous incarnation.
    * ``claim_orphans(limit)``: in one transaction, claim at most ``limit``
      active workflows that no node owns or whose owner's lease has expired
      by the store's clock; concurrent callers on several nodes never claim
      the same workflow.  Returns the claimed ids.
    * ``lease_valid()``: this node's local judgement that its lease is still
      live (the send time of the last successful renewal, plus the lease's
      length, minus a safety margin, is still ahead).  No I/O.  A node whose
      lease is not valid starts no side effect.
    * ``wait_for_work(timeout)``: returns when the store signals work for
      this node or the cluster (a notification) or after ``timeout``
      seconds; callers always re-check the store afterwards (polling backs
      notifications, which may be lost).
    * ``command_target(workflow_id)``: ``None`` when commands for the
      workflow are applied by this node (it owns it, or no live node does and
      it is not active, or it does not exist); otherwise the id of the node
      that owns it (``""``: an active workflow whose owner is gone, which the
      next claim will own).  Commands for such a workflow go through the
      store's :class:`CommandInbox`.
    * ``fenced_out()``: ``None`` while this node may still own workflows; the
      :class:`~aion_trio.StoreTakenOver` that ended it once it never can again (a
      newer incarnation of its node id took everything over).  No I/O.  The
      engine then stops, raising it out of ``open_engine``, instead of idling.
    """

    @property
    def node_id(self) -> str: ...

    async def owned_active(self) -> list[str]: ...

    async def claim_orphans(self, limit: int) -> list[str]: ...

    def lease_valid(self) -> bool: ...

    async def wait_for_work(self, timeout: float) -> None: ...

    async def command_target(self, workflow_id: str) -> str | None: ...

    def fenced_out(self) -> StoreTakenOver | None: ...


# --------------------------------------------------------------------------
# Schedules (optional capability; engine.schedules, docs/schedules.md)
# --------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class StoredSchedule:
    """A schedule as a store holds it: its id, its version (1 when created, one more per
    write) and its definition and state as JSON text, which the store does not read."""

    schedule_id: str
    version: int
    data: str


@runtime_checkable
class ScheduleStore(Protocol):
    """Optional capability: durable schedules (``engine.schedules``).

    A store holds each schedule as an opaque JSON text under a version that
    is bumped by every write, so several writers (engines of a cluster, the
    command line) change one schedule only by compare-and-set:

    * ``create_schedule(schedule_id, data)``: store it at version 1 and
      return it, or raise :class:`~aion_trio.ScheduleAlreadyExists` (an id
      that exists, whatever its data) and write nothing.  Of concurrent
      creators of one id exactly one wins.
    * ``read_schedule(schedule_id)``: the stored schedule or ``None``.
    * ``list_schedules()``: every stored schedule, ordered by id.
    * ``write_schedule(schedule_id, data, expected_version)``: replace the
      data and bump the version by one if the stored version is
      ``expected_version``; return the new record.  Otherwise raise
      :class:`~aion_trio.ScheduleConflict` (``found`` the stored version, 0
      when the schedule does not exist) and write nothing.  Of concurrent
      writers with the same expected version exactly one wins.
    * ``delete_schedule(schedule_id)``: remove it; ``True`` if it existed.

    Schedules survive closing and reopening the store.  Every method is a
    checkpoint; same close rules as :class:`EventStore`.
    """

    async def create_schedule(self, schedule_id: str, data: str) -> StoredSchedule: ...

    async def read_schedule(self, schedule_id: str) -> StoredSchedule | None: ...

    async def list_schedules(self) -> list[StoredSchedule]: ...

    async def write_schedule(self, schedule_id: str, data: str, expected_version: int) -> StoredSchedule: ...

    async def delete_schedule(self, schedule_id: str) -> bool: ...


# --------------------------------------------------------------------------
# Flow control (optional capability; limits and workflow queues, docs/flow-control.md)
# --------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class FlowGrant:
    """A store's answer to :meth:`FlowStore.acquire_flow_permit`.

    Granted: ``permit_id`` names the slot taken (``None`` when only a rate start
    was counted: nothing to release).  Refused: nothing was written;
    ``retry_after`` is the seconds until the rate frees a start, ``None`` when
    every slot is taken (ask again after a release).
    """

    granted: bool
    permit_id: str | None = None
    retry_after: float | None = None


QUEUED = "queued"
"""A :class:`QueuedRun`'s state while it waits in its queue for a slot."""
ADMITTED = "admitted"
"""A :class:`QueuedRun`'s state once admitted: it holds a slot of its queue (and partition)
until its run closes; the engine starts it if it was not started yet."""


@attrs.frozen(kw_only=True)
class QueuedRun:
    """A workflow run waiting in (or admitted from) a workflow queue.

    ``seq`` is given by the store at enqueue (increasing per store); ``state``
    is ``"queued"`` or ``"admitted"``; ``data`` is the engine's JSON text (what
    to start), which the store does not read.  ``partition_key`` is ``""``
    outside a partitioned queue.
    """

    queue: str
    workflow_id: str
    partition_key: str = ""
    priority: int = 0
    dedup_id: str | None = None
    seq: int = 0
    state: str = QUEUED
    data: str = "{}"


@attrs.frozen(kw_only=True)
class FlowWaiter:
    """An activity attempt waiting for a slot of a flow-control pool, as its engine
    recorded it in the store (:meth:`FlowStore.record_flow_waiter`), so that a reader
    of the store (``aion-trio show``) sees the wait.

    ``pool`` names the pool (e.g. ``"activity:charge"``, ``"task_queue:emails"``,
    ``"activities"``), ``limit`` its bounds as text (e.g. ``"concurrency=1"``);
    ``since`` is when the wait began, ``priority`` the attempt's.  ``holder`` is the
    recording engine; the record lapses at ``expires_at`` (set by the store: ``now +
    ttl`` when recorded or renewed) unless that engine renews it, so the record of an
    engine that died stops counting as a wait.
    """

    workflow_id: str
    run_id: str
    activity_id: int
    attempt: int
    pool: str
    limit: str
    priority: int = 0
    since: datetime
    holder: str
    expires_at: datetime | None = None


@runtime_checkable
class FlowStore(Protocol):
    """Optional capability: what flow control keeps in the store.

    Permits (limits on activity attempts):

    * ``acquire_flow_permit(key, holder=, concurrency=, rate=, period=, ttl=, now=)``:
      in one atomic step, forget ``key``'s permits that expired (``expires_at <=
      now``) and its starts older than ``now - period``; then refuse (write
      nothing) if ``concurrency`` permits are held (``retry_after=None``) or
      ``rate`` starts lie in the window (``retry_after``: seconds until the
      oldest leaves it); otherwise count a start (if ``rate``) and take a permit
      held by ``holder`` until ``now + ttl`` (if ``concurrency``).  A store with
      its own clock (a database server) may judge expiry and windows by it.
    * ``release_flow_permit(key, permit_id)``: give it back; ``True`` if held.
    * ``renew_flow_permits(holder, ttl=, now=)``: every unexpired permit and
      waiter record (below) of ``holder`` now expires at ``now + ttl``; returns
      how many (permits and waiter records together).
    * ``held_flow_permits(key, now=)``: unexpired permits of ``key``.

    Waiter records (an attempt waiting for a slot, :class:`FlowWaiter`; written
    only by a wait that blocks, removed when it ends):

    * ``record_flow_waiter(waiter, ttl=, now=)``: store it, replacing the record
      of the same ``(workflow_id, run_id, activity_id)``, with ``expires_at =
      now + ttl`` (the ``expires_at`` passed is ignored).
    * ``remove_flow_waiter(workflow_id, run_id, activity_id)``: ``True`` if there.
    * ``flow_waiters(workflow_id, now=)``: the workflow's unexpired records
      (``expires_at > now``), ordered by ``(run_id, activity_id)``.
    * ``clear_flow_waiters()``: remove every record; returns how many (an engine
      that alone serves the store calls it when it opens: any record there was
      left by an engine that died).

    Workflow queues (entries live while queued or admitted):

    * ``enqueue_flow_run(run)``: store it with the next ``seq`` in state
      queued and return ``(stored, True)``; if an entry of the same queue holds
      the same non-``None`` ``dedup_id``, or the same workflow id, write nothing
      and return ``(that entry, False)``.
    * ``admit_flow_runs(queue, concurrency=, rate=, period=, now=, limit=)``:
      in one atomic step, turn queued entries into admitted ones in order of
      ``(priority, seq)``, while fewer than ``concurrency`` entries of the
      entry's partition are admitted and fewer than ``rate`` starts of its
      partition lie in the window (each admission counts one); at most
      ``limit``.  Returns ``(admitted, retry_after)``: ``retry_after`` the
      seconds until the rate frees a start of a partition it held back, else
      ``None``.  Of concurrent callers, none exceeds the bounds together.
    * ``flow_runs(queue)``: the queue's entries in ``(priority, seq)`` order
      (every queue's when ``None``).
    * ``finish_flow_run(queue, workflow_id)``: remove the entry; ``True`` if there.

    Everything survives closing and reopening the store.  Every method is a
    checkpoint; same close rules as :class:`EventStore`.
    """

    async def acquire_flow_permit(
        self,
        key: str,
        *,
        holder: str,
        concurrency: int | None,
        rate: int | None,
        period: float,
        ttl: float,
        now: datetime,
    ) -> FlowGrant: ...

    async def release_flow_permit(self, key: str, permit_id: str) -> bool: ...

    async def renew_flow_permits(self, holder: str, *, ttl: float, now: datetime) -> int: ...

    async def held_flow_permits(self, key: str, *, now: datetime) -> int: ...

    async def record_flow_waiter(self, waiter: FlowWaiter, *, ttl: float, now: datetime) -> None: ...

    async def remove_flow_waiter(self, workflow_id: str, run_id: str, activity_id: int) -> bool: ...

    async def flow_waiters(self, workflow_id: str, *, now: datetime) -> list[FlowWaiter]: ...

    async def clear_flow_waiters(self) -> int: ...

    async def enqueue_flow_run(self, run: QueuedRun) -> tuple[QueuedRun, bool]: ...

    async def admit_flow_runs(
        self,
        queue: str,
        *,
        concurrency: int | None,
        rate: int | None,
        period: float,
        now: datetime,
        limit: int = 100,
    ) -> tuple[list[QueuedRun], float | None]: ...

    async def flow_runs(self, queue: str | None = None) -> list[QueuedRun]: ...

    async def finish_flow_run(self, queue: str, workflow_id: str) -> bool: ...


def validate_flow_key(key: object, what: str = "key") -> None:
    """``ValueError`` for a flow key (or queue name, holder) that is not a non-empty str."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"flow {what} must be a non-empty str, got {key!r}")


def validate_flow_waiter(waiter: object) -> None:
    """``TypeError``/``ValueError`` for a :class:`FlowWaiter` a store cannot record (for
    :meth:`FlowStore.record_flow_waiter`): ids and names must be non-empty str, the
    activity id and attempt ints >= 0, ``since`` an aware datetime."""
    if not isinstance(waiter, FlowWaiter):
        raise TypeError(f"record_flow_waiter() takes a FlowWaiter, got {type(waiter).__name__}")
    for what in ("workflow_id", "run_id", "pool", "holder"):
        validate_flow_key(getattr(waiter, what), f"waiter {what}")
    if not isinstance(waiter.limit, str):
        raise ValueError(f"flow waiter limit must be a str, got {waiter.limit!r}")
    for what, least in (("activity_id", 0), ("attempt", 0), ("priority", None)):
        value = getattr(waiter, what)
        if isinstance(value, bool) or not isinstance(value, int) or (least is not None and value < least):
            raise ValueError(
                f"flow waiter {what} must be an int{'' if least is None else f' >= {least}'}, got {value!r}"
            )
    if not isinstance(waiter.since, datetime) or waiter.since.utcoffset() is None:
        raise ValueError(f"flow waiter since must be an aware datetime, got {waiter.since!r}")


def rate_window(starts: Sequence[datetime], rate: int | None, period: float, now: datetime) -> float | None:
    """For a store: ``None`` if one more start fits the window of ``rate`` per ``period``
    ending ``now`` (``starts`` already pruned to it, oldest first), else the seconds
    until the oldest leaves it."""
    if rate is None or len(starts) < rate:
        return None
    return max((starts[0] + timedelta(seconds=period) - now).total_seconds(), 0.0)


def validate_schedule_write(schedule_id: object, data: object, expected_version: object = 1) -> None:
    """``TypeError``/``ValueError`` for an id that is not a non-empty str, data that is not a
    str, or an expected version that is not an int >= 1 (the :class:`ScheduleStore` methods)."""
    if not isinstance(schedule_id, str) or not schedule_id:
        raise ValueError(f"schedule ids must be non-empty str, got {schedule_id!r}")
    if not isinstance(data, str):
        raise TypeError(f"schedule data must be str (JSON text), got {type(data).__name__}")
    if isinstance(expected_version, bool) or not isinstance(expected_version, int) or expected_version < 1:
        raise ValueError(f"expected_version must be an int >= 1, got {expected_version!r}")


def validate_workflow_ids(workflow_ids: Sequence[str]) -> list[str]:
    """The distinct ids of ``workflow_ids`` in order; ``TypeError``/``ValueError`` for
    one str or an id that is not a non-empty str (the :class:`RecoveryCounts` methods)."""
    if isinstance(workflow_ids, str):
        raise TypeError("pass a sequence of workflow ids, not one str")
    ids = list(dict.fromkeys(workflow_ids))
    for workflow_id in ids:
        if not isinstance(workflow_id, str) or not workflow_id:
            raise ValueError(f"workflow ids must be non-empty str, got {workflow_id!r}")
    return ids


def validate_batch(workflow_id: str, events: Sequence[Event], expected_seq: int) -> None:
    """Raise :class:`InvalidBatch` unless ``events`` are the contiguous next seqs of ``workflow_id``.

    Store implementations call this before touching their backend.
    """
    if isinstance(expected_seq, bool) or not isinstance(expected_seq, int) or expected_seq < 0:
        raise InvalidBatch(f"expected_seq must be an int >= 0, got {expected_seq!r}")
    if not events:
        raise InvalidBatch(f"workflow {workflow_id!r}: refusing to append an empty batch")
    for offset, event in enumerate(events):
        if not isinstance(event, Event):
            raise InvalidBatch(f"workflow {workflow_id!r}: batch item {offset} is not an Event: {event!r}")
        if event.workflow_id != workflow_id:
            raise InvalidBatch(
                f"batch for workflow {workflow_id!r} holds an event of workflow {event.workflow_id!r}"
            )
        want = expected_seq + 1 + offset
        if event.seq != want:
            raise InvalidBatch(
                f"workflow {workflow_id!r}: batch item {offset} has seq {event.seq}, expected {want} "
                f"(batches must continue contiguously from expected_seq={expected_seq})"
            )
