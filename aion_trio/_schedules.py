"""Durable schedules: what a schedule is, when it fires, and what each tick does (docs/schedules.md).

Pure: no I/O and no engine.  A :class:`Schedule` is a frozen record (its
spec, the workflow it starts, its policies and its state); :func:`plan`
decides, from a schedule and the time, which ticks are due and what each
one does under the overlap policy; the engine's schedule service
(``_engine/schedules.py``) carries the decisions out and stores the new
state.  The JSON form a store keeps is made here and only here
(:func:`schedule_to_json` / :func:`schedule_from_json`).

Nominal times are the times the spec names (a cron tick, an interval
boundary); a tick *fires* at its nominal time plus its jitter, a fraction of
``jitter`` derived from the schedule id and the nominal time, so every engine
computes the same fire time for a tick and a restart does not move it.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import json
import math
import zoneinfo
from collections.abc import Iterator, Mapping
from datetime import datetime, timedelta, timezone
from typing import Any, final

import attrs
from croniter import croniter

from ._errors import InvalidSchedule
from ._events import SearchValue, validate_search_attributes
from ._ids import validate_workflow_id

#: How many actions a schedule remembers (``describe().recent``, ``aion-trio schedule show``).
RECENT_ACTIONS = 10
#: The search attributes every run a schedule starts carries.
SCHEDULE_ID_ATTRIBUTE = "ScheduleId"
NOMINAL_TIME_ATTRIBUTE = "ScheduleNominalTime"
#: Memo entries are passed to each run as search attributes with this prefix.
MEMO_PREFIX = "memo."
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


class Overlap(enum.Enum):
    """What a tick does while a run the schedule started earlier is still running.

    * ``SKIP`` (default): the tick is skipped (recorded as skipped).
    * ``BUFFER_ONE``: the tick waits and starts once the running run closed; a
      further tick while one waits is skipped.
    * ``BUFFER_ALL``: every such tick waits, and they start one after another.
    * ``CANCEL_OTHER``: the running run is cancelled; the tick starts once it closed.
    * ``TERMINATE_OTHER``: the running run is terminated and the tick starts at once.
    * ``ALLOW_ALL``: the tick starts at once, whatever runs.
    """

    SKIP = "skip"
    BUFFER_ONE = "buffer_one"
    BUFFER_ALL = "buffer_all"
    CANCEL_OTHER = "cancel_other"
    TERMINATE_OTHER = "terminate_other"
    ALLOW_ALL = "allow_all"


def _overlap(value: object) -> Overlap:
    if isinstance(value, Overlap):
        return value
    try:
        return Overlap(str(value).lower().replace("-", "_"))
    except ValueError:
        known = ", ".join(o.value for o in Overlap)
        raise InvalidSchedule("overlap policy", f"{value!r} is not one of {known}") from None


def _aware(value: datetime | None, field: str) -> datetime | None:
    if value is None:
        return None
    if not isinstance(value, datetime) or value.tzinfo is None:
        raise InvalidSchedule(field, f"must be a timezone-aware datetime, got {value!r}")
    return value.astimezone(timezone.utc)


def _seconds(value: timedelta | float | None, field: str, *, positive: bool = False) -> timedelta | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (timedelta, int, float)):
        raise InvalidSchedule(field, f"must be a timedelta or a number of seconds, got {value!r}")
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if not math.isfinite(seconds) or seconds < 0 or (positive and seconds == 0):
        raise InvalidSchedule(
            field, f"must be {'positive' if positive else 'zero or positive'}, got {value!r}"
        )
    return timedelta(seconds=seconds)


@functools.lru_cache(maxsize=256)
def _valid_cron(expression: str) -> bool:
    # Parsing is the costly part of croniter, and every stored schedule read re-checks its spec.
    return bool(croniter.is_valid(expression))


def _zone(name: str) -> zoneinfo.ZoneInfo:
    if not isinstance(name, str) or not name:
        raise InvalidSchedule("time zone", f"must be an IANA zone name such as 'Europe/Paris', got {name!r}")
    try:
        return zoneinfo.ZoneInfo(name)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        raise InvalidSchedule("time zone", f"{name!r} is not a known IANA time zone") from None


@final
@attrs.frozen(kw_only=True)
class ScheduleSpec:
    """When a schedule fires: a cron expression in a time zone, or a fixed interval.

    ``cron``: five fields (minute hour day month weekday, as croniter reads
    them, e.g. ``"0 9 * * MON-FRI"``), evaluated in ``time_zone`` (an IANA
    name, default UTC; daylight-saving changes follow the zone).
    ``interval``: every so long, at ``epoch + offset + k * interval`` (UTC),
    so ``interval=1 day, offset=2 hours`` fires at 02:00 UTC daily.  Exactly
    one of the two.  ``jitter``: each tick fires up to this long after its
    nominal time (a fixed fraction per tick).  ``start_at`` / ``end_at``
    bound the nominal times (inclusive).
    """

    cron: str | None = None
    interval: timedelta | None = None
    offset: timedelta = timedelta(0)
    time_zone: str = "UTC"
    jitter: timedelta = timedelta(0)
    start_at: datetime | None = None
    end_at: datetime | None = None

    def __attrs_post_init__(self) -> None:
        if (self.cron is None) == (self.interval is None):
            raise InvalidSchedule("spec", "give exactly one of cron= and interval=")
        _zone(self.time_zone)
        if self.cron is not None:
            if not isinstance(self.cron, str) or not _valid_cron(self.cron):
                raise InvalidSchedule("cron expression", f"{self.cron!r} is not a valid cron expression")
            if len(self.cron.split()) != 5:
                raise InvalidSchedule(
                    "cron expression", f"{self.cron!r} must have five fields (minute hour day month weekday)"
                )
        object.__setattr__(self, "interval", _seconds(self.interval, "interval", positive=True))
        object.__setattr__(self, "offset", _seconds(self.offset, "offset"))
        object.__setattr__(self, "jitter", _seconds(self.jitter, "jitter"))
        object.__setattr__(self, "start_at", _aware(self.start_at, "start_at"))
        object.__setattr__(self, "end_at", _aware(self.end_at, "end_at"))
        if self.interval is not None and self.offset >= self.interval:
            raise InvalidSchedule(
                "offset", f"must be shorter than the interval ({self.interval}), got {self.offset}"
            )
        if self.start_at is not None and self.end_at is not None and self.start_at > self.end_at:
            raise InvalidSchedule("start_at", f"{self.start_at} is after end_at {self.end_at}")

    def next_after(self, after: datetime) -> datetime | None:
        """The first nominal time strictly after ``after`` (UTC), or ``None`` past ``end_at``."""
        if self.start_at is not None and after < self.start_at:
            after = self.start_at - timedelta(microseconds=1)
        if self.interval is not None:
            step = self.interval.total_seconds()
            base = _EPOCH + self.offset
            k = math.floor((after - base).total_seconds() / step) + 1
            found = base + timedelta(seconds=k * step)
            while found <= after:  # float rounding only
                k += 1
                found = base + timedelta(seconds=k * step)
        else:
            local = after.astimezone(_zone(self.time_zone))
            found = croniter(self.cron, local).get_next(datetime).astimezone(timezone.utc)
        if self.end_at is not None and found > self.end_at:
            return None
        return found

    def times(self, after: datetime, until: datetime | None = None) -> Iterator[datetime]:
        """Nominal times strictly after ``after`` and at most ``until`` (forever if ``None``)."""
        current = self.next_after(after)
        while current is not None and (until is None or current <= until):
            yield current
            current = self.next_after(current)

    def jitter_for(self, schedule_id: str, nominal: datetime) -> timedelta:
        """This tick's jitter: the same for every engine and every restart."""
        if not self.jitter:
            return timedelta(0)
        digest = hashlib.sha256(f"{schedule_id}|{iso(nominal)}".encode()).digest()
        fraction = int.from_bytes(digest[:8], "big") / 2**64
        return timedelta(microseconds=int(self.jitter / timedelta(microseconds=1) * fraction))


@final
@attrs.frozen(kw_only=True)
class ScheduleAction:
    """What each tick starts: ``workflow_type`` with ``args`` (JSON values), on
    ``task_queue`` (``None``: the engine's default), with a run ``timeout``, the
    ``search_attributes`` and the ``memo`` (JSON-able mapping, passed as search
    attributes named ``memo.KEY``)."""

    workflow_type: str
    args: tuple[Any, ...] = ()
    task_queue: str | None = None
    timeout: timedelta | None = None
    search_attributes: Mapping[str, SearchValue] = attrs.field(factory=dict)
    memo: Mapping[str, SearchValue] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.workflow_type, str) or not self.workflow_type:
            raise InvalidSchedule("workflow", f"must name a workflow type, got {self.workflow_type!r}")
        object.__setattr__(self, "args", tuple(self.args))
        object.__setattr__(self, "timeout", _seconds(self.timeout, "timeout", positive=True))
        try:
            object.__setattr__(
                self, "search_attributes", dict(validate_search_attributes(self.search_attributes))
            )
            object.__setattr__(self, "memo", dict(validate_search_attributes(self.memo)))
            json.dumps(list(self.args))
        except (TypeError, ValueError) as exc:
            raise InvalidSchedule("action", str(exc)) from None

    def run_attributes(self, schedule_id: str, nominal: datetime) -> dict[str, SearchValue]:
        """The search attributes of the run this action starts for the tick at ``nominal``."""
        attributes: dict[str, SearchValue] = {f"{MEMO_PREFIX}{k}": v for k, v in self.memo.items()}
        attributes.update(self.search_attributes)
        attributes[SCHEDULE_ID_ATTRIBUTE] = schedule_id
        attributes[NOMINAL_TIME_ATTRIBUTE] = iso(nominal)
        return attributes


@final
@attrs.frozen(kw_only=True)
class SchedulePolicy:
    """``overlap``: see :class:`Overlap`.  ``catchup_window``: after downtime, ticks that
    should have fired at most this long ago still fire (per the overlap policy);
    older ones are skipped and recorded as skipped."""

    overlap: Overlap = attrs.field(default=Overlap.SKIP, converter=_overlap)
    catchup_window: timedelta = timedelta(minutes=1)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "catchup_window", _seconds(self.catchup_window, "catchup_window"))


class ScheduleActionKind(enum.Enum):
    """What happened to a tick."""

    STARTED = "started"
    SKIPPED = "skipped"
    BUFFERED = "buffered"


@final
@attrs.frozen(kw_only=True)
class ScheduleActionRecord:
    """One tick's outcome, as ``describe().recent`` lists it."""

    nominal_time: datetime
    kind: ScheduleActionKind
    at: datetime
    workflow_id: str | None = None
    run_id: str | None = None
    reason: str = ""


@final
@attrs.frozen(kw_only=True)
class Pending:
    """A tick waiting in the buffer (``BUFFER_*``, ``CANCEL_OTHER``) or asked for by a
    backfill or a trigger; ``overlap`` overrides the schedule's for it."""

    nominal_time: datetime
    overlap: Overlap | None = None
    manual: bool = False


@final
@attrs.frozen(kw_only=True)
class ScheduleState:
    """What a schedule has done: the next nominal time to look at (``cursor``), the
    ticks waiting, the workflow ids of runs it started that may still run, the recent
    actions and counts, pause and its note, and (cluster mode) which node works it."""

    cursor: datetime | None
    paused: bool = False
    note: str = ""
    pending: tuple[Pending, ...] = ()
    running: tuple[str, ...] = ()
    recent: tuple[ScheduleActionRecord, ...] = ()
    started_count: int = 0
    skipped_count: int = 0
    claimed_by: str | None = None
    claim_until: datetime | None = None


@final
@attrs.frozen(kw_only=True)
class Schedule:
    """A stored schedule: its id, spec, action, policy and state (``version``: the store's)."""

    schedule_id: str
    spec: ScheduleSpec
    action: ScheduleAction
    policy: SchedulePolicy
    state: ScheduleState
    created_at: datetime
    version: int = 0

    def workflow_id_for(self, nominal: datetime, *, manual: bool = False) -> str:
        """The workflow id of the run for the tick at ``nominal``: one id per tick, so the
        tick starts at most once whoever fires it and however often."""
        return f"{self.schedule_id}{'@manual' if manual else ''}@{iso(nominal)}"

    def next_times(self, now: datetime, count: int = 10) -> list[datetime]:
        """The next ``count`` fire times (nominal plus jitter) after ``now``."""
        out: list[datetime] = []
        for nominal in self.spec.times(now - self.spec.jitter):
            fire = nominal + self.spec.jitter_for(self.schedule_id, nominal)
            if fire > now:
                out.append(fire)
            if len(out) >= count:
                break
        return out


def schedule_tick_time(workflow_id: str) -> datetime | None:
    """The nominal time of the schedule tick a run with ``workflow_id`` was started for
    (``SCHEDULE@TIME``, or ``SCHEDULE@manual@TIME`` for a triggered run), or ``None`` for a
    workflow id no schedule gives.  Pure, so workflow code may call it on ``ctx.workflow_id``."""
    _, at, text = workflow_id.rpartition("@")
    if not at or not text.endswith("Z"):
        return None
    try:
        return parse_time(text)
    except ValueError:
        return None


def validate_schedule_id(schedule_id: object) -> str:
    try:
        return validate_workflow_id(schedule_id, "schedule_id")
    except (TypeError, ValueError) as exc:
        raise InvalidSchedule("id", str(exc)) from None


def iso(when: datetime) -> str:
    return when.astimezone(timezone.utc).isoformat().replace("+00:00", "Z")


def parse_time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).astimezone(timezone.utc)


# --------------------------------------------------------------------------
# Planning: what is due and what each due tick does
# --------------------------------------------------------------------------


@final
@attrs.frozen(kw_only=True)
class Start:
    nominal_time: datetime
    workflow_id: str
    manual: bool = False


@final
@attrs.frozen(kw_only=True)
class Plan:
    """The decisions of one pass: runs to stop (cancel or terminate), runs to start,
    and the state to store once they are carried out (``record`` adds the started
    runs' ids)."""

    cancel: tuple[str, ...] = ()
    terminate: tuple[str, ...] = ()
    starts: tuple[Start, ...] = ()
    state: ScheduleState
    wake_at: datetime | None = None


def _remember(recent: list[ScheduleActionRecord], record: ScheduleActionRecord) -> None:
    recent.append(record)
    del recent[:-RECENT_ACTIONS]


def plan(schedule: Schedule, now: datetime, *, still_running: frozenset[str]) -> Plan:
    """Decide one pass over ``schedule`` at ``now``.

    ``still_running``: which of ``state.running`` are still active.  Ticks from
    the cursor whose fire time has come are taken in order: those that should
    have fired longer than the catch-up window ago, and those while paused, are
    skipped; the rest join the pending ticks, which then start or wait per
    their overlap policy.  ``wake_at``: when the next pass is needed (the next
    fire time), ``None`` if never.
    """
    state = schedule.state
    spec = schedule.spec
    recent = list(state.recent)
    skipped = state.skipped_count
    pending = list(state.pending)
    cursor = state.cursor
    window = schedule.policy.catchup_window
    wake_at: datetime | None = None
    while cursor is not None:
        fire = cursor + spec.jitter_for(schedule.schedule_id, cursor)
        if fire > now:
            wake_at = fire
            break
        if state.paused or now - fire > window:
            skipped += 1
            reason = (
                f"paused: {state.note}"
                if state.paused
                else f"missed: fired {now - fire} late, past the catch-up window of {window}"
            )
            _remember(
                recent,
                ScheduleActionRecord(
                    nominal_time=cursor, kind=ScheduleActionKind.SKIPPED, at=now, reason=reason
                ),
            )
        else:
            pending.append(Pending(nominal_time=cursor))
        cursor = spec.next_after(cursor)
    running = [w for w in state.running if w in still_running]
    cancel: list[str] = []
    terminate: list[str] = []
    starts: list[Start] = []
    waiting: list[Pending] = []
    for tick in pending:
        overlap = tick.overlap or schedule.policy.overlap
        busy = bool(running)
        wid = schedule.workflow_id_for(tick.nominal_time, manual=tick.manual)
        if wid in running or any(s.workflow_id == wid for s in starts):
            continue  # this tick's run exists already
        if overlap is Overlap.ALLOW_ALL or not busy:
            starts.append(Start(nominal_time=tick.nominal_time, workflow_id=wid, manual=tick.manual))
            running.append(wid)
            continue
        if overlap is Overlap.TERMINATE_OTHER:
            terminate.extend(w for w in running if w not in terminate)
            running = [wid]
            starts.append(Start(nominal_time=tick.nominal_time, workflow_id=wid, manual=tick.manual))
            continue
        if overlap is Overlap.SKIP or (overlap is Overlap.BUFFER_ONE and waiting):
            skipped += 1
            _remember(
                recent,
                ScheduleActionRecord(
                    nominal_time=tick.nominal_time,
                    kind=ScheduleActionKind.SKIPPED,
                    at=now,
                    reason=f"overlap: {', '.join(running)} still running",
                ),
            )
            continue
        if overlap is Overlap.CANCEL_OTHER and tick not in state.pending:
            # Cancelled once, when the tick arrives; it then waits for them to close.
            cancel.extend(w for w in running if w not in cancel)
            # The newest tick replaces one that waited for the same runs to close.
            for old in waiting:
                skipped += 1
                _remember(
                    recent,
                    ScheduleActionRecord(
                        nominal_time=old.nominal_time,
                        kind=ScheduleActionKind.SKIPPED,
                        at=now,
                        reason="overlap: superseded",
                    ),
                )
            waiting = []
        if tick not in state.pending:
            _remember(
                recent,
                ScheduleActionRecord(
                    nominal_time=tick.nominal_time,
                    kind=ScheduleActionKind.BUFFERED,
                    at=now,
                    reason=f"overlap: waits for {', '.join(running)}",
                ),
            )
        waiting.append(tick)
    new_state = attrs.evolve(
        state,
        cursor=cursor,
        pending=tuple(waiting),
        running=tuple(running),
        recent=tuple(recent),
        skipped_count=skipped,
    )
    return Plan(
        cancel=tuple(cancel),
        terminate=tuple(terminate),
        starts=tuple(starts),
        state=new_state,
        wake_at=wake_at,
    )


def record_started(state: ScheduleState, start: Start, run_id: str | None, now: datetime) -> ScheduleState:
    recent = list(state.recent)
    _remember(
        recent,
        ScheduleActionRecord(
            nominal_time=start.nominal_time,
            kind=ScheduleActionKind.STARTED,
            at=now,
            workflow_id=start.workflow_id,
            run_id=run_id,
        ),
    )
    return attrs.evolve(state, recent=tuple(recent), started_count=state.started_count + 1)


# --------------------------------------------------------------------------
# The JSON form a store keeps
# --------------------------------------------------------------------------


def _td(value: timedelta | None) -> float | None:
    return None if value is None else value.total_seconds()


def _time(value: datetime | None) -> str | None:
    return None if value is None else iso(value)


def _from_time(value: Any) -> datetime | None:
    return None if value is None else parse_time(value)


def _from_td(value: Any) -> timedelta | None:
    return None if value is None else timedelta(seconds=value)


def schedule_to_json(schedule: Schedule) -> str:
    spec, action, policy, state = schedule.spec, schedule.action, schedule.policy, schedule.state
    data = {
        "format": 1,
        "schedule_id": schedule.schedule_id,
        "created_at": iso(schedule.created_at),
        "spec": {
            "cron": spec.cron,
            "interval": _td(spec.interval),
            "offset": _td(spec.offset),
            "time_zone": spec.time_zone,
            "jitter": _td(spec.jitter),
            "start_at": _time(spec.start_at),
            "end_at": _time(spec.end_at),
        },
        "action": {
            "workflow_type": action.workflow_type,
            "args": list(action.args),
            "task_queue": action.task_queue,
            "timeout": _td(action.timeout),
            "search_attributes": {
                k: list(v) if isinstance(v, tuple) else v for k, v in action.search_attributes.items()
            },
            "memo": {k: list(v) if isinstance(v, tuple) else v for k, v in action.memo.items()},
        },
        "policy": {"overlap": policy.overlap.value, "catchup_window": _td(policy.catchup_window)},
        "state": {
            "cursor": _time(state.cursor),
            "paused": state.paused,
            "note": state.note,
            "pending": [
                {
                    "nominal_time": iso(p.nominal_time),
                    "overlap": p.overlap and p.overlap.value,
                    "manual": p.manual,
                }
                for p in state.pending
            ],
            "running": list(state.running),
            "recent": [
                {
                    "nominal_time": iso(r.nominal_time),
                    "kind": r.kind.value,
                    "at": iso(r.at),
                    "workflow_id": r.workflow_id,
                    "run_id": r.run_id,
                    "reason": r.reason,
                }
                for r in state.recent
            ],
            "started_count": state.started_count,
            "skipped_count": state.skipped_count,
            "claimed_by": state.claimed_by,
            "claim_until": _time(state.claim_until),
        },
    }
    return json.dumps(data, sort_keys=True, separators=(",", ":"))


def schedule_from_json(text: str, version: int) -> Schedule:
    """The schedule a store holds; ``InvalidSchedule`` names what is wrong with unreadable data."""
    try:
        data = json.loads(text)
        spec, action, policy, state = data["spec"], data["action"], data["policy"], data["state"]
        return Schedule(
            schedule_id=data["schedule_id"],
            created_at=parse_time(data["created_at"]),
            version=version,
            spec=ScheduleSpec(
                cron=spec["cron"],
                interval=_from_td(spec["interval"]),
                offset=timedelta(seconds=spec["offset"]),
                time_zone=spec["time_zone"],
                jitter=timedelta(seconds=spec["jitter"]),
                start_at=_from_time(spec["start_at"]),
                end_at=_from_time(spec["end_at"]),
            ),
            action=ScheduleAction(
                workflow_type=action["workflow_type"],
                args=tuple(action["args"]),
                task_queue=action["task_queue"],
                timeout=_from_td(action["timeout"]),
                search_attributes=action["search_attributes"],
                memo=action["memo"],
            ),
            policy=SchedulePolicy(
                overlap=Overlap(policy["overlap"]), catchup_window=timedelta(seconds=policy["catchup_window"])
            ),
            state=ScheduleState(
                cursor=_from_time(state["cursor"]),
                paused=state["paused"],
                note=state["note"],
                pending=tuple(
                    Pending(
                        nominal_time=parse_time(p["nominal_time"]),
                        overlap=None if p["overlap"] is None else Overlap(p["overlap"]),
                        manual=p["manual"],
                    )
                    for p in state["pending"]
                ),
                running=tuple(state["running"]),
                recent=tuple(
                    ScheduleActionRecord(
                        nominal_time=parse_time(r["nominal_time"]),
                        kind=ScheduleActionKind(r["kind"]),
                        at=parse_time(r["at"]),
                        workflow_id=r["workflow_id"],
                        run_id=r["run_id"],
                        reason=r["reason"],
                    )
                    for r in state["recent"]
                ),
                started_count=state["started_count"],
                skipped_count=state["skipped_count"],
                claimed_by=state["claimed_by"],
                claim_until=_from_time(state["claim_until"]),
            ),
        )
    except InvalidSchedule:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidSchedule("stored data", f"cannot read it ({type(exc).__name__}: {exc})") from None
