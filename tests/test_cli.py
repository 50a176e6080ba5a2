"""The ``aion-trio`` command line: in-process with click's CliRunner, and the
installed console script in a real subprocess."""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import json
import os
import select
import signal
import sqlite3
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import AsyncIterator, Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from _clirunner import cli_runner
from click.testing import Result
from procs.relay_app import relay

import aion_trio
from aion_trio import _cli
from aion_trio._wire import event_from_json, event_to_json
from aion_trio.plugin import Store, StoreRegistry, hookimpl


def run_cli(*args: str) -> Result:
    return cli_runner().invoke(_cli.cli, list(args), prog_name="aion-trio")


def everything(result: Result) -> str:
    """stdout then stderr (click 8.1 and 8.2+ differ in what ``output`` holds)."""
    return result.stdout + result.stderr


def error_lines(result: Result) -> list[str]:
    return [line for line in everything(result).splitlines() if line.strip()]


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


COMMANDS = ("stores", "list", "show", "history", "replay", "start", "signal", "worker")


@pytest.mark.parametrize(
    "args", [("--help",), ("-h",), *((c, h) for c in COMMANDS for h in ("--help", "-h"))]
)
def test_help_is_available_on_every_command(args: tuple[str, ...]) -> None:
    result = run_cli(*args)
    assert result.exit_code == 0
    command = f"{args[0]} " if len(args) == 2 else ""
    assert result.output.startswith(f"Usage: aion-trio {command}[OPTIONS]")
    assert "-h, --help" in result.output


def test_bare_help_lists_every_command_and_the_store_default() -> None:
    result = run_cli("--help")
    for command in COMMANDS:
        assert f"  {command} " in result.output
    assert "sqlite:///aion.db" in result.output
    assert "AION_TRIO_STORE" in result.output


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


# --------------------------------------------------------------------------
# A seeded store: real workflows recorded by a real engine on a SQLite file
# --------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent
APP = "tests.procs.cli_app:app"
T0 = datetime(2031, 3, 4, 10, 0, 0, tzinfo=timezone.utc)
HOUR = timedelta(hours=1)


def _in_root(monkeypatch: pytest.MonkeyPatch) -> None:
    # The CLI imports MODULE from the current directory, as a user's shell would.
    monkeypatch.chdir(ROOT)


async def _wait_for(
    engine: aion_trio.Engine, workflow_id: str, event_type: type[aion_trio.EventBody]
) -> None:
    while not any(isinstance(e.body, event_type) for e in await engine.history(workflow_id)):
        await trio.testing.wait_all_tasks_blocked()


async def _seed(db: Path, gate: Path) -> None:
    """Five workflows at exactly known times (a mock clock that only moves when jumped):

    h-1 completed (T0), f-1 failed (T0+1h), a-1 waiting for a signal, n-1 sleeping an hour
    and g-1 with an activity attempt in flight (all three started at T0+2h).  A second engine
    that does not register ``napper`` then marks n-1 stuck.
    """
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(ROOT)  # tests.procs is importable from the project root (not installed)
        mp.setattr(sys, "path", list(sys.path))
        cli_app = _cli.load_app("tests.procs.cli_app")

    url = f"sqlite:///{db}"
    # The mock clock moves only when jumped: g-1's attempt is recorded at dispatch
    # (no schedule window), so that it shows as in flight without moving time.
    config = aion_trio.EngineConfig(clock=TrioClockAtT0(), activity_schedule_window=None)
    async with aion_trio.open_engine(
        url, workflows=cli_app.workflows, activities=cli_app.activities, config=config
    ) as engine:
        mock = trio.lowlevel.current_clock()
        assert isinstance(mock, trio.testing.MockClock)
        h = await engine.start(
            "hello", "ann", workflow_id="h-1", search_attributes={"region": "eu", "amount": 100}
        )
        assert await h.result() == "hello ann"
        mock.jump(3600)
        f = await engine.start(
            "fails", "card declined", workflow_id="f-1", search_attributes={"region": "us", "amount": 900}
        )
        with pytest.raises(aion_trio.WorkflowFailure):
            await f.result()
        mock.jump(3600)
        await engine.start(
            "approval",
            7,
            workflow_id="a-1",
            search_attributes={"region": "eu", "amount": 250, "tags": ["vip", "new"]},
        )
        await engine.start("napper", workflow_id="n-1")
        await engine.start("gated", str(gate), workflow_id="g-1")
        await _wait_for(engine, "a-1", aion_trio.WorkflowStarted)
        await _wait_for(engine, "n-1", aion_trio.TimerStarted)
        await _wait_for(engine, "g-1", aion_trio.ActivityStarted)
    without_napper = [w for w in cli_app.workflows if w.name != "napper"]
    async with aion_trio.open_engine(
        url, workflows=without_napper, activities=cli_app.activities, config=config
    ):
        pass


class TrioClockAtT0:
    """Durable time = T0 + Trio (mock) time since the first use: start times are known exactly."""

    def __init__(self) -> None:
        self._clock: Any = None

    def _inner(self) -> Any:
        if self._clock is None:
            from aion_trio._clock import TrioClock

            self._clock = TrioClock.start(wall=T0)
        return self._clock

    def now(self) -> datetime:
        now: datetime = self._inner().now()
        return now

    def trio_deadline(self, when: datetime) -> float:
        deadline: float = self._inner().trio_deadline(when)
        return deadline


@pytest.fixture(scope="module")
def seeded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("seeded")
    db = directory / "seeded.db"
    trio.run(_seed, db, directory / "gate", clock=trio.testing.MockClock())
    return db


def _json_list(db: Path, *args: str) -> list[dict[str, Any]]:
    result = run_cli("list", "--store", str(db), "--json", *args)
    assert result.exit_code == 0, result.output
    rows: list[dict[str, Any]] = json.loads(result.output)
    return rows


def _ids(db: Path, *args: str) -> list[str]:
    return [row["workflow_id"] for row in _json_list(db, *args)]


# --------------------------------------------------------------------------
# list
# --------------------------------------------------------------------------


def test_list_json_is_newest_first_with_every_field(seeded: Path) -> None:
    rows = _json_list(seeded)
    assert [r["workflow_id"] for r in rows] == ["a-1", "g-1", "n-1", "f-1", "h-1"]
    by_id = {r["workflow_id"]: r for r in rows}
    assert by_id["h-1"] == {
        "workflow_id": "h-1",
        "run_id": by_id["h-1"]["run_id"],
        "workflow_type": "hello",
        "status": "completed",
        "start_time": "2031-03-04T10:00:00+00:00",
        "close_time": by_id["h-1"]["close_time"],
        "task_queue": "default",
        "failed_step": None,
        "failure_reason": None,
        "stuck_reason": None,
        "search_attributes": {"region": "eu", "amount": 100},
    }
    assert by_id["h-1"]["close_time"].startswith("2031-03-04T10:00:")
    assert by_id["f-1"]["status"] == "failed"
    assert by_id["f-1"]["failed_step"] == "activity:0 explode"
    assert "TerminalError: card declined" in by_id["f-1"]["failure_reason"]
    assert by_id["a-1"]["search_attributes"]["tags"] == ["vip", "new"]
    assert by_id["n-1"]["stuck_reason"].startswith("workflow type 'napper' is not registered")


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("--status", "running"), ["a-1", "g-1", "n-1"]),
        (("--status", "FAILED", "--status", "completed"), ["f-1", "h-1"]),
        (("--type", "hello"), ["h-1"]),
        (("--started-after", "2031-03-04T10:30"), ["a-1", "g-1", "n-1", "f-1"]),
        (("--started-before", "2031-03-04T11:30:00Z"), ["f-1", "h-1"]),
        (("--started-after", "2031-03-04T10:30+01:00"), ["a-1", "g-1", "n-1", "f-1", "h-1"]),
        (("--closed-after", "2031-03-04T10:30"), ["f-1"]),
        (("--closed-before", "2031-03-04T10:30"), ["h-1"]),
        (("--attr", "region=eu"), ["a-1", "h-1"]),
        (("--attr", "amount>200"), ["a-1", "f-1"]),
        (("--attr", "amount<250"), ["h-1"]),
        (("--attr", "amount=250"), ["a-1"]),
        (("--attr", 'amount="250"'), []),
        (("--attr", "tags~vip"), ["a-1"]),
        (("--attr", "region~s"), ["f-1"]),
        (("--attr", "region=eu", "--attr", "amount>150"), ["a-1"]),
        (("--status", "running", "--limit", "1", "--offset", "1"), ["g-1"]),
        (("--limit", "0"), []),
    ],
)
def test_list_filters(seeded: Path, args: tuple[str, ...], expected: list[str]) -> None:
    assert _ids(seeded, *args) == expected


def test_list_table_shows_status_notes_and_the_count(seeded: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "250")
    result = run_cli("list", "--store", str(seeded), "--limit", "4")
    assert result.exit_code == 0, result.output
    rows = {line.split()[1]: line for line in result.output.splitlines() if "-1 " in line}
    assert set(rows) == {"a-1", "g-1", "n-1", "f-1"}
    assert "failed" in rows["f-1"]
    assert "activity:0 explode: ActivityFailure" in rows["f-1"]
    assert "stuck: workflow type 'napper' is not registered" in rows["n-1"]
    assert "2031-03-04 12:00:00Z" in rows["a-1"]
    assert "1-4 of 5 matching workflows" in result.output


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (("--attr", "region"), "'region' is not KEY=VALUE, KEY>VALUE, KEY<VALUE or KEY~TEXT"),
        (("--attr", "=eu"), "'=eu' is not KEY=VALUE"),
        (("--attr", "amount>true"), "greater needs a number or a string"),
        (("--started-after", "yesterday"), "'yesterday' is not an ISO-8601 time"),
        (("--status", "sleeping"), "'sleeping' is not one of"),
        (("--limit", "-1"), "-1 is not in the range x>=0"),
    ],
)
def test_list_bad_filters_are_one_line_usage_errors(
    seeded: Path, args: tuple[str, ...], problem: str
) -> None:
    result = run_cli("list", "--store", str(seeded), *args)
    assert result.exit_code == 2
    [line] = error_lines(result)
    assert line.startswith("Error: ")
    assert problem in line


# --------------------------------------------------------------------------
# show and history
# --------------------------------------------------------------------------


def _show(db: Path, workflow_id: str, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("COLUMNS", "250")
    result = run_cli("show", workflow_id, "--store", str(db))
    assert result.exit_code == 0, result.output
    return result.output


def _field(output: str, name: str) -> str:
    line = next(line for line in output.splitlines() if line.startswith(name + " "))
    return line[len(name) :].strip()


def test_show_a_failed_workflow(seeded: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = _show(seeded, "f-1", monkeypatch)
    assert _field(out, "Workflow") == "f-1"
    assert _field(out, "Type") == "fails"
    assert _field(out, "Status") == "failed"
    assert _field(out, "Started") == "2031-03-04 11:00:00.000Z"
    assert _field(out, "Closed").startswith("2031-03-04 11:00:")
    assert _field(out, "Task queue") == "default"
    assert _field(out, "Failure") == "ActivityFailure"
    assert "TerminalError: card declined" in _field(out, "Message")
    assert _field(out, "Failed step") == "activity:0 explode"
    assert "Pending activities" not in out
    history = [line.split("│")[1:4] for line in out.splitlines() if line.count("│") == 5]
    assert [(seq.strip(), kind.strip()) for seq, _, kind in history] == [
        ("1", "WorkflowStarted"),
        ("2", "ActivityScheduled"),
        ("3", "ActivityStarted"),
        ("4", "ActivityFailed"),
        ("5", "WorkflowFailed"),
    ]
    assert 'activity:0 explode(["card declined"])' in out
    assert "activity:0 attempt 1 terminal, final: TerminalError: card declined" in out


def test_show_a_completed_workflow_has_its_result(seeded: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = _show(seeded, "h-1", monkeypatch)
    assert _field(out, "Status") == "completed"
    assert _field(out, "Result") == '"hello ann"'
    assert _field(out, "Search attributes") == '{"region":"eu","amount":100}'
    assert "Failure" not in out
    assert "Residency" not in out, "a closed run has none"


def test_show_pending_activity(seeded: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = _show(seeded, "g-1", monkeypatch)
    assert _field(out, "Status") == "running"
    assert "Pending activities" in out
    row = next(line for line in out.splitlines() if "activity:0" in line and "gate " in line)
    cells = [c.strip() for c in row.split("│")[1:-1]]
    assert cells[:3] == ["activity:0", "gate", "1"]
    assert cells[3].startswith("2031-03-04 12:00:")
    assert cells[4] == "default"
    assert "Stuck" not in out
    # The store does not record residency: show says so instead of guessing.
    assert _field(out, "Residency").startswith("not known from the store")


def test_show_pending_timer_and_stuck_reason(seeded: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = _show(seeded, "n-1", monkeypatch)
    assert _field(out, "Stuck").startswith("workflow type 'napper' is not registered with this engine")
    assert "Pending timers" in out
    row = next(line for line in out.splitlines() if "anonymous:0" in line and "TimerStarted" not in line)
    assert "2031-03-04 13:00:00.0" in row


def test_history_json_lines_are_the_wire_form_of_the_stored_events(seeded: Path) -> None:
    result = run_cli("history", "f-1", "--store", str(seeded), "--json")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()

    async def stored() -> list[aion_trio.Event]:
        async with aion_trio.open_store(f"sqlite:///{seeded}?mode=ro") as store:
            return await store.events.read_history("f-1")

    events = trio.run(stored)
    assert [event_from_json(line) for line in lines] == events
    assert lines == [event_to_json(e) for e in events]
    assert json.loads(lines[0])["type"] == "WorkflowStarted"


def test_history_table(seeded: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "250")
    result = run_cli("history", "a-1", "--store", str(seeded))
    assert result.exit_code == 0, result.output
    assert "History of a-1" in result.output
    [row] = [line for line in result.output.splitlines() if "WorkflowStarted" in line]
    assert "2031-03-04 12:00:00.000Z" in row
    assert "approval([7]) run " in row


@pytest.mark.parametrize("command", ["show", "history"])
def test_unknown_workflow_is_one_line(seeded: Path, command: str) -> None:
    result = run_cli(command, "no-such", "--store", str(seeded))
    assert result.exit_code == 1
    [line] = error_lines(result)
    assert line.startswith("Error: workflow 'no-such' does not exist in this store")
    assert "'aion-trio list' shows the workflows it holds" in line


# --------------------------------------------------------------------------
# The store option and store errors
# --------------------------------------------------------------------------


@pytest.mark.parametrize("args", [("list",), ("show", "x"), ("history", "x", "--json")])
def test_read_only_commands_never_create_a_database(tmp_path: Path, args: tuple[str, ...]) -> None:
    missing = tmp_path / "typo.db"
    result = run_cli(*args, "--store", str(missing))
    assert result.exit_code == 1
    [line] = error_lines(result)
    assert line.startswith(f"Error: cannot open the store 'sqlite:///{missing}'")
    assert "no database file here" in line
    assert list(tmp_path.iterdir()) == []


def test_store_defaults_to_aion_db_in_the_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("AION_TRIO_STORE", raising=False)
    result = run_cli("list")
    assert result.exit_code == 1
    assert f"{tmp_path}/aion.db: no database file here" in everything(result)


def test_store_comes_from_the_option_then_the_group_then_the_environment(
    seeded: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AION_TRIO_STORE", str(seeded))
    assert len(json.loads(run_cli("list", "--json").output)) == 5
    url = f"sqlite:///{seeded}"
    assert len(json.loads(run_cli("--store", url, "list", "--json").output)) == 5
    elsewhere = tmp_path / "other.db"
    for args in (("--store", str(elsewhere), "list"), ("list", "--store", str(elsewhere))):
        result = run_cli(*args)
        assert result.exit_code == 1
        assert f"{elsewhere}: no database file here" in everything(result)


def test_not_an_aion_database(tmp_path: Path) -> None:
    foreign = tmp_path / "foreign.db"
    conn = sqlite3.connect(foreign)
    conn.execute("CREATE TABLE t (x)")
    conn.commit()
    conn.close()
    result = run_cli("list", "--store", str(foreign))
    assert result.exit_code == 1
    [line] = error_lines(result)
    assert "is a SQLite database of another program" in line


@pytest.mark.parametrize(
    ("store", "problem"),
    [
        ("nosuch://x", "no store plugin handles nosuch:// URLs"),
        ("sqlite:///x.db?cache=shared", "unknown option 'cache'"),
    ],
)
def test_bad_store_url_is_a_usage_error(store: str, problem: str) -> None:
    result = run_cli("list", "--store", store)
    assert result.exit_code == 2
    [line] = error_lines(result)
    assert line.startswith(f"Error: bad store {store!r} (--store / AION_TRIO_STORE): ")
    assert problem in line


# --------------------------------------------------------------------------
# start and signal
# --------------------------------------------------------------------------


def test_start_waits_and_prints_the_result(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _in_root(monkeypatch)
    db = tmp_path / "s.db"
    result = run_cli("start", "hello", '"zoe"', "--id", "hi", "--module", APP, "--store", str(db))
    assert result.exit_code == 0, result.output
    assert result.stdout == '"hello zoe"\n'
    assert "started workflow 'hi' run " in result.stderr
    [row] = _json_list(db)
    assert (row["workflow_id"], row["status"]) == ("hi", "completed")


def test_start_takes_a_bare_module_with_lists(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _in_root(monkeypatch)
    result = run_cli("start", "hello", '"x"', "-m", "tests.procs.cli_app", "--store", str(tmp_path / "b.db"))
    assert result.exit_code == 0, result.output
    assert result.stdout == '"hello x"\n'


def test_start_no_wait_then_signal_then_the_result(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _in_root(monkeypatch)
    monkeypatch.setenv("AION_TRIO_STORE", str(tmp_path / "sig.db"))
    monkeypatch.setenv("AION_TRIO_MODULE", APP)
    started = run_cli("start", "approval", "7", "--id", "ap", "--no-wait")
    assert started.exit_code == 0, started.output
    ids = json.loads(started.stdout)
    assert ids["workflow_id"] == "ap"
    assert [(r["workflow_id"], r["status"], r["run_id"]) for r in _json_list(tmp_path / "sig.db")] == [
        ("ap", "running", ids["run_id"])
    ]

    sent = run_cli("signal", "ap", "approve", '{"by": "ops"}')
    assert sent.exit_code == 0, sent.output
    assert "signal 'approve' recorded for workflow 'ap'" in sent.stderr
    history = [json.loads(line) for line in run_cli("history", "ap", "--json").stdout.splitlines()]
    [signal] = [e for e in history if e["type"] == "SignalReceived"]
    assert signal["data"] == {"name": "approve", "payload": {"by": "ops"}}

    # Re-attach to the same run and wait for its result.
    waited = run_cli("start", "approval", "7", "--id", "ap", "--id-reuse", "use_existing")
    assert waited.exit_code == 0, waited.output
    assert json.loads(waited.stdout) == {"order": 7, "decision": {"by": "ops"}}
    # It says it attached to the run that existed, not that it started one.
    assert f"attached to existing workflow 'ap' run {ids['run_id']} " in waited.stderr
    assert "started workflow" not in waited.stderr


def test_update_prints_the_handlers_result_and_a_retry_with_its_id_runs_it_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _in_root(monkeypatch)
    monkeypatch.setenv("AION_TRIO_STORE", str(tmp_path / "up.db"))
    monkeypatch.setenv("AION_TRIO_MODULE", APP)
    assert run_cli("start", "approval", "7", "--id", "ap", "--no-wait").exit_code == 0
    first = run_cli("update", "ap", "note", '"ship it"', "--update-id", "n-1")
    assert first.exit_code == 0, first.output
    assert first.stdout.strip() == "1"
    again = run_cli("update", "ap", "note", '"ship it"', "--update-id", "n-1")
    assert again.stdout.strip() == "1", again.output
    assert run_cli("update", "ap", "note", '"later"').stdout.strip() == "2"
    rejected = run_cli("update", "ap", "note", '""')
    assert rejected.exit_code != 0
    assert "a note needs text" in everything(rejected)
    history = [json.loads(line) for line in run_cli("history", "ap", "--json").stdout.splitlines()]
    assert [e["type"] for e in history].count("UpdateAccepted") == 2
    assert next(e["data"] for e in history if e["type"] == "UpdateCompleted") == {
        "update_id": "n-1",
        "result": 1,
    }


def test_signal_with_start_starts_the_workflow_with_the_signal_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _in_root(monkeypatch)
    monkeypatch.setenv("AION_TRIO_STORE", str(tmp_path / "sws.db"))
    monkeypatch.setenv("AION_TRIO_MODULE", APP)
    command = ("signal", "ap", "approve", '{"by": "ops"}', "--start", "approval", "--start-arg", "7")
    first = run_cli(*command, "--request-id", "approve-7")
    assert first.exit_code == 0, everything(first)
    assert "started workflow 'ap' run " in first.stderr
    assert "with signal 'approve'" in first.stderr
    again = run_cli(*command, "--request-id", "approve-7")  # a retry: records nothing
    assert again.exit_code == 0, everything(again)
    history = [json.loads(line) for line in run_cli("history", "ap", "--json").stdout.splitlines()]
    assert [e["type"] for e in history[:2]] == ["WorkflowStarted", "SignalReceived"]
    assert [e["type"] for e in history].count("WorkflowStarted") == 1
    assert [e["type"] for e in history].count("SignalReceived") == 1
    waited = run_cli("start", "approval", "7", "--id", "ap", "--id-reuse", "use_existing")
    assert json.loads(waited.stdout) == {"order": 7, "decision": {"by": "ops"}}
    lonely = run_cli("signal", "ap", "approve", "--start-arg", "7")
    assert lonely.exit_code == 2
    assert "--start-arg needs --start TYPE" in everything(lonely)


def test_start_a_failing_workflow_is_one_error_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _in_root(monkeypatch)
    result = run_cli(
        "start", "fails", '"no stock"', "--id", "ff", "-m", APP, "--store", str(tmp_path / "f.db")
    )
    assert result.exit_code == 1
    assert result.stdout == ""
    [line] = [line for line in result.stderr.splitlines() if line.startswith("Error")]
    assert line.startswith("Error: workflow 'ff' run ")
    assert "failed: ActivityFailure: activity:0 explode failed (terminal): TerminalError: no stock" in line


@pytest.mark.parametrize(
    ("args", "exit_code", "problem"),
    [
        (("start", "nope", "-m", APP), 1, "workflow type 'nope' is not in tests.procs.cli_app:app (it has: "),
        (("start", "hello", "{bad", "-m", APP), 2, "argument 1 is not valid JSON"),
        (("start", "hello", "NaN", "-m", APP), 2, "argument 1 is not valid JSON"),
        (("start", "hello", "-m", "no_such_module_xyz:app"), 1, "cannot import 'no_such_module_xyz'"),
        (("start", "hello", "-m", "tests.procs.cli_app:nothing"), 1, "has no attribute 'nothing'"),
        (("start", "hello", "-m", "tests.procs.cli_app:greet"), 1, "has no 'workflows'"),
        (("start", "hello", "-m", "tests.procs.cli_app:"), 2, "is not MODULE:ATTR"),
        (("start", "hello"), 2, "Missing option '--module'"),
        (("signal", "ap", "approve", "{x", "-m", APP), 2, "PAYLOAD_JSON is not valid JSON"),
        (("signal", "nobody", "approve", "-m", APP), 1, "workflow 'nobody' does not exist in this store"),
    ],
)
def test_start_and_signal_user_errors_are_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: tuple[str, ...], exit_code: int, problem: str
) -> None:
    _in_root(monkeypatch)
    db = tmp_path / "e.db"
    if args[0] == "signal":
        assert run_cli("start", "hello", '"a"', "--id", "seed", "-m", APP, "--store", str(db)).exit_code == 0
    result = run_cli(*args, "--store", str(db))
    assert result.exit_code == exit_code, result.output
    [line] = error_lines(result)
    assert line.startswith("Error: ")
    assert problem in line


def test_signal_to_a_closed_workflow_and_duplicate_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _in_root(monkeypatch)
    monkeypatch.setenv("AION_TRIO_STORE", str(tmp_path / "d.db"))
    assert run_cli("start", "hello", '"a"', "--id", "done", "-m", APP).exit_code == 0
    late = run_cli("signal", "done", "approve", "-m", APP)
    assert late.exit_code == 1
    assert error_lines(late) == [
        "Error: cannot signal 'approve' to workflow 'done': it is completed, not running; nothing was recorded"
    ]
    again = run_cli("start", "hello", '"a"', "--id", "done", "-m", APP, "--id-reuse", "reject_duplicate")
    assert again.exit_code == 1
    [line] = [line for line in again.stderr.splitlines() if line.startswith("Error")]
    assert "workflow 'done' already exists" in line
    assert len(run_cli("history", "done", "--json").stdout.splitlines()) == 5


def test_a_module_that_fails_to_import_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the CLI puts the cwd on it: undo that after
    (tmp_path / "broken_cli_mod.py").write_text("raise RuntimeError('config missing')\n", encoding="utf-8")
    (tmp_path / "bad_defs_cli_mod.py").write_text("workflows = [print]\n", encoding="utf-8")
    broken = run_cli("start", "x", "-m", "broken_cli_mod", "--store", str(tmp_path / "x.db"))
    assert broken.exit_code == 1
    assert error_lines(broken) == [
        "Error: importing 'broken_cli_mod' (broken_cli_mod) failed: RuntimeError: config missing"
    ]
    bad = run_cli("worker", "bad_defs_cli_mod", "--store", str(tmp_path / "x.db"))
    assert bad.exit_code == 1
    [line] = error_lines(bad)
    assert line.startswith("Error: bad_defs_cli_mod: workflows=[...] takes @aion_trio.workflow functions")
    assert not (tmp_path / "x.db").exists()


# --------------------------------------------------------------------------
# worker: a real subprocess, stopped by signals
# --------------------------------------------------------------------------


def _wait_until(condition: Callable[[], bool], what: str, proc: subprocess.Popen[str] | None = None) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"the worker exited ({proc.returncode}) while waiting for {what}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


class _Worker:
    def __init__(self, db: Path, log: Path, *extra: str) -> None:
        self.log = log
        with log.open("w", encoding="utf-8") as stderr:
            self.proc = subprocess.Popen(
                [str(_console_script()), "worker", APP, "--store", str(db), *extra],
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                text=True,
            )

    def lines(self) -> list[str]:
        return self.log.read_text(encoding="utf-8").splitlines()

    def logged(self, text: str) -> bool:
        return any(text in line for line in self.lines())

    def wait_logged(self, text: str) -> None:
        _wait_until(lambda: self.logged(text), repr(text), self.proc)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def wait(self) -> int:
        return self.proc.wait(timeout=60)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _gate_pids(gate: Path) -> list[int]:
    started = Path(f"{gate}.started")
    return [int(x) for x in started.read_text().split()] if started.exists() else []


def _history_types(db: Path, workflow_id: str) -> list[str]:
    result = run_cli("history", workflow_id, "--store", str(db), "--json")
    assert result.exit_code == 0, result.output
    return [json.loads(line)["type"] for line in result.stdout.splitlines()]


def _start_gated(db: Path, gate: Path, workflow_id: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _in_root(monkeypatch)
    result = run_cli(
        "start",
        "gated",
        json.dumps(str(gate)),
        "--id",
        workflow_id,
        "-m",
        APP,
        "--store",
        str(db),
        "--no-wait",
    )
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("command", [("list",), ("show", "some-id")])
def test_interval_without_follow_is_a_usage_error(command: tuple[str, ...], tmp_path: Path) -> None:
    result = run_cli(*command, "--interval", "2", "--store", str(tmp_path / "none.db"))
    assert result.exit_code == 2
    assert error_lines(result) == ["Error: --interval is only for --follow"]
    assert not (tmp_path / "none.db").exists()


class _Follower:
    """``aion-trio ARGS... --follow`` in a real subprocess, its stdout lines collected as they come."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [str(_console_script()), *args, "--follow", "--interval", "0.05"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self.err = ""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_line(self, text: str) -> None:
        _wait_until(lambda: any(text in line for line in self.lines), f"a line with {text!r}", self.proc)

    def wait(self) -> int:
        code = self.proc.wait(timeout=60)
        self._reader.join(timeout=60)
        return code

    def close(self) -> None:
        """Kill it if it still runs; its stderr is then in ``self.err``."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.wait()
        assert self.proc.stdout is not None
        assert self.proc.stderr is not None
        self.err = self.proc.stderr.read()
        self.proc.stdout.close()
        self.proc.stderr.close()


@pytest.mark.slow
def test_show_follow_ends_by_itself_when_another_process_completes_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db, gate = tmp_path / "f.db", tmp_path / "gate"
    _start_gated(db, gate, "g", monkeypatch)
    worker = _Worker(db, tmp_path / "w.log")
    follower = _Follower("show", "g", "--store", str(db))
    try:
        # Piped, each event is one line as it is recorded: the worker is in the gated attempt.
        follower.wait_line("ActivityStarted")
        assert follower.proc.poll() is None  # the run is still going: still following
        gate.touch()
        assert follower.wait() == 0
        worker.wait_logged("ready: serving")
        worker.stop(signal.SIGINT)
        assert worker.wait() == 0
    finally:
        follower.close()
        worker.kill()
    assert [line.split()[3] for line in follower.lines] == _history_types(db, "g")
    assert follower.lines[-1].split()[3] == "WorkflowCompleted"
    assert follower.err == ""


@pytest.mark.slow
def test_show_follow_on_a_terminal_draws_the_page_live_and_ends_with_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = tmp_path / "t.db"
    _in_root(monkeypatch)
    done = run_cli("start", "hello", '"t"', "--id", "done", "-m", APP, "--store", str(db))
    assert done.exit_code == 0, done.output
    main, terminal = os.openpty()
    try:
        proc = subprocess.Popen(
            [str(_console_script()), "show", "done", "--store", str(db), "--follow"],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=terminal,
            stderr=subprocess.PIPE,
            env={**os.environ, "COLUMNS": "120", "TERM": "xterm"},
        )
        os.close(terminal)
        output = bytearray()
        deadline = time.monotonic() + 60
        with contextlib.suppress(OSError):  # EIO once the process has closed the terminal
            while True:
                ready, _, _ = select.select([main], [], [], max(0.0, deadline - time.monotonic()))
                if not ready:
                    pytest.fail(f"show --follow on a terminal did not end: {bytes(output)!r}")
                chunk = os.read(main, 65536)
                if not chunk:
                    break
                output += chunk
        _, err = proc.communicate(timeout=60)
    finally:
        os.close(main)
    assert proc.returncode == 0
    assert err == b""
    text = output.decode()
    assert "\x1b[?25l" in text  # rich's live display hides the cursor while it redraws
    assert "WorkflowCompleted" in text
    assert "History" in text


@pytest.mark.slow
def test_list_follow_prints_a_row_when_a_workflow_starts_and_ctrl_c_ends_it_with_0(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = tmp_path / "l.db"
    _in_root(monkeypatch)
    first = run_cli("start", "hello", '"a"', "--id", "first", "-m", APP, "--store", str(db))
    assert first.exit_code == 0, first.output
    follower = _Follower("list", "--json", "--store", str(db))
    try:
        follower.wait_line('"first"')
        second = run_cli("start", "hello", '"b"', "--id", "second", "-m", APP, "--store", str(db))
        assert second.exit_code == 0, second.output
        follower.wait_line('"second"')
        follower.proc.send_signal(signal.SIGINT)
        assert follower.wait() == 0
    finally:
        follower.close()
    assert follower.err == ""
    rows = [json.loads(line) for line in follower.lines]  # JSON lines: one object per change
    assert [row["workflow_id"] for row in rows][:1] == ["first"]
    assert {row["workflow_id"] for row in rows} == {"first", "second"}
    assert rows[-1]["workflow_id"] == "second"


@pytest.mark.slow
def test_worker_drains_in_flight_work_on_sigterm_and_exits_0(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db, gate = tmp_path / "w.db", tmp_path / "gate"
    _start_gated(db, gate, "g", monkeypatch)
    worker = _Worker(db, tmp_path / "w1.log", "--drain-timeout", "60")
    try:
        worker.wait_logged("ready: serving 5 workflow types, 3 activity types; 1 running workflow(s)")
        _wait_until(lambda: worker.proc.pid in _gate_pids(gate), "the worker's gate attempt", worker.proc)
        worker.stop(signal.SIGTERM)
        worker.wait_logged("SIGTERM received: draining 1 in-flight activity attempt(s) for up to 60s")
        assert worker.proc.poll() is None  # still draining: the attempt has not finished
        gate.touch()  # let the in-flight attempt finish inside the drain
        assert worker.wait() == 0
    finally:
        worker.kill()
    assert worker.logged("drained: every in-flight activity attempt recorded its outcome; store closed")
    assert not any("Traceback" in line for line in worker.lines())
    assert "ActivityCompleted" in _history_types(db, "g")

    # The next worker finishes the run without running the activity again.
    pids = _gate_pids(gate)
    again = _Worker(db, tmp_path / "w2.log")
    try:
        _wait_until(lambda: "WorkflowCompleted" in _history_types(db, "g"), "the run to complete", again.proc)
        # The run may have completed before the first worker closed: stop this one
        # only once it serves (a SIGINT during its imports is a plain interrupt).
        again.wait_logged("ready: serving")
        again.stop(signal.SIGINT)
        assert again.wait() == 0
    finally:
        again.kill()
    assert _gate_pids(gate) == pids
    assert again.logged("SIGINT received: draining 0 in-flight activity attempt(s)")


@pytest.mark.slow
def test_worker_parks_what_outlives_the_drain_and_the_next_worker_resumes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db, gate = tmp_path / "p.db", tmp_path / "gate"
    _start_gated(db, gate, "p", monkeypatch)
    first = _Worker(db, tmp_path / "p1.log", "--drain-timeout", "0.2")
    try:
        _wait_until(lambda: first.proc.pid in _gate_pids(gate), "the first worker's attempt", first.proc)
        first.stop(signal.SIGTERM)
        assert first.wait() == 0
    finally:
        first.kill()
    assert first.logged("drain timeout: unfinished activity attempts were parked")
    types = _history_types(db, "p")
    assert "ActivityCompleted" not in types
    assert types[-1] == "ActivityStarted"

    gate.touch()
    second = _Worker(db, tmp_path / "p2.log")
    try:
        second.wait_logged("1 running workflow(s)")
        _wait_until(lambda: "WorkflowCompleted" in _history_types(db, "p"), "the resumed run", second.proc)
        second.stop(signal.SIGTERM)
        assert second.wait() == 0
    finally:
        second.kill()
    assert second.proc.pid in _gate_pids(gate)  # re-dispatched by the next worker
    completed = json.loads(
        next(
            line
            for line in run_cli("history", "p", "--store", str(db), "--json").stdout.splitlines()
            if "WorkflowCompleted" in line
        )
    )
    assert completed["data"] == {"result": "released"}


@pytest.mark.slow
def test_a_second_signal_stops_the_worker_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    db, gate = tmp_path / "x.db", tmp_path / "gate"
    _start_gated(db, gate, "x", monkeypatch)
    worker = _Worker(db, tmp_path / "x.log", "--drain-timeout", "600")
    try:
        _wait_until(lambda: worker.proc.pid in _gate_pids(gate), "the attempt", worker.proc)
        worker.stop(signal.SIGTERM)
        worker.wait_logged("draining 1 in-flight activity attempt(s) for up to 600s")
        worker.stop(signal.SIGINT)
        assert worker.wait() == 1
    finally:
        worker.kill()
    assert worker.logged("SIGINT received again: stopping now")
    assert (
        worker.lines()[-1]
        == "Error: stopped by a second signal before the drain finished; unfinished work is parked"
    )
    assert "ActivityCompleted" not in _history_types(db, "x")


# --------------------------------------------------------------------------
# Writes while a worker owns the store: the command inbox
# --------------------------------------------------------------------------


def _host() -> str:
    from aion_trio.plugin import this_host

    return this_host()


@pytest.mark.slow
def test_writes_go_through_the_inbox_to_a_running_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _in_root(monkeypatch)
    db = tmp_path / "inbox.db"
    monkeypatch.setenv("AION_TRIO_STORE", str(db))
    monkeypatch.setenv("AION_TRIO_MODULE", APP)
    worker = _Worker(db, tmp_path / "inbox.log")
    try:
        worker.wait_logged("ready: serving")
        queued = f"queued for the running worker (pid {worker.proc.pid} on {_host()}) as command #"

        started = run_cli("start", "approval", "7", "--id", "ap", "--no-wait")
        assert started.exit_code == 0, everything(started)
        assert queued + "1" in started.stderr
        assert json.loads(started.stdout)["workflow_id"] == "ap"

        asked = run_cli("query", "ap", "pending")  # queued after the start: FIFO, so the run exists
        assert asked.exit_code == 0, everything(asked)
        assert queued + "2" in asked.stderr
        assert asked.stdout == '{"order":7,"waiting":true}\n'

        noted = run_cli("update", "ap", "note", '"rush"', "--update-id", "rush-1")
        assert noted.exit_code == 0, everything(noted)
        assert queued + "3" in noted.stderr
        assert "applied by the worker: update 'rush-1' accepted by workflow 'ap'" in noted.stderr
        assert noted.stdout == "1\n", "the handler's result, read from the store"
        refused = run_cli("update", "ap", "note", '""')
        assert refused.exit_code == 1
        assert "a note needs text" in error_lines(refused)[-1]

        sent = run_cli("signal", "ap", "approve", '{"by": "ops"}')
        assert sent.exit_code == 0, everything(sent)
        assert queued + "5" in sent.stderr
        assert "applied by the worker: signal 'approve' recorded for workflow 'ap'" in sent.stderr

        # start --wait through the inbox: the id is generated here, the result read from the store.
        waited = run_cli("start", "hello", '"zoe"')
        assert waited.exit_code == 0, everything(waited)
        assert waited.stdout == '"hello zoe"\n'

        late = run_cli("terminate", "ap", "--reason", "too late")
        assert late.exit_code == 1
        assert error_lines(late)[-1] == (
            "Error: cannot terminate workflow 'ap': it is completed, not running; nothing was recorded"
        )
        not_waiting = run_cli("cancel", "nobody", "--no-wait")
        assert not_waiting.exit_code == 0, everything(not_waiting)
        assert queued in not_waiting.stderr

        second = _Worker(db, tmp_path / "second.log")
        assert second.wait() == 1
        assert second.lines()[-1].startswith(
            f"Error: the store {db} is owned by a live engine: pid {worker.proc.pid} on host {_host()!r}"
        )
        worker.stop(signal.SIGTERM)
        assert worker.wait() == 0
    finally:
        worker.kill()
    history = [json.loads(line) for line in run_cli("history", "ap", "--json").stdout.splitlines()]
    [received] = [e for e in history if e["type"] == "SignalReceived"]
    # The signal carries the request id of the inbox command that caused it (#5, queued without one of
    # its own): a redelivered command finds it and is not applied twice.
    assert received["data"] == {"name": "approve", "payload": {"by": "ops"}, "request_id": "inbox:5"}
    assert history[-1]["type"] == "WorkflowCompleted"
    assert not any("Traceback" in line for line in worker.lines())

    # No worker now: the next write is applied here, and says so.
    direct = run_cli("start", "hello", '"again"', "--id", "h2")
    assert direct.exit_code == 0, everything(direct)
    assert "(no worker owns the store: applied directly by this process)" in direct.stderr
    # A query with no worker: an engine opens here, replays the run and answers; nothing is recorded.
    assert run_cli("start", "approval", "8", "--id", "ap2", "--no-wait").exit_code == 0
    before = run_cli("history", "ap2", "--json").stdout
    answered = run_cli("query", "ap2", "pending")
    assert answered.exit_code == 0, everything(answered)
    assert answered.stdout == '{"order":8,"waiting":true}\n'
    assert run_cli("history", "ap2", "--json").stdout == before
    unknown = run_cli("query", "ap2", "nope")
    assert unknown.exit_code == 1
    assert "nope" in error_lines(unknown)[-1]


_STOPPABLE_OWNER = """
import sys, trio, aion_trio
from tests.procs.cli_app import app, approval
async def main():
    config = aion_trio.EngineConfig(owner_heartbeat=0.1, owner_stale_after=0.2, inbox_poll_interval=0.05)
    async with aion_trio.open_engine(
        sys.argv[1], workflows=app.workflows, activities=app.activities, config=config
    ) as engine:
        await engine.start(approval, 5, workflow_id="ap")
        print("READY", flush=True)
        await trio.sleep_forever()
trio.run(main)
"""


def _stored_heartbeat(db: Path) -> tuple[int, int]:
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        [(renewed, stale)] = conn.execute("SELECT renewed_at, stale_after_us FROM owner").fetchall()
    return renewed, stale


@pytest.mark.slow
def test_a_stopped_owner_past_its_stale_window_is_not_taken_over_the_cli_queues(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker SIGSTOPped for longer than its heartbeat promise is alive (its pid is, on this host):
    the CLI queues for it instead of opening an engine of its own, and the worker applies the
    command once resumed."""
    _in_root(monkeypatch)
    db = tmp_path / "stopped.db"
    monkeypatch.setenv("AION_TRIO_STORE", str(db))
    monkeypatch.setenv("AION_TRIO_MODULE", APP)
    with subprocess.Popen(
        [sys.executable, "-c", _STOPPABLE_OWNER, f"sqlite:///{db}"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    ) as owner:
        try:
            assert owner.stdout is not None
            assert owner.stdout.readline().strip() == "READY"
            # Stopped just after a heartbeat committed, so it holds no write lock while stopped.
            last, _ = _stored_heartbeat(db)
            _wait_until(lambda: _stored_heartbeat(db)[0] != last, "a heartbeat", owner)
            owner.send_signal(signal.SIGSTOP)
            renewed, stale = _stored_heartbeat(db)
            _wait_until(
                lambda: datetime.now(timezone.utc).timestamp() * 1e6 - renewed > 2 * stale, "the stale window"
            )
            result = run_cli("signal", "ap", "approve", "true", "--queue-timeout", "0.2")
            assert result.exit_code == 1, everything(result)
            assert (
                f"queued for the running worker (pid {owner.pid} on {_host()}) as command #1" in result.stderr
            )
            owner.send_signal(signal.SIGCONT)
            _wait_until(lambda: "WorkflowCompleted" in _history_types(db, "ap"), "the resumed owner", owner)
        finally:
            owner.send_signal(signal.SIGCONT)
            owner.kill()
            owner.wait()
    history = [json.loads(line) for line in run_cli("history", "ap", "--json").stdout.splitlines()]
    [received] = [e for e in history if e["type"] == "SignalReceived"]
    assert received["data"] == {"name": "approve", "payload": True, "request_id": "inbox:1"}


def test_a_command_still_queued_at_the_timeout_is_applied_by_the_next_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _in_root(monkeypatch)
    db = tmp_path / "late.db"
    monkeypatch.setenv("AION_TRIO_STORE", str(db))
    monkeypatch.setenv("AION_TRIO_MODULE", APP)
    assert run_cli("start", "approval", "3", "--id", "ap", "--no-wait").exit_code == 0
    url = f"sqlite:///{db}"

    async def plant_owner() -> Any:
        # A live owner that does not drain (this very process, with a fresh heartbeat).
        async with aion_trio.open_store(url) as store:
            return await store.claim_owner(  # type: ignore[attr-defined]
                aion_trio.OwnerIdentity.current(),
                now=datetime.now(timezone.utc),
                stale_after=timedelta(hours=1),
            )

    claim = trio.run(plant_owner)
    result = run_cli("signal", "ap", "approve", "true", "--queue-timeout", "0.2")
    assert result.exit_code == 1
    assert f"queued for the running worker (pid {os.getpid()} on {_host()}) as command #1" in result.stderr
    assert error_lines(result)[-1] == (
        f"Error: command #1 is still queued after 0.2s: the worker (pid {os.getpid()} on {_host()}) has not "
        "applied it yet; it stays queued, and the store's owner (that worker, or the next engine to open the "
        "store) applies it"
    )

    async def release_then_reopen() -> Any:
        async with aion_trio.open_store(url) as store:
            await store.release_owner(claim)  # type: ignore[attr-defined]
        # The owner goes away; the next engine (here: a direct CLI write) drains the inbox at open.
        return None

    trio.run(release_then_reopen)
    applied = run_cli("start", "approval", "3", "--id", "ap", "--id-reuse", "use_existing")
    assert applied.exit_code == 0, everything(applied)
    assert json.loads(applied.stdout) == {"order": 3, "decision": True}


async def test_a_start_queued_for_the_owner_waits_for_the_last_run_of_its_chain(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``start`` queued for the store's owner reads the result from the store: it follows the run
    through the continue-as-new successors the owner records to the chain's last run."""
    _in_root(monkeypatch)
    db = tmp_path / "relay.db"
    start = functools.partial(
        run_cli, "start", "relay", "2", "--id", "r", "-m", "tests.procs.relay_app:app", "--store", str(db)
    )
    config = aion_trio.EngineConfig(inbox_poll_interval=0.05)
    async with aion_trio.open_engine(f"sqlite:///{db}", workflows=[relay], config=config) as engine:
        with trio.fail_after(60):
            # The CLI in a thread of its own (it runs its own trio loop) while this loop owns the store.
            result = await trio.to_thread.run_sync(start, abandon_on_cancel=True)
        assert len((await engine.describe("r")).run_ids) == 3
    assert result.exit_code == 0, everything(result)
    assert f"queued for the running worker (pid {os.getpid()} on {_host()}) as command #1" in result.stderr
    assert result.stdout == '"finished in run 3"\n'


def test_a_command_retried_with_its_request_id_records_once_direct_or_queued(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _in_root(monkeypatch)
    db = tmp_path / "keys.db"
    monkeypatch.setenv("AION_TRIO_STORE", str(db))
    monkeypatch.setenv("AION_TRIO_MODULE", APP)
    started = [
        run_cli("start", "approval", "4", "--id", "k", "--no-wait", "--request-id", "s-1") for _ in "ab"
    ]
    assert [r.exit_code for r in started] == [0, 0], everything(started[1])
    assert json.loads(started[0].stdout) == json.loads(started[1].stdout), "the same run, twice"
    for _ in "ab":
        sent = run_cli("signal", "k", "approve", '"yes"', "--request-id", "sig-1")
        assert sent.exit_code == 0, everything(sent)
    history = [json.loads(line) for line in run_cli("history", "k", "--json").stdout.splitlines()]
    assert [e["type"] for e in history].count("WorkflowStarted") == 1
    assert [e["type"] for e in history].count("SignalReceived") == 1
    unnamed = run_cli("start", "approval", "4", "--request-id", "s-2")
    assert unnamed.exit_code == 2
    assert error_lines(unnamed) == ["Error: --request-id needs --id: a retry must name the same workflow"]

    # Queued for a worker: the second enqueue under the key is the first command.
    assert run_cli("start", "approval", "5", "--id", "q", "--no-wait").exit_code == 0

    async def plant_owner() -> Any:
        async with aion_trio.open_store(f"sqlite:///{db}") as store:
            return await store.claim_owner(  # type: ignore[attr-defined]
                aion_trio.OwnerIdentity.current(),
                now=datetime.now(timezone.utc),
                stale_after=timedelta(hours=1),
            )

    trio.run(plant_owner)
    for _ in "ab":
        queued = run_cli("cancel", "q", "--no-wait", "--request-id", "c-1")
        assert queued.exit_code == 0, everything(queued)
        assert "as command #1" in queued.stderr
    other = run_cli("cancel", "q", "--no-wait", "--request-id", "c-2")
    assert "as command #2" in other.stderr


def test_cancel_terminate_reopen_without_a_worker_apply_directly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _in_root(monkeypatch)
    monkeypatch.setenv("AION_TRIO_STORE", str(tmp_path / "d.db"))
    monkeypatch.setenv("AION_TRIO_MODULE", APP)
    direct = "(no worker owns the store: applied directly by this process)"
    assert run_cli("start", "approval", "1", "--id", "c", "--no-wait").exit_code == 0
    cancelled = run_cli("cancel", "c", "--reason", "changed my mind")
    assert cancelled.exit_code == 0, everything(cancelled)
    assert f"cancellation requested for workflow 'c' {direct}" in cancelled.stderr
    # Recorded; the run reacts in the next engine that runs it (this one closed at once).
    assert _history_types(tmp_path / "d.db", "c")[-1] == "WorkflowCancelRequested"
    bad = run_cli("reopen", "nobody")
    assert bad.exit_code == 1
    assert error_lines(bad) == [
        f"Error: workflow 'nobody' does not exist in this store ({_cli.store_url(str(tmp_path / 'd.db'))}); "
        "'aion-trio list' shows the workflows it holds"
    ]
    assert run_cli("start", "approval", "2", "--id", "t", "--no-wait").exit_code == 0
    terminated = run_cli("terminate", "t", "--reason", "ops")
    assert terminated.exit_code == 0, everything(terminated)
    assert f"workflow 't' terminated {direct}" in terminated.stderr
    again = run_cli("reopen", "t")
    assert again.exit_code == 0, everything(again)
    assert "reopened workflow 't' run " in again.stderr
    assert direct in again.stderr
    assert _history_types(tmp_path / "d.db", "t")[-1] == "WorkflowReopened"


def test_a_request_id_on_the_inbox_prefix_is_a_usage_error_and_opens_nothing(tmp_path: Path) -> None:
    store = tmp_path / "s.db"
    for command in (["signal", "wf", "go"], ["cancel", "wf"], ["terminate", "wf"], ["reopen", "wf"]):
        result = run_cli("--store", str(store), *command, "--request-id", "inbox:4", "-m", "flows:app")
        assert result.exit_code == 2, everything(result)
        assert "starts with 'inbox:'" in everything(result)
    assert not store.exists()


def test_reset_applies_directly_without_a_worker_and_names_the_valid_points_of_a_bad_seq(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _in_root(monkeypatch)
    monkeypatch.setenv("AION_TRIO_STORE", str(tmp_path / "d.db"))
    monkeypatch.setenv("AION_TRIO_MODULE", APP)
    assert run_cli("start", "approval", "1", "--id", "r", "--no-wait").exit_code == 0
    assert run_cli("terminate", "r", "--reason", "ops").exit_code == 0
    bad = run_cli("reset", "r", "--to-seq", "2")
    assert bad.exit_code == 1, everything(bad)
    assert "seq 2 is not a reset point" in everything(bad)
    assert "(valid: 1)" in everything(bad)
    assert _history_types(tmp_path / "d.db", "r")[-1] == "WorkflowCancelled"
    done = run_cli("reset", "r", "--to-seq", "1", "--reason", "start over")
    assert done.exit_code == 0, everything(done)
    assert "reset workflow 'r': new run " in done.stderr
    assert _history_types(tmp_path / "d.db", "r")[-2:] == ["WorkflowReset", "WorkflowStarted"]
