"""docs/tutorial.md, the parts tests/test_docs.py cannot run as plain blocks: step 3's
kill-and-resume (a real SIGKILL at the pid the demo prints), and the install.

The commands are read from the page itself, so the page cannot drift from what
is tested.  tests/test_docs.py runs every other block of the page.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
from test_docs import Block, page_blocks

import aion_trio.events

pytestmark = pytest.mark.slow  # real aion-trio subprocesses

ROOT = Path(__file__).resolve().parent.parent
TUTORIAL = ROOT / "docs" / "tutorial.md"


def _section(title_start: str) -> str:
    text = TUTORIAL.read_text(encoding="utf-8")
    start = text.index(f"\n## {title_start}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def _blocks(title_start: str) -> list[Block]:
    page = page_blocks(TUTORIAL)
    section = _section(title_start)
    return [b for b in page if f"```{b.lang}\n{b.code}```" in section]


def _commands(block: Block) -> list[str]:
    """The block's command lines, without comments (a trailing ``# ...`` included)."""
    lines = [re.sub(r"\s+#.*$", "", line).strip() for line in block.code.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def _environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AION_TRIO_") and k != "COLUMNS"}
    env["PATH"] = os.pathsep.join(
        [sysconfig.get_path("scripts"), str(Path(sys.executable).parent), env["PATH"]]
    )
    return env


def _summary(out: str) -> dict[str, int]:
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("│┃").split("│")]
        if len(cells) == 2 and cells[1].isdigit():
            rows[cells[0]] = int(cells[1])
    return rows


def _progress(out: str) -> list[dict[str, int]]:
    return [
        {k: int(v) for k, v in (part.split("=") for part in line.split()[1:])}
        for line in out.splitlines()
        if line.startswith("progress:")
    ]


def test_step_3_kill_minus_9_at_the_printed_pid_then_the_same_command_resumes(tmp_path: Path) -> None:
    shown, kill_block, resume_block = _blocks("3. Kill it")
    assert [b.lang for b in (shown, kill_block, resume_block)] == ["text", "bash", "bash"]
    start_line, kill_line = _commands(kill_block)
    (resume_line,) = _commands(resume_block)
    assert start_line.startswith("aion-trio demo"), start_line
    assert kill_line.startswith("kill -9 "), kill_line
    assert "PID" in kill_line, kill_line
    # The first line as the page shows it, with any pid.
    first_line = re.compile(re.escape(shown.code.strip()).replace("48213", r"\d+"))
    env = _environment()

    demo = subprocess.Popen(
        ["bash", "-c", f"exec {start_line}"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert demo.stdout is not None
        first = demo.stdout.readline()
        assert first_line.fullmatch(first.strip()), f"the page shows another first line than {first!r}"
        found = re.search(r"\bpid (\d+)\b", first)
        assert found, f"the demo's first line gives no pid: {first!r}"
        pid = int(found.group(1))
        assert pid == demo.pid, "the printed pid is the demo's own"
        deadline = time.monotonic() + 60
        while True:  # kill it once some orders finished and others are still in flight
            assert time.monotonic() < deadline, "the demo made no progress"
            line = demo.stdout.readline()
            assert line, (
                f"the demo ended before it could be killed: {demo.stderr.read() if demo.stderr else ''}"
            )
            counts = _progress(line)
            if counts and counts[0]["completed"] >= 1 and counts[0]["running"] + counts[0]["waiting"] >= 3:
                break
        subprocess.run(
            ["bash", "-e", "-c", kill_line.replace("PID", str(pid))],
            cwd=tmp_path,
            env=env,
            check=True,
            timeout=30,
        )
        assert demo.wait(timeout=30) == -signal.SIGKILL
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
        for stream in (demo.stdout, demo.stderr):
            if stream is not None:
                stream.close()

    resumed = subprocess.run(
        ["bash", "-e", "-c", resume_line], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180
    )
    assert resumed.returncode == 0, resumed.stderr
    out = resumed.stdout
    found = re.search(r"Resuming from aion-demo\.db: (\d+) of (\d+) orders found \((\d+) finished\)", out)
    assert found, out
    present, planned, finished = map(int, found.groups())
    assert planned == 100, "the plain 'aion-trio demo --fresh' of the page plans 100 orders"
    assert 0 < finished < present < planned, f"killed mid-way: {found.group(0)}"
    # Every count the resumed run showed is of this demo's orders, and none is negative.
    progress = _progress(out)
    assert progress, out
    for counts in progress:
        assert min(counts.values()) >= 0, counts
        assert counts["running"] + counts["waiting"] + counts["completed"] + counts["failed"] <= planned
    assert progress[-1]["completed"] == planned, progress[-1]
    declined = sum(1 for n in range(1, planned + 1) if n % 9 == 0)
    summary = _summary(out)
    assert summary["shipped"] == planned - declined, out
    assert summary["declined, stock released"] == declined, out
    assert summary["resumed from the database"] == present, out
    assert "failed" not in summary, out


def test_step_4_names_every_event_a_shipped_order_records_and_only_real_event_types(tmp_path: Path) -> None:
    text = _section("4. Look inside")
    named = set(re.findall(r"`([A-Z][A-Za-z]+)`", text))
    real = {name for name, value in vars(aion_trio.events).items() if isinstance(value, type)}
    assert named, "control: the paragraph names event types"
    assert named <= real, f"not event types of aion_trio.events: {named - real}"
    # What demo-order-7 (shipped) and demo-order-4 (a retried reservation) record.
    env = _environment()
    demo = subprocess.run(
        ["aion-trio", "demo", "--orders", "7"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert demo.returncode == 0, demo.stderr
    recorded: set[str] = set()
    for workflow_id in ("demo-order-7", "demo-order-4"):
        history = subprocess.run(
            ["aion-trio", "history", workflow_id, "--store", "aion-demo.db", "--json"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        recorded |= {json.loads(line)["type"] for line in history.stdout.splitlines()}
    assert "TimerCancelled" in recorded, "control: the histories were read"
    assert recorded <= named, f"step 4 leaves out {sorted(recorded - named)}"


# A fresh virtualenv and an install from the package index: about 45 s on a loaded
# machine, above the 120 s of tox's --timeout when CI is busy.  The mark exists only
# with pytest-timeout (tox installs it; '.[test]' alone does not).
_install_timeout = (
    pytest.mark.timeout(900) if importlib.util.find_spec("pytest_timeout") else pytest.mark.slow
)


@_install_timeout
def test_step_1_installs_a_working_aion_trio_from_a_clone(tmp_path: Path) -> None:
    (block,) = _blocks("1. Install")
    commands = [line for line in block.code.splitlines() if line and not line.startswith("#")]
    clone = tmp_path / "clone"
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for name in files:
        source = ROOT / name
        if source.is_file():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, clone / name)
    # The page's commands, then proof that the environment they made works.
    script = "\n".join(
        [*commands, "aion-trio --version", "pytest --version", "python -c 'import pytest_trio'"]
    )
    done = subprocess.run(
        ["bash", "-e", "-c", script],
        cwd=clone,
        env=_environment(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"aion-trio {aion_trio.__version__}" in done.stdout
    assert (clone / ".venv" / "bin" / "aion-trio").exists()
