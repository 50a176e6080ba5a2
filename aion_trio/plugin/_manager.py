"""The plugin manager: entry points loaded into pluggy, hooks called through it.

Plugins are found through the ``aion_trio`` entry-point group, loaded when a
manager is made (never at import), and the built-in memory and SQLite stores
are found exactly the same way.  ``AION_TRIO_DISABLE_PLUGINS`` is a
comma-separated list of entry-point names not to load (``*``: none at all).
The hooks themselves are specified in :mod:`aion_trio.plugin.hookspecs`.
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Iterable

import pluggy

from .._errors import PluginError
from . import hookspecs
from ._registry import ENTRY_POINT_GROUP, StoreRegistry

DISABLE_ENV = "AION_TRIO_DISABLE_PLUGINS"
"""The environment variable listing entry points not to load, comma-separated (``=prometheus,acme``)."""


class PluginLoadError(PluginError):
    """A plugin entry point could not be imported or validated."""


def _disabled_names() -> set[str]:
    raw = os.environ.get(DISABLE_ENV, "")
    return {part.strip() for part in raw.split(",") if part.strip()}


def make_plugin_manager(
    *, load_entry_points: bool = True, plugins: Iterable[object] = (), group: str = ENTRY_POINT_GROUP
) -> pluggy.PluginManager:
    """A plugin manager with aion_trio's hookspecs.

    ``plugins`` are registered directly (tests use this with
    ``load_entry_points=False`` to build a manager without entry points).
    """
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    for plugin in plugins:
        _register(pm, plugin, None, f"plugin {_describe(plugin)}")
    if load_entry_points:
        _load_entry_points(pm, group)
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        name = pm.get_name(exc.plugin) or _describe(exc.plugin)
        raise PluginLoadError(
            f"plugin {name!r} is invalid: {exc} (hook implementations must be named after an "
            "aion_trio hookspec, e.g. aion_trio_register_stores)"
        ) from exc
    return pm


def _describe(plugin: object) -> str:
    return getattr(plugin, "__name__", None) or repr(plugin)


def _register(pm: pluggy.PluginManager, plugin: object, name: str | None, what: str) -> None:
    """``pm.register`` with pluggy's validation errors as :class:`PluginLoadError`."""
    try:
        pm.register(plugin, name=name)
    except pluggy.PluginValidationError as exc:
        raise PluginLoadError(f"{what} is invalid: {exc}") from exc
    except ValueError as exc:
        raise PluginLoadError(f"{what} is registered twice: {exc}") from exc


def _load_entry_points(pm: pluggy.PluginManager, group: str) -> None:
    disabled = _disabled_names()
    if "*" in disabled:
        return
    for ep in importlib.metadata.entry_points(group=group):
        if ep.name in disabled or pm.is_blocked(ep.name) or pm.get_plugin(ep.name) is not None:
            continue
        dist = getattr(ep, "dist", None)
        origin = f"{dist.name} {dist.version}" if dist is not None else "unknown distribution"
        try:
            plugin = ep.load()
        except Exception as exc:
            raise PluginLoadError(
                f"store plugin {ep.name!r} (from {origin}, {ep.value}) failed to import: "
                f"{type(exc).__name__}: {exc}; fix or uninstall it, or set {DISABLE_ENV}={ep.name}"
            ) from exc
        _register(pm, plugin, ep.name, f"store plugin {ep.name!r} (from {origin}, {ep.value})")


def hook_per_plugin(pm: pluggy.PluginManager, name: str) -> list[tuple[str, pluggy.HookCaller]]:
    """``pm.hook.<name>`` narrowed to each plugin implementing it, in registration order.

    pluggy still makes every call (argument checks, ordering, wrappers,
    monitoring); the narrowing only says whose implementation is running, so
    what it registers or raises is attributed to that plugin.  With a single
    plugin the caller is ``pm.hook.<name>`` itself.
    """
    hook: pluggy.HookCaller = getattr(pm.hook, name)
    implementers = [impl.plugin for impl in hook.get_hookimpls()]
    callers = []
    for plugin in implementers:
        plugin_name = pm.get_name(plugin) or _describe(plugin)
        others = [p for p in implementers if p is not plugin]
        try:
            caller = pm.subset_hook_caller(name, remove_plugins=others) if others else hook
        except TypeError as exc:  # pluggy keeps the plugins to leave out in a set
            raise PluginLoadError(
                f"plugin {plugin_name!r} cannot be called on its own: {exc}; a plugin object implementing "
                f"{name} must be hashable (a module, a class, or an instance compared by identity)"
            ) from exc
        callers.append((plugin_name, caller))
    return callers


def build_registry(pm: pluggy.PluginManager, *, group: str = ENTRY_POINT_GROUP) -> StoreRegistry:
    """Call every plugin's ``aion_trio_register_stores`` and return the registry."""
    registry = StoreRegistry(group=group)
    for name, register_stores in hook_per_plugin(pm, "aion_trio_register_stores"):
        with registry.registering_for(name):
            try:
                register_stores(registry=registry)
            except PluginError:
                raise
            except Exception as exc:
                raise PluginLoadError(
                    f"store plugin {name!r}: aion_trio_register_stores raised "
                    f"{type(exc).__name__}: {exc}; fix or uninstall it, or set {DISABLE_ENV}={name}"
                ) from exc
    return registry
