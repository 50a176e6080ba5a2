"""Events: the append-only history's vocabulary (docs/concepts.md, "Histories and events").

An :class:`Event` is an envelope ``(workflow_id, seq, recorded_at)`` around a
body, one of the frozen classes below.  Bodies carry no envelope so the engine
can build them before the recorder knows their seq.  The JSON wire form lives
in ``_wire.py`` and is pinned by golden files.

This module imports nothing from the engine: store authors may use it alone.
"""

from __future__ import annotations

import enum
import hashlib
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import datetime, timedelta, timezone
from typing import Any, ClassVar, TypeAlias, TypeVar, Union, final

import attrs

from ._ids import check_text, validate_request_id, validate_run_id, validate_timer_id, validate_workflow_id
from ._payload import Payload


class WorkflowStatus(enum.Enum):
    """A workflow's projected status (never stored as a source of truth)."""

    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"
    CONTINUED_AS_NEW = "continued_as_new"
    #: The run was reset: a new run of the same workflow replays its history up to a
    #: chosen step and goes on from there (``WorkflowReset`` names it).
    RESET = "reset"

    @property
    def is_terminal(self) -> bool:
        """Whether the status is final for its run (anything but ``RUNNING``)."""
        return self is not WorkflowStatus.RUNNING


class FailureCause(enum.Enum):
    """Why an activity attempt failed.  For people: it never decides settlement."""

    RETRYABLE = "retryable"
    TERMINAL = "terminal"
    TIMEOUT = "timeout"
    POLICY_REFUSED = "policy_refused"
    CANCELLED = "cancelled"


class TimerCancelCause(enum.Enum):
    """Why a timer was cancelled (``TimerCancelled.cause``).

    ``WORKFLOW_INTENT``: the workflow no longer wants it (a cancelled handle or
    scope, a retired deadline).  ``CANCEL_TEARDOWN``: a cancel, terminate or
    deadline ending the run retired it; a reopen re-arms it.
    """

    WORKFLOW_INTENT = "workflow_intent"
    CANCEL_TEARDOWN = "cancel_teardown"


class TimeoutKind(enum.Enum):
    """Which timeout ended a run (``WorkflowTimedOut.timeout_kind``): ``DEADLINE``, the run's ``timeout``."""

    DEADLINE = "deadline"


SearchValue: TypeAlias = Union[str, int, float, bool, tuple[str, ...]]
"""A search attribute value: str, int, float, bool, or a tuple of str (keywords)."""


def _require_aware(instance: object, attribute: attrs.Attribute[datetime], value: datetime) -> None:
    if not isinstance(value, datetime):
        raise TypeError(f"{attribute.name} must be a datetime, got {type(value).__name__}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(f"{attribute.name} must be timezone-aware, got naive {value!r}")


def _non_negative(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{attribute.name} must be an int >= 0, got {value!r}")


def _positive(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{attribute.name} must be an int >= 1, got {value!r}")


SCOPE_TIMEOUT_TYPE = "ScopeTimeout"
"""``ActivityError.type`` of the final failure a ``ctx.timeout`` scope records for an
activity it stopped waiting for (the workflow's decision, not the activity's outcome)."""

OMIT_NONE = "aion_trio_wire_omit_none"
"""attrs field metadata key: an optional field whose ``None`` is left off the wire
(so records written before the field existed keep their exact form)."""

OMIT_EMPTY = "aion_trio_wire_omit_empty"
"""attrs field metadata key: a mapping field left off the wire when it is empty (the
same reason as :data:`OMIT_NONE`, for a field that is never ``None``)."""


def _optional_command_id(instance: object, attribute: attrs.Attribute[Any], value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{attribute.name} must be an int >= 1 or None, got {value!r}")


def _optional_request_id(instance: object, attribute: attrs.Attribute[Any], value: str | None) -> None:
    if value is not None:
        validate_request_id(value, attribute.name)


def _request_id_field() -> Any:
    """The idempotency key of the client call (or inbox command) that recorded the event:
    a retry with the same key finds it here and records nothing.  Off the wire when ``None``."""
    return attrs.field(default=None, validator=_optional_request_id, metadata={OMIT_NONE: True})


def _non_empty_str(instance: object, attribute: attrs.Attribute[Any], value: str) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{attribute.name} must be a non-empty str, got {value!r}")


def _str(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{attribute.name} must be a str, got {type(value).__name__}")


def _optional_str(instance: object, attribute: attrs.Attribute[str | None], value: str | None) -> None:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{attribute.name} must be a str or None, got {type(value).__name__}")


def _bool(instance: object, attribute: attrs.Attribute[bool], value: bool) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{attribute.name} must be a bool, got {type(value).__name__}")


def _payload(instance: object, attribute: attrs.Attribute[Any], value: Payload) -> None:
    if not isinstance(value, Payload):
        raise TypeError(
            f"{attribute.name} must be a Payload (use Payload.of(value)), got {type(value).__name__}"
        )


def _optional_payload(
    instance: object, attribute: attrs.Attribute[Payload | None], value: Payload | None
) -> None:
    if value is not None:
        _payload(instance, attribute, value)


def _optional_digest(instance: object, attribute: attrs.Attribute[str | None], value: str | None) -> None:
    if value is not None and (
        not isinstance(value, str) or not value or len(value) > 128 or value.strip("0123456789abcdef")
    ):
        raise ValueError(f"{attribute.name} must be lower-case hex (1-128 digits) or None, got {value!r}")


def _optional_true(instance: object, attribute: attrs.Attribute[bool | None], value: bool | None) -> None:
    if value is not None and value is not True:
        raise ValueError(f"{attribute.name} must be True or None (absent), got {value!r}")


#: What each simple field validator above refuses of a value of one exact type (the
#: type itself, not a subclass): ``(type, None)`` when that type alone satisfies it,
#: ``(type, expression)`` when the expression over ``{value}`` is true exactly when the
#: validator would raise.  The wire decoders compiled per event type check such fields
#: this way instead of calling the class's ``__init__`` (``_wire.py``).
EXACT_TYPE_REFUSALS: Mapping[Callable[..., None], tuple[type, str | None]] = {
    _str: (str, None),
    _optional_str: (str, None),
    _bool: (bool, None),
    _payload: (Payload, None),
    _optional_payload: (Payload, None),
    _non_negative: (int, "{value} < 0"),
    _positive: (int, "{value} < 1"),
    _non_empty_str: (str, "not {value}"),
}


def input_digest(payload: Payload) -> str:
    """The digest recorded with a command of the encoded arguments ``payload``.

    Replay compares it with the digest of what the code passes now: changed
    arguments are non-determinism, not a recorded result handed to another call.
    """
    return hashlib.blake2b(payload.json.encode("utf-8"), digest_size=16).hexdigest()


def _workflow_id(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    validate_workflow_id(value, attribute.name)


def _optional_workflow_id(
    instance: object, attribute: attrs.Attribute[str | None], value: str | None
) -> None:
    if value is not None:
        validate_workflow_id(value, attribute.name)


def _activity_ids(
    instance: object, attribute: attrs.Attribute[tuple[int, ...]], value: tuple[int, ...]
) -> None:
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            raise ValueError(f"{attribute.name} must hold ints >= 0, got {item!r}")


def _optional_non_empty_str(
    instance: object, attribute: attrs.Attribute[str | None], value: str | None
) -> None:
    if value is not None:
        _non_empty_str(instance, attribute, value)


def _run_id(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    validate_run_id(value, attribute.name)


def _optional_run_id(instance: object, attribute: attrs.Attribute[str | None], value: str | None) -> None:
    if value is not None:
        validate_run_id(value, attribute.name)


def _timer_id(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    validate_timer_id(value, attribute.name)


def _optional_timeout(
    instance: object, attribute: attrs.Attribute[timedelta | None], value: timedelta | None
) -> None:
    if value is not None and not isinstance(value, timedelta):
        raise TypeError(f"{attribute.name} must be a timedelta or None, got {type(value).__name__}")
    if value is not None and value <= timedelta(0):
        raise ValueError(f"{attribute.name} must be positive, got {value!r}")


def validate_search_attributes(attributes: Mapping[str, object]) -> dict[str, SearchValue]:
    """Check keys and values of a search-attribute mapping; lists become tuples."""
    if not isinstance(attributes, Mapping):
        raise TypeError(
            f"search attributes must be a mapping of name to value, got {type(attributes).__name__} "
            f"{attributes!r}"
        )
    out: dict[str, SearchValue] = {}
    for key, value in attributes.items():
        validate_search_key(key)
        if isinstance(value, (list, tuple)):
            if not all(isinstance(v, str) for v in value):
                raise ValueError(f"search attribute {key!r}: a list value must hold only str")
            out[key] = tuple(check_text(v, f"search attribute {key!r}") for v in value)
        elif isinstance(value, str):
            out[key] = check_text(value, f"search attribute {key!r}")
        elif isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
            raise ValueError(f"search attribute {key!r}: {value!r} is not a finite number")
        elif isinstance(value, (str, int, float, bool)):
            out[key] = value
        else:
            raise ValueError(
                f"search attribute {key!r}: {type(value).__name__} is not supported "
                "(use str, int, float, bool or a list of str; datetimes as ISO-8601 UTC strings)"
            )
    return out


def validate_search_key(key: object) -> str:
    if not isinstance(key, str) or not key or len(key) > 128:
        raise ValueError(f"search attribute name {key!r} must be a non-empty str of <= 128 chars")
    if not (key[0].isalpha() or key[0] == "_") or not all(c.isalnum() or c in "_.-" for c in key):
        raise ValueError(
            f"search attribute name {key!r} must start with a letter or '_' and contain only "
            "letters, digits, '_', '.' and '-'"
        )
    return key


@final
class FrozenSearchAttributes(Mapping[str, SearchValue]):
    """An immutable, hashable search-attribute mapping (events are frozen all the way down).

    Compares equal to any mapping with the same items, so ``body.search_attributes
    == {"k": 1}`` reads naturally.
    """

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, SearchValue]) -> None:
        self._items = dict(items)

    def __getitem__(self, key: str) -> SearchValue:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return self._items == dict(other.items())
        return NotImplemented

    def __hash__(self) -> int:
        return hash(frozenset(self._items.items()))

    def __repr__(self) -> str:
        return repr(self._items)


@final
class FrozenHeaders(Mapping[str, str]):
    """A run's headers, immutable and hashable; equal to any mapping with the same items."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, str]) -> None:
        self._items = dict(items)

    def __getitem__(self, key: str) -> str:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return self._items == dict(other.items())
        return NotImplemented

    def __hash__(self) -> int:
        return hash(frozenset(self._items.items()))

    def __repr__(self) -> str:
        return repr(self._items)


def _int_tuple(value: Iterable[int]) -> tuple[int, ...]:
    return tuple(value)


MAX_HEADERS = 64
"""At most this many headers on a run."""
MAX_HEADER_BYTES = 8192
"""At most this many bytes (UTF-8) in a run's header names and values together."""


def freeze_headers(value: Mapping[str, str]) -> Mapping[str, str]:
    """Validate a run's headers (string names and values, within the limits) and freeze them."""
    if not isinstance(value, Mapping):
        raise TypeError(f"headers must be a mapping of str to str, got {type(value).__name__}")
    if isinstance(value, FrozenHeaders):
        return value
    if len(value) > MAX_HEADERS:
        raise ValueError(f"at most {MAX_HEADERS} headers are allowed, got {len(value)}")
    size = 0
    for name, text in value.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"a header name must be a non-empty str, got {name!r}")
        if not isinstance(text, str):
            raise TypeError(f"header {name!r} must have a str value, got {type(text).__name__}")
        size += len(name.encode()) + len(text.encode())
    if size > MAX_HEADER_BYTES:
        raise ValueError(f"headers hold {size} bytes; at most {MAX_HEADER_BYTES} are allowed")
    return FrozenHeaders(value)


def _search_attrs_converter(value: Mapping[str, object]) -> Mapping[str, SearchValue]:
    if not isinstance(value, Mapping):
        raise TypeError(f"search attributes must be a mapping, got {type(value).__name__}")
    return FrozenSearchAttributes(validate_search_attributes(value))


# --------------------------------------------------------------------------
# Error records
# --------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class ErrorInfo:
    """A failure as recorded: exception type name, message, optional details and traceback."""

    type: str = attrs.field(validator=_non_empty_str)
    message: str = attrs.field(validator=_str)
    details: Payload | None = attrs.field(default=None, validator=_optional_payload)
    traceback: str | None = attrs.field(default=None, validator=_optional_str)


@attrs.frozen(kw_only=True)
class ActivityError:
    """An activity attempt's failure.  ``cause`` is for people, never for settlement."""

    cause: FailureCause = attrs.field(validator=attrs.validators.instance_of(FailureCause))
    type: str = attrs.field(validator=_non_empty_str)
    message: str = attrs.field(validator=_str)
    details: Payload | None = attrs.field(default=None, validator=_optional_payload)
    traceback: str | None = attrs.field(default=None, validator=_optional_str)


# --------------------------------------------------------------------------
# Bodies
# --------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class EventBody:
    """Base class of event bodies."""

    #: True for the events that end a run's current lease.
    TERMINAL: ClassVar[bool] = False


@attrs.frozen(kw_only=True)
class WorkflowStarted(EventBody):
    """The first event of a run: type, input, run id, parent (a child's), task queue, deadline."""

    workflow_type: str = attrs.field(validator=_non_empty_str)
    input: Payload = attrs.field(validator=_payload)
    run_id: str = attrs.field(validator=_run_id)
    parent_run_id: str | None = attrs.field(default=None, validator=_optional_run_id)
    parent_workflow_id: str | None = attrs.field(default=None, validator=_optional_workflow_id)
    task_queue: str = attrs.field(default="default", validator=_non_empty_str)
    search_attributes: Mapping[str, SearchValue] = attrs.field(
        factory=dict, converter=_search_attrs_converter
    )
    timeout: timedelta | None = attrs.field(default=None, validator=_optional_timeout)
    request_id: str | None = _request_id_field()
    #: A run started by a reset: the run it was reset from, and the seq of that run's
    #: event its history was copied up to (both ``None`` for any other start).
    reset_from_run_id: str | None = attrs.field(
        default=None, validator=_optional_run_id, metadata={OMIT_NONE: True}
    )
    reset_to_seq: int | None = attrs.field(
        default=None,
        validator=attrs.validators.optional(_positive),
        metadata={OMIT_NONE: True},
    )
    #: Context carried with the run (string keys and values, e.g. a W3C ``traceparent``):
    #: what the starter passed and what the engine's header hooks added.  Off the wire when
    #: empty.
    headers: Mapping[str, str] = attrs.field(
        factory=dict, converter=freeze_headers, metadata={OMIT_EMPTY: True}
    )


@attrs.frozen(kw_only=True)
class WorkflowCompleted(EventBody):
    """The run returned ``result``; ends the run."""

    TERMINAL: ClassVar[bool] = True
    result: Payload = attrs.field(validator=_payload)


@attrs.frozen(kw_only=True)
class WorkflowFailed(EventBody):
    """The run raised; ``error`` describes the exception.  Ends the run."""

    TERMINAL: ClassVar[bool] = True
    error: ErrorInfo = attrs.field(validator=attrs.validators.instance_of(ErrorInfo))


@attrs.frozen(kw_only=True)
class WorkflowCancelRequested(EventBody):
    """``engine.cancel`` asked the run to stop; the run sees ``trio.Cancelled`` at its next await."""

    reason: str = attrs.field(validator=_str)
    request_id: str | None = _request_id_field()


@attrs.frozen(kw_only=True)
class WorkflowCancelled(EventBody):
    """The run ended cancelled (or ``terminated`` without running its code); ends the run."""

    TERMINAL: ClassVar[bool] = True
    reason: str = attrs.field(validator=_str)
    #: True when ``terminate`` ended the run without running its code.
    terminated: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    request_id: str | None = _request_id_field()


@attrs.frozen(kw_only=True)
class WorkflowTimedOut(EventBody):
    """The run's deadline (its start's ``timeout``) passed before it ended; ends the run."""

    TERMINAL: ClassVar[bool] = True
    timeout_kind: TimeoutKind = attrs.field(
        default=TimeoutKind.DEADLINE, validator=attrs.validators.instance_of(TimeoutKind)
    )


@attrs.frozen(kw_only=True)
class WorkflowContinuedAsNew(EventBody):
    """The run continued as a new run (``ctx.continue_as_new``) with ``input``; ends this run."""

    TERMINAL: ClassVar[bool] = True
    input: Payload = attrs.field(validator=_payload)
    workflow_type: str | None = attrs.field(default=None, validator=_optional_non_empty_str)
    #: The run that was continued (the run this event ends).
    parent_run_id: str = attrs.field(validator=_run_id)


@attrs.frozen(kw_only=True)
class WorkflowReset(EventBody):
    """Ends a run that ``reset`` replaced: ``new_run_id`` replays its history up to
    ``to_seq`` (this run's event) and goes on from there with the current code."""

    TERMINAL: ClassVar[bool] = True
    new_run_id: str = attrs.field(validator=_run_id)
    to_seq: int = attrs.field(validator=_positive)
    reason: str = attrs.field(default="", validator=_str)
    request_id: str | None = _request_id_field()


@attrs.frozen(kw_only=True)
class WorkflowReopened(EventBody):
    """``engine.reopen`` resumed an ended run ``run_id``, re-scheduling the activities it names."""

    run_id: str = attrs.field(validator=_run_id)
    reopened_activity_ids: tuple[int, ...] = attrs.field(
        default=(), converter=_int_tuple, validator=_activity_ids
    )
    request_id: str | None = _request_id_field()


@attrs.frozen(kw_only=True)
class SearchAttributesUpserted(EventBody):
    """The workflow set (or, with ``None``, removed) search attributes (``ctx.upsert_search_attributes``)."""

    attributes: Mapping[str, SearchValue] = attrs.field(converter=_search_attrs_converter)


@attrs.frozen(kw_only=True)
class ActivityScheduled(EventBody):
    """The workflow asked for activity ``activity_id`` (its type, input, task queue and resolved options)."""

    activity_id: int = attrs.field(validator=_non_negative)
    activity_type: str = attrs.field(validator=_non_empty_str)
    input: Payload = attrs.field(validator=_payload)
    task_queue: str = attrs.field(default="default", validator=_non_empty_str)
    #: The resolved options (retry policy, timeouts, queues) as a JSON object.
    options: Payload = attrs.field(factory=lambda: Payload("{}"), validator=_payload)
    #: :func:`input_digest` of ``input`` as the code passed it; absent in histories
    #: recorded before it existed (replay then does not compare arguments).
    input_digest: str | None = attrs.field(
        default=None, validator=_optional_digest, metadata={OMIT_NONE: True}
    )


@attrs.frozen(kw_only=True)
class ActivityStarted(EventBody):
    """Attempt ``attempt`` of an activity began."""

    activity_id: int = attrs.field(validator=_non_negative)
    attempt: int = attrs.field(validator=_positive)


@attrs.frozen(kw_only=True)
class ActivityCompleted(EventBody):
    """An attempt returned ``result``; settles the activity."""

    activity_id: int = attrs.field(validator=_non_negative)
    result: Payload = attrs.field(validator=_payload)
    attempt: int = attrs.field(validator=_positive)


@attrs.frozen(kw_only=True)
class ActivityFailed(EventBody):
    """An attempt failed: a retry-trail record (``final`` false) or, ``final`` true, the failure that settles the
    activity.
    """

    activity_id: int = attrs.field(validator=_non_negative)
    error: ActivityError = attrs.field(validator=attrs.validators.instance_of(ActivityError))
    attempt: int = attrs.field(validator=_positive)
    #: False: a retry-trail record (another attempt follows).  True: settles the activity.
    final: bool = attrs.field(validator=_bool)
    #: On a retry-trail record: when the next attempt is due (the backoff's end), so a
    #: restart mid-backoff waits out the remainder (a final failure leaves it ``None``).
    #: ``None``: at once, or written before the field existed; absent from the wire then.
    retry_at: datetime | None = attrs.field(default=None, metadata={OMIT_NONE: True})

    @retry_at.validator
    def _check_retry_at(self, attribute: attrs.Attribute[datetime | None], value: datetime | None) -> None:
        if value is None:
            return
        if not isinstance(value, datetime) or value.utcoffset() is None:
            raise ValueError(f"retry_at must be a timezone-aware datetime or None, got {value!r}")


@attrs.frozen(kw_only=True)
class ActivityCancelled(EventBody):
    """The activity was cancelled at attempt ``attempt``; settles it."""

    activity_id: int = attrs.field(validator=_non_negative)
    attempt: int = attrs.field(validator=_positive)
    #: True: the workflow cancelled it (``await handle.cancel()``, one of its commands);
    #: absent: the engine did (terminate, a cancellation, a deadline).
    by_workflow: bool | None = attrs.field(default=None, validator=_optional_true, metadata={OMIT_NONE: True})


@attrs.frozen(kw_only=True)
class ActivityFallbackRouted(EventBody):
    """An attempt found no worker on ``from_task_queue`` and went to its fallback queue ``to_task_queue``."""

    activity_id: int = attrs.field(validator=_non_negative)
    attempt: int = attrs.field(validator=_positive)
    from_task_queue: str = attrs.field(validator=_non_empty_str)
    to_task_queue: str = attrs.field(validator=_non_empty_str)
    fallback_index: int = attrs.field(validator=_non_negative)


@attrs.frozen(kw_only=True)
class ActivityAdvisoryExhausted(EventBody):
    """An advisory activity ran out of attempts: recorded for people (``reason``), the activity still settles as
    usual.
    """

    activity_id: int = attrs.field(validator=_non_negative)
    activity_type: str = attrs.field(validator=_non_empty_str)
    reason: str = attrs.field(validator=_str)
    attempt: int = attrs.field(validator=_positive)


@attrs.frozen(kw_only=True)
class TimerStarted(EventBody):
    """A durable timer ``timer_id`` was set to fire at ``fire_at`` (a timezone-aware datetime)."""

    timer_id: str = attrs.field(validator=_timer_id)
    fire_at: datetime = attrs.field(validator=_require_aware)


@attrs.frozen(kw_only=True)
class TimerFired(EventBody):
    """Timer ``timer_id`` fired."""

    timer_id: str = attrs.field(validator=_timer_id)


@attrs.frozen(kw_only=True)
class TimerCancelled(EventBody):
    """Timer ``timer_id`` was cancelled before firing; ``cause`` says why."""

    timer_id: str = attrs.field(validator=_timer_id)
    cause: TimerCancelCause = attrs.field(validator=attrs.validators.instance_of(TimerCancelCause))


@attrs.frozen(kw_only=True)
class SignalReceived(EventBody):
    """Signal ``name`` with ``payload`` was delivered to the workflow."""

    name: str = attrs.field(validator=_non_empty_str)
    payload: Payload = attrs.field(validator=_payload)
    #: Histories written before request ids: the inbox command that delivered the
    #: signal (it counts as request id ``inbox:N``).  Never written now.
    command_id: int | None = attrs.field(
        default=None, validator=_optional_command_id, metadata={OMIT_NONE: True}
    )
    request_id: str | None = _request_id_field()


@attrs.frozen(kw_only=True)
class UpdateAccepted(EventBody):
    """An update (``engine.update``) its validator accepted, recorded before its handler runs;
    the run's code gives it to the handler at the await it is delivered at, like a signal."""

    update_id: str = attrs.field(validator=_non_empty_str)
    name: str = attrs.field(validator=_non_empty_str)
    payload: Payload = attrs.field(validator=_payload)


@attrs.frozen(kw_only=True)
class UpdateCompleted(EventBody):
    """The outcome of an accepted update's handler: ``result``, or ``error`` if it raised.
    One of the run's commands: replay finds it where the live run recorded it."""

    update_id: str = attrs.field(validator=_non_empty_str)
    result: Payload | None = attrs.field(
        default=None, validator=_optional_payload, metadata={OMIT_NONE: True}
    )
    error: ErrorInfo | None = attrs.field(
        default=None,
        validator=attrs.validators.optional(attrs.validators.instance_of(ErrorInfo)),
        metadata={OMIT_NONE: True},
    )


@attrs.frozen(kw_only=True)
class ChildWorkflowStarted(EventBody):
    """The workflow started child workflow ``child_workflow_id`` (its type and input)."""

    child_workflow_id: str = attrs.field(validator=_workflow_id)
    workflow_type: str = attrs.field(validator=_non_empty_str)
    input: Payload = attrs.field(validator=_payload)
    #: As for :class:`ActivityScheduled`: the child's input as the parent passed it.
    input_digest: str | None = attrs.field(
        default=None, validator=_optional_digest, metadata={OMIT_NONE: True}
    )


@attrs.frozen(kw_only=True)
class ChildWorkflowCompleted(EventBody):
    """Child ``child_workflow_id`` returned ``result``."""

    child_workflow_id: str = attrs.field(validator=_workflow_id)
    result: Payload = attrs.field(validator=_payload)


@attrs.frozen(kw_only=True)
class ChildWorkflowFailed(EventBody):
    """Child ``child_workflow_id`` failed or timed out; ``error`` describes why."""

    child_workflow_id: str = attrs.field(validator=_workflow_id)
    error: ErrorInfo = attrs.field(validator=attrs.validators.instance_of(ErrorInfo))


@attrs.frozen(kw_only=True)
class ChildWorkflowCancelled(EventBody):
    """Child ``child_workflow_id`` ended cancelled or terminated (``reason`` starts ``terminated:``)."""

    child_workflow_id: str = attrs.field(validator=_workflow_id)
    reason: str = attrs.field(validator=_str)


@attrs.frozen(kw_only=True)
class MarkerRecorded(EventBody):
    """A named value recorded in the history (``name``, ``value``); heartbeat details are recorded this way."""

    name: str = attrs.field(validator=_non_empty_str)
    value: Payload = attrs.field(validator=_payload)


EVENT_TYPES: Mapping[str, type[EventBody]] = {
    cls.__name__: cls
    for cls in (
        WorkflowStarted,
        WorkflowCompleted,
        WorkflowFailed,
        WorkflowCancelRequested,
        WorkflowCancelled,
        WorkflowTimedOut,
        WorkflowContinuedAsNew,
        WorkflowReset,
        WorkflowReopened,
        SearchAttributesUpserted,
        ActivityScheduled,
        ActivityStarted,
        ActivityCompleted,
        ActivityFailed,
        ActivityCancelled,
        ActivityFallbackRouted,
        ActivityAdvisoryExhausted,
        TimerStarted,
        TimerFired,
        TimerCancelled,
        SignalReceived,
        ChildWorkflowStarted,
        ChildWorkflowCompleted,
        ChildWorkflowFailed,
        ChildWorkflowCancelled,
        MarkerRecorded,
        UpdateAccepted,
        UpdateCompleted,
    )
}
"""Every event body type by its wire name."""

TERMINAL_TYPES: tuple[type[EventBody], ...] = tuple(cls for cls in EVENT_TYPES.values() if cls.TERMINAL)


def _body_validator(instance: object, attribute: attrs.Attribute[EventBody], value: EventBody) -> None:
    if type(value) not in _BODY_TYPES:
        raise TypeError(f"body must be one of the event body types, got {type(value).__name__}")


_BODY_TYPES = frozenset(EVENT_TYPES.values())


def _workflow_id_validator(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    validate_workflow_id(value, attribute.name)


@attrs.frozen(kw_only=True)
class Event:
    """One recorded event: the envelope and its body."""

    workflow_id: str = attrs.field(validator=_workflow_id_validator)
    seq: int = attrs.field(validator=_positive)
    recorded_at: datetime = attrs.field(validator=_require_aware)
    body: EventBody = attrs.field(validator=_body_validator)

    @property
    def type(self) -> str:
        """The body's type name, as on the wire (``"WorkflowStarted"``)."""
        return type(self.body).__name__

    @property
    def is_terminal(self) -> bool:
        """Whether the body ends a run's current lease (``EventBody.TERMINAL``)."""
        return self.body.TERMINAL


_BODY_FIELD = attrs.fields(Event).body
_WORKFLOW_ID_FIELD = attrs.fields(Event).workflow_id
_SEQ_FIELD = attrs.fields(Event).seq
_RECORDED_AT_FIELD = attrs.fields(Event).recorded_at


def is_terminal_body(body: EventBody) -> bool:
    return body.TERMINAL


_Body = TypeVar("_Body", bound=EventBody)

#: Per body type built by :func:`trusted`: its field names.
_TRUSTED_FIELDS: dict[type[EventBody], frozenset[str]] = {}


def trusted(cls: type[_Body], /, **fields: Any) -> _Body:
    """A ``cls`` body built from values the engine derived from already-validated ones
    (a recorded schedule's ids, an attempt it counted, a codec's payload), without
    running the per-field validators: the engine's hot path.  Every field must be
    given; a type with a converter is refused.  Values from a caller, a dispatcher or
    the wire go through the class itself, which validates them."""
    names = _TRUSTED_FIELDS.get(cls)
    if names is None:
        declared = attrs.fields(cls)
        if any(field.converter is not None for field in declared):
            raise TypeError(f"{cls.__name__} converts a field: build it with {cls.__name__}(...)")
        names = _TRUSTED_FIELDS[cls] = frozenset(field.name for field in declared)
    if fields.keys() != names:
        raise TypeError(f"{cls.__name__} needs exactly the fields {sorted(names)}, got {sorted(fields)}")
    body = object.__new__(cls)
    for name, value in fields.items():
        object.__setattr__(body, name, value)
    return body


#: Per body type: whether it starts, reopens or ends (a terminal) a run; filled on first sight.
_LIFECYCLE_KINDS: dict[type[EventBody], bool] = {}


def has_lifecycle(events: Sequence[Event], start: int = 0) -> bool:
    """Whether any of ``events[start:]`` starts, reopens or ends a run (what a wait for a
    run's end wakes for).  One lookup per event by its body's type, no call per event."""
    kinds = _LIFECYCLE_KINDS
    for i in range(start, len(events)):
        kind = type(events[i].body)
        flag = kinds.get(kind)
        if flag is None:
            flag = kinds[kind] = kind.TERMINAL or issubclass(kind, (WorkflowStarted, WorkflowReopened))
        if flag:
            return True
    return False


def make_batch(
    workflow_id: str,
    first_seq: int,
    recorded_at: datetime,
    bodies: list[EventBody] | tuple[EventBody, ...],
    *,
    checked_id: bool = False,
) -> list[Event]:
    """Envelope ``bodies`` with contiguous seqs starting at ``first_seq``.

    The envelope is validated once for the batch (the workflow id only unless
    ``checked_id``: a recorder checks its own when it is made), each body's type
    is checked, then every event is built without re-running the per-field
    validators (the hot path of every append).
    """
    if not bodies:
        return []
    if not checked_id:
        _workflow_id_validator(None, _WORKFLOW_ID_FIELD, workflow_id)
    if type(first_seq) is not int or first_seq < 1:
        _positive(None, _SEQ_FIELD, first_seq)
    if type(recorded_at) is not datetime or recorded_at.utcoffset() is None:
        _require_aware(None, _RECORDED_AT_FIELD, recorded_at)
    out = []
    new = object.__new__
    put = object.__setattr__
    seq = first_seq
    for body in bodies:
        if type(body) not in _BODY_TYPES:
            _body_validator(None, _BODY_FIELD, body)
        event = new(Event)
        put(event, "workflow_id", workflow_id)
        put(event, "seq", seq)
        put(event, "recorded_at", recorded_at)
        put(event, "body", body)
        out.append(event)
        seq += 1
    return out


def utc(value: datetime) -> datetime:
    """Normalise an aware datetime to UTC (wire form and comparisons use UTC)."""
    if value.tzinfo is None:
        raise ValueError(f"expected a timezone-aware datetime, got naive {value!r}")
    return value.astimezone(timezone.utc)
