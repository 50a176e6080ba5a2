"""Inbox commands: what a process that is not a store's owner asks the owner to do.

A command is a small frozen attrs record; payloads are :class:`Payload`
(JSON), never pickled objects.  Its wire form is
``{"type": "signal", "data": {...}}`` with the same field encodings events
use.  The owning engine applies each command through its normal client
methods (``Engine.start`` / ``signal`` / ``cancel`` / ``terminate`` /
``reopen``), so everything it records goes through the recorder, and acks it
with a :class:`CommandOutcome`.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, ClassVar, Union, final

import attrs

from ._errors import CommandDecodeError, EventDecodeError
from ._events import (
    OMIT_NONE,
    FrozenSearchAttributes,
    SearchValue,
    WorkflowStatus,
    validate_search_attributes,
)
from ._ids import validate_request_id, validate_workflow_id
from ._payload import NULL, Payload
from ._wire import loads_strict, record_from_wire, record_to_wire, register_wire_record

_SEPARATORS = (",", ":")


class IdReusePolicy(enum.Enum):
    """What ``start`` does when the workflow id already exists.

    * ``ALLOW_DUPLICATE`` (default): refuse while a run is active; once the
      last run closed, start a new run under the same id.
    * ``ALLOW_IF_FAILED``: like the default, but only if the last run failed,
      was cancelled or timed out.
    * ``REJECT_DUPLICATE``: refuse if the id was ever used.
    * ``USE_EXISTING``: return the existing latest run (idempotent start).
    """

    ALLOW_DUPLICATE = "allow_duplicate"
    ALLOW_IF_FAILED = "allow_if_failed"
    REJECT_DUPLICATE = "reject_duplicate"
    USE_EXISTING = "use_existing"


#: The ``id_reuse`` values a start command may carry (an :class:`IdReusePolicy`'s value).
ID_REUSE_VALUES = tuple(policy.value for policy in IdReusePolicy)


def reuse_decision(policy: IdReusePolicy, status: WorkflowStatus) -> bool | None:
    """What ``policy`` says of a start under an id whose latest run has ``status``:
    ``True`` start a new run, ``False`` refuse, ``None`` use the existing run.

    The one decision ``Engine.start`` (and signal-with-start) and ``Engine.enqueue``
    (at enqueue and again at admission) apply."""
    if policy is IdReusePolicy.USE_EXISTING:
        return None
    if policy is IdReusePolicy.REJECT_DUPLICATE:
        return False
    if status in (WorkflowStatus.RUNNING, WorkflowStatus.CONTINUED_AS_NEW):
        return False
    if policy is IdReusePolicy.ALLOW_IF_FAILED:
        return status in (WorkflowStatus.FAILED, WorkflowStatus.CANCELLED, WorkflowStatus.TIMED_OUT)
    return True


def _workflow_id(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    validate_workflow_id(value)


def _optional_request_id(instance: object, attribute: attrs.Attribute[str | None], value: str | None) -> None:
    if value is not None:
        validate_request_id(value, attribute.name)


def _request_id() -> Any:
    """The command's idempotency key: queueing it twice adds it once, and the owner records its
    effect under it (applied twice, it records once).  ``None``: the owner uses ``inbox:N``."""
    return attrs.field(default=None, validator=_optional_request_id, metadata={OMIT_NONE: True})


def _non_empty(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{attribute.name} must be a non-empty str, got {value!r}")


def _text(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{attribute.name} must be a str, got {value!r}")


def _payload(instance: object, attribute: attrs.Attribute[Payload], value: Payload) -> None:
    if not isinstance(value, Payload):
        raise TypeError(f"{attribute.name} must be a Payload (build one with Payload.of), got {value!r}")


def _search_attributes(value: Mapping[str, object]) -> Mapping[str, SearchValue]:
    return FrozenSearchAttributes(validate_search_attributes(value))


def _args(instance: object, attribute: attrs.Attribute[Payload], value: Payload) -> None:
    _payload(instance, attribute, value)
    if not value.json.startswith("["):
        raise ValueError(f"{attribute.name} must be a JSON list of the workflow's arguments, got {value!r}")


@final
@attrs.frozen(kw_only=True)
class StartCommand:
    """Start a run of ``workflow_type`` under ``workflow_id`` (required: the sender needs it up front)."""

    KIND: ClassVar[str] = "start"
    workflow_id: str = attrs.field(validator=_workflow_id)
    workflow_type: str = attrs.field(validator=_non_empty)
    args: Payload = attrs.field(factory=lambda: Payload.trusted("[]"), validator=_args)
    id_reuse: str = attrs.field(default="allow_duplicate")
    task_queue: str | None = None
    request_id: str | None = _request_id()

    @id_reuse.validator
    def _check_reuse(self, attribute: attrs.Attribute[str], value: str) -> None:
        if value not in ID_REUSE_VALUES:
            raise ValueError(f"id_reuse must be one of {', '.join(ID_REUSE_VALUES)}, got {value!r}")

    def describe(self) -> str:
        """One line naming what the command asks, for logs and errors."""
        return f"start {self.workflow_type} as {self.workflow_id!r}"


@final
@attrs.frozen(kw_only=True)
class SignalCommand:
    """Record signal ``name`` with ``payload`` for the workflow's running run."""

    KIND: ClassVar[str] = "signal"
    workflow_id: str = attrs.field(validator=_workflow_id)
    name: str = attrs.field(validator=_non_empty)
    payload: Payload = attrs.field(default=NULL, validator=_payload)
    request_id: str | None = _request_id()

    def describe(self) -> str:
        """One line naming what the command asks, for logs and errors."""
        return f"signal {self.name!r} to {self.workflow_id!r}"


@final
@attrs.frozen(kw_only=True)
class SignalWithStartCommand:
    """Record signal ``signal_name`` for the workflow's running run, or start a run of
    ``workflow_type`` with ``args`` and the signal in one append if none is running."""

    KIND: ClassVar[str] = "signal_with_start"
    workflow_id: str = attrs.field(validator=_workflow_id)
    workflow_type: str = attrs.field(validator=_non_empty)
    args: Payload = attrs.field(factory=lambda: Payload.trusted("[]"), validator=_args)
    signal_name: str = attrs.field(validator=_non_empty)
    payload: Payload = attrs.field(default=NULL, validator=_payload)
    id_reuse: str = attrs.field(default="allow_duplicate")
    task_queue: str | None = None
    search_attributes: Mapping[str, SearchValue] = attrs.field(factory=dict, converter=_search_attributes)
    timeout: timedelta | None = attrs.field(default=None, metadata={OMIT_NONE: True})
    request_id: str | None = _request_id()

    @id_reuse.validator
    def _check_reuse(self, attribute: attrs.Attribute[str], value: str) -> None:
        if value not in ID_REUSE_VALUES or value == IdReusePolicy.USE_EXISTING.value:
            allowed = ", ".join(v for v in ID_REUSE_VALUES if v != IdReusePolicy.USE_EXISTING.value)
            raise ValueError(f"id_reuse of a signal-with-start must be one of {allowed}, got {value!r}")

    def describe(self) -> str:
        """One line naming what the command asks, for logs and errors."""
        return f"signal {self.signal_name!r} to {self.workflow_id!r}, starting {self.workflow_type} if not running"


@final
@attrs.frozen(kw_only=True)
class CancelCommand:
    """Ask the workflow's running run to cancel."""

    KIND: ClassVar[str] = "cancel"
    workflow_id: str = attrs.field(validator=_workflow_id)
    reason: str = attrs.field(default="", validator=_text)
    request_id: str | None = _request_id()

    def describe(self) -> str:
        """One line naming what the command asks, for logs and errors."""
        return f"cancel {self.workflow_id!r}"


@final
@attrs.frozen(kw_only=True)
class TerminateCommand:
    """End the workflow's running run at once."""

    KIND: ClassVar[str] = "terminate"
    workflow_id: str = attrs.field(validator=_workflow_id)
    reason: str = attrs.field(default="", validator=_text)
    request_id: str | None = _request_id()

    def describe(self) -> str:
        """One line naming what the command asks, for logs and errors."""
        return f"terminate {self.workflow_id!r}"


@final
@attrs.frozen(kw_only=True)
class ReopenCommand:
    """Reopen the workflow's failed or cancelled run."""

    KIND: ClassVar[str] = "reopen"
    workflow_id: str = attrs.field(validator=_workflow_id)
    request_id: str | None = _request_id()

    def describe(self) -> str:
        """One line naming what the command asks, for logs and errors."""
        return f"reopen {self.workflow_id!r}"


def _optional_seq(instance: object, attribute: attrs.Attribute[int | None], value: int | None) -> None:
    if value is not None and (type(value) is not int or value < 1):
        raise ValueError(f"{attribute.name} must be a positive int or None, got {value!r}")


@final
@attrs.frozen(kw_only=True)
class ResetCommand:
    """Reset the workflow's latest run to the event ``to_seq`` (``None``: its last step)."""

    KIND: ClassVar[str] = "reset"
    workflow_id: str = attrs.field(validator=_workflow_id)
    to_seq: int | None = attrs.field(default=None, validator=_optional_seq, metadata={OMIT_NONE: True})
    reason: str = attrs.field(default="", validator=_text)
    request_id: str | None = _request_id()

    def describe(self) -> str:
        """One line naming what the command asks, for logs and errors."""
        where = "its last step" if self.to_seq is None else f"seq {self.to_seq}"
        return f"reset {self.workflow_id!r} to {where}"


@final
@attrs.frozen(kw_only=True)
class QueryCommand:
    """Ask the workflow's running run a query; the outcome's message is the JSON answer.

    Read-only like every query: applying it appends nothing.
    """

    KIND: ClassVar[str] = "query"
    workflow_id: str = attrs.field(validator=_workflow_id)
    name: str = attrs.field(validator=_non_empty)
    args: Payload = attrs.field(factory=lambda: Payload("[]"), validator=_args)
    request_id: str | None = _request_id()

    def describe(self) -> str:
        """One line naming what the command asks, for logs and errors."""
        return f"query {self.name!r} of {self.workflow_id!r}"


@final
@attrs.frozen(kw_only=True)
class UpdateCommand:
    """Validate update ``name`` against the workflow's running run and record it as accepted
    under ``update_id`` (``UpdateAccepted``); the caller reads the outcome from history."""

    KIND: ClassVar[str] = "update"
    workflow_id: str = attrs.field(validator=_workflow_id)
    name: str = attrs.field(validator=_non_empty)
    update_id: str = attrs.field(validator=_non_empty)
    args: Payload = attrs.field(factory=lambda: Payload("[]"), validator=_args)
    request_id: str | None = _request_id()

    def describe(self) -> str:
        """One line naming what the command asks, for logs and errors."""
        return f"update {self.name!r} of {self.workflow_id!r}"


#: What an :class:`ActivityCommand` does with the attempt its token names.
ACTIVITY_ACTIONS = ("complete", "fail", "heartbeat")


@final
@attrs.frozen(kw_only=True)
class ActivityCommand:
    """Complete, fail or heartbeat the activity attempt ``token`` names (async completion).

    ``payload`` is the result (complete) or the heartbeat's details (heartbeat); a failure
    carries ``error_type`` and ``message``, and ``non_retryable`` makes it final."""

    KIND: ClassVar[str] = "activity"
    workflow_id: str = attrs.field(validator=_workflow_id)
    token: str = attrs.field(validator=_non_empty)
    action: str = attrs.field()
    payload: Payload = attrs.field(default=NULL, validator=_payload)
    error_type: str = attrs.field(default="", validator=_text)
    message: str = attrs.field(default="", validator=_text)
    non_retryable: bool = False
    request_id: str | None = _request_id()

    @action.validator
    def _check_action(self, attribute: attrs.Attribute[str], value: str) -> None:
        if value not in ACTIVITY_ACTIONS:
            raise ValueError(f"action must be one of {', '.join(ACTIVITY_ACTIONS)}, got {value!r}")

    def describe(self) -> str:
        """One line naming what the command asks, for logs and errors."""
        return f"{self.action} an activity attempt of {self.workflow_id!r}"


Command = Union[
    StartCommand,
    SignalCommand,
    SignalWithStartCommand,
    CancelCommand,
    TerminateCommand,
    ReopenCommand,
    ResetCommand,
    QueryCommand,
    UpdateCommand,
    ActivityCommand,
]
"""Any inbox command."""

COMMAND_TYPES: dict[str, type[Any]] = {
    cls.KIND: cls
    for cls in (
        StartCommand,
        SignalCommand,
        SignalWithStartCommand,
        CancelCommand,
        TerminateCommand,
        ReopenCommand,
        ResetCommand,
        QueryCommand,
        UpdateCommand,
        ActivityCommand,
    )
}
"""Wire type name -> command class."""

for _cls in COMMAND_TYPES.values():
    register_wire_record(_cls, globals())
del _cls


def is_command(value: object) -> bool:
    return type(value) in COMMAND_TYPES.values()


@final
@attrs.frozen(kw_only=True)
class PendingCommand:
    """A command waiting in the inbox; ``command_id`` orders the inbox (FIFO)."""

    command_id: int
    command: Command


@final
@attrs.frozen(kw_only=True)
class CommandOutcome:
    """What applying a command did: ``ok`` and a one-line ``message`` for people.

    A refused command carries the typed error's class name in ``error_type``
    and its one-line message.  ``run_id`` names the run a start or reopen
    touched.
    """

    ok: bool
    message: str = attrs.field(validator=_text)
    error_type: str | None = None
    run_id: str | None = None

    @classmethod
    def success(cls, message: str, run_id: str | None = None) -> CommandOutcome:
        """The outcome of a command that was applied (``run_id``: the run it started, if any)."""
        return cls(ok=True, message=message, run_id=run_id)

    @classmethod
    def failure(cls, exc: BaseException) -> CommandOutcome:
        """The outcome of a command that raised ``exc``: its type name and one-line message."""
        return cls(ok=False, message=" ".join(str(exc).split()), error_type=type(exc).__name__)


def signal_recorded_outcome(workflow_id: str, name: str) -> CommandOutcome:
    """The outcome of a signal command whose ``SignalReceived`` was recorded (or found
    recorded under the command's request id, when it was delivered again)."""
    return CommandOutcome.success(f"signal {name!r} recorded for workflow {workflow_id!r}")


def signal_with_start_outcome(workflow_id: str, name: str, run_id: str, *, created: bool) -> CommandOutcome:
    """The outcome of a signal-with-start: the run that took the signal, and whether this
    call (or the first with its request id) started it."""
    verb = "started" if created else "signalled running"
    return CommandOutcome.success(
        f"{verb} workflow {workflow_id!r} run {run_id} with signal {name!r}", run_id=run_id
    )


def command_data_json(command: Command) -> tuple[str, str]:
    """``(type_name, data_as_compact_json_text)``: the form stores keep in columns."""
    if not is_command(command):
        raise TypeError(f"not an inbox command: {command!r}")
    data = record_to_wire(command)
    return command.KIND, json.dumps(data, separators=_SEPARATORS, ensure_ascii=False, allow_nan=False)


def command_from_data_json(type_name: object, data_text: str | bytes) -> Command:
    """Rebuild a command from :func:`command_data_json`'s output (:class:`CommandDecodeError` if bad)."""
    cls = COMMAND_TYPES.get(type_name) if isinstance(type_name, str) else None
    if cls is None:
        known = ", ".join(COMMAND_TYPES)
        raise CommandDecodeError(f"unknown inbox command type {type_name!r} (known: {known})")
    try:
        command: Command = record_from_wire(cls, loads_strict(data_text))
    except (EventDecodeError, ValueError, TypeError) as exc:
        raise CommandDecodeError(f"inbox command {type_name!r}: {exc}") from None
    return command


def outcome_to_json(outcome: CommandOutcome) -> str:
    """The JSON text a store keeps for an inbox command's outcome (``CommandInbox.ack_command``)."""
    data = {"ok": outcome.ok, "message": outcome.message}
    if outcome.error_type is not None:
        data["error_type"] = outcome.error_type
    if outcome.run_id is not None:
        data["run_id"] = outcome.run_id
    return json.dumps(data, separators=_SEPARATORS, ensure_ascii=False, allow_nan=False)


def outcome_from_json(text: str | bytes) -> CommandOutcome:
    """The outcome ``outcome_to_json`` wrote; anything else raises ``CommandDecodeError``."""
    try:
        data = loads_strict(text)
        if not isinstance(data, dict) or set(data) - {"ok", "message", "error_type", "run_id"}:
            raise ValueError(f"not an outcome object: {data!r}")
        ok, message = data["ok"], data["message"]
        error_type, run_id = data.get("error_type"), data.get("run_id")
        if not isinstance(ok, bool) or not isinstance(message, str):
            raise ValueError(f"bad ok/message in {data!r}")
        if not isinstance(error_type, (str, type(None))) or not isinstance(run_id, (str, type(None))):
            raise ValueError(f"bad error_type/run_id in {data!r}")
    except (KeyError, ValueError, TypeError, EventDecodeError) as exc:
        raise CommandDecodeError(f"inbox command outcome: {exc}") from None
    return CommandOutcome(ok=ok, message=message, error_type=error_type, run_id=run_id)
