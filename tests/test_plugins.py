"""Store plugins: the registry, the hook, entry points and open_store."""

from __future__ import annotations

import contextlib
import importlib.metadata
import subprocess
import sys
import textwrap
import types
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from _samples import RECORDED_AT, RUN_ID

import aion_trio
import aion_trio._plugins as plugins_module
from aion_trio import (
    InvalidStoreUrl,
    Payload,
    PluginError,
    StoreSchemeConflict,
    UnknownStoreScheme,
    WorkflowStarted,
    open_store,
)
from aion_trio._events import make_batch
from aion_trio._plugins import default_registry
from aion_trio._urls import url_scheme
from aion_trio.plugin import (
    DISABLE_ENV,
    ENTRY_POINT_GROUP,
    PluginLoadError,
    StoreRegistry,
    build_registry,
    hookimpl,
    hookspec,
    make_plugin_manager,
)


def _opener(url: str) -> contextlib.AbstractAsyncContextManager[Any]:
    @contextlib.asynccontextmanager
    async def cm() -> AsyncIterator[str]:
        yield f"store for {url}"

    return cm()


def make_plugin(
    name: str, *schemes: str, register: Callable[[StoreRegistry], None] | None = None
) -> types.ModuleType:
    """A plugin module like a real one: a module with a hookimpl-marked function."""
    module = types.ModuleType(name)

    @hookimpl
    def aion_trio_register_stores(registry: StoreRegistry) -> None:
        for scheme in schemes:
            registry.add(scheme, _opener, description=f"{scheme} from {name}")
        if register is not None:
            register(registry)

    module.aion_trio_register_stores = aion_trio_register_stores  # type: ignore[attr-defined]
    return module


def registry_of(*plugins: object) -> StoreRegistry:
    return build_registry(make_plugin_manager(load_entry_points=False, plugins=plugins))


# --------------------------------------------------------------------------
# Registry and hook
# --------------------------------------------------------------------------


def test_a_manager_without_entry_points_registers_only_the_given_plugins() -> None:
    registry = registry_of(make_plugin("alpha_plugin", "alpha", "Alpha2"), make_plugin("beta_plugin", "beta"))
    assert [(s.scheme, s.plugin, s.description) for s in registry.schemes()] == [
        ("alpha", "alpha_plugin", "alpha from alpha_plugin"),
        ("alpha2", "alpha_plugin", "Alpha2 from alpha_plugin"),  # schemes are case-insensitive
        ("beta", "beta_plugin", "beta from beta_plugin"),
    ]
    assert "memory" not in registry
    assert "ALPHA" in registry
    assert 3 not in registry
    assert registry.get("Beta").opener is _opener


def test_an_empty_manager_gives_an_empty_registry() -> None:
    assert registry_of().schemes() == []


def test_two_plugins_claiming_one_scheme_is_an_error_naming_both() -> None:
    with pytest.raises(StoreSchemeConflict) as info:
        registry_of(make_plugin("first_plugin", "dup"), make_plugin("second_plugin", "DUP"))
    assert info.value.scheme == "dup"
    assert set(info.value.plugins) == {"first_plugin", "second_plugin"}
    message = str(info.value)
    assert "dup://" in message
    assert "'first_plugin'" in message
    assert "'second_plugin'" in message
    assert DISABLE_ENV in message


def test_one_plugin_claiming_a_scheme_twice_is_a_conflict_too() -> None:
    with pytest.raises(StoreSchemeConflict, match="'twice_plugin' and 'twice_plugin'"):
        registry_of(make_plugin("twice_plugin", "x", "x"))


def test_unknown_scheme_lists_known_schemes_and_the_entry_point_group() -> None:
    registry = registry_of(make_plugin("alpha_plugin", "alpha", "beta"))
    with pytest.raises(UnknownStoreScheme) as info:
        registry.get("postgresql")
    assert info.value.scheme == "postgresql"
    assert info.value.known == ("alpha", "beta")
    assert info.value.group == ENTRY_POINT_GROUP == "aion_trio"
    assert str(info.value) == (
        "no store plugin handles postgresql:// URLs (known schemes: alpha://, beta://); "
        "install a package that registers one in the 'aion_trio' entry-point group"
    )
    assert isinstance(info.value, LookupError)
    with pytest.raises(UnknownStoreScheme, match=r"known schemes: none"):
        registry_of().get("memory")


@pytest.mark.parametrize("scheme", ["", "1sql", "my store", "mem://", "a/b", "_x", "sq;l"])
def test_invalid_scheme_strings_are_refused(scheme: str) -> None:
    with pytest.raises(PluginError, match="scheme"):
        StoreRegistry().add(scheme, _opener, description="d")
    with pytest.raises(PluginError, match="scheme"):
        registry_of(make_plugin("bad_scheme_plugin", scheme))


@pytest.mark.parametrize("scheme", ["a", "sqlite", "postgresql+psycopg", "s3.v2", "x-y", "S3"])
def test_valid_scheme_strings_are_accepted(scheme: str) -> None:
    registry = StoreRegistry()
    registry.add(scheme, _opener, description="d")
    assert scheme.lower() in registry
    assert registry.get(scheme).plugin == "<direct>"


def test_non_str_scheme_and_non_callable_opener_are_refused() -> None:
    with pytest.raises(PluginError, match="must be a non-empty str"):
        StoreRegistry().add(3, _opener, description="d")  # type: ignore[arg-type]
    with pytest.raises(PluginError, match=r"plugin 'lazy_plugin': opener for lazy:// is not callable"):
        registry_of(
            make_plugin("lazy_plugin", register=lambda r: r.add("lazy", "not callable", description="d"))
        )  # type: ignore[arg-type]


def test_a_misspelled_hook_is_refused_by_check_pending() -> None:
    module = types.ModuleType("typo_plugin")

    @hookimpl
    def aion_trio_register_store(registry: StoreRegistry) -> None:  # missing the final "s"
        raise AssertionError("never called")

    module.aion_trio_register_store = aion_trio_register_store  # type: ignore[attr-defined]
    with pytest.raises(PluginLoadError) as info:
        make_plugin_manager(load_entry_points=False, plugins=[module])
    assert "'typo_plugin'" in str(info.value)
    assert "aion_trio_register_store" in str(info.value)
    assert isinstance(info.value, PluginError)


def test_a_hook_with_a_wrong_argument_name_is_a_plugin_load_error() -> None:
    module = types.ModuleType("argname_plugin")

    @hookimpl
    def aion_trio_register_stores(reg: StoreRegistry) -> None:
        raise AssertionError("never called")

    module.aion_trio_register_stores = aion_trio_register_stores  # type: ignore[attr-defined]
    with pytest.raises(PluginLoadError, match=r"plugin argname_plugin is invalid.*reg"):
        make_plugin_manager(load_entry_points=False, plugins=[module])


def test_a_hook_that_raises_is_a_plugin_load_error_naming_the_plugin() -> None:
    def explode(registry: StoreRegistry) -> None:
        raise RuntimeError("no config file")

    with pytest.raises(
        PluginLoadError, match=r"store plugin 'exploding_plugin': .*RuntimeError: no config file"
    ) as info:
        registry_of(make_plugin("exploding_plugin", register=explode))
    assert isinstance(info.value.__cause__, RuntimeError)


def test_registering_the_same_plugin_twice_is_a_plugin_load_error() -> None:
    plugin = make_plugin("once_plugin", "once")
    with pytest.raises(PluginLoadError, match="registered twice"):
        make_plugin_manager(load_entry_points=False, plugins=[plugin, plugin])


def test_the_hook_specifications_are_one_public_module() -> None:
    from aion_trio.plugin import hookspecs

    specs = sorted(name for name in vars(hookspecs) if name.startswith("aion_trio_"))
    assert specs == ["aion_trio_observe", "aion_trio_register_stores", "aion_trio_start_headers"]
    assert all(getattr(hookspecs, name).__doc__ for name in specs)
    # The manager's hooks are exactly the module's, with its markers.
    pm = make_plugin_manager(load_entry_points=False)
    assert sorted(name for name in vars(pm.hook) if not name.startswith("_")) == specs
    assert (hookimpl, hookspec) == (hookspecs.hookimpl, hookspecs.hookspec)


def test_the_registry_is_filled_through_pluggy_one_plugin_at_a_time() -> None:
    pm = make_plugin_manager(
        load_entry_points=False,
        plugins=[make_plugin("alpha_plugin", "alpha"), make_plugin("beta_plugin", "beta")],
    )
    calls: list[tuple[str, list[str | None], list[str]]] = []

    def before(name: str, impls: Any, kwargs: dict[str, Any]) -> None:
        calls.append((name, [pm.get_name(impl.plugin) for impl in impls], sorted(kwargs)))

    undo = pm.add_hookcall_monitoring(before, lambda *args: None)
    try:
        registry = build_registry(pm)
    finally:
        undo()
    # pluggy makes each call (its monitoring sees them), narrowed to one plugin so
    # what it adds is attributed to it.
    assert calls == [
        ("aion_trio_register_stores", ["alpha_plugin"], ["registry"]),
        ("aion_trio_register_stores", ["beta_plugin"], ["registry"]),
    ]
    assert [(s.scheme, s.plugin) for s in registry.schemes()] == [
        ("alpha", "alpha_plugin"),
        ("beta", "beta_plugin"),
    ]


def test_an_unhashable_plugin_object_among_several_is_a_plugin_load_error() -> None:
    class Unhashable:
        __hash__ = None  # type: ignore[assignment]

        @hookimpl
        def aion_trio_register_stores(self, registry: StoreRegistry) -> None:
            registry.add("unhashable", _opener, description="d")

    with pytest.raises(PluginLoadError, match=r"cannot be called on its own.*must be hashable"):
        registry_of(Unhashable(), make_plugin("other_plugin", "other"))
    # Alone, it needs no narrowing.
    assert "unhashable" in registry_of(Unhashable())


def test_the_hook_receives_the_registry_by_keyword() -> None:
    seen: list[StoreRegistry] = []
    registry = registry_of(make_plugin("kw_plugin", register=seen.append))
    assert seen == [registry]


# --------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------


def test_the_installed_distribution_provides_memory_and_sqlite_entry_points() -> None:
    names = {ep.name: ep.value for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
    assert names.get("memory") == "aion_trio_memory"
    assert names.get("sqlite") == "aion_trio_sqlite"


def test_entry_point_plugins_register_under_their_entry_point_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    registry = build_registry(make_plugin_manager())
    assert registry.get("memory").plugin == "memory"


def test_the_sqlite_plugin_registers_the_sqlite_scheme(monkeypatch: pytest.MonkeyPatch) -> None:
    # Written by the SQLite store's author; fails until that plugin registers.
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    registry = build_registry(make_plugin_manager())
    assert registry.get("sqlite").plugin == "sqlite"


@pytest.mark.parametrize(
    ("disabled", "memory_present"),
    [
        ("memory", False),
        (" sqlite , memory ", False),
        ("*", False),
        ("sqlite", True),
        ("", True),
        ("mem", True),
    ],
)
def test_disable_plugins_env(monkeypatch: pytest.MonkeyPatch, disabled: str, memory_present: bool) -> None:
    monkeypatch.setenv(DISABLE_ENV, disabled)
    registry = build_registry(make_plugin_manager(plugins=[make_plugin("direct_plugin", "direct")]))
    assert ("memory" in registry) is memory_present
    # Directly passed plugins are not entry points: never disabled.
    assert "direct" in registry
    if disabled == "*":
        assert [s.scheme for s in registry.schemes()] == ["direct"]


def _fake_entry_points(monkeypatch: pytest.MonkeyPatch, *eps: importlib.metadata.EntryPoint) -> None:
    def entry_points(**params: Any) -> list[importlib.metadata.EntryPoint]:
        assert params == {"group": ENTRY_POINT_GROUP}
        return list(eps)

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)


def test_a_plugin_whose_module_raises_on_import_names_the_entry_point(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "aion_trio_test_broken.py").write_text("raise RuntimeError('missing driver')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    _fake_entry_points(
        monkeypatch,
        importlib.metadata.EntryPoint(name="broken", value="aion_trio_test_broken", group=ENTRY_POINT_GROUP),
    )
    with pytest.raises(PluginLoadError) as info:
        make_plugin_manager()
    message = str(info.value)
    assert "store plugin 'broken'" in message
    assert "aion_trio_test_broken" in message
    assert "RuntimeError: missing driver" in message
    assert f"{DISABLE_ENV}=broken" in message
    assert isinstance(info.value.__cause__, RuntimeError)
    # The advice works: disabling it by name skips the import.
    monkeypatch.setenv(DISABLE_ENV, "broken")
    assert build_registry(make_plugin_manager()).schemes() == []


def test_a_missing_plugin_module_is_a_plugin_load_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    _fake_entry_points(
        monkeypatch,
        importlib.metadata.EntryPoint(
            name="ghost", value="aion_trio_no_such_module", group=ENTRY_POINT_GROUP
        ),
    )
    with pytest.raises(PluginLoadError, match=r"store plugin 'ghost'.*ModuleNotFoundError"):
        make_plugin_manager()


def test_an_entry_point_plugin_with_a_bad_hook_signature_is_a_plugin_load_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "aion_trio_test_badsig.py").write_text(
        textwrap.dedent(
            """
            from aion_trio.plugin import hookimpl

            @hookimpl
            def aion_trio_register_stores(registry, extra):
                pass
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    _fake_entry_points(
        monkeypatch,
        importlib.metadata.EntryPoint(name="badsig", value="aion_trio_test_badsig", group=ENTRY_POINT_GROUP),
    )
    with pytest.raises(PluginLoadError, match=r"(?s)store plugin 'badsig'.*is invalid.*extra"):
        make_plugin_manager()


def _run_python(
    code: str, *, cwd: Path, env_extra: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    import os

    env = {k: v for k, v in os.environ.items() if k != DISABLE_ENV}
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=60,
        check=False,
    )


def test_importing_aion_trio_loads_no_entry_points(tmp_path: Path) -> None:
    result = _run_python(
        "import aion_trio, aion_trio.plugin, aion_trio.projections, sys; "
        "print('aion_trio_memory' in sys.modules, 'aion_trio_sqlite' in sys.modules)",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False"]
    # Control: building the default registry does load them.
    result = _run_python(
        "import aion_trio._plugins as p, sys; p.default_registry(); print('aion_trio_memory' in sys.modules)",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True"]


def test_the_default_registry_and_the_observers_manager_load_the_entry_points_once(tmp_path: Path) -> None:
    # Loading them imports every plugin and reads every distribution's metadata: an
    # engine opened on a URL (the registry) with observer hooks (the manager) pays it once.
    result = _run_python(
        "import importlib.metadata as md, aion_trio._plugins as p\n"
        "real = md.entry_points\n"
        "calls = []\n"
        "def counted(**kw):\n"
        "    calls.append(kw.get('group'))\n"
        "    return real(**kw)\n"
        "md.entry_points = counted\n"
        "p.default_registry()\n"
        "p.default_plugin_manager()\n"
        "p.default_registry()\n"
        "print(calls.count('aion_trio'))",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1"]


def test_a_real_broken_distribution_is_reported_with_its_name_and_version(tmp_path: Path) -> None:
    (tmp_path / "broken_store_plugin.py").write_text("import no_such_driver_module\n")
    dist_info = tmp_path / "broken_store-1.2.3.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-store\nVersion: 1.2.3\n")
    (dist_info / "entry_points.txt").write_text("[aion_trio]\nbroken = broken_store_plugin\n")
    code = textwrap.dedent(
        """
        import sys
        sys.path.insert(0, ".")
        from aion_trio.plugin import PluginLoadError, make_plugin_manager
        try:
            make_plugin_manager()
        except PluginLoadError as exc:
            print(exc)
        else:
            print("no error")
        """
    )
    result = _run_python(code, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout.strip()
    assert out.startswith(
        "store plugin 'broken' (from broken-store 1.2.3, broken_store_plugin) failed to import"
    ), out
    assert "ModuleNotFoundError" in out
    # Control: disabled by name, the rest loads.
    result = _run_python(
        code,
        cwd=tmp_path,
        env_extra={DISABLE_ENV: "broken"},
    )
    assert result.stdout.strip() == "no error", result.stderr


# --------------------------------------------------------------------------
# The default registry and open_store
# --------------------------------------------------------------------------


@pytest.fixture
def fresh_default_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let a test rebuild the process-wide registry; the original is restored afterwards."""
    monkeypatch.setattr(plugins_module, "_default_registry", plugins_module._default_registry)
    monkeypatch.delenv(DISABLE_ENV, raising=False)


def test_default_registry_is_built_once_and_reloadable(fresh_default_registry: None) -> None:
    first = default_registry(reload=True)
    assert default_registry() is first
    assert "memory" in first
    second = default_registry(reload=True)
    assert second is not first
    assert default_registry() is second


def test_default_registry_honours_disable_at_reload(
    fresh_default_registry: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(DISABLE_ENV, "memory")
    assert "memory" not in default_registry(reload=True)


@pytest.mark.parametrize(
    ("url", "scheme"), [("memory://", "memory"), ("SQLite:///a.db", "sqlite"), ("x+y://h/p?q=1", "x+y")]
)
def test_url_scheme(url: str, scheme: str) -> None:
    assert url_scheme(url) == scheme


@pytest.mark.parametrize("url", ["nonsense", "memory:", "://x", "/tmp/store.db", "", "memory:/x"])
async def test_open_store_refuses_urls_without_a_scheme(url: str) -> None:
    with pytest.raises(InvalidStoreUrl, match="is not a store URL; expected scheme://"):
        async with open_store(url):
            pass  # pragma: no cover


async def test_open_store_refuses_a_non_str_url() -> None:
    with pytest.raises(InvalidStoreUrl, match=r"must be a str, got \w*Path"):
        async with open_store(Path("/tmp/x.db")):  # type: ignore[arg-type]
            pass  # pragma: no cover


async def test_open_store_with_an_unknown_scheme() -> None:
    with pytest.raises(
        UnknownStoreScheme, match=r"no store plugin handles nope:// URLs \(known schemes: .*memory://"
    ):
        async with open_store("nope://x"):
            pass  # pragma: no cover


async def test_open_store_uses_the_given_registry() -> None:
    registry = registry_of(make_plugin("alpha_plugin", "alpha"))
    async with open_store("alpha://here", registry=registry) as store:
        assert store == "store for alpha://here"
    with pytest.raises(UnknownStoreScheme):
        async with open_store("memory://", registry=registry):
            pass  # pragma: no cover


def _history(workflow_id: str) -> list[aion_trio.Event]:
    body = WorkflowStarted(workflow_type="wf", input=Payload.of({"n": 1}), run_id=RUN_ID)
    return make_batch(workflow_id, 1, RECORDED_AT, [body])


async def test_open_store_memory_round_trip() -> None:
    async with open_store("memory://") as store:
        await store.events.append("wf", _history("wf"), 0)
        assert await store.events.read_history("wf") == _history("wf")
        assert await store.events.list_active() == ["wf"]
    # memory:// is private: a second open sees nothing.
    async with open_store("memory://") as store:
        assert await store.events.read_history("wf") == []


async def test_named_memory_stores_persist_across_opens_until_forgotten() -> None:
    import aion_trio_memory

    name = "test-plugins-persistence"
    aion_trio_memory.forget(name)
    try:
        async with open_store(f"memory://{name}") as store:
            await store.events.append("wf", _history("wf"), 0)
        async with open_store(f"memory://{name}") as again:
            assert await again.events.read_history("wf") == _history("wf")
            # Two opens of one name at once share the data.
            async with open_store(f"memory://{name}") as concurrent:
                assert await concurrent.events.list_workflow_ids() == ["wf"]
        async with open_store("memory://other-name") as other:
            assert await other.events.list_workflow_ids() == []
        aion_trio_memory.forget(name)
        async with open_store(f"memory://{name}") as forgotten:
            assert await forgotten.events.read_history("wf") == []
    finally:
        aion_trio_memory.forget(name)
        aion_trio_memory.forget("other-name")
    aion_trio_memory.forget("never-existed")  # forgetting an unknown name is fine


async def test_a_closed_memory_store_refuses_use() -> None:
    import trio

    async with open_store("memory://") as store:
        pass
    with pytest.raises(trio.ClosedResourceError):
        await store.events.read_history("wf")
