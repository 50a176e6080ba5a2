"""The ``aion-trio`` command line: in-process with click's CliRunner, and the
installed console script in a real subprocess."""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import subprocess
import sysconfig
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import attrs
import pytest
from click.testing import CliRunner, Result

import aion_trio
from aion_trio import _cli
from aion_trio.plugin import Store, StoreRegistry, hookimpl


def run_cli(*args: str) -> Result:
    return CliRunner().invoke(_cli.cli, list(args), prog_name="aion-trio")


def error_lines(result: Result) -> list[str]:
    return [line for line in result.output.splitlines() if line.strip()]


# --------------------------------------------------------------------------
# Test plugins, injected as extra entry points of the real loading path
# --------------------------------------------------------------------------


@attrs.frozen
class _FakeEntryPoint:
    """Quacks like importlib.metadata.EntryPoint for the plugin loader."""

    name: str
    value: str
    load: Callable[[], object]
    dist: None = None


def _add_entry_points(monkeypatch: pytest.MonkeyPatch, *extra: _FakeEntryPoint) -> None:
    real = importlib.metadata.entry_points

    def entry_points(**kwargs: str) -> list[object]:
        found: list[object] = list(real(**kwargs))
        if kwargs.get("group") == "aion_trio":
            found.extend(extra)
        return found

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)


@contextlib.asynccontextmanager
async def _never_opened(url: str) -> AsyncIterator[Store]:  # pragma: no cover - listing opens nothing
    raise AssertionError("aion-trio stores must not open stores")
    yield


class _MarkupPlugin:
    @hookimpl
    def aion_trio_register_stores(self, registry: StoreRegistry) -> None:
        registry.add("zz-test", _never_opened, description="literal [bold]brackets[/bold] kept")


def _import_failure() -> object:
    raise ModuleNotFoundError("No module named 'aion_trio_test_missing'")


class _HookRaises:
    @hookimpl
    def aion_trio_register_stores(self, registry: StoreRegistry) -> None:
        raise RuntimeError("registration exploded")


# --------------------------------------------------------------------------
# --version, --help
# --------------------------------------------------------------------------


def test_version_prints_the_package_version() -> None:
    result = run_cli("--version")
    assert result.exit_code == 0
    assert result.output == f"aion-trio {aion_trio.__version__}\n"


@pytest.mark.parametrize("args", [("--help",), ("-h",), ("stores", "--help"), ("stores", "-h")])
def test_help_is_available_on_every_command(args: tuple[str, ...]) -> None:
    result = run_cli(*args)
    assert result.exit_code == 0
    assert result.output.startswith(f"Usage: aion-trio {'stores ' if 'stores' in args else ''}[OPTIONS]")
    assert "-h, --help" in result.output


def test_bare_invocation_shows_help_and_succeeds() -> None:
    result = run_cli()
    assert result.exit_code == 0
    assert result.output.startswith("Usage: aion-trio")
    assert "stores" in result.output


# --------------------------------------------------------------------------
# stores
# --------------------------------------------------------------------------


def test_stores_json_lists_the_registered_schemes() -> None:
    result = run_cli("stores", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    by_scheme = {entry["scheme"]: entry for entry in data}
    assert set(by_scheme) >= {"memory", "sqlite"}
    assert by_scheme["memory"]["plugin"] == "memory"
    assert by_scheme["sqlite"]["plugin"] == "sqlite"
    assert all(set(entry) == {"scheme", "plugin", "description"} for entry in data)
    assert all(entry["description"] for entry in data)
    assert [entry["scheme"] for entry in data] == sorted(by_scheme)


def test_stores_table_shows_scheme_plugin_and_description(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # rich wraps to the terminal width; keep rows on one line
    _add_entry_points(monkeypatch, _FakeEntryPoint("markup-test", "tests:_MarkupPlugin", _MarkupPlugin))
    result = run_cli("stores")
    assert result.exit_code == 0, result.output
    assert "Store schemes" in result.output
    row = next(line for line in result.output.splitlines() if "zz-test://" in line)
    assert "markup-test" in row
    # Plugin text is shown as given, never interpreted as rich markup.
    assert "literal [bold]brackets[/bold] kept" in result.output
    assert "memory://" in result.output


def test_stores_honours_the_disable_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AION_TRIO_DISABLE_PLUGINS", "memory")
    schemes = [entry["scheme"] for entry in json.loads(run_cli("stores", "--json").output)]
    assert "memory" not in schemes
    assert "sqlite" in schemes


def test_stores_with_no_plugins_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AION_TRIO_DISABLE_PLUGINS", "*")
    assert json.loads(run_cli("stores", "--json").output) == []
    result = run_cli("stores")
    assert result.exit_code == 0
    assert "No store plugins are registered" in result.output


# --------------------------------------------------------------------------
# Errors: one line, non-zero exit
# --------------------------------------------------------------------------


def test_plugin_import_failure_is_one_error_line_with_exit_2(monkeypatch: pytest.MonkeyPatch) -> None:
    _add_entry_points(monkeypatch, _FakeEntryPoint("broken", "aion_trio_test_missing", _import_failure))
    result = run_cli("stores", "--json")
    assert result.exit_code == 2
    [line] = error_lines(result)
    assert line.startswith("Error: cannot load the store plugins: ")
    assert "'broken'" in line
    assert "AION_TRIO_DISABLE_PLUGINS=broken" in line


def test_plugin_hook_raising_is_one_error_line_with_exit_2(monkeypatch: pytest.MonkeyPatch) -> None:
    _add_entry_points(monkeypatch, _FakeEntryPoint("raiser", "tests:_HookRaises", _HookRaises))
    result = run_cli("stores")
    assert result.exit_code == 2
    [line] = error_lines(result)
    assert line.startswith("Error: cannot load the store plugins: ")
    assert "'raiser'" in line
    assert "RuntimeError: registration exploded" in line


@pytest.mark.parametrize(
    ("args", "problem", "hint"),
    [
        (("bogus",), "No such command", "; see 'aion-trio --help'"),
        (("stores", "--bad"), "No such option", "; see 'aion-trio stores --help'"),
        (("stores", "extra"), "unexpected extra argument", "; see 'aion-trio stores --help'"),
    ],
)
def test_usage_errors_are_one_line_with_exit_2(args: tuple[str, ...], problem: str, hint: str) -> None:
    result = run_cli(*args)
    assert result.exit_code == 2
    [line] = error_lines(result)
    assert line.startswith("Error: ")
    assert problem in line
    assert args[-1] in line
    assert line.endswith(hint)


# --------------------------------------------------------------------------
# The installed console script, for real
# --------------------------------------------------------------------------


def _console_script() -> Path:
    script = Path(sysconfig.get_path("scripts")) / ("aion-trio.exe" if os.name == "nt" else "aion-trio")
    if not script.exists():
        pytest.fail(f"console script {script} is not installed; run: pip install -e '.[test]'")
    return script


def _run_script(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(_console_script()), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
        check=False,
    )


@pytest.mark.slow
def test_console_script_lists_stores_and_reports_a_broken_plugin(tmp_path: Path) -> None:
    done = _run_script("stores", "--json")
    assert done.returncode == 0, done.stderr
    assert {"memory", "sqlite"} <= {entry["scheme"] for entry in json.loads(done.stdout)}

    # An installed distribution whose entry point names a module that does not exist.
    dist_info = tmp_path / "aion_trio_broken_plugin-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: aion-trio-broken-plugin\nVersion: 1.0\n", encoding="utf-8"
    )
    (dist_info / "entry_points.txt").write_text(
        "[aion_trio]\nbroken = aion_trio_test_no_such_module\n", encoding="utf-8"
    )
    pythonpath = os.pathsep.join([str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])
    broken = _run_script("stores", env={"PYTHONPATH": pythonpath})
    assert broken.returncode == 2
    assert broken.stdout == ""
    [line] = broken.stderr.splitlines()
    assert line.startswith("Error: cannot load the store plugins: ")
    assert "'broken' (from aion-trio-broken-plugin 1.0" in line

    # The message's advice works.
    disabled = _run_script(
        "stores", "--json", env={"PYTHONPATH": pythonpath, "AION_TRIO_DISABLE_PLUGINS": "broken"}
    )
    assert disabled.returncode == 0, disabled.stderr
    assert "memory" in {entry["scheme"] for entry in json.loads(disabled.stdout)}


def test_main_is_the_console_entry_point(capsys: pytest.CaptureFixture[str]) -> None:
    [ep] = [ep for ep in importlib.metadata.entry_points(group="console_scripts") if ep.name == "aion-trio"]
    assert ep.value == "aion_trio._cli:main"
    with pytest.raises(SystemExit) as exc_info:
        _cli.main(["--version"])
    assert exc_info.value.code == 0
    assert capsys.readouterr().out == f"aion-trio {aion_trio.__version__}\n"
