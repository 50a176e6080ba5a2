"""Waiting for a flow-control slot is visible from the store (issue 18): ``aion-trio show``,
run beside the engine and reading only the store, says which attempt waits for which
pool's slot, since when and at what priority; once the slot is taken the record is gone;
a wait recorded by an engine that was killed is cleared by the engine that opens the
store next (docs/flow-control.md)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import trio
from _clirunner import cli_runner
from click.testing import Result
from procs import flow_wait_worker
from rich.console import Console

import aion_trio as aion
from aion_trio import _cli
from aion_trio._cli import render
from aion_trio._console import data as console_data, pages as console_pages
from aion_trio_sqlite import SqliteStore

ROOT = Path(__file__).resolve().parent.parent

#: The tags of the attempts that began, in order; ``begun[i]`` is set when the i-th began
#: (which of the two gets the slot first is the scheduler's choice).
began: list[str] = []
begun: list[trio.Event] = []
release: dict[str, trio.Event] = {}


@aion.activity(priority=4)
async def slow(tag: str) -> str:
    began.append(tag)
    begun[len(began) - 1].set()
    await release[tag].wait()
    return tag


@aion.workflow
async def two_slow(ctx: aion.WorkflowContext) -> list[str]:
    first = ctx.start(slow, "first")
    second = ctx.start(slow, "second")
    return [await first, await second]


def new_events() -> None:
    began.clear()
    begun[:] = [trio.Event(), trio.Event()]
    for tag in ("first", "second"):
        release[tag] = trio.Event()


async def release_both() -> None:
    """Let the running attempt end, then the one that waited (once it began)."""
    await begun[0].wait()
    release[began[0]].set()
    await begun[1].wait()
    release[began[1]].set()


@pytest.fixture(autouse=True)
def fresh_events() -> None:
    new_events()


def show(url: str, *args: str) -> Result:
    result = cli_runner().invoke(_cli.cli, ["show", "--store", url, *args], prog_name="aion-trio")
    assert result.exit_code == 0, (result.stdout, result.stderr)
    return result


async def show_json(url: str) -> dict[str, Any]:
    # The command runs its own Trio loop: in a thread, beside the engine's.
    result = await trio.to_thread.run_sync(show, url, "fw", "--json")
    data: dict[str, Any] = json.loads(result.stdout)
    return data


def waits(data: dict[str, Any]) -> dict[str, Any]:
    """activity id -> its slot wait as show reports it (None: not waiting)."""
    return {str(a["activity_id"]): a["slot_wait"] for a in data["pending_activities"]}


async def wait_recorded(engine: aion.Engine, store: SqliteStore, count: int) -> None:
    """Until ``count`` waits of ``fw`` are recorded in the store and both its activities
    are in its history (bounded by the caller)."""
    while len(await store.flow_waiters("fw", now=datetime.now(timezone.utc))) != count:  # noqa: ASYNC110
        await trio.sleep(0.01)
    await both_scheduled(engine)


async def both_scheduled(engine: aion.Engine) -> None:
    """Until both activities of ``fw`` are in its history (bounded by the caller)."""
    while len((await engine.describe("fw")).pending_activities) != 2:  # noqa: ASYNC110
        await trio.sleep(0.01)


async def test_show_reports_an_attempt_waiting_for_a_slot_and_not_once_it_runs(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'show.db'}"
    config = aion.EngineConfig(activity_limits={"slow": aion.FlowLimit(concurrency=1)})
    with trio.fail_after(60):
        async with aion.open_store(url) as store:
            assert isinstance(store, SqliteStore)
            async with aion.open_engine(
                store, workflows=[two_slow], activities=[slow], config=config
            ) as engine:
                started = datetime.now(timezone.utc)
                run = await engine.start(two_slow, workflow_id="fw")
                await begun[0].wait()
                await wait_recorded(engine, store, 1)
                description = await engine.describe("fw")
                ids = {
                    p.activity_type + ":" + str(p.waiting_for): p.activity_id
                    for p in description.pending_activities
                }
                waiting_id = ids["slow:activity:slow"]

                data = await show_json(url)
                assert data["slot_waits_known"] is True
                reported = waits(data)
                assert set(reported) == {str(p.activity_id) for p in description.pending_activities}
                wait = reported.pop(str(waiting_id))
                assert list(reported.values()) == [None], "the running attempt does not wait"
                assert (wait["pool"], wait["limit"], wait["priority"], wait["attempt"]) == (
                    "activity:slow",
                    "concurrency=1",
                    4,
                    1,
                )
                since = datetime.fromisoformat(wait["since"].replace("Z", "+00:00"))
                assert started - timedelta(seconds=1) <= since <= datetime.now(timezone.utc)
                assert wait["holder"].startswith("engine-")
                assert wait["lapses_at"]

                # The web console's workflow page reads the same records.
                page = await console_data.workflow_page(store, "fw")
                html = console_pages.workflow_live(page)
                assert "activity:slow (concurrency=1) since" in html
                assert html.count("activity:slow (concurrency=1)") == 1

                text = (await trio.to_thread.run_sync(show, url, "fw")).stdout
                assert "Waiting for a flow-control slot" in text
                assert f"activity:{waiting_id}" in text.split("Waiting for a flow-control slot")[1]
                assert "1 waiting for a flow-control slot" in text

                # The slot frees: the waiting attempt runs, and its record goes.
                release[began[0]].set()
                await begun[1].wait()
                # The record is removed in the background once the attempt has its slot.
                while await store.flow_waiters("fw", now=datetime.now(timezone.utc)):  # noqa: ASYNC110
                    await trio.sleep(0.01)
                data = await show_json(url)
                assert len(data["pending_activities"]) == 1
                assert waits(data) == {str(waiting_id): None}
                text = (await trio.to_thread.run_sync(show, url, "fw")).stdout
                assert "Waiting for a flow-control slot" not in text
                assert text.split("Slot waits")[1].splitlines()[0].strip() == "none"
                release[began[1]].set()
                assert await run.result() == ["first", "second"]


async def test_a_slot_taken_at_once_records_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    recorded: list[object] = []
    original = SqliteStore.record_flow_waiter

    async def counting(self: SqliteStore, waiter: aion.FlowWaiter, **kw: Any) -> None:
        recorded.append(waiter)
        await original(self, waiter, **kw)

    monkeypatch.setattr(SqliteStore, "record_flow_waiter", counting)
    url = f"sqlite:///{tmp_path / 'fast.db'}"
    config = aion.EngineConfig(activity_limits={"slow": aion.FlowLimit(concurrency=2)})
    with trio.fail_after(60):
        async with aion.open_engine(url, workflows=[two_slow], activities=[slow], config=config) as engine:
            run = await engine.start(two_slow, workflow_id="fw")
            await begun[1].wait()  # both at once
            release["first"].set()
            release["second"].set()
            await run.result()
    assert recorded == []
    # The same engine with a bound of 1 records the one wait.
    new_events()
    config = aion.EngineConfig(activity_limits={"slow": aion.FlowLimit(concurrency=1)})
    with trio.fail_after(60):
        async with aion.open_engine(url, workflows=[two_slow], activities=[slow], config=config) as engine:
            run = await engine.start(two_slow, workflow_id="fw-2")
            await release_both()
            await run.result()
    assert [w.workflow_id for w in recorded] == ["fw-2"]  # type: ignore[attr-defined]


async def test_a_lapsed_record_is_not_reported(tmp_path: Path) -> None:
    """A record its engine stopped renewing (it died) lapses: show no longer reports it."""
    url = f"sqlite:///{tmp_path / 'lapsed.db'}"
    config = aion.EngineConfig(activity_limits={"slow": aion.FlowLimit(concurrency=1)})
    with trio.fail_after(60):
        async with aion.open_store(url) as store:
            assert isinstance(store, SqliteStore)
            async with aion.open_engine(
                store, workflows=[two_slow], activities=[slow], config=config
            ) as engine:
                await engine.start(two_slow, workflow_id="fw")
                await begun[0].wait()
                await wait_recorded(engine, store, 1)
                [waiter] = await store.flow_waiters("fw", now=datetime.now(timezone.utc))
                # As its engine would have left it had it died an hour ago.
                old = datetime.now(timezone.utc) - timedelta(hours=1)
                await store.record_flow_waiter(waiter, ttl=30.0, now=old)
                data = await show_json(url)
                assert data["slot_waits_known"] is True
                assert list(waits(data).values()) == [None, None]
                await release_both()


async def test_a_store_that_records_no_waits_is_shown_as_not_known(tmp_path: Path) -> None:
    """What show prints from a store without the records (slot_waits None): "not known",
    never "not waiting"."""
    url = f"sqlite:///{tmp_path / 'plain.db'}"
    config = aion.EngineConfig(activity_limits={"slow": aion.FlowLimit(concurrency=1)})
    with trio.fail_after(60):
        async with aion.open_engine(url, workflows=[two_slow], activities=[slow], config=config) as engine:
            await engine.start(two_slow, workflow_id="fw")
            await begun[0].wait()
            await both_scheduled(engine)
            events = await engine.history("fw")
            description = await engine.describe("fw")
            data = render.show_json(events, description, None)
            assert data["slot_waits_known"] is False
            assert [a["slot_wait"] for a in data["pending_activities"]] == [None, None]
            console = Console(width=200, record=True)
            render.print_show(console, events, description, None)
            text = console.export_text()
            assert "Slot waits  " + render.SLOT_WAITS_NOT_KNOWN[:40] in text
            await release_both()


# --------------------------------------------------------------------------
# SIGKILL
# --------------------------------------------------------------------------


def _scheduled(store: Path) -> int:
    """How many ActivityScheduled events the file holds."""
    with contextlib.closing(sqlite3.connect(f"file:{store}?mode=ro", uri=True)) as conn:
        return int(conn.execute("SELECT count(*) FROM events WHERE type = 'ActivityScheduled'").fetchone()[0])


def _recorded(store: Path) -> list[tuple[str, int, str]]:
    if not store.exists():
        return []
    with contextlib.closing(sqlite3.connect(f"file:{store}?mode=ro", uri=True)) as conn:
        try:
            rows = conn.execute("SELECT workflow_id, activity_id, holder FROM flow_waiters").fetchall()
        except sqlite3.OperationalError:
            return []
    return [(str(w), int(a), str(h)) for w, a, h in rows]


@pytest.mark.slow
def test_a_wait_recorded_by_a_killed_engine_is_cleared_by_the_next(tmp_path: Path) -> None:
    store = tmp_path / "killed.db"
    url = f"sqlite:///{store}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.procs.flow_wait_worker", str(store), "1"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        deadline = time.monotonic() + 60
        # The wait recorded, and both attempts' scheduling in the history.
        while not _recorded(store) or _scheduled(store) < 2:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                out, err = proc.communicate()
                pytest.fail(f"no wait was recorded (exit {proc.returncode}):\n{out}\n{err[-3000:]}")
            time.sleep(0.02)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    [(_, activity_id, holder)] = _recorded(store)

    # Right after the kill the record has not lapsed yet: show reports it, naming the
    # engine that recorded it and when the record lapses unless renewed.
    data = json.loads(show(url, flow_wait_worker.WORKFLOW_ID, "--json").stdout)
    wait = waits(data)[str(activity_id)]
    assert (wait["pool"], wait["holder"]) == ("activity:hold", holder)
    assert datetime.fromisoformat(wait["lapses_at"].replace("Z", "+00:00")) > datetime.now(timezone.utc)

    async def reopen() -> dict[str, Any]:
        # The next engine on the file (room for both attempts now) clears the dead
        # engine's record when it opens: neither attempt waits.
        with trio.fail_after(60):
            async with aion.open_engine(
                url,
                workflows=[flow_wait_worker.two_holds],
                activities=[flow_wait_worker.hold],
                config=flow_wait_worker.config(2),
            ):
                return await trio.to_thread.run_sync(
                    lambda: json.loads(show(url, flow_wait_worker.WORKFLOW_ID, "--json").stdout)
                )

    data = trio.run(reopen)
    assert len(data["pending_activities"]) == 2
    assert list(waits(data).values()) == [None, None]
    assert _recorded(store) == []
