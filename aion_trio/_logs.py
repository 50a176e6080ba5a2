"""Log lines that say which workflow, run, activity and attempt they are about.

The engine's modules log with structured ``extra`` fields (``workflow_id``,
``run_id``, ``activity``, ``activity_type``, ``attempt``, ...).  A JSON handler
sees them; a plain ``%(message)s`` handler, the one people read, did not, so
``activity attempt 1 of 3 failed (...); retrying in 60.000s`` repeated with no
way to tell which order it was about.  :class:`ContextLogger` puts the same
fields at the front of the message, and leaves them on the record too.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    _Adapter = logging.LoggerAdapter[logging.Logger]
else:  # LoggerAdapter is subscriptable only from Python 3.11
    _Adapter = logging.LoggerAdapter

__all__ = ["ContextLogger", "describe_context"]


def describe_context(fields: Mapping[str, Any]) -> str:
    """``workflow 'order-7' run R activity:0 charge attempt 1 of 3`` from a line's fields
    (each part only when its field is there); ``""`` when none is."""
    parts = []
    if fields.get("workflow_id") is not None:
        parts.append(f"workflow {fields['workflow_id']!r}")
    if fields.get("run_id"):
        parts.append(f"run {fields['run_id']}")
    if fields.get("activity") is not None:
        activity = f"activity:{fields['activity']}"
        if fields.get("activity_type"):
            activity += f" {fields['activity_type']}"
        parts.append(activity)
    if fields.get("timer"):
        parts.append(f"timer {fields['timer']}")
    if fields.get("attempt") is not None:
        attempt = f"attempt {fields['attempt']}"
        if fields.get("max_attempts") is not None:
            attempt += f" of {fields['max_attempts']}"
        parts.append(attempt)
    return " ".join(parts)


class ContextLogger(_Adapter):
    """The logger ``name``; a line logged with ``extra`` fields starts with
    :func:`describe_context` of them (``workflow 'order-7' run R ...: message``).

    The fields stay on the record as attributes, for structured handlers.
    """

    def __init__(self, name: str) -> None:
        super().__init__(logging.getLogger(name), {})

    def log(self, level: int, msg: object, *args: object, **kwargs: Any) -> None:
        if not self.isEnabledFor(level):
            return
        extra = kwargs.get("extra")
        context = describe_context(extra) if extra else ""
        if context:
            # With arguments the message is %-formatted: a '%' in an id must stay literal.
            msg = f"{context.replace('%', '%%') if args else context}: {msg}"
        self.logger.log(level, msg, *args, **kwargs)
