"""The CLI's errors and exit statuses, and running async code with the typed errors a
user can act on turned into one ``Error: ...`` line."""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from typing import NoReturn, TypeVar

import click

from .._errors import (
    AionError,
    EngineError,
    InvalidQuery,
    InvalidStoreUrl,
    NotRunning,
    PayloadError,
    PluginError,
    ScheduleError,
    StoreError,
    StoreOpenError,
    StoreOwned,
    UnknownStoreScheme,
    UnknownWorkflowType,
    WorkflowAlreadyStarted,
    WorkflowFailure,
    WorkflowNotFound,
)
from .._interrupt import Interrupted, run_interruptible
from .._urls import redact_url
from .options import STORE_ENV

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup  # type: ignore[import-not-found,unused-ignore]

EXIT_PLUGIN_ERROR = 2
EXIT_USAGE = 2
#: The shell's status for a process ended by SIGINT (128 + 2).
EXIT_INTERRUPTED = 130

T = TypeVar("T")


class PluginsUnavailable(click.ClickException):
    """The installed store plugins could not be loaded (exit status 2)."""

    exit_code = EXIT_PLUGIN_ERROR


class UserError(click.ClickException):
    """A user error with a one-line message (exit status 1)."""

    exit_code = 1


class CommandInterrupted(click.ClickException):
    """SIGINT (Ctrl-C) stopped the command after its code unwound (exit status 130)."""

    exit_code = EXIT_INTERRUPTED


class UsageProblem(UserError):
    """A bad argument found after parsing: a store URL, a filter, a module spec (exit status 2)."""

    exit_code = EXIT_USAGE


def _one_line(message: str) -> str:
    return " ".join(message.split())


def fail(message: str, exit_code: int) -> NoReturn:
    click.echo(f"Error: {_one_line(message)}", err=True)
    sys.exit(exit_code)


def _single(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def _user_error(exc: BaseException, store: str) -> click.ClickException | None:
    """The one-line message for a typed error a user can act on, or ``None`` (a bug)."""
    store = redact_url(store)
    if isinstance(exc, (UnknownStoreScheme, InvalidStoreUrl)):
        return UsageProblem(f"bad store {store!r} (--store / {STORE_ENV}): {exc}")
    if isinstance(exc, PluginError):
        return PluginsUnavailable(f"cannot load the store plugins: {exc}")
    if isinstance(exc, StoreOpenError):
        return UserError(f"cannot open the store {store!r}: {exc}")
    if isinstance(exc, InvalidQuery):
        return UsageProblem(f"bad filter: {exc}")
    if isinstance(exc, WorkflowNotFound):
        return UserError(f"{exc} ({store}); 'aion-trio list' shows the workflows it holds")
    if isinstance(exc, WorkflowFailure):
        return UserError(str(exc))
    if isinstance(exc, (NotRunning, WorkflowAlreadyStarted, PayloadError, UnknownWorkflowType, StoreOwned)):
        return UserError(str(exc))
    if isinstance(exc, ScheduleError):
        # Names the schedule and what to do (ScheduleNotFound, InvalidSchedule, ...).
        return UserError(str(exc))
    if isinstance(exc, StoreError):
        return UserError(f"store {store!r}: {type(exc).__name__}: {exc}")
    if isinstance(exc, EngineError):
        # The engine's messages name what was refused and why (CannotReopen, QueryFailed, ...).
        return UserError(str(exc))
    if isinstance(exc, AionError):
        return UserError(f"{type(exc).__name__}: {exc}")
    return None


def run(store: str, fn: Callable[[], Awaitable[T]]) -> T:
    """``trio.run(fn)``, with the typed errors a user can fix turned into one error line.

    Ctrl-C cancels ``fn`` (see :mod:`aion_trio._interrupt`) and ends the command with
    ``Error: interrupted`` and exit status 130.
    """
    try:
        return run_interruptible(fn)
    except click.ClickException:
        raise
    except BaseException as raw:
        exc = _single(raw)
        if isinstance(exc, click.ClickException):
            raise exc from None
        if isinstance(exc, Interrupted):
            raise CommandInterrupted("interrupted") from None
        error = _user_error(exc, store)
        if error is None:
            raise
        raise error from exc


def describe_error(exc: BaseException, store: str) -> str | None:
    """The one-line message ``run`` would print for ``exc`` (a typed error a user can act on,
    or a CLI error), or ``None`` for a bug; for callers that report errors without exiting."""
    exc = _single(exc)
    if isinstance(exc, click.ClickException):
        return exc.format_message()
    error = _user_error(exc, store)
    return None if error is None else error.format_message()
