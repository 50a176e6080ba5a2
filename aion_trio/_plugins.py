"""Store plugins through pluggy (DESIGN §4.4).

One sync hook, ``aion_trio_register_stores(registry)``; implementations call
``registry.add(scheme, opener, description=...)`` and do no I/O.  Plugins are
found through the ``aion_trio`` entry-point group, loaded lazily (the first
time a registry is needed, never at import), and the built-in memory and
SQLite stores are found exactly the same way.

``AION_TRIO_DISABLE_PLUGINS``: a comma-separated list of entry-point names
not to load (``*`` disables every entry point).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import re
import threading
import urllib.parse
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import AbstractAsyncContextManager
from typing import Any, final

import attrs
import pluggy

from ._errors import InvalidStoreUrl, PluginError, StoreSchemeConflict, UnknownStoreScheme
from ._store import Store

PROJECT_NAME = "aion_trio"
ENTRY_POINT_GROUP = "aion_trio"
DISABLE_ENV = "AION_TRIO_DISABLE_PLUGINS"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

StoreOpener = Callable[[str], AbstractAsyncContextManager[Store]]
"""``opener(url)`` returns an async context manager yielding an opened :class:`Store`."""


class PluginLoadError(PluginError):
    """A plugin entry point could not be imported or validated."""


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
        self._current_plugin = "<direct>"

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
        found = self._schemes.get(scheme.lower())
        if found is None:
            raise UnknownStoreScheme(scheme, sorted(self._schemes), self._group)
        return found

    def schemes(self) -> list[StoreScheme]:
        return [self._schemes[k] for k in sorted(self._schemes)]

    def __contains__(self, scheme: object) -> bool:
        return isinstance(scheme, str) and scheme.lower() in self._schemes

    @contextlib.contextmanager
    def _registering_for(self, plugin: str) -> Any:
        previous, self._current_plugin = self._current_plugin, plugin
        try:
            yield
        finally:
            self._current_plugin = previous


class _Specs:
    @hookspec
    def aion_trio_register_stores(self, registry: StoreRegistry) -> None:
        """Register store URL schemes with ``registry.add(scheme, opener, description=...)``.

        Called once per registry build.  Must not do I/O: open nothing until
        the opener is called.
        """

    @hookspec
    def aion_trio_observe(self, event: Any) -> None:
        """Observe one engine event (an :class:`aion_trio.ObserverEvent` record).

        Called synchronously from the engine, never while a recorder lock is
        held and never for what replay re-reads; keep it quick and do not
        block (hand slow work to a thread or a queue).  An exception is logged
        and the engine carries on.
        """


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
    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(_Specs)
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


def build_registry(pm: pluggy.PluginManager, *, group: str = ENTRY_POINT_GROUP) -> StoreRegistry:
    """Run every plugin's ``aion_trio_register_stores`` and return the registry."""
    registry = StoreRegistry(group=group)
    hook = pm.hook.aion_trio_register_stores
    for impl in hook.get_hookimpls():
        name = pm.get_name(impl.plugin) or repr(impl.plugin)
        with registry._registering_for(name):
            kwargs = {arg: registry for arg in impl.argnames}
            try:
                impl.function(**kwargs)
            except PluginError:
                raise
            except Exception as exc:
                raise PluginLoadError(
                    f"store plugin {name!r}: aion_trio_register_stores raised "
                    f"{type(exc).__name__}: {exc}; fix or uninstall it, or set {DISABLE_ENV}={name}"
                ) from exc
    return registry


_default_lock = threading.Lock()
_default_registry: StoreRegistry | None = None
_default_managers: dict[str, pluggy.PluginManager] = {}


def default_registry(*, reload: bool = False) -> StoreRegistry:
    """The process-wide registry, built from entry points on first use."""
    global _default_registry
    with _default_lock:
        if _default_registry is None or reload:
            _default_registry = build_registry(make_plugin_manager())
        return _default_registry


def default_plugin_manager() -> pluggy.PluginManager:
    """The process-wide manager of entry-point plugins (observers use it), built once per
    value of ``AION_TRIO_DISABLE_PLUGINS``."""
    key = os.environ.get(DISABLE_ENV, "")
    with _default_lock:
        pm = _default_managers.get(key)
        if pm is None:
            pm = _default_managers[key] = make_plugin_manager()
        return pm


#: Query options whose value is a credential (libpq's ``password``, ``sslpassword``, ...).
_SECRET_OPTION = re.compile(r"(?i)(pass|secret|token|key)")


def redact_url(url: object) -> str:
    """``url`` with its credentials replaced by ``***``, for every message and log line.

    The password of ``scheme://user:password@host/...`` and the value of any
    query option whose name mentions a password, secret, token or key
    (``?password=...``, ``sslpassword=...``) are hidden; the rest is kept, so
    the message still says which store.  The one redaction used by the core,
    the CLI and the store plugins.
    """
    if not isinstance(url, str):
        return repr(url)
    scheme, sep, rest = url.partition("://")
    if not sep:  # no scheme (a mistyped URL): the same rules over the whole text
        scheme, rest = "", url
    rest, hash_, fragment = rest.partition("#")
    rest, question, query = rest.partition("?")
    netloc, slash, path = rest.partition("/")
    userinfo, at, hostport = netloc.rpartition("@")
    if at and ":" in userinfo:
        userinfo = userinfo.split(":", 1)[0] + ":***"
    if query:
        pairs = []
        for pair in query.split("&"):
            name, equals, _ = pair.partition("=")
            secret = equals and _SECRET_OPTION.search(urllib.parse.unquote_plus(name))
            pairs.append(f"{name}=***" if secret else pair)
        query = "&".join(pairs)
    return f"{scheme}{sep}{userinfo}{at}{hostport}{slash}{path}{question}{query}{hash_}{fragment}"


def url_scheme(url: str) -> str:
    if not isinstance(url, str):
        raise InvalidStoreUrl(f"a store URL must be a str, got {type(url).__name__}")
    scheme, sep, _rest = url.partition("://")
    if not sep or not scheme:
        raise InvalidStoreUrl(
            f"{redact_url(url)!r} is not a store URL; expected scheme://..., e.g. sqlite:///path/to/file.db "
            "or memory://"
        )
    return scheme.lower()


@contextlib.asynccontextmanager
async def open_store(url: str, *, registry: StoreRegistry | None = None) -> AsyncIterator[Store]:
    """Open the store named by ``url`` through its plugin; closes it on exit."""
    scheme = url_scheme(url)
    entry = (registry if registry is not None else default_registry()).get(scheme)
    async with entry.opener(url) as store:
        yield store
