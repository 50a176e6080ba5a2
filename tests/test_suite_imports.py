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
import fnmatch
import re
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


# --------------------------------------------------------------------------
# Tests go through seams (issue 16, item 8; docs/architecture.md, "Testing seams")
# --------------------------------------------------------------------------

ROOT = TESTS_DIR.parent

#: The public surfaces: any of their names a test may use.
PUBLIC = ("aion_trio", "aion_trio.events", "aion_trio.projections", "aion_trio.plugin", "aion_trio.testing")

#: The documented internal seams, by layer: besides the public surfaces, a test may import
#: these private modules, and only their public names (no leading underscore).  Keep this
#: table and docs/architecture.md's "Testing seams" section the same (checked below).
SEAMS: dict[str, tuple[str, ...]] = {
    "entry points": ("aion_trio._cli", "aion_trio._demo", "aion_trio._console"),
    "engine services": ("aion_trio._inbox", "aion_trio._cluster"),
    "activities": ("aion_trio._activities",),
    "workflow code": ("aion_trio._context", "aion_trio._ports"),
    "runtime": (
        "aion_trio._recorder",
        "aion_trio._epoch",
        "aion_trio._clock",
        "aion_trio._transient",
        "aion_trio._observe",
        "aion_trio._codec_store",
    ),
    "stores": ("aion_trio._plugins",),
    "errors": ("aion_trio._errors",),
    "leaf helpers": (
        "aion_trio._ids",
        "aion_trio._payload",
        "aion_trio._urls",
        "aion_trio._logs",
        "aion_trio._watchdog",
        "aion_trio._contain",
        "aion_trio._interrupt",
        "aion_trio._wire",
        "aion_trio._events",
        "aion_trio._commands",
        "aion_trio._schedules",
        "aion_trio._chain",
        "aion_trio._childspec",
        "aion_trio._projections",
        "aion_trio._retry",
        "aion_trio._codecs",
        "aion_trio._convert",
    ),
}
SEAM_MODULES = frozenset(module for modules in SEAMS.values() for module in modules)

#: A package that is tested from outside aion_trio's layers (a store plugin, the conformance
#: kit) owns its private modules: its own unit tests, and only they, may import them.
OWN_TESTS = {
    "aion_trio.testing": (
        "tests/test_conformance.py",
        "tests/test_flaky_store.py",
        "tests/test_kit_catches_broken_stores.py",
    ),
    "aion_trio_memory": ("tests/test_memory_*.py",),
    "aion_trio_sqlite": ("tests/test_sqlite_*.py", "tests/procs/*wal_writer.py"),
    "aion_trio_postgres": ("contrib/aion-trio-postgres/tests/*",),
    "aion_trio_prometheus": ("contrib/aion-trio-prometheus/tests/*",),
    "aion_trio_opentelemetry": ("contrib/aion-trio-opentelemetry/tests/*",),
}

#: Reaches not yet moved onto a seam, each one listed (the check fails on any other, and on
#: an entry here that no longer occurs, so the list only shrinks).
NOT_YET_MOVED = frozenset(
    {
        # The cluster's state on each node (relinquished, stuck, leases, timers, drives).
        "contrib/aion-trio-postgres/tests/test_pg_cluster.py: engine internals ._cluster",
        "contrib/aion-trio-postgres/tests/test_pg_cluster.py: engine internals ._core",
        # Replays a recorded history under a store that refuses appends: a lease spawned by hand.
        "tests/_replay.py: engine internals ._core",
        # record_activity_event (the activities seam) needs the live engine's recorder.
        "tests/test_activity_retries.py: engine internals ._core",
        # The terminal's path (handle_run_exit and its retry) driven by hand against a live
        # engine's core and registry: every such test lives in this one file.
        "tests/test_completion.py: engine internals ._core",
        "tests/test_completion.py: private module aion_trio._completion",
        "tests/test_completion.py: private module aion_trio._engine",
        "tests/test_completion.py: private module aion_trio._registry",
        "tests/test_completion.py: private name aion_trio._completion._Progress",
        # Whether an observer is called under a recorder's lock (the live recorders' locks), and
        # that with no observer the engine holds no hub and wraps nothing.
        "tests/test_observers.py: engine internals ._core",
        # The process-wide plugin manager and registry caches, emptied for a test and restored.
        "tests/test_observers.py: private name aion_trio._plugins._default_managers",
        "tests/test_plugins.py: private name aion_trio._plugins._default_registry",
        # Holds the live recorder's lock to stand for an append in progress.
        "tests/test_schedule_window.py: engine internals ._core",
        # Spies on Runner.start_run_locked, the one start primitive.
        "tests/test_start_path.py: private module aion_trio._engine.runner",
    }
)


def _private(dotted: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in dotted.split("."))


def _engine_private_names() -> frozenset[str]:
    """The private attributes and methods of ``aion_trio.Engine`` (``_core``, ``_local``, ...)."""
    client = ROOT / "aion_trio" / "_engine" / "client.py"
    tree = ast.parse(client.read_text(encoding="utf-8"), str(client))
    engine = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Engine")
    names = {"_core"}
    for node in ast.walk(engine):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            names.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
    return frozenset(name for name in names if _private(name))


def reaches_past_the_seams(path: Path, root: Path, engine_private: frozenset[str]) -> list[str]:
    """``file: what`` for every import or attribute of aion_trio a test may not use.

    (a) a private aion_trio module that is not a seam, (b) a private name imported from
    any aion_trio module or read (or monkeypatched) on one, (c) ``x._core`` or another of
    the Engine's private names, and a package's private module (a store plugin's, the
    kit's) imported by a test that is not the package's own.
    """
    rel = path.relative_to(root).as_posix()
    found: set[str] = set()

    def own(package: str) -> bool:
        return any(fnmatch.fnmatch(rel, pattern) for pattern in OWN_TESTS[package])

    def module(dotted: str) -> None:
        package = next((p for p in OWN_TESTS if dotted.startswith(p + ".")), None)
        if package is not None:
            if _private(dotted) and not own(package):
                found.add(f"{rel}: a package's private module {dotted}")
        elif dotted.split(".")[0] == "aion_trio" and _private(dotted) and dotted not in SEAM_MODULES:
            found.add(f"{rel}: private module {dotted}")

    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    modules: dict[str, str] = {}  # local name -> the aion_trio module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update(
                {a.asname: a.name for a in node.names if a.asname and a.name.startswith("aion_trio")}
            )
            modules.update({a.name: a.name for a in node.names if a.name == "aion_trio"})
        elif (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and (node.module or "").startswith("aion_trio")
        ):
            for a in node.names:
                if f"{node.module}.{a.name}" in SEAM_MODULES:
                    modules[a.asname or a.name] = f"{node.module}.{a.name}"

    def bound_module(owner: ast.expr) -> str | None:
        if isinstance(owner, ast.Name):
            return modules.get(owner.id)
        if isinstance(owner, ast.Attribute) and (parent := bound_module(owner.value)) is not None:
            dotted = f"{parent}.{owner.attr}"
            return dotted if dotted in SEAM_MODULES or dotted in PUBLIC else None
        return None

    def module_private(owner: ast.expr, name: str) -> None:
        dotted = f"{bound_module(owner)}.{name}"
        if bound_module(owner) is not None and _private(name) and dotted not in SEAM_MODULES:
            found.add(f"{rel}: private name {dotted}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            module_private(node.value, node.attr)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in {"setattr", "delattr"}
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            module_private(node.args[0], node.args[1].value)  # monkeypatch.setattr(module, "_x", ...)
        if isinstance(node, ast.Import):
            for alias in node.names:
                module(alias.name)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            module(node.module)
            for alias in node.names:
                dotted = f"{node.module}.{alias.name}"
                if dotted in SEAM_MODULES or dotted in OWN_TESTS:
                    continue  # ``from aion_trio import _cli``: the seam itself
                if node.module.split(".")[0] == "aion_trio" and _private(alias.name):
                    if not (node.module in OWN_TESTS and own(node.module)):
                        found.add(f"{rel}: private name {dotted}")
                elif _private(alias.name):
                    module(dotted)
        elif isinstance(node, ast.Attribute) and node.attr in engine_private:
            found.add(f"{rel}: engine internals .{node.attr}")
    return sorted(found)


def _test_files() -> list[Path]:
    return sorted([*TESTS_DIR.rglob("*.py"), *ROOT.glob("contrib/*/tests/**/*.py")])


def test_tests_reach_the_engine_only_through_its_public_api_and_the_seams() -> None:
    files = _test_files()
    assert any("contrib" in path.parts for path in files), "the walk found contrib's tests"
    engine_private = _engine_private_names()
    assert {"_core", "_local"} <= engine_private, engine_private
    found = {where for path in files for where in reaches_past_the_seams(path, ROOT, engine_private)}
    new = sorted(found - NOT_YET_MOVED)
    assert new == [], f"use the public API or a seam (docs/architecture.md, 'Testing seams'): {new}"
    moved = sorted(NOT_YET_MOVED - found)
    assert moved == [], f"no longer reached: drop these from NOT_YET_MOVED: {moved}"


def test_the_seam_check_catches_each_kind_of_reach(tmp_path: Path) -> None:
    # Control: one line of each kind, and the allowed forms beside them.
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import aion_trio\n"
        "from aion_trio.testing import FlakyStore\n"
        "from aion_trio._context import RunActivation\n"  # a seam's public name: allowed
        "import aion_trio._ids\n"  # a seam: allowed
        "from aion_trio._completion import handle_run_exit\n"  # (a)
        "def f(engine):\n"
        "    import aion_trio._engine.core\n"  # (a), inside a function
        "    from aion_trio._context import _seed\n"  # (b)
        "    from aion_trio import _registry\n"  # (b)
        "    from aion_trio import _errors, events\n"  # a seam and a public module: allowed
        "    from aion_trio_postgres._store import Backend\n"  # a plugin's internals, not its test
        "    from aion_trio.testing._flaky import X\n"  # the kit's internals, not its test
        "    from aion_trio import _plugins as plugins\n"  # a seam, under another name
        "    monkeypatch.setattr(plugins, '_default_managers', {})\n"  # (b), patched
        "    aion_trio._ids._secret, plugins.default_registry()\n"  # (b) read; a public name
        "    return engine._core.registry, engine._local\n",  # (c)
        encoding="utf-8",
    )
    assert reaches_past_the_seams(sample, tmp_path, frozenset({"_core", "_local"})) == [
        "sample.py: a package's private module aion_trio.testing._flaky",
        "sample.py: a package's private module aion_trio_postgres._store",
        "sample.py: engine internals ._core",
        "sample.py: engine internals ._local",
        "sample.py: private module aion_trio._completion",
        "sample.py: private module aion_trio._engine.core",
        "sample.py: private name aion_trio._context._seed",
        "sample.py: private name aion_trio._ids._secret",
        "sample.py: private name aion_trio._plugins._default_managers",
        "sample.py: private name aion_trio._registry",
    ]


def test_the_seams_are_those_the_architecture_page_documents() -> None:
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = page.split("\n## Testing seams\n", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"`(aion_trio\._\w+)", section))
    assert documented == SEAM_MODULES, (sorted(documented - SEAM_MODULES), sorted(SEAM_MODULES - documented))
