"""The engine's user surface: start, result, describe, history, list/count, activities.

Runs against the store selected by ``AION_TRIO_TEST_STORE`` (memory or sqlite).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest
import trio
import trio.lowlevel
import trio.testing

import aion_trio as aion
from aion_trio import projections
from aion_trio.testing import FlakyStoreBundle

# --------------------------------------------------------------------------
# Definitions used below
# --------------------------------------------------------------------------

CALLS: dict[str, int] = {}


@aion.activity
async def double(x: int) -> int:
    CALLS["double"] = CALLS.get("double", 0) + 1
    await trio.lowlevel.checkpoint()
    return x * 2


@aion.activity
def add_one_in_thread(x: int) -> int:
    return x + 1


@aion.activity
async def explode(message: str) -> None:
    raise ValueError(message)


@aion.workflow
async def pipeline(ctx: aion.WorkflowContext, x: int) -> dict[str, Any]:
    a = await ctx.run(double, x)
    h1 = ctx.start(double, a)
    h2 = ctx.start(add_one_in_thread, a)
    both = await ctx.gather(h1, h2)
    return {"a": a, "both": both}


@aion.workflow
async def fails_after_activity(ctx: aion.WorkflowContext, message: str) -> None:
    try:
        await ctx.run(explode, message)
    except aion.ActivityFailure as exc:
        raise RuntimeError(f"step failed: {exc.message}") from exc


@aion.workflow
async def returns_input(ctx: aion.WorkflowContext, value: Any) -> Any:
    return value


WORKFLOWS = [pipeline, fails_after_activity, returns_input]
ACTIVITIES = [double, add_one_in_thread, explode]


# --------------------------------------------------------------------------


async def _row_when(engine: aion.Engine, workflow_id: str, status: aion.WorkflowStatus) -> aion.VisibilityRow:
    """The visibility row once it shows ``status`` (it is updated right after the terminal)."""
    with trio.fail_after(10):
        while True:
            row = await engine.store.visibility.get(workflow_id)
            if row is not None and row.status is status:
                return row
            await trio.sleep(0.01)


async def test_a_workflow_runs_activities_and_returns_its_result(store_url: Callable[[], str]) -> None:
    async with aion.open_engine(store_url(), workflows=WORKFLOWS, activities=ACTIVITIES) as engine:
        run = await engine.start(pipeline, 5, workflow_id="order-5")
        assert await run.result() == {"a": 10, "both": [20, 11]}
        history = await engine.history("order-5")
        types = [e.type for e in history]
        assert types[0] == "WorkflowStarted"
        assert types[-1] == "WorkflowCompleted"
        assert types.count("ActivityScheduled") == 3
        assert types.count("ActivityCompleted") == 3
        # seqs are contiguous from 1
        assert [e.seq for e in history] == list(range(1, len(history) + 1))
        description = await engine.describe("order-5")
        assert description.status is aion.WorkflowStatus.COMPLETED
        assert description.result == {"a": 10, "both": [20, 11]}
        assert description.pending_activities == ()
        assert description.close_time is not None
        assert description.close_time >= description.start_time


async def test_a_failing_workflow_records_the_failure_and_result_raises(store_url: Callable[[], str]) -> None:
    async with aion.open_engine(store_url(), workflows=WORKFLOWS, activities=ACTIVITIES) as engine:
        run = await engine.start(fails_after_activity, "card declined", workflow_id="bad")
        with pytest.raises(aion.WorkflowFailure) as info:
            await run.result()
        assert info.value.status == "failed"
        assert info.value.error.type == "RuntimeError"
        assert "card declined" in info.value.error.message
        # Visibility follows the terminal (the waiter is woken first).
        row = await _row_when(engine, "bad", aion.WorkflowStatus.FAILED)
        assert row.failed_step == "activity:0 explode"
        assert row.failure_reason is not None
        assert "card declined" in row.failure_reason
        failed = [e.body for e in await engine.history("bad") if isinstance(e.body, aion.ActivityFailed)]
        assert len(failed) == 1
        assert failed[0].final
        assert failed[0].error.type == "ValueError"


async def test_list_and_count_follow_visibility(store_url: Callable[[], str]) -> None:
    async with aion.open_engine(store_url(), workflows=WORKFLOWS, activities=ACTIVITIES) as engine:
        for i in range(3):
            run = await engine.start(
                returns_input, i, workflow_id=f"r{i}", search_attributes={"customer": f"c{i % 2}", "n": i}
            )
            await run.result()
            await _row_when(engine, f"r{i}", aion.WorkflowStatus.COMPLETED)
        assert await engine.count() == 3
        assert await engine.count(status=aion.WorkflowStatus.COMPLETED) == 3
        assert await engine.count(status=aion.WorkflowStatus.RUNNING) == 0
        rows = await engine.list(
            search=[aion.SearchPredicate(key="customer", op=aion.SearchOp.EQUALS, value="c0")]
        )
        assert sorted(r.workflow_id for r in rows) == ["r0", "r2"]
        rows = await engine.list(search=[aion.SearchPredicate(key="n", op=aion.SearchOp.GREATER, value=0)])
        assert sorted(r.workflow_id for r in rows) == ["r1", "r2"]


async def test_bad_input_is_refused_before_anything_is_recorded(store_url: Callable[[], str]) -> None:
    async with aion.open_engine(store_url(), workflows=WORKFLOWS, activities=ACTIVITIES) as engine:
        with pytest.raises(aion.UnknownWorkflowType, match="not registered") as info:
            await engine.start("no_such_workflow", workflow_id="x1")
        assert "pipeline" in str(info.value)
        with pytest.raises(aion.PayloadNotSerializable, match=r"\[0\]"):
            await engine.start(returns_input, object(), workflow_id="x2")
        with pytest.raises(aion.PayloadTooLarge):
            await engine.start(returns_input, "x" * (3 * 1024 * 1024), workflow_id="x3")
        with pytest.raises(ValueError, match="search attribute"):
            await engine.start(returns_input, 1, workflow_id="x4", search_attributes={"bad key": 1})
        with pytest.raises(ValueError, match="workflow_id"):
            await engine.start(returns_input, 1, workflow_id="")
        for wid in ("x1", "x2", "x3", "x4"):
            with pytest.raises(aion.WorkflowNotFound):
                await engine.history(wid)
        assert await engine.count() == 0
        with pytest.raises(aion.WorkflowNotFound):
            await engine.result("never-started")
        with pytest.raises(aion.WorkflowNotFound):
            await engine.describe("never-started")


@aion.workflow
async def calls_unknown_activity(ctx: aion.WorkflowContext) -> None:
    await ctx.run("no_such_activity")


async def test_an_unknown_activity_fails_the_run_with_a_typed_error_and_records_no_schedule(
    store_url: Callable[[], str],
) -> None:
    async with aion.open_engine(
        store_url(), workflows=[calls_unknown_activity], activities=ACTIVITIES
    ) as engine:
        run = await engine.start(calls_unknown_activity, workflow_id="u")
        with pytest.raises(aion.WorkflowFailure) as info:
            await run.result()
        assert info.value.error.type == "UnknownActivityType"
        assert "no_such_activity" in info.value.error.message
        assert not any(isinstance(e.body, aion.ActivityScheduled) for e in await engine.history("u"))


@pytest.mark.parametrize(
    ("policy", "after_completion"),
    [
        (aion.IdReusePolicy.ALLOW_DUPLICATE, "new_run"),
        (aion.IdReusePolicy.ALLOW_IF_FAILED, "refused"),
        (aion.IdReusePolicy.REJECT_DUPLICATE, "refused"),
        (aion.IdReusePolicy.USE_EXISTING, "existing"),
    ],
)
async def test_id_reuse_policies(
    store_url: Callable[[], str], policy: aion.IdReusePolicy, after_completion: str
) -> None:
    async with aion.open_engine(store_url(), workflows=WORKFLOWS, activities=ACTIVITIES) as engine:
        first = await engine.start(returns_input, 1, workflow_id="same")
        assert await first.result() == 1
        if after_completion == "refused":
            with pytest.raises(aion.WorkflowAlreadyStarted, match=policy.value):
                await engine.start(returns_input, 2, workflow_id="same", id_reuse=policy)
            assert len(projections.run_ids(await engine.history("same"))) == 1
        elif after_completion == "existing":
            again = await engine.start(returns_input, 2, workflow_id="same", id_reuse=policy)
            assert again.run_id == first.run_id
            assert await again.result() == 1
        else:
            second = await engine.start(returns_input, 2, workflow_id="same", id_reuse=policy)
            assert second.run_id != first.run_id
            assert await second.result() == 2
            assert projections.run_ids(await engine.history("same")) == [first.run_id, second.run_id]


@pytest.mark.parametrize(
    ("policy", "after_completion"),
    [
        (aion.IdReusePolicy.ALLOW_DUPLICATE, "new_run"),
        (aion.IdReusePolicy.ALLOW_IF_FAILED, "refused"),
        (aion.IdReusePolicy.REJECT_DUPLICATE, "refused"),
        (aion.IdReusePolicy.USE_EXISTING, "existing"),
    ],
)
async def test_id_reuse_policies_hold_for_an_id_this_engine_never_loaded(
    store_url: Callable[[], str], policy: aion.IdReusePolicy, after_completion: str
) -> None:
    # A start appends at expected seq 0 without reading first; an id with
    # stored history (here: made by an earlier engine) must still get its policy.
    url = store_url()
    async with aion.open_engine(url, workflows=WORKFLOWS, activities=ACTIVITIES) as engine:
        first = await engine.start(returns_input, 1, workflow_id="same")
        assert await first.result() == 1
    async with aion.open_engine(url, workflows=WORKFLOWS, activities=ACTIVITIES) as engine:
        if after_completion == "refused":
            with pytest.raises(aion.WorkflowAlreadyStarted, match=policy.value):
                await engine.start(returns_input, 2, workflow_id="same", id_reuse=policy)
            assert projections.run_ids(await engine.history("same")) == [first.run_id]
        elif after_completion == "existing":
            again = await engine.start(returns_input, 2, workflow_id="same", id_reuse=policy)
            assert again.run_id == first.run_id
            assert await again.result() == 1
            assert projections.run_ids(await engine.history("same")) == [first.run_id]
        else:
            second = await engine.start(returns_input, 2, workflow_id="same", id_reuse=policy)
            assert second.run_id != first.run_id
            assert await second.result() == 2
            assert projections.run_ids(await engine.history("same")) == [first.run_id, second.run_id]
        # The engine's own view of the id is its whole stored history.
        assert (await engine.describe("same")).history_length == len(await engine.history("same"))


async def test_a_new_id_start_whose_commit_landed_unacknowledged_is_not_started_twice_and_runs_once(
    store_url: Callable[[], str],
) -> None:
    async with aion.open_store(store_url()) as inner:
        flaky = FlakyStoreBundle(inner)
        async with aion.open_engine(flaky, workflows=WORKFLOWS, activities=ACTIVITIES) as engine:
            flaky.events.commit_then_fail_next_appends(1)
            with pytest.raises(aion.BackendUnavailable):
                await engine.start(returns_input, 1, workflow_id="lost-ack")
            assert flaky.events.faults["append"] == 1, "control: the start's commit landed unacknowledged"
            # The landed run is the workflow's one run (running, or already run by this engine,
            # which looks at what landed once the store answers): a second start is refused.
            with pytest.raises(aion.WorkflowAlreadyStarted):
                await engine.start(
                    returns_input, 2, workflow_id="lost-ack", id_reuse=aion.IdReusePolicy.REJECT_DUPLICATE
                )
            with trio.fail_after(30):
                assert await engine.result("lost-ack") == 1
            history = await inner.events.read_history("lost-ack")
            assert [e.type for e in history] == ["WorkflowStarted", "WorkflowCompleted"]


class _FirstAppendHeld:
    """A store whose first append waits for ``release`` (a slow commit), so a test can act
    while a start on a new id is in flight."""

    def __init__(self, inner: aion.Store) -> None:
        self._inner = inner
        self.waiting = trio.Event()
        self.release = trio.Event()

    @property
    def events(self) -> Any:
        return self

    @property
    def visibility(self) -> aion.VisibilityStore:
        return self._inner.visibility

    async def append(self, workflow_id: str, events: Any, expected_seq: int) -> None:
        if not self.waiting.is_set():
            self.waiting.set()
            await self.release.wait()
        await self._inner.events.append(workflow_id, events, expected_seq)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner.events, name)

    async def aclose(self) -> None:
        pass


async def test_callers_wait_for_a_start_in_flight_on_a_new_id(store_url: Callable[[], str]) -> None:
    async with aion.open_store(store_url()) as inner:
        held = _FirstAppendHeld(inner)
        async with aion.open_engine(held, workflows=WORKFLOWS, activities=ACTIVITIES) as engine:
            outcomes: dict[str, Any] = {}

            async def start(name: str, value: int) -> None:
                try:
                    outcomes[name] = await engine.start(
                        returns_input,
                        value,
                        workflow_id="twice",
                        id_reuse=aion.IdReusePolicy.REJECT_DUPLICATE,
                    )
                except aion.WorkflowAlreadyStarted as exc:
                    outcomes[name] = exc

            async def result() -> None:
                outcomes["result"] = await engine.result("twice")

            async with trio.open_nursery() as nursery:
                nursery.start_soon(start, "first", 1)
                await held.waiting.wait()  # the first start's append is in flight
                nursery.start_soon(start, "second", 2)
                nursery.start_soon(result)
                await trio.testing.wait_all_tasks_blocked()
                assert set(outcomes) == set(), "control: both wait for the start in flight"
                held.release.set()
            assert isinstance(outcomes["first"], aion.RunHandle)
            assert isinstance(outcomes["second"], aion.WorkflowAlreadyStarted)
            assert outcomes["result"] == 1
            assert projections.run_ids(await engine.history("twice")) == [outcomes["first"].run_id]


class _VisibilityHeld:
    """A store whose visibility upserts wait for ``release`` (a slow index write)."""

    def __init__(self, inner: aion.Store) -> None:
        self._inner = inner
        self.release = trio.Event()
        self.upserts = 0

    @property
    def events(self) -> aion.EventStore:
        return self._inner.events

    @property
    def visibility(self) -> Any:
        return self

    async def upsert(self, row: aion.VisibilityRow) -> None:
        await self.release.wait()
        await self._inner.visibility.upsert(row)
        self.upserts += 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner.visibility, name)

    async def aclose(self) -> None:
        pass


async def test_start_does_not_wait_for_the_visibility_row_but_list_and_count_do(
    store_url: Callable[[], str],
) -> None:
    async with aion.open_store(store_url()) as inner:
        held = _VisibilityHeld(inner)
        async with aion.open_engine(held, workflows=[waits_forever], activities=[block_forever]) as engine:
            # start returns while the row's write is still held.
            with trio.fail_after(5):
                await engine.start(waits_forever, workflow_id="listed")
            assert held.upserts == 0
            assert await inner.visibility.get("listed") is None, "control: the row is not written yet"
            listed: list[aion.VisibilityRow] = []
            counted: list[int] = []

            async def query() -> None:
                listed.extend(await engine.list())
                counted.append(await engine.count(status=aion.WorkflowStatus.RUNNING))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(query)
                await trio.testing.wait_all_tasks_blocked()
                assert listed == [], "list waits for the row this engine owes"
                held.release.set()
            assert [row.workflow_id for row in listed] == ["listed"]
            assert listed[0].status is aion.WorkflowStatus.RUNNING
            assert counted == [1]


async def test_a_start_row_is_written_even_if_the_engine_closes_at_once(store_url: Callable[[], str]) -> None:
    url = store_url()
    async with aion.open_engine(url, workflows=[waits_forever], activities=[block_forever]) as engine:
        await engine.start(waits_forever, workflow_id="closing")
    async with aion.open_store(url) as store:
        row = await store.visibility.get("closing")
    assert row is not None
    assert row.status is aion.WorkflowStatus.RUNNING


@aion.workflow
async def waits_forever(ctx: aion.WorkflowContext) -> None:
    await ctx.run(block_forever)


@aion.activity
async def block_forever() -> None:
    await trio.sleep_forever()


async def test_a_running_workflow_id_is_refused_by_default(store_url: Callable[[], str]) -> None:
    async with aion.open_engine(store_url(), workflows=[waits_forever], activities=[block_forever]) as engine:
        await engine.start(waits_forever, workflow_id="busy")
        for policy in (aion.IdReusePolicy.ALLOW_DUPLICATE, aion.IdReusePolicy.ALLOW_IF_FAILED):
            with pytest.raises(aion.WorkflowAlreadyStarted, match="running"):
                await engine.start(waits_forever, workflow_id="busy", id_reuse=policy)
        description = await engine.describe("busy")
        assert description.status is aion.WorkflowStatus.RUNNING
        assert [p.activity_type for p in description.pending_activities] == ["block_forever"]


@aion.workflow
async def doubles(ctx: aion.WorkflowContext, steps: int) -> int:
    value = 1
    for _ in range(steps):
        value = await ctx.run(double, value)
    return value


class _TaskSteps(trio.abc.Instrument):
    """Counts the scheduler steps of the tasks named in ``names``."""

    def __init__(self, *names: str) -> None:
        self.names = names
        self.steps = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task.name in self.names:
            self.steps += 1


async def test_a_result_waiter_is_not_woken_by_activity_records(store_url: Callable[[], str]) -> None:
    async with aion.open_engine(store_url(), workflows=[doubles], activities=[double]) as engine:
        counter = _TaskSteps("result-waiter")
        outcome: list[int] = []

        async def wait() -> None:
            outcome.append(await engine.result("long"))

        run = await engine.start(doubles, 20, workflow_id="long")
        trio.lowlevel.add_instrument(counter)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(wait, name="result-waiter")
        finally:
            trio.lowlevel.remove_instrument(counter)
        assert outcome == [2**20]
        history = await engine.history(run.workflow_id)
        assert len(history) == 1 + 20 * 3 + 1, "control: every activity was recorded while it waited"
        # A few steps to start, park and return -- not one or more per activity record.
        assert counter.steps <= 6, counter.steps


# --------------------------------------------------------------------------
# Activities: threads, asyncio, concurrency inside a workflow
# --------------------------------------------------------------------------

GATE = threading.Event()


@aion.activity
def blocks_a_thread_until_released() -> str:
    if not GATE.wait(timeout=30):
        raise TimeoutError("never released")
    return "released"


@aion.workflow
async def uses_blocking_activity(ctx: aion.WorkflowContext) -> str:
    return str(await ctx.run(blocks_a_thread_until_released))


async def test_a_blocking_sync_activity_does_not_stall_other_workflows() -> None:
    GATE.clear()
    async with aion.open_engine(
        "memory://",
        workflows=[uses_blocking_activity, pipeline],
        activities=[blocks_a_thread_until_released, *ACTIVITIES],
    ) as engine:
        blocked = await engine.start(uses_blocking_activity, workflow_id="blocked")
        # While the thread is blocked, another workflow runs to completion.
        other = await engine.start(pipeline, 1, workflow_id="other")
        assert await other.result() == {"a": 2, "both": [4, 3]}
        # Control: the blocked one really was still blocked.
        assert (await engine.describe("blocked")).status is aion.WorkflowStatus.RUNNING
        GATE.set()
        assert await blocked.result() == "released"


@aion.activity(loop="asyncio")
async def asyncio_echo_over_loopback(text: str) -> str:
    """Uses real asyncio APIs: asyncio.sleep and an asyncio stream server on loopback."""
    await asyncio.sleep(0.01)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        data = await reader.readline()
        writer.write(data.upper())
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(text.encode() + b"\n")
        await writer.drain()
        reply = await reader.readline()
        writer.close()
        return reply.decode().strip()
    finally:
        server.close()
        await server.wait_closed()


@aion.workflow
async def uses_asyncio(ctx: aion.WorkflowContext, text: str) -> str:
    return str(await ctx.run(asyncio_echo_over_loopback, text))


async def test_an_asyncio_activity_runs_through_trio_asyncio() -> None:
    async with aion.open_engine(
        "memory://", workflows=[uses_asyncio], activities=[asyncio_echo_over_loopback]
    ) as engine:
        run = await engine.start(uses_asyncio, "hello", workflow_id="aio")
        assert await run.result() == "HELLO"


@aion.activity
async def sleep_then_return(delay: float, value: str) -> str:
    await trio.sleep(delay)
    return value


@aion.workflow
async def races(ctx: aion.WorkflowContext) -> dict[str, Any]:
    slow = ctx.start(sleep_then_return, 10.0, "slow")
    fast = ctx.start(sleep_then_return, 1.0, "fast")
    first = await ctx.wait_first(slow, fast)
    winner = await first
    rest = await ctx.gather(slow, fast)
    return {"winner": winner, "rest": rest}


async def test_wait_first_takes_the_resolution_recorded_first(autojump_clock: trio.testing.MockClock) -> None:
    async with aion.open_engine("memory://", workflows=[races], activities=[sleep_then_return]) as engine:
        run = await engine.start(races, workflow_id="race")
        assert await run.result() == {"winner": "fast", "rest": ["slow", "fast"]}


@aion.workflow
async def spawns_a_task_that_issues_commands(ctx: aion.WorkflowContext) -> str:
    errors: list[BaseException] = []

    async def rogue() -> None:
        try:
            ctx.start(double, 1)
        except aion.WorkflowCommandError as exc:
            errors.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(rogue)
    return str(errors[0]) if errors else "no error"


async def test_commands_from_another_task_are_refused_with_a_pointer_to_handles() -> None:
    async with aion.open_engine(
        "memory://", workflows=[spawns_a_task_that_issues_commands], activities=ACTIVITIES
    ) as engine:
        run = await engine.start(spawns_a_task_that_issues_commands, workflow_id="rogue")
        message = await run.result()
        assert "not workflow 'rogue'" in message
        assert "ctx.gather" in message
        assert not any(isinstance(e.body, aion.ActivityScheduled) for e in await engine.history("rogue"))


# --------------------------------------------------------------------------
# Structured shutdown
# --------------------------------------------------------------------------


def _all_tasks() -> set[trio.lowlevel.Task]:
    root = trio.lowlevel.current_root_task()
    assert root is not None
    found: set[trio.lowlevel.Task] = set()
    stack = [root]
    while stack:
        task = stack.pop()
        found.add(task)
        for nursery in task.child_nurseries:
            stack.extend(nursery.child_tasks)
    return found


async def test_leaving_open_engine_leaves_no_task_running() -> None:
    before = _all_tasks()
    async with aion.open_engine(
        "memory://", workflows=[waits_forever, pipeline], activities=[block_forever, *ACTIVITIES]
    ) as engine:
        for i in range(5):
            await engine.start(waits_forever, workflow_id=f"w{i}")
        await trio.testing.wait_all_tasks_blocked()
        during = _all_tasks() - before
        # Control: the engine really has background tasks (5 runs + 5 activities).
        assert len([t for t in during if t.name.startswith(("workflow:", "activity:"))]) >= 10
    after = _all_tasks()
    assert after - before == set(), f"tasks outlived the engine: {[t.name for t in after - before]}"


async def test_an_error_in_the_body_propagates_unwrapped_and_closes_the_epoch() -> None:
    engines: list[aion.Engine] = []

    async def body() -> None:
        async with aion.open_engine(
            "memory://", workflows=[waits_forever], activities=[block_forever]
        ) as engine:
            engines.append(engine)
            await engine.start(waits_forever, workflow_id="w")
            raise KeyError("from the body")

    with pytest.raises(KeyError, match="from the body"):
        await body()
    (engine,) = engines
    assert not engine.epoch.is_open
    with pytest.raises(aion.EngineEpochClosed):
        await engine.start(waits_forever, workflow_id="late")
