"""Admission: named pools of slots that bound the work in flight (backpressure).

A pool has a name, a capacity (how many may hold one of its slots at once;
``None``: no bound) and a waiting policy: a caller that finds every slot taken
waits for one, as long as it takes (``timeout=None``) or at most ``timeout``
seconds, after which :class:`~aion_trio.AdmissionTimeout` is raised (``0``:
refused at once).  Slots are handed out first come, first served.  The engine
keeps one pool for starts (``EngineConfig.max_inflight_starts``) and one for
activity attempts (``max_inflight_activities``); a bound per task queue or per
activity type is one more pool.

A caller whose own clock should stop while it waits (an activity attempt's
``timeout`` counts from the moment it really starts) passes a
:class:`Waiting`: ``queued()`` is called when it has to wait, ``started()``
once it holds the slot.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator
from typing import Protocol, final

import trio

from ._errors import AdmissionTimeout


class Waiting(Protocol):
    """Told when a caller has to wait for a slot, and when it got one."""

    def queued(self) -> None: ...

    def started(self) -> None: ...


@final
class AdmissionPool:
    """A named bound on work in flight, with its waiting policy (see the module docstring).

    ``setting`` names what configures it (for the error's message), e.g.
    ``"EngineConfig.max_inflight_starts"``.
    """

    __slots__ = ("_limiter", "capacity", "name", "setting", "timeout")

    def __init__(
        self, name: str, capacity: int | None, *, timeout: float | None = None, setting: str = ""
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
        self._limiter = None if capacity is None else trio.CapacityLimiter(capacity)

    @contextlib.asynccontextmanager
    async def slot(self, waiting: Waiting | None = None) -> AsyncIterator[None]:
        """Hold one slot for the body of ``async with``.

        Takes a free slot without a scheduler round trip (the work it admits is the
        checkpoint); otherwise waits its turn.  Raises :class:`AdmissionTimeout` if
        the policy's ``timeout`` passes first.  Cancelled while waiting: nothing is
        held.  An unbounded pool admits at once.
        """
        limiter = self._limiter
        if limiter is None:
            yield
            return
        token = object()
        try:
            limiter.acquire_on_behalf_of_nowait(token)
        except trio.WouldBlock:
            if waiting is not None:
                waiting.queued()
            await self._wait(limiter, token)
            if waiting is not None:
                waiting.started()
        try:
            yield
        finally:
            limiter.release_on_behalf_of(token)

    async def _wait(self, limiter: trio.CapacityLimiter, token: object) -> None:
        if self.timeout is None:
            await limiter.acquire_on_behalf_of(token)
            return
        with trio.move_on_after(self.timeout):
            await limiter.acquire_on_behalf_of(token)
            return
        assert self.capacity is not None
        raise AdmissionTimeout(self.name, self.capacity, self.timeout, self.setting)
