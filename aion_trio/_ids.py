"""Identifiers.

Identifiers are plain ``str``/``int`` values at run time so users can pass
their own; these helpers construct, validate and print them in one place.
"""

from __future__ import annotations

import hashlib
import re
import uuid
from typing import TypeAlias

WorkflowId: TypeAlias = str
"""A user-chosen string, or a generated UUID."""
RunId: TypeAlias = str
"""A UUID (canonical hyphenated text), one per run."""
ActivityId: TypeAlias = int
"""A zero-based per-run ordinal; printed ``activity:N``."""
TimerId: TypeAlias = str
"""``named:X`` or ``anonymous:N``; ``deadline:`` and ``scope:`` are engine-reserved."""
LeaseId: TypeAlias = int
"""Monotonic per engine; tells two incarnations of one run apart."""

MAX_WORKFLOW_ID_LENGTH = 512
RESERVED_TIMER_PREFIXES = ("deadline:", "scope:")
_CONTROL_CHARACTER = re.compile(r"[\x00-\x1f\x7f]")


def validate_workflow_id(workflow_id: object, what: str = "workflow_id") -> WorkflowId:
    """Return ``workflow_id`` if it is usable, else raise ``ValueError`` saying why.

    ``what`` names the value in the message (e.g. ``"child_workflow_id"``).
    """
    return _check_key(workflow_id, what, MAX_WORKFLOW_ID_LENGTH)


def _check_key(key: object, what: str, max_length: int) -> str:
    """``key`` if it is a non-empty str of at most ``max_length`` characters, without control
    characters, that UTF-8 can encode; else ``TypeError``/``ValueError`` saying why."""
    if not isinstance(key, str):
        raise TypeError(f"{what} must be str, got {type(key).__name__}")
    if not key:
        raise ValueError(f"{what} must not be empty")
    if len(key) > max_length:
        raise ValueError(f"{what} is {len(key)} characters; the limit is {max_length}")
    if _CONTROL_CHARACTER.search(key):
        raise ValueError(f"{what} {key!r} contains control characters")
    return check_text(key, what)


def validate_task_queue(queue: object, what: str = "task_queue") -> str:
    """A task queue name: a non-empty str (``None`` means "the default" to callers, never here)."""
    if not isinstance(queue, str) or not queue.strip():
        raise ValueError(
            f"{what} must be a non-empty str, got {queue!r}; leave it unset for the default queue"
        )
    return check_text(queue, what)


def check_text(value: str, what: str) -> str:
    """``value`` if UTF-8 can encode it, else ``ValueError`` (a lone surrogate, e.g. from a bad decode)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{what} {value!r} contains a lone surrogate ({value[exc.start]!r} at index {exc.start}), "
            "which UTF-8 cannot encode; decode the text it came from correctly"
        ) from None
    return value


def new_workflow_id() -> WorkflowId:
    return str(uuid.uuid4())


def new_run_id() -> RunId:
    return str(uuid.uuid4())


def validate_run_id(run_id: object, what: str = "run_id") -> RunId:
    """Return ``run_id`` if it is a UUID in canonical (lower-case, hyphenated) form."""
    if not isinstance(run_id, str):
        raise TypeError(f"{what} must be str, got {type(run_id).__name__}")
    try:
        parsed = uuid.UUID(run_id)
    except ValueError:
        raise ValueError(f"{what} {run_id!r} is not a UUID") from None
    if str(parsed) != run_id:
        raise ValueError(f"{what} {run_id!r} is not in canonical UUID form ({parsed})")
    return run_id


def activity_label(activity_id: ActivityId) -> str:
    return f"activity:{activity_id}"


def named_timer(name: str) -> TimerId:
    if not name:
        raise ValueError("timer name must not be empty")
    return f"named:{name}"


def anonymous_timer(ordinal: int) -> TimerId:
    if ordinal < 0:
        raise ValueError(f"timer ordinal must be >= 0, got {ordinal}")
    return f"anonymous:{ordinal}"


DEADLINE_TIMER_PREFIX = "deadline:"
"""Timer ids the engine reserves for workflow deadlines (not commands of the code)."""

PATCH_MARKER_PREFIX = "patch:"
"""Names of the markers ``ctx.patched(id)`` records."""

CHILD_CANCEL_MARKER_PREFIX = "cancel-child:"
"""Names of the markers ``await child_handle.cancel()`` records (``cancel-child:N``, N the child's ordinal)."""

EXTERNAL_MARKER_PREFIX = "external:"
"""Names of the markers ``ctx.signal_external`` / ``ctx.cancel_external`` record before they
deliver (``external:N``, N the run's N-th such message): the intent, a workflow command."""

EXTERNAL_OUTCOME_MARKER_PREFIX = "external-outcome:"
"""Names of the markers recording how message ``N`` was received (``external-outcome:N``)."""

EVENT_READ_MARKER_PREFIX = "get-event:"
"""Names of the markers ``ctx.get_event`` records (``get-event:N``): what it asked and what its
first look found (``{"workflow_id", "key", "first": {"outcome": ...}}``), a workflow command."""

EVENT_READ_RESULT_MARKER_PREFIX = "get-event-result:"
"""Names of the markers recording what read ``N`` found after waiting (``get-event-result:N``)."""

HEARTBEAT_MARKER_PREFIX = "heartbeat:"
"""Names of the markers holding an activity attempt's last heartbeat details (``heartbeat:N``,
N the activity id; the value ``{"attempt": A, "details": ...}``), written by the engine."""

ASYNC_MARKER_PREFIX = "async-completion:"
"""Names of the markers recording that an activity attempt will be completed later through its
task token (``async-completion:N``, N the activity id; the value ``{"attempt": A}``), written
by the engine."""

EVENT_MARKER_PREFIX = "set-event:"
"""Names of the markers ``ctx.set_event(key, value)`` records (``set-event:N``, the run's N-th;
the value holds ``{"key": ..., "value": ...}``)."""


def deadline_timer_id(run_id: RunId) -> TimerId:
    return f"{DEADLINE_TIMER_PREFIX}{run_id}"


def scope_timer_id(ordinal: int) -> TimerId:
    return f"scope:{ordinal}"


def is_reserved_timer_id(timer_id: TimerId) -> bool:
    return timer_id.startswith(RESERVED_TIMER_PREFIXES)


def validate_timer_id(timer_id: object, what: str = "timer_id") -> TimerId:
    """Return ``timer_id`` if it is ``named:X``, ``anonymous:N``, ``deadline:X`` or ``scope:N``."""
    if not isinstance(timer_id, str):
        raise TypeError(f"{what} must be str, got {type(timer_id).__name__}")
    kind, sep, rest = timer_id.partition(":")
    if not sep or not rest or kind not in ("named", "anonymous", "deadline", "scope"):
        raise ValueError(f"{what} {timer_id!r} must look like named:X, anonymous:N, deadline:RUN or scope:N")
    if kind in ("anonymous", "scope") and not _is_ordinal(rest):
        # One spelling per ordinal: "anonymous:01" and "anonymous:1" must not both exist.
        raise ValueError(f"{what} {timer_id!r}: {kind}:N needs N as a decimal int >= 0 without leading zeros")
    return timer_id


def _is_ordinal(text: str) -> bool:
    return text.isascii() and text.isdigit() and str(int(text)) == text


RequestId: TypeAlias = str
"""An idempotency key: the same key twice on one workflow id records once (docs/concepts.md)."""

MAX_REQUEST_ID_LENGTH = 200
INBOX_REQUEST_PREFIX = "inbox:"
"""Request ids ``inbox:N`` name inbox command ``N`` that was queued without a request id."""


def validate_request_id(request_id: object, what: str = "request_id") -> RequestId:
    """Return ``request_id`` if it is a usable idempotency key, else raise saying why."""
    return _check_key(request_id, what, MAX_REQUEST_ID_LENGTH)


def validate_caller_request_id(request_id: object, what: str = "request_id") -> RequestId:
    """``validate_request_id`` for a key a caller chose: ``inbox:N`` is the inbox's own, so refused."""
    key = validate_request_id(request_id, what)
    if key.startswith(INBOX_REQUEST_PREFIX):
        raise ValueError(
            f"{what} {key!r} starts with {INBOX_REQUEST_PREFIX!r}, which names inbox commands queued "
            "without a key of their own; choose another key"
        )
    return key


def new_request_id() -> RequestId:
    return str(uuid.uuid4())


def external_request_id(workflow_id: WorkflowId, run_id: RunId, ordinal: int) -> RequestId:
    """The request id a run's ``ordinal``-th message to another workflow is delivered with:
    the same on every redelivery, so the target records it once."""
    digest = hashlib.blake2b(f"{workflow_id}\x00{run_id}\x00{ordinal}".encode(), digest_size=16)
    return f"external:{digest.hexdigest()}"


def inbox_request_id(command_id: int) -> RequestId:
    """The request id of inbox command ``command_id`` queued without one of its own."""
    return f"{INBOX_REQUEST_PREFIX}{command_id}"
