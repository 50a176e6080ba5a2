"""Typed payloads: plain JSON data to the types a function annotates, through cattrs.

Payloads hold plain JSON data (see :mod:`aion_trio._payload`, which also encodes
the typed values: a dataclass or attrs instance to an object, a datetime to an
ISO string, a UUID or Decimal to a str, an enum to its value).  This module goes
the other way: a function's parameters and return annotation, read once per
function (:class:`Hints`), say what each value is decoded to.  An un-annotated
parameter, ``Any``, ``object`` and the bare ``dict``/``list`` keep the plain
data exactly as it is.  Decoding is strict about scalars (an ``int`` parameter
takes a JSON integer, not ``"7"`` or ``7.5``) and names the path of what does
not fit in :class:`~aion_trio.PayloadDecodeError`.  A pydantic model (when the
user's code uses pydantic; this module never imports it) is validated by the model
itself, its validation error turned into the same error naming the path.
"""

from __future__ import annotations

import decimal
import enum
import inspect
import json
import sys
import threading
import typing
import uuid
import weakref
from collections.abc import Callable
from datetime import date, datetime, time
from typing import Any, final

import attrs
import cattrs
from cattrs.errors import ClassValidationError, IterableValidationError
from cattrs.strategies import configure_union_passthrough

from ._errors import PayloadDecodeError

#: Types whose values are the plain JSON data itself: decoding leaves them alone.
_PASSTHROUGH: frozenset[Any] = frozenset({Any, object, dict, list, inspect.Parameter.empty, None, type(None)})


class _Mismatch(Exception):
    """Raised by the strict hooks: ``detail`` says what was expected and what came."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


def _shown(value: Any) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _expected(kind: str, value: Any) -> _Mismatch:
    return _Mismatch(f"expected {kind}, got {_shown(value)}")


def _int(value: Any, _: Any) -> int:
    if type(value) is not int:  # a bool is not an int here, nor is 7.0
        raise _expected("int", value)
    return value


def _float(value: Any, _: Any) -> float:
    if type(value) not in (int, float):
        raise _expected("float", value)
    return float(value)


def _str(value: Any, _: Any) -> str:
    if type(value) is not str:
        raise _expected("str", value)
    return value


def _bool(value: Any, _: Any) -> bool:
    if type(value) is not bool:
        raise _expected("bool", value)
    return value


def _iso(kind: type[Any], name: str) -> Callable[[Any, Any], Any]:
    def structure(value: Any, _: Any) -> Any:
        if type(value) is not str:
            raise _expected(f"an ISO 8601 {name} str", value)
        try:
            return kind.fromisoformat(value)
        except ValueError:
            raise _expected(f"an ISO 8601 {name} str", value) from None

    return structure


def _uuid(value: Any, _: Any) -> uuid.UUID:
    if type(value) is not str:
        raise _expected("a UUID str", value)
    try:
        return uuid.UUID(value)
    except ValueError:
        raise _expected("a UUID str", value) from None


def _decimal(value: Any, _: Any) -> decimal.Decimal:
    if type(value) not in (str, int):
        raise _expected("a decimal str", value)
    try:
        return decimal.Decimal(value)
    except decimal.InvalidOperation:
        raise _expected("a decimal str", value) from None


def _exactly(kind: type[Any], hook: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """``hook`` for ``kind`` and its subclasses, but an enum (an ``IntEnum``, a ``StrEnum``) is
    built by calling it.  (A workflow module's ``datetime`` is the determinism guard's subclass,
    whose instances are plain datetimes.)"""

    def structure(value: Any, cl: Any) -> Any:
        if cl is not kind and issubclass(cl, enum.Enum):
            return cl(value)
        return hook(value, cl)

    return structure


class _ModelInvalid(Exception):
    """A pydantic model refused its data: ``loc`` is the place inside it, ``detail`` what was wrong."""

    def __init__(self, loc: str, detail: str) -> None:
        super().__init__(detail)
        self.loc = loc
        self.detail = detail


def _pydantic_model(kind: Any) -> bool:
    """Whether ``kind`` is a pydantic model class.  pydantic is looked up, never imported: a
    model annotation means the user's code imported it already."""
    pydantic = sys.modules.get("pydantic")
    return pydantic is not None and isinstance(kind, type) and issubclass(kind, pydantic.BaseModel)


def _pydantic_structure(kind: Any) -> Callable[[Any, Any], Any]:
    invalid = sys.modules["pydantic"].ValidationError

    def structure(value: Any, _: Any) -> Any:
        try:
            return kind.model_validate(value)
        except invalid as exc:
            first = exc.errors()[0]
            loc = "".join(
                f"[{part!r}]" if isinstance(part, int) else f".{part}" for part in first.get("loc", ())
            )
            raise _ModelInvalid(
                loc.lstrip("."), f"{first.get('msg', 'invalid')}, got {_shown(first.get('input'))}"
            ) from None

    return structure


def _make_converter() -> cattrs.Converter:
    converter = cattrs.Converter(detailed_validation=True)
    for kind, hook in (
        (int, _int),
        (float, _float),
        (str, _str),
        (bool, _bool),
        (datetime, _iso(datetime, "datetime")),
        (date, _iso(date, "date")),
        (time, _iso(time, "time")),
        (uuid.UUID, _uuid),
        (decimal.Decimal, _decimal),
    ):
        converter.register_structure_hook(kind, _exactly(kind, hook))
    converter.register_structure_hook_func(lambda t: t is object, lambda value, _: value)

    def attrs_class(cl: Any) -> Any:
        attrs.resolve_types(cl)  # string annotations (``from __future__ import annotations``) to types
        return converter.gen_structure_attrs_fromdict(cl)

    converter.register_structure_hook_factory(attrs.has, attrs_class)
    converter.register_structure_hook_factory(_pydantic_model, _pydantic_structure)
    # ``int | str`` and the like: the value's own JSON type picks the member.
    configure_union_passthrough(typing.Union[int, float, str, bool, None], converter)
    return converter


_converter = _make_converter()


def _path(base: str, exc: BaseException) -> tuple[str, BaseException]:
    """Follow cattrs' nested validation errors to the first leaf, building its path."""
    while isinstance(exc, (ClassValidationError, IterableValidationError)):
        with_notes, without = exc.group_exceptions()
        if with_notes:
            sub, note = with_notes[0]
            if isinstance(note, cattrs.AttributeValidationNote):
                base = f"{base}.{note.name}" if base else note.name
            else:
                base = f"{base}[{getattr(note, 'index', '?')!r}]"
            exc = sub
        elif without:
            exc = without[0]
        else:  # pragma: no cover - cattrs always holds at least one
            break
    return base, exc


def _detail(exc: BaseException, kind: Any) -> str:
    if isinstance(exc, (_Mismatch, _ModelInvalid)):
        return exc.detail
    if isinstance(exc, KeyError):
        return "missing (a required field)"
    if isinstance(exc, cattrs.StructureHandlerNotFoundError):
        return f"no way to decode {typing.cast(Any, exc).type!r}: annotate a supported type (or Any)"
    return f"{type(exc).__name__}: {exc}"


def _passthrough(kind: Any) -> bool:
    try:
        return kind in _PASSTHROUGH
    except TypeError:  # an unhashable annotation: not one of them
        return False


#: Annotations whose hook returns a value of exactly that type as it is (``_int``, ``_str``, ``_bool``).
_SAME_WHEN_EXACT: frozenset[Any] = frozenset({int, str, bool})


def decode(value: Any, kind: Any, *, what: str, path: str) -> Any:
    """``value`` (plain JSON data) as ``kind``; raise :class:`PayloadDecodeError` naming the path."""
    if type(value) is kind and kind in _SAME_WHEN_EXACT:
        return value  # what the converter's hook returns, without the converter
    if _passthrough(kind):
        return value
    try:
        return _converter.structure(value, kind)
    except Exception as exc:
        where, leaf = _path(path, exc)
        if isinstance(leaf, _ModelInvalid) and leaf.loc:
            where = f"{where}{leaf.loc}" if leaf.loc.startswith("[") or not where else f"{where}.{leaf.loc}"
        raise PayloadDecodeError(what, where, _detail(leaf, kind)) from None


@final
class Hints:
    """A function's parameter and return types, read once (on first use) and kept.

    Reading is deferred to first use so a forward reference to a class defined
    after the decorated function still resolves.  ``skip`` leaves out leading
    parameters the engine fills itself (a workflow's ``ctx``).
    """

    __slots__ = ("_fn", "_lock", "_params", "_result", "_skip", "_star")

    def __init__(self, fn: Callable[..., Any], skip: int = 0) -> None:
        self._fn = fn
        self._skip = skip
        self._lock = threading.Lock()  # activities in threads may read it first concurrently
        self._params: tuple[tuple[str, Any], ...] | None = None
        self._star: tuple[str, Any] | None = None
        self._result: Any = Any

    def _load(self) -> tuple[tuple[str, Any], ...]:
        params = self._params
        if params is not None:
            return params
        with self._lock:
            if self._params is not None:
                return self._params
            try:
                hints = typing.get_type_hints(self._fn)
            except Exception:  # unresolvable annotations: keep the plain data, as before typed payloads
                hints = {}
            try:
                parameters = list(inspect.signature(self._fn).parameters.values())[self._skip :]
            except (TypeError, ValueError):
                parameters = []
            positional = []
            for p in parameters:
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                    positional.append((p.name, hints.get(p.name, Any)))
                elif p.kind is p.VAR_POSITIONAL:
                    self._star = (p.name, hints.get(p.name, Any))
            self._result = hints.get("return", Any)
            self._params = tuple(positional)
            return self._params

    def decode_arguments(self, values: list[Any], *, what: str) -> list[Any]:
        """Positional argument values, each decoded to its parameter's type."""
        params = self._load()
        out = list(values)
        for i, value in enumerate(values):
            if i < len(params):
                name, kind = params[i]
            elif self._star is not None:
                name, kind = f"{self._star[0]}[{i - len(params)}]", self._star[1]
            else:
                break  # more values than parameters: the call itself says so
            if not _passthrough(kind):
                out[i] = decode(value, kind, what=what, path=name)
        return out

    def decode_result(self, value: Any, *, what: str) -> Any:
        """``value`` decoded to the function's return type (an ``async def``'s awaited type)."""
        self._load()
        kind = self._result
        if _passthrough(kind):
            return value
        return decode(value, kind, what=what, path="")

    def result_decoder(self, what: str) -> Callable[[Any], Any]:
        return lambda value: self.decode_result(value, what=what)


#: Handlers' hints by code object: a handler defined inside the workflow function is a new
#: function on each execution of the code, with the same code and annotations.
_HANDLER_HINTS: weakref.WeakKeyDictionary[Any, tuple[dict[str, Any], Hints]] = weakref.WeakKeyDictionary()


def handler_hints(handler: Callable[..., Any]) -> Hints:
    """The hints of a signal or query handler, read once per handler code."""
    target: Any = handler.__func__ if inspect.ismethod(handler) else handler
    code = getattr(target, "__code__", None)
    annotations = getattr(target, "__annotations__", None)
    if code is None or not isinstance(annotations, dict):
        return Hints(handler)  # a callable object: read on each registration
    found = _HANDLER_HINTS.get(code)
    if found is None or found[0] != annotations:
        found = (dict(annotations), Hints(target, skip=1 if target is not handler else 0))
        _HANDLER_HINTS[code] = found
    return found[1]
