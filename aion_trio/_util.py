"""Small helpers shared by the package."""

from __future__ import annotations

from collections.abc import Collection, Mapping


def _is_private(module: str) -> bool:
    """``aion_trio._x`` and ``aion_trio.plugin._x``: a module no user should name."""
    parts = module.split(".")
    return parts[0] == "aion_trio" and any(part.startswith("_") for part in parts[1:])


def fixup_module_metadata(
    module_name: str, namespace: Mapping[str, object], *, reclaim: Collection[str] = ()
) -> None:
    """Make re-exported objects say they live in ``module_name``.

    So tracebacks and reprs say ``aion_trio.SequenceConflict`` rather than
    ``aion_trio._errors.SequenceConflict``.  An object a public module in
    ``reclaim`` already claimed is claimed again, so which of two surfaces
    exporting it was imported first does not decide what it says.
    """
    seen: set[int] = set()

    def fix_one(qualname: str, name: str, obj: object) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        mod = getattr(obj, "__module__", None)
        if isinstance(mod, str) and (_is_private(mod) or mod in reclaim):
            try:
                obj.__module__ = module_name
            except (AttributeError, TypeError):  # pragma: no cover - builtins, slots
                return
            if isinstance(obj, type):
                for attr_name, attr_value in list(vars(obj).items()):
                    if isinstance(attr_value, (classmethod, staticmethod)):
                        attr_value = attr_value.__func__
                    if callable(attr_value) and getattr(attr_value, "__qualname__", "").startswith(
                        obj.__qualname__ + "."
                    ):
                        fix_one(f"{qualname}.{attr_name}", attr_name, attr_value)

    for name, obj in namespace.items():
        if not name.startswith("_"):
            fix_one(name, name, obj)
