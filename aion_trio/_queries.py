"""A run's query handlers: registered by its code, answered between its steps.

A handler is a plain (sync) function that reads the workflow's state; it runs
while the run's task is parked, caught up with history, and must not issue
commands (they raise :class:`~aion_trio.QueryReadOnly`, even if the handler
catches that).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, final

from ._contain import is_structural
from ._convert import handler_hints
from ._errors import QueryFailed, UnknownQuery
from ._replay import Replay


@final
class QueryHandlers:
    """The handlers one execution of a run's code registered, by query name."""

    def __init__(self, replay: Replay) -> None:
        self._replay = replay
        self._handlers: dict[str, Callable[..., Any]] = {}

    def register(self, name: str, handler: Callable[..., Any]) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"query name must be a non-empty str, got {name!r}")
        if not callable(handler):
            raise TypeError(f"query handler {name!r} must be callable, got {handler!r}")
        if inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(
            getattr(handler, "__call__", None)  # noqa: B004 -- an object with an async __call__
        ):
            raise TypeError(
                f"query handler {name!r} is an async function; handlers must be plain functions "
                "(def, not async def): a query reads the workflow's state between steps and never "
                "waits, so it cannot hold up the run"
            )
        self._handlers[name] = handler

    def answer(self, name: str, args: Sequence[Any]) -> Any:
        """Run the handler for ``name`` synchronously (the run's task is parked)."""
        replay = self._replay
        handler = self._handlers.get(name)
        if handler is None:
            raise UnknownQuery(replay.workflow_id, replay.run_id, name, sorted(self._handlers))
        # Annotated parameters get their types; arguments that do not fit raise PayloadDecodeError.
        args = handler_hints(handler).decode_arguments(list(args), what=f"arguments of query {name!r}")
        replay.answering = name
        replay.query_violation = None
        error: BaseException | None = None
        try:
            value = handler(*args)
        except BaseException as exc:
            # SystemExit or any BaseException of the handler's own is its failure (see _contain).
            if is_structural(exc):
                raise
            error = exc
        finally:
            replay.answering = None
        violation, replay.query_violation = replay.query_violation, None
        if violation is not None:
            raise violation  # even if the handler caught it: the query broke the read-only rule
        if error is not None:
            raise QueryFailed(replay.workflow_id, replay.run_id, name, error) from error
        if inspect.isawaitable(value):
            if inspect.iscoroutine(value):
                value.close()
            problem = TypeError(
                f"query handler {name!r} returned an awaitable; handlers must be plain functions"
            )
            raise QueryFailed(replay.workflow_id, replay.run_id, name, problem)
        return value
