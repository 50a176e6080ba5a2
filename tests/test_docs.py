"""Every code block in ``docs/`` is executed, as a reader would use it.

Per page, in document order, in a fresh temporary directory that is also the
current directory:

* a block whose first line is ``# <file name>`` (``# flows.py``,
  ``# acme_aion_store/__init__.py``, ``# pyproject.toml``) is written to that
  file; later blocks run it (``python``, ``pytest``, ``aion-trio -m``);
* every other ``python`` block is executed in one namespace per page (like
  the README's, tests/test_readme.py);
* a ``bash`` block runs in ``bash -e`` with the installed ``aion-trio``,
  ``python`` and ``pytest`` first on ``PATH`` (real subprocesses) and must exit 0;
* a ``console`` block's ``$ command`` lines run the same way and their output
  must match the lines shown (a ``...`` line stands for any lines);
* a ``text`` block is an illustration, not code (checked where a page says so).

A ``python`` or ``bash`` block that must be shown but not run starts with
``# not run: <reason>``; the reason is required and the count per page is
pinned below, so a block cannot quietly stop running.  A ``pyproject.toml``
file block is "installed" by writing the ``.dist-info`` that pip would
(metadata and entry points) next to the files, and the directory is put on
``PYTHONPATH``: that is how the plugin page's entry point is found.
Page-specific checks then look at what the blocks printed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest

import aion_trio

pytestmark = pytest.mark.slow  # runs every docs page, with real aion-trio subprocesses

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest depends on tomli before 3.11
    import tomli as tomllib

DOCS = Path(__file__).resolve().parent.parent / "docs"
README = DOCS.parent / "README.md"

FENCE = re.compile(r"^```([\w-]*)[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
FILE_HEADER = re.compile(r"# ([\w][\w./-]*\.(?:py|toml))\n")
NOT_RUN = re.compile(r"# not run:(.*)\n")
LANGUAGES = {"python", "bash", "console", "toml", "text"}

#: How many blocks each page shows without running them (see the module docstring).
NOT_RUN_PER_PAGE = {
    "architecture.md": 0,
    "tutorial.md": 2,
    "concepts.md": 0,
    "testing.md": 0,
    "operating.md": 2,
    "console.md": 1,
    "errors.md": 0,
    "writing-a-store-plugin.md": 0,
    "schedules.md": 0,
    "flow-control.md": 0,
    "payloads.md": 0,
}


@attrs.frozen
class Block:
    lang: str
    code: str
    line: int

    @property
    def where(self) -> str:
        return f"line {self.line}"


def page_blocks(page: Path) -> list[Block]:
    text = page.read_text(encoding="utf-8")
    return [Block(m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1) for m in FENCE.finditer(text)]


@attrs.define
class PageRun:
    """What running one page's blocks produced."""

    directory: Path
    namespace: dict[str, Any] = attrs.field(factory=dict)
    outputs: list[tuple[Block, str]] = attrs.field(factory=list)
    files: list[str] = attrs.field(factory=list)
    not_run: list[tuple[Block, str]] = attrs.field(factory=list)
    executed: int = 0

    def output_of(self, needle: str) -> str:
        """The output of the one bash/console block whose code contains ``needle``."""
        found = [out for block, out in self.outputs if needle in block.code]
        assert len(found) == 1, f"expected one shell block containing {needle!r}, found {len(found)}"
        return found[0]


def _environment(directory: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AION_TRIO_")}
    scripts = sysconfig.get_path("scripts")
    env["PATH"] = os.pathsep.join([scripts, str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = str(directory)
    env["COLUMNS"] = "200"  # rich tables: no wrapping in captured output
    env["NO_COLOR"] = "1"
    env.pop("PYTEST_ADDOPTS", None)
    return env


def _shell(command: str, directory: Path, where: str) -> str:
    done = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", command],
        cwd=directory,
        env=_environment(directory),
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{where}: exit status {done.returncode}\n$ {command}\n{output}"
    return output


def _install_metadata(pyproject: Path) -> None:
    """Write the ``.dist-info`` that ``pip install`` would, so the entry points are found."""
    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    dist = pyproject.parent / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n", encoding="utf-8"
    )
    groups = project.get("entry-points", {})
    (dist / "entry_points.txt").write_text(
        "".join(
            f"[{group}]\n" + "".join(f"{name} = {value}\n" for name, value in points.items()) + "\n"
            for group, points in groups.items()
        ),
        encoding="utf-8",
    )


def _console_pattern(expected: list[str]) -> re.Pattern[str]:
    parts = [
        r"(?:[^\n]*\n)*?" if line.strip() == "..." else re.escape(line.rstrip()) + r"[ \t]*\n"
        for line in expected
    ]
    return re.compile("".join(parts) + r"\s*\Z")


def _run_console(block: Block, directory: Path) -> str:
    sessions: list[tuple[str, list[str]]] = []
    for line in block.code.splitlines():
        if line.startswith("$ "):
            sessions.append((line[2:], []))
        else:
            assert sessions, f"console block at {block.where}: output before the first '$ ' command"
            sessions[-1][1].append(line)
    outputs = []
    for command, expected in sessions:
        output = _shell(command, directory, f"console block at {block.where}")
        assert _console_pattern(expected).match(output), (
            f"console block at {block.where}: the output of {command!r} is not what the page shows:\n{output}"
        )
        outputs.append(output)
    return "".join(outputs)


def run_page(page: Path, directory: Path, monkeypatch: pytest.MonkeyPatch) -> PageRun:
    monkeypatch.chdir(directory)
    for name in list(os.environ):
        if name.startswith("AION_TRIO_"):
            monkeypatch.delenv(name)
    # The page's blocks run in a module, as a reader's code does: dataclasses and typing.get_type_hints
    # look a class's module up in sys.modules (the blocks inherit this file's ``annotations`` future).
    module = types.ModuleType(f"docs.{page.stem}")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    run = PageRun(directory, namespace=module.__dict__)
    for block in page_blocks(page):
        assert block.lang in LANGUAGES, (
            f"{page.name} {block.where}: a ```{block.lang} block; every block must be one of {sorted(LANGUAGES)}"
        )
        if block.lang == "text":
            continue
        skipped = NOT_RUN.match(block.code)
        if skipped:
            reason = skipped.group(1).strip()
            assert block.lang in ("python", "bash"), (
                f"{page.name} {block.where}: only python/bash may be not run"
            )
            assert reason, f"{page.name} {block.where}: '# not run:' needs a reason"
            run.not_run.append((block, reason))
            continue
        header = FILE_HEADER.match(block.code)
        if header:
            path = directory / header.group(1)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(block.code, encoding="utf-8")
            if path.name == "pyproject.toml":
                _install_metadata(path)
            run.files.append(header.group(1))
        elif block.lang == "python":
            # Padding with the lines above the block makes tracebacks give the line in the page.
            exec(compile("\n" * block.line + block.code, str(page), "exec"), run.namespace)
        elif block.lang == "bash":
            run.outputs.append(
                (block, _shell(block.code, directory, f"{page.name} bash block at {block.where}"))
            )
        elif block.lang == "console":
            run.outputs.append((block, _run_console(block, directory)))
        else:
            pytest.fail(f"{page.name} {block.where}: a ```{block.lang} block must be a '# <file>' block")
        run.executed += 1
    assert len(run.not_run) == NOT_RUN_PER_PAGE[page.name], (
        f"{page.name}: {len(run.not_run)} blocks are marked '# not run:' "
        f"({[b.where for b, _ in run.not_run]}); the pinned count is {NOT_RUN_PER_PAGE[page.name]}"
    )
    return run


# --------------------------------------------------------------------------
# What each page's blocks must have shown
# --------------------------------------------------------------------------


def check_tutorial(run: PageRun) -> None:
    first = run.output_of("aion-trio demo --orders 20 --fresh")
    assert "Starting 20 orders" in first, first
    assert "shipped" in first, first
    again = run.output_of("aion-trio demo\n")
    assert "Resuming from aion-demo.db: 20 of 20 orders found (20 finished)" in again, again
    listing = run.output_of("aion-trio list --store aion-demo.db")
    assert "demo-order-7 " in listing, listing
    assert "completed" in listing, listing
    shown = run.output_of("aion-trio show demo-order-7")
    assert "WorkflowStarted" in shown, shown
    assert "WorkflowCompleted" in shown, shown
    twice = run.output_of("python shop.py")
    # Run twice, the script attaches to the finished order-7 the second time.
    assert twice.count("{'order': 7, 'receipt': 'receipt-7', 'approved_by': 'ann'}") == 2, twice
    assert "Traceback" not in twice, twice
    assert '"receipt-8"' in run.output_of("aion-trio start checkout")
    tested = run.output_of("pytest -q")
    assert re.search(r"\b2 passed\b", tested), tested


def check_operating(run: PageRun) -> None:
    stuck = run.output_of("--status running")
    assert "stuck: workflow type 'checkout' is not registered" in stuck, stuck
    shown = run.output_of("aion-trio show order-1")
    assert "non-determinism" in shown, shown
    helped = run.output_of("aion-trio --help")
    assert "Commands:" in helped, helped
    assert "worker" in helped, helped


def check_plugin_page(run: PageRun) -> None:
    assert "acme store: every conformance scenario passed" in run.output_of("python check_acme_store.py")
    assert re.search(r"\b\d{2,} passed\b", run.output_of("pytest -q")), run.output_of("pytest -q")
    # The package layout the page draws is the files it gives.
    tree = next(b for b in page_blocks(DOCS / "writing-a-store-plugin.md") if b.lang == "text")
    drawn = {line.strip() for line in tree.code.splitlines()[1:] if line.strip()}
    assert drawn <= set(run.files), f"the layout names files the page does not give: {drawn - set(run.files)}"


def check_testing(run: PageRun) -> None:
    tested = run.output_of("pytest -q test_billing.py")
    assert re.search(r"\b5 passed\b", tested), tested


PAGE_CHECKS: dict[str, Callable[[PageRun], None]] = {
    "tutorial.md": check_tutorial,
    "testing.md": check_testing,
    "operating.md": check_operating,
    "writing-a-store-plugin.md": check_plugin_page,
}


@pytest.mark.parametrize("name", sorted(NOT_RUN_PER_PAGE))
def test_the_page_runs(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    page = DOCS / name
    run = run_page(page, tmp_path, monkeypatch)
    assert run.executed >= 3, f"control: {name} had its blocks found and run ({run.executed})"
    check = PAGE_CHECKS.get(name)
    if check is not None:
        check(run)


def test_every_page_in_docs_is_run_and_linked_from_the_readme() -> None:
    pages = {p.name for p in DOCS.glob("*.md")}
    assert pages == set(NOT_RUN_PER_PAGE), f"pages not run by this test: {pages - set(NOT_RUN_PER_PAGE)}"
    readme = README.read_text(encoding="utf-8")
    for page in pages:
        assert f"](docs/{page})" in readme, f"README does not link docs/{page}"


def public_exceptions() -> list[str]:
    return sorted(
        name
        for name, value in vars(aion_trio).items()
        if not name.startswith("_") and isinstance(value, type) and issubclass(value, BaseException)
    )


def documented_exceptions() -> list[str]:
    text = (DOCS / "errors.md").read_text(encoding="utf-8")
    return re.findall(r"^### `(\w+)`", text, flags=re.M)


def test_every_public_exception_is_in_the_error_reference() -> None:
    public = public_exceptions()
    assert len(public) >= 40, f"control: the public exceptions were found ({len(public)})"
    documented = documented_exceptions()
    missing = sorted(set(public) - set(documented))
    assert not missing, f"docs/errors.md has no '### `Name`' section for: {', '.join(missing)}"
    unknown = sorted(set(documented) - set(public))
    assert not unknown, f"docs/errors.md documents names aion_trio does not export: {', '.join(unknown)}"
    assert len(documented) == len(set(documented)), "docs/errors.md documents a name twice"
