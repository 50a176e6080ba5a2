"""The event model: validators, frozen-ness, envelopes and batches."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import attrs
import pytest
from _samples import FULL_BODIES, RECORDED_AT, RUN_ID, sample_events

from aion_trio import (
    ActivityCancelled,
    ActivityCompleted,
    ActivityError,
    ActivityFailed,
    ActivityScheduled,
    ActivityStarted,
    ChildWorkflowStarted,
    ErrorInfo,
    Event,
    EventBody,
    FailureCause,
    MarkerRecorded,
    Payload,
    SearchAttributesUpserted,
    SignalReceived,
    TimerCancelCause,
    TimerCancelled,
    TimerFired,
    TimerStarted,
    WorkflowCompleted,
    WorkflowContinuedAsNew,
    WorkflowFailed,
    WorkflowReopened,
    WorkflowReset,
    WorkflowStarted,
    WorkflowStatus,
    WorkflowTimedOut,
)
from aion_trio._events import (
    EVENT_TYPES,
    TERMINAL_TYPES,
    is_terminal_body,
    make_batch,
    utc,
    validate_search_attributes,
    validate_search_key,
)
from aion_trio.events import WorkflowCancelled

NAIVE = datetime(2026, 1, 1, 12, 0)
P = Payload.of({"x": 1})


def started(**changes: Any) -> WorkflowStarted:
    fields: dict[str, Any] = {"workflow_type": "checkout", "input": P, "run_id": RUN_ID}
    fields.update(changes)
    return WorkflowStarted(**fields)


def event(body: EventBody | None = None, **changes: Any) -> Event:
    fields: dict[str, Any] = {
        "workflow_id": "wf",
        "seq": 1,
        "recorded_at": RECORDED_AT,
        "body": body if body is not None else started(),
    }
    fields.update(changes)
    return Event(**fields)


# --------------------------------------------------------------------------
# Validators
# --------------------------------------------------------------------------

INVALID: list[tuple[str, Callable[[], object], type[Exception], str]] = [
    # (case, constructor, exception type, message regex)
    ("naive-recorded-at", lambda: event(recorded_at=NAIVE), ValueError, "recorded_at must be timezone-aware"),
    ("str-recorded-at", lambda: event(recorded_at="2026-01-01"), TypeError, "recorded_at must be a datetime"),
    (
        "naive-fire-at",
        lambda: TimerStarted(timer_id="named:t", fire_at=NAIVE),
        ValueError,
        "fire_at must be timezone-aware",
    ),
    ("seq-zero", lambda: event(seq=0), ValueError, "seq must be an int >= 1"),
    ("seq-negative", lambda: event(seq=-4), ValueError, "seq must be an int >= 1"),
    ("seq-bool", lambda: event(seq=True), ValueError, "seq must be an int >= 1"),
    ("seq-float", lambda: event(seq=1.0), ValueError, "seq must be an int >= 1"),
    ("empty-workflow-id", lambda: event(workflow_id=""), ValueError, "workflow_id must not be empty"),
    ("control-char-workflow-id", lambda: event(workflow_id="a\nb"), ValueError, "control characters"),
    ("body-not-a-body", lambda: event(body="WorkflowStarted"), TypeError, "body must be one of"),
    ("body-base-class", lambda: event(body=EventBody()), TypeError, "body must be one of"),
    (
        "negative-activity-id",
        lambda: ActivityStarted(activity_id=-1, attempt=1),
        ValueError,
        "activity_id must be an int >= 0",
    ),
    (
        "bool-activity-id",
        lambda: ActivityStarted(activity_id=False, attempt=1),
        ValueError,
        "activity_id must be an int >= 0",
    ),
    (
        "negative-reopened-id",
        lambda: WorkflowReopened(run_id=RUN_ID, reopened_activity_ids=[0, -2]),
        ValueError,
        "reopened_activity_ids must hold ints >= 0",
    ),
    (
        "negative-fallback-index",
        lambda: attrs.evolve(FULL_BODIES["ActivityFallbackRouted"], fallback_index=-1),
        ValueError,
        "fallback_index must be an int >= 0",
    ),
    (
        "attempt-zero",
        lambda: ActivityStarted(activity_id=0, attempt=0),
        ValueError,
        "attempt must be an int >= 1",
    ),
    (
        "attempt-zero-completed",
        lambda: ActivityCompleted(activity_id=0, result=P, attempt=0),
        ValueError,
        "attempt must be an int >= 1",
    ),
    ("attempt-zero-cancelled", lambda: ActivityCancelled(activity_id=0, attempt=0), ValueError, "attempt"),
    (
        "empty-workflow-type",
        lambda: started(workflow_type=""),
        ValueError,
        "workflow_type must be a non-empty str",
    ),
    ("empty-task-queue", lambda: started(task_queue=""), ValueError, "task_queue must be a non-empty str"),
    (
        "empty-activity-type",
        lambda: ActivityScheduled(activity_id=0, activity_type="", input=P),
        ValueError,
        "activity_type must be a non-empty str",
    ),
    (
        "empty-signal-name",
        lambda: SignalReceived(name="", payload=P),
        ValueError,
        "name must be a non-empty str",
    ),
    (
        "empty-marker-name",
        lambda: MarkerRecorded(name="", value=P),
        ValueError,
        "name must be a non-empty str",
    ),
    ("empty-error-type", lambda: ErrorInfo(type="", message="m"), ValueError, "type must be a non-empty str"),
    (
        "empty-child-id",
        lambda: ChildWorkflowStarted(child_workflow_id="", workflow_type="t", input=P),
        ValueError,
        "child_workflow_id must not be empty",
    ),
    (
        "empty-continued-type",
        lambda: WorkflowContinuedAsNew(input=P, workflow_type="", parent_run_id=RUN_ID),
        ValueError,
        "workflow_type must be a non-empty str",
    ),
    ("non-uuid-run-id", lambda: started(run_id="run-1"), ValueError, "run_id 'run-1' is not a UUID"),
    ("upper-case-run-id", lambda: started(run_id=RUN_ID.upper()), ValueError, "not in canonical UUID form"),
    (
        "non-uuid-parent-run-id",
        lambda: started(parent_run_id="p"),
        ValueError,
        "parent_run_id 'p' is not a UUID",
    ),
    (
        "bad-parent-workflow-id",
        lambda: started(parent_workflow_id=""),
        ValueError,
        "parent_workflow_id must not be empty",
    ),
    ("zero-timeout", lambda: started(timeout=timedelta(0)), ValueError, "timeout must be positive"),
    ("number-timeout", lambda: started(timeout=30), TypeError, "timeout must be a timedelta"),
    ("timer-id-no-kind", lambda: TimerFired(timer_id="alarm"), ValueError, "timer_id 'alarm' must look like"),
    ("timer-id-unknown-kind", lambda: TimerFired(timer_id="cron:x"), ValueError, "must look like"),
    ("timer-id-empty-name", lambda: TimerFired(timer_id="named:"), ValueError, "must look like"),
    (
        "timer-id-anonymous-text",
        lambda: TimerFired(timer_id="anonymous:x"),
        ValueError,
        "anonymous:N needs N",
    ),
    (
        "timer-id-anonymous-negative",
        lambda: TimerFired(timer_id="anonymous:-1"),
        ValueError,
        "anonymous:N needs N",
    ),
    (
        "timer-id-leading-zero",
        lambda: TimerFired(timer_id="anonymous:01"),
        ValueError,
        "without leading zeros",
    ),
    ("timer-id-scope-text", lambda: TimerFired(timer_id="scope:a"), ValueError, "scope:N needs N"),
    ("timer-id-empty-deadline", lambda: TimerFired(timer_id="deadline:"), ValueError, "must look like"),
    ("timer-id-not-str", lambda: TimerFired(timer_id=3), TypeError, "timer_id must be str"),
    ("payload-as-dict", lambda: started(input={"x": 1}), TypeError, "input must be a Payload"),
    ("payload-as-text", lambda: MarkerRecorded(name="m", value="1"), TypeError, "value must be a Payload"),
    (
        "details-as-dict",
        lambda: ErrorInfo(type="E", message="m", details={"a": 1}),
        TypeError,
        "details must be a Payload",
    ),
    ("message-not-str", lambda: ErrorInfo(type="E", message=5), TypeError, "message must be a str"),
    (
        "traceback-not-str",
        lambda: ErrorInfo(type="E", message="", traceback=[]),
        TypeError,
        "traceback must be a str",
    ),
    ("reason-not-str", lambda: WorkflowCancelled(reason=None), TypeError, "reason must be a str"),
    (
        "final-not-bool",
        lambda: ActivityFailed(
            activity_id=0,
            error=FULL_BODIES["ActivityFailed"].error,
            attempt=1,
            final=1,  # type: ignore[attr-defined]
        ),
        TypeError,
        "final must be a bool",
    ),
    (
        "cause-as-str",
        lambda: ActivityError(cause="retryable", type="E", message=""),
        TypeError,
        "cause",
    ),
    (
        "timer-cause-as-str",
        lambda: TimerCancelled(timer_id="named:t", cause="workflow_intent"),
        TypeError,
        "cause",
    ),
    ("timeout-kind-as-str", lambda: WorkflowTimedOut(timeout_kind="deadline"), TypeError, "timeout_kind"),
    ("error-as-activity-error", lambda: WorkflowFailed(error=ACTIVITY_ERROR), TypeError, "error"),
    (
        "activity-error-as-error-info",
        lambda: ActivityFailed(activity_id=0, error=ERROR, attempt=1, final=True),
        TypeError,
        "error",
    ),
    (
        "search-attributes-not-mapping",
        lambda: started(search_attributes=[("k", 1)]),
        TypeError,
        "must be a mapping",
    ),
]

ERROR = ErrorInfo(type="E", message="m")
ACTIVITY_ERROR = ActivityError(cause=FailureCause.TERMINAL, type="E", message="m")


@pytest.mark.parametrize(("case", "build", "exc", "message"), INVALID, ids=[c[0] for c in INVALID])
def test_invalid_values_are_refused_with_a_message_naming_the_field(
    case: str, build: Callable[[], object], exc: type[Exception], message: str
) -> None:
    with pytest.raises(exc, match=message):
        build()


@pytest.mark.parametrize(
    "build",
    [
        lambda: event(recorded_at=datetime(2026, 1, 1, tzinfo=timezone(timedelta(hours=9)))),
        lambda: event(seq=2**62),
        lambda: event(workflow_id="x" * 512),
        lambda: ActivityStarted(activity_id=0, attempt=1),
        lambda: WorkflowReopened(run_id=RUN_ID, reopened_activity_ids=[]),
        lambda: started(timeout=timedelta(microseconds=1), parent_workflow_id="parent"),
        lambda: TimerFired(timer_id="named:a:b c"),
        lambda: TimerFired(timer_id="anonymous:0"),
        lambda: TimerFired(timer_id="anonymous:10"),
        lambda: TimerFired(timer_id="scope:7"),
        lambda: TimerFired(timer_id=f"deadline:{RUN_ID}"),
        lambda: ErrorInfo(type="E", message=""),
        lambda: WorkflowCancelled(reason=""),
    ],
)
def test_boundary_values_are_accepted(build: Callable[[], object]) -> None:
    # Control for the refusals above: the validators are not simply refusing everything.
    build()


def test_engine_reserved_timer_ids_are_valid_in_events() -> None:
    # deadline: and scope: are reserved for the engine (the API refuses them from
    # users), but the engine records them, so the event model must accept them.
    for timer_id in (f"deadline:{RUN_ID}", "scope:0"):
        assert TimerStarted(timer_id=timer_id, fire_at=RECORDED_AT).timer_id == timer_id
        assert TimerCancelled(timer_id=timer_id, cause=TimerCancelCause.CANCEL_TEARDOWN).timer_id == timer_id


# --------------------------------------------------------------------------
# Search attributes
# --------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["a", "_private", "Customer.Tier", "order-id", "x1", "é", "k" * 128])
def test_valid_search_attribute_names(key: str) -> None:
    assert validate_search_key(key) == key
    assert dict(SearchAttributesUpserted(attributes={key: 1}).attributes) == {key: 1}


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("", "must be a non-empty str"),
        ("k" * 129, "<= 128 chars"),
        (3, "must be a non-empty str"),
        ("1st", "must start with a letter or '_'"),
        ("-x", "must start with a letter or '_'"),
        ("a b", "contain only"),
        ("a/b", "contain only"),
        ("a=b", "contain only"),
        ("a'b", "contain only"),
    ],
)
def test_invalid_search_attribute_names(key: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        validate_search_key(key)
    with pytest.raises(ValueError, match=message):
        SearchAttributesUpserted(attributes={key: 1})
    with pytest.raises(ValueError, match=message):
        started(search_attributes={key: 1})


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (float("nan"), "not a finite number"),
        (float("inf"), "not a finite number"),
        (float("-inf"), "not a finite number"),
        ({"a": 1}, "dict is not supported"),
        (None, "NoneType is not supported"),
        (RECORDED_AT, "datetime is not supported.*ISO-8601"),
        ([1, 2], "a list value must hold only str"),
        (["a", None], "a list value must hold only str"),
        (b"bytes", "bytes is not supported"),
    ],
)
def test_invalid_search_attribute_values(value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SearchAttributesUpserted(attributes={"k": value})


def test_search_attribute_values_normalise_lists_to_tuples() -> None:
    body = SearchAttributesUpserted(attributes={"tags": ["a", "b"], "n": 1, "f": 0.5, "b": False, "s": ""})
    assert body.attributes == {"tags": ("a", "b"), "n": 1, "f": 0.5, "b": False, "s": ""}
    assert validate_search_attributes({"t": ("x",)}) == {"t": ("x",)}


def test_search_attributes_are_immutable_and_not_aliased() -> None:
    source: dict[str, Any] = {"k": 1, "tags": ["a"]}
    body = started(search_attributes=source)
    source["k"] = 2
    source["tags"].append("b")
    assert body.search_attributes == {"k": 1, "tags": ("a",)}
    with pytest.raises(TypeError):
        body.search_attributes["k"] = 3  # type: ignore[index]
    with pytest.raises(AttributeError):
        body.search_attributes.update({"k": 3})  # type: ignore[attr-defined]
    assert "k" in body.search_attributes
    assert len(body.search_attributes) == 2
    assert dict(body.search_attributes) == {"k": 1, "tags": ("a",)}
    assert repr(body.search_attributes) == "{'k': 1, 'tags': ('a',)}"


# --------------------------------------------------------------------------
# Frozen-ness, equality, hashing
# --------------------------------------------------------------------------


@pytest.mark.parametrize("body", list(FULL_BODIES.values()), ids=list(FULL_BODIES))
def test_every_body_is_frozen_and_hashable(body: EventBody) -> None:
    first_field = attrs.fields(type(body))[0].name
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        setattr(body, first_field, None)
    # Hashable all the way down (search attributes included), and equal bodies hash equal.
    copy = attrs.evolve(body)
    assert copy == body
    assert hash(copy) == hash(body)
    assert {body, copy} == {body}


def test_events_and_records_are_frozen() -> None:
    ev = sample_events()[0]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        ev.seq = 2  # type: ignore[misc]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        ERROR.message = "changed"  # type: ignore[misc]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        P.json = "2"  # type: ignore[misc]
    assert hash(ev) == hash(attrs.evolve(ev))


def test_evolve_revalidates() -> None:
    with pytest.raises(ValueError, match="seq must be an int >= 1"):
        attrs.evolve(sample_events()[0], seq=0)


def test_bodies_are_keyword_only() -> None:
    with pytest.raises(TypeError):
        TimerFired("named:t")  # type: ignore[misc]


# --------------------------------------------------------------------------
# Envelope helpers, terminal flags, make_batch
# --------------------------------------------------------------------------


def test_event_type_and_terminal_flags() -> None:
    assert event().type == "WorkflowStarted"
    assert not event().is_terminal
    assert set(TERMINAL_TYPES) == {
        WorkflowCompleted,
        WorkflowFailed,
        WorkflowCancelled,
        WorkflowTimedOut,
        WorkflowContinuedAsNew,
        WorkflowReset,
    }
    for name, body in FULL_BODIES.items():
        assert is_terminal_body(body) == (type(body) in TERMINAL_TYPES), name
        assert event(body).is_terminal == (type(body) in TERMINAL_TYPES), name


def test_event_types_are_keyed_by_class_name_and_cover_every_body_class() -> None:
    assert all(cls.__name__ == name for name, cls in EVENT_TYPES.items())
    assert set(EVENT_TYPES.values()) == set(_all_subclasses(EventBody))


def _all_subclasses(cls: type) -> set[type]:
    out = set()
    for sub in cls.__subclasses__():
        if sub.__module__.startswith("aion_trio"):
            out.add(sub)
            out |= _all_subclasses(sub)
    return out


def test_workflow_status_is_terminal() -> None:
    assert not WorkflowStatus.RUNNING.is_terminal
    assert all(s.is_terminal for s in WorkflowStatus if s is not WorkflowStatus.RUNNING)


def test_make_batch_envelopes_with_contiguous_seqs() -> None:
    bodies = [started(), ActivityStarted(activity_id=0, attempt=1), TimerFired(timer_id="named:t")]
    batch = make_batch("wf", 5, RECORDED_AT, bodies)
    assert [e.seq for e in batch] == [5, 6, 7]
    assert [e.body for e in batch] == bodies
    assert {e.workflow_id for e in batch} == {"wf"}
    assert {e.recorded_at for e in batch} == {RECORDED_AT}
    assert make_batch("wf", 1, RECORDED_AT, ()) == []


def test_make_batch_validates_like_the_envelope() -> None:
    with pytest.raises(ValueError, match="seq must be an int >= 1"):
        make_batch("wf", 0, RECORDED_AT, [started()])
    with pytest.raises(ValueError, match="timezone-aware"):
        make_batch("wf", 1, NAIVE, [started()])
    with pytest.raises(ValueError, match="workflow_id must not be empty"):
        make_batch("", 1, RECORDED_AT, [started()])


def test_utc_normalises_aware_datetimes_and_refuses_naive_ones() -> None:
    tokyo = datetime(2026, 1, 1, 9, 0, tzinfo=timezone(timedelta(hours=9)))
    assert utc(tokyo) == datetime(2026, 1, 1, 0, 0, tzinfo=timezone.utc)
    assert utc(tokyo).tzinfo is timezone.utc
    with pytest.raises(ValueError, match="naive"):
        utc(NAIVE)


def test_events_compare_by_instant_not_by_timezone() -> None:
    tokyo = RECORDED_AT.astimezone(timezone(timedelta(hours=9)))
    assert event(recorded_at=tokyo) == event(recorded_at=RECORDED_AT)
