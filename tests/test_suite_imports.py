"""The suite's own helpers import the same way from every invocation.

pytest puts ``tests/`` (no ``__init__.py``) on ``sys.path``, so a test module
imports a helper by its top-level name: ``_samples``, ``_replay``,
``procs.wal_writer``.  ``tests.procs...`` is importable in-process only when the
project root happens to be on ``sys.path`` (an editable install, or an earlier
test that put the working directory there): under tox, which installs a wheel,
one file run alone then failed with ``No module named 'tests'``.  Child processes
are another matter: they are started with ``cwd`` and ``PYTHONPATH`` set to the
root and may run ``-m tests.procs...``.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent


def in_process_imports_of_tests(path: Path, root: Path) -> list[str]:
    """``file:line`` (relative to ``root``) of every ``import tests...`` / ``from tests... import``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        if any(name == "tests" or name.startswith("tests.") for name in names):
            found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_no_test_module_imports_the_tests_package() -> None:
    files = sorted(TESTS_DIR.rglob("*.py"))
    assert len(files) > 20, files  # the walk found the suite
    found = [where for path in files for where in in_process_imports_of_tests(path, TESTS_DIR.parent)]
    assert found == [], f"import helpers by their top-level name (procs..., _samples), not tests.: {found}"


def test_the_check_finds_such_an_import(tmp_path: Path) -> None:
    # Control: the walk sees function-local imports, the kind that hid the problem.
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from procs.wal_writer import BATCH\ndef f():\n    from tests.procs.x import y\n    import tests\n",
        encoding="utf-8",
    )
    assert in_process_imports_of_tests(sample, tmp_path) == ["sample.py:3", "sample.py:4"]
