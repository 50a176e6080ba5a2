"""Typed calls: ``engine.start``, ``ctx.run``, ``ctx.start``, ``ctx.child`` and ``ctx.start_child``
check their arguments against the decorated function's parameters and give their handles and
results its return type, so mypy sees what the engine will do (issue 20, item 1).

mypy runs on ``tests/typecheck/calls.py`` with the project's configuration (strict); its whole
output is compared with the lines below: every ``reveal_type`` and every refused call
(``# E`` in the fixture), so a check that stops working and a new false alarm both fail.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a mypy run in a subprocess: seconds

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "typecheck" / "calls.py"

ASYNC_STR = "Coroutine[Any, Any, str]"
CHECKOUT = "WorkflowDefinition[Callable[[WorkflowContext, int, str], Coroutine[Any, Any, dict[str, int]]]]"
CHARGE = f"ActivityDefinition[Callable[[int, float], {ASYNC_STR}]]"

EXPECTED = [
    'note: Revealed type is "str"',
    'note: Revealed type is "bytes"',
    'note: Revealed type is "aion_trio._handles.ActivityHandle[str]"',
    'note: Revealed type is "aion_trio._handles.ActivityHandle[str]"',
    'note: Revealed type is "str"',
    'note: Revealed type is "list[str]"',
    'note: Revealed type is "aion_trio._handles.ChildHandle[list[str]]"',
    'note: Revealed type is "Any"',
    'error: Too many arguments for "run" of "WorkflowContext"  [call-arg]',
    f'error: Argument 1 to "run" of "WorkflowContext" has incompatible type "{CHARGE}"; '
    'expected "ActivityDefinition[Callable[[str, float], Awaitable[str]]]"  [arg-type]',
    f'error: Argument 1 to "run" of "WorkflowContext" has incompatible type "{CHARGE}"; '
    'expected "ActivityDefinition[Callable[[int], Awaitable[str]]]"  [arg-type]',
    'error: Argument 1 to "start" of "WorkflowContext" has incompatible type '
    '"ActivityDefinition[Callable[[str], bytes]]"; '
    'expected "ActivityDefinition[Callable[[int], Awaitable[Never]]]"  [arg-type]',
    'error: Too few arguments for "child" of "WorkflowContext"  [call-arg]',
    'error: Argument 1 to "child" of "WorkflowContext" has incompatible type '
    '"WorkflowDefinition[Callable[[WorkflowContext, int], Coroutine[Any, Any, list[str]]]]"; '
    'expected "WorkflowDefinition[Callable[[WorkflowContext], Awaitable[list[str]]]]"  [arg-type]',
    'note: Revealed type is "aion_trio._engine.client.RunHandle[dict[str, int]]"',
    'note: Revealed type is "dict[str, int]"',
    'note: Revealed type is "aion_trio._engine.client.RunHandle[Any]"',
    f'error: Argument 1 to "start" of "Engine" has incompatible type "{CHECKOUT}"; '
    'expected "WorkflowDefinition[Callable[[WorkflowContext, str], Awaitable[dict[str, int]]]]"  [arg-type]',
    'error: Too few arguments for "start" of "Engine"  [call-arg]',
    f'error: Argument 1 to "start" of "Engine" has incompatible type "{CHECKOUT}"; '
    'expected "WorkflowDefinition[Callable[[WorkflowContext], Awaitable[dict[str, int]]]]"  [arg-type]',
    'error: Too many arguments for "start" of "Engine"  [call-arg]',
    f'error: Argument 1 to "start" of "Engine" has incompatible type "{CHECKOUT}"; '
    'expected "WorkflowDefinition[Callable[[WorkflowContext, int, str, str], Awaitable[dict[str, int]]]]"  [arg-type]',
]


def _mypy(tmp_path: Path) -> list[tuple[int, str]]:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            str(ROOT / "pyproject.toml"),
            "--cache-dir",
            str(tmp_path / "mypy-cache"),
            "--no-error-summary",
            "--hide-error-context",
            str(FIXTURE),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode in (0, 1), done.stdout + done.stderr  # 1: errors were found, as expected
    found = []
    for line in done.stdout.splitlines():
        match = re.match(r".*calls\.py:(\d+): (.*)$", line)
        assert match is not None, line
        found.append((int(match.group(1)), match.group(2)))
    return found


def test_mypy_checks_arguments_and_infers_results(tmp_path: Path) -> None:
    found = _mypy(tmp_path)
    assert [message for _, message in found] == EXPECTED
    # Every refused call is marked in the fixture, and every marked line was refused.
    lines = FIXTURE.read_text(encoding="utf-8").splitlines()
    marked = {n for n, line in enumerate(lines, 1) if line.rstrip().endswith("# E")}
    assert {n for n, message in found if message.startswith("error:")} == marked
    revealed = {n for n, line in enumerate(lines, 1) if "reveal_type(" in line}
    assert {n for n, message in found if message.startswith("note:")} == revealed
