"""Activity task tokens, and ``complete_async()``: an activity that says it completes later.

A task token names one attempt of one activity (workflow, run, activity id, attempt).  Any
process holding it completes, fails or heartbeats that attempt through the engine
(``Engine.complete_activity`` / ``fail_activity`` / ``heartbeat_activity``, or the CLI), and a
token of an attempt that is over is refused, so it is never mistaken for the attempt after it.
The text is ``aion-activity:`` and base64url of a JSON list: readable, not a secret.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any, NoReturn, final

import attrs

from .._errors import InvalidActivityToken
from .._ids import validate_workflow_id

TOKEN_PREFIX = "aion-activity:"
_VERSION = 1


@final
@attrs.frozen(kw_only=True)
class TaskToken:
    """The attempt an activity task token names."""

    workflow_id: str
    run_id: str
    activity_id: int
    attempt: int

    @property
    def key(self) -> tuple[str, str, int, int]:
        return (self.workflow_id, self.run_id, self.activity_id, self.attempt)

    def text(self) -> str:
        """The token as passed around (``activity_info().task_token``)."""
        data = json.dumps(
            [_VERSION, self.workflow_id, self.run_id, self.activity_id, self.attempt],
            separators=(",", ":"),
            ensure_ascii=False,
        )
        return TOKEN_PREFIX + base64.urlsafe_b64encode(data.encode()).decode().rstrip("=")

    @classmethod
    def parse(cls, token: object) -> TaskToken:
        """The attempt ``token`` names; :class:`InvalidActivityToken` if it is not a token."""
        if not isinstance(token, str):
            raise InvalidActivityToken(token, f"a token is a str, got {type(token).__name__}")
        text = token.strip()
        if not text.startswith(TOKEN_PREFIX):
            raise InvalidActivityToken(token, f"it does not start with {TOKEN_PREFIX!r}")
        body = text[len(TOKEN_PREFIX) :]
        try:
            raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
            data: Any = json.loads(raw.decode())
        except (binascii.Error, ValueError, UnicodeDecodeError):
            raise InvalidActivityToken(token, "it is damaged (not base64url JSON)") from None
        if not (isinstance(data, list) and len(data) == 5 and data[0] == _VERSION):
            raise InvalidActivityToken(token, "unknown token layout")
        _, workflow_id, run_id, activity_id, attempt = data
        if not (isinstance(workflow_id, str) and isinstance(run_id, str) and run_id):
            raise InvalidActivityToken(token, "it names no workflow run")
        if type(activity_id) is not int or type(attempt) is not int or activity_id < 0 or attempt < 1:
            raise InvalidActivityToken(token, "it names no activity attempt")
        try:
            validate_workflow_id(workflow_id)
        except ValueError as exc:
            raise InvalidActivityToken(token, str(exc)) from None
        return cls(workflow_id=workflow_id, run_id=run_id, activity_id=activity_id, attempt=attempt)


class CompleteAsync(BaseException):
    """Raised by :func:`complete_async`: the attempt completes later, through its task token.

    A ``BaseException`` (like ``trio.Cancelled``) so that an ``except Exception`` in the
    activity does not swallow it; the engine catches it.
    """

    def __init__(self) -> None:
        super().__init__("the activity attempt completes later, through its task token")


def complete_async() -> NoReturn:
    """Leave the running activity attempt open: it is completed (or failed) later by whoever
    holds its task token (``activity_info().task_token``), through
    ``Engine.complete_activity`` / ``fail_activity`` or ``aion-trio activity complete|fail``.

    Call it from an activity after handing the token on; it raises :class:`CompleteAsync`,
    which must leave the activity.  The attempt's ``timeout``, ``heartbeat_timeout``
    (heartbeats then come through ``Engine.heartbeat_activity``) and ``schedule_to_close``
    still apply: an attempt not completed in time fails as a timeout and is retried per
    its policy.
    """
    raise CompleteAsync()
