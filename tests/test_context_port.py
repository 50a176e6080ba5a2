"""The workflow context alone, driven against a fake port: no engine, no store, no recorder.

This is the seam of the context's layer (``aion_trio._context.RunActivation``
built with an ``aion_trio._ports.WorkflowPort``): what workflow code does is
decided from the history the port shows and the commands it hands the port,
nothing else.  The fake keeps a history list, records the command batches it
is given and appends what an engine would (schedules, timer starts); the test
plays the world (an activity's outcome) by appending to that history.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import trio
import trio.testing

import aion_trio as aion
from aion_trio._context import RunActivation
from aion_trio._events import input_digest
from aion_trio._payload import Payload, PayloadCodec
from aion_trio._ports import RunAborted, ScheduleActivity, StartTimer, WorkflowCommand
from aion_trio._projections import RunState
from aion_trio.events import (
    ActivityCompleted,
    ActivityScheduled,
    ActivityStarted,
    Event,
    EventBody,
    TimerStarted,
    WorkflowCancelled,
    WorkflowStarted,
)

RUN_ID = "7d0c2c4e-3b1f-4f7e-9a52-0c8f3f1d2a61"
STARTED_AT = datetime(2030, 1, 1, tzinfo=timezone.utc)


@aion.activity
async def greet(name: str) -> str:
    raise AssertionError("the fake port never runs activities")  # pragma: no cover


@aion.activity
async def shout(name: str) -> str:
    raise AssertionError("the fake port never runs activities")  # pragma: no cover


ACTIVITIES = {d.name: d for d in (greet, shout)}


class FakePort:
    """A ``WorkflowPort`` over a plain list of events."""

    workflow_id = "wf"
    run_id = RUN_ID
    workflow_type = "greeter"

    def __init__(self, history: Sequence[EventBody] = ()) -> None:
        self.codec = PayloadCodec()
        self.history: list[Event] = []
        self._changed = trio.lowlevel.ParkingLot()
        self.append(WorkflowStarted(workflow_type=self.workflow_type, input=Payload("[]"), run_id=RUN_ID))
        self.append(*history)
        #: Everything already in history when the execution begins replays.
        self.start_head = len(self.history)
        self.read_only = False
        self.state = RunState(RUN_ID, self.history)
        self.batches: list[list[WorkflowCommand]] = []
        self.parks = 0

    def append(self, *bodies: EventBody) -> None:
        for body in bodies:
            seq = len(self.history) + 1
            at = STARTED_AT + timedelta(seconds=seq)
            self.history.append(Event(workflow_id=self.workflow_id, seq=seq, recorded_at=at, body=body))
        self._changed.unpark_all()

    # -- the port --------------------------------------------------------------------

    def run_state(self) -> RunState:
        self.state.sync()
        return self.state

    def history_length(self) -> int:
        return len(self.history)

    async def wait_changed(self) -> None:
        await self._changed.park()

    def parked(self) -> None:
        self.parks += 1

    def activity_definition(self, activity: Any) -> Any:
        return ACTIVITIES[activity if isinstance(activity, str) else activity.name]

    def workflow_definition(self, workflow: Any) -> Any:
        raise AssertionError("no child workflows here")  # pragma: no cover

    def registered_workflow(self, workflow_type: str) -> Any:
        return None

    def resolved_activity_options(
        self, definition: Any, call_layer: Mapping[str, Any]
    ) -> tuple[str, Payload]:
        return "default", Payload("{}")

    async def record_commands(self, commands: Sequence[WorkflowCommand]) -> None:
        await trio.lowlevel.checkpoint()
        self.batches.append(list(commands))
        for command in commands:
            if isinstance(command, ScheduleActivity):
                self.append(
                    ActivityScheduled(
                        activity_id=command.ordinal,
                        activity_type=command.definition.name,
                        input=command.input,
                        task_queue=command.task_queue,
                        options=command.options,
                        input_digest=input_digest(command.input),
                    ),
                    ActivityStarted(activity_id=command.ordinal, attempt=1),
                )
            elif isinstance(command, StartTimer):
                self.append(TimerStarted(timer_id=command.timer_id, fire_at=command.fire_at))

    async def record_marker(self, name: str, value: Payload) -> None:
        raise AssertionError("no markers here")  # pragma: no cover

    async def record_activities_cancelled(
        self, activity_ids: Sequence[int], *, by_workflow: bool = False
    ) -> None:
        raise AssertionError("nothing is cancelled here")  # pragma: no cover

    async def record_activity_scope_timeout(self, activity_id: int, scope_timer: str) -> Event:
        raise AssertionError("no timeout scopes here")  # pragma: no cover

    async def record_timer_scope_timeout(self, timer_id: str, scope_timer: str) -> Event:
        raise AssertionError("no timeout scopes here")  # pragma: no cover

    async def cancel_recorded_child(self, ordinal: int) -> None:
        raise AssertionError("no child workflows here")  # pragma: no cover


def completed(activity_id: int, value: Any) -> ActivityCompleted:
    return ActivityCompleted(activity_id=activity_id, result=Payload.of(value), attempt=1)


def recorded_greeting(name: str, result: str) -> list[EventBody]:
    """The history a live run of ``await ctx.run(greet, name)`` leaves behind."""
    arguments = PayloadCodec().encode([name])
    return [
        ActivityScheduled(
            activity_id=0,
            activity_type=greet.name,
            input=arguments,
            input_digest=input_digest(arguments),
        ),
        ActivityStarted(activity_id=0, attempt=1),
        completed(0, result),
    ]


async def execute(
    port: FakePort, code: Callable[[aion.WorkflowContext], Awaitable[Any]]
) -> tuple[RunActivation, Any]:
    """Run ``code`` as the run's task does: in a task of its own, then flush what it left."""
    outcome: dict[str, Any] = {}
    with trio.fail_after(5):
        activation = RunActivation(port)
        outcome["value"] = await code(activation.context)
        await activation.flush()
    return activation, outcome["value"]


async def test_replay_returns_recorded_results_and_records_nothing() -> None:
    port = FakePort(recorded_greeting("ada", "hello ada"))
    seen: list[bool] = []

    async def code(ctx: aion.WorkflowContext) -> Any:
        seen.append(ctx.is_replaying)
        value = await ctx.run(greet, "ada")
        return value, ctx.now()

    activation, (value, now) = await execute(port, code)
    assert value == "hello ada"
    assert now == port.history[-1].recorded_at  # advanced to the consumed resolution only
    assert seen == [True]
    assert port.batches == []
    assert port.parks == 0  # history resolved the await: the code never parked
    assert activation.poisoned is None
    assert activation.unissued_recorded_command() is None


async def test_a_live_command_is_recorded_through_the_port_as_one_batch() -> None:
    port = FakePort()
    results: list[Any] = []

    async def code(ctx: aion.WorkflowContext) -> None:
        handle = ctx.start(greet, "bob")
        timer = ctx.start_timer("reminder", 30)
        assert port.batches == []  # queued until the next await
        results.append(await handle)
        results.append(timer.fire_at)

    async with trio.open_nursery() as nursery:
        done = trio.Event()

        async def run() -> None:
            await execute(port, code)
            done.set()

        nursery.start_soon(run)
        await trio.testing.wait_all_tasks_blocked()
        assert port.parks == 1  # parked, caught up, waiting for the activity's outcome
        [batch] = port.batches
        schedule, start_timer = batch
        assert isinstance(schedule, ScheduleActivity)
        assert (schedule.ordinal, schedule.definition.name, schedule.task_queue) == (0, greet.name, "default")
        assert schedule.input.value() == ["bob"]
        assert isinstance(start_timer, StartTimer)
        assert start_timer.timer_id.endswith("reminder")
        assert start_timer.fire_at == STARTED_AT + timedelta(seconds=1 + 30)
        port.append(completed(0, "hello bob"))  # the world answers: the outcome is recorded first
        with trio.fail_after(5):
            await done.wait()
    assert results == ["hello bob", STARTED_AT + timedelta(seconds=31)]
    assert len(port.batches) == 1


async def test_a_changed_command_is_non_determinism_and_poisons_the_execution() -> None:
    port = FakePort(recorded_greeting("ada", "hello ada"))
    later: list[BaseException] = []

    async def code(ctx: aion.WorkflowContext) -> None:
        try:
            await ctx.run(shout, "ada")  # history recorded greet here
        except aion.NonDeterminismError:
            try:
                ctx.start(greet, "ada")
            except aion.NonDeterminismError as again:
                later.append(again)
            raise

    activation = RunActivation(port)
    with trio.fail_after(5), pytest.raises(aion.NonDeterminismError) as raised:
        await code(activation.context)
    assert raised.value.run_id == RUN_ID
    assert greet.name in str(raised.value)
    assert shout.name in str(raised.value)
    assert activation.poisoned is raised.value
    assert later == [raised.value]  # every later command raises the same divergence
    assert port.batches == []


async def test_changed_arguments_are_non_determinism_naming_the_argument() -> None:
    port = FakePort(recorded_greeting("ada", "hello ada"))
    activation = RunActivation(port)
    with trio.fail_after(5), pytest.raises(aion.NonDeterminismError, match="argument 0 changed"):
        await activation.context.run(greet, "eve")
    assert port.batches == []


async def test_code_that_stops_short_of_its_history_leaves_a_recorded_command_unissued() -> None:
    port = FakePort(recorded_greeting("ada", "hello ada"))

    async def code(ctx: aion.WorkflowContext) -> str:
        return "done early"

    activation, _ = await execute(port, code)
    assert activation.unissued_recorded_command() == ("activity", 0, f"activity {greet.name!r}")


async def test_a_terminal_recorded_from_outside_aborts_the_parked_code() -> None:
    port = FakePort()

    async def code(ctx: aion.WorkflowContext) -> None:
        await ctx.run(greet, "bob")

    async with trio.open_nursery() as nursery:
        aborted = trio.Event()

        async def run() -> None:
            with pytest.raises(RunAborted):
                await execute(port, code)
            aborted.set()

        nursery.start_soon(run)
        await trio.testing.wait_all_tasks_blocked()
        port.append(WorkflowCancelled(reason="terminated", terminated=True))
        with trio.fail_after(5):
            await aborted.wait()
