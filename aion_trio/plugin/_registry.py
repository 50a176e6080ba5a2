"""The store registry: the URL schemes plugins registered, looked up by scheme.

It knows nothing of URLs beyond their scheme (parsing and redacting them is
:mod:`aion_trio._urls`) and nothing of how plugins are found (the manager,
:mod:`aion_trio.plugin._manager`, fills it through the hook).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractAsyncContextManager
from typing import final

import attrs

from .._errors import PluginError, StoreSchemeConflict, UnknownStoreScheme
from .._store import Store

ENTRY_POINT_GROUP = "aion_trio"
"""The entry-point group a plugin's distribution names its plugin module in."""

StoreOpener = Callable[[str], AbstractAsyncContextManager[Store]]
"""``opener(url)`` returns an async context manager yielding an opened :class:`Store`."""

DIRECT = "<direct>"
"""The plugin named for what is added outside a plugin's hook (a test's own registry)."""


@final
@attrs.frozen(kw_only=True)
class StoreScheme:
    """One registered URL scheme."""

    scheme: str
    opener: StoreOpener
    description: str
    plugin: str


def _check_scheme(scheme: object) -> str:
    if not isinstance(scheme, str) or not scheme:
        raise PluginError(f"a store scheme must be a non-empty str, got {scheme!r}")
    if not (scheme[0].isalpha() and all(c.isalnum() or c in "+-." for c in scheme)):
        raise PluginError(f"store scheme {scheme!r} is not a valid URL scheme")
    return scheme.lower()


@final
class StoreRegistry:
    """The store schemes plugins registered; can list what it holds."""

    def __init__(self, *, group: str = ENTRY_POINT_GROUP) -> None:
        self._schemes: dict[str, StoreScheme] = {}
        self._group = group
        self._current_plugin = DIRECT

    def add(self, scheme: str, opener: StoreOpener, *, description: str) -> None:
        """Register ``opener`` for ``scheme://`` URLs; called from the hook."""
        key = _check_scheme(scheme)
        if not callable(opener):
            raise PluginError(f"plugin {self._current_plugin!r}: opener for {key}:// is not callable")
        existing = self._schemes.get(key)
        if existing is not None:
            raise StoreSchemeConflict(key, existing.plugin, self._current_plugin)
        self._schemes[key] = StoreScheme(
            scheme=key, opener=opener, description=description, plugin=self._current_plugin
        )

    def get(self, scheme: str) -> StoreScheme:
        """The scheme registered as ``scheme`` (any case); else ``UnknownStoreScheme`` listing them."""
        found = self._schemes.get(scheme.lower())
        if found is None:
            raise UnknownStoreScheme(scheme, sorted(self._schemes), self._group)
        return found

    def schemes(self) -> list[StoreScheme]:
        """Every registered scheme, by name."""
        return [self._schemes[k] for k in sorted(self._schemes)]

    def __contains__(self, scheme: object) -> bool:
        return isinstance(scheme, str) and scheme.lower() in self._schemes

    @contextlib.contextmanager
    def registering_for(self, plugin: str) -> Iterator[None]:
        """Attribute what is added inside the block to ``plugin``.

        The plugin manager calls each plugin's hook inside one, so a scheme's
        :attr:`StoreScheme.plugin` and a conflict's message name the plugins.
        """
        previous, self._current_plugin = self._current_plugin, plugin
        try:
            yield
        finally:
            self._current_plugin = previous
