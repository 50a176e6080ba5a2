"""Payloads: JSON encoding at the edge, error paths, size limits."""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

import attrs
import pytest
from hypothesis import given, settings, strategies as st

from aion_trio import Payload, PayloadCodec, PayloadError, PayloadNotSerializable, PayloadTooLarge
from aion_trio._payload import DEFAULT_MAX_BYTES, DEFAULT_WARN_BYTES, NULL


class Foo:
    pass


@attrs.frozen
class Money:
    amount: int
    currency: str


@attrs.define
class Order:
    id: int
    total: Money
    tags: list[str]


@dataclasses.dataclass
class Line:
    sku: str
    qty: int
    price: Money | None = None


# --------------------------------------------------------------------------
# Round trips
# --------------------------------------------------------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=200, derandomize=True)
@given(value=json_values)
def test_json_values_round_trip(value: Any) -> None:
    codec = PayloadCodec()
    payload = codec.encode(value)
    assert codec.decode(payload) == value
    assert Payload.of(value) == payload
    assert payload.value() == value
    # Compact, canonical text: re-normalising changes nothing.
    assert Payload.from_json_text(payload.json) == payload
    assert payload.size == len(payload.json.encode("utf-8"))


def test_encoding_is_compact_and_keeps_non_ascii() -> None:
    payload = Payload.of({"a": [1, 2.5, None, True], "é": "✓"})
    assert payload.json == '{"a":[1,2.5,null,true],"é":"✓"}'
    assert payload.size == len(payload.json) + 1 + 2  # é is 2 bytes, ✓ is 3
    assert Payload.of(None) == NULL


def test_tuples_encode_as_lists() -> None:
    assert Payload.of((1, ("a", "b"))).value() == [1, ["a", "b"]]


def test_attrs_and_dataclass_instances_are_encoded_as_objects() -> None:
    order = Order(id=7, total=Money(amount=1250, currency="EUR"), tags=["gift"])
    assert Payload.of(order).value() == {
        "id": 7,
        "total": {"amount": 1250, "currency": "EUR"},
        "tags": ["gift"],
    }
    line = Line(sku="b-1", qty=2, price=Money(amount=5, currency="EUR"))
    assert PayloadCodec().encode([line]).value() == [
        {"sku": "b-1", "qty": 2, "price": {"amount": 5, "currency": "EUR"}}
    ]
    assert Payload.of(Line(sku="x", qty=1)).value() == {"sku": "x", "qty": 1, "price": None}


def test_classes_themselves_are_not_instances() -> None:
    with pytest.raises(PayloadNotSerializable, match="object of type type"):
        Payload.of(Line)


def test_from_json_text_normalises_and_refuses_invalid_json() -> None:
    assert Payload.from_json_text('{ "a" : [1, 2] }').json == '{"a":[1,2]}'
    with pytest.raises(ValueError):
        Payload.from_json_text("{nope")
    with pytest.raises(ValueError):
        Payload.from_json_text("[NaN]")


def test_payload_repr_is_short() -> None:
    assert repr(Payload.of([1])) == "Payload([1])"
    long = Payload.of("x" * 100)
    assert len(repr(long)) < 80
    assert repr(long).endswith("...)")


def test_payload_is_frozen_and_holds_only_text() -> None:
    payload = Payload.of(1)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        payload.json = "2"  # type: ignore[misc]
    with pytest.raises(TypeError, match="Payload holds JSON text"):
        Payload({"a": 1})  # type: ignore[arg-type]


# --------------------------------------------------------------------------
# Not serialisable: the message names the path
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "path", "detail"),
    [
        ({"items": [1, 2, 3, Foo()]}, "['items'][3]", "object of type Foo is not JSON-serialisable"),
        ([{1: "a"}], "[0]", "dict key 1 is a int; JSON object keys must be str"),
        ({("a",): 1}, "", "dict key ('a',) is a tuple"),
        ({"price": float("nan")}, "['price']", "nan is not valid JSON"),
        ([float("inf")], "[0]", "inf is not valid JSON"),
        ([[-float("inf")]], "[0][0]", "-inf is not valid JSON"),
        ({"s": {1, "a"}}, "['s']", "a set is encoded as a sorted list"),
        ({"b": b"bytes"}, "['b']", "object of type bytes"),
        (
            Order(id=1, total=Money(amount=1, currency=Foo()), tags=[]),
            "['total']['currency']",
            "object of type Foo",
        ),  # type: ignore[arg-type]
        ([Line(sku="s", qty=1, price=Foo())], "[0]['price']", "object of type Foo"),  # type: ignore[arg-type]
        ({"k": "lone \ud800 surrogate"}, "['k']", "lone surrogate"),
        ({"lone \udfff key": 1}, " (key 'lone \\udfff key')", "lone surrogate"),
    ],
)
def test_non_serialisable_values_name_the_path(value: Any, path: str, detail: str) -> None:
    with pytest.raises(PayloadNotSerializable) as info:
        PayloadCodec().encode(value, what="input")
    assert info.value.path == path
    assert info.value.what == "input"
    assert str(info.value).startswith(f"input{path}: ")
    assert detail in str(info.value)
    # Payload.of refuses the same values, naming them "payload".
    with pytest.raises(PayloadNotSerializable, match=r"^payload"):
        Payload.of(value)


def test_the_message_of_a_nested_object_reads_like_an_index_expression() -> None:
    with pytest.raises(PayloadNotSerializable) as info:
        PayloadCodec().encode({"items": [0, 1, 2, Foo()]}, what="input")
    assert str(info.value).startswith(
        "input['items'][3]: object of type Foo is not JSON-serialisable; pass dicts, lists"
    )


def test_too_deep_nesting_is_refused() -> None:
    value: Any = []
    for _ in range(300):
        value = [value]
    with pytest.raises(PayloadNotSerializable, match="nested more than 200 levels deep"):
        Payload.of(value)
    shallow: Any = []
    for _ in range(150):
        shallow = [shallow]
    Payload.of(shallow)


def test_payload_errors_are_value_errors() -> None:
    assert issubclass(PayloadNotSerializable, TypeError)
    assert issubclass(PayloadNotSerializable, PayloadError)
    assert issubclass(PayloadTooLarge, ValueError)


# --------------------------------------------------------------------------
# Size limits
# --------------------------------------------------------------------------


def test_defaults_warn_at_256_kib_and_refuse_at_2_mib() -> None:
    codec = PayloadCodec()
    assert (
        (codec.warn_bytes, codec.max_bytes)
        == (DEFAULT_WARN_BYTES, DEFAULT_MAX_BYTES)
        == (256 * 1024, 2 * 1024**2)
    )
    big = "x" * (2 * 1024**2)  # 2 MiB + 2 quote bytes when encoded
    with pytest.raises(PayloadTooLarge) as info:
        codec.encode(big, what="input of upload")
    assert info.value.size == 2 * 1024**2 + 2
    assert info.value.limit == 2 * 1024**2
    assert "input of upload encodes to 2097154 bytes, over the limit of 2097152 bytes" in str(info.value)
    assert "PayloadCodec(max_bytes=...)" in str(info.value)
    codec.encode("x" * (2 * 1024**2 - 2))  # exactly at the limit: accepted


def test_limits_count_utf8_bytes_not_characters() -> None:
    codec = PayloadCodec(warn_bytes=10, max_bytes=10)
    codec.encode("éééé")  # 6 characters, 2 quotes + 8 bytes = 10: at the limit
    with pytest.raises(PayloadTooLarge) as info:
        codec.encode("ééééé")  # 7 characters, 12 bytes
    assert info.value.size == 12


@pytest.mark.parametrize(("text", "size"), [("ab", 4), ("éé", 6), ("✓✓", 8), ("😀", 6)])
def test_size_is_the_utf8_length_of_the_compact_text(text: str, size: int) -> None:
    assert Payload.of(text).size == size
    codec = PayloadCodec(warn_bytes=size, max_bytes=size)
    codec.encode(text)
    with pytest.raises(PayloadTooLarge):
        PayloadCodec(warn_bytes=size - 1, max_bytes=size - 1).encode(text)


def test_over_the_warning_threshold_logs_on_aion_trio_payload(caplog: pytest.LogCaptureFixture) -> None:
    codec = PayloadCodec(warn_bytes=10, max_bytes=100)
    with caplog.at_level(logging.WARNING, logger="aion_trio.payload"):
        codec.encode("x" * 8, what="input of charge")  # 10 bytes: at the threshold, silent
        assert caplog.records == []
        payload = codec.encode("x" * 9, what="input of charge")  # 11 bytes
    assert payload.size == 11
    (record,) = caplog.records
    assert record.name == "aion_trio.payload"
    assert record.levelno == logging.WARNING
    assert record.getMessage() == "input of charge encodes to 11 bytes (warning threshold 10, limit 100)"
    assert record.payload_bytes == 11  # type: ignore[attr-defined]


def test_refused_payloads_are_not_also_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="aion_trio.payload"), pytest.raises(PayloadTooLarge):
        PayloadCodec(warn_bytes=5, max_bytes=10).encode("x" * 20)
    assert caplog.records == []


def test_configurable_limits() -> None:
    codec = PayloadCodec(warn_bytes=1, max_bytes=1_000)
    codec.encode("x" * 998)
    with pytest.raises(PayloadTooLarge, match="limit of 1000 bytes"):
        codec.encode("x" * 999)
    PayloadCodec(warn_bytes=5, max_bytes=5)  # equal is fine


@pytest.mark.parametrize(
    ("kwargs", "exc", "message"),
    [
        ({"warn_bytes": 0}, ValueError, "warn_bytes must be positive, got 0"),
        ({"warn_bytes": -1}, ValueError, "warn_bytes must be positive"),
        ({"max_bytes": 0}, ValueError, "max_bytes must be positive, got 0"),
        (
            {"warn_bytes": 100, "max_bytes": 99},
            ValueError,
            r"max_bytes \(99\) must be at least warn_bytes \(100\)",
        ),
        ({"max_bytes": 1024}, ValueError, r"max_bytes \(1024\) must be at least warn_bytes \(262144\)"),
        ({"warn_bytes": 1.5}, TypeError, "warn_bytes must be an int"),
        ({"max_bytes": "2MiB"}, TypeError, "max_bytes must be an int"),
        ({"max_bytes": True}, TypeError, "max_bytes must be an int"),
    ],
)
def test_invalid_codec_configuration_is_refused(
    kwargs: dict[str, Any], exc: type[Exception], message: str
) -> None:
    with pytest.raises(exc, match=message):
        PayloadCodec(**kwargs)


def test_codec_is_frozen_keyword_only() -> None:
    codec = PayloadCodec()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        codec.max_bytes = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        PayloadCodec(10, 20)  # type: ignore[misc]


# Plain JSON data (exact dict, list, str, int, float, bool, None) is dumped as it
# is, without the checked copy; anything else takes the full way.  Both must give
# the text the full way gives, and refuse what it refuses.

_plain_leaves = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6)
)
_plain_values = st.recursive(
    _plain_leaves,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.lists(inner, max_size=3).map(tuple)
        | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=10,
)


def _reference_text(value: Any) -> str:
    def plain(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        return v

    return json.dumps(plain(value), separators=(",", ":"), ensure_ascii=False, allow_nan=False)


@settings(max_examples=300, derandomize=True)
@given(value=_plain_values)
def test_plain_data_encodes_to_the_text_of_the_checked_copy(value: Any) -> None:
    assert Payload.of(value).json == _reference_text(value)
    assert PayloadCodec().encode(value).json == _reference_text(value)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([1, float("nan")], r"\[1\]"),
        ({"a": [float("inf")]}, r"\['a'\]\[0\]"),
        ({"a": {1: 2}}, "JSON object keys must be str"),
        ([2**20000], "too large for JSON"),
        ([True, 1.5, "x", None, (1, [2])], None),  # a tuple: not plain, accepted the full way
        ([object()], "not JSON-serialisable"),
    ],
)
def test_data_that_is_not_plain_is_refused_naming_where(value: Any, message: str | None) -> None:
    if message is None:
        assert Payload.of(value).json == _reference_text(value)
        return
    with pytest.raises(PayloadNotSerializable, match=message):
        Payload.of(value)


def test_nesting_past_the_limit_is_refused_on_the_plain_path_too() -> None:
    value: Any = 1
    for _ in range(205):
        value = [value]
    with pytest.raises(PayloadNotSerializable, match="200 levels"):
        Payload.of(value)
    ok: Any = 1
    for _ in range(150):
        ok = [ok]
    assert Payload.of(ok).json == "[" * 150 + "1" + "]" * 150


@settings(max_examples=200, derandomize=True)
@given(value=_plain_values, spaced=st.booleans())
def test_value_decodes_the_text_as_json_loads_does_and_fresh_each_time(value: Any, spaced: bool) -> None:
    text = json.dumps(value, ensure_ascii=False) if spaced else Payload.of(value).json
    payload = Payload(f" {text}\n" if spaced else text)
    first = payload.value()
    assert first == json.loads(payload.json)
    if isinstance(first, (list, dict)):
        first.clear()  # the caller owns what it got: the next call decodes again
        assert payload.value() == json.loads(payload.json)


def test_value_of_text_with_extra_data_fails_as_json_loads_does() -> None:
    # Only text built past the checks (trusted) can hold it; value() still refuses it.
    for text in ("[1] [2]", "1 2", '{"a":1}x'):
        with pytest.raises(json.JSONDecodeError, match="Extra data"):
            Payload.trusted(text).value()


def _python_calls(fn: Any) -> int:
    """How many Python functions ``fn()`` calls (C functions not counted)."""
    import sys

    calls = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        if event == "call":
            calls += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def test_a_list_of_scalars_is_checked_in_one_call_and_encodes_as_before() -> None:
    # A call's arguments are encoded on every replayed step: checking a list of scalars
    # costs the same Python calls for one item as for fifty (no call per item).
    codec = PayloadCodec()
    assert _python_calls(lambda: codec.encode([1])) == _python_calls(lambda: codec.encode(list(range(50))))
    args = [1, "é", None, True, 2**64]
    payload = codec.encode(args)
    assert payload.json == json.dumps(args, separators=(",", ":"), ensure_ascii=False)
    # Nested or not-plain items still take the checked way: a tuple inside is listed, a
    # float is checked for finiteness, an int too large for JSON text is refused.
    assert codec.encode([1, (2, 3), 0.5]).json == "[1,[2,3],0.5]"
    with pytest.raises(PayloadNotSerializable, match=r"\[1\]"):
        codec.encode([1, float("nan")])
    with pytest.raises(PayloadNotSerializable, match="too large"):
        codec.encode([1, 2**15_000])
    # The size counts UTF-8 bytes: an ASCII text's length, or the encoded length.
    small = PayloadCodec(warn_bytes=5, max_bytes=5)
    assert small.encode("abc").json == '"abc"'  # 5 characters, 5 bytes
    with pytest.raises(PayloadTooLarge):
        small.encode("éé")  # 4 characters, 6 bytes
    with pytest.raises(PayloadTooLarge):
        small.encode(["ab"])  # 6 characters
