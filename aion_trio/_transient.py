"""The one retry of a store call that failed transiently.

``BackendUnavailable`` is the only store error that waiting may repair, and
its outcome is unknown (the write may have landed), so only an idempotent
attempt is retried: one that looks first whether an earlier try landed.
Every path of the engine that retries such a fault goes through
:class:`Transient`, so they all behave alike:

* **The ladder** (``EngineConfig.completion_retry``): sleep ``initial`` after
  the first failure, doubling up to ``ceiling``; no attempt budget.
* **Loudness.**  An outage is stated once, at its first failure; while it
  lasts it is restated when a fault of another type appears, when the number
  of retries reaches the next power of two, and on every retry once the sleep
  is at the ceiling (so the ceiling is the log rate of a stuck retry).  When
  the call succeeds again one line says so.  The dedup key is the error's
  type, never its rendered message.
* **Observers** get a :class:`~aion_trio.TransientRetry` for each failure and
  one when the retry ends (recovered, or gave up).
* **Give-up.**  Before each retry: once the engine epoch has closed the retry
  stops with ``EngineEpochClosed`` (the next engine's recovery redoes the
  work), and a caller's ``stop`` hook may end it for its own reason (the run
  was relinquished, the work was done by someone else) with
  :class:`RetryAbandoned`.

Any other error an attempt raises propagates to the caller, whose business it
is (a run marks itself stuck, a background step logs it).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol, TypeVar, final

import attrs
import trio

from ._epoch import EngineEpoch
from ._errors import BackendUnavailable, EngineEpochClosed, epoch_closed
from ._logs import ContextLogger
from ._observe import ObserverHub, TransientRetry

T = TypeVar("T")

__all__ = [
    "CompletionRetryConfig",
    "FaultReporter",
    "Ladder",
    "Retry",
    "RetryAbandoned",
    "Transient",
    "failure_discriminant",
    "is_transient",
]

#: What an epoch that closed mid-retry leaves to whom (the give-up line's reason).
SHUTTING_DOWN = "the engine is shutting down; the next engine's recovery redoes it"


class Ladder(Protocol):
    """A backoff ladder: sleep ``initial`` seconds, doubling up to ``ceiling``."""

    @property
    def initial(self) -> float: ...

    @property
    def ceiling(self) -> float: ...


@final
@attrs.frozen(kw_only=True)
class CompletionRetryConfig:
    """The backoff ladder of every retry of a transient store fault: sleep ``initial``,
    doubling up to ``ceiling``.

    Refused at construction if it cannot climb: ``initial`` must be positive
    and finite, ``ceiling`` at least ``initial``.  The ceiling is also the
    log rate of a stuck retry (every attempt at the ceiling logs once).
    """

    initial: float = 0.1
    ceiling: float = 30.0

    def __attrs_post_init__(self) -> None:
        for name in ("initial", "ceiling"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"completion retry {name} must be a finite number of seconds, got {value!r}")
        if self.initial <= 0:
            raise ValueError(
                f"completion retry initial backoff must be > 0 (a ladder from 0 cannot climb), got {self.initial!r}"
            )
        if self.ceiling < self.initial:
            raise ValueError(
                f"completion retry ceiling ({self.ceiling!r}) must be at least the initial backoff ({self.initial!r})"
            )


def is_transient(error: BaseException) -> bool:
    """Only unavailability clears by waiting.

    ``SequenceConflict`` (a second writer), ``NotOwner`` (this node lost the
    workflow: re-resolving the owner is not a retry's job), ``NotFound``,
    serialization, non-determinism and a closed epoch are all reported, never
    retried: a retry has no attempt budget and must not spin on them.
    """
    return isinstance(error, BackendUnavailable)


def failure_discriminant(error: BaseException) -> str:
    """A retry's log dedup key: the error's type, never its rendered message."""
    cls = type(error)
    return f"{cls.__module__}.{cls.__qualname__}"


@final
class FaultReporter:
    """When an unbounded retry states its fault: when a fault is first seen, and
    whenever the attempt count reaches the next power of two.  A new fault does
    not push the escalation point out."""

    def __init__(self) -> None:
        self._seen: set[str] = set()
        self._report_at = 1

    def should_report(self, fault: str, attempts: int) -> bool:
        unseen = fault not in self._seen
        escalated = attempts >= self._report_at
        if not unseen and not escalated:
            return False
        if unseen:
            self._seen.add(fault)
        if escalated:
            self._report_at = attempts * 2
        return True


@final
class RetryAbandoned(Exception):
    """A retry's ``stop`` hook ended it before the store answered; ``reason`` says why."""

    def __init__(self, what: str, reason: str) -> None:
        super().__init__(f"stopped retrying to {what}: {reason}")
        self.what = what
        self.reason = reason


@final
@attrs.frozen
class Transient:
    """How this engine retries transient store faults: the ladder, the epoch whose
    closing ends every retry, and the observers told about them."""

    ladder: Ladder
    epoch: EngineEpoch | None = None
    observers: ObserverHub | None = None

    def retrying(
        self, what: str, log: logging.Logger | ContextLogger, fields: Mapping[str, Any] | None = None
    ) -> Retry:
        """A retry of ``what`` (``"fire timer t1"``: what a line says could not be done),
        logging to ``log`` with ``fields`` (read at each line, so a caller may update them)."""
        return Retry(self, what, log, {} if fields is None else fields)

    async def call(
        self,
        what: str,
        attempt: Callable[[], Awaitable[T]],
        log: logging.Logger | ContextLogger,
        fields: Mapping[str, Any] | None = None,
        *,
        after: BaseException | None = None,
        stop: Callable[[], str | None] | None = None,
    ) -> T:
        """``await attempt()``, retried while it fails transiently (see :meth:`Retry.run`)."""
        return await self.retrying(what, log, fields).run(attempt, after=after, stop=stop)

    async def now_or_in_background(
        self,
        what: str,
        attempt: Callable[[], Awaitable[object]],
        log: logging.Logger | ContextLogger,
        fields: Mapping[str, Any],
    ) -> None:
        """One attempt of an idempotent background step now; if it fails transiently it is
        retried in the epoch (so the caller goes on) until it lands or the epoch closes.
        Anything else is logged and left to the next engine's recovery.  Never raises."""
        try:
            await attempt()
        except BackendUnavailable as exc:
            retry = self.retrying(what, log, fields)
            try:
                if self.epoch is None:
                    raise epoch_closed(fields.get("workflow_id"), fields.get("run_id"), what)
                self.epoch.spawn(
                    retry.in_background,
                    attempt,
                    exc,
                    name=f"retry:{what}",
                    workflow_id=fields.get("workflow_id"),
                    run_id=fields.get("run_id"),
                )
            except EngineEpochClosed:
                log.warning(
                    "could not %s (the engine is shutting down; recovery redoes it): %s",
                    what,
                    exc,
                    extra=fields,
                )
        except EngineEpochClosed:
            log.info("did not %s: the engine is shutting down; recovery redoes it", what, extra=fields)
        except Exception as exc:
            log.error(
                "could not %s (not retried here; the next engine's recovery redoes it): %s: %s",
                what,
                type(exc).__name__,
                exc,
                extra=fields,
            )


@final
class Retry:
    """One retry of one operation through one outage: where it is on the ladder, how
    often it failed, when the outage began, and what it stated."""

    def __init__(
        self, policy: Transient, what: str, log: logging.Logger | ContextLogger, fields: Mapping[str, Any]
    ) -> None:
        self._policy = policy
        self.what = what
        self._log = log
        self._fields = fields
        #: Retries made so far (the attempt that began the outage is not one).
        self.attempts = 0
        self._delay = policy.ladder.initial
        self._began: float | None = None
        self._reporter = FaultReporter()

    @property
    def elapsed(self) -> float:
        """Seconds since the outage began (0 before any failure)."""
        return 0.0 if self._began is None else trio.current_time() - self._began

    async def run(
        self,
        attempt: Callable[[], Awaitable[T]],
        *,
        after: BaseException | None = None,
        reported: bool = False,
        stop: Callable[[], str | None] | None = None,
    ) -> T:
        """``await attempt()`` until it does not raise ``BackendUnavailable``; returns its value.

        ``after``: the attempt already failed once with this error (the outage began
        there), so the first thing done is the backoff; ``reported``: the caller has
        already stated that failure.  Before each retry the epoch is looked at (closed:
        ``EngineEpochClosed``) and then ``stop()`` (a reason: :class:`RetryAbandoned`).
        Any other error of an attempt propagates.  Cancellation stops it at once.
        """
        if after is not None:
            self._failed(after, stated=reported)
        while True:
            if self._began is not None:
                await trio.sleep(self._delay)
                self._delay = min(self._delay * 2, self._policy.ladder.ceiling)
                self._check(stop)
                self.attempts += 1
            try:
                value = await attempt()
            except BackendUnavailable as exc:
                self._failed(exc, stated=False)
                continue
            if self._began is not None:
                self._ended("recovered")
            return value

    async def in_background(self, attempt: Callable[[], Awaitable[object]], first: BaseException) -> None:
        """The epoch task of :meth:`Transient.now_or_in_background`: never raises."""
        try:
            await self.run(attempt, after=first)
        except EngineEpochClosed:
            pass  # the epoch closed under the attempt's own gate: nothing was written
        except Exception as exc:
            self._log.error(
                "could not %s: %s: %s", self.what, type(exc).__name__, exc, extra=dict(self._fields)
            )

    # -- what is said -------------------------------------------------------

    def _check(self, stop: Callable[[], str | None] | None) -> None:
        epoch = self._policy.epoch
        if epoch is not None and not epoch.is_open:
            self._gave_up(SHUTTING_DOWN)
            raise epoch_closed(self._fields.get("workflow_id"), self._fields.get("run_id"), self.what)
        reason = stop() if stop is not None else None
        if reason is not None:
            self._gave_up(reason)
            raise RetryAbandoned(self.what, reason)

    def _failed(self, error: BaseException, *, stated: bool) -> None:
        if self._began is None:
            self._began = trio.current_time()
        fault = failure_discriminant(error)
        at_ceiling = self._delay >= self._policy.ladder.ceiling
        # Always consulted, so its first-sight bookkeeping sees every fault; the failure
        # that began the outage is always news.
        news = self._reporter.should_report(fault, self.attempts) or self.attempts == 0
        if not stated and (news or at_ceiling):
            fields = {
                **self._fields,
                "attempts": self.attempts,
                "elapsed_seconds": round(self.elapsed, 3),
                "error": repr(error),
                "fault": fault,
                "at_ceiling": at_ceiling,
            }
            if self.attempts:
                self._log.warning(
                    "could not %s (retry %d failed); retrying with backoff: %s",
                    self.what,
                    self.attempts,
                    error,
                    extra=fields,
                )
            else:
                self._log.warning("could not %s; retrying with backoff: %s", self.what, error, extra=fields)
        self._emit("retrying", fault, delay=self._delay)

    def _ended(self, outcome: str) -> None:
        fields = {**self._fields, "attempts": self.attempts, "elapsed_seconds": round(self.elapsed, 3)}
        if outcome == "recovered":
            self._log.info(
                "the store answered again: could %s after %d %s (%.3fs)",
                self.what,
                self.attempts,
                "retry" if self.attempts == 1 else "retries",
                self.elapsed,
                extra=fields,
            )
        self._emit(outcome, None, delay=None)

    def _gave_up(self, reason: str) -> None:
        self._log.info(
            "stopped retrying to %s after %d %s: %s",
            self.what,
            self.attempts,
            "retry" if self.attempts == 1 else "retries",
            reason,
            extra={**self._fields, "attempts": self.attempts, "elapsed_seconds": round(self.elapsed, 3)},
        )
        self._ended("gave_up")

    def _emit(self, outcome: str, fault: str | None, *, delay: float | None) -> None:
        hub = self._policy.observers
        if hub is None:
            return
        hub.emit(
            TransientRetry(
                what=self.what,
                outcome=outcome,
                attempts=self.attempts,
                seconds=self.elapsed,
                delay=delay,
                error_type=fault,
                workflow_id=self._fields.get("workflow_id"),
                run_id=self._fields.get("run_id"),
            )
        )
