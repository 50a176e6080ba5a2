"""One execution of a run's code against its history: resolving commands, parking, poisoning.

Commands take per-run ordinals by family in program order and resolve against
the run's recorded command sequence as *Recorded* (replay: return it, append
nothing), *ResumeLive* (history exhausted: do it for real and record it) or
*NonDeterminism*.  Observations (activity outcomes, ...) are recorded before
they are observed: the code only ever reads its run's segment of the
recorder's history, a prefix that only grows, and consumes resolutions from
it -- so replay takes the branch the live run took.

:class:`Replay` holds that state for one execution and talks to the engine
only through its :class:`~aion_trio._ports.WorkflowPort`.  The context, the
handles and the query handlers are built on it.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from typing import Any, TypeVar, final

import attrs
import trio

from ._convert import handler_hints
from ._errors import (
    AionInternalError,
    NonDeterminismError,
    QueryReadOnly,
    Timeout,
    UpdateRejected,
    WorkflowCancelled,
    WorkflowCommandError,
)
from ._events import (
    ActivityScheduled,
    ErrorInfo,
    Event,
    EventBody,
    SignalReceived,
    TimerCancelCause,
    TimerCancelled,
    TimerFired,
    UpdateAccepted,
    WorkflowCancelRequested,
    input_digest,
)
from ._guard import run_workflow_code
from ._payload import Payload
from ._ports import CancelTimer, CompleteUpdate, RunAborted, StartTimer, WorkflowCommand, WorkflowPort
from ._projections import (
    COMMAND_ACTIVITY,
    COMMAND_TIMER,
    COMMAND_TIMER_CANCEL,
    COMMAND_UPDATE,
    CommandKey,
    command_key,
)

T = TypeVar("T")

#: While replaying, a wait that history resolves yields to the scheduler once in this many.
REPLAY_YIELD_EVERY = 64


@final
class Branch:
    """One line of execution of a run's code: the workflow function, or an async handler.

    A run's branches take turns: exactly one runs at a time (the one holding
    the turn); the others are suspended at an await.  Which branch goes next
    is decided from history alone (see :meth:`Replay.wait_until`), so a replay
    gives the turns in the order the live run did.
    """

    def __init__(self, name: str, task: trio.lowlevel.Task | None, index: int) -> None:
        #: For people: "the workflow function", "update handler 'x' (update-1)", ...
        self.name = name
        self.task = task
        #: Creation order: the tie-break between branches whose waits resolve at one seq.
        self.index = index
        #: Set when the turn is handed to this branch.
        self.wake = trio.Event()
        #: What the branch waits for while suspended at an await (``None`` while it runs).
        self.check: Callable[[], object] | None = None
        #: The timers of the timeout scopes this branch entered and did not leave, outermost first.
        self.scopes: list[str] = []
        self.cleanup_depth = 0
        #: What an async handler raised that the workflow function must raise (main branch only).
        self.failure: BaseException | None = None

    def __repr__(self) -> str:
        return f"<Branch {self.index}: {self.name}>"


@final
class Replay:
    """Where one execution of a run's code stands against the run's history."""

    # Slots: a resident run holds one; a dict of this many attributes costs ~1.5 KiB.
    __slots__ = (
        "abandoned",
        "answering",
        "branches",
        "branches_started",
        "caught_up",
        "current",
        "guarded",
        "main",
        "next_activity",
        "next_child",
        "next_command",
        "next_scope",
        "next_timer",
        "now",
        "nursery",
        "parked",
        "parked_at",
        "pending",
        "poisoned",
        "port",
        "position",
        "query_violation",
        "replayed_waits",
        "run_id",
        "signal_handlers",
        "start_head",
        "state",
        "timers_retired",
        "unobserved_children",
        "workflow_id",
    )

    def __init__(self, port: WorkflowPort) -> None:
        self.port = port
        self.workflow_id = port.workflow_id
        self.run_id = port.run_id
        self.state = port.run_state()
        start = self.state.start
        if start is None:
            raise WorkflowCommandError(f"run {port.run_id} has no WorkflowStarted in history")
        self.start_head = port.start_head
        #: The replay position (``ctx.now()``): the start's time, advanced by each resolution consumed.
        self.now: datetime = start.recorded_at
        self.position = start.seq
        # A run whose execution began with nothing after its start has nothing to replay.
        self.caught_up = self.start_head <= start.seq
        self.next_activity = 0
        self.next_timer = 0
        self.next_scope = 0
        self.next_child = 0
        #: Position in the run's recorded command sequence (``RunState.commands``): the
        #: code's next command must match the one recorded there, of whatever kind.
        self.next_command = 0
        #: Timers whose cancel this execution issued (or found recorded as its own).
        self.timers_retired: set[str] = set()
        #: Ids of children this execution started and whose outcome it has not consumed.
        self.unobserved_children: set[str] = set()
        #: Commands issued and not yet recorded (the next await records them as one batch).
        self.pending: list[WorkflowCommand] = []
        #: The divergence that stopped this execution: every later command raises it again.
        self.poisoned: BaseException | None = None
        #: The workflow function's branch, then the async handlers' still running, oldest first.
        self.main = Branch("the workflow function", trio.lowlevel.current_task(), 0)
        self.branches: list[Branch] = [self.main]
        #: The branch holding the turn: the only one whose task may issue commands.
        self.current = self.main
        self.branches_started = 1
        #: Where async handlers run (set by :meth:`run_code` while the code runs), and
        #: whether they run with the determinism guard on, as the workflow function does.
        self.nursery: trio.Nursery | None = None
        self.guarded = False
        #: The async handlers still running when the workflow function exited (cancelled).
        self.abandoned: list[str] = []
        # True only while the run's task is parked between steps, caught up with history;
        # parked_at is the history length it parked at (longer: it has something to consume).
        self.parked = False
        self.parked_at = 0
        #: The query whose handler runs now (commands are refused meanwhile).
        self.answering: str | None = None
        self.query_violation: QueryReadOnly | None = None
        #: Signal handlers by name and how many of each name's signals they were given
        #: (built when the code registers the first one).
        self.signal_handlers: SignalHandlers | None = None
        #: Waits resolved from history while replaying (every REPLAY_YIELD_EVERY-th yields).
        self.replayed_waits = 0

    # -- the current branch's state ---------------------------------------------

    @property
    def task(self) -> trio.lowlevel.Task | None:
        """The task holding the turn: the only one that may issue commands."""
        return self.current.task

    @property
    def scopes(self) -> list[str]:
        """The current branch's open timeout scopes (each branch has its own)."""
        return self.current.scopes

    @property
    def cleanup_depth(self) -> int:
        return self.current.cleanup_depth

    @cleanup_depth.setter
    def cleanup_depth(self, value: int) -> None:
        self.current.cleanup_depth = value

    # -- guards ----------------------------------------------------------------

    def refuse_in_query(self, what: str) -> None:
        if self.answering is not None:
            error = QueryReadOnly(self.workflow_id, self.run_id, self.answering, what)
            self.query_violation = error
            raise error
        handlers = self.signal_handlers
        if handlers is not None and handlers.running is not None:
            raise WorkflowCommandError(
                f"{what} was called from {handlers.running} of workflow {self.workflow_id!r}: plain "
                "(def) signal and update handlers, update validators and wait_condition predicates "
                "read and update the workflow's state and issue no commands; issue commands from "
                "the workflow code or from an async def handler (wait for the state with "
                "ctx.wait_condition)"
            )

    def require_own_task(self, what: str) -> None:
        self.refuse_in_query(what)
        try:
            current = trio.lowlevel.current_task()
        except RuntimeError:
            current = None
        if current is not self.current.task:
            raise WorkflowCommandError(
                f"{what} was called from a task that is not workflow {self.workflow_id!r}'s own; "
                "workflow commands must be issued by the workflow function itself — for concurrency "
                "use handles: h = ctx.start(activity, ...), then await ctx.gather(h1, h2) or "
                "ctx.wait_first(h1, h2) instead of a nursery"
            )
        if self.poisoned is not None:
            raise self.poisoned

    @property
    def answerable(self) -> bool:
        """Parked between steps with nothing new to consume: a query may read the state now.

        Once history grew past where the run parked (a signal, an activity
        result...), the run is due to take that step first, so a query asked
        after e.g. ``engine.signal`` returned sees the state after the signal.
        """
        return (
            self.parked
            and self.caught_up
            and self.poisoned is None
            and self.port.history_length() == self.parked_at
        )

    # -- consuming history ---------------------------------------------------------

    def consume(self, event: Event) -> None:
        if event.seq > self.position:
            self.position = event.seq
        if event.recorded_at > self.now:
            self.now = event.recorded_at

    def poison(self, error: BaseException) -> BaseException:
        self.poisoned = error
        return error

    def divergence(self, position: int, recorded: CommandKey, requested: str, seq: int) -> BaseException:
        return self.poison(
            NonDeterminismError(
                self.workflow_id,
                self.run_id,
                recorded.kind,
                position,
                recorded.describe(),
                requested,
                seq=seq,
            )
        )

    def recorded_end(self) -> Event | None:
        """The run's terminal if it was recorded before this execution began: the code
        replays a finished history, so going past its recorded commands is a divergence."""
        ended = self.state.ended
        return ended if ended is not None and ended.seq <= self.start_head else None

    def past_the_end(self, requested: str) -> BaseException:
        if self.port.read_only:
            return RunAborted()  # a replay for a query stops at the end of history
        ended = self.state.ended
        assert ended is not None
        return self.poison(
            NonDeterminismError(
                self.workflow_id,
                self.run_id,
                "run end",
                self.next_command,
                f"the run's end ({type(ended.body).__name__})",
                requested,
                seq=ended.seq,
            )
        )

    def resolve_command(self, requested: CommandKey, arguments: Payload | None = None) -> Event | None:
        """Resolve the code's next command against the run's recorded command sequence.

        Returns the recorded event (*Recorded*: replay, append nothing) or ``None``
        (*ResumeLive*: the caller records it).  A recorded command of another kind,
        name or arguments at this position is *NonDeterminism*.  One list index per
        command: no scan of the history.
        """
        commands = self.state.commands
        position = self.next_command
        self.next_command = position + 1
        if position < len(commands):
            recorded, event = commands[position]
            if not recorded.matches(requested):
                self.next_command = position
                wanted = requested.describe()
                if attrs.evolve(recorded, digest=None) == attrs.evolve(requested, digest=None):
                    wanted += f" with other arguments ({_argument_change(event, arguments)})"
                raise self.divergence(position, recorded, wanted, event.seq)
            return event
        if self.recorded_end() is not None:
            self.next_command = position
            raise self.past_the_end(requested.describe())
        self.caught_up = True
        return None

    def resolve_activity(self, name: str, arguments: Payload) -> Event | None:
        """:meth:`resolve_command` for an activity of type ``name`` called with ``arguments``.

        Replay's common case costs no digest and no key: the command recorded here is
        this activity's schedule with the same argument text, so the digests agree
        (the recorded digest is of that text).  Anything else is decided on the
        digest by :meth:`resolve_command`, as for every command.
        """
        commands = self.state.commands
        position = self.next_command
        if position < len(commands):
            recorded, event = commands[position]
            body = event.body
            if (
                type(body) is ActivityScheduled
                and recorded.kind == COMMAND_ACTIVITY
                and recorded.name == name
                and body.input.json == arguments.json
            ):
                self.next_command = position + 1
                return event
        else:
            # Nothing recorded to compare with (live, or a finished history's end): no digest.
            return self.resolve_command(CommandKey(COMMAND_ACTIVITY, name), arguments)
        return self.resolve_command(
            CommandKey(COMMAND_ACTIVITY, name, digest=input_digest(arguments)), arguments
        )

    def resolve_cancel(self, requested: CommandKey, resolution: Event | None) -> str:
        """The code cancels a timer, activity or child whose resolution so far is ``resolution``.

        Returns ``"recorded"`` (replay: the cancel is in history here), ``"record"``
        (live: the caller records it) or ``"none"`` (it was already resolved, so no
        cancel is written).  Live, a thing resolved first needs no cancel (one that
        resolves before the cancel is written is not cancelled either), so on replay
        a recorded resolution that is not itself a command stands for the cancel the
        live run did not write.
        """
        self.state.sync()
        commands = self.state.commands
        position = self.next_command
        if position < len(commands):
            recorded, event = commands[position]
            if recorded.matches(requested):
                self.next_command = position + 1
                return "recorded"
            if resolution is not None and command_key(resolution.body) is None:
                return "none"
            raise self.divergence(position, recorded, requested.describe(), event.seq)
        if resolution is not None:
            return "none"
        if self.recorded_end() is not None:
            raise self.past_the_end(requested.describe())
        self.next_command = position + 1
        self.caught_up = True
        return "record"

    def unissued_recorded_command(
        self, terminal: type[EventBody] | None = None
    ) -> tuple[str, int, str] | None:
        """The first command recorded in history that this execution never issued, if any:
        ``(kind, position in the run's command sequence, description)``.  Replaying a
        finished run, a recorded end of another kind than ``terminal`` counts too."""
        self.state.sync()
        position = self.next_command
        if position < len(self.state.commands):
            recorded, _ = self.state.commands[position]
            return (recorded.kind, position, recorded.describe())
        ended = self.recorded_end()
        if terminal is not None and ended is not None and not isinstance(ended.body, terminal):
            return ("run end", position, f"the run's end ({type(ended.body).__name__})")
        return None

    def exit_divergence(self, exit: str, terminal: type[EventBody]) -> BaseException | None:
        """The code exited (``exit`` says how, ``terminal`` is the event that exit records):
        the divergence from history this execution ends with, if any -- a command of its
        own failed to match, history holds a command it never issued, or (replaying a
        finished run) the recorded end is of another kind.  The engine marks such a run
        stuck; the replayer reports it."""
        if self.poisoned is not None:
            return self.poisoned
        leftover = self.unissued_recorded_command(terminal)
        if leftover is None:
            return None
        family, ordinal, recorded = leftover
        position = self.next_command
        commands = self.state.commands
        ended = self.state.ended
        seq = commands[position][1].seq if position < len(commands) else ended.seq if ended else None
        return NonDeterminismError(self.workflow_id, self.run_id, family, ordinal, recorded, exit, seq=seq)

    # -- timers --------------------------------------------------------------------

    def issue_timer(self, timer_id: str, fire_at: datetime) -> Event | None:
        """Issue the command starting ``timer_id``; returns its recorded ``TimerStarted`` on replay."""
        recorded = self.resolve_command(CommandKey(COMMAND_TIMER, timer_id))
        if recorded is None:
            self.pending.append(StartTimer(timer_id=timer_id, fire_at=fire_at))
        return recorded

    def resolve_timer_cancel(self, timer_id: str) -> bool:
        """The code retires timer ``timer_id``: ``True`` if the caller must record the cancel."""
        self.state.sync()
        verdict = self.resolve_cancel(
            CommandKey(COMMAND_TIMER_CANCEL, timer_id), self.state.timer_resolutions.get(timer_id)
        )
        if verdict != "none":
            self.timers_retired.add(timer_id)
        return verdict == "record"

    def retire_timer(self, timer_id: str) -> bool:
        """Retire ``timer_id`` unless already retired; ``True`` if its cancel was queued."""
        if timer_id not in self.timers_retired and self.resolve_timer_cancel(timer_id):
            self.pending.append(CancelTimer(timer_id=timer_id))
            return True
        return False

    async def await_timer_or_scope(self, timer_id: str) -> Event:
        """Wait for the timer's resolution; a timeout scope expiring first cancels the timer.

        That cancel is one of the code's commands: replay finds it recorded (and
        consumes it) where the live run wrote it.
        """

        async def expire(scope_timer: str) -> Event:
            if not self.resolve_timer_cancel(timer_id):
                resolution = self.state.timer_resolutions.get(timer_id)
                assert resolution is not None
                return resolution
            return await self.port.record_timer_scope_timeout(timer_id, scope_timer)

        event = await self.wait_until(lambda: self.state.timer_resolutions.get(timer_id), expire)
        body = event.body
        if (
            isinstance(body, TimerCancelled)
            and body.cause is TimerCancelCause.WORKFLOW_INTENT
            and timer_id not in self.timers_retired
        ):
            # Replay: the live run's scope expiry recorded this cancel here.
            self.resolve_timer_cancel(timer_id)
        return event

    def expired_scope(self) -> str | None:
        for timer_id in self.current.scopes:
            resolution = self.state.timer_resolutions.get(timer_id)
            if resolution is not None and isinstance(resolution.body, TimerFired):
                return timer_id
        return None

    def fired_scopes(self, extra: str | None = None) -> list[Event]:
        """The fires of the open scopes' timers (and of ``extra``) present in history."""
        fired_events = []
        for scope in [*self.current.scopes, *([extra] if extra else [])]:
            fired = self.state.timer_resolutions.get(scope)
            if fired is not None and isinstance(fired.body, TimerFired):
                fired_events.append(fired)
        return fired_events

    # -- recording and waiting -----------------------------------------------------------

    async def flush(self) -> bool:
        """Record pending commands (one batch) and dispatch what they start.

        Returns whether there were any (recording them passed a checkpoint).
        """
        if not self.pending:
            return False
        pending, self.pending = self.pending, []
        await self.port.record_commands(pending)
        return True

    def cancel_in_force(self) -> Event | None:
        """The cancel request this await must honour (none inside ``ctx.cleanup()``)."""
        if self.current.cleanup_depth:
            return None
        return self.state.cancel_request

    async def wait_until(
        self,
        check: Callable[[], T | None],
        on_expiry: Callable[[str], Awaitable[T]] | None = None,
        awaited_activities: Sequence[int] = (),
    ) -> T:
        """Flush commands, then park until ``check()`` finds a resolution in the snapshot.

        Inside a timeout scope whose timer fired in this snapshot (and no
        resolution is present), ``on_expiry`` records the timeout durably and
        returns what was recorded (or what won the race under the lock).

        While the run has several branches (async handlers beside the workflow
        function), the one whose wait history resolves first takes the turn
        (:meth:`_yield_turn`): this await returns only once this branch's
        resolution is the earliest in history.
        """
        self.require_own_task("awaiting a workflow handle")
        if not await self.flush():
            if self.caught_up:
                await trio.lowlevel.checkpoint()
            else:
                # Replaying recorded resolutions: a cancel point every time, a schedule
                # point every REPLAY_YIELD_EVERY waits (a pass of the scheduler on each
                # cost more than the step it interrupts; the run still yields often).
                self.replayed_waits += 1
                if self.replayed_waits % REPLAY_YIELD_EVERY:
                    await trio.lowlevel.checkpoint_if_cancelled()
                else:
                    await trio.lowlevel.checkpoint()
        branch = self.current
        branch.check = check
        try:
            while True:
                self.state.sync()
                ended = self.state.ended
                if ended is not None and ended.seq > self.start_head:
                    # Ended from outside while this code ran (a finished history being
                    # replayed holds its own terminal at or below the execution's start head).
                    raise RunAborted()
                if branch.failure is not None or self.poisoned is not None:
                    self._raise_failure(branch)
                found = check()
                cancel = self.cancel_in_force()
                expired = self.expired_scope()
                if (self.signal_handlers is not None or len(self.branches) > 1) and await self._yield_turn(
                    branch, self._cut(found, cancel, expired)
                ):
                    continue  # a handler or another branch ran first: decide again
                if found is not None and (cancel is None or _resolution_seq(found) < cancel.seq):
                    return found
                if cancel is not None:
                    fired = self.state.timer_resolutions.get(expired) if expired is not None else None
                    if fired is None or cancel.seq < fired.seq:
                        # Recorded before whatever would have resolved this await: replay decides alike.
                        body = cancel.body
                        assert isinstance(body, WorkflowCancelRequested)
                        if awaited_activities:
                            # The workflow stops waiting: the awaited attempts stop too.
                            await self.port.record_activities_cancelled(awaited_activities)
                        raise WorkflowCancelled(body.reason)
                if expired is not None:
                    if on_expiry is None:
                        raise Timeout(expired)
                    return await on_expiry(expired)
                if self.recorded_end() is not None:
                    # Nothing is appended to a finished run: this wait would never resolve.
                    raise self.past_the_end("a wait that history does not resolve")
                self.caught_up = True
                self.parked = True
                self.parked_at = self.port.history_length()
                self.port.parked()  # queries wait for this moment
                try:
                    await self.port.wait_changed()
                finally:
                    self.parked = False
                if self.poisoned is not None:
                    raise self.poisoned
        finally:
            branch.check = None

    # -- branches: async handlers beside the workflow function -----------------------

    def _raise_failure(self, branch: Branch) -> None:
        if self.poisoned is not None:
            raise self.poisoned
        failure = branch.failure
        if failure is not None:
            branch.failure = None
            raise failure

    def _branch_cut(self, branch: Branch) -> float:
        """Where history resolves suspended ``branch``'s wait (infinity: not yet), judged
        in that branch's own context (its timeout scopes, its cleanup depth)."""
        if branch.failure is not None:
            return -math.inf  # an async handler's failure is raised in it at once
        check = branch.check
        assert check is not None
        saved, self.current = self.current, branch
        try:
            return self._cut(check(), self.cancel_in_force(), self.expired_scope())
        finally:
            self.current = saved

    async def _yield_turn(self, me: Branch, my_cut: float) -> bool:
        """Give the turn to what history resolves before ``me``'s wait: the earliest handled
        signal or accepted update recorded before it (delivered here; an async handler gets
        a branch of its own) or another branch whose wait resolves earlier (a tie goes to
        the older branch).  ``False`` if nothing comes first; ``True`` once the turn came
        back to ``me`` (the caller decides again).

        The choice reads history only (seqs of recorded events), and each live decision
        reads a prefix of what a replay reads, so a replay hands out the turns -- and
        issues the branches' commands -- in the order the live run did.
        """
        best, best_cut = me, my_cut
        for other in self.branches:
            if other is not me and other.check is not None:
                cut = self._branch_cut(other)
                if (cut, other.index) < (best_cut, best.index):
                    best, best_cut = other, cut
        handlers = self.signal_handlers
        if handlers is not None:
            delivered = handlers.deliver_next(self, best_cut)
            if delivered is not None:
                await self.flush()  # an update handler's outcome is recorded before anything else
                if isinstance(delivered, Branch):
                    await self._switch(me, delivered)
                return True
        if best is me or best_cut == math.inf:
            return False
        await self._switch(me, best)
        return True

    async def _switch(self, me: Branch, to: Branch) -> None:
        """Hand the turn from ``me`` to ``to`` and wait until it comes back."""
        me.wake = trio.Event()
        self.current = to
        to.wake.set()
        await me.wake.wait()
        if self.current is not me:
            raise AionInternalError(f"{me!r} resumed while {self.current!r} holds the turn")

    def start_branch(self, name: str, body: Callable[[], Awaitable[object]]) -> Branch:
        """A new branch running ``body`` (an async handler); it runs once given the turn."""
        nursery = self.nursery
        if nursery is None:
            raise WorkflowCommandError(
                f"{name} is async, and this execution of workflow {self.workflow_id!r} runs no "
                "branches (its code was not started through RunActivation.run)"
            )
        branch = Branch(name, None, self.branches_started)
        self.branches_started += 1
        self.branches.append(branch)
        nursery.start_soon(self._run_branch, branch, body, name=f"workflow:{self.workflow_id}:{name}")
        return branch

    async def _run_branch(self, branch: Branch, body: Callable[[], Awaitable[object]]) -> None:
        branch.task = trio.lowlevel.current_task()
        await branch.wake.wait()
        try:
            if self.guarded:
                await run_workflow_code(body)
            else:
                await body()
        except trio.Cancelled:
            raise  # the run ends (or is torn down): nothing more of this branch is recorded
        except BaseException as exc:
            # What the handler did not turn into its own outcome (an async signal handler's
            # exception, a divergence, the run aborted): the workflow function raises it.
            if self.main.failure is None:
                self.main.failure = exc
        self.branches.remove(branch)
        # The workflow function takes the turn back and decides who goes next.
        self.current = self.main
        self.main.wake.set()

    def running_handlers(self) -> list[str]:
        """The async handlers started and not finished, oldest first."""
        return [b.name for b in self.branches if b is not self.main]

    async def run_code(self, fn: Callable[..., Awaitable[T]], *args: Any, guarded: bool) -> T:
        """``await fn(*args)`` (the workflow function) with a nursery for async handlers.

        When the function exits (returns or raises), handlers still running are
        cancelled: they record nothing more, and their updates stay without an
        outcome (the waiting caller gets :class:`~aion_trio.UpdateUnavailable`).
        """
        self.guarded = guarded
        failure: BaseException | None = None
        value: Any = None
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            try:
                value = await (run_workflow_code(fn, *args) if guarded else fn(*args))
            except BaseException as exc:
                failure = exc  # raised below, outside the nursery (never inside a group)
            finally:
                self.nursery = None
                self.abandoned = self.running_handlers()
                if nursery.child_tasks:
                    # Only handlers still running need cancelling: a run without them (a
                    # parked run unwound at close) skips the scope's recalculation.
                    nursery.cancel_scope.cancel()
        if failure is not None:
            try:
                raise failure
            finally:
                # The raised exception's traceback holds this frame: dropping the local breaks
                # the cycle, so a run's unwinding (each parked run at close) is freed at once
                # instead of piling up for the cycle collector.
                failure = None
        return value  # type: ignore[no-any-return]

    def _cut(self, found: object, cancel: Event | None, expired: str | None) -> float:
        """The seq of what ends the current wait, if history holds it (else infinity):
        signals recorded before it are delivered to their handlers first, live and on replay."""
        cut = math.inf
        if found is not None:
            cut = _resolution_seq(found)
        if cancel is not None:
            cut = min(cut, cancel.seq)
        if expired is not None:
            fired = self.state.timer_resolutions.get(expired)
            if fired is not None:
                cut = min(cut, fired.seq)
        return cut


@final
class SignalHandlers:
    """The signal and update handlers one execution of a run's code registered, and what
    they were given.

    A signal handler is a function of the signal's payload that updates the
    workflow's state.  Signals are given to it in the order they were recorded,
    at the run's awaits: before an await resolves, every handled signal recorded
    before its resolution (or before the cancel or timeout that ends it) is
    delivered.  That depends on history alone, so replay delivers each signal
    at the same point the live run did.  A signal recorded before its handler
    was registered is delivered at the next await.

    A plain handler runs to its end at the delivery; an ``async def`` handler
    starts a branch of the run (:meth:`Replay.start_branch`) that takes turns
    with the workflow function and may issue commands.
    """

    def __init__(self) -> None:
        self._handlers: dict[str, Callable[[Any], object]] = {}
        self._delivered: dict[str, int] = {}
        #: Update handlers and validators by name; the ids of the accepted updates delivered
        #: (and how many of the run's accepted updates, in order, all were).
        self._updates: dict[str, tuple[Callable[..., object], Callable[..., object] | None]] = {}
        self._updates_done: set[str] = set()
        self._updates_seen = 0
        #: What runs now ("signal handler 'x'", "the wait_condition predicate"): commands are refused.
        self.running: str | None = None

    def register(self, name: str, handler: Callable[[Any], object]) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"signal name must be a non-empty str, got {name!r}")
        if not callable(handler):
            raise TypeError(f"signal handler {name!r} must be callable, got {handler!r}")
        self._handlers[name] = handler

    def deliver_next(self, replay: Replay, below: float) -> Branch | bool | None:
        """Give the earliest undelivered handled signal or accepted update recorded before seq
        ``below`` to its handler; ``None`` if there is none, the new branch if the handler is
        async, else ``True``.  A plain signal handler's exception is raised at the await; an
        update handler's outcome is queued as the run's next command."""
        signals = replay.state.signals
        earliest: Event | None = None
        for name in self._handlers:
            received = signals.get(name)
            index = self._delivered.get(name, 0)
            if received is not None and index < len(received):
                candidate = received[index]
                if candidate.seq < below and (earliest is None or candidate.seq < earliest.seq):
                    earliest = candidate
        update = self._next_update(replay, below)
        if update is not None and (earliest is None or update.seq < earliest.seq):
            return self._deliver_update(replay, update)
        if earliest is None:
            return None
        body = earliest.body
        assert isinstance(body, SignalReceived)
        self._delivered[body.name] = self._delivered.get(body.name, 0) + 1
        replay.consume(earliest)
        value = replay.port.codec.decode(body.payload)
        handler = self._handlers[body.name]
        # An annotated parameter gets its type (a PayloadDecodeError reaches the workflow's code).
        value = handler_hints(handler).decode_arguments([value], what=f"payload of signal {body.name!r}")[0]
        what = f"signal handler {body.name!r}"
        if is_async_callable(handler):
            run: Callable[[], Awaitable[object]] = functools.partial(handler, value)  # type: ignore[assignment]
            return replay.start_branch(what, run)
        self.call(what, handler, value)
        return True

    # -- updates ---------------------------------------------------------------

    def register_update(
        self, name: str, handler: Callable[..., object], validator: Callable[..., object] | None
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"update name must be a non-empty str, got {name!r}")
        for role, fn in (("handler", handler), ("validator", validator)):
            if fn is None and role == "validator":
                continue
            if not callable(fn):
                raise TypeError(f"update {role} {name!r} must be callable, got {fn!r}")
        if validator is not None and is_async_callable(validator):
            raise TypeError(
                f"update validator {name!r} is an async function; a validator is a plain function "
                "(def, not async def) that reads the workflow's state and raises to reject the update "
                "(it runs while the run is parked, before anything is recorded)"
            )
        self._updates[name] = (handler, validator)

    def validate_update(self, workflow_id: str, name: str, args: Sequence[Any]) -> None:
        """Run update ``name``'s validator (the run's task is parked): raises its rejection."""
        entry = self._updates.get(name)
        if entry is None:
            raise UpdateRejected(
                workflow_id, name, "the workflow has no handler for this update (yet)", "LookupError"
            )
        validator = entry[1]
        if validator is None:
            return
        try:
            # Annotated parameters get their types, as the handler's do.
            typed = handler_hints(validator).decode_arguments(
                list(args), what=f"arguments of update {name!r}"
            )
            self.call(f"update validator {name!r}", validator, *typed)
        except Exception as exc:
            raise UpdateRejected(workflow_id, name, str(exc), type(exc).__name__) from exc

    def _next_update(self, replay: Replay, below: float) -> Event | None:
        for event in replay.state.updates[self._updates_seen :]:
            if event.seq >= below:
                return None
            body = event.body
            assert isinstance(body, UpdateAccepted)
            if body.update_id not in self._updates_done and body.name in self._updates:
                return event
        return None

    def _deliver_update(self, replay: Replay, event: Event) -> Branch | bool:
        body = event.body
        assert isinstance(body, UpdateAccepted)
        self._updates_done.add(body.update_id)
        while (
            self._updates_seen < len(replay.state.updates)
            and _update_id(replay.state.updates[self._updates_seen]) in self._updates_done
        ):
            self._updates_seen += 1
        replay.consume(event)
        codec = replay.port.codec
        handler = self._updates[body.name][0]
        what = f"update handler {body.name!r}"
        try:
            args = handler_hints(handler).decode_arguments(
                list(codec.decode(body.payload)), what=f"arguments of update {body.name!r}"
            )
            if is_async_callable(handler):
                run = functools.partial(self._run_async_update, replay, body, handler, args)
                return replay.start_branch(f"{what} ({body.update_id})", run)
            value = self.call(what, handler, *args)
            result = codec.encode(value, what=f"result of update {body.name!r}")
        except Exception as exc:
            _complete_update(
                replay, body.update_id, None, ErrorInfo(type=type(exc).__name__, message=str(exc))
            )
        else:
            _complete_update(replay, body.update_id, result, None)
        return True

    async def _run_async_update(
        self, replay: Replay, body: UpdateAccepted, handler: Callable[..., Any], args: Sequence[Any]
    ) -> None:
        """An async update handler's branch: run it, record its outcome (a command)."""
        result: Payload | None = None
        error: ErrorInfo | None = None
        try:
            value = await handler(*args)
            result = replay.port.codec.encode(value, what=f"result of update {body.name!r}")
        except (Exception, WorkflowCancelled) as exc:
            if replay.poisoned is not None:
                raise  # a divergence is the run's, not the update's
            error = ErrorInfo(type=type(exc).__name__, message=str(exc))
        _complete_update(replay, body.update_id, result, error)
        await replay.flush()

    def call(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        """Run a handler or predicate with commands refused."""
        self.running = what
        try:
            result = fn(*args)
        finally:
            self.running = None
        if inspect.isawaitable(result):
            if inspect.iscoroutine(result):
                result.close()
            raise TypeError(f"{what} returned an awaitable; it must be a plain function")
        return result


def is_async_callable(fn: object) -> bool:
    """An ``async def`` function (or an object with an async ``__call__``)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 -- an object with an async __call__
    )


def _complete_update(replay: Replay, update_id: str, result: Payload | None, error: ErrorInfo | None) -> None:
    """Queue an update's outcome as the run's next command (found instead on replay)."""
    if replay.resolve_command(CommandKey(COMMAND_UPDATE, update_id)) is None:
        replay.pending.append(CompleteUpdate(update_id=update_id, result=result, error=error))


def _update_id(event: Event) -> str:
    body = event.body
    assert isinstance(body, UpdateAccepted)
    return body.update_id


def _argument_change(recorded: Event, arguments: Payload | None) -> str:
    """Which argument differs between a recorded command's input and ``arguments``
    (only on a mismatch: it decodes both)."""
    before = getattr(recorded.body, "input", None)
    if not isinstance(before, Payload) or arguments is None:
        return "the arguments changed"
    old, new = before.value(), arguments.value()
    if not isinstance(old, list) or not isinstance(new, list):
        return "the arguments changed"
    if len(old) != len(new):
        return f"{len(new)} argument(s) where {len(old)} were recorded"
    changed = [str(i) for i, (a, b) in enumerate(zip(old, new, strict=True)) if a != b]
    if not changed:
        return "the arguments' encoding changed"
    return (
        f"argument {', '.join(changed)} changed"
        if len(changed) == 1
        else f"arguments {', '.join(changed)} changed"
    )


@final
@attrs.frozen
class Satisfied:
    """A wait whose condition holds: it became true at replay position ``seq``."""

    seq: int


def _resolution_seq(found: Any) -> int:
    """The seq at which an await's resolution became complete in history."""
    if isinstance(found, (Event, Satisfied)):
        return found.seq
    if isinstance(found, tuple):
        return _resolution_seq(found[-1])
    return max(int(e.seq) for e in found)
