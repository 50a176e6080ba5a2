"""Durable schedules (``engine.schedules``, docs/schedules.md).

The behaviours peers pin for their schedulers (cron firing, one run per tick
across restarts, overlap policies, catch-up after downtime within and outside
the window, backfill, pause, trigger, update and delete, the recent and next
actions), on the engine clock under MockClock: a year of a daily schedule
runs in milliseconds.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import datetime, timedelta, timezone
from typing import Any

import attrs
import pytest
import trio
import trio.testing

import aion_trio as aion
from aion_trio._clock import TrioClock
from aion_trio._schedules import Overlap, Schedule, ScheduleSpec, plan

T0 = datetime(2027, 1, 1, tzinfo=timezone.utc)


@aion.workflow
async def tick(ctx: aion.WorkflowContext, label: str) -> str:
    return label


@aion.workflow
async def which_tick(ctx: aion.WorkflowContext) -> str:
    nominal = aion.schedule_tick_time(ctx.workflow_id)
    return "none" if nominal is None else nominal.isoformat()


@aion.workflow
async def slow(ctx: aion.WorkflowContext, minutes: float) -> str:
    await ctx.sleep(timedelta(minutes=minutes))
    return "done"


def config(**overrides: Any) -> aion.EngineConfig:
    return aion.EngineConfig(
        clock=TrioClock.start(wall=T0 + timedelta(seconds=trio.current_time())),
        schedule_poll_interval=None,
        loop_stall_warning=None,
        **overrides,
    )


@asynccontextmanager
async def engine_on(store: str, **overrides: Any) -> AsyncIterator[aion.Engine]:
    async with aion.open_engine(
        store, workflows=[tick, slow, which_tick], config=config(**overrides)
    ) as engine:
        yield engine


async def scheduled_runs(engine: aion.Engine, schedule_id: str) -> list[aion.VisibilityRow]:
    rows = await engine.list(
        search=[aion.SearchPredicate(key="ScheduleId", op=aion.SearchOp.EQUALS, value=schedule_id)]
    )
    return sorted(rows, key=lambda r: r.workflow_id)


async def test_cron_fires_each_tick_with_its_memo_and_search_attributes(
    store_url: Callable[[], str],
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with engine_on(store_url()) as engine:
        await engine.schedules.create(
            "hourly", tick, "x", cron="0 * * * *", memo={"team": "ops"}, search_attributes={"Kind": "report"}
        )
        await trio.sleep(3 * 3600 + 60)
        rows = await scheduled_runs(engine, "hourly")
        assert [r.workflow_id for r in rows] == [
            "hourly@2027-01-01T01:00:00Z",
            "hourly@2027-01-01T02:00:00Z",
            "hourly@2027-01-01T03:00:00Z",
        ]
        assert all(r.status is aion.WorkflowStatus.COMPLETED for r in rows)
        first = rows[0].search_attributes
        assert first["memo.team"] == "ops"
        assert first["Kind"] == "report"
        assert first["ScheduleNominalTime"] == "2027-01-01T01:00:00Z"
        description = await engine.schedules.describe("hourly")
        assert [r.kind for r in description.recent] == [aion.ScheduleActionKind.STARTED] * 3
        assert description.next_times[0] == datetime(2027, 1, 1, 4, tzinfo=timezone.utc)
        assert len(description.next_times) == 10


async def test_cron_follows_its_time_zone(autojump_clock: trio.testing.MockClock) -> None:
    async with engine_on("memory://") as engine:
        description = await engine.schedules.create(
            "paris", tick, "x", cron="0 9 * * *", time_zone="Europe/Paris"
        )
        # 09:00 in Paris in January is 08:00 UTC.
        assert description.next_times[0] == datetime(2027, 1, 1, 8, tzinfo=timezone.utc)


async def test_a_year_of_a_daily_schedule_runs_under_mock_clock(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with engine_on("memory://") as engine:
        await engine.schedules.create("daily", tick, "d", cron="30 6 * * *")
        await trio.sleep(365 * 86400)
        rows = await scheduled_runs(engine, "daily")
        assert len(rows) == 365
        assert rows[0].workflow_id == "daily@2027-01-01T06:30:00Z"
        assert rows[-1].workflow_id == "daily@2027-12-31T06:30:00Z"
        assert (await engine.schedules.describe("daily")).schedule.state.started_count == 365


async def test_interval_with_offset_and_jitter_fire_at_their_times(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with engine_on("memory://") as engine:
        await engine.schedules.create(
            "every-10",
            tick,
            "i",
            interval=timedelta(minutes=10),
            offset=timedelta(minutes=3),
            jitter=timedelta(seconds=30),
        )
        await trio.sleep(31 * 60)
        rows = await scheduled_runs(engine, "every-10")
        assert [r.workflow_id for r in rows] == [
            "every-10@2027-01-01T00:03:00Z",
            "every-10@2027-01-01T00:13:00Z",
            "every-10@2027-01-01T00:23:00Z",
        ]
        for row in rows:
            nominal = datetime.fromisoformat(
                str(row.search_attributes["ScheduleNominalTime"]).replace("Z", "+00:00")
            )
            assert nominal <= row.start_time < nominal + timedelta(seconds=30)
        spec = (await engine.schedules.describe("every-10")).schedule.spec
        jitters = {spec.jitter_for("every-10", T0 + timedelta(minutes=3 + 10 * k)) for k in range(20)}
        assert len(jitters) > 1  # not one fixed delay


async def test_start_and_end_bound_the_ticks(autojump_clock: trio.testing.MockClock) -> None:
    async with engine_on("memory://") as engine:
        await engine.schedules.create(
            "bounded",
            tick,
            "b",
            interval=timedelta(hours=1),
            start_at=T0 + timedelta(hours=2),
            end_at=T0 + timedelta(hours=4),
        )
        await trio.sleep(10 * 3600)
        rows = await scheduled_runs(engine, "bounded")
        assert [r.workflow_id.split("@")[1] for r in rows] == [
            "2027-01-01T02:00:00Z",
            "2027-01-01T03:00:00Z",
            "2027-01-01T04:00:00Z",
        ]
        assert (await engine.schedules.describe("bounded")).next_times == ()


@pytest.mark.parametrize(
    ("overlap", "started", "ended"),
    [
        # slow runs take 25 minutes, ticks come every 10: ticks at 10, 20, 30, 40, 50.
        (Overlap.SKIP, ["00:10", "00:40"], {"00:10": "completed", "00:40": "running"}),
        # 00:20 waits for 00:10 (until 00:35), 00:30 is skipped (one waits already), 00:40 waits.
        (Overlap.BUFFER_ONE, ["00:10", "00:20"], {"00:10": "completed", "00:20": "running"}),
        (Overlap.BUFFER_ALL, ["00:10", "00:20"], {"00:10": "completed", "00:20": "running"}),
        # Each tick cancels the run before it, which closes at once, and starts when it has.
        (
            Overlap.CANCEL_OTHER,
            ["00:10", "00:20", "00:30", "00:40", "00:50"],
            {"00:10": "cancelled", "00:50": "running"},
        ),
        (
            Overlap.TERMINATE_OTHER,
            ["00:10", "00:20", "00:30", "00:40", "00:50"],
            {"00:10": "terminated", "00:50": "running"},
        ),
        (
            Overlap.ALLOW_ALL,
            ["00:10", "00:20", "00:30", "00:40", "00:50"],
            {"00:10": "completed", "00:50": "running"},
        ),
    ],
)
async def test_overlap_policies(
    store_url: Callable[[], str],
    autojump_clock: trio.testing.MockClock,
    overlap: Overlap,
    started: list[str],
    ended: dict[str, str | None],
) -> None:
    async with engine_on(store_url()) as engine:
        await engine.schedules.create("o", slow, 25, interval=timedelta(minutes=10), overlap=overlap)
        await trio.sleep(55 * 60)
        rows = {r.workflow_id.split("T")[1][:5]: r for r in await scheduled_runs(engine, "o")}
        assert sorted(rows) == started
        for hhmm, status in ended.items():
            if status is None:
                assert hhmm not in rows
            elif status == "terminated":
                assert rows[hhmm].status.value in ("terminated", "failed", "cancelled")
            else:
                assert rows[hhmm].status.value == status, hhmm
        description = await engine.schedules.describe("o")
        kinds = [r.kind.value for r in description.recent]
        if overlap is Overlap.SKIP:
            skipped = [r for r in description.recent if r.kind is aion.ScheduleActionKind.SKIPPED]
            assert len(skipped) == 3
            assert "still running" in skipped[0].reason
        if overlap is Overlap.BUFFER_ONE:
            assert kinds.count("buffered") == 2
            assert kinds.count("skipped") == 2
            assert len(description.schedule.state.pending) == 1  # 00:40 waits for 00:20
        if overlap is Overlap.BUFFER_ALL:
            assert kinds.count("skipped") == 0
            assert [p.nominal_time.minute for p in description.schedule.state.pending] == [30, 40, 50]


async def test_catch_up_after_downtime_within_the_window_and_skips_older_ticks(
    store_url: Callable[[], str],
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = store_url()
    async with engine_on(store) as engine:
        await engine.schedules.create(
            "m",
            tick,
            "m",
            interval=timedelta(minutes=1),
            catchup_window=timedelta(minutes=3),
            overlap="allow_all",
        )
        await trio.sleep(90)  # the tick at 00:01 fires
    await trio.sleep(10 * 60)  # down until 00:11:30: ticks 00:02 .. 00:11 missed
    async with engine_on(store) as engine:
        with trio.fail_after(60):  # mock seconds: the service's first pass after the restart
            while (await engine.schedules.describe("m")).schedule.state.started_count < 4:  # noqa: ASYNC110
                await trio.sleep(1)
        rows = await scheduled_runs(engine, "m")
        times = [r.workflow_id.split("T")[1][:5] for r in rows]
        assert times == ["00:01", "00:09", "00:10", "00:11"]  # within 3 minutes of 00:11:30
        state = (await engine.schedules.describe("m")).schedule.state
        assert state.skipped_count == 7  # 00:02 .. 00:08, recorded as skipped
        missed = [r for r in state.recent if r.kind is aion.ScheduleActionKind.SKIPPED]
        assert missed
        assert "catch-up window" in missed[-1].reason


async def test_a_tick_starts_once_when_its_state_write_was_lost(
    store_url: Callable[[], str],
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A crash between a tick's start and the schedule's state write: the next engine sees
    the tick due again, and its start finds the run the tick's workflow id names."""
    store = store_url()
    async with engine_on(store) as engine:
        await engine.schedules.create("once", slow, 30, interval=timedelta(minutes=10), overlap="allow_all")
        stored = engine.store
        assert isinstance(stored, aion.ScheduleStore)
        before = await stored.read_schedule("once")
        assert before is not None
        await trio.sleep(11 * 60)  # 00:10 fired
        after = await stored.read_schedule("once")
        assert after is not None
        assert after.version > before.version
        # Lose the write: the stored state is the one before the tick again.
        await stored.write_schedule("once", before.data, after.version)
    async with engine_on(store) as engine:
        await trio.sleep(60)
        rows = await scheduled_runs(engine, "once")
        assert [r.workflow_id for r in rows] == ["once@2027-01-01T00:10:00Z"]
        history = await engine.history("once@2027-01-01T00:10:00Z")
        assert sum(type(e.body).__name__ == "WorkflowStarted" for e in history) == 1


async def test_pause_skips_ticks_with_its_note_and_unpause_resumes(
    store_url: Callable[[], str],
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with engine_on(store_url()) as engine:
        await engine.schedules.create("p", tick, "p", interval=timedelta(minutes=10))
        await trio.sleep(11 * 60)
        paused = await engine.schedules.pause("p", note="maintenance")
        assert paused.paused
        assert paused.note == "maintenance"
        assert paused.next_times == ()
        await trio.sleep(20 * 60)
        await engine.schedules.unpause("p")
        await trio.sleep(10 * 60)
        times = [r.workflow_id.split("T")[1][:5] for r in await scheduled_runs(engine, "p")]
        assert times == ["00:10", "00:40"]
        recent = (await engine.schedules.describe("p")).recent
        assert [r.reason for r in recent if r.kind is aion.ScheduleActionKind.SKIPPED] == [
            "paused: maintenance"
        ] * 2


async def test_trigger_starts_a_run_now(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    async with engine_on(store_url()) as engine:
        await engine.schedules.create("t", tick, "t", cron="0 0 1 1 *")
        await trio.sleep(5)
        await engine.schedules.trigger("t")
        rows = await scheduled_runs(engine, "t")
        assert [r.workflow_id for r in rows] == ["t@manual@2027-01-01T00:00:05Z"]


async def test_backfill_runs_a_past_range_once(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    async with engine_on(store_url()) as engine:
        await engine.schedules.create("bf", tick, "b", cron="0 0 * * *", start_at=T0 - timedelta(days=30))
        await engine.schedules.backfill("bf", T0 - timedelta(days=3), T0 - timedelta(days=1))
        await engine.schedules.backfill(
            "bf", T0 - timedelta(days=2), T0 - timedelta(days=1)
        )  # again: no new run
        rows = await scheduled_runs(engine, "bf")
        assert [r.workflow_id for r in rows] == [
            "bf@2026-12-29T00:00:00Z",
            "bf@2026-12-30T00:00:00Z",
            "bf@2026-12-31T00:00:00Z",
        ]
        for row in rows:
            assert len(await engine.history(row.workflow_id)) == 2  # started, completed: once


async def test_update_changes_the_spec_and_delete_stops_the_ticks(
    store_url: Callable[[], str],
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with engine_on(store_url()) as engine:
        await engine.schedules.create("u", tick, "u", interval=timedelta(hours=1))
        updated = await engine.schedules.update("u", interval=timedelta(minutes=5), args=("v",))
        assert updated.next_times[0] == T0 + timedelta(minutes=5)
        await trio.sleep(6 * 60)
        rows = await scheduled_runs(engine, "u")
        assert [r.workflow_id for r in rows] == ["u@2027-01-01T00:05:00Z"]
        assert await engine.result(rows[0].workflow_id) == "v"
        await engine.schedules.delete("u")
        await trio.sleep(3600)
        assert len(await scheduled_runs(engine, "u")) == 1
        assert await engine.schedules.list() == []
        with pytest.raises(aion.ScheduleNotFound):
            await engine.schedules.delete("u")


async def test_bad_input_gets_typed_errors(autojump_clock: trio.testing.MockClock) -> None:
    async with engine_on("memory://") as engine:
        with pytest.raises(aion.InvalidSchedule, match="cron"):
            await engine.schedules.create("bad", tick, "x", cron="61 * * * *")
        with pytest.raises(aion.InvalidSchedule, match="time zone"):
            await engine.schedules.create("bad", tick, "x", cron="0 * * * *", time_zone="Mars/Olympus")
        with pytest.raises(aion.InvalidSchedule, match="exactly one"):
            await engine.schedules.create("bad", tick, "x")
        with pytest.raises(aion.UnknownWorkflowType):
            await engine.schedules.create("bad", "no-such-workflow", cron="0 * * * *")
        with pytest.raises(aion.ScheduleNotFound):
            await engine.schedules.describe("bad")
        await engine.schedules.create("dup", tick, "x", cron="0 * * * *")
        with pytest.raises(aion.ScheduleAlreadyExists):
            await engine.schedules.create("dup", tick, "y", cron="0 * * * *")
        with pytest.raises(aion.ScheduleNotFound):
            await engine.schedules.pause("nope")
        assert [d.schedule_id for d in await engine.schedules.list()] == ["dup"]


@attrs.define
class NoSchedules:
    """A store bundle without the schedule capability."""

    inner: Any

    @property
    def events(self) -> Any:
        return self.inner.events

    @property
    def visibility(self) -> Any:
        return self.inner.visibility

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_a_store_without_the_capability_gets_a_typed_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with aion.open_store("memory://") as store:
        bare = NoSchedules(store)
        assert not isinstance(bare, aion.ScheduleStore)
        async with aion.open_engine(bare, workflows=[tick], config=config()) as engine:
            with pytest.raises(aion.SchedulesUnsupported):
                await engine.schedules.create("s", tick, "x", cron="0 * * * *")
            with pytest.raises(aion.SchedulesUnsupported):
                await engine.schedules.list()


def test_plan_skips_ticks_outside_the_catch_up_window_and_records_them() -> None:
    spec = ScheduleSpec(interval=timedelta(minutes=1))
    schedule = Schedule(
        schedule_id="s",
        spec=spec,
        action=aion.ScheduleAction(workflow_type="w"),
        policy=aion.SchedulePolicy(catchup_window=timedelta(minutes=2)),
        state=aion.ScheduleState(cursor=T0 + timedelta(minutes=1)),
        created_at=T0,
    )
    decided = plan(schedule, T0 + timedelta(minutes=10, seconds=30), still_running=frozenset())
    assert [s.workflow_id for s in decided.starts] == ["s@2027-01-01T00:09:00Z"]
    assert decided.state.skipped_count == 8 + 1  # 00:01-00:08 missed, 00:10 overlaps 00:09 (skip)
    assert decided.state.cursor == T0 + timedelta(minutes=11)
    assert decided.wake_at == T0 + timedelta(minutes=11)


def test_plan_cancels_the_running_run_once_and_the_tick_then_waits() -> None:
    schedule = Schedule(
        schedule_id="c",
        spec=ScheduleSpec(interval=timedelta(minutes=10)),
        action=aion.ScheduleAction(workflow_type="w"),
        policy=aion.SchedulePolicy(overlap=Overlap.CANCEL_OTHER),
        state=aion.ScheduleState(cursor=T0 + timedelta(minutes=10), running=("c@old",)),
        created_at=T0,
    )
    first = plan(schedule, T0 + timedelta(minutes=10), still_running=frozenset({"c@old"}))
    assert first.cancel == ("c@old",)
    assert first.starts == ()
    assert [p.nominal_time for p in first.state.pending] == [T0 + timedelta(minutes=10)]
    # The next pass, the old run still closing: no second cancel, the tick still waits.
    again = plan(
        attrs.evolve(schedule, state=first.state),
        T0 + timedelta(minutes=11),
        still_running=frozenset({"c@old"}),
    )
    assert again.cancel == ()
    assert again.starts == ()
    assert again.state.pending == first.state.pending
    # Once it closed, the tick starts.
    closed = plan(
        attrs.evolve(schedule, state=again.state), T0 + timedelta(minutes=12), still_running=frozenset()
    )
    assert [s.workflow_id for s in closed.starts] == ["c@2027-01-01T00:10:00Z"]


async def test_an_unreadable_schedule_does_not_stop_the_others(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    async with engine_on(store_url()) as engine:
        stored = engine.store
        assert isinstance(stored, aion.ScheduleStore)
        await stored.create_schedule("a-broken", "not a schedule")  # listed before "good"
        await engine.schedules.create("good", tick, "g", interval=timedelta(minutes=1))
        await trio.sleep(3 * 60 + 1)
        assert len(await scheduled_runs(engine, "good")) == 3
        with pytest.raises(aion.InvalidSchedule, match="stored data"):
            await engine.schedules.describe("a-broken")


async def test_update_keeps_the_state_pause_and_counts(autojump_clock: trio.testing.MockClock) -> None:
    async with engine_on("memory://") as engine:
        await engine.schedules.create("k", tick, "k", interval=timedelta(minutes=1))
        await trio.sleep(2 * 60 + 1)
        await engine.schedules.pause("k", note="hold")
        updated = await engine.schedules.update("k", overlap="buffer_all", memo={"v": 2})
        state = updated.schedule.state
        assert (state.paused, state.note, state.started_count) == (True, "hold", 2)
        assert updated.schedule.policy.overlap is Overlap.BUFFER_ALL
        assert updated.schedule.action.memo == {"v": 2}


@attrs.define
class LosesAScheduleWrite:
    """A store bundle whose first schedule write after a start fails as a backend fault would
    (fault injection: everything else goes to the real store)."""

    inner: Any
    failed: int = 0

    @property
    def events(self) -> Any:
        return self.inner.events

    @property
    def visibility(self) -> Any:
        return self.inner.visibility

    async def aclose(self) -> None:
        await self.inner.aclose()

    async def create_schedule(self, schedule_id: str, data: str) -> Any:
        return await self.inner.create_schedule(schedule_id, data)

    async def read_schedule(self, schedule_id: str) -> Any:
        return await self.inner.read_schedule(schedule_id)

    async def list_schedules(self) -> Any:
        return await self.inner.list_schedules()

    async def write_schedule(self, schedule_id: str, data: str, expected_version: int) -> Any:
        if not self.failed and '"started_count":1' in data:
            self.failed += 1
            await trio.lowlevel.checkpoint()
            raise aion.BackendUnavailable("injected: the schedule's write after its first start failed")
        return await self.inner.write_schedule(schedule_id, data, expected_version)

    async def delete_schedule(self, schedule_id: str) -> bool:
        return bool(await self.inner.delete_schedule(schedule_id))


async def test_a_failed_pass_is_retried_and_its_tick_starts_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with aion.open_store("memory://") as inner:
        store = LosesAScheduleWrite(inner)
        assert isinstance(store, aion.ScheduleStore)
        async with aion.open_engine(store, workflows=[tick], config=config()) as engine:
            await engine.schedules.create("f", tick, "f", interval=timedelta(hours=1))
            await trio.sleep(3600 + 5)  # the first tick started, its state write failed, retried 1 s later
            assert store.failed == 1
            state = (await engine.schedules.describe("f")).schedule.state
            assert state.started_count == 1
            assert state.cursor == T0 + timedelta(hours=2)
            await trio.sleep(2 * 3600)
            rows = await scheduled_runs(engine, "f")
            assert [r.workflow_id.split("T")[1] for r in rows] == ["01:00:00Z", "02:00:00Z", "03:00:00Z"]
            for row in rows:
                history = await engine.history(row.workflow_id)
                assert sum(type(e.body).__name__ == "WorkflowStarted" for e in history) == 1


async def test_a_run_knows_its_tick_from_its_workflow_id(autojump_clock: trio.testing.MockClock) -> None:
    async with engine_on("memory://") as engine:
        await engine.schedules.create("w@x", which_tick, cron="15 * * * *")  # an id with an '@' in it
        await trio.sleep(20 * 60)
        await engine.schedules.trigger("w@x")
        rows = await scheduled_runs(engine, "w@x")
        results = [await engine.result(r.workflow_id) for r in rows]
        assert results == ["2027-01-01T00:15:00+00:00", "2027-01-01T00:20:00+00:00"]
        assert await (await engine.start(which_tick, workflow_id="plain")).result() == "none"
        assert aion.schedule_tick_time("a@not-a-time") is None
