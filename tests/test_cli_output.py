"""What the ``aion-trio`` command prints: errors worded alike, hints for common slips,
``show --json``, and tables that fit the terminal (or 100 columns when piped)."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import sysconfig
import termios
from pathlib import Path
from typing import Any

import pytest
import trio
from click.testing import CliRunner, Result

import aion_trio as aion
from aion_trio import _cli

ROOT = Path(__file__).resolve().parent.parent
APP = "tests.procs.cli_app:app"


def run_cli(*args: str) -> Result:
    try:
        runner = CliRunner(mix_stderr=False)  # type: ignore[call-arg,unused-ignore]
    except TypeError:  # click >= 8.2 keeps stdout and stderr apart anyway
        runner = CliRunner()
    return runner.invoke(_cli.cli, list(args), prog_name="aion-trio")


def error_lines(result: Result) -> list[str]:
    return [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(ROOT)  # the CLI imports MODULE from the current directory
    monkeypatch.setattr(sys, "path", list(sys.path))  # and puts that directory on sys.path
    db = tmp_path / "out.db"
    monkeypatch.setenv("AION_TRIO_STORE", str(db))
    monkeypatch.setenv("AION_TRIO_MODULE", APP)
    return db


# --------------------------------------------------------------------------
# Errors read alike
# --------------------------------------------------------------------------


def test_a_refused_reopen_is_worded_like_every_other_error(store: Path) -> None:
    assert run_cli("start", "hello", '"a"', "--id", "done").exit_code == 0
    refused = run_cli("reopen", "done")
    assert refused.exit_code == 1
    [line] = error_lines(refused)
    # No exception class name between "Error:" and the sentence, as for NotRunning & co.
    assert line.startswith("Error: cannot reopen workflow 'done' (run "), line
    assert "CannotReopen" not in line


def test_a_query_of_a_closed_workflow_is_answered_by_replaying_it(store: Path) -> None:
    assert run_cli("start", "approval", "1", "--id", "ap", "--no-wait").exit_code == 0
    assert run_cli("terminate", "ap").exit_code == 0
    before = run_cli("history", "ap", "--json").stdout
    answered = run_cli("query", "ap", "pending")
    assert answered.exit_code == 0, error_lines(answered)
    assert answered.stdout == '{"order":1,"waiting":true}\n'
    assert run_cli("history", "ap", "--json").stdout == before, "a query records nothing"
    # A write refused the same way still says that nothing was recorded.
    late = run_cli("signal", "ap", "approve")
    assert error_lines(late)[-1].endswith("not running; nothing was recorded")


async def test_no_query_error_says_nothing_was_recorded() -> None:
    @aion.workflow(name="asks")
    async def asks(ctx: aion.WorkflowContext) -> None:
        ctx.set_query_handler("boom", lambda: 1 / 0)
        await ctx.wait_signal("never")

    async with aion.open_engine("memory://", workflows=[asks]) as engine:
        await engine.start(asks, workflow_id="q")
        with trio.fail_after(10):
            for name in ("nope", "boom"):
                with pytest.raises(aion.QueryError) as raised:
                    await engine.query("q", name)
                assert "recorded" not in str(raised.value)
        await engine.terminate("q")
        with pytest.raises(aion.QueryFailed) as closed:  # closed: replayed, and the handler raised
            await engine.query("q", "boom")
        assert "recorded" not in str(closed.value)


@pytest.mark.parametrize(
    ("spec", "hint"),
    [
        ("side_effect_flows.py", "side_effect_flows:app"),
        ("pkg/side_effect_flows.py:app", "pkg.side_effect_flows:app"),
    ],
)
def test_a_file_name_given_as_the_module_hints_module_colon_attr(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spec: str, hint: str
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "pkg").mkdir()
    for path in (tmp_path / "side_effect_flows.py", tmp_path / "pkg" / "side_effect_flows.py"):
        path.write_text("open('imported', 'w').close()\nworkflows = []\n", encoding="utf-8")
    result = run_cli("start", "hello", "-m", spec, "--store", str(tmp_path / "x.db"))
    assert result.exit_code == 2
    [line] = error_lines(result)
    assert line.startswith(f"Error: {spec!r} is a file name"), line
    assert f"e.g. {hint} " in line, line
    assert not (tmp_path / "imported").exists(), "the file was imported (run) before the hint"
    assert not (tmp_path / "x.db").exists()


# --------------------------------------------------------------------------
# show --json
# --------------------------------------------------------------------------


def test_show_json_holds_the_summary_the_pending_work_and_the_history(store: Path) -> None:
    assert run_cli("start", "approval", "7", "--id", "ap", "--no-wait").exit_code == 0
    assert run_cli("start", "napper", "--id", "nap", "--no-wait").exit_code == 0
    assert run_cli("start", "fails", '"no stock"', "--id", "ff").exit_code == 1

    shown = run_cli("show", "nap", "--json")
    assert shown.exit_code == 0, shown.stderr
    data: dict[str, Any] = json.loads(shown.stdout)
    assert (data["workflow_id"], data["workflow_type"], data["status"]) == ("nap", "napper", "running")
    assert data["result"] is None
    assert data["error"] is None
    assert "residency" in data
    assert data["residency"] is None, "not known from the store"
    [timer] = data["pending_timers"]
    assert set(timer) == {"timer_id", "fire_at"}
    # The history is the same wire form as 'history --json', event for event.
    lines = run_cli("history", "nap", "--json").stdout.splitlines()
    assert data["history"] == [json.loads(line) for line in lines]
    assert data["history_length"] == len(lines)

    failed = json.loads(run_cli("show", "ff", "--json").stdout)
    assert failed["status"] == "failed"
    assert failed["error"]["type"] == "ActivityFailure"
    assert "no stock" in failed["error"]["message"]
    assert failed["failed_step"]
    assert failed["history"][-1]["type"] == "WorkflowFailed"


def test_show_json_of_an_unknown_workflow_is_the_usual_error(store: Path) -> None:
    assert run_cli("start", "hello", '"a"', "--id", "h").exit_code == 0
    missing = run_cli("show", "nobody", "--json")
    assert missing.exit_code == 1
    assert missing.stdout == ""
    assert error_lines(missing)[0].startswith("Error: workflow 'nobody' does not exist in this store")


# --------------------------------------------------------------------------
# Table widths
# --------------------------------------------------------------------------

LONG_ID = "order-2026-12-01-0f79455e-e250-40b9-8bf0"  # 40 characters, like a UUID-based id


def _script() -> str:
    return str(Path(sysconfig.get_path("scripts")) / "aion-trio")


def _environment(db: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AION_TRIO_") and k != "COLUMNS"}
    return {**env, "AION_TRIO_STORE": str(db), "NO_COLOR": "1", "PYTHONPATH": str(ROOT)}


def _seeded(store: Path) -> None:
    long_type = "fails"
    assert (
        run_cli("start", long_type, '"' + "the supplier has no stock " * 4 + '"', "--id", LONG_ID).exit_code
        == 1
    )
    assert run_cli("start", "approval", "7", "--id", "ap", "--no-wait").exit_code == 0


@pytest.mark.slow
@pytest.mark.parametrize("command", [("list",), ("show", LONG_ID), ("history", LONG_ID)])
def test_piped_tables_are_at_most_100_columns_and_keep_the_workflow_id_whole(
    store: Path, command: tuple[str, ...]
) -> None:
    _seeded(store)
    done = subprocess.run(
        [_script(), *command],
        capture_output=True,
        text=True,
        env=_environment(store),
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    widths = [len(line) for line in done.stdout.splitlines()]
    assert max(widths) <= 100, done.stdout
    assert max(widths) >= 80, "control: the table uses the width it has"
    assert LONG_ID in done.stdout


ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _on_a_terminal(args: list[str], env: dict[str, str], columns: int) -> str:
    """Run ``args`` with stdout on a pseudo-terminal ``columns`` wide; what it printed."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    proc = subprocess.Popen(args, stdout=follower, stderr=subprocess.PIPE, env=env, close_fds=True)
    os.close(follower)
    chunks = []
    try:
        while True:
            ready, _, _ = select.select([leader], [], [], 60)
            assert ready, "the command printed nothing for 60 s"
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the other side closed
                break
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(leader)
        assert proc.wait(timeout=60) == 0
        assert proc.stderr is not None
        proc.stderr.close()
    return ANSI.sub("", b"".join(chunks).decode("utf-8").replace("\r\n", "\n"))


@pytest.mark.slow
@pytest.mark.parametrize("columns", [72, 130])
def test_tables_on_a_terminal_fit_its_width(store: Path, columns: int) -> None:
    _seeded(store)
    out = _on_a_terminal([_script(), "show", LONG_ID], _environment(store), columns)
    assert "History" in out
    widths = [len(line) for line in out.splitlines()]
    assert max(widths) <= columns, out
    assert max(widths) > columns - 10, f"control: the table spreads to the terminal's width\n{out}"


# --------------------------------------------------------------------------
# Ctrl-C
# --------------------------------------------------------------------------


@pytest.mark.slow
def test_ctrl_c_while_a_command_waits_is_one_line_and_exit_status_130(store: Path) -> None:
    proc = subprocess.Popen(
        [_script(), "start", "approval", "1", "--id", "waits"],  # waits for a signal nobody sends
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**_environment(store), "AION_TRIO_MODULE": APP},
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert line.startswith("started workflow 'waits'"), line
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    assert [line for line in err.splitlines() if line.strip()] == ["Error: interrupted"]
    assert out == ""
