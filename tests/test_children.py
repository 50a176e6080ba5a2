"""Child workflows (issue 5 item 7).

Every finished history that can be replayed is replayed in a fresh engine that
refuses appends (tests/_replay.py).  A run ended from outside (terminate,
deadline) stops where it was, so its own code cannot be replayed to an end; for
those the children's histories are replayed.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from _replay import assert_replays_cleanly

import aion_trio as aion
from aion_trio import events as ev
from aion_trio._childspec import derive_child_run_id
from aion_trio.plugin import EventStore

LIMIT = 40 * 86400
IDS: list[str] = []
REACHED: list[str] = []


@pytest.fixture(autouse=True)
def _reset() -> None:
    IDS.clear()
    REACHED.clear()


@aion.activity
async def double(x: int) -> int:
    return 2 * x


@aion.workflow
async def child_ok(ctx: aion.WorkflowContext, x: int) -> dict[str, int]:
    return {"doubled": await ctx.run(double, x)}


@aion.workflow
async def child_fails(ctx: aion.WorkflowContext, message: str) -> None:
    raise ValueError(message)


@aion.workflow
async def child_waits(ctx: aion.WorkflowContext, name: str) -> str:
    try:
        payload = await ctx.wait_signal("go")
    except aion.WorkflowCancelled:
        REACHED.append(f"{ctx.workflow_id} saw the cancellation")
        raise
    return f"{name}:{payload}"


@aion.workflow
async def child_counts(ctx: aion.WorkflowContext, n: int) -> int:
    if n < 2:
        raise ctx.continue_as_new(n + 1)
    return n


@aion.workflow
async def parent_result(ctx: aion.WorkflowContext, x: int) -> list[Any]:
    handle = ctx.start_child(child_ok, x)
    IDS.append(handle.workflow_id)
    named = await ctx.child(child_ok, x + 1, workflow_id=f"{ctx.workflow_id}-named")
    return [await handle, named]


@aion.workflow
async def parent_one(ctx: aion.WorkflowContext, x: int) -> Any:
    return await ctx.child(child_ok, x)


@aion.workflow
async def parent_waits_for_child(ctx: aion.WorkflowContext) -> str:
    return str(await ctx.child(child_waits, "c", workflow_id=f"{ctx.workflow_id}-child"))


@aion.workflow
async def parent_waits_for_abandoned_child(ctx: aion.WorkflowContext) -> str:
    handle = ctx.start_child(
        child_waits,
        "a",
        workflow_id=f"{ctx.workflow_id}-child",
        parent_close_policy=aion.ParentClosePolicy.ABANDON,
    )
    return str(await handle)


@aion.workflow
async def parent_failure(ctx: aion.WorkflowContext) -> dict[str, Any]:
    try:
        await ctx.child(child_fails, "boom")
    except aion.ChildWorkflowFailure as failure:
        return {"status": failure.status, "type": failure.error.type, "message": failure.error.message}
    return {}


@aion.workflow
async def parent_timeout(ctx: aion.WorkflowContext) -> str:
    handle = ctx.start_child(child_waits, "slow", workflow_id=f"{ctx.workflow_id}-child")
    try:
        async with ctx.timeout(60):
            await handle
    except aion.Timeout:
        return "gave up"
    return "child finished first"


@aion.workflow
async def parent_late_child(ctx: aion.WorkflowContext) -> str:
    handle = ctx.start_child(child_waits, "late", workflow_id=f"{ctx.workflow_id}-child")
    try:
        async with ctx.timeout(60):
            value = await handle
        REACHED.append("in time")
    except aion.Timeout:
        REACHED.append("timed out")
        value = await handle  # outside the scope: waits for the child
    return str(value)


@aion.workflow
async def parent_policy(ctx: aion.WorkflowContext, policy: str) -> str:
    ctx.start_child(
        child_waits,
        "c",
        workflow_id=f"{ctx.workflow_id}-child",
        parent_close_policy=aion.ParentClosePolicy(policy),
    )
    return str(await ctx.wait_signal("never"))


@aion.workflow
async def parent_of_chain(ctx: aion.WorkflowContext) -> Any:
    return await ctx.child(child_counts, 0)


@aion.workflow
async def parent_of_slow_child(ctx: aion.WorkflowContext) -> dict[str, Any]:
    try:
        await ctx.child(child_waits, "late", timeout=30)
    except aion.ChildWorkflowFailure as failure:
        return {"status": failure.status, "type": failure.error.type}
    return {}


@aion.workflow
async def parent_bad_input(ctx: aion.WorkflowContext) -> list[str]:
    seen = []
    try:
        ctx.start_child("no_such_workflow", 1)
    except aion.UnknownWorkflowType as exc:
        seen.append(f"unknown {exc.name}")
    try:
        ctx.start_child(child_ok, object())
    except aion.PayloadNotSerializable:
        seen.append("unserialisable")
    try:
        ctx.start_child(child_ok, 1, workflow_id=ctx.workflow_id)
    except ValueError:
        seen.append("own id")
    seen.append(str(await ctx.child(child_ok, 1)))
    return seen


@aion.workflow
async def parent_id_taken(ctx: aion.WorkflowContext) -> dict[str, Any]:
    try:
        await ctx.child(child_waits, "x", workflow_id="taken")
    except aion.ChildWorkflowFailure as failure:
        return {"status": failure.status, "type": failure.error.type}
    return {}


WORKFLOWS = [
    child_ok,
    child_fails,
    child_waits,
    child_counts,
    parent_result,
    parent_one,
    parent_waits_for_child,
    parent_waits_for_abandoned_child,
    parent_failure,
    parent_timeout,
    parent_late_child,
    parent_policy,
    parent_of_chain,
    parent_of_slow_child,
    parent_bad_input,
    parent_id_taken,
]
ACTIVITIES = [double]


def url() -> str:
    return f"memory://children-{uuid.uuid4().hex}"


def types(history: list[aion.Event]) -> list[str]:
    return [type(e.body).__name__ for e in history]


def bodies(history: list[aion.Event], kind: type[Any]) -> list[Any]:
    return [e.body for e in history if isinstance(e.body, kind)]


async def replay(history: list[aion.Event]) -> None:
    await assert_replays_cleanly(history, workflows=WORKFLOWS, activities=ACTIVITIES)


# -- results and failures -------------------------------------------------------------


async def test_a_child_result_is_recorded_in_the_parent_and_both_histories_replay(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(LIMIT):
        async with aion.open_engine(url(), workflows=WORKFLOWS, activities=ACTIVITIES) as engine:
            run = await engine.start(parent_result, 20, workflow_id="p")
            assert await run.result() == [{"doubled": 40}, {"doubled": 42}]
            parent = await engine.history("p")
            derived = await engine.history(IDS[0])
            named = await engine.history("p-named")
        # One batch per command: the child's start and its options marker, then the outcome.
        assert types(parent)[1:3] == ["ChildWorkflowStarted", "MarkerRecorded"]
        assert [b.child_workflow_id for b in bodies(parent, ev.ChildWorkflowCompleted)] == [IDS[0], "p-named"]
        for child, ordinal in ((derived, 0), (named, 1)):
            start = child[0].body
            assert isinstance(start, ev.WorkflowStarted)
            assert start.parent_workflow_id == "p"
            assert start.run_id == derive_child_run_id("p", run.run_id, ordinal)
            assert types(child)[-1] == "WorkflowCompleted"
        await replay(parent)
        await replay(derived)
        await replay(named)


async def test_child_ids_are_derived_from_the_parent_run_and_ordinal_and_replay_identically(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(LIMIT):
        async with aion.open_engine(url(), workflows=WORKFLOWS, activities=ACTIVITIES) as engine:
            first = await engine.start(parent_result, 1, workflow_id="ids")
            await first.result()
            history = await engine.history("ids")
            # A second run of the same parent id derives other child ids.
            second = await engine.start(parent_result, 1, workflow_id="ids")
            await second.result()
        assert IDS[0] == f"ids/{first.run_id}/0"
        assert IDS[1] == f"ids/{second.run_id}/0"
        recorded = bodies(history, ev.ChildWorkflowStarted)
        assert [b.child_workflow_id for b in recorded] == [IDS[0], "ids-named"]
        IDS.clear()
        await replay(history)
        assert [f"ids/{first.run_id}/0"] == IDS, "replay derived the same id"


async def test_a_failed_child_raises_a_typed_failure_in_the_parent(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(LIMIT):
        async with aion.open_engine(url(), workflows=WORKFLOWS, activities=ACTIVITIES) as engine:
            run = await engine.start(parent_failure, workflow_id="pf")
            assert await run.result() == {"status": "failed", "type": "ValueError", "message": "boom"}
            parent = await engine.history("pf")
            child_id = bodies(parent, ev.ChildWorkflowStarted)[0].child_workflow_id
            child = await engine.history(child_id)
        failed = bodies(parent, ev.ChildWorkflowFailed)
        assert len(failed) == 1
        assert failed[0].error.message == "boom"
        await replay(parent)
        await replay(child)


async def test_a_child_that_continues_as_new_is_followed_to_its_final_run(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(LIMIT):
        async with aion.open_engine(url(), workflows=WORKFLOWS, activities=ACTIVITIES) as engine:
            run = await engine.start(parent_of_chain, workflow_id="chain")
            assert await run.result() == 2
            parent = await engine.history("chain")
            child = await engine.history(bodies(parent, ev.ChildWorkflowStarted)[0].child_workflow_id)
        assert types(child).count("WorkflowContinuedAsNew") == 2
        assert len(bodies(parent, ev.ChildWorkflowCompleted)) == 1
        await replay(parent)
        await replay(child)


async def test_a_child_deadline_fails_the_child_as_timed_out(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(LIMIT):
        async with aion.open_engine(url(), workflows=WORKFLOWS, activities=ACTIVITIES) as engine:
            run = await engine.start(parent_of_slow_child, workflow_id="slow")
            assert await run.result() == {"status": "timed_out", "type": "WorkflowTimedOut"}
            parent = await engine.history("slow")
            child = await engine.history(bodies(parent, ev.ChildWorkflowStarted)[0].child_workflow_id)
        start = child[0].body
        assert isinstance(start, ev.WorkflowStarted)
        assert start.timeout is not None
        assert start.timeout.total_seconds() == 30
        assert "WorkflowTimedOut" in types(child)
        await replay(parent)


async def test_an_unknown_type_or_bad_input_is_refused_at_start_child_before_anything_is_recorded(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(LIMIT):
        async with aion.open_engine(url(), workflows=WORKFLOWS, activities=ACTIVITIES) as engine:
            run = await engine.start(parent_bad_input, workflow_id="bad")
            assert await run.result() == [
                "unknown no_such_workflow",
                "unserialisable",
                "own id",
                "{'doubled': 2}",
            ]
            parent = await engine.history("bad")
        # Only the good child was recorded.
        assert [b.workflow_type for b in bodies(parent, ev.ChildWorkflowStarted)] == ["child_ok"]
        await replay(parent)


async def test_a_child_id_held_by_a_running_workflow_fails_the_child_as_not_started(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(LIMIT):
        async with aion.open_engine(url(), workflows=WORKFLOWS, activities=ACTIVITIES) as engine:
            await engine.start(child_waits, "other", workflow_id="taken")
            before = await engine.history("taken")
            run = await engine.start(parent_id_taken, workflow_id="pt")
            assert await run.result() == {"status": "not_started", "type": "WorkflowAlreadyStarted"}
            assert await engine.history("taken") == before, "nothing was written to the other workflow"
            parent = await engine.history("pt")
        await replay(parent)


# -- timeout scopes -----------------------------------------------------------------


async def test_awaiting_a_child_inside_a_timeout_scope_raises_timeout_decided_from_history(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(LIMIT):
        async with aion.open_engine(url(), workflows=WORKFLOWS, activities=ACTIVITIES) as engine:
            run = await engine.start(parent_timeout, workflow_id="pto")
            assert await run.result() == "gave up"
            with pytest.raises(aion.WorkflowFailure, match="cancelled"):
                await engine.result("pto-child")
            parent = await engine.history("pto")
            child = await engine.history("pto-child")
        fired = [e for e in parent if isinstance(e.body, ev.TimerFired)]
        assert [e.body.timer_id for e in fired] == ["scope:0"]
        assert not bodies(parent, ev.ChildWorkflowCompleted)
        # The parent ended; the default policy cancelled the child it left running.
        assert REACHED == ["pto-child saw the cancellation"]
        await replay(parent)
        await replay(child)


async def test_a_child_outcome_recorded_after_the_scope_expired_replays_as_the_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(LIMIT):
        async with aion.open_engine(url(), workflows=WORKFLOWS, activities=ACTIVITIES) as engine:
            run = await engine.start(parent_late_child, workflow_id="late")
            await trio.sleep(120)
            await engine.signal("late-child", "go", "eventually")
            assert await run.result() == "late:eventually"
            parent = await engine.history("late")
        names = types(parent)
        assert names.index("TimerFired") < names.index("ChildWorkflowCompleted")
        assert REACHED == ["timed out"]
        # On replay both are in the snapshot: the one recorded first (the expiry) wins again.
        REACHED.clear()
        await replay(parent)
        assert REACHED == ["timed out"]


# -- parent-close policy --------------------------------------------------------------


@pytest.mark.parametrize("ending", ["terminate", "cancel"])
@pytest.mark.parametrize("policy", ["cancel", "terminate", "abandon"])
async def test_the_parent_close_policy_applies_when_the_parent_ends(
    policy: str, ending: str, autojump_clock: trio.testing.MockClock
) -> None:
    with trio.fail_after(LIMIT):
        async with aion.open_engine(url(), workflows=WORKFLOWS, activities=ACTIVITIES) as engine:
            await engine.start(parent_policy, policy, workflow_id="pp")
            await trio.testing.wait_all_tasks_blocked()
            assert (await engine.describe("pp-child")).status is aion.WorkflowStatus.RUNNING
            if ending == "terminate":
                await engine.terminate("pp", "operator")
            else:
                await engine.cancel("pp", "customer")
            with pytest.raises(aion.WorkflowFailure, match="cancelled"):
                await engine.result("pp")
            await trio.testing.wait_all_tasks_blocked()
            if policy == "abandon":
                assert (await engine.describe("pp-child")).status is aion.WorkflowStatus.RUNNING
                await engine.signal("pp-child", "go", "on its own")
                assert await engine.result("pp-child") == "c:on its own"
            else:
                with pytest.raises(aion.WorkflowFailure, match="cancelled") as info:
                    await engine.result("pp-child")
                assert "parent workflow 'pp' closed" in info.value.reason
            parent = await engine.history("pp")
            child = await engine.history("pp-child")
        terminal = [b for b in bodies(child, ev.WorkflowCancelled)]
        if policy == "cancel":
            assert REACHED == ["pp-child saw the cancellation"]
            assert len(terminal) == 1
            assert not terminal[0].terminated
            assert len(bodies(child, ev.WorkflowCancelRequested)) == 1
        elif policy == "terminate":
            assert REACHED == [], "a terminated child's code does not run on"
            assert len(terminal) == 1
            assert terminal[0].terminated
        else:
            assert REACHED == []
            assert terminal == []
            assert types(child)[-1] == "WorkflowCompleted"
        # The parent had ended: the child's outcome stood down, nothing was added to it.
        assert not any(
            isinstance(e.body, (ev.ChildWorkflowCompleted, ev.ChildWorkflowCancelled)) for e in parent
        )
        if ending == "cancel":
            await replay(parent)
        if policy != "terminate":
            await replay(child)


async def test_a_parent_deadline_applies_the_parent_close_policy(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(LIMIT):
        async with aion.open_engine(url(), workflows=WORKFLOWS, activities=ACTIVITIES) as engine:
            await engine.start(parent_policy, "terminate", workflow_id="pd", timeout=120)
            with pytest.raises(aion.WorkflowFailure, match="timed_out"):
                await engine.result("pd")
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(aion.WorkflowFailure, match="cancelled"):
                await engine.result("pd-child")
            child = await engine.history("pd-child")
        terminal = bodies(child, ev.WorkflowCancelled)
        assert len(terminal) == 1
        assert terminal[0].terminated


async def test_reopening_a_parent_delivers_the_outcome_of_a_child_that_ended_while_it_was_closed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(LIMIT):
        async with aion.open_engine(url(), workflows=WORKFLOWS, activities=ACTIVITIES) as engine:
            await engine.start(parent_waits_for_abandoned_child, workflow_id="ro")
            await trio.testing.wait_all_tasks_blocked()
            await engine.terminate("ro", "by mistake")
            await engine.signal("ro-child", "go", "meanwhile")
            assert await engine.result("ro-child") == "a:meanwhile"
            await trio.testing.wait_all_tasks_blocked()
            closed = await engine.history("ro")
            assert not bodies(closed, ev.ChildWorkflowCompleted), "a closed parent records no outcome"
            handle = await engine.reopen("ro")
            assert await handle.result() == "a:meanwhile"
            parent = await engine.history("ro")
        assert types(parent)[len(closed) :] == [
            "WorkflowReopened",
            "ChildWorkflowCompleted",
            "WorkflowCompleted",
        ]
        await replay(parent)


# -- crashes and faults ---------------------------------------------------------------


class _FaultyStore:
    """Fault injection: appends matching ``refuse`` raise ``error`` (while ``budget`` lasts)."""

    def __init__(
        self, inner: aion.Store, refuse: Callable[[aion.Event], bool], error: Exception, budget: int
    ) -> None:
        self._inner = inner
        self.events = _FaultyEvents(inner.events, refuse, error, budget)

    @property
    def visibility(self) -> Any:
        return self._inner.visibility

    async def aclose(self) -> None:
        await self._inner.aclose()


class _FaultyEvents:
    def __init__(
        self, inner: EventStore, refuse: Callable[[aion.Event], bool], error: Exception, budget: int
    ) -> None:
        self._inner = inner
        self._refuse = refuse
        self._error = error
        self.budget = budget
        self.refused = 0
        #: Set at the first refusal (a thread-backed store leaves Trio idle while it works,
        #: so wait_all_tasks_blocked alone does not say the write was attempted).
        self.hit = trio.Event()

    async def append(self, workflow_id: str, events: Any, expected_seq: int) -> None:
        if self.budget > 0 and any(self._refuse(e) for e in events):
            self.budget -= 1
            self.refused += 1
            self.hit.set()
            await trio.lowlevel.checkpoint()
            raise self._error
        await self._inner.append(workflow_id, events, expected_seq)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _child_start(event: aion.Event) -> bool:
    return isinstance(event.body, ev.WorkflowStarted) and event.body.parent_workflow_id is not None


def _child_outcome(event: aion.Event) -> bool:
    return isinstance(event.body, ev.ChildWorkflowCompleted)


async def _crash_between_and_recover(name: str) -> None:
    crash = aion.NotOwner("simulated crash before the child's start")
    async with aion.open_store(name) as raw:
        faulty = _FaultyStore(raw, _child_start, crash, budget=1)
        async with aion.open_engine(faulty, workflows=WORKFLOWS, activities=ACTIVITIES) as engine:  # type: ignore[arg-type]
            run = await engine.start(parent_one, 5, workflow_id="crash")
            await faulty.events.hit.wait()
            await trio.testing.wait_all_tasks_blocked()
            half = await engine.history("crash")
            child_id = bodies(half, ev.ChildWorkflowStarted)[0].child_workflow_id
            with pytest.raises(aion.WorkflowNotFound):
                await engine.history(child_id)
        assert faulty.events.refused == 1
    async with aion.open_engine(name, workflows=WORKFLOWS, activities=ACTIVITIES) as engine:
        assert await engine.result("crash") == {"doubled": 10}
        parent = await engine.history("crash")
        child = await engine.history(child_id)
    assert parent[: len(half)] == half
    starts = bodies(child, ev.WorkflowStarted)
    assert len(starts) == 1
    assert starts[0].run_id == derive_child_run_id("crash", run.run_id, 0)
    assert len(bodies(parent, ev.ChildWorkflowStarted)) == 1
    assert len(bodies(parent, ev.ChildWorkflowCompleted)) == 1
    await replay(parent)
    await replay(child)


async def test_a_crash_between_the_parents_record_and_the_childs_start_is_repaired_by_recovery(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(LIMIT):
        await _crash_between_and_recover(url())


async def test_the_crash_between_repair_on_a_real_sqlite_file(tmp_path: Path) -> None:
    # Real time (a thread-backed store under autojump "takes" arbitrary mock time); no timers here.
    with trio.fail_after(60):
        await _crash_between_and_recover(f"sqlite:///{tmp_path}/children.db")


async def test_a_child_that_finished_while_the_engine_was_down_is_delivered_at_recovery(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(LIMIT):
        name = url()
        crash = aion.NotOwner("simulated crash after the child's terminal")
        async with aion.open_store(name) as raw:
            faulty = _FaultyStore(raw, _child_outcome, crash, budget=1)
            async with aion.open_engine(faulty, workflows=WORKFLOWS, activities=ACTIVITIES) as engine:  # type: ignore[arg-type]
                await engine.start(parent_waits_for_child, workflow_id="down")
                await trio.testing.wait_all_tasks_blocked()
                await engine.signal("down-child", "go", "late")
                assert await engine.result("down-child") == "c:late"
                await trio.testing.wait_all_tasks_blocked()
                half = await engine.history("down")
            assert faulty.events.refused == 1
        assert not bodies(half, ev.ChildWorkflowCompleted), (
            "the fault must keep the outcome out of the parent"
        )
        async with aion.open_engine(name, workflows=WORKFLOWS, activities=ACTIVITIES) as engine:
            assert await engine.result("down") == "c:late"
            parent = await engine.history("down")
            child = await engine.history("down-child")
        assert parent[: len(half)] == half
        assert len(bodies(parent, ev.ChildWorkflowCompleted)) == 1
        assert types(child).count("WorkflowStarted") == 1
        await replay(parent)
        await replay(child)


async def test_a_parent_that_ended_before_its_policy_was_applied_has_it_applied_at_recovery(
    autojump_clock: trio.testing.MockClock,
) -> None:
    def cancel_request(event: aion.Event) -> bool:
        return isinstance(event.body, ev.WorkflowCancelRequested)

    with trio.fail_after(LIMIT):
        name = url()
        crash = aion.NotOwner("simulated crash before the child was cancelled")
        async with aion.open_store(name) as raw:
            faulty = _FaultyStore(raw, cancel_request, crash, budget=1)
            async with aion.open_engine(faulty, workflows=WORKFLOWS, activities=ACTIVITIES) as engine:  # type: ignore[arg-type]
                await engine.start(parent_policy, "cancel", workflow_id="orphan")
                await trio.testing.wait_all_tasks_blocked()
                await engine.terminate("orphan")
                await trio.testing.wait_all_tasks_blocked()
                assert (await engine.describe("orphan-child")).status is aion.WorkflowStatus.RUNNING
            assert faulty.events.refused == 1
        async with aion.open_engine(name, workflows=WORKFLOWS, activities=ACTIVITIES) as engine:
            with pytest.raises(aion.WorkflowFailure, match="cancelled") as info:
                await engine.result("orphan-child")
            child = await engine.history("orphan-child")
        assert "parent workflow 'orphan' closed" in info.value.reason
        assert REACHED == ["orphan-child saw the cancellation"]
        assert len(bodies(child, ev.WorkflowCancelRequested)) == 1
        await replay(child)


async def test_a_delivery_that_fails_transiently_is_retried_in_the_epoch(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(LIMIT):
        name = url()
        async with aion.open_store(name) as raw:
            faulty = _FaultyStore(raw, _child_outcome, aion.BackendUnavailable("database is busy"), budget=3)
            async with aion.open_engine(faulty, workflows=WORKFLOWS, activities=ACTIVITIES) as engine:  # type: ignore[arg-type]
                run = await engine.start(parent_one, 4, workflow_id="flaky")
                assert await run.result() == {"doubled": 8}
                parent = await engine.history("flaky")
            assert faulty.events.refused == 3
        assert len(bodies(parent, ev.ChildWorkflowCompleted)) == 1
        await replay(parent)
