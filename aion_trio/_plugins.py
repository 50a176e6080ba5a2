"""The process-wide plugins: one manager and one store registry, and ``open_store``.

Built from the installed entry points the first time they are needed (never
at import); the hooks are specified in :mod:`aion_trio.plugin.hookspecs` and
called by the manager (:func:`aion_trio.plugin.make_plugin_manager`).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import AsyncIterator

import pluggy

from ._store import Store
from ._urls import url_scheme
from .plugin import DISABLE_ENV, StoreRegistry, build_registry, make_plugin_manager

_default_lock = threading.Lock()
_default_registry: StoreRegistry | None = None
_default_managers: dict[str, pluggy.PluginManager] = {}


def default_registry(*, reload: bool = False) -> StoreRegistry:
    """The process-wide registry, built from entry points on first use."""
    global _default_registry
    with _default_lock:
        if _default_registry is None or reload:
            # The manager observers use too: the entry points are loaded once per process
            # (loading them imports every plugin and reads every distribution's metadata).
            pm = make_plugin_manager() if reload else _manager_locked()
            _default_registry = build_registry(pm)
        return _default_registry


def default_plugin_manager() -> pluggy.PluginManager:
    """The process-wide manager of entry-point plugins (observers and the default store
    registry use it), built once per value of ``AION_TRIO_DISABLE_PLUGINS``."""
    with _default_lock:
        return _manager_locked()


def _manager_locked() -> pluggy.PluginManager:
    key = os.environ.get(DISABLE_ENV, "")
    pm = _default_managers.get(key)
    if pm is None:
        pm = _default_managers[key] = make_plugin_manager()
    return pm


@contextlib.asynccontextmanager
async def open_store(url: str, *, registry: StoreRegistry | None = None) -> AsyncIterator[Store]:
    """Open the store named by ``url`` through its plugin; closes it on exit."""
    scheme = url_scheme(url)
    entry = (registry if registry is not None else default_registry()).get(scheme)
    async with entry.opener(url) as store:
        yield store
