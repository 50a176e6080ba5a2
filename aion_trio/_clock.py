"""The engine clock: durable time (``recorded_at``, timer ``fire_at``) derived from Trio's clock.

Durable time is ``anchor_wall + (trio.current_time() - anchor_trio)``, anchored
when the engine opens.  Under ``trio.testing.MockClock`` durable time therefore
moves exactly as mock time does: a workflow sleeping 30 days completes in
milliseconds.  (Under autojump, time jumps whenever every task is blocked —
including while a worker thread runs — so thread-backed stores and sync
activities "take" arbitrary mock time; time-skipping tests use the memory
store and async activities.)
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Protocol, final

import attrs
import trio


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
            return cls(anchor_wall=anchor, anchor_trio=trio.current_time(), last=anchor)
        try:
            found = _RUN_ANCHOR.get()
        except LookupError:
            found = (datetime.now(timezone.utc), trio.current_time())
            _RUN_ANCHOR.set(found)
        anchor_wall, anchor_trio = found
        clock = cls(anchor_wall=anchor_wall, anchor_trio=anchor_trio, last=anchor_wall)
        clock._last = clock.now()
        return clock

    def now(self) -> datetime:
        current = self._anchor_wall + timedelta(seconds=trio.current_time() - self._anchor_trio)
        if current < self._last:  # pragma: no cover - float rounding only
            current = self._last
        self._last = current
        return current

    def trio_deadline(self, when: datetime) -> float:
        return self._anchor_trio + (when - self._anchor_wall).total_seconds()
