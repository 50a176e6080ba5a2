"""Check that a *-mindeps tox env holds exactly the floors pyproject.toml claims.

    python .ci/check_mindeps.py PYPROJECT CONSTRAINTS [EXTRA ...]

For every requirement of the project (and of the named extras) that applies to
this interpreter: it must declare a ``>=`` floor, the constraints file must
pin it ``==`` that floor, and the installed version must equal it.  Pins for
packages the project does not require are refused too.  Exits 1 naming every
mismatch, so a floor that drifts from what the suite really ran on is caught.
"""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - depends on the interpreter
    import tomli as tomllib


def _applies(req: Requirement, extras: list[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({"extra": extra}) for extra in ["", *extras])


def _floor(req: Requirement) -> Version | None:
    floors = [Version(spec.version) for spec in req.specifier if spec.operator == ">="]
    return max(floors) if floors else None


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    pyproject, constraints, *extras = argv
    project = tomllib.loads(Path(pyproject).read_text(encoding="utf-8"))["project"]
    own_name = canonicalize_name(project["name"])
    declared = [Requirement(r) for r in project.get("dependencies", [])]
    for extra in extras:
        declared += [Requirement(r) for r in project.get("optional-dependencies", {})[extra]]

    pins: dict[str, Requirement] = {}
    for line in Path(constraints).read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            pins[canonicalize_name(req.name)] = req

    problems: list[str] = []
    wanted: set[str] = set()
    checked: set[str] = set()
    for req in declared:
        name = canonicalize_name(req.name)
        if name == own_name:
            continue
        wanted.add(name)
        if not _applies(req, extras) or name in checked:
            continue  # not for this interpreter, or listed twice (two extras): checked once
        checked.add(name)
        floor = _floor(req)
        if floor is None:
            problems.append(f"{req}: pyproject.toml declares no >= floor")
            continue
        pin = pins.get(name)
        pinned = [Version(s.version) for s in pin.specifier if s.operator == "=="] if pin else []
        if pinned != [floor]:
            problems.append(
                f"{req.name}: {constraints} pins {pin or 'nothing'}, pyproject.toml's floor is {floor}"
            )
        try:
            installed = Version(importlib.metadata.version(req.name))
        except importlib.metadata.PackageNotFoundError:
            problems.append(f"{req.name}: not installed (floor {floor})")
            continue
        if installed != floor:
            problems.append(f"{req.name}: installed {installed}, but the floor is {floor}")
        else:
            print(f"ok  {req.name}=={installed}")
    for name in sorted(set(pins) - wanted):
        problems.append(f"{name}: pinned in {constraints} but not required by pyproject.toml")
    for problem in problems:
        print(f"MISMATCH  {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
