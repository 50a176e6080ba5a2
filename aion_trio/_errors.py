"""The typed error set.

Each exception has one meaning and structured fields.  Backend exceptions are
mapped into the store errors at the store boundary, with the original kept as
``__cause__``.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any


class AionError(Exception):
    """Base class of every error aion_trio raises on purpose."""


class AionInternalError(AionError):
    """Something that cannot happen happened: a bug in aion_trio.

    Please report it, with the traceback, to the project's issue tracker.
    """


# --------------------------------------------------------------------------
# Store errors
# --------------------------------------------------------------------------


class StoreError(AionError):
    """Base class of errors raised by an event or visibility store."""


class BackendUnavailable(StoreError):
    """The backend could not be reached or was busy: transient.

    This is the only store error a retry may repair.  When raised from
    ``append`` the outcome of the write is *unknown*: the commit may have
    landed and only its acknowledgement been lost.
    """


class NotOwner(StoreError):
    """This engine no longer owns ``shard``: stop, never retry here.

    The common base of :class:`StoreTakenOver` (the engine's hold on the whole
    store was taken over) and :class:`WorkflowFenced` (cluster mode: one
    workflow was claimed by another node).  Stores raise one of those two;
    ``except NotOwner`` catches both.  Nothing was written.
    """

    def __init__(self, shard: str, detail: str = "") -> None:
        self.shard = shard
        self.detail = detail
        msg = f"this node no longer owns {shard!r}"
        if detail:
            msg += f": {detail}"
        super().__init__(msg)


class StoreTakenOver(NotOwner):
    """Another process took this engine's place in the store: it owns nothing there any more.

    An owned embedded store (SQLite, memory) whose claim another engine took
    over (this one was taken for dead; ``shard`` is ``'store'``), or a cluster
    node superseded by a newer open of its node id (``shard`` is the node id).
    The write was refused and nothing was written; ``open_engine`` raises it
    and the engine stops.
    """


class WorkflowFenced(NotOwner):
    """Cluster mode: another node claimed this workflow, so this node's write was refused.

    ``shard`` (also ``workflow_id``) names the workflow.  Nothing was written;
    the engine relinquishes the workflow and the new owner carries it on.
    Never retried here.
    """

    @property
    def workflow_id(self) -> str:
        """The fenced workflow (the same as ``shard``)."""
        return self.shard


class SequenceConflict(StoreError):
    """The stored head was not the expected one: a second writer exists.

    Nothing was written.  Report it loudly; never retry it.
    """

    def __init__(self, workflow_id: str, expected: int, found: int) -> None:
        self.workflow_id = workflow_id
        self.expected = expected
        self.found = found
        super().__init__(
            f"workflow {workflow_id!r}: expected stored head seq {expected}, found {found}"
            " (another writer appended to this history)"
        )


class StoreOwned(StoreError):
    """Another live engine owns this store: only one engine may write an embedded store.

    ``pid``, ``host`` and ``since`` (timezone-aware UTC) name the owner.  Nothing
    was written.  Stop that process first, or leave it running and send it
    commands through the store's inbox (the ``aion-trio`` CLI does this).
    """

    def __init__(self, pid: int, host: str, since: datetime, location: str | None = None) -> None:
        self.pid = pid
        self.host = host
        self.since = since
        self.location = location
        where = f"the store {location}" if location else "the store"
        super().__init__(
            f"{where} is owned by a live engine: pid {pid} on host {host!r} since "
            f"{since.isoformat(timespec='seconds')}; stop that process first (a dead owner's claim is "
            "taken over automatically), or send it commands through the inbox (aion-trio start/signal/"
            "cancel/terminate/reopen queue them for it)"
        )


class NodeInUse(StoreOwned):
    """Cluster mode: another live engine holds this node id's lease, so this one did not start.

    ``node_id``, and ``pid``, ``host`` and ``since`` of the engine holding it;
    ``lease_expires_at`` is when its lease runs out unless renewed (database
    clock).  Nothing was written: starting a second process with the same
    ``?node=`` would fence the first out of every workflow it owns.  Give each
    process its own node id, or stop the other one first (a node whose process
    is gone on this host, or whose lease ran out, is replaced at once).
    """

    def __init__(
        self,
        node_id: str,
        pid: int,
        host: str,
        since: datetime,
        lease_expires_at: datetime,
        location: str | None = None,
    ) -> None:
        self.node_id = node_id
        self.pid = pid
        self.host = host
        self.since = since
        self.lease_expires_at = lease_expires_at
        self.location = location
        where = f" of {location}" if location else ""
        StoreError.__init__(
            self,
            f"node id {node_id!r}{where} is held by a live engine: pid {pid} on host {host!r} since "
            f"{since.isoformat(timespec='seconds')} (its lease runs until "
            f"{lease_expires_at.isoformat(timespec='seconds')}); give this process another node id "
            "(?node=), or stop that one first",
        )


class NoTaskQueues(StoreError):
    """The store cannot hold activity tasks, so remote activity workers cannot serve it.

    ``location`` names the store.  Use a store with task queues (for example
    ``postgresql://``, from the aion-trio-postgres package) for both the
    engines and their workers.
    """

    def __init__(self, location: str) -> None:
        self.location = location
        super().__init__(
            f"the store {location} has no activity task queues, so remote activity workers cannot serve it; "
            "open the engines and workers on a store that has them (e.g. postgresql://... with "
            "aion-trio-postgres installed)"
        )


class InvalidBatch(StoreError, ValueError):
    """An append whose events are not the contiguous next seqs of one workflow.

    Nothing was written.  This is a caller bug, not a backend condition.
    """


class NotFound(StoreError):
    """The named workflow, run or record does not exist."""


class SerializationError(StoreError):
    """The common base of :class:`StoreEncodeError` and :class:`StoreDecodeError`.

    Names the workflow and seq, and the store location when known.  Stores
    raise one of the two subclasses; ``except SerializationError`` catches both.
    """

    _verb = "decode"

    def __init__(
        self,
        workflow_id: str,
        seq: int | None,
        detail: str,
        *,
        location: str | None = None,
    ) -> None:
        self.workflow_id = workflow_id
        self.seq = seq
        self.detail = detail
        self.location = location
        where = f"workflow {workflow_id!r}"
        if seq is not None:
            where += f" seq {seq}"
        if location:
            where += f" in {location}"
        super().__init__(f"cannot {self._verb} {where}: {detail}")


class StoreEncodeError(SerializationError):
    """An event (or visibility row) could not be encoded for the store: nothing was written.

    A bug or bad input (a value the backend cannot hold), not a damaged store.
    """

    _verb = "encode"


class StoreDecodeError(SerializationError):
    """Something stored could not be decoded: an event, a visibility row, an owner or inbox row.

    The store is damaged (or was written by something else); restore it from a backup.
    """


class InvalidQuery(StoreError, ValueError):
    """A visibility filter or search-attribute predicate is malformed."""


class StoreOpenError(StoreError):
    """A store could not be opened at ``location``; the message says why and what to do."""

    def __init__(self, location: str, reason: str) -> None:
        self.location = location
        self.reason = reason
        super().__init__(f"{location}: {reason}")


class NotAnAionDatabase(StoreOpenError):
    """The file exists but was not written by aion_trio."""


class DatabaseTooNew(StoreOpenError):
    """The database was written by a newer aion_trio schema than this code knows."""

    def __init__(self, location: str, found: int, supported: int) -> None:
        self.found = found
        self.supported = supported
        super().__init__(
            location,
            f"schema version {found} is newer than the newest this aion_trio supports"
            f" ({supported}); upgrade aion-trio to open it",
        )


class DatabaseCorrupt(StoreOpenError):
    """The database file is damaged."""


class StorePathError(StoreOpenError):
    """The store location is missing, not writable or otherwise unusable."""


# --------------------------------------------------------------------------
# Plugin and URL errors
# --------------------------------------------------------------------------


class PluginError(AionError):
    """Base class of store-plugin registration and lookup errors."""


class UnknownStoreScheme(PluginError, LookupError):
    """No registered plugin opens this URL scheme."""

    def __init__(self, scheme: str, known: Sequence[str], group: str) -> None:
        self.scheme = scheme
        self.known = tuple(known)
        self.group = group
        known_text = ", ".join(f"{k}://" for k in self.known) or "none"
        super().__init__(
            f"no store plugin handles {scheme}:// URLs (known schemes: {known_text}); "
            f"install a package that registers one in the {group!r} entry-point group"
        )


class StoreSchemeConflict(PluginError):
    """Two plugins claimed the same URL scheme."""

    def __init__(self, scheme: str, first: str, second: str) -> None:
        self.scheme = scheme
        self.plugins = (first, second)
        super().__init__(
            f"store scheme {scheme}:// is claimed by two plugins: {first!r} and {second!r}; "
            "uninstall one of them or disable it with AION_TRIO_DISABLE_PLUGINS"
        )


class InvalidStoreUrl(PluginError, ValueError):
    """A store URL that cannot be parsed or that its plugin refuses."""


# --------------------------------------------------------------------------
# Payload and wire errors
# --------------------------------------------------------------------------


class PayloadError(AionError, ValueError):
    """Base class of payload conversion errors; raised before anything is recorded."""


class PayloadNotSerializable(PayloadError, TypeError):
    """A value cannot be represented as JSON; ``path`` says where inside it."""

    def __init__(self, what: str, path: str, detail: str) -> None:
        self.what = what
        self.path = path
        self.detail = detail
        super().__init__(f"{what}{path}: {detail}")


class PayloadTooLarge(PayloadError):
    """An encoded payload exceeds the configured size limit."""

    def __init__(self, what: str, size: int, limit: int) -> None:
        self.what = what
        self.size = size
        self.limit = limit
        super().__init__(
            f"{what} encodes to {size} bytes, over the limit of {limit} bytes; "
            "store large data elsewhere and pass a reference, or raise "
            "PayloadCodec(max_bytes=...)"
        )


class PayloadDecodeError(PayloadError, TypeError):
    """A payload's JSON data does not fit the type its function annotates.

    ``what`` names the payload (``"input of activity 'charge'"``), ``path`` the
    place inside it (``"order.items[2].sku"``), ``detail`` what was wrong there
    (``'expected int, got "x"'``).
    """

    def __init__(self, what: str, path: str, detail: str) -> None:
        self.what = what
        self.path = path
        self.detail = detail
        super().__init__(f"{what}: {path}: {detail}" if path else f"{what}: {detail}")


class PayloadCodecError(PayloadError):
    """A stored payload does not decode through the configured codec chain.

    A wrong or missing key, a tampered payload, or a codec named in the payload
    that is not configured.  ``workflow_id`` and ``seq`` name the event (``seq``
    is ``None`` for a payload met outside history, such as a remote activity
    task's), ``what`` the payload in it, ``detail`` what went wrong.  Nothing
    falls back to the undecoded bytes.
    """

    def __init__(self, workflow_id: str, seq: int | None, what: str, detail: str) -> None:
        self.workflow_id = workflow_id
        self.seq = seq
        self.what = what
        self.detail = detail
        where = f"workflow {workflow_id!r}" + (f" seq {seq}" if seq is not None else "")
        super().__init__(f"{where}: {what}: {detail}")


class EventDecodeError(AionError, ValueError):
    """A wire-form event has an unknown type, an unknown or missing field, or a bad value."""


class InvalidHistory(AionError, ValueError):
    """A history given to the replayer cannot be replayed as it is: a file that is not
    JSON-lines events, or a workflow's events that are not its whole history (seq 1, 2, ...).

    ``source`` names the file (and line) or the history; the message says what to fix.
    """

    def __init__(self, source: str, detail: str) -> None:
        self.source = source
        self.detail = detail
        super().__init__(f"{source}: {detail}")


class CommandDecodeError(AionError, ValueError):
    """A wire-form inbox command has an unknown type, an unknown or missing field, or a bad value."""


# --------------------------------------------------------------------------
# Engine errors
# --------------------------------------------------------------------------


class EngineError(AionError):
    """Base class of errors raised by the engine itself."""


class EngineEpochClosed(EngineError):
    """A durable write was refused because this engine's epoch has closed.

    It is not a store fault: the engine is shutting down (or has shut down),
    nothing was written, and the next engine's recovery owns the work.
    Constructed only by :func:`epoch_closed`.
    """

    def __init__(self, workflow_id: str | None, run_id: str | None, action: str) -> None:
        self.workflow_id = workflow_id
        self.run_id = run_id
        self.action = action
        where = ""
        if workflow_id is not None:
            where = f" for workflow {workflow_id!r}"
            if run_id is not None:
                where += f" run {run_id}"
        super().__init__(
            f"refused to {action}{where}: the engine epoch is closed (the engine is shutting "
            "down); nothing was written and the next engine's recovery will pick this up"
        )


class CommandNotAnswered(EngineError):
    """A command sent to the node that owns a workflow (cluster mode) got no outcome in time.

    The command stays queued in the store's inbox: the owner (or, if it died,
    the node that claims the workflow next) may still apply it.  Check the
    workflow's history before sending it again.
    """

    def __init__(self, command_id: int, description: str, timeout: float) -> None:
        self.command_id = command_id
        self.description = description
        self.timeout = timeout
        super().__init__(
            f"inbox command #{command_id} ({description}) got no outcome within {timeout:g}s: the node "
            "owning the workflow has not applied it yet (it stays queued and may still be applied); check "
            "that engine nodes are running, or raise EngineConfig.remote_command_timeout"
        )


class AdmissionTimeout(EngineError):
    """No slot of an admission pool came free in time: the engine refused the work, nothing was done.

    ``pool`` names the pool (``"starts"``, ``"activities"``), ``capacity`` its
    bound (how many were in flight), ``timeout`` the seconds waited and
    ``setting`` what configures it.  The engine is busy, not broken: retry
    later, or raise the bound or the wait (``EngineConfig``).  A start refused so
    recorded nothing and may be retried as it is.
    """

    def __init__(self, pool: str, capacity: int, timeout: float, setting: str) -> None:
        self.pool = pool
        self.capacity = capacity
        self.timeout = timeout
        self.setting = setting
        super().__init__(
            f"refused: all {capacity} slots of the engine's {pool!r} admission pool stayed taken for "
            f"{timeout:g}s, so nothing was done; retry later, or raise {setting} or "
            "EngineConfig.admission_timeout"
        )


def epoch_closed(workflow_id: str | None, run_id: str | None, action: str) -> EngineEpochClosed:
    """The one place an :class:`EngineEpochClosed` is constructed."""
    return EngineEpochClosed(workflow_id, run_id, action)


class NonDeterminismError(EngineError):
    """Replayed workflow code issued a command that differs from the recorded one.

    The run is not failed: it stays Running and is marked stuck until an
    operator deploys compatible code (and restarts) or terminates it.
    ``seq`` is the recorded event the code diverged at (``None`` when unknown);
    ``recorded`` is what that event holds, ``requested`` what the code did instead.
    """

    def __init__(
        self,
        workflow_id: str,
        run_id: str,
        family: str,
        ordinal: int,
        recorded: str,
        requested: str,
        *,
        seq: int | None = None,
    ) -> None:
        self.workflow_id = workflow_id
        self.run_id = run_id
        self.family = family
        self.ordinal = ordinal
        self.recorded = recorded
        self.requested = requested
        self.seq = seq
        at = f" at seq {seq}" if seq is not None else ""
        super().__init__(
            f"non-determinism in workflow {workflow_id!r} run {run_id}: {family} command "
            f"#{ordinal} was recorded as {recorded}{at} but the code now requests {requested}; "
            "the run stays Running (marked stuck) until compatible code is deployed or it is "
            "terminated (use ctx.patched() to change code under running workflows)"
        )


class NonDeterministicCall(EngineError, RuntimeError):
    """Workflow code made a call that breaks replay (a clock, randomness, I/O, a thread).

    On replay the call would answer differently than it did live, and the run
    would take another branch.  ``call`` names it, ``instead`` the deterministic
    alternative (``ctx.now()``, ``ctx.sleep()``, ``ctx.random()``, ``ctx.uuid4()``,
    an activity).  Raised where the call was made, like any exception of the
    code's own: uncaught, it fails the run.
    """

    def __init__(self, call: str, instead: str) -> None:
        self.call = call
        self.instead = instead
        super().__init__(
            f"{call} was called from workflow code, where it breaks replay (a replayed run would get "
            f"another answer); use {instead} instead, or wrap a block known to be safe in "
            "'with aion_trio.unsafe_nondeterminism():' (EngineConfig(determinism_guard=False) turns "
            "the guard off)"
        )


class UnknownWorkflowType(EngineError, LookupError):
    """No workflow of this name is registered with the engine."""

    def __init__(self, name: str, known: Sequence[str]) -> None:
        self.name = name
        self.known = tuple(known)
        super().__init__(
            f"workflow type {name!r} is not registered with this engine "
            f"(registered: {', '.join(self.known) or 'none'}); pass it in open_engine(workflows=[...])"
        )


class UnknownActivityType(EngineError, LookupError):
    """No activity of this name is registered with the engine."""

    def __init__(self, name: str, known: Sequence[str]) -> None:
        self.name = name
        self.known = tuple(known)
        super().__init__(
            f"activity type {name!r} is not registered with this engine "
            f"(registered: {', '.join(self.known) or 'none'}); pass it in open_engine(activities=[...])"
        )


class InvalidArguments(EngineError, TypeError):
    """The arguments do not fit the workflow's or activity's signature; nothing was recorded."""

    def __init__(self, kind: str, name: str, parameter: str | None, signature: str, detail: str) -> None:
        self.kind = kind
        self.name = name
        self.parameter = parameter
        self.signature = signature
        super().__init__(f"{kind} {name!r} takes {signature}: {detail}; nothing was recorded")


class WorkflowNotFound(EngineError, LookupError):
    """No workflow with this id (or run) exists in the store."""

    def __init__(self, workflow_id: str, run_id: str | None = None) -> None:
        self.workflow_id = workflow_id
        self.run_id = run_id
        what = f"workflow {workflow_id!r}" + (f" run {run_id}" if run_id else "")
        super().__init__(f"{what} does not exist in this store")


class WorkflowAlreadyStarted(EngineError):
    """A start was refused by the id-reuse policy."""

    def __init__(self, workflow_id: str, run_id: str, status: str, policy: str) -> None:
        self.workflow_id = workflow_id
        self.run_id = run_id
        self.status = status
        self.policy = policy
        super().__init__(
            f"workflow {workflow_id!r} already exists (run {run_id}, {status}); id_reuse={policy} "
            "refuses a new run — pick another workflow_id or another id_reuse policy"
        )


class NotRunning(EngineError):
    """The operation needs a running workflow, and this one is terminal.

    ``writes`` is false for an operation that never records anything (a query): its
    message then does not say that nothing was recorded.
    """

    def __init__(self, workflow_id: str, status: str, operation: str, *, writes: bool = True) -> None:
        self.workflow_id = workflow_id
        self.status = status
        self.operation = operation
        outcome = "nothing was recorded" if writes else "only a running workflow answers queries"
        super().__init__(
            f"cannot {operation} workflow {workflow_id!r}: it is {status}, not running; {outcome}"
        )


class CannotReset(EngineError):
    """``reset`` (or ``fork``) was asked to copy a run's history up to an event that is not
    one of its reset points (``valid``: the seqs it could be, ascending)."""

    def __init__(
        self, workflow_id: str, run_id: str | None, to_seq: int | None, valid: Sequence[int]
    ) -> None:
        self.workflow_id = workflow_id
        self.run_id = run_id
        self.to_seq = to_seq
        self.valid = tuple(valid)
        choices = ", ".join(str(v) for v in self.valid) or "none"
        what = "it has no step to reset to" if to_seq is None else f"seq {to_seq} is not a reset point"
        super().__init__(
            f"cannot reset workflow {workflow_id!r} (run {run_id}): {what}; a reset point is the run's "
            f"start or a step boundary with nothing in flight (valid: {choices}); nothing was recorded"
        )


class CannotReopen(EngineError):
    """``reopen`` was asked of a run that cannot be reopened (not Failed or Cancelled,
    or its code already reacted to a cancellation)."""

    def __init__(self, workflow_id: str, run_id: str | None, why: str) -> None:
        self.workflow_id = workflow_id
        self.run_id = run_id
        self.why = why
        super().__init__(
            f"cannot reopen workflow {workflow_id!r} (run {run_id}): {why}; nothing was recorded"
        )


class WorkflowCommandError(EngineError, RuntimeError):
    """A workflow command was used where it is not allowed (wrong task, query handler, ...)."""


class QueryError(EngineError):
    """Base class of the errors only a query raises (see also ``WorkflowNotFound``, ``NotRunning``)."""


class UnknownQuery(QueryError, LookupError):
    """The run has no query handler of this name (``known`` lists the registered ones)."""

    def __init__(self, workflow_id: str, run_id: str, name: str, known: Sequence[str]) -> None:
        self.workflow_id = workflow_id
        self.run_id = run_id
        self.name = name
        self.known = tuple(known)
        super().__init__(
            f"workflow {workflow_id!r} run {run_id} has no query handler {name!r} "
            f"(registered: {', '.join(repr(k) for k in self.known) or 'none'}); register one in the "
            f"workflow code with ctx.set_query_handler({name!r}, fn) or @ctx.query_handler"
        )


class QueryFailed(QueryError):
    """The query handler raised; the original exception is ``__cause__``.  The run is unaffected."""

    def __init__(self, workflow_id: str, run_id: str, name: str, error: BaseException) -> None:
        self.workflow_id = workflow_id
        self.run_id = run_id
        self.name = name
        self.error = error
        super().__init__(
            f"query {name!r} on workflow {workflow_id!r} run {run_id} failed: its handler raised "
            f"{type(error).__name__}: {error} (traceback in __cause__); the run is unaffected"
        )


class QueryReadOnly(QueryError, WorkflowCommandError):
    """A query handler tried to issue a workflow command; queries are read-only.

    Raised inside the handler at the command, and by ``engine.query`` (even if
    the handler caught it).  Nothing was recorded; the run is unaffected.
    """

    def __init__(self, workflow_id: str, run_id: str, name: str, command: str) -> None:
        self.workflow_id = workflow_id
        self.run_id = run_id
        self.name = name
        self.command = command
        super().__init__(
            f"query handler {name!r} of workflow {workflow_id!r} run {run_id} called {command}: "
            "queries are read-only — a handler may read the workflow's state and ctx.now(), but "
            "must not issue commands (activities, timers, signals, timeouts, markers, "
            "continue-as-new, ctx.random()/uuid4(), handler registration); issue the command from "
            "the workflow code instead. The query failed; nothing was recorded and the run is unaffected"
        )


class QueryUnavailable(QueryError):
    """Nothing here can run the handler: the run is Running but its code is not executing
    in this engine (stuck or not resident), or it is closed and replaying its history with
    this engine's code is not possible (its type is not registered, or the code diverged)."""

    def __init__(self, workflow_id: str, run_id: str, reason: str, *, status: str = "Running") -> None:
        self.workflow_id = workflow_id
        self.run_id = run_id
        self.reason = reason
        self.status = status
        super().__init__(f"cannot query workflow {workflow_id!r} run {run_id}: it is {status}, but {reason}")


class UpdateError(EngineError):
    """An update (``engine.update``) did not return a result."""


class UpdateRejected(UpdateError):
    """The update was refused before anything was recorded: no handler of that name is
    registered by the running code, or its validator raised (``error_type``, ``message``)."""

    def __init__(self, workflow_id: str, name: str, message: str, error_type: str) -> None:
        self.workflow_id = workflow_id
        self.name = name
        self.message = message
        self.error_type = error_type
        super().__init__(
            f"update {name!r} of workflow {workflow_id!r} was rejected ({error_type}: {message}); "
            "nothing was recorded"
        )


class UpdateFailed(UpdateError):
    """The update was accepted and its handler raised: ``error_type`` and ``message`` are
    the exception's, as recorded in ``UpdateCompleted`` (a retry with the same update id
    raises this again; the handler does not run again)."""

    def __init__(self, workflow_id: str, name: str, update_id: str, error_type: str, message: str) -> None:
        self.workflow_id = workflow_id
        self.name = name
        self.update_id = update_id
        self.error_type = error_type
        self.message = message
        super().__init__(
            f"update {name!r} ({update_id}) of workflow {workflow_id!r} failed: {error_type}: {message}"
        )


class UpdateUnavailable(UpdateError):
    """Nothing here can take the update now: the run's code is not executing in this engine
    (stuck, or not resident), or the run closed after the update was accepted and before
    its handler finished (``reason`` says which)."""

    def __init__(self, workflow_id: str, name: str, reason: str) -> None:
        self.workflow_id = workflow_id
        self.name = name
        self.reason = reason
        super().__init__(f"update {name!r} of workflow {workflow_id!r} has no result: {reason}")


class ActivityFailure(AionError):
    """Raised inside workflow code when an activity settled with a final failure."""

    def __init__(self, activity_id: int, activity_type: str, error: Any) -> None:
        self.activity_id = activity_id
        self.activity_type = activity_type
        self.error = error
        super().__init__(
            f"activity:{activity_id} {activity_type} failed ({error.cause.value}): "
            f"{error.type}: {error.message}"
        )

    @property
    def type(self) -> str:
        """The type name of the exception the activity raised."""
        return str(self.error.type)

    @property
    def message(self) -> str:
        """The message of the exception the activity raised."""
        return str(self.error.message)


class WorkflowFailure(AionError):
    """Raised by ``result()`` when the run ended without a result.

    ``status`` is the terminal status; ``error`` the recorded error (for Failed).
    """

    def __init__(
        self, workflow_id: str, run_id: str, status: str, error: Any = None, reason: str = ""
    ) -> None:
        self.workflow_id = workflow_id
        self.run_id = run_id
        self.status = status
        self.error = error
        self.reason = reason
        detail = f"{error.type}: {error.message}" if error is not None else reason
        super().__init__(
            f"workflow {workflow_id!r} run {run_id} {status}" + (f": {detail}" if detail else "")
        )


class ChildWorkflowFailure(AionError):
    """Raised inside workflow code when a child workflow ended without a result.

    ``status`` is how the child ended: ``"failed"`` (``error`` holds its recorded
    error), ``"timed_out"`` (its deadline passed), ``"cancelled"`` (``reason`` says
    why; a terminate reads ``"terminated: ..."``), or ``"not_started"`` (the child
    id belongs to another running workflow).
    """

    def __init__(
        self,
        child_workflow_id: str,
        workflow_type: str,
        status: str,
        error: Any = None,
        reason: str = "",
    ) -> None:
        self.child_workflow_id = child_workflow_id
        self.workflow_type = workflow_type
        self.status = status
        self.error = error
        self.reason = reason
        detail = f"{error.type}: {error.message}" if error is not None else reason
        super().__init__(
            f"child workflow {child_workflow_id!r} ({workflow_type}) {status}"
            + (f": {detail}" if detail else "")
        )


class AttemptCancelled(AionError):
    """Raised by :func:`aion_trio.heartbeat` in a plain ``def`` activity whose attempt was stopped.

    The engine cannot interrupt a thread: on cancel, terminate, a timeout
    (attempt, heartbeat, schedule-to-close, timeout scope), a workflow deadline
    or engine shutdown it stops waiting for the thread and tells it through
    this (and :func:`aion_trio.activity_cancelled`).  Let it propagate, or
    return: whatever the thread does next is discarded.
    """

    def __init__(self, activity_type: str, activity_id: int, attempt: int) -> None:
        super().__init__(
            f"activity:{activity_id} {activity_type} attempt {attempt} was cancelled; "
            "the engine no longer waits for this thread"
        )
        self.activity_type = activity_type
        self.activity_id = activity_id
        self.attempt = attempt


class InvalidActivityToken(AionError, ValueError):
    """The text given as an activity task token is not one (``activity_info().task_token``)."""

    def __init__(self, token: object, reason: str) -> None:
        self.token = token
        self.reason = reason
        shown = repr(token) if not isinstance(token, str) or len(token) <= 80 else repr(token[:77] + "...")
        super().__init__(f"not an activity task token ({reason}): {shown}")


class ActivityAttemptClosed(EngineError):
    """The activity attempt a task token names can no longer be completed, failed or heartbeaten.

    It already has an outcome (a completion, a failure, a timeout), a later
    attempt runs, the activity or its run settled, or the attempt never
    started; ``reason`` says which.  Nothing was recorded.
    """

    def __init__(self, workflow_id: str, activity_id: int, attempt: int, reason: str) -> None:
        self.workflow_id = workflow_id
        self.activity_id = activity_id
        self.attempt = attempt
        self.reason = reason
        super().__init__(
            f"attempt {attempt} of activity:{activity_id} of workflow {workflow_id!r} is not open: {reason}; "
            "nothing was recorded"
        )


class TerminalError(Exception):
    """Raise from activity code for a failure that must not be retried."""


class PolicyRefused(Exception):
    """Raise from an activity (or a dispatcher) when the target refused the call by policy.

    Rate limits, quotas, a queue that does not accept the work: retry-eligible
    within the budget, and with ``fallback_queues`` the next attempt hops to
    the next queue.
    """


class WorkerLost(Exception):
    """Raised by a dispatcher when the worker running an attempt vanished before reporting.

    The same attempt is re-dispatched; no retry budget is consumed.
    """


class Timeout(AionError):
    """A ``ctx.timeout()`` scope expired while workflow code was waiting inside it.

    The expiry is recorded durably, so replay raises it at the same point.
    """


class WorkflowCancelled(BaseException):
    """Raised inside workflow code at its next await after ``engine.cancel(...)``.

    A ``BaseException`` (like ``trio.Cancelled``), so ``except Exception`` in
    workflow code does not swallow a cancellation by accident.  Catch it to
    compensate, run the compensation inside ``with ctx.cleanup():`` (awaits
    there are not interrupted), then re-raise: a run that ends by raising it is
    recorded ``WorkflowCancelled``.  Cancellation is level-triggered: every
    await outside a cleanup scope raises it again.
    """

    def __init__(self, reason: str = "") -> None:
        self.reason = reason
        super().__init__(f"workflow cancelled: {reason}" if reason else "workflow cancelled")


# --------------------------------------------------------------------------
# Schedules (engine.schedules, docs/schedules.md)
# --------------------------------------------------------------------------


class ScheduleError(AionError):
    """Base class of the errors about durable schedules."""


class InvalidSchedule(ScheduleError, ValueError):
    """A schedule's definition is unusable (a bad cron expression, an unknown time zone, an
    interval that is not positive, a start after its end, ...); nothing was written.

    ``field`` names the part that is wrong."""

    def __init__(self, field: str, detail: str) -> None:
        self.field = field
        super().__init__(f"invalid schedule {field}: {detail}; nothing was written")


class ScheduleNotFound(ScheduleError, LookupError):
    """No schedule with this id exists in the store."""

    def __init__(self, schedule_id: str) -> None:
        self.schedule_id = schedule_id
        super().__init__(f"schedule {schedule_id!r} does not exist in this store")


class ScheduleAlreadyExists(ScheduleError):
    """A schedule with this id exists already; nothing was written (``update`` changes one)."""

    def __init__(self, schedule_id: str) -> None:
        self.schedule_id = schedule_id
        super().__init__(
            f"schedule {schedule_id!r} already exists; pick another id, or change it with "
            "engine.schedules.update()"
        )


class ScheduleConflict(ScheduleError, StoreError):
    """A schedule write expected ``expected`` as the stored version and found ``found``
    (``0``: the schedule is gone): another writer changed it in between.  Nothing was
    written; the writer reads the schedule again and decides anew."""

    def __init__(self, schedule_id: str, expected: int, found: int) -> None:
        self.schedule_id = schedule_id
        self.expected = expected
        self.found = found
        super().__init__(
            f"schedule {schedule_id!r}: expected stored version {expected}, found "
            f"{found if found else 'none (deleted)'}; nothing was written"
        )


class SchedulesUnsupported(ScheduleError):
    """The store has no schedule capability (:class:`~aion_trio.ScheduleStore`).

    ``location`` names the store.  The built-in stores (``memory://``, ``sqlite://``)
    and ``postgresql://`` have it."""

    def __init__(self, location: str) -> None:
        self.location = location
        super().__init__(
            f"the store {location} cannot hold schedules (it does not implement "
            "aion_trio.ScheduleStore); open the engine on a store that does (memory://, "
            "sqlite://, postgresql://)"
        )


class FlowError(AionError):
    """Base class of the errors about flow control (limits and workflow queues)."""


class FlowControlUnsupported(FlowError):
    """What was asked of flow control needs the store's :class:`~aion_trio.FlowStore`
    (a cluster-wide bound, a workflow queue) and the store ``location`` has none.
    The built-in stores (``memory://``, ``sqlite://``) and ``postgresql://`` have it."""

    def __init__(self, location: str, what: str) -> None:
        self.location = location
        self.what = what
        super().__init__(
            f"{what} needs a store with aion_trio.FlowStore, and the store {location} has none; "
            "open the engine on one that does (memory://, sqlite://, postgresql://)"
        )


class UnknownQueue(FlowError, ValueError):
    """``engine.enqueue(..., queue=NAME)`` names a queue the engine was not configured
    with (``EngineConfig.workflow_queues``); nothing was enqueued."""

    def __init__(self, queue: str, known: list[str]) -> None:
        self.queue = queue
        self.known = known
        super().__init__(
            f"no workflow queue {queue!r} in EngineConfig.workflow_queues "
            f"(configured: {', '.join(map(repr, known)) or 'none'}); nothing was enqueued"
        )


class QueueDeduplicated(FlowError):
    """A run with the same ``dedup_id`` is already queued or running in ``queue``: this
    enqueue was refused and nothing was written.  ``workflow_id`` is that run's
    (``engine.handle(workflow_id)`` waits for it)."""

    def __init__(self, queue: str, dedup_id: str, workflow_id: str) -> None:
        self.queue = queue
        self.dedup_id = dedup_id
        self.workflow_id = workflow_id
        super().__init__(
            f"queue {queue!r} already holds a run with dedup_id {dedup_id!r} (workflow {workflow_id!r}, "
            "queued or running); nothing was enqueued"
        )
