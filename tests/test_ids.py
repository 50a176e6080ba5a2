"""Identifiers: construction, validation and printing in one place."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

from aion_trio._ids import (
    MAX_WORKFLOW_ID_LENGTH,
    activity_label,
    anonymous_timer,
    deadline_timer_id,
    is_reserved_timer_id,
    named_timer,
    new_run_id,
    new_workflow_id,
    scope_timer_id,
    validate_run_id,
    validate_timer_id,
    validate_workflow_id,
)

RUN = "3f1c2a9e-5b7d-4c1e-8f20-6a9b0c1d2e3f"


@pytest.mark.parametrize(
    "workflow_id", ["order-7", "a", "ünï/cødé ✓", "x" * MAX_WORKFLOW_ID_LENGTH, " spaced "]
)
def test_valid_workflow_ids(workflow_id: str) -> None:
    assert validate_workflow_id(workflow_id) == workflow_id


@pytest.mark.parametrize(
    ("workflow_id", "exc", "message"),
    [
        (7, TypeError, "workflow_id must be str, got int"),
        (None, TypeError, "workflow_id must be str, got NoneType"),
        ("", ValueError, "workflow_id must not be empty"),
        ("x" * (MAX_WORKFLOW_ID_LENGTH + 1), ValueError, "513 characters; the limit is 512"),
        ("a\x00b", ValueError, "control characters"),
        ("a\nb", ValueError, "control characters"),
        ("a\x7fb", ValueError, "control characters"),
    ],
)
def test_invalid_workflow_ids(workflow_id: Any, exc: type[Exception], message: str) -> None:
    with pytest.raises(exc, match=message):
        validate_workflow_id(workflow_id)


def test_validators_name_the_value_they_check() -> None:
    with pytest.raises(ValueError, match="child_workflow_id must not be empty"):
        validate_workflow_id("", "child_workflow_id")
    with pytest.raises(ValueError, match="parent_run_id 'x' is not a UUID"):
        validate_run_id("x", "parent_run_id")
    with pytest.raises(ValueError, match="my_timer 'x' must look like"):
        validate_timer_id("x", "my_timer")


def test_generated_ids_are_canonical_unique_uuids() -> None:
    runs = {new_run_id() for _ in range(100)}
    assert len(runs) == 100
    for run in runs:
        assert validate_run_id(run) == run
        assert uuid.UUID(run).version == 4
    workflow_id = new_workflow_id()
    assert validate_workflow_id(workflow_id) == workflow_id
    assert new_workflow_id() != workflow_id


@pytest.mark.parametrize(
    ("run_id", "exc", "message"),
    [
        ("run-1", ValueError, "is not a UUID"),
        ("", ValueError, "is not a UUID"),
        (RUN.upper(), ValueError, "not in canonical UUID form"),
        (RUN.replace("-", ""), ValueError, "not in canonical UUID form"),
        ("{" + RUN + "}", ValueError, "not in canonical UUID form"),
        ("urn:uuid:" + RUN, ValueError, "not in canonical UUID form"),
        (uuid.UUID(RUN), TypeError, "run_id must be str, got UUID"),
    ],
)
def test_invalid_run_ids(run_id: Any, exc: type[Exception], message: str) -> None:
    with pytest.raises(exc, match=message):
        validate_run_id(run_id)


def test_valid_run_id() -> None:
    assert validate_run_id(RUN) == RUN


def test_printing_helpers() -> None:
    assert activity_label(3) == "activity:3"
    assert named_timer("reminder") == "named:reminder"
    assert anonymous_timer(0) == "anonymous:0"
    assert deadline_timer_id(RUN) == f"deadline:{RUN}"
    assert scope_timer_id(2) == "scope:2"


def test_helper_refusals() -> None:
    with pytest.raises(ValueError, match="timer name must not be empty"):
        named_timer("")
    with pytest.raises(ValueError, match="timer ordinal must be >= 0"):
        anonymous_timer(-1)


def test_reserved_timer_ids() -> None:
    assert is_reserved_timer_id(deadline_timer_id(RUN))
    assert is_reserved_timer_id(scope_timer_id(0))
    assert not is_reserved_timer_id(named_timer("deadline"))
    assert not is_reserved_timer_id(anonymous_timer(0))
    # A user name that merely contains a reserved prefix is still the user's.
    assert not is_reserved_timer_id(named_timer("scope:1"))


@pytest.mark.parametrize(
    "timer_id",
    [
        "named:x",
        "named:a:b",
        "anonymous:0",
        "anonymous:42",
        "scope:3",
        f"deadline:{RUN}",
        "deadline:anything",
    ],
)
def test_valid_timer_ids(timer_id: str) -> None:
    assert validate_timer_id(timer_id) == timer_id


@pytest.mark.parametrize(
    "timer_id",
    ["", "x", ":x", "named:", "named", "cron:x", "anonymous:", "anonymous:x", "anonymous:01", "anonymous:-1",
     "anonymous:\u0661", "scope:1.0", "scope: 1", "deadline:"],
)  # fmt: skip
def test_invalid_timer_ids(timer_id: str) -> None:
    with pytest.raises(ValueError, match="timer_id"):
        validate_timer_id(timer_id)


@settings(max_examples=200, derandomize=True)
@given(
    name=st.text(min_size=1, max_size=20),
    ordinal=st.integers(0, 2**63),
    run=st.uuids(),
)
def test_every_id_the_helpers_make_is_valid(name: str, ordinal: int, run: uuid.UUID) -> None:
    for timer_id in (
        named_timer(name),
        anonymous_timer(ordinal),
        scope_timer_id(ordinal),
        deadline_timer_id(str(run)),
    ):
        assert validate_timer_id(timer_id) == timer_id
    assert validate_run_id(str(run)) == str(run)
