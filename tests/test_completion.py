"""Recording a run's terminal, and retrying it (docs/architecture.md, "Terminals").

Each test pins one rule of the completion path.  Where a test could pass for
the wrong reason, a *control* assertion checks the fixture first (the fault
really fired, the lease really was superseded, the index really was stale).

The fixture drives ``handle_run_exit`` directly for a lease that has no run
task, exactly what a run task does when its coroutine ends.  Time is Trio's
``MockClock`` (autojump), so retry backoffs cost no real time.

Every test of the suite that drives the completion path by hand lives here
(tests/test_suite_imports.py lists this file's reaches past the testing seams).
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from typing import Any

import attrs
import pytest
import trio
import trio.testing

import aion_trio as aion
from aion_trio import projections
from aion_trio._completion import (
    CompletionFailure,
    TerminalIntent,
    TerminalProgress,
    _Progress,
    complete_run_exit,
    handle_run_exit,
    run_exit_attempt,
)
from aion_trio._engine import EngineCore
from aion_trio._events import (
    ErrorInfo,
    TimerCancelled,
    TimerStarted,
    WorkflowCompleted,
    WorkflowContinuedAsNew,
    WorkflowStarted,
    WorkflowTimedOut,
)
from aion_trio._ids import deadline_timer_id, new_run_id
from aion_trio._registry import Lease, Residency
from aion_trio._transient import CompletionRetryConfig, FaultReporter, failure_discriminant
from aion_trio.testing import FlakyStoreBundle

# Every async test takes ``autojump_clock`` directly (pytest-trio only honours a
# clock passed as a test argument): retry backoffs then cost no real time.


@attrs.define
class Harness:
    engine: aion.Engine
    core: EngineCore
    flaky: FlakyStoreBundle

    async def truth(self, lease: Lease) -> list[aion.Event]:
        """History read past the fault injector, so the oracle cannot be faulted."""
        return await self.flaky.inner.events.read_history(lease.workflow_id)

    async def completed_count(self, lease: Lease) -> int:
        segment = projections.run_segment(await self.truth(lease), lease.run_id)
        return sum(1 for e in segment if isinstance(e.body, WorkflowCompleted))

    async def wait_for_completed(self, lease: Lease, limit: float = 3600) -> list[aion.Event]:
        with trio.fail_after(limit):
            while True:
                history = await self.truth(lease)
                if any(isinstance(e.body, WorkflowCompleted) for e in history):
                    return history
                await trio.sleep(0.001)


FAST = CompletionRetryConfig(initial=0.001, ceiling=0.005)


@contextlib.asynccontextmanager
async def harness(retry: CompletionRetryConfig = FAST) -> AsyncIterator[Harness]:
    async with aion.open_store(f"memory://completion-{uuid.uuid4().hex}") as inner:
        flaky = FlakyStoreBundle(inner)
        config = aion.EngineConfig(completion_retry=retry)
        async with aion.open_engine(flaky, config=config) as engine:
            yield Harness(engine=engine, core=engine._core, flaky=flaky)


async def active_workflow(h: Harness) -> Lease:
    """A running run with a registered lease and no run task."""
    workflow_id = f"wf-{uuid.uuid4().hex[:8]}"
    run_id = new_run_id()
    recorder = await h.core.recorder_for(workflow_id)
    async with recorder.lock:
        await recorder.append(
            [WorkflowStarted(workflow_type="checkout", input=aion.Payload.of([]), run_id=run_id)],
            action="test start",
            run_id=run_id,
        )
        return h.core.new_lease(recorder, run_id, "checkout")


async def write(lease: Lease, *bodies: Any) -> None:
    """Write events through the workflow's recorder, as another path (cancel, teardown) would."""
    async with lease.recorder.lock:
        await lease.recorder.append(list(bodies), action="test write", run_id=lease.run_id)


def completed(label: str, h: Harness) -> TerminalIntent:
    return TerminalIntent.completed(aion.Payload.of({"label": label}), h.core.clock.now())


def deadline_started(lease: Lease, h: Harness) -> TimerStarted:
    return TimerStarted(
        timer_id=deadline_timer_id(lease.run_id), fire_at=h.core.clock.now() + timedelta(hours=1)
    )


def deadline_outstanding(history: list[aion.Event], lease: Lease) -> bool:
    segment = projections.run_segment(history, lease.run_id)
    return any(t.timer_id == deadline_timer_id(lease.run_id) for t in projections.outstanding_timers(segment))


# --------------------------------------------------------------------------
# Normal and abnormal exit
# --------------------------------------------------------------------------


async def test_normal_exit_records_completed_reconciles_and_notifies(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with harness() as h:
        lease = await active_workflow(h)
        intent = completed("result", h)
        await handle_run_exit(h.core, lease, intent)
        assert lease.completion.is_set
        assert isinstance(lease.completion.terminal.body, WorkflowCompleted)  # type: ignore[union-attr]
        assert lease.completion.terminal.body.result == intent.result  # type: ignore[union-attr]
        assert h.core.registry.get(lease.workflow_id, lease.run_id) is lease
        assert lease.cached_status is aion.WorkflowStatus.COMPLETED
        assert lease.residency is Residency.SUSPENDED
        history = await h.truth(lease)
        assert [type(e.body) for e in history] == [WorkflowStarted, WorkflowCompleted]
        assert history[1].body.result == intent.result
        row = await h.flaky.inner.visibility.get(lease.workflow_id)
        assert row is not None
        assert row.status is aion.WorkflowStatus.COMPLETED


async def test_abnormal_exit_records_failed_reconciles_and_notifies(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with harness() as h:
        lease = await active_workflow(h)
        error = ErrorInfo(type="RuntimeError", message="process crashed")
        await handle_run_exit(h.core, lease, TerminalIntent.failed(error, h.core.clock.now()))
        assert isinstance(lease.completion.terminal.body, aion.WorkflowFailed)  # type: ignore[union-attr]
        assert lease.cached_status is aion.WorkflowStatus.FAILED
        assert lease.residency is Residency.SUSPENDED
        history = await h.truth(lease)
        assert [type(e.body) for e in history] == [WorkflowStarted, aion.WorkflowFailed]
        assert history[1].body.error == error


def test_the_terminal_is_scoped_to_the_requested_run_segment() -> None:
    old, new = new_run_id(), new_run_id()
    now = datetime(2026, 1, 1, tzinfo=aion.Event.__annotations__ and __import__("datetime").timezone.utc)
    bodies = [
        WorkflowStarted(workflow_type="checkout", input=aion.Payload.of(["first"]), run_id=old),
        WorkflowContinuedAsNew(input=aion.Payload.of(["next"]), parent_run_id=old),
        WorkflowStarted(
            workflow_type="checkout", input=aion.Payload.of(["next"]), run_id=new, parent_run_id=old
        ),
        WorkflowCompleted(result=aion.Payload.of("done")),
    ]
    events = [aion.Event(workflow_id="w", seq=i + 1, recorded_at=now, body=b) for i, b in enumerate(bodies)]
    old_terminal = projections.current_lease_terminal(projections.run_segment(events, old))
    new_terminal = projections.current_lease_terminal(projections.run_segment(events, new))
    assert old_terminal is not None
    assert isinstance(old_terminal.body, WorkflowContinuedAsNew)
    assert new_terminal is not None
    assert isinstance(new_terminal.body, WorkflowCompleted)


# --------------------------------------------------------------------------
# The resume path and the deadline teardown
# --------------------------------------------------------------------------


async def test_an_exit_resumes_an_interrupted_deadline_retirement(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with harness() as h:
        lease = await active_workflow(h)
        await write(lease, deadline_started(lease, h))
        await write(lease, WorkflowCompleted(result=aion.Payload.of("r")))
        assert deadline_outstanding(await h.truth(lease), lease), "control: the deadline is outstanding"
        await handle_run_exit(h.core, lease, completed("r", h))
        history = await h.truth(lease)
        assert not deadline_outstanding(history, lease)
        assert await h.completed_count(lease) == 1
        retired = [e.body for e in history if isinstance(e.body, TimerCancelled)]
        assert retired[0].cause is aion.TimerCancelCause.WORKFLOW_INTENT


async def test_a_fresh_terminal_retires_the_deadline_in_the_same_batch(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with harness() as h:
        lease = await active_workflow(h)
        await write(lease, deadline_started(lease, h))
        await handle_run_exit(h.core, lease, completed("r", h))
        history = await h.truth(lease)
        assert [type(e.body) for e in history[-2:]] == [WorkflowCompleted, TimerCancelled]
        assert history[-1].recorded_at == history[-2].recorded_at


async def test_an_exit_does_not_retire_a_timed_out_runs_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with harness() as h:
        lease = await active_workflow(h)
        await write(lease, deadline_started(lease, h))
        await write(lease, WorkflowTimedOut())
        await handle_run_exit(h.core, lease, completed("late", h))
        history = await h.truth(lease)
        assert deadline_outstanding(history, lease), "the teardown's resume anchor must stay live"
        assert await h.completed_count(lease) == 0


async def test_an_exit_leaves_a_timed_out_runs_visibility_to_its_teardown(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Control: the next test drives the same resume path with a Completed
    # terminal and shows the index IS written there.
    async with harness() as h:
        lease = await active_workflow(h)
        await write(lease, deadline_started(lease, h))
        await write(lease, WorkflowTimedOut())
        await handle_run_exit(h.core, lease, completed("late", h))
        row = await h.flaky.inner.visibility.get(lease.workflow_id)
        assert row is None or row.status is not aion.WorkflowStatus.TIMED_OUT


async def test_a_resumed_completion_appends_nothing_and_still_refreshes_visibility(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with harness() as h:
        lease = await active_workflow(h)
        # An earlier attempt appended the terminal and died before the upsert.
        await write(lease, WorkflowCompleted(result=aion.Payload.of("r")))
        row = await h.flaky.inner.visibility.get(lease.workflow_id)
        assert row is None or row.status is not aion.WorkflowStatus.COMPLETED, "control: the index is stale"
        before = await h.truth(lease)
        await handle_run_exit(h.core, lease, completed("r", h))
        assert len(await h.truth(lease)) == len(before)
        row = await h.flaky.inner.visibility.get(lease.workflow_id)
        assert row is not None
        assert row.status is aion.WorkflowStatus.COMPLETED


# --------------------------------------------------------------------------
# Stale leases, reopened runs
# --------------------------------------------------------------------------


async def test_a_stale_lease_that_never_recorded_does_not_append_into_a_reopened_run(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with harness() as h:
        stale = await active_workflow(h)
        # Another path ended the run; an operator reopened it (new lease, same critical section).
        async with stale.recorder.lock:
            await stale.recorder.append(
                [WorkflowCompleted(result=aion.Payload.of("first"))], action="t", run_id=stale.run_id
            )
            successor = await h.core.reopen_locked(stale.recorder, stale.run_id, "checkout")
        assert await h.completed_count(stale) == 1, "control: exactly one terminal before the exit"
        current = h.core.registry.get(stale.workflow_id, stale.run_id)
        assert current is successor, "control: the reopen's lease is current"
        assert current.lease_id != stale.lease_id, "control: a different lease is current"
        # No error (a double-writer report would be a false incident) and no append.
        await handle_run_exit(h.core, stale, completed("late", h))
        assert await h.completed_count(stale) == 1
        assert (
            projections.current_lease_terminal(projections.run_segment(await h.truth(stale), stale.run_id))
            is None
        )


async def test_a_reopened_run_that_finishes_again_records_its_terminal(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with harness() as h:
        first = await active_workflow(h)
        async with first.recorder.lock:
            await first.recorder.append(
                [aion.WorkflowFailed(error=ErrorInfo(type="E", message="first attempt"))],
                action="t",
                run_id=first.run_id,
            )
            current = await h.core.reopen_locked(first.recorder, first.run_id, "checkout")
        history = await h.truth(first)
        assert projections.current_lease_terminal(projections.run_segment(history, first.run_id)) is None, (
            "control: the reopen superseded the first terminal"
        )
        assert h.core.registry.get(first.workflow_id, first.run_id) is current
        await handle_run_exit(h.core, current, completed("second", h))
        terminal = projections.current_lease_terminal(
            projections.run_segment(await h.truth(first), first.run_id)
        )
        assert terminal is not None
        assert isinstance(terminal.body, WorkflowCompleted)


async def test_a_lease_that_already_recorded_stands_down_when_the_registry_has_no_entry(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with harness() as h:
        lease = await active_workflow(h)
        await write(lease, WorkflowCompleted(result=aion.Payload.of("recorded by me")))
        await write(lease, aion.WorkflowReopened(run_id=lease.run_id))
        h.core.registry.remove(lease.workflow_id, lease.run_id)
        assert await h.completed_count(lease) == 1, "control"
        assert h.core.registry.get(lease.workflow_id, lease.run_id) is None, (
            "control: with a lease present the lease disjunct would carry the test"
        )
        progress = _Progress(TerminalProgress.RECORDED)
        await run_exit_attempt(h.core, lease, completed("second", h), progress)
        assert await h.completed_count(lease) == 1


async def test_an_absent_registry_entry_alone_does_not_stand_down(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with harness() as h:
        lease = await active_workflow(h)
        h.core.registry.remove(lease.workflow_id, lease.run_id)
        await handle_run_exit(h.core, lease, completed("r", h))
        assert await h.completed_count(lease) == 1


class GatedAppends:
    """Holds the next append inside the store until released (fault injection)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.armed = False
        self.entered = trio.Event()
        self.release = trio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def append(self, workflow_id: str, events: Any, expected_seq: int) -> None:
        if self.armed:
            self.armed = False
            self.entered.set()
            await self.release.wait()
        await self.inner.append(workflow_id, events, expected_seq)


async def test_the_reopen_window_is_closed_an_exit_never_sees_a_reopen_without_its_lease(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The residual window of a stale lease: a lease that never recorded, whose run another path
    ended and an operator reopened, arriving while the reopen is in flight.  Because the
    reopen appends and installs its lease in one recorder critical section, the exit
    waits for the lock and then sees the new lease: it stands down, appends nothing and
    reports nothing."""
    async with harness() as h:
        stale = await active_workflow(h)
        await write(stale, aion.events.WorkflowCancelled(reason="operator"))
        gate = GatedAppends(stale.recorder._store)
        stale.recorder._store = gate
        gate.armed = True
        successor: list[Lease] = []
        errors: list[BaseException] = []

        async def reopen() -> None:
            async with stale.recorder.lock:
                successor.append(await h.core.reopen_locked(stale.recorder, stale.run_id, "checkout"))

        async def late_exit() -> None:
            try:
                await handle_run_exit(h.core, stale, completed("late", h))
            except Exception as exc:  # pragma: no cover - the failure mode under test
                errors.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reopen)
            await gate.entered.wait()
            # The reopen's append is in flight: the event is not yet durable, the old lease
            # is still registered, and the exit must wait for the lock.
            nursery.start_soon(late_exit)
            await trio.testing.wait_all_tasks_blocked()
            assert stale.recorder.lock.statistics().tasks_waiting == 1, (
                "control: the exit is waiting on the lock"
            )
            gate.release.set()
        assert errors == []
        assert h.core.registry.get(stale.workflow_id, stale.run_id) is successor[0]
        history = await h.truth(stale)
        assert isinstance(history[-1].body, aion.WorkflowReopened)
        assert await h.completed_count(stale) == 0


# --------------------------------------------------------------------------
# Transient failures: exactly one terminal lands
# --------------------------------------------------------------------------


async def test_a_transient_history_read_failure_still_lands_the_terminal(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with harness() as h:
        lease = await active_workflow(h)
        # The append fails with an unknown outcome, so the recorder must re-read
        # before deciding, and those reads fail too.
        h.flaky.events.fail_next_appends(1)
        h.flaky.events.fail_next_reads(3)
        await handle_run_exit(h.core, lease, completed("result", h))
        history = await h.wait_for_completed(lease)
        assert sum(1 for e in history if isinstance(e.body, WorkflowCompleted)) == 1
        assert h.flaky.events.faults["read_history"] == 3, "control: the read faults really fired"


async def test_a_transient_append_failure_still_lands_the_original_terminal_at_its_exit_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with harness() as h:
        lease = await active_workflow(h)
        h.flaky.events.fail_next_appends(3)
        intent = completed("result", h)
        await handle_run_exit(h.core, lease, intent)
        history = await h.wait_for_completed(lease)
        terminals = [e for e in history if isinstance(e.body, WorkflowCompleted)]
        assert len(terminals) == 1
        assert terminals[0].body.result == intent.result
        assert h.core.clock.now() > intent.exit_time, "control: time moved while retrying"
        assert terminals[0].recorded_at == intent.exit_time, "the terminal says when the run finished"


async def test_an_append_that_commits_then_reports_failure_lands_exactly_one_terminal(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with harness() as h:
        lease = await active_workflow(h)
        h.flaky.events.commit_then_fail_next_appends(1)
        await handle_run_exit(h.core, lease, completed("result", h))
        assert await h.completed_count(lease) == 1, "control: the first append really committed"
        assert h.core.epoch.armed_completion_retry_count() == 1
        # The retry re-reads, finds its own commit and takes the resume path.
        await trio.sleep(1)
        assert h.core.epoch.armed_completion_retry_count() == 0
        assert await h.completed_count(lease) == 1
        assert lease.recorder.rereads >= 1
        row = await h.flaky.inner.visibility.get(lease.workflow_id)
        assert row is not None
        assert row.status is aion.WorkflowStatus.COMPLETED


async def test_a_retrying_completion_returns_with_the_retry_still_armed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with harness() as h:
        lease = await active_workflow(h)
        h.flaky.events.fail_next_appends(1)
        h.flaky.events.fail_next_reads(200)
        await handle_run_exit(h.core, lease, completed("stalled", h))
        assert h.core.epoch.armed_completion_retry_count() == 1


async def test_a_retry_stops_once_its_workflow_is_relinquished(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Its recorder dropped (another node claimed the workflow), the retry gives up instead
    of retrying until the store answers only to be refused: the new owner records the terminal."""
    async with harness() as h:
        lease = await active_workflow(h)
        h.flaky.events.fail_next_appends(1)
        h.flaky.events.fail_next_reads(10_000)
        await handle_run_exit(h.core, lease, completed("r", h))
        await trio.sleep(1)
        assert h.core.epoch.armed_completion_retry_count() == 1, "control: the retry is still at it"
        h.core.recorders.relinquish(lease.recorder, aion.NotOwner(lease.workflow_id))
        await trio.sleep(1)  # the ceiling is 5 ms: one more rung, then the hook is asked
        assert h.core.epoch.armed_completion_retry_count() == 0
        assert h.flaky.events.faults["read_history"] < 10_000
        assert await h.completed_count(lease) == 0


async def test_notify_precedes_bookkeeping_so_a_failed_upsert_strands_no_waiter(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with harness() as h:
        lease = await active_workflow(h)
        h.flaky.visibility.fail_next("upsert", 1)
        await handle_run_exit(h.core, lease, completed("r", h))
        assert lease.completion.is_set
        assert h.flaky.visibility.faults["upsert"] == 1, "control: the upsert really failed"
        assert await h.engine.result(lease.workflow_id) == {"label": "r"}


async def test_a_failure_after_the_terminal_landed_reports_it_as_recorded(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with harness() as h:
        lease = await active_workflow(h)
        h.flaky.visibility.fail_next("upsert", 1)
        with pytest.raises(CompletionFailure) as info:
            await complete_run_exit(h.core, lease, completed("r", h), TerminalProgress.NOT_RECORDED)
        assert await h.completed_count(lease) == 1, "control: the terminal really is durable"
        assert info.value.progress is TerminalProgress.RECORDED
        assert info.value.retryable


# --------------------------------------------------------------------------
# Retry slots
# --------------------------------------------------------------------------


async def test_one_lease_can_never_hold_more_than_one_completion_retry(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with harness() as h:
        lease = await active_workflow(h)
        assert h.core.epoch.armed_completion_retry_count() == 0, (
            "control: nothing armed before the first exit"
        )
        h.flaky.events.fail_next_appends(1)
        h.flaky.events.fail_next_reads(500)
        for arm in range(1, 26):
            await handle_run_exit(h.core, lease, completed("r", h))
            # Let the retry task run a step between arms, so a buggy release could bite.
            await trio.testing.wait_all_tasks_blocked()
            assert h.core.epoch.armed_completion_retry_count() == 1, f"after arm {arm} of 25"


async def test_two_leases_of_one_run_can_each_hold_a_retry(autojump_clock: trio.testing.MockClock) -> None:
    async with harness() as h:
        first = await active_workflow(h)
        h.flaky.events.fail_next_appends(1)
        h.flaky.events.fail_next_reads(500)
        await handle_run_exit(h.core, first, completed("r", h))
        assert h.core.epoch.armed_completion_retry_count() == 1
        second = Lease(
            workflow_id=first.workflow_id,
            run_id=first.run_id,
            workflow_type="checkout",
            recorder=first.recorder,
        )
        h.core.registry.install(second)
        from aion_trio._completion import arm_completion_retry

        outcome = arm_completion_retry(
            h.core, second, completed("r", h), RuntimeError("x"), TerminalProgress.NOT_RECORDED
        )
        assert outcome.value == "armed"
        assert h.core.epoch.armed_completion_retry_count() == 2


async def test_a_release_from_a_foreign_task_cannot_evict_a_live_retry(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with harness() as h:
        lease = await active_workflow(h)
        h.flaky.events.fail_next_appends(1)
        h.flaky.events.fail_next_reads(500)
        await handle_run_exit(h.core, lease, completed("r", h))
        await trio.testing.wait_all_tasks_blocked()
        (key,) = h.core.epoch.armed_completion_retry_keys()
        slot = h.core.epoch._retries[key]
        assert slot.task is not None, "control: the running task claimed its slot"
        assert h.core.epoch.release_completion_retry(slot) is False
        assert h.core.epoch.armed_completion_retry_count() == 1


async def test_shutdown_cancels_and_joins_armed_retries(autojump_clock: trio.testing.MockClock) -> None:
    async with aion.open_store(f"memory://completion-{uuid.uuid4().hex}") as inner:
        flaky = FlakyStoreBundle(inner)
        async with aion.open_engine(flaky, config=aion.EngineConfig(completion_retry=FAST)) as engine:
            h = Harness(engine=engine, core=engine._core, flaky=flaky)
            lease = await active_workflow(h)
            flaky.events.fail_next_appends(1)
            flaky.events.fail_next_reads(500)
            await handle_run_exit(h.core, lease, completed("r", h))
            await trio.testing.wait_all_tasks_blocked()
            assert h.core.epoch.armed_completion_retry_count() == 1, "control: a retry is armed"
            epoch = h.core.epoch
            (key,) = epoch.armed_completion_retry_keys()
            task = epoch._retries[key].task
        # The slot is released only in the retry task's own `finally`: an empty set
        # after the block means the task ran to its end (was joined), not detached.
        assert epoch.armed_completion_retry_count() == 0
        assert task is not None
        assert task.parent_nursery is not None
        assert task not in task.parent_nursery.child_tasks
        assert await h.completed_count(lease) == 0, "the closed epoch wrote nothing"


# --------------------------------------------------------------------------
# The ladder and the loudness
# --------------------------------------------------------------------------


def test_a_ladder_that_cannot_climb_is_refused() -> None:
    with pytest.raises(ValueError, match="> 0"):
        CompletionRetryConfig(initial=0, ceiling=1)
    with pytest.raises(ValueError, match="at least"):
        CompletionRetryConfig(initial=2, ceiling=1)
    with pytest.raises(ValueError, match="finite"):
        CompletionRetryConfig(initial=float("nan"), ceiling=1)
    CompletionRetryConfig(initial=1, ceiling=1)  # a flat ladder is fine


async def test_the_configured_ladder_governs_when_a_retry_lands(
    autojump_clock: trio.testing.MockClock,
) -> None:
    configured = 500.0
    assert configured / 5 > CompletionRetryConfig().initial * 10, (
        "the window must dwarf the default first sleep"
    )
    async with harness(CompletionRetryConfig(initial=configured, ceiling=configured)) as h:
        lease = await active_workflow(h)
        h.flaky.events.fail_next_appends(1)
        start = trio.current_time()
        await handle_run_exit(h.core, lease, completed("r", h))
        assert h.core.epoch.armed_completion_retry_count() == 1, "control: a retry was armed"
        await trio.sleep(configured - 1)
        assert await h.completed_count(lease) == 0, "landed before the configured backoff"
        await h.wait_for_completed(lease)
        landed = trio.current_time() - start
        assert configured <= landed < configured + 1
        assert await h.completed_count(lease) == 1


async def test_at_the_ceiling_every_failing_attempt_states_itself(
    caplog: pytest.LogCaptureFixture, autojump_clock: trio.testing.MockClock
) -> None:
    caplog.set_level(logging.WARNING, logger="aion_trio.completion")
    failing_reads = 64
    async with harness(CompletionRetryConfig(initial=0.001, ceiling=0.001)) as h:
        lease = await active_workflow(h)
        h.flaky.events.fail_next_appends(1)
        h.flaky.events.fail_next_reads(failing_reads)
        await handle_run_exit(h.core, lease, completed("r", h))
        await h.wait_for_completed(lease)
        assert await h.completed_count(lease) == 1, "the outage was survived, not merely narrated"
    stated = [r for r in caplog.records if "retrying with backoff" in r.getMessage()]
    attempts = [r.attempts for r in stated]  # type: ignore[attr-defined]
    assert len(attempts) >= 3, f"fewer than three attempts spoke: {len(caplog.records)} records captured"
    assert attempts == list(range(1, len(attempts) + 1)), "at the ceiling the stated attempts are contiguous"
    assert len(attempts) == failing_reads, "each failing attempt spends one read, so every one must speak"
    for record in stated:
        assert record.at_ceiling is True  # type: ignore[attr-defined]
        assert isinstance(record.elapsed_seconds, float)  # type: ignore[attr-defined]
        assert record.fault.endswith("BackendUnavailable")  # type: ignore[attr-defined]


async def test_below_the_ceiling_only_first_sight_and_doublings_speak(
    caplog: pytest.LogCaptureFixture, autojump_clock: trio.testing.MockClock
) -> None:
    caplog.set_level(logging.WARNING, logger="aion_trio.completion")
    async with harness(CompletionRetryConfig(initial=0.001, ceiling=1000.0)) as h:
        lease = await active_workflow(h)
        h.flaky.events.fail_next_appends(1)
        h.flaky.events.fail_next_reads(9)
        await handle_run_exit(h.core, lease, completed("r", h))
        await h.wait_for_completed(lease, limit=10_000)
    stated = [r.attempts for r in caplog.records if "retrying with backoff" in r.getMessage()]  # type: ignore[attr-defined]
    assert stated == [1, 2, 4, 8]


# --------------------------------------------------------------------------
# What is reported and never retried
# --------------------------------------------------------------------------


async def test_a_sequence_conflict_is_reported_not_retried(autojump_clock: trio.testing.MockClock) -> None:
    async with harness() as h:
        lease = await active_workflow(h)
        h.flaky.events.conflict_next_appends(1)
        with pytest.raises(aion.SequenceConflict):
            await handle_run_exit(h.core, lease, completed("r", h))
        assert h.core.epoch.armed_completion_retry_count() == 0


async def test_a_lost_ownership_refusal_is_reported_not_retried(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with harness() as h:
        lease = await active_workflow(h)
        h.flaky.events.not_owner_next_appends(1)
        with pytest.raises(aion.NotOwner):
            await handle_run_exit(h.core, lease, completed("r", h))
        assert h.core.epoch.armed_completion_retry_count() == 0


async def test_an_attempt_refuses_to_append_once_the_epoch_is_closed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with harness() as h:
        lease = await active_workflow(h)
        before = await h.truth(lease)
        h.core.epoch.begin_close()
        with pytest.raises(aion.EngineEpochClosed):
            await handle_run_exit(h.core, lease, completed("r", h))
        assert len(await h.truth(lease)) == len(before)
        assert h.core.epoch.armed_completion_retry_count() == 0


async def test_the_resume_arm_refuses_to_append_once_the_epoch_is_closed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with harness() as h:
        lease = await active_workflow(h)
        await write(lease, deadline_started(lease, h))
        await write(lease, WorkflowCompleted(result=aion.Payload.of("r")))
        before = await h.truth(lease)
        assert deadline_outstanding(before, lease), "control: the resume arm has an append owed"
        h.core.epoch.begin_close()
        with pytest.raises(aion.EngineEpochClosed):
            await handle_run_exit(h.core, lease, completed("r", h))
        after = await h.truth(lease)
        assert len(after) == len(before)
        assert deadline_outstanding(after, lease)


async def test_the_continuation_start_refuses_once_the_epoch_is_closed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with harness() as h:
        lease = await active_workflow(h)
        terminal = WorkflowContinuedAsNew(input=aion.Payload.of(["next"]), parent_run_id=lease.run_id)
        await write(lease, terminal)
        starts = lambda history: sum(1 for e in history if isinstance(e.body, WorkflowStarted))  # noqa: E731
        assert starts(await h.truth(lease)) == 1, "control: only the parent run has started"
        h.core.epoch.begin_close()
        with pytest.raises(aion.EngineEpochClosed):
            await h.core.start_successor(lease, terminal)
        assert starts(await h.truth(lease)) == 1


async def test_a_successor_already_open_is_not_started_twice(autojump_clock: trio.testing.MockClock) -> None:
    async with harness() as h:
        lease = await active_workflow(h)
        terminal = WorkflowContinuedAsNew(input=aion.Payload.of([]), parent_run_id=lease.run_id)
        await write(lease, terminal)
        first = await h.core.start_successor(lease, terminal)
        assert first is not None
        assert await h.core.start_successor(lease, terminal) is None
        starts = [e for e in await h.truth(lease) if isinstance(e.body, WorkflowStarted)]
        assert len(starts) == 2
        assert starts[1].body.parent_run_id == lease.run_id


# --------------------------------------------------------------------------
# The fault reporter
# --------------------------------------------------------------------------


def test_the_fault_key_is_the_error_type_not_its_message() -> None:
    first = aion.BackendUnavailable("peer 10.0.0.7:5432 unreachable after 1.20s")
    second = aion.BackendUnavailable("peer 10.0.0.9:5432 unreachable after 4.80s")
    assert str(first) != str(second), "control: the renderings differ"
    assert failure_discriminant(first) == failure_discriminant(second)
    assert failure_discriminant(first) != failure_discriminant(aion.NotOwner("shard-3")), (
        "control: different faults stay distinguishable"
    )


def test_an_unchanging_fault_is_restated_on_attempt_count_doubling() -> None:
    reporter = FaultReporter()
    stated = [a for a in range(1, 33) if reporter.should_report("store/unavailable", a)]
    assert stated == [1, 2, 4, 8, 16, 32]


def test_a_changed_fault_is_stated_at_once_and_does_not_defer_the_escalation() -> None:
    reporter = FaultReporter()
    assert reporter.should_report("store/unavailable", 1)
    assert not reporter.should_report("store/unavailable", 1)
    assert reporter.should_report("engine/other", 1), "a new fault is news at once"
    assert reporter.should_report("engine/other", 2), "the escalation set by attempt 1 still fires at 2"
    alternating = [
        a for a in range(3, 17) if reporter.should_report("store/unavailable" if a % 2 else "engine/other", a)
    ]
    assert alternating == [4, 8, 16], "flapping between known faults does not flood"


async def test_a_sequence_conflict_never_triggers_a_reread(autojump_clock: trio.testing.MockClock) -> None:
    async with harness() as h:
        lease = await active_workflow(h)
        h.flaky.events.conflict_next_appends(1)
        with pytest.raises(aion.SequenceConflict):
            await handle_run_exit(h.core, lease, completed("r", h))
        assert not lease.recorder.stale
        assert lease.recorder.rereads == 0
        assert h.flaky.events.calls["read_history"] == 1, "only the initial load read the store"


# --------------------------------------------------------------------------
# A late completion of a run the deadline already tore down
# --------------------------------------------------------------------------


@aion.activity
async def ship(order: str) -> str:
    """Takes a day; stands for work still in flight when the run is ended."""
    await trio.sleep(86400)
    return f"shipped {order}"


@aion.workflow
async def sleeper(ctx: aion.WorkflowContext) -> str:
    handle = ctx.start(ship, "slow")
    await ctx.sleep(7200)
    return str(await handle)


class _CountingVisibility:
    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.upserts: list[str] = []

    async def upsert(self, row: Any) -> None:
        self.upserts.append(row.workflow_id)
        await self._inner.upsert(row)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _CountingStore:
    def __init__(self, inner: aion.Store) -> None:
        self._inner = inner
        self.events = inner.events
        self.visibility = _CountingVisibility(inner.visibility)

    async def aclose(self) -> None:
        await self._inner.aclose()


async def test_a_late_completion_of_a_timed_out_run_writes_neither_history_nor_visibility(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The teardown owns a TimedOut run's visibility and deadline: the run's own completion
    path, arriving after the teardown, must stand down without writing either."""
    with trio.fail_after(40 * 86400):
        async with aion.open_store(f"memory://completion-{uuid.uuid4().hex}") as raw:
            store = _CountingStore(raw)
            async with aion.open_engine(store, workflows=[sleeper], activities=[ship]) as engine:  # type: ignore[arg-type]
                run = await engine.start(sleeper, workflow_id="late2", timeout=60)
                with pytest.raises(aion.WorkflowFailure, match="timed_out"):
                    await run.result()
                await trio.testing.wait_all_tasks_blocked()
                lease = engine._core.registry.get("late2", run.run_id)
                assert lease is not None
                history = await engine.history("late2")
                upserts = list(store.visibility.upserts)
                assert upserts, "control: the teardown did write the row"
                intent = TerminalIntent.completed(aion.Payload('"too late"'), engine._core.clock.now())
                await handle_run_exit(engine._core, lease, intent)
                await trio.testing.wait_all_tasks_blocked()
                assert await engine.history("late2") == history
                assert store.visibility.upserts == upserts
                assert (await engine.describe("late2")).status is aion.WorkflowStatus.TIMED_OUT
