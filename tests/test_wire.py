"""The JSON wire form: golden files, round trips, and every way decoding refuses input."""

from __future__ import annotations

import enum
import json
import os
import typing
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import attrs
import pytest
from _samples import ADDED_VARIANTS, FULL_BODIES, MINIMAL_BODIES, RECORDED_AT, WORKFLOW_ID, sample_events
from hypothesis import HealthCheck, given, settings, strategies as st

import aion_trio._events as events_module
from aion_trio import (
    ActivityError,
    ErrorInfo,
    Event,
    EventBody,
    EventDecodeError,
    MarkerRecorded,
    Payload,
    StoreDecodeError,
)
from aion_trio._events import EVENT_TYPES
from aion_trio._wire import (
    body_from_wire,
    body_to_wire,
    data_decoder,
    event_from_wire,
    event_to_wire,
    loads_strict,
)
from aion_trio.plugin import (
    body_data_json,
    body_from_data_json,
    event_from_json,
    event_to_json,
    events_from_rows,
    format_datetime,
    parse_datetime,
)

GOLDEN = Path(__file__).parent / "golden" / "events.jsonl"
REGEN_ENV = "AION_TRIO_REGEN_GOLDEN"


# --------------------------------------------------------------------------
# Golden file
# --------------------------------------------------------------------------


def _golden_text() -> str:
    return "".join(event_to_json(e) + "\n" for e in sample_events())


def test_golden_file_matches_the_wire_form_byte_for_byte() -> None:
    expected = _golden_text()
    if os.environ.get(REGEN_ENV) == "1":
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(expected, encoding="utf-8", newline="\n")
        pytest.fail("regenerated; review the diff and commit")
    assert GOLDEN.exists(), f"{GOLDEN} is missing; run with {REGEN_ENV}=1 to create it"
    actual = GOLDEN.read_text(encoding="utf-8")
    # Line by line first, so a failure names the event type that changed.
    for want, got in zip(expected.splitlines(), actual.splitlines(), strict=False):
        assert got == want, (
            f"wire form of {json.loads(want)['type']} changed (set {REGEN_ENV}=1 to regenerate)"
        )
    assert actual == expected


def test_golden_file_decodes_to_the_sample_events() -> None:
    lines = GOLDEN.read_text(encoding="utf-8").splitlines()
    assert [event_from_json(line) for line in lines] == sample_events()


def test_golden_file_covers_every_event_type() -> None:
    types_in_golden = {json.loads(line)["type"] for line in GOLDEN.read_text(encoding="utf-8").splitlines()}
    assert types_in_golden == set(EVENT_TYPES)


def test_samples_cover_every_type_with_every_field_set() -> None:
    assert set(FULL_BODIES) == set(EVENT_TYPES)

    def check_all_set(obj: Any, where: str, variants: list[Any]) -> None:
        for field in attrs.fields(type(obj)):
            # A field added later is set in a variant instead (the full sample's line is pinned).
            value = next(
                (v for v in (getattr(o, field.name) for o in (obj, *variants)) if v is not None and v != {}),
                getattr(obj, field.name),
            )
            assert value is not None, f"{where}.{field.name} is None in the full sample"
            if isinstance(value, (tuple, dict)) or hasattr(value, "items"):
                assert len(value) > 0, f"{where}.{field.name} is empty in the full sample"
            if attrs.has(type(value)) and not isinstance(value, Payload):
                check_all_set(value, f"{where}.{field.name}", [])

    for name, body in FULL_BODIES.items():
        check_all_set(body, name, [v for v in ADDED_VARIANTS if type(v) is type(body)])


def test_minimal_samples_cover_every_type_with_optional_or_default_fields() -> None:
    def has_optional(cls: type) -> bool:
        hints = typing.get_type_hints(cls, vars(events_module))
        return any(
            f.default is not attrs.NOTHING or hints[f.name] in (ErrorInfo, ActivityError)
            for f in attrs.fields(cls)
        )

    wanted = {name for name, cls in EVENT_TYPES.items() if has_optional(cls)}
    assert wanted <= set(MINIMAL_BODIES)
    # And the minimal samples do leave their defaults out.
    for name, body in MINIMAL_BODIES.items():
        for field in attrs.fields(type(body)):
            if isinstance(field.default, attrs.Factory):  # type: ignore[arg-type]
                assert getattr(body, field.name) == field.default.factory(), (name, field.name)
            elif field.default is not attrs.NOTHING:
                assert getattr(body, field.name) == field.default, (name, field.name)


def test_absent_optional_payload_is_an_absent_key_and_other_optionals_are_null() -> None:
    _, data = body_to_wire(MINIMAL_BODIES["WorkflowFailed"])
    assert data == {"error": {"type": "RuntimeError", "message": "", "traceback": None}}
    _, data = body_to_wire(MINIMAL_BODIES["WorkflowStarted"])
    assert data["parent_run_id"] is None
    assert data["timeout"] is None


def test_payload_null_in_an_optional_payload_field_round_trips() -> None:
    # A present JSON null is the payload null, distinct from "no details".
    body = FULL_BODIES["WorkflowFailed"]
    with_null = attrs.evolve(body, error=attrs.evolve(ERROR_DETAILS_NULL))
    name, text = body_data_json(with_null)
    assert json.loads(text)["error"]["details"] is None
    assert body_from_data_json(name, text) == with_null
    without = attrs.evolve(body, error=attrs.evolve(ERROR_DETAILS_NULL, details=None))
    name, text = body_data_json(without)
    assert "details" not in json.loads(text)["error"]
    assert body_from_data_json(name, text) == without


ERROR_DETAILS_NULL = ErrorInfo(type="E", message="m", details=Payload.of(None))


# --------------------------------------------------------------------------
# Round trips
# --------------------------------------------------------------------------


@pytest.mark.parametrize("event", sample_events(), ids=lambda e: f"{e.seq}-{e.type}")
def test_every_sample_round_trips_through_every_form(event: Event) -> None:
    assert event_from_json(event_to_json(event)) == event
    assert event_from_wire(event_to_wire(event)) == event
    name, text = body_data_json(event.body)
    assert name == event.type
    assert body_from_data_json(name, text) == event.body
    assert body_from_data_json(name, text.encode("utf-8")) == event.body
    assert body_from_wire(*body_to_wire(event.body)) == event.body
    # Stores keep (type, data) in columns: that data is the event form's "data".
    assert json.loads(event_to_json(event))["data"] == json.loads(text)


def test_wire_datetimes_are_utc_and_decode_to_the_same_instant() -> None:
    eastern = datetime(2026, 3, 1, 12, 0, 0, 5, tzinfo=timezone(timedelta(hours=-5)))
    assert format_datetime(eastern) == "2026-03-01T17:00:00.000005+00:00"
    parsed = parse_datetime("2026-03-01T17:00:00.000005Z")
    assert parsed == eastern
    assert parsed.tzinfo == timezone.utc


def test_durations_are_float_seconds() -> None:
    _, data = body_to_wire(FULL_BODIES["WorkflowStarted"])
    assert data["timeout"] == 2 * 86400 + 0.000005


def test_non_ascii_text_is_written_as_is() -> None:
    text = event_to_json(sample_events()[0])
    assert "ünïcödé ✓" in text
    assert "\\u" not in text


def test_body_to_wire_refuses_non_event_types() -> None:
    @attrs.frozen
    class NotAnEvent(EventBody):
        pass

    with pytest.raises(TypeError, match="NotAnEvent"):
        body_to_wire(NotAnEvent())


def test_a_non_finite_or_invalid_payload_cannot_be_built_so_it_can_never_be_written() -> None:
    # Encoding splices payload text in as is (no re-parse on the append path),
    # so the guard sits at construction.
    for text in ("NaN", "Infinity", "-Infinity", "{not json", '{"a": NaN}'):
        with pytest.raises(ValueError, match="JSON"):
            Payload(text)
    body = attrs.evolve(FULL_BODIES["MarkerRecorded"], value=Payload('{"b": [1, 2.5, "NaN"]}'))
    _, text = body_data_json(body)
    assert json.loads(text)["value"] == {"b": [1, 2.5, "NaN"]}


# Property: any constructible body round-trips. Strategies are derived from the
# field types, so a new event type or field is covered without editing this.

_json_leaf = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
)
json_values = st.recursive(
    _json_leaf,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
# Top-level edge values drawn often: recursive() alone rarely yields a bare null.
payloads = (st.sampled_from([None, 0, "", [], {}]) | json_values).map(Payload.of)
names = st.text(st.characters(exclude_categories=("Cs", "Cc")), min_size=1, max_size=12)
run_ids = st.uuids().map(str)
timer_ids = st.one_of(
    names.map(lambda n: f"named:{n}"),
    st.integers(0, 10**6).map(lambda n: f"anonymous:{n}"),
    st.integers(0, 10**6).map(lambda n: f"scope:{n}"),
    run_ids.map(lambda r: f"deadline:{r}"),
)
search_keys = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.\-]{0,20}", fullmatch=True)
search_values = (
    st.text(max_size=8)
    | st.integers(-(2**53), 2**53)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.booleans()
    | st.lists(st.text(max_size=5), max_size=3)
)
search_maps = st.dictionaries(search_keys, search_values, max_size=4)
aware_datetimes = st.datetimes(
    min_value=datetime(1971, 1, 1),
    max_value=datetime(2200, 1, 1),
    timezones=st.sampled_from(
        [timezone.utc, timezone(timedelta(hours=5, minutes=30)), timezone(timedelta(hours=-8))]
    ),
)
durations = st.timedeltas(min_value=timedelta(microseconds=1), max_value=timedelta(days=365 * 200))

_BY_NAME: dict[str, st.SearchStrategy[Any]] = {
    "run_id": run_ids,
    "parent_run_id": run_ids,
    "new_run_id": run_ids,
    "reset_from_run_id": run_ids,
    "to_seq": st.integers(1, 2**53),
    "reset_to_seq": st.integers(1, 2**53),
    "parent_workflow_id": names,
    "child_workflow_id": names,
    "timer_id": timer_ids,
    "search_attributes": search_maps,
    "attributes": search_maps,
    "attempt": st.integers(1, 10**6),
    "reopened_activity_ids": st.lists(st.integers(0, 10**6), max_size=4).map(tuple),
    "timeout": durations,
    "command_id": st.integers(1, 2**53),
    "by_workflow": st.just(True),
    "input_digest": st.text(alphabet="0123456789abcdef", min_size=1, max_size=32),
    "headers": st.dictionaries(
        names, st.text(st.characters(exclude_categories=("Cs",)), max_size=40), max_size=3
    ),
}


def _strategy_for(cls: type) -> st.SearchStrategy[Any]:
    hints = typing.get_type_hints(cls, vars(events_module))
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for field in attrs.fields(cls):
        fields[field.name] = _for_field(field.name, hints[field.name])
    return st.builds(cls, **fields)


def _for_field(name: str, tp: Any) -> st.SearchStrategy[Any]:
    args = typing.get_args(tp)
    if type(None) in args:
        (inner,) = (a for a in args if a is not type(None))
        return st.none() | _for_field(name, inner)
    by_name = _BY_NAME.get(name)
    return by_name if by_name is not None else _for_type(tp)


def _for_type(tp: Any) -> st.SearchStrategy[Any]:
    if tp is Payload:
        return payloads
    if tp is str:
        return names
    if tp is bool:
        return st.booleans()
    if tp is int:
        return st.integers(0, 2**53)
    if tp is datetime:
        return aware_datetimes
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return st.sampled_from(list(tp))
    if tp in (ErrorInfo, ActivityError):
        return _strategy_for(tp)
    raise AssertionError(f"no test strategy for field type {tp!r}: extend _for_type")


any_body = st.one_of([_strategy_for(cls) for cls in EVENT_TYPES.values()])
any_event = st.builds(
    Event,
    workflow_id=names,
    seq=st.integers(1, 2**53),
    recorded_at=aware_datetimes,
    body=any_body,
)


@settings(max_examples=300, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(event=any_event)
def test_any_constructible_event_round_trips(event: Event) -> None:
    text = event_to_json(event)
    decoded = event_from_json(text)
    assert decoded == event
    # Decoding normalises, so a second trip is byte-identical.
    assert event_to_json(decoded) == text
    name, data_text = body_data_json(event.body)
    assert body_from_data_json(name, data_text) == event.body
    # The direct-to-text encoder writes exactly what dumping the wire data writes.
    assert data_text == _compact(body_to_wire(event.body)[1])


def _compact(data: Any) -> str:
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


@pytest.mark.parametrize("event", sample_events(), ids=lambda e: f"{e.seq}-{e.type}")
def test_body_data_json_is_the_compact_dump_of_the_wire_data(event: Event) -> None:
    # Samples hold canonical (compact) payload text, so splicing it in unparsed
    # must give the same bytes as parsing and re-dumping it.
    name, text = body_data_json(event.body)
    assert (name, text) == (event.type, _compact(body_to_wire(event.body)[1]))


def test_body_data_json_refuses_a_value_json_cannot_hold_with_a_type_error() -> None:
    # Stores map TypeError/ValueError from encoding to SerializationError.
    for field in ("workflow_type", "task_queue", "parent_run_id"):
        body = attrs.evolve(FULL_BODIES["WorkflowStarted"])
        object.__setattr__(body, field, object())  # bypasses the validators
        with pytest.raises(TypeError):
            body_data_json(body)


# --------------------------------------------------------------------------
# Decode errors
# --------------------------------------------------------------------------


def _wire(type_name: str, **data_changes: Any) -> dict[str, Any]:
    """The wire dict of the full sample of ``type_name`` with ``data`` keys changed (None deletes)."""
    event = Event(workflow_id=WORKFLOW_ID, seq=1, recorded_at=RECORDED_AT, body=FULL_BODIES[type_name])
    obj = event_to_wire(event)
    for key, value in data_changes.items():
        if value is _DELETE:
            del obj["data"][key]
        else:
            obj["data"][key] = value
    return obj


_DELETE = object()


def _envelope(**changes: Any) -> dict[str, Any]:
    obj = _wire("ActivityStarted")
    for key, value in changes.items():
        if value is _DELETE:
            del obj[key]
        else:
            obj[key] = value
    return obj


def _nested(type_name: str, field: str, **changes: Any) -> dict[str, Any]:
    obj = _wire(type_name)
    obj["data"][field].update(changes)
    return obj


DECODE_ERRORS: list[tuple[str, Any, str]] = [
    # (case id, wire object or JSON text, regex the message must match)
    ("unknown-type", _envelope(type="ActivityExploded"), r"unknown event type 'ActivityExploded'"),
    ("type-not-a-string", _envelope(type=3), r"event type must be a string"),
    ("unknown-envelope-field", _envelope(shard=1), r"event envelope: unknown field\(s\) 'shard'"),
    ("missing-envelope-field", _envelope(seq=_DELETE), r"event envelope: missing field\(s\) 'seq'"),
    ("envelope-not-an-object", [1, 2], r"an event must be a JSON object"),
    (
        "unknown-data-field",
        _wire("ActivityStarted", worker="w1"),
        r"ActivityStarted: unknown field\(s\) 'worker'",
    ),
    (
        "unknown-field-in-error-info",
        _nested("WorkflowFailed", "error", stack=[]),
        r"WorkflowFailed\.error: ErrorInfo: unknown field\(s\) 'stack'",
    ),
    (
        "unknown-field-in-activity-error",
        _nested("ActivityFailed", "error", retry_in=3),
        r"ActivityFailed\.error: ActivityError: unknown field\(s\) 'retry_in'",
    ),
    (
        "unknown-field-in-child-error",
        _nested("ChildWorkflowFailed", "error", code=1),
        r"ChildWorkflowFailed\.error: ErrorInfo: unknown field\(s\) 'code'",
    ),
    (
        "missing-data-field",
        _wire("ActivityStarted", attempt=_DELETE),
        r"ActivityStarted: missing field 'attempt'",
    ),
    (
        "missing-field-in-error",
        _wire("WorkflowFailed", error={"message": "m"}),
        r"WorkflowFailed\.error: ErrorInfo: missing field 'type'",
    ),
    (
        "str-for-int",
        _wire("ActivityStarted", attempt="3"),
        r"ActivityStarted\.attempt: expected an integer, got '3'",
    ),
    (
        "bool-for-int",
        _wire("ActivityStarted", attempt=True),
        r"ActivityStarted\.attempt: expected an integer, got True",
    ),
    (
        "float-for-int",
        _wire("ActivityStarted", activity_id=2.0),
        r"ActivityStarted\.activity_id: expected an integer",
    ),
    ("int-for-bool", _wire("ActivityFailed", final=1), r"ActivityFailed\.final: expected a boolean, got 1"),
    ("int-for-str", _wire("SignalReceived", name=5), r"SignalReceived\.name: expected a string, got 5"),
    ("list-for-object-data", _envelope(data=[]), r"ActivityStarted: expected an object, got \[\]"),
    (
        "list-for-error-object",
        _wire("WorkflowFailed", error=["E"]),
        r"WorkflowFailed\.error: ErrorInfo: expected an object",
    ),
    (
        "list-for-search-attributes",
        _wire("WorkflowStarted", search_attributes=[["k", 1]]),
        r"WorkflowStarted\.search_attributes: expected an object",
    ),
    (
        "object-for-list",
        _wire("WorkflowReopened", reopened_activity_ids={"0": 1}),
        r"reopened_activity_ids: expected a list",
    ),
    (
        "str-in-int-list",
        _wire("WorkflowReopened", reopened_activity_ids=[0, "1"]),
        r"reopened_activity_ids: expected an integer",
    ),
    ("str-for-seq", _envelope(seq="1"), r"event envelope: seq must be an integer, got '1'"),
    ("bool-for-seq", _envelope(seq=True), r"event envelope: seq must be an integer, got True"),
    ("seq-zero", _envelope(seq=0), r"event envelope: seq must be an int >= 1"),
    ("int-workflow-id", _envelope(workflow_id=7), r"event envelope: workflow_id must be a string"),
    ("empty-workflow-id", _envelope(workflow_id=""), r"event envelope: workflow_id must not be empty"),
    (
        "naive-recorded-at",
        _envelope(recorded_at="2026-01-02T03:04:05"),
        r"event envelope: recorded_at: .*no timezone",
    ),
    (
        "garbled-recorded-at",
        _envelope(recorded_at="yesterday"),
        r"event envelope: recorded_at: 'yesterday' is not an ISO-8601",
    ),
    (
        "int-recorded-at",
        _envelope(recorded_at=0),
        r"event envelope: recorded_at: expected an ISO-8601 string",
    ),
    (
        "naive-fire-at",
        _wire("TimerStarted", fire_at="2026-01-02T03:04:05"),
        r"TimerStarted\.fire_at: .*no timezone",
    ),
    (
        "non-uuid-run-id",
        _wire("WorkflowStarted", run_id="run-1"),
        r"WorkflowStarted: run_id 'run-1' is not a UUID",
    ),
    (
        "non-canonical-run-id",
        _wire("WorkflowStarted", run_id="3F1C2A9E-5B7D-4C1E-8F20-6A9B0C1D2E3F"),
        r"WorkflowStarted: run_id .* is not in canonical UUID form",
    ),
    (
        "non-uuid-parent-run-id",
        _wire("WorkflowContinuedAsNew", parent_run_id="x"),
        r"WorkflowContinuedAsNew: parent_run_id 'x' is not a UUID",
    ),
    (
        "bad-failure-cause",
        _nested("ActivityFailed", "error", cause="flaky"),
        r"ActivityFailed\.error: ActivityError\.cause: 'flaky' is not a valid FailureCause \(one of 'retryable'",
    ),
    (
        "bad-cancel-cause",
        _wire("TimerCancelled", cause="boredom"),
        r"TimerCancelled\.cause: 'boredom' is not a valid TimerCancelCause",
    ),
    (
        "bad-timeout-kind",
        _wire("WorkflowTimedOut", timeout_kind="idle"),
        r"WorkflowTimedOut\.timeout_kind: 'idle' is not a valid TimeoutKind",
    ),
    (
        "bad-timer-id",
        _wire("TimerFired", timer_id="alarm"),
        r"TimerFired: timer_id 'alarm' must look like named:X",
    ),
    (
        "negative-activity-id",
        _wire("ActivityStarted", activity_id=-1),
        r"ActivityStarted: activity_id must be an int >= 0",
    ),
    ("attempt-zero", _wire("ActivityStarted", attempt=0), r"ActivityStarted: attempt must be an int >= 1"),
    ("empty-name", _wire("SignalReceived", name=""), r"SignalReceived: name must be a non-empty str"),
    (
        "bad-search-key",
        _wire("SearchAttributesUpserted", attributes={"1st": 1}),
        r"SearchAttributesUpserted: search attribute name '1st'",
    ),
    (
        "bad-search-value",
        _wire("SearchAttributesUpserted", attributes={"k": {"nested": 1}}),
        r"SearchAttributesUpserted: search attribute 'k': dict is not supported",
    ),
    ("negative-duration", _wire("WorkflowStarted", timeout=-5), r"WorkflowStarted: timeout must be positive"),
    (
        "str-duration",
        _wire("WorkflowStarted", timeout="5s"),
        r"WorkflowStarted\.timeout: expected a duration in seconds",
    ),
    (
        "huge-duration",
        _wire("WorkflowStarted", timeout=1e300),
        r"WorkflowStarted\.timeout: duration 1e\+300 seconds is out of range",
    ),
    ("invalid-json", '{"workflow_id": "w", "seq": 1,', r"event is not valid JSON"),
    ("not-json-at-all", "\x00", r"event is not valid JSON"),
    ("nan-in-payload", None, r"event is not valid JSON: NaN is not valid JSON"),
    ("infinity-in-payload", None, r"event is not valid JSON: Infinity is not valid JSON"),
    ("overflowing-float", None, r"event is not valid JSON: number 1e400 is out of range"),
]


def _text_for(case: str, obj: Any) -> str:
    if case.endswith("-in-payload") or case == "overflowing-float":
        literal = {"nan-in-payload": "NaN", "infinity-in-payload": "Infinity", "overflowing-float": "1e400"}[
            case
        ]
        return json.dumps(_wire("MarkerRecorded", value="__X__")).replace('"__X__"', literal)
    return obj if isinstance(obj, str) else json.dumps(obj)


@pytest.mark.parametrize(("case", "obj", "message"), DECODE_ERRORS, ids=[c[0] for c in DECODE_ERRORS])
def test_decode_errors_are_typed_and_name_the_culprit(case: str, obj: Any, message: str) -> None:
    text = _text_for(case, obj)
    with pytest.raises(EventDecodeError, match=message):
        event_from_json(text)


@pytest.mark.parametrize(
    ("type_name", "data_text", "message"),
    [
        ("Nope", "{}", r"unknown event type 'Nope'"),
        ("ActivityStarted", "{", r"ActivityStarted data is not valid JSON"),
        ("ActivityStarted", b"\xff\xfe", r"ActivityStarted data is not valid JSON"),
        ("MarkerRecorded", '{"name":"m","value":NaN}', r"MarkerRecorded data is not valid JSON: NaN"),
        ("ActivityStarted", '{"activity_id":0}', r"ActivityStarted: missing field 'attempt'"),
        ("ActivityStarted", "[]", r"ActivityStarted: expected an object"),
    ],
)
def test_body_from_data_json_errors(type_name: str, data_text: str | bytes, message: str) -> None:
    with pytest.raises(EventDecodeError, match=message):
        body_from_data_json(type_name, data_text)


def test_decode_error_is_a_value_error_and_an_aion_error() -> None:
    from aion_trio import AionError

    with pytest.raises(ValueError) as info:
        event_from_json("{}")
    assert isinstance(info.value, AionError)


# Property: whatever JSON value replaces a field, decoding gives an Event or an
# EventDecodeError, never another exception (stores turn EventDecodeError into
# SerializationError; anything else would escape as an unexplained crash).

_sample_wires = [event_to_wire(e) for e in sample_events()]


def _paths(obj: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = []
    if isinstance(obj, dict):
        for key, value in obj.items():
            out.append((*prefix, key))
            if key != "input" and isinstance(value, dict) and len(prefix) < 2:
                out.extend(_paths(value, (*prefix, key)))
    return out


_EDGE_VALUES = [_DELETE, 1e300, -1e300, 2**64, -1, 0, 1.5, "", "x", True, False, None, [], [1], {}, {"a": 1}]


def _decode_or_refuse(obj: Any) -> None:
    try:
        event = event_from_json(json.dumps(obj))
    except EventDecodeError:
        return
    # Accepted: then it is a real event that re-encodes and decodes to itself.
    assert event_from_json(event_to_json(event)) == event


def _replaced(wire: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    obj = json.loads(json.dumps(wire))
    parent = obj
    for key in path[:-1]:
        parent = parent[key]
    if value is _DELETE:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return obj


def test_every_field_of_every_sample_replaced_by_edge_values_decodes_or_is_refused() -> None:
    checked = 0
    for wire in _sample_wires:
        for path in _paths(wire):
            for value in _EDGE_VALUES:
                _decode_or_refuse(_replaced(wire, path, value))
                checked += 1
    assert checked > 3000


@settings(max_examples=400, derandomize=True)
@given(
    which=st.integers(0, len(_sample_wires) - 1),
    pick=st.integers(0, 10**6),
    replacement=json_values | st.just(_DELETE),
    extra_key=st.none() | st.text(max_size=4),
)
def test_mangled_events_decode_or_raise_event_decode_error(
    which: int, pick: int, replacement: Any, extra_key: str | None
) -> None:
    wire = _sample_wires[which]
    paths = _paths(wire)
    path = paths[pick % len(paths)]
    obj = _replaced(wire, path, replacement)
    if extra_key is not None:
        parent = obj
        for key in path[:-1]:
            parent = parent[key]
        parent.setdefault(extra_key, 1)
    _decode_or_refuse(obj)


def test_decoding_refuses_floats_that_overflow_in_any_number_position() -> None:
    obj = _wire("SearchAttributesUpserted", attributes={"x": 1.5})
    text = json.dumps(obj)
    with pytest.raises(EventDecodeError, match="out of range"):
        event_from_json(text.replace("1.5", "-1e999"))
    # Control: a large but finite float is fine.
    assert event_from_json(text.replace("1.5", "-1e99")).body.attributes == {"x": -1e99}


# --------------------------------------------------------------------------
# The read path: decoders compiled per event type, payload text carried as is
# --------------------------------------------------------------------------


def _general_path(type_name: str, text: str) -> EventBody:
    """What decoding gave before decoders were compiled: parse it all, then convert."""
    return body_from_wire(type_name, loads_strict(text))


@settings(max_examples=400, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(bodies=st.lists(any_body, min_size=1, max_size=4))
def test_every_type_s_compiled_decoder_gives_the_general_path_s_body(bodies: list[EventBody]) -> None:
    # Several bodies through one decoder in a row: a payload reused from the previous
    # event's text must only be reused when it is the same text.
    for body in bodies:
        name, text = body_data_json(body)
        decoded = data_decoder(name)(text)
        assert decoded is not None, f"{name}: the compiled decoder refused the encoder's own layout"
        assert decoded == body == _general_path(name, text)
        assert body_from_data_json(name, text) == body
        # Byte-identical: re-encoding what was decoded writes the stored text again.
        assert body_data_json(decoded) == (name, text)


@pytest.mark.parametrize(
    "body", [*FULL_BODIES.values(), *MINIMAL_BODIES.values()], ids=lambda b: type(b).__name__
)
def test_the_samples_take_the_compiled_decoder(body: EventBody) -> None:
    name, text = body_data_json(body)
    assert data_decoder(name)(text) == body


def test_a_decoded_payload_is_the_stored_text_and_behaves_as_payload_of_its_value() -> None:
    value = {"b": [1, 2.5, "ünï", None], "a": {"x": True}}
    stored = Payload.of(value).json
    name, text = body_data_json(MarkerRecorded(name="m", value=Payload.of(value)))
    decoded = body_from_data_json(name, text)
    assert isinstance(decoded, MarkerRecorded)
    payload = decoded.value
    assert payload.json == stored
    assert payload == Payload.of(value)
    assert hash(payload) == hash(Payload.of(value))
    assert repr(payload) == repr(Payload.of(value))
    assert payload.value() == value
    # Text other than the compact form (a payload built from it as is) is carried as
    # written: reading a history back gives the payload that was appended.
    spaced = Payload('{"b": [1, 2],  "a": "x"}')
    name, text = body_data_json(MarkerRecorded(name="m", value=spaced))
    assert body_from_data_json(name, text) == MarkerRecorded(name="m", value=spaced)


def test_re_encoding_a_decoded_body_parses_no_payload(monkeypatch: pytest.MonkeyPatch) -> None:
    bodies = [FULL_BODIES[name] for name in ("ActivityScheduled", "WorkflowStarted", "ActivityFailed")]
    texts = [body_data_json(b) for b in bodies]

    def no_parse(self: Payload) -> Any:
        raise AssertionError(f"payload {self!r} was parsed")

    monkeypatch.setattr(Payload, "value", no_parse)
    for name, text in texts:
        assert body_data_json(body_from_data_json(name, text)) == (name, text)


@pytest.mark.parametrize(
    ("previous", "text", "message"),
    [
        # The previous event's payload text, then more: reusing its value must not hide the rest.
        ('{"name":"m","value":{"i":1}}', '{"name":"m","value":{"i":1}}}', "Extra data"),
        ('{"name":"m","value":{"i":1}}', '{"name":"m","value":{"i":1},"x":2}', "unknown field"),
        ('{"name":"m","value":1}', '{"name":"m","value":12}', None),
        ('{"name":"m","value":"a"}', '{"name":"m","value":"a"', "not valid JSON"),
        ('{"name":"m","value":[1]}', '{"name":"m","value":[1,NaN]}', "NaN is not valid JSON"),
        ('{"name":"m","value":[1]}', '{"name":"m","value":[1e400]}', "out of range"),
        ('{"name":"m","value":[1]}', '{"name":"m","value":[1,}', "not valid JSON"),
        ('{"name":"m","value":[1]}', '{"name":"m","value":[1] }', None),
        ('{"name":"m","value":[1]}', '{"name":"m","value":[1]', "not valid JSON"),
        ('{"name":"m","value":[1]}', '{"name":"m"}', "missing field 'value'"),
        ('{"name":"m","value":[1]}', '{"name":"","value":[1]}', "name must be a non-empty str"),
        ('{"name":"m","value":[1]}', '{"name":"m","name":"n","value":[1]}', None),
    ],
)
def test_text_off_the_fast_layout_decodes_or_fails_as_the_general_path_does(
    previous: str, text: str, message: str | None
) -> None:
    assert body_from_data_json("MarkerRecorded", previous) == _general_path("MarkerRecorded", previous)
    if message is None:
        assert body_from_data_json("MarkerRecorded", text) == _general_path("MarkerRecorded", text)
    else:
        with pytest.raises(EventDecodeError, match=message):
            body_from_data_json("MarkerRecorded", text)


def test_events_from_rows_builds_the_events_and_names_the_row_of_a_bad_one() -> None:
    events = sample_events()
    rows = [(e.seq, format_datetime(e.recorded_at), *body_data_json(e.body)) for e in events]
    assert events_from_rows(WORKFLOW_ID, rows, parse_datetime, "here") == events
    decoded = events_from_rows(WORKFLOW_ID, rows, parse_datetime, "here")
    assert [type(e) for e in decoded] == [Event] * len(events)
    # A converter that lets a naive datetime through: the envelope's own check refuses it.
    convert = datetime.fromisoformat
    for bad, message in [
        ((0, rows[1][1], rows[1][2], rows[1][3]), "seq must be an int >= 1"),
        ((2, "yesterday", rows[1][2], rows[1][3]), "Invalid isoformat"),
        ((2, "2026-01-02T03:04:05", rows[1][2], rows[1][3]), "must be timezone-aware"),
        ((2, rows[1][1], rows[1][2], b"{}"), "event data is a bytes"),
        ((2, rows[1][1], "Nope", rows[1][3]), "unknown event type"),
    ]:
        with pytest.raises(StoreDecodeError, match=message) as info:
            events_from_rows(WORKFLOW_ID, [rows[0], bad, *rows[2:]], convert, "here")
        assert (info.value.workflow_id, info.value.seq, info.value.location) == (WORKFLOW_ID, bad[0], "here")
    with pytest.raises(StoreDecodeError, match="workflow_id must not be empty"):
        events_from_rows("", rows, parse_datetime, "here")


def test_a_payload_that_begins_with_the_previous_one_s_text_is_scanned_not_reused() -> None:
    decode = data_decoder("MarkerRecorded")
    for previous, text, value in [
        ("1", "12", 12),
        ('"a"', '"a"', "a"),
        ("[1]", "[1]", [1]),
        ("true", "true", True),
        ("1", "1.5", 1.5),
        ("1", "1e2", 100.0),
    ]:
        assert decode(f'{{"name":"m","value":{previous}}}') is not None
        body = decode(f'{{"name":"m","value":{text}}}')
        assert isinstance(body, MarkerRecorded)
        assert body.value.json == text
        assert body.value.value() == value


_DATA_ERRORS = [
    (case, obj, message)
    for case, obj, message in DECODE_ERRORS
    if isinstance(obj, dict) and "envelope" not in message and case != "list-for-object-data"
]


@pytest.mark.parametrize(("case", "obj", "message"), _DATA_ERRORS, ids=[c[0] for c in _DATA_ERRORS])
def test_bad_data_in_the_compact_layout_fails_as_the_general_path_does(
    case: str, obj: Any, message: str
) -> None:
    # The compact text stores keep, so the compiled decoder sees it first: what it
    # cannot take goes to the general path, which raises the same typed error.
    text = json.dumps(obj["data"], separators=(",", ":"), ensure_ascii=False)
    with pytest.raises(EventDecodeError, match=message.removeprefix(r"event envelope: ")):
        body_from_data_json(obj["type"], text)
    if obj["type"] in EVENT_TYPES:
        try:
            taken = data_decoder(obj["type"])(text)
        except (ValueError, TypeError, IndexError, StopIteration):
            taken = None
        assert taken is None, f"the compiled decoder accepted {case}: {taken!r}"


def test_the_table_of_data_errors_covers_the_compiled_checks() -> None:
    assert len(_DATA_ERRORS) > 30


def test_compiled_decoders_set_slotted_fields_through_their_slots() -> None:
    # The hot loop stores each field through its slot's descriptor, not a name lookup per call.
    from aion_trio._events import EVENT_TYPES
    from aion_trio._wire import field_setter

    for cls in [*EVENT_TYPES.values(), Event]:
        for field in attrs.fields(cls):
            slot = next(base.__dict__[field.name] for base in cls.__mro__ if field.name in base.__dict__)
            assert field_setter(cls, field.name) == slot.__set__, (cls, field.name)

    @attrs.frozen(slots=False)
    class Plain:
        value: int

    plain = Plain.__new__(Plain)
    field_setter(Plain, "value")(plain, 3)  # a frozen class without slots: as object.__setattr__ sets it
    assert plain == Plain(3)
