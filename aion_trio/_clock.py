"""The engine clock: durable time (``recorded_at``, timer ``fire_at``) derived from Trio's clock.

Durable time is ``anchor_wall + (trio.current_time() - anchor_trio)``, anchored
when the engine opens.  Under ``trio.testing.MockClock`` durable time therefore
moves exactly as mock time does: a workflow sleeping 30 days completes in
milliseconds.

Under autojump the clock jumps whenever every task is blocked, and a task
waiting for a worker thread counts as blocked: a thread-backed store call or
a plain ``def`` activity would "take" arbitrary mock time.  Every thread hop
of the engine and of the stores therefore runs under :func:`hold_mock_time`,
which suspends autojump while any such call is in flight.
"""

from __future__ import annotations

import contextlib
import math
import sys
from datetime import datetime, timedelta, timezone
from types import TracebackType
from typing import TYPE_CHECKING, Protocol, final

import attrs
import trio

from ._guard import unguarded

#: Trio's clock, read without the determinism guard's check (the engine's reads are never
#: workflow code's, and the recorder makes them on every step).
_trio_time = unguarded(trio.current_time)

if TYPE_CHECKING:
    # Not imported at run time: trio.testing imports pytest (about 0.2 s of CPU
    # for every process that imports aion_trio, the CLI's included).
    import trio.testing


class EngineClock(Protocol):
    """What the engine needs of a clock.  Inject one through ``EngineConfig(clock=...)``."""

    def now(self) -> datetime:
        """Current durable time, timezone-aware UTC.  Never goes backwards."""
        ...

    def trio_deadline(self, when: datetime) -> float:
        """The ``trio.current_time()`` value at which ``when`` is reached."""
        ...


_RUN_ANCHOR: trio.lowlevel.RunVar[tuple[datetime, float]] = trio.lowlevel.RunVar("aion_trio_clock_anchor")


@final
@attrs.define(eq=False)
class TrioClock:
    """Wall time anchored once, advanced by Trio's (possibly mocked) clock."""

    _anchor_wall: datetime
    _anchor_trio: float
    _last: datetime

    @classmethod
    def start(cls, wall: datetime | None = None) -> TrioClock:
        """A clock anchored once per ``trio.run`` (shared by every engine in it).

        Sharing the anchor keeps durable time consistent across engines of one
        run: an engine reopened after an hour of (mock) time sees that hour.
        """
        if wall is not None:
            anchor = wall.astimezone(timezone.utc)
            return cls(anchor_wall=anchor, anchor_trio=_trio_time(), last=anchor)
        try:
            found = _RUN_ANCHOR.get()
        except LookupError:
            found = (datetime.now(timezone.utc), _trio_time())
            _RUN_ANCHOR.set(found)
        anchor_wall, anchor_trio = found
        clock = cls(anchor_wall=anchor_wall, anchor_trio=anchor_trio, last=anchor_wall)
        clock._last = clock.now()
        return clock

    def now(self) -> datetime:
        current = self._anchor_wall + timedelta(seconds=_trio_time() - self._anchor_trio)
        if current < self._last:  # pragma: no cover - float rounding only
            current = self._last
        self._last = current
        return current

    def trio_deadline(self, when: datetime) -> float:
        return self._anchor_trio + (when - self._anchor_wall).total_seconds()


# -- mock time stands still while a thread call is in flight ---------------------


@final
@attrs.define(eq=False)
class _Suspension:
    """One run's suspended autojump: how many thread calls hold it, and the threshold to restore."""

    clock: trio.testing.MockClock
    saved: float
    holders: int = 0


_SUSPENSION: trio.lowlevel.RunVar[_Suspension | None] = trio.lowlevel.RunVar(
    "aion_trio_autojump_suspension", default=None
)


@final
class _Hold:
    __slots__ = ("_clock",)

    def __init__(self, clock: trio.testing.MockClock) -> None:
        self._clock = clock

    def __enter__(self) -> None:
        suspension = _SUSPENSION.get()
        if suspension is None or suspension.clock is not self._clock:
            suspension = _Suspension(clock=self._clock, saved=self._clock.autojump_threshold)
            _SUSPENSION.set(suspension)
        if suspension.holders == 0:
            suspension.saved = self._clock.autojump_threshold
            self._clock.autojump_threshold = math.inf
        suspension.holders += 1

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        suspension = _SUSPENSION.get()
        assert suspension is not None
        assert suspension.holders > 0
        suspension.holders -= 1
        if suspension.holders == 0 and self._clock.autojump_threshold == math.inf:
            # (A threshold the test set meanwhile is left as it set it.)
            self._clock.autojump_threshold = suspension.saved


_NO_HOLD = contextlib.nullcontext()


def _mock_clock_class() -> type[trio.testing.MockClock] | None:
    """``MockClock``, or None while ``trio.testing`` is not imported (then no clock is one:
    ``trio.testing`` is where a test gets it)."""
    testing = sys.modules.get("trio.testing")
    return None if testing is None else testing.MockClock


def hold_mock_time() -> contextlib.AbstractContextManager[None]:
    """While entered, a ``trio.testing.MockClock``'s autojump does not jump.

    Wrap every await on a worker thread (a store's database call, a thread
    activity) in it, so mock time does not pass while real work runs in a
    thread: a 0.2 s thread call under a 1-hour timeout does not time out under
    ``MockClock(autojump_threshold=0)``.  Holds nest and count: autojump is
    restored when the last one is left.  Under any other clock it costs one
    check and does nothing.  Enter it in the Trio thread, around the await
    (a thread the caller stops waiting for, e.g. abandoned on cancellation,
    no longer holds time).
    """
    clock = trio.lowlevel.current_clock()
    mock_clock = _mock_clock_class()
    if mock_clock is not None and isinstance(clock, mock_clock):
        return _Hold(clock)
    return _NO_HOLD
