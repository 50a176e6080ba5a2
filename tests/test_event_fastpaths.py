"""The engine's hot-path helpers over event bodies: building a body from trusted values,
and finding a run's lifecycle events in a batch."""

from __future__ import annotations

from datetime import datetime, timezone

import attrs
import pytest

from aion_trio._events import (
    ActivityCompleted,
    ActivityScheduled,
    ActivityStarted,
    Event,
    EventBody,
    SearchAttributesUpserted,
    WorkflowCompleted,
    WorkflowReopened,
    WorkflowStarted,
    has_lifecycle,
    make_batch,
    trusted,
)
from aion_trio._payload import Payload

AT = datetime(2026, 1, 1, tzinfo=timezone.utc)
RUN = "7d3f8a2e-52a1-4c0e-9a44-2f1c7b0e9d11"


def test_a_trusted_body_equals_the_validated_one() -> None:
    fields = dict(
        activity_id=3,
        activity_type="charge",
        input=Payload.of({"order": 3}),
        task_queue="default",
        options=Payload("{}"),
        input_digest="ab12",
    )
    built = trusted(ActivityScheduled, **fields)
    checked = ActivityScheduled(**fields)  # type: ignore[arg-type]
    assert type(built) is ActivityScheduled
    assert built == checked
    assert hash(built) == hash(checked)
    assert attrs.asdict(built, recurse=False) == fields
    started = trusted(ActivityStarted, activity_id=3, attempt=2)
    assert started == ActivityStarted(activity_id=3, attempt=2)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        started.attempt = 5  # type: ignore[misc]


def test_trusted_refuses_missing_or_unknown_fields_and_converted_types() -> None:
    with pytest.raises(TypeError, match="needs exactly the fields"):
        trusted(ActivityStarted, activity_id=3)
    with pytest.raises(TypeError, match="needs exactly the fields"):
        trusted(ActivityStarted, activity_id=3, attempt=1, extra=1)
    # Defaults are not filled in: a partial schedule is refused, not half-built.
    with pytest.raises(TypeError, match="needs exactly the fields"):
        trusted(ActivityScheduled, activity_id=0, activity_type="a", input=Payload.of(None))
    with pytest.raises(TypeError, match="converts a field"):
        trusted(SearchAttributesUpserted, attributes={"a": 1})


def _event(seq: int, body: EventBody) -> Event:
    return Event(workflow_id="wf", seq=seq, recorded_at=AT, body=body)


def test_has_lifecycle_finds_starts_reopens_and_terminals_from_an_offset() -> None:
    step = [
        _event(2, ActivityScheduled(activity_id=0, activity_type="a", input=Payload.of(None))),
        _event(3, ActivityStarted(activity_id=0, attempt=1)),
        _event(4, ActivityCompleted(activity_id=0, result=Payload.of(1), attempt=1)),
    ]
    start = _event(1, WorkflowStarted(workflow_type="w", input=Payload.of(None), run_id=RUN))
    assert not has_lifecycle(step)
    assert not has_lifecycle([])
    assert has_lifecycle([start, *step])
    assert not has_lifecycle([start, *step], 1)
    assert has_lifecycle([*step, _event(5, WorkflowCompleted(result=Payload.of(1)))])
    assert has_lifecycle([*step, _event(5, WorkflowReopened(run_id=RUN, reopened_activity_ids=(0,)))], 3)
    assert not has_lifecycle([*step, _event(5, WorkflowCompleted(result=Payload.of(1)))], 4)


def test_make_batch_builds_what_the_envelope_would_and_still_checks_seq_time_and_bodies() -> None:
    bodies = [
        ActivityScheduled(activity_id=0, activity_type="a", input=Payload.of(None)),
        ActivityStarted(activity_id=0, attempt=1),
    ]
    for checked in (False, True):
        batch = make_batch("wf", 4, AT, bodies, checked_id=checked)
        assert batch == [
            Event(workflow_id="wf", seq=4, recorded_at=AT, body=bodies[0]),
            Event(workflow_id="wf", seq=5, recorded_at=AT, body=bodies[1]),
        ]
        with pytest.raises(ValueError, match="seq must be an int >= 1"):
            make_batch("wf", 0, AT, bodies, checked_id=checked)
        with pytest.raises(ValueError, match="seq must be an int >= 1"):
            make_batch("wf", True, AT, bodies, checked_id=checked)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="timezone-aware"):
            make_batch("wf", 1, AT.replace(tzinfo=None), bodies, checked_id=checked)
        with pytest.raises(TypeError, match="must be a datetime"):
            make_batch("wf", 1, "2026-01-01", bodies, checked_id=checked)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="event body types"):
            make_batch("wf", 1, AT, [bodies[0], "body"], checked_id=checked)  # type: ignore[list-item]
    # The id is the one field a recorder vouches for (it checks its own when made).
    with pytest.raises(ValueError, match="workflow_id must not be empty"):
        make_batch("", 1, AT, bodies)
    assert make_batch("", 1, AT, bodies, checked_id=True)[0].seq == 1
