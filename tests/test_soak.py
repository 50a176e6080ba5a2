"""bench/soak.py: its smoke run, and its checker proved able to fail.

The smoke run is the SQLite soak itself (a real engine subprocess SIGKILLed at
seeded random moments, signals queued in the inbox meanwhile) with a few kills;
bench/README.md documents the full run.  The checker tests run the soak's
workload in one process on the memory store under the mock clock, then break
the recorded histories on purpose: each kind of damage must be reported.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import attrs
import pytest
import trio

import aion_trio as aion
from aion_trio.testing import FlakyStoreBundle

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"


@pytest.fixture
def soak(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCH))  # the bench scripts import their _common as a sibling
    return importlib.import_module("soak")


@pytest.mark.slow
def test_the_sqlite_soak_smoke_run_finds_every_history_whole(tmp_path: Path) -> None:
    # 80 workflows over 10 kills: enough work that most generations are killed mid-way on
    # a fast idle machine too (with 40, faster recovery let half of them finish first).
    command = [
        sys.executable,
        str(BENCH / "soak.py"),
        "--kills",
        "10",
        "--seed",
        "20261201",
        "--workflows",
        "80",
    ]
    done = subprocess.run(
        [*command, "--dir", str(tmp_path), "--patience", "60"],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    figures = [line for line in lines if line["kind"] == "figures"]
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr[-3000:]}"
    assert len(figures) == 1, done.stdout
    found = figures[0]
    assert found["violations"] == 0
    assert found["kills"] + found["generations_that_finished_before_their_kill"] == 10
    # Killed mid-way, not finished: the seed kills two during start-up; the rest depends
    # on how fast the engine gets through the work (6 of 10 on an idle machine, more
    # under load), so the bound leaves that margin.
    assert found["kills"] >= 4, found
    assert found["workflows"] == 80
    assert found["signals_queued"] == 16  # one per signal workflow
    assert found["histories"] == 96  # 80 workflows and 16 children
    assert not list(tmp_path.iterdir()), "the scratch directory was removed"


async def recorded(soak: ModuleType, workflows: int) -> dict[str, list[aion.Event]]:
    """The soak's workload run to its end in this process; every history."""
    async with aion.open_store("memory://") as store:
        async with aion.open_engine(store, workflows=soak.WORKFLOWS, activities=[soak.step]) as engine:
            handles = [await soak.start_one(engine, i) for i in range(workflows)]
            for i in range(workflows):
                if soak.kind_of(i) == "signal":
                    await engine.signal(soak.workflow_id(i), soak.SIGNAL, soak.signal_payload(i))
            assert [await h.result() for h in handles] == [soak.expected_result(i) for i in range(workflows)]
        return {wid: await store.events.read_history(wid) for wid in await store.events.list_workflow_ids()}


def appended(history: list[aion.Event], body: Any) -> list[aion.Event]:
    """``history`` with ``body`` recorded once more just before its last event."""
    last = history[-1]
    extra = attrs.evolve(last, seq=last.seq, body=body)
    return [*history[:-1], extra, attrs.evolve(last, seq=last.seq + 1)]


async def test_the_soak_checker_passes_the_workload_and_names_each_kind_of_damage(
    soak: ModuleType, autojump_clock: trio.testing.MockClock
) -> None:
    histories = await recorded(soak, 5)  # one workflow of each kind
    sent = {soak.workflow_id(i): 1 for i in range(5) if soak.kind_of(i) == "signal"}
    assert soak.check_histories(histories, 5, sent) == []

    def damaged(wid: str, history: list[aion.Event]) -> list[str]:
        return soak.check_histories({**histories, wid: history}, 5, sent)

    seq = histories["soak-0"]
    completion = next(e.body for e in seq if isinstance(e.body, aion.ActivityCompleted))
    assert damaged("soak-0", appended(seq, completion)) == [
        "soak-0 run 0: an activity completed twice ([0, 0, 1, 2])"
    ]
    assert damaged("soak-0", [*seq[:2], *seq[3:]]) == [f"soak-0: seqs are not 1..{len(seq) - 1}"]
    assert damaged("soak-0", seq[:-1]) == [
        "soak-0 run 0: 0 terminal events",
        f"soak-0: did not complete (last events {', '.join(f'{e.seq}:{e.type}' for e in seq[-5:-1])})",
    ]
    wrong = attrs.evolve(seq[-1], body=aion.WorkflowCompleted(result=aion.Payload.of(-1)))
    assert damaged("soak-0", [*seq[:-1], wrong]) == [f"soak-0: result -1, expected {soak.expected_result(0)}"]
    signalled = histories["soak-2"]
    again = next(e.body for e in signalled if isinstance(e.body, aion.SignalReceived))
    assert damaged("soak-2", appended(signalled, again)) == [
        "soak-2: 2 signals recorded, 1 sent",
        "soak-2: signals [2, 2], expected [2]",
    ]
    child = next(wid for wid in histories if "/" in wid)
    assert soak.check_histories({w: h for w, h in histories.items() if w != child}, 5, sent) == [
        "0 child workflows for 1 parents"
    ]
    assert soak.check_histories(histories, 6, sent) == ["soak-5: missing"]


# --------------------------------------------------------------------------
# Found by the flaky soak (bench/soak.py --store flaky): a write that records a
# run's start, whose commit landed but whose acknowledgement was lost, leaves the
# run recorded as Running; once the store answers, this engine looks at what
# landed and runs it (EngineCore.resume_idle), not only the next engine's recovery.
# --------------------------------------------------------------------------


@aion.activity
async def one(n: int) -> int:
    return n


@aion.workflow
async def chained(ctx: aion.WorkflowContext, n: int, total: int) -> int:
    total += await ctx.run(one, n)
    if n < 1:
        raise ctx.continue_as_new(n + 1, total)
    return total


async def test_a_start_retried_after_a_lost_acknowledgement_runs_to_its_result(
    autojump_clock: trio.testing.MockClock, store_url: Callable[[], str]
) -> None:
    async with aion.open_store(store_url()) as store:
        flaky = FlakyStoreBundle(store)
        async with aion.open_engine(flaky, workflows=[chained], activities=[one]) as engine:
            flaky.events.commit_then_fail_next_appends(1)  # the start's WorkflowStarted lands, "fails"
            with pytest.raises(aion.BackendUnavailable):
                await engine.start(chained, 1, 0, workflow_id="w")
            run = await engine.start(chained, 1, 0, workflow_id="w", id_reuse=aion.IdReusePolicy.USE_EXISTING)
            result = None
            with trio.move_on_after(3600):  # mock time
                result = await run.result()
    assert result == 1, "no result within an hour"


async def test_a_continue_as_new_whose_acknowledgement_was_lost_runs_the_successor(
    autojump_clock: trio.testing.MockClock, store_url: Callable[[], str]
) -> None:
    async with aion.open_store(store_url()) as store:
        flaky = FlakyStoreBundle(store)
        async with aion.open_engine(flaky, workflows=[chained], activities=[one]) as engine:
            # Appends: the start, the activity's records (one batch), the WorkflowContinuedAsNew
            # terminal; the fourth is the successor's WorkflowStarted.
            flaky.events.commit_then_fail_appends_after(3, 1)
            run = await engine.start(chained, 0, 0, workflow_id="c")
            result = None
            with trio.move_on_after(3600):  # mock time
                result = await run.result()
        kinds = [e.type for e in await store.events.read_history("c")]
    assert kinds[4:6] == ["WorkflowContinuedAsNew", "WorkflowStarted"]
    assert flaky.events.faults["append"] == 1
    assert result == 1, "no result within an hour"


async def test_a_start_whose_acknowledgement_was_lost_runs_without_being_retried(
    autojump_clock: trio.testing.MockClock, store_url: Callable[[], str]
) -> None:
    async with aion.open_store(store_url()) as store:
        flaky = FlakyStoreBundle(store)
        async with aion.open_engine(flaky, workflows=[chained], activities=[one]) as engine:
            flaky.events.commit_then_fail_next_appends(1)
            with pytest.raises(aion.BackendUnavailable):
                await engine.start(chained, 1, 0, workflow_id="w")
            kinds: list[str] = []
            with trio.move_on_after(3600):  # mock time: look once a second until the run ends
                while "WorkflowCompleted" not in kinds:
                    await trio.sleep(1)
                    kinds = [e.type for e in await store.events.read_history("w")]
    assert kinds == [
        "WorkflowStarted",
        "ActivityScheduled",
        "ActivityStarted",
        "ActivityCompleted",
        "WorkflowCompleted",
    ]


async def test_a_new_run_of_a_loaded_workflow_whose_start_lost_its_acknowledgement_is_run_and_found(
    autojump_clock: trio.testing.MockClock, store_url: Callable[[], str]
) -> None:
    async with aion.open_store(store_url()) as store:
        flaky = FlakyStoreBundle(store)
        async with aion.open_engine(flaky, workflows=[chained], activities=[one]) as engine:
            first = await engine.start(chained, 1, 0, workflow_id="w")
            assert await first.result() == 1
            flaky.events.commit_then_fail_next_appends(1)  # the second run's start lands, "fails"
            with pytest.raises(aion.BackendUnavailable):
                await engine.start(chained, 1, 1, workflow_id="w")
            run = await engine.start(chained, 1, 1, workflow_id="w", id_reuse=aion.IdReusePolicy.USE_EXISTING)
            result = None
            with trio.move_on_after(3600):  # mock time
                result = await run.result()
        history = await store.events.read_history("w")
    assert run.run_id != first.run_id
    assert [e.body.run_id for e in history if isinstance(e.body, aion.WorkflowStarted)] == [
        first.run_id,
        run.run_id,
    ]
    assert result == 2, "no result within an hour"


@aion.workflow
async def parent_of_chained(ctx: aion.WorkflowContext, n: int) -> int:
    result: int = await ctx.child(chained, n, 0, workflow_id="kid")
    return result + 100


async def test_a_child_whose_start_lost_its_acknowledgement_is_run_and_its_parent_completes(
    autojump_clock: trio.testing.MockClock, store_url: Callable[[], str]
) -> None:
    async with aion.open_store(store_url()) as store:
        flaky = FlakyStoreBundle(store)
        async with aion.open_engine(
            flaky, workflows=[parent_of_chained, chained], activities=[one]
        ) as engine:
            # Appends: the parent's start, its ChildWorkflowStarted; the third is the child's
            # WorkflowStarted, which lands and "fails".
            flaky.events.commit_then_fail_appends_after(2, 1)
            run = await engine.start(parent_of_chained, 1, workflow_id="p")
            result = None
            with trio.move_on_after(3600):  # mock time
                result = await run.result()
        kid = [e.type for e in await store.events.read_history("kid")]
    assert flaky.events.faults["append"] == 1
    assert kid.count("WorkflowStarted") == 1, kid
    assert result == 101, "no result within an hour"
