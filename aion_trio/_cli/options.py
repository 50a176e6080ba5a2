"""Options and arguments shared by the commands: the store, the user module, JSON
arguments, times and search-attribute filters."""

from __future__ import annotations

import json
import math
import os
import urllib.parse
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any, TypeVar

import click

from .._codecs import CodecChain
from .._errors import InvalidQuery
from .._events import WorkflowStatus
from .._store import SearchOp, SearchPredicate, VisibilityFilter

STORE_ENV = "AION_TRIO_STORE"
MODULE_ENV = "AION_TRIO_MODULE"
CODEC_ENV = "AION_TRIO_CODEC"
#: Where the group's ``--codec`` chain is kept for the commands (``click.Context.meta``).
CODECS_META = "aion_trio.codecs"
DEFAULT_STORE = "sqlite:///aion.db"
DEFAULT_LIST_LIMIT = 100


def store_url(value: str) -> str:
    """A store URL, or a plain path taken as a SQLite file."""
    value = value.strip()
    if not value:
        raise click.BadParameter("the store is empty; give a URL such as sqlite:///aion.db, or a path")
    if "://" in value:
        return value
    path = os.path.abspath(os.path.expanduser(value))
    return "sqlite:///" + urllib.parse.quote(path, safe="/")


def read_only(url: str) -> str:
    """For a ``sqlite://`` URL, the same URL with ``mode=ro`` (unless it names a mode)."""
    scheme, _, rest = url.partition("://")
    if scheme.lower() != "sqlite":
        return url
    _, _, query = rest.partition("?")
    if any(name == "mode" for name, _ in urllib.parse.parse_qsl(query, keep_blank_values=True)):
        return url
    return url + ("&" if query else "?") + "mode=ro"


F = TypeVar("F", bound=Callable[..., Any])


def configured_codecs() -> CodecChain | None:
    """The codec chain ``aion-trio --codec MODULE:ATTR`` loaded, if any (docs/payloads.md)."""
    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return None
    chain = ctx.meta.get(CODECS_META)
    return chain if isinstance(chain, CodecChain) else None


def store_option(fn: F) -> F:
    return click.option(
        "--store",
        "store",
        metavar="URL",
        help=f"Store URL, or a path to a SQLite file (default: 'aion-trio --store', then ${STORE_ENV}, "
        f"then {DEFAULT_STORE}).",
    )(fn)


def resolve_store(store: str | None) -> str:
    """The command's --store, else the group's (which falls back to $AION_TRIO_STORE, then the default)."""
    if store is None:
        # An empty group --store is refused like an empty command one, never taken as the default.
        store = click.get_current_context().find_root().params.get("store")
        if store is None:
            store = DEFAULT_STORE
    return store_url(store)


def module_option(fn: F) -> F:
    return click.option(
        "--module",
        "-m",
        "module",
        envvar=MODULE_ENV,
        required=True,
        metavar="MODULE:ATTR",
        help=f"Where the workflows and activities are (env: {MODULE_ENV}); see 'aion-trio worker --help'.",
    )(fn)


def json_argument(text: str, what: str) -> Any:
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except ValueError as exc:
        raise click.BadParameter(
            f"{what} is not valid JSON ({exc}): {text!r}; quote strings, e.g. '\"text\"'"
        ) from None


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_time(value: str | None, option: str) -> datetime | None:
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


def parse_attr(text: str) -> SearchPredicate:
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


_STATUS_CHOICES = [s.value for s in WorkflowStatus]

# The visibility filter's options, in the order help shows them (``list``, ``replay --store``).
_FILTER_OPTIONS = (
    click.option(
        "--status",
        "statuses",
        multiple=True,
        type=click.Choice(_STATUS_CHOICES, case_sensitive=False),
        help="Only workflows in this status (repeatable: any of them).",
    ),
    click.option("--type", "workflow_type", metavar="TYPE", help="Only workflows of this type."),
    click.option("--task-queue", metavar="QUEUE", help="Only workflows on this task queue."),
    click.option(
        "--started-after", metavar="TIME", help="Started at or after TIME (ISO-8601; UTC if no offset)."
    ),
    click.option("--started-before", metavar="TIME", help="Started at or before TIME."),
    click.option("--closed-after", metavar="TIME", help="Closed at or after TIME (excludes open workflows)."),
    click.option(
        "--closed-before", metavar="TIME", help="Closed at or before TIME (excludes open workflows)."
    ),
    click.option(
        "--attr",
        "attrs_",
        multiple=True,
        metavar="KEY=VALUE",
        help="Search attribute filter (repeatable, all must hold): KEY=VALUE equals, KEY>VALUE, KEY<VALUE, "
        "KEY~TEXT contains. VALUE is JSON when it parses (3, 2.5, true, '\"007\"'), else a string.",
    ),
    click.option(
        "--limit",
        type=click.IntRange(min=0),
        default=DEFAULT_LIST_LIMIT,
        show_default=True,
        help="At most this many rows.",
    ),
    click.option(
        "--offset", type=click.IntRange(min=0), default=0, show_default=True, help="Skip this many rows."
    ),
)


def filter_options(fn: F) -> F:
    """The options of a visibility filter; :func:`visibility_filter` builds it from their values."""
    for option in reversed(_FILTER_OPTIONS):
        fn = option(fn)
    return fn


def visibility_filter(
    *,
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
) -> VisibilityFilter:
    """The newest-first filter the :func:`filter_options` values describe (raises ``InvalidQuery``)."""
    criteria: dict[str, Any] = {
        "workflow_type": workflow_type,
        "task_queue": task_queue,
        "status": frozenset(WorkflowStatus(s.lower()) for s in statuses) if statuses else None,
        "started_after": parse_time(started_after, "--started-after"),
        "started_before": parse_time(started_before, "--started-before"),
        "closed_after": parse_time(closed_after, "--closed-after"),
        "closed_before": parse_time(closed_before, "--closed-before"),
        "search": tuple(parse_attr(a) for a in attrs_),
    }
    return VisibilityFilter(**criteria, limit=limit, offset=offset, newest_first=True)
