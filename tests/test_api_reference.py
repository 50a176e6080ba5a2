"""Every public name has a docstring and a place in the API reference (docs/reference/).

The reference is rendered from the docstrings by mkdocstrings (mkdocs.yml;
``tox -e docs`` builds it with ``--strict``).  This test needs neither: it reads
the sources the way the renderer does, statically.  A name is *documented*
when the statement that defines it (followed through ``from x import name``
re-exports) has a docstring: a class's or function's own, or for a constant
or type alias the string literal right below its assignment, or the ``#:``
comment lines right above it (docs/_tools/griffe_roles.py renders those).  It is *in the
reference* when some ``::: dotted.name`` line of a page under docs/reference/
resolves to that same definition, so a class re-exported by several modules
is documented once.

Public names are those tests/test_exports.py pins (``public_names``) for
aion_trio and its public submodules, ``__all__`` for the stores shipped in
the wheel and the contrib packages (read from their sources: contrib need
not be installed), and the plugin hooks (``@hookspec`` functions).
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import attrs
import pytest
from test_exports import public_names

import aion_trio
import aion_trio.events
import aion_trio.plugin
import aion_trio.projections
import aion_trio.testing

REPO_DIR = Path(__file__).resolve().parent.parent
REFERENCE_DIR = REPO_DIR / "docs" / "reference"


def _contrib_packages() -> dict[str, Path]:
    """Each contrib distribution's top-level package (``contrib/<dist>/<package>/__init__.py``)."""
    return {
        package.name: package
        for dist in sorted((REPO_DIR / "contrib").iterdir())
        for package in sorted(dist.iterdir())
        if (package / "__init__.py").is_file() and package.name != "tests"
    }


CONTRIB = _contrib_packages()
RUNTIME_MODULES = [aion_trio, aion_trio.testing, aion_trio.plugin, aion_trio.events, aion_trio.projections]
ALL_MODULES = ["aion_trio_sqlite", "aion_trio_memory", *CONTRIB]
#: The plugin hooks: a plugin implements them by name (``@hookimpl``).
HOOKSPECS = "aion_trio.plugin.hookspecs"
DIRECTIVE = re.compile(r"^::: ([\w.]+)[ \t]*$", re.M)


@attrs.frozen
class Definition:
    """Where a name is defined: the module and the name there (re-exports followed)."""

    module: str
    name: str
    docstring: str | None
    node: ast.stmt | None = attrs.field(default=None, eq=False, repr=False)


@attrs.define
class Sources:
    """Module sources by dotted name, parsed once; ``extra_roots`` maps top-level packages to folders."""

    extra_roots: dict[str, Path] = attrs.field(factory=dict)
    _trees: dict[str, tuple[ast.Module, bool]] = attrs.field(factory=dict)
    _lines: dict[str, list[str]] = attrs.field(factory=dict)

    def path(self, module: str) -> Path:
        top, *rest = module.split(".")
        if top in self.extra_roots:
            root = self.extra_roots[top]
        else:
            spec = importlib.util.find_spec(top)  # a top-level lookup imports nothing
            assert spec is not None, f"cannot find package {top}"
            assert spec.submodule_search_locations, f"{top} is not a package"
            root = Path(next(iter(spec.submodule_search_locations)))
        base = root.joinpath(*rest)
        return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")

    def tree(self, module: str) -> tuple[ast.Module, bool]:
        if module not in self._trees:
            path = self.path(module)
            text = path.read_text(encoding="utf-8")
            self._trees[module] = (ast.parse(text), path.name == "__init__.py")
            self._lines[module] = text.splitlines()
        return self._trees[module]

    def all_names(self, module: str) -> list[str]:
        tree, _ = self.tree(module)
        for statement in tree.body:
            if isinstance(statement, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in statement.targets
            ):
                value = ast.literal_eval(statement.value)
                assert isinstance(value, list)
                return [str(name) for name in value]
        raise AssertionError(f"{module} has no __all__")

    def hook_specifications(self, module: str) -> list[str]:
        """The functions of ``module`` decorated ``@hookspec``."""
        tree, _ = self.tree(module)
        return [
            statement.name
            for statement in tree.body
            if isinstance(statement, ast.FunctionDef)
            and any(isinstance(d, ast.Name) and d.id == "hookspec" for d in statement.decorator_list)
        ]

    def define(self, module: str, name: str) -> Definition:
        """The statement defining ``module.name``, following ``from ... import`` re-exports.

        The last one wins, as at run time: after ``@overload`` stubs, the implementation.
        """
        tree, is_package = self.tree(module)
        body = _flatten(tree.body)
        found: Definition | None = None
        for index, statement in enumerate(body):
            if isinstance(statement, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                if statement.name == name:
                    found = Definition(module, name, ast.get_docstring(statement), statement)
            elif _assigns(statement, name):
                following = body[index + 1] if index + 1 < len(body) else None
                docstring = None
                if (
                    isinstance(following, ast.Expr)
                    and isinstance(following.value, ast.Constant)
                    and isinstance(following.value.value, str)
                ):
                    docstring = following.value.value
                else:
                    docstring = comment_docstring(self._lines[module], statement.lineno)
                found = Definition(module, name, docstring)
            elif isinstance(statement, ast.ImportFrom):
                for alias in statement.names:
                    if (alias.asname or alias.name) == name:
                        source = _absolute(statement, module, is_package)
                        if source.split(".")[0] not in self.top_levels(module):
                            found = Definition(source, alias.name, None)  # a third-party object
                        else:
                            found = self.define(source, alias.name)
        assert found is not None, f"{module}.{name}: no definition found in its source"
        return found

    def top_levels(self, module: str) -> set[str]:
        return {module.split(".")[0], "aion_trio", *self.extra_roots}


def comment_docstring(lines: list[str], lineno: int) -> str | None:
    """The ``#:`` comment lines right above line ``lineno`` (1-based), joined; ``None`` if none."""
    found: list[str] = []
    index = lineno - 2
    while index >= 0 and lines[index].strip().startswith("#:"):
        found.insert(0, lines[index].strip()[2:].strip())
        index -= 1
    return "\n".join(found) or None


def _flatten(statements: list[ast.stmt]) -> list[ast.stmt]:
    """Top-level statements, with those inside ``if``/``try`` blocks in place."""
    out: list[ast.stmt] = []
    for statement in statements:
        if isinstance(statement, ast.If | ast.Try):
            out.extend(_flatten(statement.body))
            for handler in getattr(statement, "handlers", []):
                out.extend(_flatten(handler.body))
            out.extend(_flatten(statement.orelse))
        else:
            out.append(statement)
    return out


def _assigns(statement: ast.stmt, name: str) -> bool:
    if isinstance(statement, ast.Assign):
        return any(isinstance(t, ast.Name) and t.id == name for t in statement.targets)
    if isinstance(statement, ast.AnnAssign):
        return isinstance(statement.target, ast.Name) and statement.target.id == name
    type_alias = getattr(ast, "TypeAlias", None)  # Python >= 3.12
    return type_alias is not None and isinstance(statement, type_alias) and statement.name.id == name


def _absolute(statement: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not statement.level:
        assert statement.module is not None
        return statement.module
    parts = module.split(".") if is_package else module.split(".")[:-1]
    base = parts[: len(parts) - statement.level + 1]
    return ".".join(base + ([statement.module] if statement.module else []))


def public_api(sources: Sources) -> dict[str, list[str]]:
    """Every public name, by module."""
    api = {module.__name__: public_names(module) for module in RUNTIME_MODULES}
    api.update({module: sources.all_names(module) for module in ALL_MODULES})
    api[HOOKSPECS] = sources.hook_specifications(HOOKSPECS)
    return api


def reference_targets(reference_dir: Path) -> list[str]:
    """Every ``::: dotted.name`` the reference pages render."""
    return [
        m.group(1)
        for page in sorted(reference_dir.glob("*.md"))
        for m in DIRECTIVE.finditer(page.read_text())
    ]


def resolve(sources: Sources, dotted: str) -> Definition:
    """The definition a directive names (a module path, then one attribute)."""
    module, _, name = dotted.rpartition(".")
    return sources.define(module, name)


def api_problems(sources: Sources, api: dict[str, list[str]], targets: list[str]) -> dict[str, list[str]]:
    documented: set[tuple[str, str]] = set()
    modules = {target for target in targets if target in api}  # ``::: aion_trio.events``: the module's page
    for target in targets:
        if target not in modules:
            definition = resolve(sources, target)
            documented.add((definition.module, definition.name))
    no_docstring, not_in_reference = [], []
    for module, names in api.items():
        for name in names:
            definition = sources.define(module, name)
            if not (definition.docstring or "").strip():
                no_docstring.append(f"{module}.{name}")
            if (definition.module, definition.name) not in documented:
                not_in_reference.append(f"{module}.{name}")
    return {"no docstring": no_docstring, "not in docs/reference": not_in_reference}


def _methods(node: ast.ClassDef) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    """Public methods and properties (the last definition of a name: overloads are stubs)."""
    return {
        item.name: item
        for item in node.body
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and not item.name.startswith("_")
    }


def _is_protocol(node: ast.ClassDef) -> bool:
    for base in node.bases:
        base = base.value if isinstance(base, ast.Subscript) else base
        if (isinstance(base, ast.Name) and base.id == "Protocol") or (
            isinstance(base, ast.Attribute) and base.attr == "Protocol"
        ):
            return True
    return False


def member_problems(sources: Sources, api: dict[str, list[str]]) -> list[str]:
    """Public methods of public classes without a docstring.

    Excused: a protocol's methods (its class docstring states the contract, as
    ``EventStore``'s does), a class's methods named after the methods of a
    protocol it implements (defines more than half of its methods: the
    protocol documents them), and the
    ``test_<scenario>`` methods of the conformance suites (named after what they check).
    """
    classes: dict[tuple[str, str], ast.ClassDef] = {}
    for module, names in api.items():
        for name in names:
            definition = sources.define(module, name)
            if isinstance(definition.node, ast.ClassDef):
                classes[definition.module, definition.name] = definition.node
    protocols = [set(_methods(node)) for node in classes.values() if _is_protocol(node)]
    missing = []
    for (module, name), node in sorted(classes.items()):
        if _is_protocol(node):
            continue
        methods = _methods(node)
        excused = set().union(*(p for p in protocols if 2 * len(p & set(methods)) > len(p)))
        for method, item in methods.items():
            if method.startswith("test_") or method in excused:
                continue
            if not (ast.get_docstring(item) or "").strip():
                missing.append(f"{module}.{name}.{method}")
    return missing


def test_every_public_method_has_a_docstring() -> None:
    sources = Sources(extra_roots=dict(CONTRIB))
    api = public_api(sources)
    missing = member_problems(sources, api)
    assert missing == [], "write a docstring for: " + ", ".join(missing)


def test_every_public_name_has_a_docstring_and_a_reference_entry() -> None:
    sources = Sources(extra_roots=dict(CONTRIB))
    api = public_api(sources)
    assert sum(map(len, api.values())) > 400, "control: the public names were found"
    assert set(api["aion_trio_postgres"]) >= {"PostgresStore", "open_postgres_store"}, "control: contrib read"
    assert "aion_trio_register_stores" in api[HOOKSPECS], "control: the hooks were found"
    problems = api_problems(sources, api, reference_targets(REFERENCE_DIR))
    assert problems["no docstring"] == [], "write a docstring for: " + ", ".join(problems["no docstring"])
    assert problems["not in docs/reference"] == [], (
        "add a '::: name' line to a page of docs/reference/ for: "
        + (", ".join(problems["not in docs/reference"]))
    )


def test_the_site_reads_every_contrib_package() -> None:
    assert {"aion_trio_postgres", "aion_trio_prometheus"} <= set(CONTRIB), "control: contrib found"
    config = (REPO_DIR / "mkdocs.yml").read_text(encoding="utf-8")
    paths = re.search(r"^ +paths: \[(.*)\]$", config, re.M)
    assert paths is not None, "mkdocs.yml: the python handler's paths"
    listed = {p.strip() for p in paths.group(1).split(",")}
    missing = sorted(f"contrib/{p.parent.name}" for p in CONTRIB.values())
    assert [m for m in missing if m not in listed] == [], "add the contrib folder to mkdocs.yml's paths"


def test_every_reference_entry_names_a_public_object() -> None:
    sources = Sources(extra_roots=dict(CONTRIB))
    api = public_api(sources)
    targets = reference_targets(REFERENCE_DIR)
    assert len(targets) > 300, "control: the directives were found"
    assert len(targets) == len(set(targets)), "a name is rendered twice"
    private = [t for t in targets if any(part.startswith("_") for part in t.split("."))]
    assert private == []
    unknown = [
        t for t in targets if t not in api and t.rpartition(".")[2] not in api.get(t.rpartition(".")[0], [])
    ]
    assert unknown == [], "the reference renders names their module does not export"


# --------------------------------------------------------------------------
# Controls: the checker finds what it is meant to find
# --------------------------------------------------------------------------

FAKE_INIT = '''
"""A fake package."""
from ._impl import Documented as Documented, Bare as Bare, LIMIT as LIMIT, UNDOCUMENTED as UNDOCUMENTED
from ._impl import COMMENTED as COMMENTED, Closable as Closable, Closer as Closer
__all__ = ["Documented", "Bare", "LIMIT", "COMMENTED", "UNDOCUMENTED", "helper", "Closable", "Closer"]

def helper():
    """Helps."""
'''
FAKE_IMPL = '''
from typing import Protocol

class Documented:
    """Has a docstring."""

    def said(self):
        """Documented."""

    def unsaid(self):
        pass

    def test_something(self):
        pass

class Closable(Protocol):
    """The contract: ``close()`` closes."""

    def close(self): ...

class Closer:
    """Implements Closable."""

    def close(self):
        pass

class Bare:
    x: int = 1

LIMIT = 3
"""The limit."""

#: A Sphinx-style comment is rendered too.
COMMENTED = 4

# an ordinary comment is not
UNDOCUMENTED = 5
'''


def test_the_checker_reports_missing_docstrings_and_reference_entries(tmp_path: Path) -> None:
    package = tmp_path / "fakepkg"
    package.mkdir()
    (package / "__init__.py").write_text(FAKE_INIT)
    (package / "_impl.py").write_text(FAKE_IMPL)
    pages = tmp_path / "reference"
    pages.mkdir()
    (pages / "a.md").write_text(
        "# A\n\n::: fakepkg.Documented\n\n::: fakepkg.Bare\n\n::: fakepkg.LIMIT\n\n::: fakepkg.COMMENTED\n\n::: fakepkg.Closable\n\n::: fakepkg.Closer\n"
    )
    sources = Sources(extra_roots={"fakepkg": package})
    api = {"fakepkg": sources.all_names("fakepkg")}
    problems = api_problems(sources, api, reference_targets(pages))
    assert problems == {
        "no docstring": ["fakepkg.Bare", "fakepkg.UNDOCUMENTED"],
        "not in docs/reference": ["fakepkg.UNDOCUMENTED", "fakepkg.helper"],
    }
    assert member_problems(sources, api) == ["fakepkg._impl.Documented.unsaid"]
    # The definition is found through the re-export, so one entry covers both spellings.
    assert resolve(sources, "fakepkg._impl.LIMIT") == resolve(sources, "fakepkg.LIMIT")


@pytest.mark.parametrize("module", ["aion_trio", "aion_trio.plugin"])
def test_re_exports_resolve_to_one_definition(module: str) -> None:
    sources = Sources(extra_roots=dict(CONTRIB))
    assert sources.define(module, "Store") == sources.define("aion_trio.plugin", "Store")
    assert sources.define(module, "Store").module.startswith("aion_trio._")
