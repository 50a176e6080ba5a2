"""The replayer: recorded histories replayed against the current workflow code.

``await replay(workflows, histories)`` runs each run's code against its
recorded history through the engine's own replay (:class:`~aion_trio._context.RunActivation`
over a port that serves the history and records nothing), and reports per
run: a match, or the first divergence -- the same
:class:`~aion_trio.NonDeterminismError` the engine marks a run stuck with,
naming the event's seq, what it recorded and what the code did instead.

Nothing runs for real: no activity, no timer, no store.  A history that is
still running replays up to its end (the code's next step would have been
live) and counts as a match; a finished one must reach its recorded end.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Union, final

import attrs

from .._contain import is_structural
from .._context import ContinueAsNew, RunActivation
from .._definitions import ActivityDefinition, ActivityLoop, WorkflowDefinition, index_definitions
from .._errors import (
    EventDecodeError,
    InvalidHistory,
    NonDeterminismError,
    UnknownActivityType,
    UnknownWorkflowType,
    WorkflowCancelled,
)
from .._events import (
    Event,
    EventBody,
    WorkflowCancelled as CancelledEvent,
    WorkflowCompleted,
    WorkflowContinuedAsNew,
    WorkflowFailed,
    WorkflowReset,
    WorkflowStarted,
    WorkflowTimedOut,
)
from .._guard import install as install_guard
from .._payload import PayloadCodec
from .._projections import RunState
from .._run_port import HistoryEnded, HistoryPort
from .._wire import event_from_json


def _event_tuple(events: Iterable[Event]) -> tuple[Event, ...]:
    return tuple(events)


@final
@attrs.frozen
class History:
    """One workflow's whole history and where it came from (a file, a store, ...)."""

    source: str
    events: tuple[Event, ...] = attrs.field(converter=_event_tuple)


HistorySource = Union[History, Sequence[Event], str, "os.PathLike[str]"]
"""A history to replay: a :class:`History`, its events, or the path of a file (JSON
lines, as ``aion-trio history ID --json`` prints) or of a directory of such files."""

#: The file names a directory of histories is read for.
HISTORY_SUFFIXES = (".jsonl", ".json")


@final
@attrs.frozen(kw_only=True)
class ReplayResult:
    """What replaying one run of one history found.

    ``error`` is ``None`` for a match; a :class:`~aion_trio.NonDeterminismError`
    when the code diverged from history (then :attr:`seq`, :attr:`expected` and
    :attr:`got` say where and how); another error when the run could not be
    replayed at all (an :class:`~aion_trio.UnknownWorkflowType`, an input that
    does not decode).  ``complete`` says whether history holds the run's end.
    """

    source: str
    workflow_id: str
    run_id: str
    workflow_type: str
    complete: bool
    error: BaseException | None = None

    @property
    def ok(self) -> bool:
        """Whether the run replayed without error (``error`` is ``None``)."""
        return self.error is None

    @property
    def diverged(self) -> bool:
        """Whether the code diverged from the history (``error`` is a ``NonDeterminismError``)."""
        return isinstance(self.error, NonDeterminismError)

    @property
    def seq(self) -> int | None:
        """The recorded event the code diverged at."""
        return self.error.seq if isinstance(self.error, NonDeterminismError) else None

    @property
    def expected(self) -> str | None:
        """What history recorded there."""
        return self.error.recorded if isinstance(self.error, NonDeterminismError) else None

    @property
    def got(self) -> str | None:
        """What the code did instead."""
        return self.error.requested if isinstance(self.error, NonDeterminismError) else None

    @property
    def verdict(self) -> str:
        """``"match"``, ``"diverged"`` or ``"error"``."""
        return "match" if self.error is None else "diverged" if self.diverged else "error"

    def describe(self) -> str:
        """One line for people: the run, and what replaying it found."""
        run = f"{self.workflow_id!r} run {self.run_id} ({self.workflow_type}) from {self.source}"
        if self.error is None:
            return f"match: {run}" + ("" if self.complete else ", replayed up to its end (still running)")
        if self.diverged:
            return f"diverged: {run} at seq {self.seq}: history has {self.expected}, the code {self.got}"
        return f"error: {run}: {type(self.error).__name__}: {self.error}"


@final
@attrs.frozen
class ReplayReport:
    """The results of a replay, one per run, in the order the histories were given."""

    results: tuple[ReplayResult, ...]

    @property
    def ok(self) -> bool:
        """Every run matched."""
        return all(r.ok for r in self.results)

    @property
    def failures(self) -> tuple[ReplayResult, ...]:
        """The results that are not ``ok`` (diverged or failed otherwise), in order."""
        return tuple(r for r in self.results if not r.ok)

    def check(self) -> None:
        """Raise the first failure's error (a test's one-line assertion); nothing if all matched."""
        for result in self.results:
            if result.error is not None:
                raise result.error


async def replay(
    workflows: Iterable[WorkflowDefinition[Any]],
    histories: HistorySource | Iterable[HistorySource],
    *,
    activities: Iterable[ActivityDefinition[Any]] = (),
    codec: PayloadCodec | None = None,
) -> ReplayReport:
    """Replay recorded histories against ``workflows`` (the current code); report per run.

    ``histories`` is a history or several: lists of :class:`~aion_trio.Event`
    (``await engine.history(id)``), or paths of files of JSON lines (``aion-trio
    history ID --json``; a file may hold several workflows' histories one after
    the other) or of directories of such files (``*.jsonl`` and ``*.json``).
    Every run of each history is replayed in the calling task; nothing is
    written anywhere and no activity runs.  ``activities`` are only looked up
    (a workflow that names an activity by string); ``codec`` encodes arguments
    as the engine did (its default if not given).

    A file that is not JSON-lines events, or events that are not a workflow's
    whole history, raise :class:`~aion_trio.InvalidHistory`; what replaying
    finds is in the report (call :meth:`ReplayReport.check` to raise it).
    """
    workflow_map, activity_map = index_definitions(tuple(workflows), tuple(activities))
    install_guard(d.fn for d in workflow_map.values())  # the guard the engine runs the code under
    codec = codec if codec is not None else PayloadCodec()
    results: list[ReplayResult] = []
    for history in _histories(histories):
        events = list(history.events)
        for start in [e for e in events if isinstance(e.body, WorkflowStarted)]:
            results.append(
                await _replay_run(history.source, events, start, workflow_map, activity_map, codec)
            )
    return ReplayReport(tuple(results))


def read_histories(path: str | os.PathLike[str]) -> list[History]:
    """The histories in a file of JSON lines or a directory of them, one per workflow.

    Raises :class:`~aion_trio.InvalidHistory` naming the file (and line) that is not one.
    """
    root = Path(path)
    if root.is_dir():
        files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in HISTORY_SUFFIXES)
        if not files:
            raise InvalidHistory(
                str(root), f"the directory holds no history files ({', '.join(HISTORY_SUFFIXES)})"
            )
        return [found for file in files for found in _read_file(file)]
    return _read_file(root)


def _read_file(path: Path) -> list[History]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidHistory(str(path), f"cannot read it: {exc}") from exc
    by_workflow: dict[str, list[Event]] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            event = event_from_json(line)
        except EventDecodeError as exc:
            raise InvalidHistory(
                f"{path}:{number}", f"not an event as 'aion-trio history ID --json' prints them: {exc}"
            ) from exc
        by_workflow.setdefault(event.workflow_id, []).append(event)
    if not by_workflow:
        raise InvalidHistory(str(path), "the file holds no events")
    return [History(str(path), _whole(str(path), events)) for events in by_workflow.values()]


def _histories(histories: HistorySource | Iterable[HistorySource]) -> list[History]:
    if isinstance(histories, (str, os.PathLike)):
        return read_histories(histories)
    if isinstance(histories, History):
        return [History(histories.source, _whole(histories.source, list(histories.events)))]
    items: list[Any] = list(histories)
    if items and all(isinstance(item, Event) for item in items):
        items = [items]  # one history, given as its events
    found: list[History] = []
    for item in items:
        if isinstance(item, (str, os.PathLike)):
            found.extend(read_histories(item))
            continue
        if isinstance(item, History):
            found.append(History(item.source, _whole(item.source, list(item.events))))
            continue
        events = list(item)
        if not events or not all(isinstance(e, Event) for e in events):
            raise InvalidHistory(
                f"history #{len(found) + 1}",
                "a history is a non-empty list of events, or a file or directory path",
            )
        source = f"the history of {events[0].workflow_id!r}"
        found.append(History(source, _whole(source, events)))
    return found


def _whole(source: str, events: list[Event]) -> list[Event]:
    """``events`` if they are one workflow's whole history (seq 1, 2, ... from its start)."""
    workflow_id = events[0].workflow_id
    for expected, event in enumerate(events, 1):
        if event.workflow_id != workflow_id:
            raise InvalidHistory(
                source,
                f"events of workflows {workflow_id!r} and {event.workflow_id!r} are mixed in one history",
            )
        if event.seq != expected:
            raise InvalidHistory(
                source,
                f"workflow {workflow_id!r}: expected seq {expected}, found {event.seq}; a replay needs the "
                "whole history, as 'aion-trio history ID --json' prints it",
            )
    if not isinstance(events[0].body, WorkflowStarted):
        raise InvalidHistory(
            source, f"workflow {workflow_id!r}: the history does not begin with WorkflowStarted"
        )
    return events


async def _replay_run(
    source: str,
    events: list[Event],
    start: Event,
    workflows: Mapping[str, WorkflowDefinition[Any]],
    activities: Mapping[str, ActivityDefinition[Any]],
    codec: PayloadCodec,
) -> ReplayResult:
    body = start.body
    assert isinstance(body, WorkflowStarted)
    state = RunState(body.run_id, events)
    state.sync()
    ended = state.ended
    result = ReplayResult(
        source=source,
        workflow_id=start.workflow_id,
        run_id=body.run_id,
        workflow_type=body.workflow_type,
        complete=ended is not None,
    )
    definition = workflows.get(body.workflow_type)
    if definition is None:
        return attrs.evolve(result, error=UnknownWorkflowType(body.workflow_type, sorted(workflows)))
    history = events
    if ended is not None and _ended_from_outside(ended.body):
        # Terminated or timed out: the code stopped wherever it was then, so it replays
        # the history before that end as a run still going.
        history = [e for e in events if e.seq < ended.seq]
    elif ended is not None and isinstance(ended.body, WorkflowReset):
        # Reset: its history counts up to the reset point only (what came after was
        # replaced by the new run, and may no longer match the current code).
        to_seq = ended.body.to_seq
        history = [e for e in events if e.seq <= to_seq]
    # Not a query's read-only replay: code that goes past the end of a finished
    # history is a divergence to report, not a stop.
    port = HistoryPort(
        _GivenDefinitions(codec, workflows, activities),
        history,
        workflow_id=start.workflow_id,
        run_id=body.run_id,
        workflow_type=body.workflow_type,
        read_only=False,
    )
    try:
        activation = RunActivation(port)
        raw_args = codec.decode(activation.input)
    except Exception as exc:
        return attrs.evolve(result, error=exc)
    args = raw_args if isinstance(raw_args, list) else [raw_args]
    exit: tuple[str, type[EventBody]]
    try:
        args = definition.hints.decode_arguments(args, what=f"input of workflow {definition.name!r}")
        await activation.run(definition.fn, *args, guarded=True)
        await activation.flush()
        exit = ("the workflow to return", WorkflowCompleted)
    except HistoryEnded:
        state = port.run_state()
        recorded_end = state.ended
        if recorded_end is None:
            return result  # the code reached the end of a history still running: a match
        return attrs.evolve(
            result,
            error=NonDeterminismError(
                result.workflow_id,
                result.run_id,
                "run end",
                len(state.commands),
                f"the run's end ({type(recorded_end.body).__name__})",
                "a step history does not hold",
                seq=recorded_end.seq,
            ),
        )
    except NonDeterminismError as exc:
        return attrs.evolve(result, error=exc)
    except WorkflowCancelled:
        exit = ("the workflow to end cancelled", CancelledEvent)
    except ContinueAsNew:
        exit = ("the workflow to continue as new", WorkflowContinuedAsNew)
    except BaseException as exc:
        if is_structural(exc):
            raise
        exit = (f"the workflow to fail ({type(exc).__name__})", WorkflowFailed)
    finally:
        activation.detach()
    return attrs.evolve(result, error=activation.exit_divergence(*exit))


def _ended_from_outside(body: EventBody) -> bool:
    return isinstance(body, WorkflowTimedOut) or (isinstance(body, CancelledEvent) and body.terminated)


async def _not_run(*args: Any) -> None:
    raise AssertionError("the replayer never runs activities or child workflows")


@final
class _GivenDefinitions:
    """The replayer's lookups: the definitions it was given; an activity or child workflow
    named by string and not given stands in by name (replay only compares its name and
    arguments, and never runs it)."""

    def __init__(
        self,
        codec: PayloadCodec,
        workflows: Mapping[str, WorkflowDefinition[Any]],
        activities: Mapping[str, ActivityDefinition[Any]],
    ) -> None:
        self.codec = codec
        self.workflows = workflows
        self._activities = activities

    def activity_definition(self, activity: ActivityDefinition[Any] | str) -> ActivityDefinition[Any]:
        if isinstance(activity, ActivityDefinition):
            return activity
        if not isinstance(activity, str):
            raise UnknownActivityType(str(activity), sorted(self._activities))
        found = self._activities.get(activity)
        return found or ActivityDefinition(name=activity, fn=_not_run, loop=ActivityLoop.TRIO)

    def workflow_definition(self, workflow: WorkflowDefinition[Any] | str) -> WorkflowDefinition[Any]:
        if isinstance(workflow, WorkflowDefinition):
            return workflow
        if not isinstance(workflow, str):
            raise UnknownWorkflowType(str(workflow), sorted(self.workflows))
        return self.workflows.get(workflow) or WorkflowDefinition(name=workflow, fn=_not_run)
