"""The engine epoch: one nursery owning every background task (docs/architecture.md, "The epoch").

Closing the epoch is a one-way latch.  The gate is checked at the append
boundary under the recorder lock (see ``Recorder.append``); a refused write
raises :class:`EngineEpochClosed`, constructed only by ``epoch_closed``.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from typing import Any, final

import attrs
import trio

from ._contain import is_structural
from ._errors import AionInternalError, epoch_closed
from ._logs import ContextLogger

logger = ContextLogger("aion_trio.epoch")


class ArmOutcome(enum.Enum):
    ARMED = "armed"
    ALREADY_ARMED = "already_armed"
    EPOCH_CLOSED = "epoch_closed"


@attrs.frozen
class RetryKey:
    """A completion retry's key: one per lease, so two leases of one run may each hold one."""

    workflow_id: str
    run_id: str
    lease_id: int


@final
@attrs.define(eq=False)
class RetrySlot:
    """A completion-retry registration.

    Inserted by ``arm`` and *claimed* by the retry task itself when it starts
    running; released in ``finally`` only if the registry still holds this
    very slot, so a finishing task can never evict another task's entry, and
    an arm that was refused never created anything that could release one.
    """

    key: RetryKey
    task: trio.lowlevel.Task | None = None


@final
@attrs.frozen
class EpochStatistics:
    is_open: bool
    admitting: bool
    armed_completion_retries: int
    in_flight_attempts: int
    background_tasks: int


@final
class EngineEpoch:
    """Owns the engine's nursery; the latch every durable background write checks."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        self._open = True
        self._admitting = True
        self._retries: dict[RetryKey, RetrySlot] = {}
        self._in_flight = 0
        self._idle = trio.Event()
        self._idle.set()
        self._tasks = 0

    # -- latch -------------------------------------------------------------

    @property
    def is_open(self) -> bool:
        return self._open

    @property
    def admitting(self) -> bool:
        """False once shutdown began: no new starts, no new dispatches."""
        return self._admitting and self._open

    def stop_admitting(self) -> None:
        self._admitting = False

    def begin_close(self) -> None:
        """Close the latch (one way): every later gated write is refused."""
        self._admitting = False
        self._open = False

    def gate(self, workflow_id: str | None, run_id: str | None, action: str) -> None:
        """Raise ``EngineEpochClosed`` if the epoch is closed; call under the recorder lock."""
        if not self._open:
            raise epoch_closed(workflow_id, run_id, action)

    # -- tasks -------------------------------------------------------------

    def spawn(
        self,
        fn: Callable[..., Awaitable[Any]],
        *args: Any,
        name: str,
        workflow_id: str | None = None,
        run_id: str | None = None,
    ) -> None:
        """Start a background task in the epoch nursery (refused once closed)."""
        if not self._open:
            raise epoch_closed(workflow_id, run_id, f"start background task {name}")
        self._nursery.start_soon(self._counted, fn, args, name, workflow_id, run_id, name=name)

    async def _counted(
        self,
        fn: Callable[..., Awaitable[Any]],
        args: tuple[Any, ...],
        name: str,
        workflow_id: str | None = None,
        run_id: str | None = None,
    ) -> None:
        self._tasks += 1
        try:
            await fn(*args)
        except BaseException as exc:
            # One task's failure must not take down the epoch (and every other run):
            # nor may a SystemExit or other BaseException from code it called; only
            # cancellation and a real Ctrl-C are structural (see _contain).
            if is_structural(exc):
                raise
            logger.exception(
                "background task %s failed", name, extra={"workflow_id": workflow_id, "run_id": run_id}
            )
        finally:
            self._tasks -= 1

    @property
    def cancel_scope(self) -> trio.CancelScope:
        return self._nursery.cancel_scope

    # -- in-flight activity attempts (for drain) ---------------------------

    def attempt_started(self) -> None:
        self._in_flight += 1
        self._idle = trio.Event() if self._idle.is_set() else self._idle

    def attempt_finished(self) -> None:
        self._in_flight -= 1
        if self._in_flight < 0:  # pragma: no cover - defensive
            raise AionInternalError("in-flight attempt count went negative; please report this")
        if self._in_flight == 0:
            self._idle.set()

    async def wait_attempts_idle(self) -> None:
        while self._in_flight:
            await self._idle.wait()

    # -- completion retries ------------------------------------------------

    def arm_completion_retry(self, key: RetryKey, body: Callable[[RetrySlot], Awaitable[None]]) -> ArmOutcome:
        """Spawn ``body(slot)`` unless this lease already holds a retry or the epoch closed."""
        if not self._open:
            return ArmOutcome.EPOCH_CLOSED
        existing = self._retries.get(key)
        if existing is not None:
            return ArmOutcome.ALREADY_ARMED
        slot = RetrySlot(key=key)
        self._retries[key] = slot
        self._nursery.start_soon(self._run_retry, slot, body, name=f"completion-retry:{key.workflow_id}")
        return ArmOutcome.ARMED

    async def _run_retry(self, slot: RetrySlot, body: Callable[[RetrySlot], Awaitable[None]]) -> None:
        self._tasks += 1
        # Claimed by the running task, on its first step.
        slot.task = trio.lowlevel.current_task()
        try:
            await body(slot)
        except Exception:
            logger.exception(
                "completion retry for %s failed",
                slot.key,
                extra={
                    "workflow_id": slot.key.workflow_id,
                    "run_id": slot.key.run_id,
                    "lease": slot.key.lease_id,
                },
            )
        finally:
            self._tasks -= 1
            self.release_completion_retry(slot)

    def release_completion_retry(self, slot: RetrySlot) -> bool:
        """Remove ``slot`` if it is still the registered one and owned by the calling task."""
        current = self._retries.get(slot.key)
        if current is not slot:
            return False
        try:
            caller = trio.lowlevel.current_task()
        except RuntimeError:  # pragma: no cover - not in a task
            return False
        if slot.task is not caller:
            return False
        del self._retries[slot.key]
        return True

    def armed_completion_retry_count(self) -> int:
        return len(self._retries)

    def armed_completion_retry_keys(self) -> list[RetryKey]:
        return list(self._retries)

    def statistics(self) -> EpochStatistics:
        return EpochStatistics(
            is_open=self._open,
            admitting=self.admitting,
            armed_completion_retries=len(self._retries),
            in_flight_attempts=self._in_flight,
            background_tasks=self._tasks,
        )
