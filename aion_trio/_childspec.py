"""What a child command is: its ids, options and parent-close policy (pure, no I/O).

A child's workflow id is the one given to ``ctx.start_child``, else derived
from the command (:func:`derive_child_workflow_id`); its first run id is
derived from the same parts (:func:`derive_child_run_id`), so replay derives
the same ids and "already started" needs nothing extra recorded.  The options
the engine needs later without the parent's code are recorded in the parent's
``child:N`` marker (:class:`ChildOptions`).  The service that starts children
and delivers their outcomes is :mod:`aion_trio._children`.
"""

from __future__ import annotations

import enum
import hashlib
import uuid
from collections.abc import Mapping
from typing import final

import attrs

from ._ids import MAX_WORKFLOW_ID_LENGTH
from ._payload import Payload

CHILD_MARKER_PREFIX = "child:"
_RUN_ID_NAMESPACE = uuid.UUID("5b0c7d2e-6f1a-4c83-9a4e-2d1f0b7c9e61")

#: ``ChildWorkflowFailed.error.details["status"]`` values other than a plain failure.
STATUS_TIMED_OUT = "timed_out"
STATUS_NOT_STARTED = "not_started"


class ParentClosePolicy(enum.Enum):
    """What happens to a child still running when its parent run ends (any terminal).

    * ``CANCEL`` (default): the child is asked to cancel (as ``engine.cancel``);
      its code sees :class:`aion_trio.WorkflowCancelled` and may compensate.
    * ``TERMINATE``: the child is ended at once (as ``engine.terminate``).
    * ``ABANDON``: the child runs on; its outcome is not recorded in the parent.
    """

    CANCEL = "cancel"
    TERMINATE = "terminate"
    ABANDON = "abandon"


@final
@attrs.frozen(kw_only=True)
class ChildOptions:
    """The options of one child command, recorded in the ``child:N`` marker."""

    parent_close_policy: ParentClosePolicy
    task_queue: str
    timeout: float | None = None

    def to_payload(self) -> Payload:
        return Payload.of(
            {
                "parent_close_policy": self.parent_close_policy.value,
                "task_queue": self.task_queue,
                "timeout": self.timeout,
            }
        )

    @classmethod
    def from_payload(cls, payload: Payload | None, default_task_queue: str) -> ChildOptions:
        data = payload.value() if payload is not None else None
        if not isinstance(data, Mapping):
            return cls(parent_close_policy=ParentClosePolicy.CANCEL, task_queue=default_task_queue)
        timeout = data.get("timeout")
        return cls(
            parent_close_policy=ParentClosePolicy(data.get("parent_close_policy", "cancel")),
            task_queue=str(data.get("task_queue") or default_task_queue),
            timeout=float(timeout) if isinstance(timeout, (int, float)) else None,
        )


def child_marker_name(ordinal: int) -> str:
    return f"{CHILD_MARKER_PREFIX}{ordinal}"


def derive_child_workflow_id(parent_workflow_id: str, parent_run_id: str, ordinal: int) -> str:
    """The id of a child started without ``workflow_id`` (see the module docstring)."""
    text = f"{parent_workflow_id}/{parent_run_id}/{ordinal}"
    if len(text) <= MAX_WORKFLOW_ID_LENGTH:
        return text
    digest = hashlib.sha256(f"{parent_workflow_id}\x00{parent_run_id}\x00{ordinal}".encode()).hexdigest()
    return f"child:{digest}"


def derive_child_run_id(parent_workflow_id: str, parent_run_id: str, ordinal: int) -> str:
    """The run id of the child's first run, derived from the command that starts it."""
    return str(uuid.uuid5(_RUN_ID_NAMESPACE, f"{parent_workflow_id}\x00{parent_run_id}\x00{ordinal}"))
