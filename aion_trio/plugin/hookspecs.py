"""The hooks aion_trio calls on its plugins: the one place a plugin author reads.

A plugin is a module (or object) named in the ``aion_trio`` entry-point group
of its distribution; aion_trio imports it the first time it needs a store or an
observer, never at import.  Implement a hook by defining a function with the
hook's name and arguments, marked with :data:`hookimpl`::

    from aion_trio.plugin import StoreRegistry, hookimpl

    @hookimpl
    def aion_trio_register_stores(registry: StoreRegistry) -> None:
        registry.add("acme", open_acme_store, description="Acme's store (acme://)")

Every hook is synchronous, called with keyword arguments, and may take fewer
arguments than its specification.  ``docs/writing-a-store-plugin.md`` is the
walk-through.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pluggy

from ._registry import StoreRegistry

PROJECT_NAME = "aion_trio"
"""pluggy's project name: markers of another project are not aion_trio hooks."""

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
"""Marks a hook specification (the functions of this module)."""
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
"""Mark a plugin's function as the implementation of the hook it is named after."""


@hookspec
def aion_trio_register_stores(registry: StoreRegistry) -> None:
    """Register store URL schemes with ``registry.add(scheme, opener, description=...)``.

    Called once each time a registry is built (the first ``open_store`` of a
    process, each ``aion-trio`` command).  Must not do I/O: open nothing until
    the opener is called.  Two plugins adding one scheme is an error naming
    both (:class:`~aion_trio.StoreSchemeConflict`); an exception raised here is
    reported naming the plugin, with how to disable it.
    """


@hookspec
def aion_trio_observe(event: Any) -> None:
    """Observe one engine event (an :class:`aion_trio.ObserverEvent` record).

    Called synchronously from the engine, never while a recorder lock is
    held and never for what replay re-reads; keep it quick and do not
    block (hand slow work to a thread or a queue).  An exception is logged
    and the engine carries on.
    """


@hookspec
def aion_trio_start_headers(start: Any) -> Mapping[str, str] | None:
    """Add headers to a run about to start (``start`` is an :class:`aion_trio.RunStart`).

    Called synchronously, before the run's ``WorkflowStarted`` is built, in the
    starter's task: for a client's ``engine.start`` that is the caller's task, so
    context variables (a trace's current span) are visible.  Return a mapping of
    ``str`` to ``str`` to record on top of ``start.headers``, or ``None``.  The run
    carries them in its history (``WorkflowStarted.headers``, shown to observers) for
    as long as it lives, across restarts.  Keep it quick; an exception, or a return
    value that is not valid headers, is logged and the start goes on without it.
    """
