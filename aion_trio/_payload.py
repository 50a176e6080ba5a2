"""JSON payloads with size limits.

A :class:`Payload` is an immutable, already-encoded JSON document.  Events
hold payloads, never live Python objects, so an event is frozen all the way
down and replay sees exactly the bytes that were recorded.  Conversion from
and to Python values happens at the edge, in :class:`PayloadCodec`.
"""

from __future__ import annotations

import dataclasses
import decimal
import enum
import json
import logging
import math
import sys
import uuid
from collections.abc import Callable
from datetime import date, time
from typing import Any, final

import attrs

from ._errors import PayloadNotSerializable, PayloadTooLarge

logger = logging.getLogger("aion_trio.payload")

DEFAULT_WARN_BYTES = 256 * 1024
DEFAULT_MAX_BYTES = 2 * 1024 * 1024

_SEPARATORS = (",", ":")
#: Compact JSON text: one encoder for every payload (``json.dumps`` with options builds one per call).
_encode_any = json.JSONEncoder(separators=_SEPARATORS, ensure_ascii=False, allow_nan=False).encode


def _not_json(value: object) -> Any:
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _tree_encoder() -> Callable[[Any], str]:
    """Compact JSON text of checked data, through one C encoder built once.

    ``JSONEncoder.encode`` builds its C encoder on every call, which costs more
    than encoding a small payload.  Checked data is a tree at most 200 levels
    deep (the checks refuse deeper nesting, so cycles too): this encoder keeps
    no record of the containers it is inside.  Where the C encoder is missing
    or does not answer as expected, the general encoder is used.
    """
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:  # pragma: no cover - CPython has it
        return _encode_any
    try:
        encoder = make(None, _not_json, json.encoder.encode_basestring, None, ":", ",", False, False, False)

        def encode(data: Any) -> str:
            return "".join(encoder(data, 0))

        sample = {"a": [1, 2.5, "é\n", None, True], "b": {}}
        if encode(sample) != _encode_any(sample) or encode("x") != '"x"':  # pragma: no cover
            return _encode_any
    except (TypeError, ValueError):  # pragma: no cover - another signature
        return _encode_any
    return encode


_encode = _tree_encoder()
#: The default decoder's scanner: ``Payload.value`` of compact text without ``json.loads``'s wrapping.
_scan_default: Callable[[str, int], tuple[Any, int]] = json.decoder.JSONDecoder().scan_once  # type: ignore[attr-defined]
#: Python refuses to print (and to parse) ints of more than 4300 digits; stay under that.
_MAX_INT_BITS = 14_000


def _check_json(value: Any, path: str, what: str, depth: int = 0) -> Any:
    """Return ``value`` as plain JSON data, or raise naming the offending path."""
    if depth > 200:
        raise PayloadNotSerializable(what, path, "nested more than 200 levels deep")
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > _MAX_INT_BITS:
        raise PayloadNotSerializable(
            what, path, f"an int of {value.bit_length()} bits is too large for JSON here; pass it as a str"
        )
    if value is None or isinstance(value, (bool, str, int)):
        return value
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            raise PayloadNotSerializable(what, path, f"{value!r} is not valid JSON")
        return value
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise PayloadNotSerializable(
                    what,
                    path,
                    f"dict key {k!r} is a {type(k).__name__}; JSON object keys must be str",
                )
            out[k] = _check_json(v, f"{path}[{k!r}]", what, depth + 1)
        return out
    if isinstance(value, (list, tuple)):
        return [_check_json(v, f"{path}[{i}]", what, depth + 1) for i, v in enumerate(value)]
    if attrs.has(type(value)):
        return _check_json(attrs.asdict(value, recurse=False), path, what, depth + 1)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        return _check_json(fields, path, what, depth + 1)
    if isinstance(value, enum.Enum):
        return _check_json(value.value, path, what, depth + 1)
    if isinstance(value, (date, time)):  # datetime is a date
        return value.isoformat()
    if isinstance(value, (uuid.UUID, decimal.Decimal)):
        return str(value)
    if isinstance(value, (set, frozenset)):
        try:
            ordered = sorted(value)  # a stable order: the same set records the same text on replay
        except TypeError:
            raise PayloadNotSerializable(
                what, path, "a set is encoded as a sorted list, and this one's items cannot be sorted"
            ) from None
        return _check_json(ordered, path, what, depth + 1)
    pydantic = sys.modules.get("pydantic")  # never imported here: a model means the caller has it
    if pydantic is not None and isinstance(value, pydantic.BaseModel):
        return _check_json(value.model_dump(mode="json"), path, what, depth + 1)
    raise PayloadNotSerializable(
        what,
        path,
        f"object of type {type(value).__qualname__} is not JSON-serialisable; pass dicts, lists, "
        "str, int, float, bool, None, attrs/dataclass instances, pydantic models, enums, datetimes, UUIDs or Decimals",
    )


def _is_plain(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` is already plain JSON data :func:`_check_json` accepts as it is.

    Exact types only (no subclasses, tuples, attrs or dataclass instances): for
    such a value the checked copy dumps to the same text as the value itself, so
    the common case skips building the copy and the error paths.  Anything else
    answers ``False`` and goes the full way.
    """
    kind = type(value)
    if kind is str or value is None or kind is bool:
        return True
    if kind is int:
        return bool(value.bit_length() <= _MAX_INT_BITS)
    if kind is float:
        return math.isfinite(value)
    if depth >= 200:
        return False
    if kind is list:
        # The common payload (a call's arguments) is a short list of scalars: those are
        # checked here, without a call per item.
        for item in value:
            kind = type(item)
            if kind is str or item is None or kind is bool:
                continue
            if kind is int:
                if item.bit_length() > _MAX_INT_BITS:
                    return False
                continue
            if not _is_plain(item, depth + 1):
                return False
        return True
    if kind is dict:
        return all(type(key) is str and _is_plain(item, depth + 1) for key, item in value.items())
    return False


def _checked(value: Any, what: str) -> Any:
    """``value`` as plain JSON data (itself when it already is), or raise naming the offending path."""
    return value if _is_plain(value) else _check_json(value, "", what)


def _find_unencodable(value: Any, path: str) -> str | None:
    """The path of the first str (value or key) that UTF-8 cannot encode (a lone surrogate)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            found = _find_unencodable(k, f"{path} (key {k!r})") or _find_unencodable(v, f"{path}[{k!r}]")
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = _find_unencodable(v, f"{path}[{i}]")
            if found is not None:
                return found
    return None


def _dumps(data: Any, what: str) -> tuple[str, int]:
    """Compact JSON text of checked ``data`` and its UTF-8 size."""
    text = _encode(data)
    if text.isascii():  # one byte per character: nothing to encode to count them
        return text, len(text)
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        # Rare: find where, to name it (the fast path above costs nothing extra).
        path = _find_unencodable(data, "") or ""
        raise PayloadNotSerializable(
            what, path, "str contains a lone surrogate and cannot be encoded as UTF-8"
        ) from None
    return text, size


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _json_text(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str):
        raise TypeError(f"Payload holds JSON text (a str), got {type(value).__name__}; use Payload.of(value)")
    try:
        json.loads(value, parse_constant=_reject_constant)
    except ValueError as exc:
        raise ValueError(
            f"Payload text is not valid JSON ({exc}); build payloads with Payload.of(value)"
        ) from None


@final
@attrs.frozen(repr=False)
class Payload:
    """An encoded JSON document (compact UTF-8 text).

    Build one with :meth:`of` (from a value) or :meth:`from_json_text`; the
    constructor takes the text as is, and it should be the compact form those
    produce (that is what the wire form round-trips).
    """

    json: str = attrs.field(validator=_json_text)

    @classmethod
    def of(cls, value: Any) -> Payload:
        """Encode ``value`` with no size limit (for engine-made payloads)."""
        data = _checked(value, "payload")
        return cls.trusted(_dumps(data, "payload")[0])

    @classmethod
    def from_json_text(cls, text: str) -> Payload:
        """Normalise JSON ``text`` into a payload; raises ``ValueError`` if invalid."""
        value = json.loads(text, parse_constant=_reject_constant)
        return cls.trusted(_dumps(value, "JSON text")[0])

    @classmethod
    def trusted(cls, text: str) -> Payload:
        """Wrap text this package just produced with ``json.dumps`` (skips re-validation)."""
        payload = object.__new__(cls)
        object.__setattr__(payload, "json", text)
        return payload

    @property
    def size(self) -> int:
        """The encoded size in bytes (UTF-8), as the size limits count it."""
        return len(self.json.encode("utf-8"))

    def value(self) -> Any:
        """Decode into plain JSON data (dicts, lists, str, numbers, bool, None).

        Each call decodes the text again: the caller owns what it gets.
        """
        text = self.json
        try:
            value, end = _scan_default(text, 0)
        except StopIteration:
            return json.loads(text)  # leading whitespace (or no value: its error)
        if end != len(text):
            return json.loads(text)  # trailing whitespace (or extra data: its error)
        return value

    def __repr__(self) -> str:
        text = self.json if len(self.json) <= 60 else self.json[:57] + "..."
        return f"Payload({text})"


NULL = Payload("null")


@final
@attrs.frozen(kw_only=True)
class PayloadCodec:
    """Converts user values to payloads and back, enforcing size limits.

    ``warn_bytes``: an encoded payload larger than this is logged as a warning
    on ``aion_trio.payload``.  ``max_bytes``: larger payloads are refused with
    :class:`PayloadTooLarge` before anything is recorded.
    """

    warn_bytes: int = attrs.field(default=DEFAULT_WARN_BYTES)
    max_bytes: int = attrs.field(default=DEFAULT_MAX_BYTES)

    @warn_bytes.validator
    def _check_warn(self, attribute: attrs.Attribute[int], value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"warn_bytes must be an int, got {value!r}")
        if value <= 0:
            raise ValueError(f"warn_bytes must be positive, got {value}")

    @max_bytes.validator
    def _check_max(self, attribute: attrs.Attribute[int], value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"max_bytes must be an int, got {value!r}")
        if value <= 0:
            raise ValueError(f"max_bytes must be positive, got {value}")
        if value < self.warn_bytes:
            raise ValueError(f"max_bytes ({value}) must be at least warn_bytes ({self.warn_bytes})")

    def encode(self, value: Any, *, what: str = "payload") -> Payload:
        """Encode ``value``; ``what`` names it in errors (e.g. ``"input of charge"``)."""
        data = _checked(value, what)
        text, size = _dumps(data, what)
        if size > self.max_bytes:
            raise PayloadTooLarge(what, size, self.max_bytes)
        if size > self.warn_bytes:
            logger.warning(
                "%s encodes to %d bytes (warning threshold %d, limit %d)",
                what,
                size,
                self.warn_bytes,
                self.max_bytes,
                extra={"payload_bytes": size},
            )
        return Payload.trusted(text)

    def decode(self, payload: Payload) -> Any:
        """The value ``payload`` holds, as plain JSON data."""
        return payload.value()
