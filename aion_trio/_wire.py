"""The one place events are converted to and from their JSON wire form.

Wire form of an event::

    {"workflow_id": "...", "seq": 1, "recorded_at": "2026-01-01T00:00:00+00:00",
     "type": "ActivityCompleted", "data": {...}}

Field encodings inside ``data``: payloads inline as JSON values (an absent
optional payload is an absent key, so a present ``null`` is the payload
``null``), other absent optionals are ``null``, datetimes as ISO-8601 in UTC,
durations as float seconds, enums by value, tuples as lists, nested error
records as objects.  ``NaN`` and infinities are not JSON and are refused both
ways.  Unknown types, unknown fields, missing fields and ill-typed values are
:class:`EventDecodeError`.  The form is pinned by golden files in
``tests/golden``.

Stores keep the ``data`` object as text (:func:`body_data_json`, payload text
spliced in as is).  Reading it back (:func:`body_from_data_json`,
:func:`events_from_rows`) goes through a decoder compiled once per event type
for that layout: one shared strict JSON scanner checks every value as
strictly as a full parse, and a payload keeps the slice of text it was
stored as (no parse into Python values, no re-encoding).  Text in any other
layout takes the general path (parse, convert), which raises the typed error.
"""

from __future__ import annotations

import enum
import json
import math
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime, timedelta, timezone
from typing import Any, Union

import attrs

from ._errors import EventDecodeError, StoreDecodeError
from ._events import (
    EVENT_TYPES,
    EXACT_TYPE_REFUSALS,
    OMIT_EMPTY,
    OMIT_NONE,
    ActivityError,
    ErrorInfo,
    Event,
    EventBody,
)
from ._payload import Payload

_SEPARATORS = (",", ":")
_MISSING = object()
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
# Compact JSON text, exactly as ``json.dumps(value, separators=_SEPARATORS,
# ensure_ascii=False, allow_nan=False)`` writes it (one encoder, built once).
_ENCODER = json.JSONEncoder(separators=_SEPARATORS, ensure_ascii=False, allow_nan=False)
_encode_json = _ENCODER.encode
_encode_str: Callable[[str], str] = json.encoder.encode_basestring


def _refuse_constant(name: str) -> Any:
    raise EventDecodeError(f"{name} is not valid JSON (only finite numbers are)")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise EventDecodeError(f"number {text} is out of range for a float")
    return value


#: The one strict decoder (``json.loads`` with hooks would build a new one per call).
_DECODER = json.JSONDecoder(parse_constant=_refuse_constant, parse_float=_finite_float)
#: Its C scanner: ``scan(text, index) -> (value, end)``, ``StopIteration`` if no value starts there.
_scan: Callable[[str, int], tuple[Any, int]] = _DECODER.scan_once  # type: ignore[attr-defined]


def _loads(text: str | bytes) -> Any:
    """Strict JSON parsing: ``NaN``/``Infinity`` and overflowing floats are refused.

    The same checks and errors as ``json.loads(text, parse_constant=..., parse_float=...)``,
    through the one shared decoder.
    """
    if isinstance(text, str):
        if text.startswith("\ufeff"):
            raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
    elif isinstance(text, (bytes, bytearray)):
        text = text.decode(json.detect_encoding(text), "surrogatepass")
    else:
        raise TypeError(f"the JSON object must be str, bytes or bytearray, not {type(text).__name__}")
    return _DECODER.decode(text)


def _format_dt(value: datetime) -> str:
    return value.astimezone(timezone.utc).isoformat()


def _parse_dt(value: object) -> datetime:
    if not isinstance(value, str):
        raise EventDecodeError(f"expected an ISO-8601 string, got {value!r}")
    text = value[:-1] + "+00:00" if value.endswith("Z") else value
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        raise EventDecodeError(f"{value!r} is not an ISO-8601 datetime") from None
    if parsed.tzinfo is None:
        raise EventDecodeError(f"datetime {value!r} has no timezone")
    return parsed.astimezone(timezone.utc)


@attrs.frozen
class _FieldCodec:
    encode: Callable[[Any], Any]
    decode: Callable[[Any], Any]
    #: Encode ``None`` by omitting the key (only for optional payloads).
    omit_none: bool = False
    #: Encode an empty mapping by omitting the key.
    omit_empty: bool = False
    #: The value straight to compact JSON text: the same text as dumping ``encode(value)``,
    #: except that payload text is spliced in as it is (the append hot path).
    text: Callable[[Any], str] | None = None

    def to_text(self, value: Any) -> str:
        if self.text is not None:
            return self.text(value)
        return _encode_json(self.encode(value))


def _expect(kind: type | tuple[type, ...], name: str) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
            raise EventDecodeError(f"expected {name}, got {value!r}")
        if not isinstance(value, kind):
            raise EventDecodeError(f"expected {name}, got {value!r}")
        return value

    return check


def _identity(value: Any) -> Any:
    return value


def _encode_payload(payload: Payload) -> Any:
    return payload.value()


def _payload_text(payload: Payload) -> str:
    return payload.json


def _int_text(value: int) -> str:
    return int.__repr__(value) if type(value) is int else _encode_json(value)


def _bool_text(value: bool) -> str:
    return ("true" if value else "false") if type(value) is bool else _encode_json(value)


def _datetime_text(value: datetime) -> str:
    return _encode_str(_format_dt(value))


def _codec_for(tp: Any) -> _FieldCodec:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (Union, types.UnionType) and type(None) in args:
        (inner,) = (a for a in args if a is not type(None))
        inner_codec = _codec_for(inner)

        def enc_opt(value: Any) -> Any:
            return None if value is None else inner_codec.encode(value)

        def dec_opt(value: Any) -> Any:
            return None if value is None else inner_codec.decode(value)

        def text_opt(value: Any) -> str:
            return "null" if value is None else inner_codec.to_text(value)

        if inner is Payload:
            # None is an absent key, so a present null is the JSON payload null.
            return _FieldCodec(enc_opt, inner_codec.decode, omit_none=True, text=text_opt)
        return _FieldCodec(enc_opt, dec_opt, text=text_opt)
    if tp is Payload:

        def dec_payload(value: Any) -> Payload:
            return Payload.trusted(_encode_json(value))

        return _FieldCodec(_encode_payload, dec_payload, text=_payload_text)
    if tp is str:
        return _FieldCodec(_identity, _expect(str, "a string"), text=_encode_str)
    if tp is bool:
        return _FieldCodec(_identity, _expect(bool, "a boolean"), text=_bool_text)
    if tp is int:
        return _FieldCodec(_identity, _expect(int, "an integer"), text=_int_text)
    if tp is datetime:
        return _FieldCodec(_format_dt, _parse_dt, text=_datetime_text)
    if tp is timedelta:

        def dec_td(value: Any) -> timedelta:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise EventDecodeError(f"expected a duration in seconds, got {value!r}")
            try:
                return timedelta(seconds=value)
            except (OverflowError, ValueError):
                raise EventDecodeError(f"duration {value!r} seconds is out of range") from None

        return _FieldCodec(lambda td: td.total_seconds(), dec_td)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        enum_type = tp

        def dec_enum(value: Any) -> Any:
            try:
                return enum_type(value)
            except ValueError:
                allowed = ", ".join(repr(m.value) for m in enum_type)
                raise EventDecodeError(
                    f"{value!r} is not a valid {enum_type.__name__} (one of {allowed})"
                ) from None

        return _FieldCodec(lambda e: e.value, dec_enum)
    if tp in (ErrorInfo, ActivityError):
        return _FieldCodec(lambda v: _encode_attrs(v), lambda v: _decode_attrs(tp, v), text=_attrs_text)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        item = _codec_for(args[0])

        def dec_tuple(value: Any) -> tuple[Any, ...]:
            if not isinstance(value, list):
                raise EventDecodeError(f"expected a list, got {value!r}")
            return tuple(item.decode(v) for v in value)

        return _FieldCodec(lambda t: [item.encode(v) for v in t], dec_tuple)
    if origin is Mapping or tp is Mapping:
        # Search attributes: JSON object; list values become tuples via the
        # body's own converter, which also validates names and values.
        def enc_map(value: Mapping[str, Any]) -> dict[str, Any]:
            return {k: list(v) if isinstance(v, tuple) else v for k, v in value.items()}

        def dec_map(value: Any) -> dict[str, Any]:
            if not isinstance(value, dict):
                raise EventDecodeError(f"expected an object, got {value!r}")
            return value

        return _FieldCodec(enc_map, dec_map)
    raise TypeError(f"no wire codec for field type {tp!r}")  # pragma: no cover - import-time


_CODECS: dict[type, dict[str, _FieldCodec]] = {}


def _field_codec(field: attrs.Attribute[Any], hint: Any) -> _FieldCodec:
    codec = _codec_for(hint)
    if field.metadata.get(OMIT_NONE) and not codec.omit_none:
        codec = attrs.evolve(codec, omit_none=True)
    if field.metadata.get(OMIT_EMPTY):
        codec = attrs.evolve(codec, omit_empty=True)
    return codec


def _codecs(cls: type) -> dict[str, _FieldCodec]:
    found = _CODECS.get(cls)
    if found is None:
        import aion_trio._events as events_module

        hints = typing.get_type_hints(cls, vars(events_module))
        found = {f.name: _field_codec(f, hints[f.name]) for f in attrs.fields(cls)}
        _CODECS[cls] = found
    return found


def register_wire_record(cls: type, namespace: Mapping[str, Any]) -> None:
    """Give another frozen attrs record of the domain model (an inbox command) the field
    encodings events use; ``namespace`` resolves its annotations."""
    hints = typing.get_type_hints(cls, dict(namespace))
    _CODECS[cls] = {f.name: _field_codec(f, hints[f.name]) for f in attrs.fields(cls)}


def record_to_wire(value: Any) -> dict[str, Any]:
    """The ``data`` object of a record registered with :func:`register_wire_record`."""
    return _encode_attrs(value)


def record_from_wire(cls: type, data: object) -> Any:
    """Build a registered record from its ``data`` object (``EventDecodeError`` if malformed)."""
    return _decode_attrs(cls, data)


def loads_strict(text: str | bytes) -> Any:
    """Strict JSON parsing: ``NaN``/``Infinity`` and overflowing floats are refused."""
    return _loads(text)


def _encode_attrs(value: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, codec in _codecs(type(value)).items():
        field_value = getattr(value, name)
        if field_value is None and codec.omit_none:
            continue
        if codec.omit_empty and not field_value:
            continue
        out[name] = codec.encode(field_value)
    return out


_TEXT_ENCODERS: dict[type, Callable[[Any], str]] = {}
#: The same, for the event body types only (checked once, then looked up by type alone).
_BODY_TEXT_ENCODERS: dict[type, Callable[[Any], str]] = {}


def _compile_text_encoder(cls: type) -> Callable[[Any], str]:
    """Build ``value -> compact JSON text`` for the attrs class ``cls``.

    The generated function concatenates, in field order, each key and its
    value's text (``'{"a":' + f0(v.a) + ',"b":' + f1(v.b) + '}'``); an
    optional payload field that is ``None`` is left out.  Field names come
    from ``attrs.fields`` (identifiers) and every key is embedded with ``repr``.
    """
    codecs = _codecs(cls)
    namespace: dict[str, Any] = {"ej": _encode_json}
    texts: list[str] = []
    for i, (name, codec) in enumerate(codecs.items()):
        namespace[f"f{i}"] = text = codec.text or codec.to_text
        inline = _INLINE_TEXT.get(text)
        texts.append(f"f{i}(v.{name})" if inline is None else inline.replace("READ", f"v.{name}"))
    keys = [_encode_str(name) + ":" for name in codecs]
    if any(codec.omit_none or codec.omit_empty for codec in codecs.values()):
        lines = ["def encode(v):", "    parts = []"]
        for i, (name, codec) in enumerate(codecs.items()):
            append = f"parts.append({keys[i]!r} + {texts[i]})"
            if codec.omit_none:
                lines.append(f"    if v.{name} is not None: {append}")
            elif codec.omit_empty:
                lines.append(f"    if v.{name}: {append}")
            else:
                lines.append(f"    {append}")
        lines.append('    return "{" + ",".join(parts) + "}"')
    else:
        # Every key always present: one concatenation.
        pieces = [f"{('{' if i == 0 else ',') + keys[i]!r} + {texts[i]}" for i in range(len(codecs))]
        lines = ["def encode(v):", "    return " + (" + ".join(pieces) or "'{'") + " + '}'"]
    exec("\n".join(lines), namespace)
    encode: Callable[[Any], str] = namespace["encode"]
    return encode


#: Text functions a compiled encoder writes inline, as an expression of the field's value
#: (``READ``, read once): no call per field for the commonest kinds.
_INLINE_TEXT: dict[Callable[[Any], str], str] = {
    _int_text: "(int.__repr__(x) if type(x := READ) is int else ej(x))",
    _payload_text: "READ.json",
}


def _attrs_text(value: Any) -> str:
    """Compact JSON text of ``_encode_attrs(value)``, payload text spliced in unparsed."""
    cls = type(value)
    encode = _TEXT_ENCODERS.get(cls)
    if encode is None:
        encode = _TEXT_ENCODERS[cls] = _compile_text_encoder(cls)
    return encode(value)


def _decode_attrs(cls: type, data: Any) -> Any:
    if not isinstance(data, dict):
        raise EventDecodeError(f"{cls.__name__}: expected an object, got {data!r}")
    codecs = _codecs(cls)
    unknown = sorted(set(data) - set(codecs))
    if unknown:
        raise EventDecodeError(f"{cls.__name__}: unknown field(s) {', '.join(map(repr, unknown))}")
    kwargs: dict[str, Any] = {}
    for field in attrs.fields(cls):
        codec = codecs[field.name]
        raw = data.get(field.name, _MISSING)
        if raw is _MISSING:
            if field.default is attrs.NOTHING:
                raise EventDecodeError(f"{cls.__name__}: missing field {field.name!r}")
            continue
        try:
            kwargs[field.name] = codec.decode(raw)
        except EventDecodeError as exc:
            raise EventDecodeError(f"{cls.__name__}.{field.name}: {exc}") from None
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:
        raise EventDecodeError(f"{cls.__name__}: {exc}") from exc


# --------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------


def body_to_wire(body: EventBody) -> tuple[str, dict[str, Any]]:
    """Return ``(type_name, data)`` for an event body."""
    name = type(body).__name__
    if EVENT_TYPES.get(name) is not type(body):
        raise TypeError(f"{type(body).__qualname__} is not an event body type")
    return name, _encode_attrs(body)


def body_from_wire(type_name: object, data: object) -> EventBody:
    """Build an event body from its wire type name and data object."""
    if not isinstance(type_name, str):
        raise EventDecodeError(f"event type must be a string, got {type_name!r}")
    cls = EVENT_TYPES.get(type_name)
    if cls is None:
        raise EventDecodeError(f"unknown event type {type_name!r}")
    result: EventBody = _decode_attrs(cls, data)
    return result


def body_data_json(body: EventBody) -> tuple[str, str]:
    """Return ``(type_name, data_as_compact_json_text)``: the form stores keep in a column.

    Payloads are already JSON text, so they are spliced in as they are rather
    than parsed and re-serialised (the hot path of every append).
    """
    cls = type(body)
    encode = _BODY_TEXT_ENCODERS.get(cls)
    if encode is None:
        if EVENT_TYPES.get(cls.__name__) is not cls:
            raise TypeError(f"{cls.__qualname__} is not an event body type")
        encode = _BODY_TEXT_ENCODERS[cls] = _TEXT_ENCODERS.get(cls) or _compile_text_encoder(cls)
    return cls.__name__, encode(body)


def body_from_data_json(type_name: object, data_text: str | bytes) -> EventBody:
    """Build an event body from the ``data`` text a store keeps (``EventDecodeError`` if malformed).

    Text in the layout :func:`body_data_json` writes is decoded by the type's
    compiled decoder: payloads keep the text stored for them, unparsed into
    Python values.  Anything else (other spacing or key order, an unknown or
    missing field, a bad value) takes the general path, which raises the
    typed error naming what is wrong.
    """
    decode = _DATA_DECODERS.get(type_name) if type(type_name) is str else None
    if decode is None and type(type_name) is str and type_name in EVENT_TYPES:
        decode = data_decoder(type_name)
    if decode is not None:
        body: EventBody | None
        try:
            if type(data_text) is str:
                body = decode(data_text)
            elif isinstance(data_text, (bytes, bytearray)):
                body = decode(data_text.decode("utf-8"))
            else:
                body = None
        except _NOT_THE_FAST_LAYOUT:
            body = None
        if body is not None:
            return body
    try:
        data = _loads(data_text)
    except (ValueError, TypeError) as exc:
        raise EventDecodeError(f"{type_name} data is not valid JSON: {exc}") from None
    return body_from_wire(type_name, data)


def events_from_rows(
    workflow_id: str,
    rows: Iterable[Sequence[Any]],
    recorded_at: Callable[[Any], datetime],
    location: str,
) -> list[Event]:
    """The events of ``(seq, recorded_at, type, data)`` rows a store read for ``workflow_id``.

    ``recorded_at(raw)`` turns the stored timestamp into an aware UTC datetime
    (a store-specific form; a bad one raises ``EventDecodeError``, ``ValueError``
    or ``TypeError``); ``data`` must be the JSON text :func:`body_data_json` gave.
    A bad row raises :class:`StoreDecodeError` naming the workflow, its seq and
    ``location``.  The envelope is checked in full once, then each event is
    built without re-running the checks its first one passed (the same
    workflow id; a timestamp converted once per distinct stored value).
    """
    out: list[Event] = []
    append = out.append
    decoders = _DATA_DECODERS
    new = object.__new__
    set_workflow_id, set_seq, set_recorded_at, set_body = _EVENT_SETTERS
    checked = False
    last_raw: Any = _MISSING
    at = _EPOCH  # replaced by the first row's (``last_raw`` matches no stored value)
    seq: Any = None
    try:
        for seq, raw_at, type_name, data in rows:
            if raw_at != last_raw or type(raw_at) is not type(last_raw):
                at = recorded_at(raw_at)
                last_raw = raw_at
            if type(data) is not str:
                raise EventDecodeError(f"event data is a {type(data).__name__}, not JSON text")
            # body_from_data_json, its compiled decoder called here directly (the hot loop).
            decode = decoders.get(type_name) if type(type_name) is str else None
            body = None
            if decode is not None:
                try:
                    body = decode(data)
                except _NOT_THE_FAST_LAYOUT:
                    body = None
            if body is None:
                body = body_from_data_json(type_name, data)
            if checked and type(seq) is int and seq > 0 and at.tzinfo is timezone.utc:
                event = new(Event)
                set_workflow_id(event, workflow_id)
                set_seq(event, seq)
                set_recorded_at(event, at)
                set_body(event, body)
            else:
                event = Event(workflow_id=workflow_id, seq=seq, recorded_at=at, body=body)
                checked = True
            append(event)
    except (EventDecodeError, ValueError, TypeError, OverflowError) as exc:
        raise StoreDecodeError(workflow_id, seq, str(exc), location=location) from exc
    return out


# --------------------------------------------------------------------------
# Decoders compiled once per event type (the read path of every store)
# --------------------------------------------------------------------------

#: Event type name -> ``data text -> body``, or ``None`` when the text is not in the layout
#: the encoder writes.  Filled on first use of each type.
_DATA_DECODERS: dict[str, Callable[[str], EventBody | None]] = {}
#: What a compiled decoder may raise on text it cannot take (the general path then
#: decodes it, or raises the typed error): JSON and value errors, a text cut short.
_NOT_THE_FAST_LAYOUT = (ValueError, TypeError, IndexError, StopIteration, OverflowError)
_EXACT_TYPES = (str, int, bool)


def data_decoder(type_name: str) -> Callable[[str], EventBody | None]:
    """The decoder compiled for the event type ``type_name`` (compiled on first use).

    It takes ``data`` text in the layout :func:`body_data_json` writes and returns
    the body, or ``None`` (or raises ``ValueError``, ``TypeError``, ``IndexError`` or
    ``StopIteration``) for any other text: :func:`body_from_data_json` then takes
    the general path.
    """
    decode = _DATA_DECODERS.get(type_name)
    if decode is None:
        decode = _DATA_DECODERS[type_name] = _compile_data_decoder(EVENT_TYPES[type_name])
    return decode


def _compile_data_decoder(cls: type) -> Callable[[str], EventBody | None]:
    """Build ``text -> body`` for the body type ``cls``, for the layout :func:`body_data_json` writes.

    That layout is a compact object with the fields as keys in declaration order,
    an absent key standing for a field's default.  The generated function walks it
    with the shared C scanner: each key is matched as a literal, each value
    scanned (so it is checked as strictly as the general path checks it), a payload
    kept as the slice of text it was scanned from, a str, int or bool field checked
    by its exact type, any other field converted by its codec.  The body is built by
    the class itself, so its validators run.  On any departure from the layout it
    returns ``None`` or raises one of ``_NOT_THE_FAST_LAYOUT``.
    """
    import aion_trio._events as events_module

    codecs = _codecs(cls)
    hints = typing.get_type_hints(cls, vars(events_module))
    namespace: dict[str, Any] = {"cls": cls, "scan": _scan, "trusted": Payload.trusted}
    lines = [
        "def decode(s):",
        "    if s[0] != '{':",
        "        return None",
        "    more = s[1] != '}'",
        "    i = 1 if more else 2",
    ]
    arguments = []
    for k, field in enumerate(attrs.fields(cls)):
        name = field.name
        tp = hints[name]
        optional = _value_type(tp) is not tp
        inner = _value_type(tp)
        key = _encode_str(name) + ":"
        lines += [f"    if more and s.startswith({key!r}, i):", f"        j = i + {len(key)}"]
        if inner in _EXACT_TYPES:
            namespace[f"t{k}"] = inner
            check = f"type(v) is not t{k}"
            if optional:
                check = f"v is not None and {check}"
            lines += [
                "        v, i = scan(s, j)",
                f"        if {check}:",
                "            return None",
                f"        a{k} = v",
            ]
        else:
            # A payload (or a value a codec converts) is often the same text as in the
            # previous event of this type (activity options, inputs): the value decoded
            # then is reused, and nothing is scanned.  Sound: a value scanned whole
            # before, found again here and followed by ',' or '}', scans to the same end
            # (a longer value that begins with it, "12" after "1", is scanned; anything
            # else after it fails the separator check below and takes the general path).
            namespace[f"m{k}"] = [("", None)]
            if inner is Payload:
                convert = "trusted(t)"
            else:
                namespace[f"d{k}"] = codecs[name].decode
                convert = f"d{k}(v)"
            lines += [
                f"        t, a{k} = m{k}[0]",
                "        e = j + len(t)",
                "        if t and s.startswith(t, j) and s[e] in ',}':",
                "            i = e",
                "        else:",
                "            v, i = scan(s, j)",
                "            t = s[j:i]",
                f"            a{k} = {convert}",
                f"            m{k}[0] = (t, a{k})",
            ]
        lines += [
            "        c = s[i]",
            "        i += 1",
            "        if c != ',':",
            "            if c != '}':",
            "                return None",
            "            more = False",
            "    else:",
        ]
        if field.default is attrs.NOTHING:
            lines.append("        return None")
        elif isinstance(field.default, attrs.Factory):  # type: ignore[arg-type]
            namespace[f"f{k}"] = field.default.factory
            lines.append(f"        a{k} = f{k}()")
        else:
            namespace[f"f{k}"] = field.default
            lines.append(f"        a{k} = f{k}")
        arguments.append(f"{name}=a{k}")
    lines += ["    if more or i != len(s):", "        return None"]
    if any(field.converter is not None for field in attrs.fields(cls)):
        lines.append(f"    return cls({', '.join(arguments)})")
    else:
        lines += _construction(cls, [_value_type(hints[f.name]) for f in attrs.fields(cls)], namespace)
    exec("\n".join(lines), namespace)
    decoder: Callable[[str], EventBody | None] = namespace["decode"]
    return decoder


def field_setter(cls: type, name: str) -> Callable[[Any, Any], None]:
    """``set(obj, value)``: store field ``name`` of a ``cls`` built without ``__init__``.

    A slotted class's field is set through its slot's descriptor directly (no lookup
    of the name on each call, as ``object.__setattr__`` makes); otherwise as
    ``object.__setattr__`` sets it (a frozen class refuses ``setattr``).
    """
    for base in cls.__mro__:
        slot = base.__dict__.get(name)
        if slot is not None:
            if isinstance(slot, types.MemberDescriptorType):
                setter: Callable[[Any, Any], None] = slot.__set__
                return setter
            break
    return _setattr_of(name)


def _setattr_of(name: str) -> Callable[[Any, Any], None]:
    def set_field(obj: Any, value: Any) -> None:
        object.__setattr__(obj, name, value)

    return set_field


def _value_type(tp: Any) -> Any:
    """``X`` for a field annotated ``X | None``, else the annotation itself."""
    if typing.get_origin(tp) in (Union, types.UnionType) and type(None) in typing.get_args(tp):
        return next(a for a in typing.get_args(tp) if a is not type(None))
    return tp


def _construction(cls: type, value_types: list[Any], namespace: dict[str, Any]) -> list[str]:
    """Lines building ``cls`` from the decoded ``a0, a1, ...`` without its ``__init__``.

    The checks its validators make are made here, each in the cheapest form that
    refuses exactly what it refuses: the simple ones written out, those the
    decoder's exact-type checks already made left out, any other validator
    called as ``__init__`` would call it.  A refusal returns ``None`` (or raises),
    so the general path builds the body through ``__init__`` and raises its error.
    """
    namespace["new"] = object.__new__
    lines = []
    for k, field in enumerate(attrs.fields(cls)):
        validator = field.validator
        if validator is None:
            continue
        kind, refusal = EXACT_TYPE_REFUSALS.get(validator, (None, None))
        if kind is not None and value_types[k] is kind:
            # The decoder checked the exact type (or built the Payload) already.
            if refusal is not None:
                lines += [f"    if {refusal.format(value=f'a{k}')}:", "        return None"]
        else:
            namespace[f"v{k}"] = validator
            namespace[f"field{k}"] = field
            lines.append(f"    v{k}(None, field{k}, a{k})")
    lines.append("    o = new(cls)")
    for k, field in enumerate(attrs.fields(cls)):
        namespace[f"s{k}"] = field_setter(cls, field.name)
        lines.append(f"    s{k}(o, a{k})")
    lines.append("    return o")
    return lines


#: The setters of an ``Event``'s fields, in the order ``events_from_rows`` stores them.
_EVENT_SETTERS = tuple(field_setter(Event, name) for name in ("workflow_id", "seq", "recorded_at", "body"))

_ENVELOPE_KEYS = frozenset({"workflow_id", "seq", "recorded_at", "type", "data"})


def event_to_wire(event: Event) -> dict[str, Any]:
    name, data = body_to_wire(event.body)
    return {
        "workflow_id": event.workflow_id,
        "seq": event.seq,
        "recorded_at": _format_dt(event.recorded_at),
        "type": name,
        "data": data,
    }


def event_from_wire(obj: object) -> Event:
    if not isinstance(obj, dict):
        raise EventDecodeError(f"an event must be a JSON object, got {obj!r}")
    unknown = sorted(set(obj) - _ENVELOPE_KEYS)
    if unknown:
        raise EventDecodeError(f"event envelope: unknown field(s) {', '.join(map(repr, unknown))}")
    missing = sorted(_ENVELOPE_KEYS - set(obj))
    if missing:
        raise EventDecodeError(f"event envelope: missing field(s) {', '.join(map(repr, missing))}")
    workflow_id = obj["workflow_id"]
    seq = obj["seq"]
    if not isinstance(workflow_id, str):
        raise EventDecodeError(f"event envelope: workflow_id must be a string, got {workflow_id!r}")
    if isinstance(seq, bool) or not isinstance(seq, int):
        raise EventDecodeError(f"event envelope: seq must be an integer, got {seq!r}")
    try:
        recorded_at = _parse_dt(obj["recorded_at"])
    except EventDecodeError as exc:
        raise EventDecodeError(f"event envelope: recorded_at: {exc}") from None
    body = body_from_wire(obj["type"], obj["data"])
    try:
        return Event(workflow_id=workflow_id, seq=seq, recorded_at=recorded_at, body=body)
    except (ValueError, TypeError) as exc:
        raise EventDecodeError(f"event envelope: {exc}") from exc


def event_to_json(event: Event) -> str:
    """The wire form of ``event`` (compact JSON text), as a store persists it; ``event_from_json`` reads it back."""
    return _encode_json(event_to_wire(event))


def event_from_json(text: str | bytes) -> Event:
    """The event ``event_to_json`` wrote; text that is not a valid event raises ``EventDecodeError``."""
    try:
        obj = _loads(text)
    except (ValueError, TypeError) as exc:
        raise EventDecodeError(f"event is not valid JSON: {exc}") from None
    return event_from_wire(obj)


def format_datetime(value: datetime) -> str:
    """The wire form of a datetime (ISO-8601, UTC)."""
    return _format_dt(value)


def parse_datetime(value: str) -> datetime:
    """A datetime from its wire form (ISO-8601 with a timezone), as aware UTC; else ``EventDecodeError``."""
    return _parse_dt(value)
