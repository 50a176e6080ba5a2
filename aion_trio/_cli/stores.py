"""Opening stores: the plugin registry, and read-only access for the reading commands."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from datetime import datetime, timezone

from .._codec_store import CodecStoreView
from .._codecs import CodecChain
from .._errors import PluginError, WorkflowNotFound
from .._events import Event
from .._plugins import open_store
from .._store import FlowStore, FlowWaiter, Store
from ..plugin import StoreRegistry, build_registry, make_plugin_manager
from .errors import PluginsUnavailable
from .options import configured_codecs, read_only


def load_registry() -> StoreRegistry:
    """A fresh registry from the installed entry points (a CLI run is one-shot: no cache)."""
    try:
        return build_registry(make_plugin_manager())
    except PluginError as exc:
        raise PluginsUnavailable(f"cannot load the store plugins: {exc}") from exc
    except Exception as exc:
        # Whatever a plugin raised while loading or registering, the user's fix is
        # the same: repair, uninstall or disable that plugin.
        raise PluginsUnavailable(f"cannot load the store plugins: {type(exc).__name__}: {exc}") from exc


@contextlib.asynccontextmanager
async def open_for_reading(store: str, codecs: CodecChain | None = None) -> AsyncIterator[Store]:
    """The store opened read-only; its events read through ``codecs`` (default: ``--codec``'s)."""
    registry = load_registry()
    chain = codecs if codecs is not None else configured_codecs()
    async with open_store(read_only(store), registry=registry) as opened:
        yield opened if chain is None else CodecStoreView(opened, chain)


async def read_history(opened: Store, workflow_id: str) -> list[Event]:
    events = await opened.events.read_history(workflow_id)
    if not events:
        raise WorkflowNotFound(workflow_id)
    return events


async def read_slot_waits(opened: Store, workflow_id: str) -> dict[tuple[str, int], FlowWaiter] | None:
    """The workflow's recorded waits for a flow-control slot that have not lapsed (by this
    machine's clock), by (run id, activity id); ``None``: the store records none."""
    if not isinstance(opened, FlowStore):
        return None
    waiters = await opened.flow_waiters(workflow_id, now=datetime.now(timezone.utc))
    return {(w.run_id, w.activity_id): w for w in waiters}
