"""The book of activity attempts that completions and heartbeats arrive for by task token.

The engine's side of async completion.  A caller that found an attempt open in history
(under the recorder lock) hands its outcome to the attempt's slot here and waits for the
answer; the activity's driver takes the outcome as the attempt's own (so the one activity
record path records it, and a failure is retried by the policy like any other) and answers
once its record is made.  Whatever ends the attempt otherwise (its own result, a timeout, a
cancellation, the driver stopping) answers a waiting caller with the refusal, so no caller
waits for an attempt that is over.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import final

import trio

from .._commands import ActivityCommand
from .._errors import ActivityAttemptClosed
from .._events import ActivityError, FailureCause
from .._payload import Payload
from .protocol import ActivityOutcome

AttemptKey = tuple[str, str, int, int]
"""``(workflow_id, run_id, activity_id, attempt)``."""


def command_outcome(command: ActivityCommand) -> tuple[ActivityOutcome | None, Payload | None]:
    """What an activity command brings its attempt: an outcome (complete, fail) or the
    details of a heartbeat."""
    if command.action == "heartbeat":
        return None, None if command.payload.json == "null" else command.payload
    if command.action == "complete":
        return ActivityOutcome(result=command.payload), None
    cause = FailureCause.TERMINAL if command.non_retryable else FailureCause.RETRYABLE
    error = ActivityError(cause=cause, type=command.error_type or "ActivityFailed", message=command.message)
    return ActivityOutcome(error=error), None


@final
class AttemptSlot:
    """One attempt's mailbox: the outcome a token brought, heartbeats, and the answer."""

    def __init__(self, key: AttemptKey) -> None:
        self.key = key
        #: The outcome a caller delivered, until the driver takes it.
        self.outcome: ActivityOutcome | None = None
        #: Whether the driver took a delivered outcome as the attempt's.
        self.taken = False
        #: When the last heartbeat (or the wait's start) was heard (Trio time).
        self.last_beat = trio.current_time()
        #: Where heartbeat details go (the driver's heartbeat log) once a driver waits.
        self.on_details: Callable[[Payload], None] | None = None
        #: Details heard before a driver waited.
        self.details: Payload | None = None
        self._changed = trio.Event()
        self._answered = trio.Event()
        self._refusal: BaseException | None = None

    def notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def changed(self) -> None:
        await self._changed.wait()

    def answer(self, refusal: BaseException | None) -> None:
        if not self._answered.is_set():
            self._refusal = refusal
            self._answered.set()

    async def answered(self) -> None:
        """Wait for the driver's answer; raises the refusal if there is one."""
        await self._answered.wait()
        if self._refusal is not None:
            raise self._refusal


@final
class AwaitingAttempts:
    """The engine's slots, by attempt.  Everything here is sync (no checkpoint): callers
    decide under the recorder lock and wait afterwards."""

    def __init__(self) -> None:
        self._slots: dict[AttemptKey, AttemptSlot] = {}

    def __len__(self) -> int:
        return len(self._slots)

    def slot(self, key: AttemptKey) -> AttemptSlot:
        """The attempt's slot (made on first use)."""
        found = self._slots.get(key)
        if found is None:
            found = self._slots[key] = AttemptSlot(key)
        return found

    def deliver(self, key: AttemptKey, outcome: ActivityOutcome) -> AttemptSlot:
        """Hand ``outcome`` to the attempt (found open in history by the caller)."""
        slot = self.slot(key)
        if slot.outcome is not None or slot.taken:
            workflow_id, _, activity_id, attempt = key
            raise ActivityAttemptClosed(
                workflow_id, activity_id, attempt, "another completion of this attempt is being recorded"
            )
        slot.outcome = outcome
        slot.notify()
        return slot

    def beat(self, key: AttemptKey, details: Payload | None) -> None:
        """A heartbeat by token for the attempt (found open in history by the caller)."""
        slot = self.slot(key)
        slot.last_beat = trio.current_time()
        if details is not None:
            if slot.on_details is not None:
                slot.on_details(details)
            else:
                slot.details = details
        slot.notify()

    def settle(self, key: AttemptKey, refusal: BaseException | None, *, reason: str) -> None:
        """The attempt's outcome was recorded (``refusal`` None) or could not be: answer its
        slot.  A delivered outcome the driver did not take is refused with ``reason``."""
        slot = self._slots.pop(key, None)
        if slot is None:
            return
        if slot.taken:
            slot.answer(refusal)
        elif slot.outcome is not None:
            workflow_id, _, activity_id, attempt = key
            slot.answer(ActivityAttemptClosed(workflow_id, activity_id, attempt, reason))
        else:
            slot.answer(None)

    def close_activity(self, workflow_id: str, run_id: str, activity_id: int, reason: str) -> None:
        """The activity's driver stopped: refuse what still waits on any of its attempts."""
        if not self._slots:
            return
        for key in [k for k in self._slots if k[:3] == (workflow_id, run_id, activity_id)]:
            slot = self._slots.pop(key)
            if slot.outcome is not None or slot.taken:
                slot.answer(ActivityAttemptClosed(workflow_id, activity_id, key[3], reason))
            else:
                slot.answer(None)
