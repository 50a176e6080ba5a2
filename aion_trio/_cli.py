"""The ``aion-trio`` command line.

Commands: ``stores``, ``list``, ``show``, ``history`` (read-only); ``start``,
``signal``, ``cancel``, ``terminate``, ``reopen`` (writes) and ``worker`` (serve
the user's definitions until SIGINT/SIGTERM, then drain).

Writes and the store's owner
----------------------------
One engine owns a store at a time (DESIGN §4.5).  When a live worker owns it,
a write command is queued in the store's command inbox and the worker applies
it through its engine ("queued for the running worker (pid N on HOST)"); the
command waits (``--queue-timeout``) for the outcome and prints it.  With no
live owner, the command opens an engine in this process and applies the
write directly, and says so.

The store
---------
Every command but ``stores`` works on the store named by ``--store`` or the
``AION_TRIO_STORE`` environment variable: a store URL (``sqlite:///orders.db``,
``memory://``, any scheme a plugin registers) or a plain path, taken as a SQLite
file.  The default is ``sqlite:///aion.db``: ``aion.db`` in the current
directory.  The read-only commands open a SQLite store with ``?mode=ro``, so a
mistyped path is an error rather than a new, empty database.

The user module (``MODULE:ATTR``)
---------------------------------
``start``, ``signal`` and ``worker`` import ``MODULE`` (the current directory
is put on ``sys.path`` first) and read the definitions from ``ATTR``: any
object with a ``workflows`` sequence of ``@aion_trio.workflow`` functions and
an optional ``activities`` sequence of ``@aion_trio.activity`` functions (a
``types.SimpleNamespace`` will do).  Without ``:ATTR`` the module itself is
that object: module-level lists named ``workflows`` and ``activities``.

Output and errors
-----------------
Human output is rich tables on stdout (plain text when stdout is not a
terminal); ``--json`` prints JSON for machines.  Every error is one line,
``Error: ...``, on stderr: exit status 2 for a usage error (a bad option or
argument, a bad store URL, a store plugin that cannot be loaded), 130 for
an interrupt (SIGINT, Ctrl-C), 1 for anything else (a store that cannot be
opened, an unknown workflow, a failed run, ...).  Tracebacks are for bugs
only.  Tables fit the terminal, or ``PIPED_WIDTH`` columns when stdout is not
a terminal (``COLUMNS`` overrides both).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import logging
import math
import os
import signal as signal_module
import sys
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any, NoReturn, TypeVar

import attrs
import click
import trio
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ._chain import ChainState, follow_chain, settled_result
from ._commands import (
    CancelCommand,
    Command,
    CommandOutcome,
    QueryCommand,
    ReopenCommand,
    SignalCommand,
    StartCommand,
    TerminateCommand,
)
from ._definitions import ActivityDefinition, WorkflowDefinition, index_definitions
from ._engine import Engine, IdReusePolicy, WorkflowDescription, describe_history, open_engine
from ._errors import (
    AionError,
    EngineError,
    InvalidArguments,
    InvalidQuery,
    InvalidStoreUrl,
    NotRunning,
    PayloadError,
    PluginError,
    StoreError,
    StoreOpenError,
    StoreOwned,
    UnknownStoreScheme,
    UnknownWorkflowType,
    WorkflowAlreadyStarted,
    WorkflowFailure,
    WorkflowNotFound,
)
from ._events import (
    ActivityCompleted,
    ActivityFailed,
    ActivityScheduled,
    ActivityStarted,
    Event,
    EventBody,
    SignalReceived,
    TimerStarted,
    WorkflowCompleted,
    WorkflowFailed,
    WorkflowStarted,
    WorkflowStatus,
)
from ._ids import new_workflow_id, validate_caller_request_id, validate_task_queue
from ._logs import ContextLogger
from ._observe import ObserverEvent, WorkflowRunEnded, WorkflowRunStarted
from ._ownership import claim_is_live, wall_now
from ._payload import Payload, PayloadCodec
from ._plugins import open_store
from ._projections import outstanding_timers, run_segment
from ._store import (
    CommandInbox,
    OwnedStore,
    SearchOp,
    SearchPredicate,
    Store,
    VisibilityFilter,
    VisibilityRow,
)
from ._taskqueues import run_activity_worker
from ._urls import redact_url
from ._version import __version__
from ._wire import body_to_wire, event_to_json, event_to_wire, format_datetime
from .plugin import ENTRY_POINT_GROUP, StoreRegistry, build_registry, make_plugin_manager

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup  # type: ignore[import-not-found,unused-ignore]

PROG_NAME = "aion-trio"
EXIT_PLUGIN_ERROR = 2
EXIT_USAGE = 2
#: The shell's status for a process ended by SIGINT (128 + 2).
EXIT_INTERRUPTED = 130
STORE_ENV = "AION_TRIO_STORE"
MODULE_ENV = "AION_TRIO_MODULE"
DEFAULT_STORE = "sqlite:///aion.db"
DEFAULT_LIST_LIMIT = 100
DEFAULT_DRAIN_TIMEOUT = 10.0
#: Columns of the tables when stdout is not a terminal (a terminal: its width; $COLUMNS: that).
PIPED_WIDTH = 100

T = TypeVar("T")

worker_log = ContextLogger("aion_trio.worker")


class PluginsUnavailable(click.ClickException):
    """The installed store plugins could not be loaded (exit status 2)."""

    exit_code = EXIT_PLUGIN_ERROR


class UserError(click.ClickException):
    """A user error with a one-line message (exit status 1)."""

    exit_code = 1


class UsageProblem(UserError):
    """A bad argument found after parsing: a store URL, a filter, a module spec (exit status 2)."""

    exit_code = EXIT_USAGE


def _one_line(message: str) -> str:
    return " ".join(message.split())


class _Cli(click.Group):
    """click's group, except that every error is one ``Error: ...`` line on stderr.

    click prints usage errors as usage text plus a hint plus the error; here the
    hint is folded into the one line, so scripts and people read the same thing.
    """

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.UsageError as exc:
            hint = f"; see '{exc.ctx.command_path} --help'" if exc.ctx is not None else ""
            _fail(f"{exc.format_message().rstrip('.')}{hint}", exc.exit_code)
        except click.ClickException as exc:
            _fail(exc.format_message(), exc.exit_code)
        except click.Abort as exc:
            if isinstance(exc.__context__, KeyboardInterrupt):
                _fail("interrupted", EXIT_INTERRUPTED)
            _fail("aborted", 1)
        sys.exit(rv if isinstance(rv, int) else 0)


def _fail(message: str, exit_code: int) -> NoReturn:
    click.echo(f"Error: {_one_line(message)}", err=True)
    sys.exit(exit_code)


def _load_registry() -> StoreRegistry:
    """A fresh registry from the installed entry points (a CLI run is one-shot: no cache)."""
    try:
        return build_registry(make_plugin_manager())
    except PluginError as exc:
        raise PluginsUnavailable(f"cannot load the store plugins: {exc}") from exc
    except Exception as exc:
        # Whatever a plugin raised while loading or registering, the user's fix is
        # the same: repair, uninstall or disable that plugin.
        raise PluginsUnavailable(f"cannot load the store plugins: {type(exc).__name__}: {exc}") from exc


# --------------------------------------------------------------------------
# Running async code, and mapping typed errors to one-line messages
# --------------------------------------------------------------------------


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
    if isinstance(exc, StoreError):
        return UserError(f"store {store!r}: {type(exc).__name__}: {exc}")
    if isinstance(exc, EngineError):
        # The engine's messages name what was refused and why (CannotReopen, QueryFailed, ...).
        return UserError(str(exc))
    if isinstance(exc, AionError):
        return UserError(f"{type(exc).__name__}: {exc}")
    return None


def _run(store: str, fn: Callable[[], Awaitable[T]]) -> T:
    """``trio.run(fn)``, with the typed errors a user can fix turned into one error line."""
    try:
        return trio.run(fn)
    except click.ClickException:
        raise
    except BaseException as raw:
        exc = _single(raw)
        if isinstance(exc, click.ClickException):
            raise exc from None
        error = _user_error(exc, store)
        if error is None:
            raise
        raise error from exc


# --------------------------------------------------------------------------
# Options shared by commands
# --------------------------------------------------------------------------


def _store_url(value: str) -> str:
    """A store URL, or a plain path taken as a SQLite file."""
    value = value.strip()
    if not value:
        raise click.BadParameter("the store is empty; give a URL such as sqlite:///aion.db, or a path")
    if "://" in value:
        return value
    path = os.path.abspath(os.path.expanduser(value))
    return "sqlite:///" + urllib.parse.quote(path, safe="/")


def _read_only(url: str) -> str:
    """For a ``sqlite://`` URL, the same URL with ``mode=ro`` (unless it names a mode)."""
    scheme, _, rest = url.partition("://")
    if scheme.lower() != "sqlite":
        return url
    _, _, query = rest.partition("?")
    if any(name == "mode" for name, _ in urllib.parse.parse_qsl(query, keep_blank_values=True)):
        return url
    return url + ("&" if query else "?") + "mode=ro"


F = TypeVar("F", bound=Callable[..., Any])


def _store_option(fn: F) -> F:
    return click.option(
        "--store",
        "store",
        metavar="URL",
        help=f"Store URL, or a path to a SQLite file (default: 'aion-trio --store', then ${STORE_ENV}, "
        f"then {DEFAULT_STORE}).",
    )(fn)


def _resolve_store(store: str | None) -> str:
    """The command's --store, else the group's (which falls back to $AION_TRIO_STORE, then the default)."""
    if store is None:
        # An empty group --store is refused like an empty command one, never taken as the default.
        store = click.get_current_context().find_root().params.get("store")
        if store is None:
            store = DEFAULT_STORE
    return _store_url(store)


def _module_option(fn: F) -> F:
    return click.option(
        "--module",
        "-m",
        "module",
        envvar=MODULE_ENV,
        required=True,
        metavar="MODULE:ATTR",
        help=f"Where the workflows and activities are (env: {MODULE_ENV}); see 'aion-trio worker --help'.",
    )(fn)


def _json_argument(text: str, what: str) -> Any:
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except ValueError as exc:
        raise click.BadParameter(
            f"{what} is not valid JSON ({exc}): {text!r}; quote strings, e.g. '\"text\"'"
        ) from None


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _parse_time(value: str | None, option: str) -> datetime | None:
    if value is None:
        return None
    text = value.strip()
    if text.endswith(("Z", "z")):
        text = text[:-1] + "+00:00"
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        raise click.BadParameter(
            f"{value!r} is not an ISO-8601 time (e.g. 2026-11-30, 2026-11-30T14:00, 2026-11-30T14:00:00+01:00)",
            param_hint=option,
        ) from None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=timezone.utc)


_ATTR_OPS = {"=": SearchOp.EQUALS, ">": SearchOp.GREATER, "<": SearchOp.LESS, "~": SearchOp.CONTAINS}


def _parse_attr(text: str) -> SearchPredicate:
    """``KEY=VALUE``, ``KEY>VALUE``, ``KEY<VALUE`` or ``KEY~TEXT`` as a search predicate."""
    at = min((text.find(op) for op in _ATTR_OPS if op in text), default=-1)
    if at <= 0:
        raise click.BadParameter(
            f"{text!r} is not KEY=VALUE, KEY>VALUE, KEY<VALUE or KEY~TEXT", param_hint="--attr"
        )
    key, op, raw = text[:at], _ATTR_OPS[text[at]], text[at + 1 :]
    value: Any = raw
    if op is not SearchOp.CONTAINS:
        try:
            value = json.loads(raw, parse_constant=_refuse_constant)
        except ValueError:
            value = raw
        if not isinstance(value, (str, int, float, bool, list)) or (
            isinstance(value, float) and not math.isfinite(value)
        ):
            value = raw
    try:
        return SearchPredicate(key=key, op=op, value=value)
    except InvalidQuery as exc:
        raise click.BadParameter(f"{text!r}: {exc}", param_hint="--attr") from None


# --------------------------------------------------------------------------
# The user module
# --------------------------------------------------------------------------


@attrs.frozen
class App:
    spec: str
    workflows: tuple[WorkflowDefinition[Any], ...]
    activities: tuple[ActivityDefinition[Any], ...]

    def describe(self) -> str:
        def plural(n: int, what: str) -> str:
            return f"{n} {what}{'' if n == 1 else 's'}"

        return (
            f"{plural(len(self.workflows), 'workflow type')}, {plural(len(self.activities), 'activity type')}"
        )


def _import_target(spec: str) -> Any:
    """Import ``MODULE[:ATTR]`` and return the object it names."""
    module_name, _, attr_path = spec.partition(":")
    if not module_name or (":" in spec and not attr_path):
        raise UsageProblem(f"{spec!r} is not MODULE:ATTR (e.g. myapp.workflows:app) or MODULE")
    if module_name.endswith(".py") or "/" in module_name or os.sep in module_name:
        # A file name where a module name goes: name the module that file is.
        stem = os.path.splitext(module_name)[0].replace(os.sep, "/").strip("./").replace("/", ".")
        raise UsageProblem(
            f"{spec!r} is a file name; give the module and the object in it, MODULE:ATTR, e.g. "
            f"{stem}:app (the current directory is on the import path)"
        )
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        target: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module_name.startswith(exc.name):
            raise UserError(
                f"cannot import {module_name!r} ({spec}): no module named {exc.name!r}; run from the "
                "directory that holds it, or add that directory to PYTHONPATH"
            ) from exc
        raise UserError(f"importing {module_name!r} ({spec}) failed: {type(exc).__name__}: {exc}") from exc
    except Exception as exc:
        raise UserError(f"importing {module_name!r} ({spec}) failed: {type(exc).__name__}: {exc}") from exc
    for part in attr_path.split(".") if attr_path else ():
        try:
            target = getattr(target, part)
        except AttributeError:
            raise UserError(f"{spec}: {module_name!r} has no attribute {attr_path!r}") from None
    return target


def load_activities(spec: str) -> tuple[ActivityDefinition[Any], ...]:
    """Import ``MODULE[:ATTR]`` and return its activity definitions (``.activities``)."""
    target = _import_target(spec)
    activities = getattr(target, "activities", None)
    if not activities:
        raise UserError(
            f"{spec} has no 'activities': point --activities at an object with an .activities sequence "
            "of @aion_trio.activity functions, or at a module defining a list named so"
        )
    try:
        _, activity_map = index_definitions((), tuple(activities))
    except (TypeError, ValueError) as exc:
        raise UserError(f"{spec}: {exc}") from exc
    return tuple(activity_map.values())


def load_app(spec: str) -> App:
    """Import ``MODULE[:ATTR]`` and return its workflow and activity definitions."""
    target = _import_target(spec)
    workflows = getattr(target, "workflows", None)
    activities = getattr(target, "activities", ())
    if workflows is None:
        raise UserError(
            f"{spec} has no 'workflows': point MODULE:ATTR at an object with .workflows (and .activities) "
            "sequences, or MODULE at a module defining lists named so"
        )
    try:
        workflow_map, activity_map = index_definitions(tuple(workflows), tuple(activities))
    except (TypeError, ValueError) as exc:
        raise UserError(f"{spec}: {exc}") from exc
    return App(spec=spec, workflows=tuple(workflow_map.values()), activities=tuple(activity_map.values()))


# --------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------

_STATUS_STYLE = {
    WorkflowStatus.RUNNING: "cyan",
    WorkflowStatus.COMPLETED: "green",
    WorkflowStatus.FAILED: "red",
    WorkflowStatus.CANCELLED: "yellow",
    WorkflowStatus.TIMED_OUT: "red",
    WorkflowStatus.CONTINUED_AS_NEW: "blue",
}


def _console() -> Console:
    console = Console(highlight=False)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        # Piped or redirected: a fixed width that fits a review tool or an e-mail.
        console = Console(highlight=False, width=PIPED_WIDTH)
    return console


def _status_text(status: WorkflowStatus) -> Text:
    return Text(status.value, style=_STATUS_STYLE.get(status, ""))


def _when(value: datetime | None, *, precise: bool = False) -> str:
    if value is None:
        return "-"
    utc = value.astimezone(timezone.utc)
    return utc.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z" if precise else utc.strftime("%Y-%m-%d %H:%M:%SZ")


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _payload_text(payload: Payload, limit: int = 60) -> str:
    return _short(payload.json, limit)


def _json_text(value: Any, limit: int = 60) -> str:
    return _short(json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str), limit)


def event_detail(body: EventBody) -> str:
    """A short, one-line description of an event body, for people."""
    if isinstance(body, WorkflowStarted):
        text = f"{body.workflow_type}({_payload_text(body.input)}) run {body.run_id}"
        if body.parent_run_id:
            text += f" continues {body.parent_run_id}"
        return text
    if isinstance(body, WorkflowCompleted):
        return f"result {_payload_text(body.result)}"
    if isinstance(body, WorkflowFailed):
        return _short(f"{body.error.type}: {body.error.message}", 80)
    if isinstance(body, ActivityScheduled):
        return f"activity:{body.activity_id} {body.activity_type}({_payload_text(body.input)})"
    if isinstance(body, ActivityStarted):
        return f"activity:{body.activity_id} attempt {body.attempt}"
    if isinstance(body, ActivityCompleted):
        return f"activity:{body.activity_id} attempt {body.attempt} -> {_payload_text(body.result)}"
    if isinstance(body, ActivityFailed):
        settles = "final" if body.final else "will retry"
        return _short(
            f"activity:{body.activity_id} attempt {body.attempt} {body.error.cause.value}, {settles}: "
            f"{body.error.type}: {body.error.message}",
            100,
        )
    if isinstance(body, TimerStarted):
        return f"{body.timer_id} fires at {_when(body.fire_at, precise=True)}"
    if isinstance(body, SignalReceived):
        return f"{body.name} {_payload_text(body.payload)}"
    # Every other event: its wire fields, shortened.
    _, data = body_to_wire(body)
    parts = [f"{k}={_json_text(v, 40)}" for k, v in data.items() if k not in ("traceback", "details")]
    return _short(" ".join(parts), 100)


def _history_table(events: Sequence[Event], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("Seq", justify="right", no_wrap=True)
    table.add_column("Time (UTC)", no_wrap=True)
    table.add_column("Event", no_wrap=True, style="bold")
    table.add_column("Detail")
    for event in events:
        table.add_row(
            str(event.seq),
            _when(event.recorded_at, precise=True),
            type(event.body).__name__,
            Text(event_detail(event.body)),
        )
    return table


def _row_json(row: VisibilityRow) -> dict[str, Any]:
    return {
        "workflow_id": row.workflow_id,
        "run_id": row.run_id,
        "workflow_type": row.workflow_type,
        "status": row.status.value,
        "start_time": format_datetime(row.start_time),
        "close_time": format_datetime(row.close_time) if row.close_time is not None else None,
        "task_queue": row.task_queue,
        "failed_step": row.failed_step,
        "failure_reason": row.failure_reason,
        "stuck_reason": row.stuck_reason,
        "search_attributes": _attributes_json(row.search_attributes),
    }


def _attributes_json(attributes: Mapping[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in attributes.items()}


# --------------------------------------------------------------------------
# Store access for the read-only commands
# --------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _open_for_reading(store: str) -> AsyncIterator[Store]:
    registry = _load_registry()
    async with open_store(_read_only(store), registry=registry) as opened:
        yield opened


async def _read_history(opened: Store, workflow_id: str) -> list[Event]:
    events = await opened.events.read_history(workflow_id)
    if not events:
        raise WorkflowNotFound(workflow_id)
    return events


# --------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------


@click.group(cls=_Cli, invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "-V", "--version", prog_name=PROG_NAME, message="%(prog)s %(version)s")
@click.option(
    "--store",
    "store",
    envvar=STORE_ENV,
    default=DEFAULT_STORE,
    show_default=True,
    metavar="URL",
    help=f"Store URL, or a path to a SQLite file (env: {STORE_ENV}); commands also take --store.",
)
@click.pass_context
def cli(ctx: click.Context, store: str) -> None:
    """aion-trio: durable, event-sourced workflows embedded in Trio applications.

    Commands work on the store given by --store URL or $AION_TRIO_STORE
    (default sqlite:///aion.db, i.e. ./aion.db); a plain path is a SQLite file.
    """
    if ctx.invoked_subcommand is None:
        click.echo(ctx.get_help())


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of objects instead of a table.")
def stores(as_json: bool) -> None:
    """List the store URL schemes that installed plugins register.

    Plugins are found through the 'aion_trio' entry-point group; set
    AION_TRIO_DISABLE_PLUGINS=name[,name...] (or '*') to skip some.
    """
    schemes = _load_registry().schemes()
    if as_json:
        data = [{"scheme": s.scheme, "plugin": s.plugin, "description": s.description} for s in schemes]
        click.echo(json.dumps(data, indent=2))
        return
    console = _console()
    if not schemes:
        console.print(
            Text(
                f"No store plugins are registered (entry-point group {ENTRY_POINT_GROUP!r}).", style="yellow"
            )
        )
        return
    table = Table(title="Store schemes")
    table.add_column("Scheme", no_wrap=True, style="bold")
    table.add_column("Plugin", no_wrap=True)
    table.add_column("Description")
    for s in schemes:
        # Text, not markup: a description is plugin-supplied and may contain '[...]'.
        table.add_row(Text(f"{s.scheme}://"), Text(s.plugin), Text(s.description))
    console.print(table)


_STATUS_CHOICES = [s.value for s in WorkflowStatus]


@cli.command("list")
@_store_option
@click.option(
    "--status",
    "statuses",
    multiple=True,
    type=click.Choice(_STATUS_CHOICES, case_sensitive=False),
    help="Only workflows in this status (repeatable: any of them).",
)
@click.option("--type", "workflow_type", metavar="TYPE", help="Only workflows of this type.")
@click.option("--task-queue", metavar="QUEUE", help="Only workflows on this task queue.")
@click.option(
    "--started-after", metavar="TIME", help="Started at or after TIME (ISO-8601; UTC if no offset)."
)
@click.option("--started-before", metavar="TIME", help="Started at or before TIME.")
@click.option("--closed-after", metavar="TIME", help="Closed at or after TIME (excludes open workflows).")
@click.option("--closed-before", metavar="TIME", help="Closed at or before TIME (excludes open workflows).")
@click.option(
    "--attr",
    "attrs_",
    multiple=True,
    metavar="KEY=VALUE",
    help="Search attribute filter (repeatable, all must hold): KEY=VALUE equals, KEY>VALUE, KEY<VALUE, "
    "KEY~TEXT contains. VALUE is JSON when it parses (3, 2.5, true, '\"007\"'), else a string.",
)
@click.option(
    "--limit",
    type=click.IntRange(min=0),
    default=DEFAULT_LIST_LIMIT,
    show_default=True,
    help="At most this many rows.",
)
@click.option(
    "--offset", type=click.IntRange(min=0), default=0, show_default=True, help="Skip this many rows."
)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of objects instead of a table.")
def list_(
    store: str | None,
    statuses: tuple[str, ...],
    workflow_type: str | None,
    task_queue: str | None,
    started_after: str | None,
    started_before: str | None,
    closed_after: str | None,
    closed_before: str | None,
    attrs_: tuple[str, ...],
    limit: int,
    offset: int,
    as_json: bool,
) -> None:
    """List workflows, newest first, with filters.

    \b
    Examples:
      aion-trio list --status running --type checkout
      aion-trio list --started-after 2026-11-30T08:00 --attr region=eu --attr 'amount>100'
    """
    url = _resolve_store(store)
    criteria: dict[str, Any] = {
        "workflow_type": workflow_type,
        "task_queue": task_queue,
        "status": frozenset(WorkflowStatus(s.lower()) for s in statuses) if statuses else None,
        "started_after": _parse_time(started_after, "--started-after"),
        "started_before": _parse_time(started_before, "--started-before"),
        "closed_after": _parse_time(closed_after, "--closed-after"),
        "closed_before": _parse_time(closed_before, "--closed-before"),
        "search": tuple(_parse_attr(a) for a in attrs_),
    }
    try:
        page = VisibilityFilter(**criteria, limit=limit, offset=offset, newest_first=True)
    except InvalidQuery as exc:
        raise UsageProblem(f"bad filter: {exc}") from None

    async def query() -> tuple[list[VisibilityRow], int]:
        async with _open_for_reading(url) as opened:
            return await opened.visibility.list(page), await opened.visibility.count(page)

    rows, total = _run(url, query)
    if as_json:
        click.echo(json.dumps([_row_json(r) for r in rows], indent=2, ensure_ascii=False))
        return
    console = _console()
    if not rows:
        console.print(f"No workflows match ({total} in total match the filters; offset {offset}).")
        return
    table = Table(title=f"Workflows in {redact_url(url)}", title_justify="left")
    # Narrow output (PIPED_WIDTH) wraps the times and folds the type; an id stays whole.
    table.add_column("Workflow ID", no_wrap=True, style="bold")
    table.add_column("Type", overflow="fold")
    table.add_column("Status", no_wrap=True)
    table.add_column("Started (UTC)", overflow="fold")
    table.add_column("Closed (UTC)", overflow="fold")
    table.add_column("Note", overflow="fold")
    for row in rows:
        note = row.stuck_reason and f"stuck: {row.stuck_reason}"
        if note is None and row.failure_reason:
            note = f"{row.failed_step}: {row.failure_reason}" if row.failed_step else row.failure_reason
        table.add_row(
            Text(row.workflow_id),
            Text(row.workflow_type),
            _status_text(row.status),
            _when(row.start_time),
            _when(row.close_time),
            Text(_short(note or "", 80)),
        )
    console.print(table)
    console.print(f"{offset + 1}-{offset + len(rows)} of {total} matching workflows")


def _show(console: Console, events: list[Event], description: WorkflowDescription) -> None:
    summary = Table.grid(padding=(0, 2))
    summary.add_column(style="bold", no_wrap=True)
    summary.add_column()
    summary.add_row("Workflow", Text(description.workflow_id))
    summary.add_row("Type", Text(description.workflow_type))
    summary.add_row("Run", Text(description.run_id))
    if len(description.run_ids) > 1:
        summary.add_row("Runs", str(len(description.run_ids)))
    summary.add_row("Status", _status_text(description.status))
    summary.add_row("Started", _when(description.start_time, precise=True))
    summary.add_row("Closed", _when(description.close_time, precise=True))
    summary.add_row("Task queue", Text(description.task_queue))
    if description.search_attributes:
        summary.add_row("Search attributes", Text(_json_text(dict(description.search_attributes), 200)))
    if description.stuck_reason:
        summary.add_row("Stuck", Text(description.stuck_reason, style="red"))
    if description.status is WorkflowStatus.COMPLETED:
        summary.add_row("Result", Text(_json_text(description.result, 200)))
    summary.add_row("Events", str(description.history_length))
    console.print(summary)

    if description.pending_activities:
        table = Table(title="Pending activities", title_justify="left")
        for column in ("Activity", "Type", "Next attempt", "Scheduled (UTC)", "Task queue"):
            table.add_column(column, no_wrap=True)
        for a in description.pending_activities:
            table.add_row(
                f"activity:{a.activity_id}",
                Text(a.activity_type),
                str(a.attempt),
                _when(a.scheduled_at, precise=True),
                Text(a.task_queue),
            )
        console.print(table)
    timers = outstanding_timers(run_segment(events, description.run_id))
    if timers and description.status is WorkflowStatus.RUNNING:
        table = Table(title="Pending timers", title_justify="left")
        table.add_column("Timer", no_wrap=True)
        table.add_column("Fires at (UTC)", no_wrap=True)
        for t in timers:
            table.add_row(Text(t.timer_id), _when(t.fire_at, precise=True))
        console.print(table)
    if description.error is not None:
        failure = Table.grid(padding=(0, 2))
        failure.add_column(style="bold red", no_wrap=True)
        failure.add_column()
        failure.add_row("Failure", Text(description.error.type))
        failure.add_row("Message", Text(description.error.message))
        failure.add_row("Failed step", Text(description.failed_step or "-"))
        console.print(failure)
    console.print(_history_table(events, "History"))


def _show_json(events: list[Event], description: WorkflowDescription) -> dict[str, Any]:
    """What ``show`` prints, as one JSON object; ``history`` holds the events' wire form."""
    error = description.error
    running = description.status is WorkflowStatus.RUNNING
    return {
        "workflow_id": description.workflow_id,
        "run_id": description.run_id,
        "run_ids": list(description.run_ids),
        "workflow_type": description.workflow_type,
        "status": description.status.value,
        "start_time": format_datetime(description.start_time),
        "close_time": format_datetime(description.close_time) if description.close_time else None,
        "task_queue": description.task_queue,
        "search_attributes": _attributes_json(description.search_attributes),
        "stuck_reason": description.stuck_reason,
        "result": description.result if description.status is WorkflowStatus.COMPLETED else None,
        "error": None
        if error is None
        else {"type": error.type, "message": error.message, "traceback": error.traceback},
        "failed_step": description.failed_step,
        "pending_activities": [
            {
                "activity_id": a.activity_id,
                "activity_type": a.activity_type,
                "attempt": a.attempt,
                "scheduled_at": format_datetime(a.scheduled_at),
                "task_queue": a.task_queue,
            }
            for a in description.pending_activities
        ],
        "pending_timers": [
            {"timer_id": t.timer_id, "fire_at": format_datetime(t.fire_at)}
            for t in (outstanding_timers(run_segment(events, description.run_id)) if running else ())
        ],
        "history_length": description.history_length,
        "history": [event_to_wire(event) for event in events],
    }


@cli.command()
@_store_option
@click.argument("workflow_id")
@click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON object (the summary, and the history's events)."
)
def show(store: str | None, workflow_id: str, as_json: bool) -> None:
    """Show one workflow: summary, pending work, failure, and its history."""
    url = _resolve_store(store)

    async def read() -> tuple[list[Event], VisibilityRow | None]:
        async with _open_for_reading(url) as opened:
            events = await _read_history(opened, workflow_id)
            return events, await opened.visibility.get(workflow_id)

    events, row = _run(url, read)
    description = describe_history(
        workflow_id, events, codec=PayloadCodec(), stuck_reason=row.stuck_reason if row else None
    )
    if as_json:
        click.echo(json.dumps(_show_json(events, description), indent=2, ensure_ascii=False))
        return
    _show(_console(), events, description)


@cli.command()
@_store_option
@click.argument("workflow_id")
@click.option("--json", "as_json", is_flag=True, help="Print the events as JSON lines (the wire form).")
def history(store: str | None, workflow_id: str, as_json: bool) -> None:
    """Print a workflow's event history (a table, or JSON lines with --json)."""
    url = _resolve_store(store)

    async def read() -> list[Event]:
        async with _open_for_reading(url) as opened:
            return await _read_history(opened, workflow_id)

    events = _run(url, read)
    if as_json:
        for event in events:
            click.echo(event_to_json(event))
        return
    _console().print(_history_table(events, f"History of {workflow_id}"))


def _check_type(app: App, workflow_type: str, args: Sequence[Any] | None = None) -> None:
    """Refuse an unknown workflow type, and (given ``args``) arguments that do not fit its signature."""
    known = sorted(w.name for w in app.workflows)
    if workflow_type not in known:
        raise UserError(
            f"workflow type {workflow_type!r} is not in {app.spec} (it has: {', '.join(known) or 'none'}); "
            "add it to its workflows, or check the spelling"
        )
    if args is not None:
        definition = next(w for w in app.workflows if w.name == workflow_type)
        try:
            definition.check_arguments(args)
        except InvalidArguments as exc:
            raise UsageProblem(f"{exc}; give them as JSON after TYPE") from None


DEFAULT_QUEUE_TIMEOUT = 30.0
_DIRECT = "no worker owns the store: applied directly by this process"
_OUTCOME_POLL = 0.05
_RESULT_POLL = 0.1


def _queue_timeout_option(fn: F) -> F:
    return click.option(
        "--queue-timeout",
        type=click.FloatRange(min=0),
        default=DEFAULT_QUEUE_TIMEOUT,
        show_default=True,
        metavar="SECONDS",
        help="When a running worker owns the store: how long to wait for it to apply the queued command.",
    )(fn)


def _vetted_request_id(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is None:
        return None
    try:
        return validate_caller_request_id(value, "--request-id")
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _request_id_option(fn: F) -> F:
    return click.option(
        "--request-id",
        metavar="KEY",
        callback=_vetted_request_id,
        help="Idempotency key: the same command again with the same KEY records nothing more, so a "
        "retry after a crash or a time-out is safe (docs/concepts.md, Request ids).",
    )(fn)


@attrs.define
class _Delivered:
    """How a write command reached the store: applied here, or queued for its owner."""

    queued: bool
    value: Any = None
    command_id: int | None = None
    owner: str = ""
    outcome: CommandOutcome | None = None


async def _live_owner(opened: Store) -> str | None:
    """``"pid N on HOST"`` of the store's live owner, or ``None`` (no owner, or a dead one)."""
    if not isinstance(opened, OwnedStore):
        return None
    claim = await opened.current_owner()
    if claim is None or not claim_is_live(claim, wall_now()):
        return None
    return f"pid {claim.identity.pid} on {claim.identity.host}"


async def _apply_or_queue(
    url: str,
    app: App,
    command: Command,
    direct: Callable[[Engine], Awaitable[Any]],
    *,
    wait: bool,
    queue_timeout: float,
) -> _Delivered:
    """With no live owner, open an engine here and run ``direct``; else queue ``command`` in the
    store's inbox for the owner and (``wait``) poll for its outcome, at most ``queue_timeout``s."""
    async with open_store(url, registry=_load_registry()) as opened:
        owner = await _live_owner(opened)
        if owner is None:
            try:
                async with open_engine(opened, workflows=app.workflows, activities=app.activities) as engine:
                    return _Delivered(queued=False, value=await direct(engine))
            except StoreOwned as exc:  # a worker claimed the store between the check and the open
                owner = f"pid {exc.pid} on {exc.host}"
        if not isinstance(opened, CommandInbox):
            raise UserError(
                f"the store {redact_url(url)!r} is owned by {owner} and has no command inbox; stop that process first"
            )
        command_id = await opened.enqueue_command(command)
        click.echo(f"queued for the running worker ({owner}) as command #{command_id}", err=True)
        delivered = _Delivered(queued=True, command_id=command_id, owner=owner)
        if not wait:
            return delivered
        with trio.move_on_after(queue_timeout):
            while delivered.outcome is None:
                delivered.outcome = await opened.command_outcome(command_id)
                if delivered.outcome is None:
                    await trio.sleep(_OUTCOME_POLL)
            if not delivered.outcome.ok:
                raise UserError(delivered.outcome.message)
            click.echo(f"applied by the worker: {delivered.outcome.message}", err=True)
            return delivered
        raise UserError(
            f"command #{command_id} is still queued after {queue_timeout:g}s: the worker ({owner}) has not "
            "applied it yet; it stays queued, and the store's owner (that worker, or the next engine to "
            "open the store) applies it"
        )


async def _poll_result(url: str, workflow_id: str, run_id: str) -> Any:
    """Wait for a run another process executes, reading the store until it settles."""
    async with _open_for_reading(url) as opened:
        while True:
            position = follow_chain(await opened.events.read_history(workflow_id), run_id)
            if position.state is ChainState.SETTLED:
                return settled_result(workflow_id, position).value()
            run_id = position.run_id  # the chain stands there: look on from it
            await trio.sleep(_RESULT_POLL)


@cli.command()
@_store_option
@_module_option
@click.argument("workflow_type", metavar="TYPE")
@click.argument("args_json", nargs=-1, metavar="[ARGS_JSON]...")
@click.option("--id", "workflow_id", metavar="ID", help="Workflow id (default: a new UUID).")
@click.option("--task-queue", metavar="QUEUE", help="Task queue of the run (default: the engine's).")
@click.option(
    "--id-reuse",
    type=click.Choice([p.value for p in IdReusePolicy], case_sensitive=False),
    default=IdReusePolicy.ALLOW_DUPLICATE.value,
    show_default=True,
    help="What to do when the id already exists.",
)
@click.option(
    "--wait/--no-wait",
    default=True,
    show_default=True,
    help="Wait for the result (printed as JSON) or return once the start is durable.",
)
@_request_id_option
@_queue_timeout_option
def start(
    store: str | None,
    module: str,
    workflow_type: str,
    args_json: tuple[str, ...],
    workflow_id: str | None,
    task_queue: str | None,
    id_reuse: str,
    wait: bool,
    request_id: str | None,
    queue_timeout: float,
) -> None:
    """Start a workflow of TYPE with JSON arguments, e.g. start checkout '{"id": 7}' --id order-7.

    If a worker ('aion-trio worker') owns the store, the start is queued in
    the store's command inbox and that worker applies it (the id is generated
    here when --id is not given); otherwise an engine opens here with the
    module's definitions (resuming the store's other running workflows while
    it is open). With --no-wait it returns once the start is recorded; the run
    continues in the store's owner, or in the next engine to open the store.
    """
    url = _resolve_store(store)
    args = [_json_argument(text, f"argument {i}") for i, text in enumerate(args_json, 1)]
    app = load_app(module)
    _check_type(app, workflow_type, args)
    if request_id is not None and workflow_id is None:
        raise UsageProblem("--request-id needs --id: a retry must name the same workflow")
    wid = workflow_id if workflow_id is not None else new_workflow_id()
    try:
        if task_queue is not None:
            validate_task_queue(task_queue, "--task-queue")
        command = StartCommand(
            workflow_id=wid,
            workflow_type=workflow_type,
            args=Payload.of(args),
            id_reuse=id_reuse.lower(),
            task_queue=task_queue,
            request_id=request_id,
        )
    except (TypeError, ValueError) as exc:
        raise UsageProblem(str(exc)) from None

    async def direct(engine: Engine) -> tuple[str, Any]:
        handle = await engine.start(
            workflow_type,
            *args,
            workflow_id=wid,
            task_queue=task_queue,
            id_reuse=IdReusePolicy(id_reuse.lower()),
            request_id=request_id,
        )
        verb = "started" if handle.created else "attached to existing"
        click.echo(f"{verb} workflow {handle.workflow_id!r} run {handle.run_id} ({_DIRECT})", err=True)
        return handle.run_id, (await handle.result() if wait else None)

    async def go() -> tuple[str, Any]:
        delivered = await _apply_or_queue(url, app, command, direct, wait=True, queue_timeout=queue_timeout)
        if not delivered.queued:
            run_id, result = delivered.value
            return run_id, result
        assert delivered.outcome is not None
        run_id = delivered.outcome.run_id
        assert run_id is not None
        return run_id, (await _poll_result(url, wid, run_id) if wait else None)

    run_id, result = _run(url, go)
    if wait:
        click.echo(json.dumps(result, ensure_ascii=False))
    else:
        click.echo(json.dumps({"workflow_id": wid, "run_id": run_id}))


def _wait_option(fn: F) -> F:
    return click.option(
        "--wait/--no-wait",
        default=True,
        show_default=True,
        help="When a worker owns the store: wait for it to apply the queued command (see --queue-timeout).",
    )(fn)


def _write_command(
    url: str,
    app: App,
    command: Command,
    direct: Callable[[Engine], Awaitable[str]],
    wait: bool,
    queue_timeout: float,
) -> None:
    delivered = _run(
        url, lambda: _apply_or_queue(url, app, command, direct, wait=wait, queue_timeout=queue_timeout)
    )
    if not delivered.queued:
        click.echo(f"{delivered.value} ({_DIRECT})", err=True)


@cli.command()
@_store_option
@_module_option
@click.argument("workflow_id")
@click.argument("name")
@click.argument("payload_json", required=False, metavar="[PAYLOAD_JSON]")
@_wait_option
@_request_id_option
@_queue_timeout_option
def signal(
    store: str | None,
    module: str,
    workflow_id: str,
    name: str,
    payload_json: str | None,
    wait: bool,
    request_id: str | None,
    queue_timeout: float,
) -> None:
    """Send signal NAME with a JSON payload (default null) to a running workflow.

    If a worker owns the store the signal is queued for it (and, with --wait,
    this waits for its outcome); otherwise an engine opens here and records it.
    """
    url = _resolve_store(store)
    payload = _json_argument(payload_json, "PAYLOAD_JSON") if payload_json is not None else None
    app = load_app(module)
    command = _command(
        lambda: SignalCommand(
            workflow_id=workflow_id, name=name, payload=Payload.of(payload), request_id=request_id
        )
    )

    async def direct(engine: Engine) -> str:
        await engine.signal(workflow_id, name, payload, request_id=request_id)
        return f"signal {name!r} recorded for workflow {workflow_id!r}"

    _write_command(url, app, command, direct, wait, queue_timeout)


@cli.command()
@_store_option
@_module_option
@click.argument("workflow_id")
@click.argument("name")
@click.argument("args_json", nargs=-1, metavar="[ARGS_JSON]...")
@_queue_timeout_option
def query(
    store: str | None,
    module: str,
    workflow_id: str,
    name: str,
    args_json: tuple[str, ...],
    queue_timeout: float,
) -> None:
    """Ask a running workflow's query handler NAME (with JSON arguments); prints the JSON answer.

    Read-only: nothing is recorded.  If a worker owns the store the query is
    queued for it and this waits for the answer; otherwise an engine opens here
    (replaying the run) and answers.
    """
    url = _resolve_store(store)
    args = [_json_argument(text, "ARGS_JSON") for text in args_json]
    app = load_app(module)
    command = _command(lambda: QueryCommand(workflow_id=workflow_id, name=name, args=Payload.of(args)))

    async def direct(engine: Engine) -> str:
        return json.dumps(
            await engine.query(workflow_id, name, *args), ensure_ascii=False, separators=(",", ":")
        )

    delivered = _run(
        url, lambda: _apply_or_queue(url, app, command, direct, wait=True, queue_timeout=queue_timeout)
    )
    if delivered.queued:
        assert delivered.outcome is not None
        click.echo(delivered.outcome.message)
    else:
        click.echo(delivered.value)


def _command(build: Callable[[], Command]) -> Command:
    try:
        return build()
    except (TypeError, ValueError) as exc:
        raise UsageProblem(str(exc)) from None


_REASON = click.option("--reason", default="", metavar="TEXT", help="Why (recorded in the history).")


@cli.command()
@_store_option
@_module_option
@click.argument("workflow_id")
@_REASON
@_wait_option
@_request_id_option
@_queue_timeout_option
def cancel(
    store: str | None,
    module: str,
    workflow_id: str,
    reason: str,
    wait: bool,
    request_id: str | None,
    queue_timeout: float,
) -> None:
    """Ask a running workflow to cancel: it sees WorkflowCancelled at its next await, may
    compensate, and ends Cancelled. Queued for the store's worker if one owns it."""
    url = _resolve_store(store)
    app = load_app(module)
    command = _command(lambda: CancelCommand(workflow_id=workflow_id, reason=reason, request_id=request_id))

    async def direct(engine: Engine) -> str:
        await engine.cancel(workflow_id, reason, request_id=request_id)
        return f"cancellation requested for workflow {workflow_id!r}"

    _write_command(url, app, command, direct, wait, queue_timeout)


@cli.command()
@_store_option
@_module_option
@click.argument("workflow_id")
@_REASON
@_wait_option
@_request_id_option
@_queue_timeout_option
def terminate(
    store: str | None,
    module: str,
    workflow_id: str,
    reason: str,
    wait: bool,
    request_id: str | None,
    queue_timeout: float,
) -> None:
    """End a running workflow at once, without running its code (its activities are cancelled).
    Queued for the store's worker if one owns it."""
    url = _resolve_store(store)
    app = load_app(module)
    command = _command(
        lambda: TerminateCommand(workflow_id=workflow_id, reason=reason, request_id=request_id)
    )

    async def direct(engine: Engine) -> str:
        await engine.terminate(workflow_id, reason, request_id=request_id)
        return f"workflow {workflow_id!r} terminated"

    _write_command(url, app, command, direct, wait, queue_timeout)


@cli.command()
@_store_option
@_module_option
@click.argument("workflow_id")
@_wait_option
@_request_id_option
@_queue_timeout_option
def reopen(
    store: str | None, module: str, workflow_id: str, wait: bool, request_id: str | None, queue_timeout: float
) -> None:
    """Reopen a failed or cancelled workflow run: it replays (with fixed code) and carries on.
    Queued for the store's worker if one owns it."""
    url = _resolve_store(store)
    app = load_app(module)
    command = _command(lambda: ReopenCommand(workflow_id=workflow_id, request_id=request_id))

    async def direct(engine: Engine) -> str:
        handle = await engine.reopen(workflow_id, request_id=request_id)
        return f"reopened workflow {handle.workflow_id!r} run {handle.run_id}"

    _write_command(url, app, command, direct, wait, queue_timeout)


@attrs.define
class _Lifecycle:
    """What the worker's signal watcher and drain watcher report back."""

    signals: int = 0
    signal_name: str = ""
    drain_deadline: float | None = None
    idle_at: float | None = None
    forced: bool = False


async def _watch_signals(
    receiver: Any, stop: trio.Event, hard_stop: trio.CancelScope, state: _Lifecycle
) -> None:
    async for signum in receiver:
        state.signals += 1
        if state.signals == 1:
            state.signal_name = signal_module.Signals(signum).name
            stop.set()
        else:
            worker_log.warning(
                "%s received again: stopping now; unfinished activity attempts are parked for the next engine",
                signal_module.Signals(signum).name,
            )
            state.forced = True
            hard_stop.cancel()


async def _watch_drain(engine: Engine, state: _Lifecycle) -> None:
    await engine.epoch.wait_attempts_idle()
    state.idle_at = trio.current_time()


@contextlib.asynccontextmanager
async def _until_signalled() -> AsyncIterator[tuple[_Lifecycle, trio.Event, trio.Nursery]]:
    """A worker's lifetime: ``stop`` is set by the first SIGINT/SIGTERM; a second one
    cancels the body at once.  Yields (state, stop, a nursery cancelled on the way out)."""
    state = _Lifecycle()
    stop = trio.Event()
    with trio.open_signal_receiver(signal_module.SIGINT, signal_module.SIGTERM) as receiver:
        async with trio.open_nursery() as nursery:
            hard_stop = trio.CancelScope()
            nursery.start_soon(_watch_signals, receiver, stop, hard_stop, state)
            with hard_stop:
                yield state, stop, nursery
            nursery.cancel_scope.cancel()


def _log_runs(event: ObserverEvent) -> None:
    """The worker's observer: one info line when a workflow run starts, one when it ends."""
    if isinstance(event, (WorkflowRunStarted, WorkflowRunEnded)):
        fields = {
            "workflow_id": event.workflow_id,
            "run_id": event.run_id,
            "workflow_type": event.workflow_type,
        }
        if isinstance(event, WorkflowRunStarted):
            worker_log.info("%s started", event.workflow_type, extra=fields)
        else:
            worker_log.info("%s ended %s", event.workflow_type, event.status.value, extra=fields)


async def _serve(url: str, app: App, drain_timeout: float) -> _Lifecycle:
    async with _until_signalled() as (state, stop, nursery):
        worker_log.info("opening store %s for %s (%s)", redact_url(url), app.spec, app.describe())
        async with open_engine(
            url,
            workflows=app.workflows,
            activities=app.activities,
            drain_timeout=drain_timeout,
            observers=[_log_runs],
        ) as engine:
            running = await engine.count(status=WorkflowStatus.RUNNING)
            worker_log.info(
                "ready: serving %s; %d running workflow(s) in the store; stop with SIGINT or SIGTERM",
                app.describe(),
                running,
            )
            await stop.wait()
            in_flight = engine.statistics().epoch.in_flight_attempts
            if drain_timeout:
                worker_log.info(
                    "%s received: draining %d in-flight activity attempt(s) for up to %gs "
                    "(send it again to stop at once)",
                    state.signal_name,
                    in_flight,
                    drain_timeout,
                )
                state.drain_deadline = trio.current_time() + drain_timeout
                nursery.start_soon(_watch_drain, engine, state)
            else:
                worker_log.info(
                    "%s received: stopping without a drain (%d in-flight activity attempt(s) parked)",
                    state.signal_name,
                    in_flight,
                )
    return state


async def _serve_activities(
    url: str,
    activities: Sequence[ActivityDefinition[Any]],
    queues: Sequence[str],
    concurrency: int,
    drain_timeout: float,
) -> _Lifecycle:
    async with _until_signalled() as (state, stop, _):
        worker_log.info("opening store %s for activity queue(s) %s", redact_url(url), ", ".join(queues))
        async with trio.open_nursery() as inner:
            worker_id = await inner.start(
                functools.partial(
                    run_activity_worker,
                    url,
                    activities,
                    queues,
                    concurrency=concurrency,
                    drain_timeout=drain_timeout,
                    stop=stop,
                )
            )
            worker_log.info(
                "ready: activity worker %s runs %d activity type(s) from queue(s) %s, up to %d at once; "
                "stop with SIGINT or SIGTERM",
                worker_id,
                len(activities),
                ", ".join(queues),
                concurrency,
            )
            await stop.wait()
            worker_log.info(
                "%s received: no new claims; running attempts may finish for up to %gs, then go back "
                "to their queues (send it again to stop at once)",
                state.signal_name,
                drain_timeout,
            )
    return state


def _worker_activities_only(
    url: str,
    module: str | None,
    activities_spec: str | None,
    queues: Sequence[str],
    concurrency: int,
    drain_timeout: float,
) -> None:
    if module is not None:
        raise UsageProblem(
            "--activities-only takes no MODULE:ATTR argument; name the activities with --activities MODULE:ATTR"
        )
    if activities_spec is None:
        raise UsageProblem(
            "--activities-only needs --activities MODULE:ATTR (the activities this worker runs)"
        )
    if not queues:
        raise UsageProblem("--activities-only needs at least one --queue QUEUE (the task queues to serve)")
    activities = load_activities(activities_spec)
    state = _run(url, lambda: _serve_activities(url, activities, queues, concurrency, drain_timeout))
    if state.forced:
        raise UserError("stopped by a second signal; running attempts went back to their queues")
    worker_log.info("stopped; unfinished attempts went back to their queues")


@cli.command()
@_store_option
@click.argument("module", metavar="MODULE:ATTR", required=False)
@click.option(
    "--activities-only",
    is_flag=True,
    help="Run only activities, claimed from the store's task queues (a store with task queues, "
    "e.g. postgresql://); needs --activities and --queue.",
)
@click.option(
    "--activities",
    "activities_spec",
    metavar="MODULE:ATTR",
    help="With --activities-only: where the activities are (an object or module with 'activities').",
)
@click.option(
    "--queue",
    "queues",
    multiple=True,
    metavar="QUEUE",
    help="With --activities-only: a task queue to serve (repeat for several).",
)
@click.option(
    "--concurrency",
    type=click.IntRange(min=1),
    default=10,
    show_default=True,
    help="With --activities-only: attempts run at once.",
)
@click.option(
    "--drain-timeout",
    type=click.FloatRange(min=0),
    default=DEFAULT_DRAIN_TIMEOUT,
    show_default=True,
    metavar="SECONDS",
    help="On SIGINT/SIGTERM, how long in-flight activity attempts may run on to record their outcome.",
)
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False),
    default="warning",
    show_default=True,
    help="Level of the engine's own log lines (lifecycle lines are always shown).",
)
def worker(
    store: str | None,
    module: str | None,
    activities_only: bool,
    activities_spec: str | None,
    queues: tuple[str, ...],
    concurrency: int,
    drain_timeout: float,
    log_level: str,
) -> None:
    """Serve the workflows and activities of MODULE:ATTR until SIGINT or SIGTERM.

    \b
    MODULE:ATTR names an object with a 'workflows' sequence of
    @aion_trio.workflow functions and an optional 'activities' sequence of
    @aion_trio.activity functions, e.g. in myapp/flows.py:
        app = types.SimpleNamespace(workflows=[checkout], activities=[charge])
    and run 'aion-trio worker myapp.flows:app'.  A bare MODULE uses the
    module's own lists named 'workflows' and 'activities'.  The current
    directory is on the import path.

    On open the engine resumes every running workflow in the store. On the
    first SIGINT/SIGTERM it stops admitting work and lets in-flight activity
    attempts finish for up to --drain-timeout seconds; what is still running
    then is parked and re-dispatched by the next engine. A second signal stops
    at once. Exit status 0 after a graceful stop.

    \b
    With --activities-only the process runs no engine: it claims activity
    tasks of the --queue queues from the store (one with task queues, such
    as postgresql://) and runs the activities of --activities MODULE:ATTR:
        aion-trio worker --activities-only --store postgresql://... \\
            --queue payments --activities myapp.acts:app --concurrency 20
    On SIGINT/SIGTERM it claims no more, lets running attempts finish for up
    to --drain-timeout seconds and hands the rest back to their queues.
    """
    url = _resolve_store(store)
    if not activities_only and (activities_spec is not None or queues):
        raise UsageProblem("--activities and --queue only apply with --activities-only")
    if not activities_only and module is None:
        raise UsageProblem("missing argument 'MODULE:ATTR' (or use --activities-only)")
    app = None if activities_only else load_app(module or "")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    package_log = logging.getLogger("aion_trio")
    package_log.addHandler(handler)
    package_log.setLevel(log_level.upper())
    worker_log.setLevel(logging.INFO)
    try:
        if app is None:
            _worker_activities_only(url, module, activities_spec, queues, concurrency, drain_timeout)
            return
        state = _run(url, lambda: _serve(url, app, drain_timeout))
        if state.forced:
            raise UserError("stopped by a second signal before the drain finished; unfinished work is parked")
        if (
            state.drain_deadline is not None
            and state.idle_at is not None
            and state.idle_at < state.drain_deadline
        ):
            worker_log.info("drained: every in-flight activity attempt recorded its outcome; store closed")
        elif state.drain_deadline is not None:
            worker_log.info(
                "drain timeout: unfinished activity attempts were parked (nothing recorded) and the next "
                "engine on this store re-dispatches them; store closed"
            )
        else:
            worker_log.info("stopped; store closed")
    finally:
        package_log.removeHandler(handler)


def _add_demo() -> None:
    from ._demo import demo_command

    cli.add_command(demo_command)


_add_demo()


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``aion-trio`` console script."""
    cli.main(args=list(argv) if argv is not None else None, prog_name=PROG_NAME)
