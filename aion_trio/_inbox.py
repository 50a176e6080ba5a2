"""The owning engine's side of the command inbox: keeping its claim alive and draining the inbox.

Heartbeats (from a thread of their own) and polls wait on the wall clock, not on Trio's
clock: liveness is judged by other processes in real time, and a mocked
clock that jumps days ahead must neither flood the store with heartbeats nor
starve them.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from typing import TYPE_CHECKING, final

import attrs
import trio

from ._commands import (
    ActivityCommand,
    CancelCommand,
    Command,
    CommandOutcome,
    IdReusePolicy,
    QueryCommand,
    ReopenCommand,
    ResetCommand,
    SignalCommand,
    SignalWithStartCommand,
    StartCommand,
    TerminateCommand,
    UpdateCommand,
    signal_recorded_outcome,
    signal_with_start_outcome,
)
from ._errors import AionError, AionInternalError, BackendUnavailable, EngineEpochClosed, NotOwner, StoreError
from ._ids import inbox_request_id
from ._ownership import OwnerClaim, wall_now
from ._store import CommandInbox, OwnedStore, ThreadRenewal

if TYPE_CHECKING:
    from ._epoch import EngineEpoch
    from ._hub import InboxHub, InboxSettings

logger = logging.getLogger("aion_trio.engine")


async def wall_sleep(seconds: float, limiter: trio.CapacityLimiter) -> None:
    """Sleep ``seconds`` of wall-clock time (cancellable; the helper thread exits at once).

    Not under ``hold_mock_time``: the thread waits, it does no work, and holding
    a MockClock's autojump for a wall-clock poll interval would stall mock time.
    """
    wake = threading.Event()
    try:
        await trio.to_thread.run_sync(wake.wait, seconds, abandon_on_cancel=True, limiter=limiter)
    finally:
        wake.set()


@final
@attrs.define(eq=False)
class Ownership:
    """This engine's claim on its store, renewed by :meth:`keep_alive`."""

    store: OwnedStore
    claim: OwnerClaim
    heartbeat: float
    renewals: int = 0
    _lost: NotOwner | None = None
    _scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    _epoch: EngineEpoch | None = None

    async def keep_alive(self, epoch: EngineEpoch) -> None:
        """Renew the claim every ``heartbeat`` seconds until cancelled.

        The beats run in a thread of their own, on the wall clock: with a
        :class:`~aion_trio.plugin.ThreadRenewal` store they go on while the Trio
        loop is blocked (an activity that never yields), so the claim never looks
        abandoned to another host.  A transient failure is logged and retried at
        the next beat.  If the claim was taken over (this engine was taken for
        dead), or a write was refused by the store's fence (:meth:`fenced`), the
        epoch is closed at once, so no later write lands, and :class:`NotOwner`
        is raised out of ``open_engine``.
        """
        self._epoch = epoch
        stop = threading.Event()
        with self._scope:
            try:
                lost = await trio.to_thread.run_sync(
                    self._beat_until_lost, stop, abandon_on_cancel=True, limiter=trio.CapacityLimiter(1)
                )
            finally:
                stop.set()  # the thread ends at once (or after the renewal it is making)
            if lost is None:  # pragma: no cover - the Trio run ended under the thread
                return
            self._lose(lost)
        assert self._lost is not None
        logger.error("lost ownership of the store; stopping: %s", self._lost)
        raise self._lost

    def fenced(self, error: NotOwner) -> None:
        """A write was refused because the claim is no longer ours: stop the engine (not a checkpoint)."""
        self._lose(error)

    def _lose(self, error: NotOwner) -> None:
        if self._lost is None:
            self._lost = error
        if self._epoch is not None:
            self._epoch.begin_close()
        self._scope.cancel()

    def _renew(self) -> OwnerClaim:
        store: object = self.store
        if isinstance(store, ThreadRenewal):
            return store.renew_owner_blocking(self.claim, now=wall_now())
        # A store that renews only through Trio: the beat waits for the loop.
        return trio.from_thread.run(functools.partial(self.store.renew_owner, self.claim, now=wall_now()))

    def _beat_until_lost(self, stop: threading.Event) -> NotOwner | None:
        # The heartbeat thread.  Returns the NotOwner that ended the claim, or None once stopped.
        while not stop.wait(self.heartbeat):
            try:
                self.claim = self._renew()
                self.renewals += 1
            except NotOwner as exc:
                return exc
            except StoreError as exc:
                logger.warning("could not renew the store's owner claim (will retry): %s", exc)
            except (trio.RunFinishedError, trio.Cancelled, trio.ClosedResourceError):
                return None
        return None

    async def release(self) -> None:
        """Drop the claim (shielded): the next engine need not wait.

        Not bounded by Trio's clock: under a mock clock that jumps while the store's
        thread works, a Trio deadline would cancel the release and leave the claim
        behind.  The store's own busy timeout bounds the write.
        """
        with trio.CancelScope(shield=True):
            try:
                await self.store.release_owner(self.claim)
            except (StoreError, trio.ClosedResourceError) as exc:
                logger.warning("could not release the store's owner claim: %s", exc)


def _one_line(text: str) -> str:
    return " ".join(text.split())


async def apply_command(
    commands: InboxHub, command: Command, command_id: int | None = None
) -> CommandOutcome:
    """Apply one command here, through the engine's local commands; a refusal becomes a failed outcome.

    ``EngineEpochClosed``, ``BackendUnavailable`` and ``NotOwner`` (cluster mode:
    another node claimed the workflow) propagate: the command was not (or not
    knowably) applied and stays queued for a later drain, or for the new owner.
    Every command but a query is applied under its request id (its own, or
    ``inbox:N`` from ``command_id``), which the effect's event records: a command
    delivered again (its worker died after applying it, before the ack) finds
    its effect in history, records nothing and answers with the first outcome.
    A query records nothing: delivered again, it is simply answered again.  An
    activity command (async completion) is not keyed by its request id: the
    attempt's recorded outcome makes it safe to apply again (the same outcome
    again is quiet; anything else is refused, recording nothing).
    """
    key = command.request_id
    if key is None and command_id is not None:
        key = inbox_request_id(command_id)
    try:
        if isinstance(command, StartCommand):
            args = commands.decode(command.args)
            policy = IdReusePolicy(command.id_reuse)
            started = await commands.start(
                command.workflow_type,
                args,
                workflow_id=command.workflow_id,
                id_reuse=policy,
                task_queue=command.task_queue,
                request_id=key,
            )
            verb = "started" if started.created else "attached to existing"
            return CommandOutcome.success(
                f"{verb} workflow {started.workflow_id!r} run {started.run_id}", run_id=started.run_id
            )
        if isinstance(command, SignalCommand):
            await commands.signal(command.workflow_id, command.name, command.payload, key)
            return signal_recorded_outcome(command.workflow_id, command.name)
        if isinstance(command, SignalWithStartCommand):
            started = await commands.signal_with_start(
                command.workflow_type,
                commands.decode(command.args),
                command.signal_name,
                command.payload,
                workflow_id=command.workflow_id,
                id_reuse=IdReusePolicy(command.id_reuse),
                task_queue=command.task_queue,
                search_attributes=command.search_attributes,
                timeout=command.timeout,
                request_id=key,
            )
            return signal_with_start_outcome(
                started.workflow_id, command.signal_name, started.run_id, created=started.created
            )
        if isinstance(command, CancelCommand):
            await commands.cancel(command.workflow_id, command.reason, key)
            return CommandOutcome.success(f"cancellation requested for workflow {command.workflow_id!r}")
        if isinstance(command, TerminateCommand):
            await commands.terminate(command.workflow_id, command.reason, key)
            return CommandOutcome.success(f"workflow {command.workflow_id!r} terminated")
        if isinstance(command, ReopenCommand):
            reopened = await commands.reopen(command.workflow_id, key)
            return CommandOutcome.success(
                f"reopened workflow {reopened.workflow_id!r} run {reopened.run_id}", run_id=reopened.run_id
            )
        if isinstance(command, ResetCommand):
            reset = await commands.reset(command.workflow_id, command.to_seq, command.reason, key)
            return CommandOutcome.success(
                f"reset workflow {reset.workflow_id!r}: new run {reset.run_id}", run_id=reset.run_id
            )
        if isinstance(command, QueryCommand):
            answer = await commands.query(command.workflow_id, command.name, command.args)
            return CommandOutcome.success(json.dumps(answer, ensure_ascii=False, separators=(",", ":")))
        if isinstance(command, UpdateCommand):
            await commands.accept_update(command.workflow_id, command.name, command.args, command.update_id)
            return CommandOutcome.success(
                f"update {command.update_id!r} accepted by workflow {command.workflow_id!r}"
            )
        if isinstance(command, ActivityCommand):
            await commands.activity_by_token(command)
            done = {"complete": "completed", "fail": "failed", "heartbeat": "heartbeat taken"}[command.action]
            return CommandOutcome.success(f"activity attempt of workflow {command.workflow_id!r} {done}")
        raise AionInternalError(f"unknown inbox command {command!r}; please report this")
    except (EngineEpochClosed, BackendUnavailable, NotOwner):
        raise
    except (AionError, ValueError, TypeError, LookupError) as exc:
        return CommandOutcome.failure(exc)


@final
@attrs.define(eq=False)
class InboxDrainer:
    """Applies the inbox's pending commands in order, one drain at a time, through the
    engine's local commands (``commands``, handed in by the wiring)."""

    commands: InboxHub
    inbox: CommandInbox
    config: InboxSettings
    limiter: trio.CapacityLimiter
    _lock: trio.Lock = attrs.field(factory=trio.Lock, init=False)
    applied: int = attrs.field(default=0, init=False)

    def _admitting(self) -> bool:
        return self.commands.admitting

    async def drain(self) -> int:
        """Apply and ack every pending command (FIFO); returns how many were acked.

        Stops early, leaving the rest queued, when the engine stops admitting
        work or the store is unavailable.
        """
        done = 0
        seen: set[int] = set()
        async with self._lock:
            while self._admitting():
                # A store that failed to drop an acked command must not make this loop forever.
                batch = [
                    p
                    for p in await self.inbox.pending_commands(self.config.inbox_batch)
                    if p.command_id not in seen
                ]
                if not batch:
                    break
                for pending in batch:
                    seen.add(pending.command_id)
                    if not self._admitting():
                        return done
                    try:
                        outcome = await apply_command(self.commands, pending.command, pending.command_id)
                    except EngineEpochClosed:
                        return done
                    except NotOwner as exc:
                        logger.info(
                            "inbox command #%d (%s) not applied: another node owns the workflow now; "
                            "it stays queued for that node: %s",
                            pending.command_id,
                            pending.command.describe(),
                            exc,
                        )
                        continue
                    except BackendUnavailable as exc:
                        logger.warning(
                            "inbox command #%d (%s) not applied, store unavailable; it stays queued: %s",
                            pending.command_id,
                            pending.command.describe(),
                            exc,
                        )
                        return done
                    await self.inbox.ack_command(pending.command_id, outcome)
                    done += 1
                    self.applied += 1
                    log = logger.info if outcome.ok else logger.warning
                    log(
                        "inbox command #%d (%s): %s",
                        pending.command_id,
                        pending.command.describe(),
                        _one_line(outcome.message),
                        extra={"command_id": pending.command_id},
                    )
        return done

    async def poll_forever(self) -> None:
        """Drain every ``inbox_poll_interval`` seconds (wall clock) until cancelled."""
        interval = self.config.inbox_poll_interval
        assert interval is not None
        while True:
            await wall_sleep(interval, self.limiter)
            try:
                await self.drain()
            except (StoreError, trio.ClosedResourceError) as exc:
                logger.warning("could not drain the command inbox (will retry): %s", exc)
