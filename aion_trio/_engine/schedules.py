"""Durable schedules in the engine: ``engine.schedules`` and the service that fires them.

* :class:`ScheduleBook` changes stored schedules by compare-and-set (read,
  change, write at the version read; a :class:`~aion_trio.ScheduleConflict`
  reads again): create, pause, trigger, backfill, update, delete.  It needs
  only a :class:`~aion_trio.ScheduleStore`, so the command line uses it too.
* :class:`Schedules` is ``engine.schedules``: the book, checked against the
  engine's workflows, plus one *pass* over a schedule (:func:`aion_trio._schedules.plan`
  decides; this module stops the other runs, starts the due ones through
  ``Engine.start`` (the one start path) and stores the new state), and the
  service that runs a pass whenever a tick is due, a watched run closes, or
  the poll interval passes.

A tick's run has the workflow id ``SCHEDULE@NOMINAL`` and the request id
``schedule``, so starting it again (after a crash between the start and the
state's write, or on a second node) returns the run that exists: a tick
starts at most once.  In cluster mode a node claims a schedule (the claim is
part of its state, written by compare-and-set and kept for
``EngineConfig.schedule_claim_ttl`` seconds) before it starts anything, so
one node works each schedule at a time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any, Protocol, final

import attrs
import trio

from .._clock import EngineClock
from .._commands import IdReusePolicy
from .._definitions import WorkflowDefinition
from .._errors import (
    AionError,
    EngineEpochClosed,
    InvalidSchedule,
    NotRunning,
    ScheduleConflict,
    ScheduleNotFound,
    SchedulesUnsupported,
    StoreError,
    WorkflowAlreadyStarted,
    WorkflowFenced,
    WorkflowNotFound,
)
from .._inbox import wall_sleep
from .._projections import is_active_status
from .._schedules import (
    RECENT_ACTIONS,
    Overlap,
    Pending,
    Schedule,
    ScheduleAction,
    ScheduleActionKind,
    ScheduleActionRecord,
    SchedulePolicy,
    ScheduleSpec,
    ScheduleState,
    Start,
    plan,
    record_started,
    schedule_from_json,
    schedule_to_json,
    validate_schedule_id,
)
from .._store import ScheduleStore, StoredSchedule
from .log import logger


class ScheduleClient(Protocol):
    """What the schedule service asks of the engine's client (``Engine``): the one start
    path and the lifecycle commands, routed to a workflow's owner in cluster mode."""

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

    async def cancel(self, workflow_id: str, reason: str = ..., *, request_id: str | None = ...) -> None: ...

    async def terminate(
        self, workflow_id: str, reason: str = ..., *, request_id: str | None = ...
    ) -> None: ...

    async def result(
        self, workflow_id: str, *, run_id: str | None = ..., follow_continue_as_new: bool = ...
    ) -> Any: ...


#: Compare-and-set tries before a change gives up (each loses only to another writer's change).
WRITE_TRIES = 20
#: At most this many ticks one backfill may ask for.
MAX_BACKFILL = 10_000
#: How long (engine clock) after a failed pass the service tries that schedule again.
PASS_RETRY = timedelta(seconds=1)
#: The request id of every tick's start (the workflow id names the tick).
TICK_REQUEST_ID = "schedule"

_SPEC_KEYS = frozenset(f.name for f in attrs.fields(ScheduleSpec))
_POLICY_KEYS = frozenset(f.name for f in attrs.fields(SchedulePolicy))
_ACTION_KEYS = frozenset({"args", "task_queue", "timeout", "search_attributes", "memo"})


@final
@attrs.frozen(kw_only=True)
class ScheduleDescription:
    """A schedule as ``describe`` shows it: the stored record, its recent actions (oldest
    first) and the next fire times."""

    schedule: Schedule
    recent: tuple[ScheduleActionRecord, ...]
    next_times: tuple[datetime, ...]

    @property
    def schedule_id(self) -> str:
        """The schedule's id."""
        return self.schedule.schedule_id

    @property
    def paused(self) -> bool:
        """Whether the schedule is paused (it starts nothing until resumed)."""
        return self.schedule.state.paused

    @property
    def note(self) -> str:
        """The note given with the last pause or resume."""
        return self.schedule.state.note


def describe_schedule(schedule: Schedule, now: datetime, count: int = 10) -> ScheduleDescription:
    return ScheduleDescription(
        schedule=schedule,
        recent=schedule.state.recent,
        next_times=tuple([] if schedule.state.paused else schedule.next_times(now, count)),
    )


def build_schedule(
    schedule_id: str,
    workflow_type: str,
    args: Sequence[Any],
    *,
    now: datetime,
    options: Mapping[str, Any],
) -> Schedule:
    """A new schedule from ``create``'s keywords (``InvalidSchedule`` for a bad one)."""
    validate_schedule_id(schedule_id)
    unknown = set(options) - _SPEC_KEYS - _POLICY_KEYS - _ACTION_KEYS - {"paused", "note"}
    if unknown:
        raise TypeError(f"unknown schedule option(s): {', '.join(sorted(unknown))}")
    spec = ScheduleSpec(**{k: v for k, v in options.items() if k in _SPEC_KEYS})
    action = ScheduleAction(
        workflow_type=workflow_type,
        args=tuple(args),
        **{k: v for k, v in options.items() if k in _ACTION_KEYS - {"args"}},
    )
    policy = SchedulePolicy(**{k: v for k, v in options.items() if k in _POLICY_KEYS})
    note = options.get("note", "")
    if not isinstance(note, str):
        raise InvalidSchedule("note", f"must be a str, got {note!r}")
    return Schedule(
        schedule_id=schedule_id,
        spec=spec,
        action=action,
        policy=policy,
        created_at=now,
        state=ScheduleState(
            cursor=spec.next_after(now), paused=bool(options.get("paused", False)), note=note
        ),
    )


def updated_schedule(schedule: Schedule, now: datetime, changes: Mapping[str, Any]) -> Schedule:
    """``schedule`` with ``update``'s keywords applied; a new spec restarts the cursor at ``now``."""
    unknown = set(changes) - _SPEC_KEYS - _POLICY_KEYS - _ACTION_KEYS - {"workflow"}
    if unknown:
        raise TypeError(f"unknown schedule option(s): {', '.join(sorted(unknown))}")
    spec_changes = {k: v for k, v in changes.items() if k in _SPEC_KEYS}
    if "cron" in spec_changes and "interval" not in spec_changes:
        spec_changes["interval"] = None
    if "interval" in spec_changes and "cron" not in spec_changes:
        spec_changes["cron"] = None
    spec = attrs.evolve(schedule.spec, **spec_changes) if spec_changes else schedule.spec
    action_changes = {k: v for k, v in changes.items() if k in _ACTION_KEYS}
    if "workflow" in changes:
        action_changes["workflow_type"] = changes["workflow"]
    action = attrs.evolve(schedule.action, **action_changes) if action_changes else schedule.action
    policy_changes = {k: v for k, v in changes.items() if k in _POLICY_KEYS}
    policy = attrs.evolve(schedule.policy, **policy_changes) if policy_changes else schedule.policy
    state = schedule.state
    if spec_changes:
        state = attrs.evolve(state, cursor=spec.next_after(now))
    return attrs.evolve(schedule, spec=spec, action=action, policy=policy, state=state)


@final
@attrs.define(eq=False)
class ScheduleBook:
    """Stored schedules changed by compare-and-set; needs only the store (the CLI uses it)."""

    store: ScheduleStore | None
    location: str
    now: Callable[[], datetime]

    def _store(self) -> ScheduleStore:
        if self.store is None:
            raise SchedulesUnsupported(self.location)
        return self.store

    async def read(self, schedule_id: str) -> Schedule:
        stored = await self._store().read_schedule(validate_schedule_id(schedule_id))
        if stored is None:
            raise ScheduleNotFound(schedule_id)
        return schedule_from_json(stored.data, stored.version)

    async def stored(self) -> list[StoredSchedule]:
        """The stored records, not decoded (one unreadable schedule spoils no listing of ids)."""
        return await self._store().list_schedules()

    async def list(self) -> list[Schedule]:
        return [schedule_from_json(s.data, s.version) for s in await self.stored()]

    async def create(self, schedule: Schedule) -> Schedule:
        stored = await self._store().create_schedule(schedule.schedule_id, schedule_to_json(schedule))
        return attrs.evolve(schedule, version=stored.version)

    async def write(self, schedule: Schedule) -> Schedule:
        """Store ``schedule`` at the version it was read at (``ScheduleConflict`` otherwise)."""
        stored = await self._store().write_schedule(
            schedule.schedule_id, schedule_to_json(schedule), schedule.version
        )
        return attrs.evolve(schedule, version=stored.version)

    async def change(self, schedule_id: str, change: Callable[[Schedule, datetime], Schedule]) -> Schedule:
        """Read, apply ``change``, write; read again after a conflicting write."""
        for _ in range(WRITE_TRIES):
            current = await self.read(schedule_id)
            changed = change(current, self.now())
            if changed == current:
                return current
            try:
                return await self.write(changed)
            except ScheduleConflict as exc:
                if exc.found == 0:
                    raise ScheduleNotFound(schedule_id) from None
        raise ScheduleConflict(schedule_id, current.version, -1)

    async def delete(self, schedule_id: str) -> None:
        if not await self._store().delete_schedule(validate_schedule_id(schedule_id)):
            raise ScheduleNotFound(schedule_id)

    async def pause(self, schedule_id: str, note: str = "") -> Schedule:
        return await self.change(schedule_id, lambda s, now: _paused(s, True, note))

    async def unpause(self, schedule_id: str, note: str = "") -> Schedule:
        return await self.change(schedule_id, lambda s, now: _paused(s, False, note))

    async def trigger(self, schedule_id: str, overlap: Overlap | str | None = None) -> Schedule:
        chosen = None if overlap is None else SchedulePolicy(overlap=overlap).overlap

        def add(schedule: Schedule, now: datetime) -> Schedule:
            tick = Pending(nominal_time=now, overlap=chosen, manual=True)
            return attrs.evolve(
                schedule, state=attrs.evolve(schedule.state, pending=(*schedule.state.pending, tick))
            )

        return await self.change(schedule_id, add)

    async def backfill(
        self, schedule_id: str, start: datetime, end: datetime, overlap: Overlap | str | None = None
    ) -> Schedule:
        """Ask for every tick with a nominal time in ``[start, end]`` (a tick that ran already
        is not run again: its run has the same workflow id)."""
        chosen = Overlap.ALLOW_ALL if overlap is None else SchedulePolicy(overlap=overlap).overlap
        for name, value in (("backfill start", start), ("backfill end", end)):
            if not isinstance(value, datetime) or value.tzinfo is None:
                raise InvalidSchedule(name, f"must be a timezone-aware datetime, got {value!r}")
        if start > end:
            raise InvalidSchedule("backfill start", f"{start} is after the end {end}")

        def add(schedule: Schedule, now: datetime) -> Schedule:
            ticks: list[Pending] = []
            for nominal in schedule.spec.times(start - timedelta(microseconds=1), end):
                ticks.append(Pending(nominal_time=nominal, overlap=chosen))
                if len(ticks) > MAX_BACKFILL:
                    raise InvalidSchedule("backfill", f"the range holds more than {MAX_BACKFILL} ticks")
            known = set(schedule.state.pending)
            pending = (*schedule.state.pending, *(t for t in ticks if t not in known))
            return attrs.evolve(schedule, state=attrs.evolve(schedule.state, pending=pending))

        return await self.change(schedule_id, add)


def _paused(schedule: Schedule, paused: bool, note: str) -> Schedule:
    if not isinstance(note, str):
        raise InvalidSchedule("note", f"must be a str, got {note!r}")
    return attrs.evolve(schedule, state=attrs.evolve(schedule.state, paused=paused, note=note))


@final
@attrs.define(eq=False)
class Schedules:
    """``engine.schedules``: create, describe, list, pause, unpause, trigger, backfill,
    update and delete durable schedules (docs/schedules.md).

    Every method raises :class:`~aion_trio.SchedulesUnsupported` on a store
    without the :class:`~aion_trio.ScheduleStore` capability,
    :class:`~aion_trio.ScheduleNotFound` for an unknown id and
    :class:`~aion_trio.InvalidSchedule` for a bad definition; each is a
    checkpoint, and a cancelled call wrote its change wholly or not at all.
    """

    _engine: ScheduleClient
    _book: ScheduleBook
    _clock: EngineClock
    _workflow_definition: Callable[[WorkflowDefinition[Any] | str], WorkflowDefinition[Any]]
    _node: str | None
    _claim_ttl: float
    _poll_interval: float | None
    _limiter: trio.CapacityLimiter
    _lock: trio.Lock = attrs.field(factory=trio.Lock)
    _wake: trio.Event = attrs.field(factory=trio.Event)
    _watched: set[str] = attrs.field(factory=set)
    _nursery: trio.Nursery | None = None
    passes: int = 0
    """Passes over schedules this engine made (statistics, tests)."""

    # ---- the API --------------------------------------------------------

    async def create(
        self,
        schedule_id: str,
        workflow: WorkflowDefinition[Any] | str,
        *args: Any,
        **options: Any,
    ) -> ScheduleDescription:
        """Create schedule ``schedule_id`` starting ``workflow(*args)`` at each tick.

        Options: ``cron`` + ``time_zone``, or ``interval`` + ``offset``; ``jitter``,
        ``start_at``, ``end_at``; ``overlap`` (an :class:`~aion_trio.Overlap`),
        ``catchup_window``; ``task_queue``, ``timeout``, ``search_attributes``,
        ``memo``; ``paused`` and ``note``.  The first tick is the first nominal
        time after now.  :class:`~aion_trio.ScheduleAlreadyExists` for an id in use,
        :class:`~aion_trio.UnknownWorkflowType` for a workflow this engine lacks.
        """
        definition = self._workflow_definition(workflow)
        definition.check_arguments(args)
        schedule = build_schedule(schedule_id, definition.name, args, now=self._clock.now(), options=options)
        await self._book.create(schedule)
        self._wake.set()
        return await self.describe(schedule_id)

    async def describe(self, schedule_id: str) -> ScheduleDescription:
        """The schedule, its recent actions and its next ten fire times."""
        return describe_schedule(await self._book.read(schedule_id), self._clock.now())

    async def list(self) -> list[ScheduleDescription]:
        """Every schedule, ordered by id."""
        now = self._clock.now()
        return [describe_schedule(s, now) for s in await self._book.list()]

    async def pause(self, schedule_id: str, note: str = "") -> ScheduleDescription:
        """Stop firing (ticks while paused are recorded as skipped); ``note`` says why."""
        await self._book.pause(schedule_id, note)
        return await self.describe(schedule_id)

    async def unpause(self, schedule_id: str, note: str = "") -> ScheduleDescription:
        """Fire again from the next tick on."""
        await self._book.unpause(schedule_id, note)
        self._wake.set()
        return await self.describe(schedule_id)

    async def trigger(self, schedule_id: str, overlap: Overlap | str | None = None) -> ScheduleDescription:
        """Start a run now (workflow id ``SCHEDULE@manual@NOW``), per ``overlap`` (default:
        the schedule's); returns once this engine made the pass that starts it (in cluster
        mode, a schedule another node holds is started by that node at its next pass)."""
        await self._book.trigger(schedule_id, overlap)
        await self.run_pass(schedule_id)
        return await self.describe(schedule_id)

    async def backfill(
        self, schedule_id: str, start: datetime, end: datetime, overlap: Overlap | str | None = None
    ) -> ScheduleDescription:
        """Run the ticks with nominal times in ``[start, end]`` now, per ``overlap`` (default
        ``ALLOW_ALL``); a tick that already ran is not run again."""
        await self._book.backfill(schedule_id, start, end, overlap)
        await self.run_pass(schedule_id)
        return await self.describe(schedule_id)

    async def update(self, schedule_id: str, **changes: Any) -> ScheduleDescription:
        """Change a schedule: the keywords of :meth:`create` (``workflow=`` names another
        workflow).  A new spec takes effect from now; the state (recent actions, pause) stays."""
        if "workflow" in changes:
            changes["workflow"] = self._workflow_definition(changes["workflow"]).name
        await self._book.change(schedule_id, lambda s, now: updated_schedule(s, now, changes))
        self._wake.set()
        return await self.describe(schedule_id)

    async def delete(self, schedule_id: str) -> None:
        """Delete the schedule (the runs it started go on)."""
        await self._book.delete(schedule_id)

    # ---- one pass -------------------------------------------------------

    async def _still_running(self, workflow_ids: Sequence[str]) -> frozenset[str]:
        running = set()
        for workflow_id in workflow_ids:
            try:
                status = (await self._engine.describe(workflow_id)).status
            except WorkflowNotFound:
                continue
            if is_active_status(status):
                running.add(workflow_id)
        return frozenset(running)

    def _claimed_elsewhere(self, schedule: Schedule, now: datetime) -> bool:
        state = schedule.state
        return (
            self._node is not None
            and state.claimed_by not in (None, self._node)
            and state.claim_until is not None
            and state.claim_until > now
        )

    async def run_pass(self, schedule_id: str) -> datetime | None:
        """One pass over a schedule: start what is due, store the new state.  Returns when
        the next pass is needed (``None``: only when something changes)."""
        book = self._book
        async with self._lock:
            self.passes += 1
            for _ in range(WRITE_TRIES):
                schedule = await book.read(schedule_id)
                now = self._clock.now()
                if self._claimed_elsewhere(schedule, now):
                    return schedule.state.claim_until
                if self._node is not None:
                    state = schedule.state
                    if (
                        state.claimed_by != self._node
                        or state.claim_until is None
                        or (state.claim_until - now).total_seconds() < self._claim_ttl / 2
                    ):
                        claimed = attrs.evolve(
                            state, claimed_by=self._node, claim_until=now + timedelta(seconds=self._claim_ttl)
                        )
                        try:
                            schedule = await book.write(attrs.evolve(schedule, state=claimed))
                        except ScheduleConflict:
                            continue
                decided = plan(schedule, now, still_running=await self._still_running(schedule.state.running))
                state = await self._carry_out(
                    schedule, decided.cancel, decided.terminate, decided.starts, decided.state
                )
                if state != schedule.state:
                    try:
                        await book.write(attrs.evolve(schedule, state=state))
                    except ScheduleConflict as exc:
                        if exc.found == 0:
                            return None
                        continue  # changed meanwhile: decide again (the starts are idempotent)
                self._watch(state)
                wake = decided.wake_at
                if self._node is not None and state.claim_until is not None:
                    renew = state.claim_until - timedelta(seconds=self._claim_ttl / 2)
                    wake = renew if wake is None else min(wake, renew)
                return wake
            return None

    async def _carry_out(
        self,
        schedule: Schedule,
        cancel: Sequence[str],
        terminate: Sequence[str],
        starts: Sequence[Start],
        state: ScheduleState,
    ) -> ScheduleState:
        reason = f"schedule {schedule.schedule_id!r}: overlap policy"
        for workflow_id in terminate:
            with _quiet(NotRunning, WorkflowNotFound):
                await self._engine.terminate(workflow_id, reason)
        for workflow_id in cancel:
            with _quiet(NotRunning, WorkflowNotFound):
                await self._engine.cancel(workflow_id, reason)
        action = schedule.action
        for start in starts:
            run_id: str | None = None
            try:
                handle = await self._engine.start(
                    action.workflow_type,
                    *action.args,
                    workflow_id=start.workflow_id,
                    id_reuse=IdReusePolicy.REJECT_DUPLICATE,
                    search_attributes=action.run_attributes(schedule.schedule_id, start.nominal_time),
                    task_queue=action.task_queue,
                    timeout=action.timeout,
                    request_id=TICK_REQUEST_ID,
                )
                run_id = handle.run_id
            except WorkflowAlreadyStarted as exc:
                run_id = exc.run_id  # the id was taken by a start without this tick's key
            except WorkflowFenced:
                pass  # cluster mode: another node owns the tick's run, so it was started
            except (EngineEpochClosed, StoreError):
                raise
            except AionError as exc:
                # Nothing recorded (an unknown workflow type, bad arguments): the tick is skipped.
                logger.error(
                    "schedule %r: the tick at %s was not started: %s",
                    schedule.schedule_id,
                    start.nominal_time,
                    exc,
                )
                state = attrs.evolve(
                    state,
                    running=tuple(w for w in state.running if w != start.workflow_id),
                    skipped_count=state.skipped_count + 1,
                    recent=(
                        *state.recent,
                        ScheduleActionRecord(
                            nominal_time=start.nominal_time,
                            kind=ScheduleActionKind.SKIPPED,
                            at=self._clock.now(),
                            workflow_id=start.workflow_id,
                            reason=f"not started: {exc}",
                        ),
                    )[-RECENT_ACTIONS:],
                )
                continue
            state = record_started(state, start, run_id, self._clock.now())
        return state

    def _watch(self, state: ScheduleState) -> None:
        """While ticks wait for running runs, wake the service when one of them closes."""
        if not state.pending or self._nursery is None:
            return
        for workflow_id in state.running:
            if workflow_id not in self._watched:
                self._watched.add(workflow_id)
                self._nursery.start_soon(self._await_close, workflow_id)

    async def _await_close(self, workflow_id: str) -> None:
        try:
            with _quiet(Exception):
                await self._engine.result(workflow_id, follow_continue_as_new=False)
        finally:
            self._watched.discard(workflow_id)
            self._wake.set()

    # ---- the service ----------------------------------------------------

    async def serve(self) -> None:
        """Make a pass over every schedule whenever one is due, a watched run closes, or
        the poll interval (wall-clock time) passes; runs until the epoch is cancelled."""
        if self._book.store is None:
            return
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            if self._poll_interval is not None:
                nursery.start_soon(self._poll, self._poll_interval)
            while True:
                self._wake = trio.Event()
                next_at: datetime | None = None
                try:
                    schedule_ids = [s.schedule_id for s in await self._book.stored()]
                except StoreError as exc:
                    logger.warning("listing the schedules failed (will retry at the next poll): %s", exc)
                    schedule_ids = []
                for schedule_id in schedule_ids:
                    # A pass the store failed is tried again soon, whatever else wakes the service.
                    retry = self._clock.now() + PASS_RETRY
                    try:
                        wake = await self.run_pass(schedule_id)
                    except EngineEpochClosed:
                        return
                    except ScheduleNotFound:
                        continue  # deleted meanwhile
                    except StoreError as exc:
                        logger.warning("schedule %r: the pass failed (will retry): %s", schedule_id, exc)
                        wake = retry
                    except InvalidSchedule as exc:
                        # Unreadable until someone fixes or deletes it: looked at again at the next poll.
                        logger.error("schedule %r cannot be fired: %s", schedule_id, exc)
                        continue
                    except Exception:
                        # One schedule's failure must not stop the others: logged, looked at again
                        # at the next poll or change.
                        logger.exception("schedule %r: the pass failed unexpectedly", schedule_id)
                        continue
                    if wake is not None and (next_at is None or wake < next_at):
                        next_at = wake
                deadline = math.inf if next_at is None else self._clock.trio_deadline(next_at)
                with trio.move_on_at(deadline):
                    await self._wake.wait()

    async def _poll(self, seconds: float) -> None:
        while True:
            await wall_sleep(seconds, self._limiter)
            self._wake.set()


class _quiet:
    """``with _quiet(E): ...`` swallows ``E`` (a context manager that is not contextlib's,
    so a Trio cancellation still passes through: it is not an Exception)."""

    def __init__(self, *types: type[BaseException]) -> None:
        self.types = types

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> bool:
        return exc_type is not None and issubclass(exc_type, self.types)


def open_schedules(
    engine: ScheduleClient,
    *,
    store: object,
    location: str,
    clock: EngineClock,
    workflow_definition: Callable[[WorkflowDefinition[Any] | str], WorkflowDefinition[Any]],
    node: str | None,
    claim_ttl: float,
    poll_interval: float | None,
    limiter: trio.CapacityLimiter,
) -> Schedules:
    """``engine.schedules`` over ``store`` (``None`` book store: the capability is missing)."""
    book = ScheduleBook(
        store=store if isinstance(store, ScheduleStore) else None, location=location, now=clock.now
    )
    return Schedules(
        engine=engine,
        book=book,
        clock=clock,
        workflow_definition=workflow_definition,
        node=node,
        claim_ttl=claim_ttl,
        poll_interval=poll_interval,
        limiter=limiter,
    )
