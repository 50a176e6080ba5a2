"""The replayer (``aion_trio.testing.replay`` and ``aion-trio replay``): recorded histories
replayed against the current code, a match or the first divergence per run.

Ported from the behaviour of Temporal's replayer tests: a finished, a failed and a
still-running history of unchanged code match; a changed activity or a changed order
diverges, naming the event; a history of a workflow type the code lacks is an error;
several histories are all replayed and each reported.  The divergence is the very
``NonDeterminismError`` the engine marks the run stuck with (one replay mechanism).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from _clirunner import cli_runner
from click.testing import Result
from procs import replay_app
from procs.replay_app import (
    charge,
    checkout_patched,
    checkout_renamed,
    checkout_reordered,
    checkout_v1,
    other,
    refund,
    ship,
)

import aion_trio as aion
from aion_trio import _cli
from aion_trio.plugin import event_to_json
from aion_trio.testing import ReplayReport, replay

ACTIVITIES = [charge, refund, ship]
APP = "tests.procs.replay_app"


async def record(workflow_id: str, order: int, *, approve: bool, url: str = "memory://") -> list[aion.Event]:
    """Run ``checkout`` (v1) with ``order``; approve it or leave it waiting; its history."""
    async with aion.open_engine(url, workflows=[checkout_v1], activities=ACTIVITIES) as engine:
        await engine.start(checkout_v1, order, workflow_id=workflow_id)
        with trio.fail_after(60):
            await trio.testing.wait_all_tasks_blocked()
            if approve:
                await engine.signal(workflow_id, "approve")
            if approve or order < 0:
                with pytest.raises(aion.WorkflowFailure) if order < 0 else _nothing():
                    await engine.result(workflow_id)
            else:
                await trio.testing.wait_all_tasks_blocked()
        return await engine.history(workflow_id)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def write_jsonl(path: Path, *histories: list[aion.Event]) -> Path:
    path.write_text("".join(event_to_json(e) + "\n" for h in histories for e in h), encoding="utf-8")
    return path


def seq_of(history: list[aion.Event], kind: type[aion.EventBody], nth: int = 0) -> int:
    return [e.seq for e in history if isinstance(e.body, kind)][nth]


# --------------------------------------------------------------------------
# The API
# --------------------------------------------------------------------------


async def test_a_finished_history_of_unchanged_code_matches(autojump_clock: trio.abc.Clock) -> None:
    history = await record("done", 7, approve=True)
    report = await replay([checkout_v1], [history])
    [result] = report.results
    assert (result.verdict, result.complete, result.workflow_id, result.workflow_type) == (
        "match",
        True,
        "done",
        "checkout",
    )
    assert report.ok
    report.check()  # nothing to raise


async def test_a_failed_history_matches(autojump_clock: trio.abc.Clock) -> None:
    history = await record("failed", -1, approve=False)
    assert isinstance(history[-1].body, aion.WorkflowFailed)
    report = await replay([checkout_v1], history)  # one history, given as its events
    assert [r.verdict for r in report.results] == ["match"]


async def test_a_running_history_replays_up_to_its_end(autojump_clock: trio.abc.Clock) -> None:
    history = await record("waiting", 7, approve=False)
    assert not isinstance(history[-1].body, aion.WorkflowCompleted)
    [result] = (await replay([checkout_v1], [history])).results
    assert (result.verdict, result.complete) == ("match", False)
    # The code past the history's end would go live: the later change is invisible here.
    assert (await replay([checkout_patched], [history])).ok


async def test_a_changed_activity_diverges_naming_the_event(autojump_clock: trio.abc.Clock) -> None:
    history = await record("renamed", 7, approve=True)
    [result] = (await replay([checkout_renamed], [history])).results
    assert result.verdict == "diverged"
    assert isinstance(result.error, aion.NonDeterminismError)
    assert result.seq == seq_of(history, aion.ActivityScheduled)
    assert result.expected == "activity 'charge'"
    assert result.got == "activity 'refund'"
    assert (
        f"at seq {result.seq}: history has activity 'charge', the code activity 'refund'" in result.describe()
    )


async def test_a_changed_order_diverges_at_the_first_difference(autojump_clock: trio.abc.Clock) -> None:
    history = await record("reordered", 7, approve=True)
    [result] = (await replay([checkout_reordered], [history])).results
    assert result.diverged
    # The first recorded command is the charge; the code now waits for the signal, then ships.
    assert (result.seq, result.expected, result.got) == (
        seq_of(history, aion.ActivityScheduled),
        "activity 'charge'",
        "activity 'ship'",
    )


async def test_a_step_past_a_finished_history_diverges_at_its_end(autojump_clock: trio.abc.Clock) -> None:
    @aion.workflow(name="checkout")
    async def one_more_step(ctx: aion.WorkflowContext, order: int) -> str:
        result: str = await checkout_v1.fn(ctx, order)
        await ctx.run(refund, order)
        return result

    history = await record("longer", 7, approve=True)
    # ctx.patched() on a finished history takes the old path: that change matches.
    assert (await replay([checkout_patched], [history])).ok
    [result] = (await replay([one_more_step], [history])).results
    assert result.diverged
    assert (result.seq, result.expected, result.got) == (
        history[-1].seq,
        "the run's end (WorkflowCompleted)",
        "activity 'refund'",
    )


async def test_code_that_ends_early_diverges_at_the_command_it_never_issued(
    autojump_clock: trio.abc.Clock,
) -> None:
    @aion.workflow(name="checkout")
    async def gives_up(ctx: aion.WorkflowContext, order: int) -> str:
        receipt: str = await ctx.run(charge, order)
        return receipt

    history = await record("early", 7, approve=True)
    [result] = (await replay([gives_up], [history])).results
    assert result.diverged
    assert (result.seq, result.expected, result.got) == (
        seq_of(history, aion.ActivityScheduled, 1),
        "activity 'ship'",
        "the workflow to return",
    )


async def test_a_history_of_an_unknown_workflow_type_is_an_error(autojump_clock: trio.abc.Clock) -> None:
    history = await record("stranger", 7, approve=True)
    [result] = (await replay([other], [history])).results
    assert result.verdict == "error"
    assert isinstance(result.error, aion.UnknownWorkflowType)
    assert "'checkout' is not registered" in result.describe()


async def test_every_history_is_replayed_and_reported(autojump_clock: trio.abc.Clock) -> None:
    first = await record("a", 1, approve=True)
    second = await record("b", 2, approve=False)
    report = await replay([checkout_renamed], [first, second])
    assert [(r.workflow_id, r.verdict) for r in report.results] == [("a", "diverged"), ("b", "diverged")]
    assert not report.ok
    assert len(report.failures) == 2
    with pytest.raises(aion.NonDeterminismError) as raised:
        report.check()
    assert raised.value is report.results[0].error


async def _poll(check: Callable[[], Any]) -> Any:
    """Real time, for every store kind (a server's I/O is not a blocked task): poll, bounded."""
    with trio.fail_after(60):
        while True:
            found = await check()
            if found:
                return found
            await trio.sleep(0.005)


async def test_the_divergence_is_the_error_the_engine_marks_the_run_stuck_with(
    store_url: Callable[[], str],
) -> None:
    url = store_url()
    async with aion.open_engine(url, workflows=[checkout_v1], activities=ACTIVITIES) as engine:
        await engine.start(checkout_v1, 7, workflow_id="same")

        async def charged() -> list[aion.Event] | None:
            history = await engine.history("same")
            return history if any(isinstance(e.body, aion.ActivityCompleted) for e in history) else None

        history = await _poll(charged)  # charged, now waiting for the approval
    [result] = (await replay([checkout_renamed], [history])).results
    assert result.diverged
    # The engine, given the changed code, replays the run on recovery and marks it stuck.
    async with aion.open_engine(url, workflows=[checkout_renamed], activities=ACTIVITIES) as engine:

        async def stuck() -> str | None:
            return (await engine.describe("same")).stuck_reason

        assert await _poll(stuck) == str(result.error)


async def test_terminated_and_timed_out_runs_replay_up_to_where_they_were_stopped(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with aion.open_engine("memory://", workflows=[checkout_v1], activities=ACTIVITIES) as engine:
        await engine.start(checkout_v1, 1, workflow_id="ended")
        await engine.start(checkout_v1, 2, workflow_id="late", timeout=60)
        with trio.fail_after(3600):
            await trio.testing.wait_all_tasks_blocked()
            await engine.terminate("ended", reason="enough")
            with pytest.raises(aion.WorkflowFailure):
                await engine.result("late")
        histories = [await engine.history("ended"), await engine.history("late")]
    assert any(isinstance(e.body, aion.events.WorkflowCancelled) and e.body.terminated for e in histories[0])
    assert any(isinstance(e.body, aion.WorkflowTimedOut) for e in histories[1])
    report = await replay([checkout_v1], histories)
    assert [(r.verdict, r.complete) for r in report.results] == [("match", True), ("match", True)]
    assert not (await replay([checkout_renamed], histories)).ok


async def test_every_run_of_a_continued_history_is_replayed(autojump_clock: trio.abc.Clock) -> None:
    @aion.workflow(name="loop")
    async def loop(ctx: aion.WorkflowContext, n: int) -> int:
        await ctx.run(charge, n)
        if n < 2:
            raise ctx.continue_as_new(n + 1)
        return n

    @aion.workflow(name="loop")
    async def loop_changed(ctx: aion.WorkflowContext, n: int) -> int:
        await ctx.run(charge if n < 2 else ship, n)
        if n < 2:
            raise ctx.continue_as_new(n + 1)
        return n

    async with aion.open_engine("memory://", workflows=[loop], activities=ACTIVITIES) as engine:
        await engine.start(loop, 0, workflow_id="chain")
        with trio.fail_after(60):
            assert await engine.result("chain") == 2
        history = await engine.history("chain")
    report = await replay([loop], [history])
    assert [r.verdict for r in report.results] == ["match"] * 3
    changed = await replay([loop_changed], [history])
    assert [r.verdict for r in changed.results] == ["match", "match", "diverged"]


async def test_histories_are_read_from_files_and_directories(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    first = await record("f1", 1, approve=True)
    second = await record("f2", 2, approve=False)
    write_jsonl(tmp_path / "f1.jsonl", first)
    (tmp_path / "more").mkdir()
    write_jsonl(tmp_path / "more" / "f2.json", second)
    (tmp_path / "notes.txt").write_text("not a history", encoding="utf-8")
    report = await replay([checkout_v1], tmp_path)
    assert [(r.workflow_id, r.source, r.verdict) for r in report.results] == [
        ("f1", str(tmp_path / "f1.jsonl"), "match"),
        ("f2", str(tmp_path / "more" / "f2.json"), "match"),
    ]
    both = write_jsonl(tmp_path / "both.jsonl", first, second)  # two workflows in one file
    report = await replay([checkout_v1], [str(both)])
    assert [r.workflow_id for r in report.results] == ["f1", "f2"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json\n", "both.jsonl:1: not an event as 'aion-trio history ID --json' prints them"),
        ("", "the file holds no events"),
        ("GAP", "expected seq 2, found 3; a replay needs the whole history"),
    ],
)
async def test_a_history_that_cannot_be_replayed_is_a_typed_error(
    autojump_clock: trio.abc.Clock, tmp_path: Path, content: str, message: str
) -> None:
    if content == "GAP":
        history = await record("gap", 1, approve=True)
        content = "".join(event_to_json(e) + "\n" for e in history if e.seq != 2)
    path = tmp_path / "both.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(aion.InvalidHistory, match=message):
        await replay([checkout_v1], path)


# --------------------------------------------------------------------------
# aion-trio replay
# --------------------------------------------------------------------------


def run_cli(*args: str) -> Result:
    return cli_runner().invoke(_cli.cli, list(args), prog_name="aion-trio")


async def _two_files(tmp_path: Path) -> list[str]:
    done = write_jsonl(tmp_path / "done.jsonl", await record("done", 7, approve=True))
    waiting = write_jsonl(tmp_path / "waiting.jsonl", await record("waiting", 8, approve=False))
    return [str(done), str(waiting)]


async def test_cli_replay_exits_0_when_every_run_matches(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    files = await _two_files(tmp_path)
    result = await trio.to_thread.run_sync(run_cli, "replay", *files, "-m", f"{APP}:v1")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith("match: 'done' run ")
    assert lines[1].startswith("match: 'waiting' run ")
    assert "still running" in lines[1]
    assert lines[-1] == "2 runs replayed: 2 match, 0 diverged, 0 could not be replayed"


async def test_cli_replay_exits_1_and_names_the_divergence(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    files = await _two_files(tmp_path)
    result = await trio.to_thread.run_sync(run_cli, "replay", *files, "-m", f"{APP}:renamed", "--json")
    assert result.exit_code == 1, result.output
    rows = json.loads(result.stdout)
    assert [(r["workflow_id"], r["verdict"], r["seq"], r["expected"], r["got"]) for r in rows] == [
        ("done", "diverged", 2, "activity 'charge'", "activity 'refund'"),
        ("waiting", "diverged", 2, "activity 'charge'", "activity 'refund'"),
    ]
    assert "non-determinism in workflow 'done'" in rows[0]["error"]


async def test_cli_replay_of_an_unknown_type_exits_1(autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    files = await _two_files(tmp_path)
    result = await trio.to_thread.run_sync(run_cli, "replay", files[0], "-m", f"{APP}:unrelated")
    assert result.exit_code == 1, result.output
    assert result.stdout.splitlines()[0].startswith("error: 'done' run ")
    assert "UnknownWorkflowType" in result.stdout


async def test_cli_replays_straight_from_a_store_with_a_filter(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path}/prod.db"
    await record("s1", 1, approve=True, url=url)
    await record("s2", 2, approve=False, url=url)
    matched = await trio.to_thread.run_sync(
        run_cli, "replay", "--store", url, "--status", "running", "-m", f"{APP}:v1"
    )
    assert matched.exit_code == 0, matched.output
    assert [line.split(" run ")[0] for line in matched.stdout.splitlines()[:-1]] == ["match: 's2'"]
    diverged = await trio.to_thread.run_sync(run_cli, "replay", "--store", url, "-m", f"{APP}:renamed")
    assert diverged.exit_code == 1, diverged.output
    assert diverged.stdout.splitlines()[-1] == "2 runs replayed: 0 match, 2 diverged, 0 could not be replayed"


async def test_cli_replays_every_active_workflow_of_a_store(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    """``--active``: the runs the next engine resumes (the pre-deploy check of lazy recovery),
    not the closed ones, and the store is left as it was."""
    url = f"sqlite:///{tmp_path}/prod.db"
    await record("closed", 1, approve=True, url=url)
    await record("open-a", 2, approve=False, url=url)
    await record("open-b", 3, approve=False, url=url)
    before = (tmp_path / "prod.db").read_bytes()
    matched = await trio.to_thread.run_sync(run_cli, "replay", "--store", url, "--active", "-m", f"{APP}:v1")
    assert matched.exit_code == 0, matched.output
    assert [line.split(" run ")[0] for line in matched.stdout.splitlines()[:-1]] == [
        "match: 'open-a'",
        "match: 'open-b'",
    ]
    diverged = await trio.to_thread.run_sync(
        run_cli, "replay", "--store", url, "--active", "-m", f"{APP}:renamed", "--json"
    )
    assert diverged.exit_code == 1, diverged.output
    assert [(r["workflow_id"], r["verdict"]) for r in json.loads(diverged.stdout)] == [
        ("open-a", "diverged"),
        ("open-b", "diverged"),
    ]
    assert (tmp_path / "prod.db").read_bytes() == before


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--active",), "--active replays the active workflows of a store: give --store URL"),
        (
            ("--store", "memory://", "--active", "--status", "running"),
            "--active replays every active workflow: leave out the filters",
        ),
        ((), "give history files or directories, or --store URL"),
        (("x.jsonl", "--store", "memory://"), "give history files or directories, or --store URL, not both"),
        (("missing.jsonl",), "missing.jsonl: cannot read it"),
    ],
)
def test_cli_replay_usage_problems_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: tuple[str, ...], message: str
) -> None:
    monkeypatch.chdir(tmp_path)
    result = run_cli("replay", *args, "-m", f"{APP}:v1")
    assert result.exit_code == 2, result.output
    [line] = [line for line in result.stderr.splitlines() if line.strip()]
    assert line.startswith("Error: "), line
    assert message in line, line


def test_report_types_are_public() -> None:
    assert ReplayReport.__module__ == "aion_trio.testing"
    assert replay.__module__ == "aion_trio.testing"
    _: Any = replay_app


async def test_a_reopened_run_replays_to_its_recorded_end(autojump_clock: trio.abc.Clock) -> None:
    failures_left = [1]

    @aion.activity(retry=aion.RetryPolicy(max_attempts=1))
    async def flaky(order: int) -> str:
        if failures_left[0]:
            failures_left[0] -= 1
            raise ConnectionError("down")
        return f"charged {order}"

    @aion.workflow(name="reopened")
    async def reopened(ctx: aion.WorkflowContext, order: int) -> str:
        result: str = await ctx.run(flaky, order)
        return result

    async with aion.open_engine("memory://", workflows=[reopened], activities=[flaky]) as engine:
        run = await engine.start(reopened, 7, workflow_id="again")
        with trio.fail_after(60):
            with pytest.raises(aion.WorkflowFailure):
                await run.result()
            assert await (await engine.reopen("again")).result() == "charged 7"
        history = await engine.history("again")
    assert any(isinstance(e.body, aion.WorkflowReopened) for e in history)
    [result] = (await replay([reopened], [history])).results
    assert (result.verdict, result.complete) == ("match", True)


async def test_a_cancelled_run_replays_to_its_recorded_end(autojump_clock: trio.abc.Clock) -> None:
    async with aion.open_engine("memory://", workflows=[checkout_v1], activities=ACTIVITIES) as engine:
        run = await engine.start(checkout_v1, 7, workflow_id="cancelled")
        with trio.fail_after(60):
            await trio.testing.wait_all_tasks_blocked()
            await engine.cancel("cancelled", reason="changed my mind")
            with pytest.raises(aion.WorkflowFailure):
                await run.result()
        history = await engine.history("cancelled")
    assert isinstance(history[-1].body, aion.events.WorkflowCancelled)
    assert (await replay([checkout_v1], [history])).results[0].verdict == "match"
    [changed] = (await replay([checkout_reordered], [history])).results
    assert changed.diverged
