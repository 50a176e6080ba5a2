"""Identifiers (DESIGN §3.1).

Identifiers are plain ``str``/``int`` values at run time so users can pass
their own; these helpers construct, validate and print them in one place.
"""

from __future__ import annotations

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


def validate_workflow_id(workflow_id: object) -> WorkflowId:
    """Return ``workflow_id`` if it is usable, else raise ``ValueError`` saying why."""
    if not isinstance(workflow_id, str):
        raise TypeError(f"workflow_id must be str, got {type(workflow_id).__name__}")
    if not workflow_id:
        raise ValueError("workflow_id must not be empty")
    if len(workflow_id) > MAX_WORKFLOW_ID_LENGTH:
        raise ValueError(
            f"workflow_id is {len(workflow_id)} characters; the limit is {MAX_WORKFLOW_ID_LENGTH}"
        )
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in workflow_id):
        raise ValueError(f"workflow_id {workflow_id!r} contains control characters")
    return workflow_id


def new_workflow_id() -> WorkflowId:
    return str(uuid.uuid4())


def new_run_id() -> RunId:
    return str(uuid.uuid4())


def validate_run_id(run_id: object) -> RunId:
    if not isinstance(run_id, str):
        raise TypeError(f"run_id must be str, got {type(run_id).__name__}")
    try:
        parsed = uuid.UUID(run_id)
    except ValueError:
        raise ValueError(f"run_id {run_id!r} is not a UUID") from None
    if str(parsed) != run_id:
        raise ValueError(f"run_id {run_id!r} is not in canonical UUID form ({parsed})")
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


def deadline_timer_id(run_id: RunId) -> TimerId:
    return f"deadline:{run_id}"


def scope_timer_id(ordinal: int) -> TimerId:
    return f"scope:{ordinal}"


def is_reserved_timer_id(timer_id: TimerId) -> bool:
    return timer_id.startswith(RESERVED_TIMER_PREFIXES)


def validate_timer_id(timer_id: object) -> TimerId:
    if not isinstance(timer_id, str):
        raise TypeError(f"timer_id must be str, got {type(timer_id).__name__}")
    kind, sep, rest = timer_id.partition(":")
    if not sep or not rest or kind not in ("named", "anonymous", "deadline", "scope"):
        raise ValueError(
            f"timer_id {timer_id!r} must look like named:X, anonymous:N, deadline:RUN or scope:N"
        )
    return timer_id
