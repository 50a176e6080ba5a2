"""The user module (``MODULE:ATTR``): importing it and reading its definitions."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence
from typing import Any

import attrs

from .._codecs import CodecChain, chain_or_none
from .._definitions import ActivityDefinition, WorkflowDefinition, index_definitions
from .._errors import InvalidArguments
from .errors import UsageProblem, UserError
from .options import configured_codecs


@attrs.frozen
class App:
    spec: str
    workflows: tuple[WorkflowDefinition[Any], ...]
    activities: tuple[ActivityDefinition[Any], ...]
    #: ``--codec``'s chain, else the app object's ``codecs`` (docs/payloads.md).
    codecs: CodecChain | None = None

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
    codecs = configured_codecs()
    if codecs is None and getattr(target, "codecs", None) is not None:
        codecs = _chain(f"{spec} .codecs", target.codecs)
    return App(
        spec=spec,
        workflows=tuple(workflow_map.values()),
        activities=tuple(activity_map.values()),
        codecs=codecs,
    )


def _chain(where: str, value: Any) -> CodecChain:
    try:
        chain = chain_or_none(value)
    except (TypeError, ValueError) as exc:
        raise UserError(f"{where}: {exc}") from exc
    if chain is None:
        raise UserError(f"{where} is empty: name a codec, a sequence of codecs or a CodecChain")
    return chain


def load_codecs(spec: str) -> CodecChain:
    """Import ``MODULE:ATTR`` naming a codec, a sequence of codecs or a :class:`CodecChain`."""
    return _chain(spec, _import_target(spec))


def check_type(app: App, workflow_type: str, args: Sequence[Any] | None = None) -> None:
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
