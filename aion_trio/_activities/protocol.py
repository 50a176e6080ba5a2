"""The dispatcher protocols: an attempt's request, its outcome, and who runs it."""

from __future__ import annotations

import enum
import functools
import json
import traceback
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Protocol, final, runtime_checkable

import attrs

from .._events import ActivityError, FailureCause
from .._payload import Payload
from .._retry import ActivityOptions


@final
@attrs.frozen(kw_only=True)
class ActivityRequest:
    """One attempt of one activity, as handed to a dispatcher."""

    workflow_id: str
    run_id: str
    activity_id: int
    activity_type: str
    input: Payload
    attempt: int
    task_queue: str
    #: The resolved options as recorded in ``ActivityScheduled`` (a JSON object).
    options: Payload
    #: When the activity was scheduled (``schedule_to_close`` counts from here).
    scheduled_at: datetime | None = None
    #: The last heartbeat details an earlier attempt of this activity reported (JSON).
    heartbeat_details: Payload | None = None

    def resolved_options(self) -> ActivityOptions:
        """The attempt's ``ActivityOptions`` as the workflow resolved and recorded them."""
        return _decoded_options(self.options.json, self.task_queue)


class OutcomeKind(enum.Enum):
    """How an activity attempt ended, as a dispatcher reports it in ``ActivityOutcome.kind``."""

    COMPLETED = "completed"
    FAILED = "failed"
    #: The worker vanished: re-dispatch the same attempt, consume no budget.
    WORKER_LOST = "worker_lost"
    #: The dispatch was parked for a restart: record nothing, deliver nothing.
    PARKED = "parked"
    #: The activity said it completes later (``complete_async()``): the attempt stays open
    #: until a completion, failure or timeout arrives for its task token.
    ASYNC = "async"


@final
@attrs.frozen(kw_only=True)
class ActivityOutcome:
    """What an attempt produced."""

    result: Payload | None = None
    error: ActivityError | None = None
    kind: OutcomeKind = attrs.field()

    @kind.default
    def _default_kind(self) -> OutcomeKind:
        return OutcomeKind.COMPLETED if self.error is None else OutcomeKind.FAILED

    @property
    def ok(self) -> bool:
        """Whether the attempt completed (``kind`` is ``COMPLETED``)."""
        return self.kind is OutcomeKind.COMPLETED


class ActivityDispatcher(Protocol):
    """Runs one activity attempt and reports its outcome.

    The engine bounds each attempt by its ``timeout`` (cancelling
    ``dispatch``) and drives retries; a dispatcher only runs one attempt.
    Cancellation of ``dispatch`` means the attempt was stopped by the engine:
    nothing is recorded for it by the dispatcher.
    """

    async def dispatch(self, request: ActivityRequest) -> ActivityOutcome: ...


@runtime_checkable
class RemoteAttempts(Protocol):
    """Optional, on a dispatcher: whether the attempts of a task queue run in other processes.

    While such an attempt is in flight, all this process holds of it is the wait for
    its outcome, which the engine records through the workflow's current recorder: the
    run awaiting it may be evicted meanwhile (the outcome's record makes it resident
    again).  The PostgreSQL task dispatcher has it.
    """

    def remote(self, task_queue: str) -> bool: ...


@runtime_checkable
class DelegatingDispatcher(Protocol):
    """A dispatcher that hands some requests to the engine's in-process dispatcher.

    :func:`~aion_trio.open_engine` given such a ``dispatcher=`` calls
    :meth:`use_in_process` once, before anything is dispatched, with the
    dispatcher that runs the engine's registered activities in its own
    process (threads, asyncio loop and codec as configured).  The PostgreSQL
    task dispatcher uses it for the task queues it does not send to workers.
    """

    def use_in_process(self, local: ActivityDispatcher) -> None: ...


#: Runs one attempt in this process: ``execute(request, on_heartbeat)``.
#: ``on_heartbeat(details)`` is called (in the Trio thread) on each heartbeat, with the
#: details encoded by the executor's codec (``None``: the beat had none).
ActivityExecutor = Callable[
    [ActivityRequest, Callable[[Payload | None], None] | None], Awaitable["ActivityOutcome"]
]


def error_from_exception(exc: BaseException, cause: FailureCause) -> ActivityError:
    return ActivityError(
        cause=cause,
        type=type(exc).__qualname__,
        message=str(exc),
        traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
    )


@functools.lru_cache(maxsize=1024)
def _decoded_options(options_json: str, task_queue: str) -> ActivityOptions:
    """Recorded options are decoded once per distinct text, not on every attempt."""
    data = json.loads(options_json)
    return ActivityOptions.from_json(data if isinstance(data, dict) else {}, task_queue=task_queue)
