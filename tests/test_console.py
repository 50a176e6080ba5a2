"""The web console's reads, on every store kind (``store_url``): the list's keyset pages, its
filters (parsed as ``aion-trio list`` parses them) and its counts.  The pages themselves, the
token and the actions are driven in a real browser by tests/test_console_browser.py."""

from __future__ import annotations

import sys
from collections.abc import Callable
from datetime import datetime, timedelta, timezone

import pytest
import trio

import aion_trio as aion
from aion_trio._cli import cli
from aion_trio._console import BadFilter, ListQuery, list_page, workflow_page

T0 = datetime(2031, 3, 4, 10, 0, 0, tzinfo=timezone.utc)


def _rows() -> list[aion.VisibilityRow]:
    """150 rows: 60 started at the same instant (a keyset must not lose or repeat any of
    them across pages), the rest a second apart; every third one failed, region eu or us."""
    rows = []
    for n in range(150):
        start = T0 if n < 60 else T0 + timedelta(seconds=n)
        status = aion.WorkflowStatus.FAILED if n % 3 == 0 else aion.WorkflowStatus.RUNNING
        rows.append(
            aion.VisibilityRow(
                workflow_id=f"w-{n:03d}",
                run_id=f"00000000-0000-4000-8000-{n:012d}",
                workflow_type="order" if n % 2 else "refund",
                status=status,
                start_time=start,
                close_time=start + timedelta(seconds=1) if status is aion.WorkflowStatus.FAILED else None,
                search_attributes={"region": "eu" if n % 4 < 2 else "us", "amount": n},
            )
        )
    return rows


async def _pages(store: aion.Store, query: ListQuery, page_size: int) -> list[list[str]]:
    pages = []
    while True:
        page = await list_page(store, query, page_size=page_size)
        pages.append([r.workflow_id for r in page.rows])
        if page.next_cursor is None:
            return pages
        assert len(pages) < 100, "the cursor does not advance"
        params: dict[str, list[str]] = {"after": [page.next_cursor]}
        for key, value in query.params():
            params.setdefault(key, []).append(value)
        query = ListQuery.from_params(params)


@pytest.mark.parametrize(
    ("params", "matches"),
    [
        ({}, lambda r: True),
        ({"status": ["failed"]}, lambda r: r.status is aion.WorkflowStatus.FAILED),
        (
            {"type": ["order"], "attr": ["region=eu"]},
            lambda r: r.workflow_type == "order" and r.search_attributes["region"] == "eu",
        ),
        ({"attr": ["amount>40", "amount<100"]}, lambda r: 40 < r.search_attributes["amount"] < 100),
        ({"started_after": ["2031-03-04T10:01:00"]}, lambda r: r.start_time >= T0 + timedelta(minutes=1)),
    ],
)
async def test_keyset_pages_list_every_matching_row_once_newest_first(
    store_url: Callable[[], str], params: dict[str, list[str]], matches: Callable[[aion.VisibilityRow], bool]
) -> None:
    rows = _rows()
    async with aion.open_store(store_url()) as store:
        for row in rows:
            await store.visibility.upsert(row)
        query = ListQuery.from_params(params)
        pages = await _pages(store, query, page_size=25)
        expected = [r.workflow_id for r in aion.VisibilityFilter(newest_first=True).apply(rows) if matches(r)]
        assert [wid for page in pages for wid in page] == expected
        assert all(len(page) == 25 for page in pages[:-1])
        first = await list_page(store, query, page_size=25)
        assert first.total == len(expected)
        if "status" not in params:  # the counts per status: what the filters and that status select
            for status in aion.WorkflowStatus:
                counted = [r for r in rows if matches(r) and r.status is status]
                assert first.counts[status.value] == len(counted)


@pytest.mark.parametrize(
    ("params", "problem"),
    [
        ({"attr": ["region"]}, "'region' is not KEY=VALUE, KEY>VALUE, KEY<VALUE or KEY~TEXT"),
        ({"started_after": ["yesterday"]}, "'yesterday' is not an ISO-8601 time"),
        ({"status": ["sleeping"]}, "status 'sleeping' is not one of running"),
        ({"after": ["not-a-cursor"]}, "the page cursor 'not-a-cursor' is not START_TIME|WORKFLOW_ID"),
    ],
)
async def test_bad_filters_are_refused_with_the_list_commands_words(
    store_url: Callable[[], str], params: dict[str, list[str]], problem: str
) -> None:
    async with aion.open_store(store_url()) as store:
        with pytest.raises(BadFilter) as caught:
            await list_page(store, ListQuery.from_params(params))
    assert problem in str(caught.value)


def test_the_console_command_is_listed_and_has_help() -> None:
    from click.testing import CliRunner

    runner = CliRunner()
    listed = runner.invoke(cli, ["--help"])
    assert listed.exit_code == 0
    assert "console" in listed.output
    helped = runner.invoke(cli, ["console", "--help"])
    assert helped.exit_code == 0, helped.output
    assert "--read-only" in helped.output
    assert "token" in helped.output


# --------------------------------------------------------------------------
# A workflow's page: its timeline, children, parent and continue-as-new chain
# --------------------------------------------------------------------------

_attempts: list[int] = []


@aion.activity(retry=aion.RetryPolicy(max_attempts=4, backoff=aion.Fixed(delay=2)))
async def flaky(item: str) -> str:
    attempt = aion.activity_info().attempt
    _attempts.append(attempt)
    if attempt < 3:
        raise RuntimeError(f"busy {attempt}")
    return item


@aion.workflow
async def leaf(ctx: aion.WorkflowContext, item: str) -> str:
    return item.upper()


@aion.workflow
async def rounds(ctx: aion.WorkflowContext, n: int) -> str:
    if n == 0:
        await ctx.run(flaky, "book")
        await ctx.sleep(timedelta(seconds=30))
        await ctx.child(leaf, "book", workflow_id="rounds-leaf")
        await ctx.wait_signal("go")
        raise ctx.continue_as_new(1)
    return "done"


async def test_the_workflow_page_draws_each_attempt_the_timer_the_child_and_the_signal(
    store_url: Callable[[], str], autojump_clock: object
) -> None:
    _attempts.clear()
    url = store_url()
    async with aion.open_engine(url, workflows=[rounds, leaf], activities=[flaky]) as engine:
        handle = await engine.start(rounds, 0, workflow_id="rounds")
        await engine.signal("rounds", "go", {"why": "test"})  # kept until the run waits for it
        with trio.fail_after(3600):
            assert await handle.result() == "done"
    async with aion.open_store(url) as store:
        latest = await workflow_page(store, "rounds")
        runs = latest.show["run_ids"]
        assert len(runs) == 2
        assert latest.run_id == runs[1]
        assert [lane.label for lane in latest.timeline.lanes] == [f"run {runs[1][:8]}"]
        first = await workflow_page(store, "rounds", runs[0])
        assert first.run_id == runs[0]
        assert first.children == (("rounds-leaf", "leaf"),)
        lanes = {lane.label: lane for lane in first.timeline.lanes}
        assert [b.kind for b in lanes["activity:0 flaky"].bars] == ["retrying", "retrying", "completed"]
        # Each attempt is drawn from its start to its outcome, the retry's backoff between.
        bars = lanes["activity:0 flaky"].bars
        assert all(b.end is not None and b.end >= b.start for b in bars)
        assert bars[1].start - bars[0].start >= timedelta(seconds=2)
        (timer,) = (lane for label, lane in lanes.items() if label.startswith("timer "))
        assert timer.bars[0].kind == "timer"
        assert timer.bars[0].end is not None
        assert timer.bars[0].end - timer.bars[0].start == timedelta(seconds=30)
        assert lanes["child rounds-leaf (leaf)"].link == "rounds-leaf"
        assert lanes["child rounds-leaf (leaf)"].bars[0].kind == "child"
        (signal,) = lanes["signals"].bars
        assert "signal go" in signal.title
        svg = first.timeline.svg()
        assert svg.count('class="bar retrying"') == 2
        assert '<a href="/workflows/rounds-leaf">' in svg
        child = await workflow_page(store, "rounds-leaf")
        assert child.parent == "rounds"


@aion.workflow
async def tallied(ctx: aion.WorkflowContext) -> int:
    total = 0

    @ctx.update_handler("add")
    def add(amount: int) -> int:
        nonlocal total
        if amount < 0:
            raise ValueError("no refunds here")
        total += amount
        return total

    await ctx.wait_signal("close")
    return total


async def test_the_timeline_draws_each_update_from_its_acceptance_to_its_outcome(
    store_url: Callable[[], str], autojump_clock: object
) -> None:
    url = store_url()
    async with aion.open_engine(url, workflows=[tallied]) as engine:
        handle = await engine.start(tallied, workflow_id="tally")
        with trio.fail_after(60):
            assert await engine.update("tally", "add", 5) == 5
            with pytest.raises(aion.UpdateFailed):
                await engine.update("tally", "add", -1)
            await engine.signal("tally", "close")
            assert await handle.result() == 5
    async with aion.open_store(url) as store:
        page = await workflow_page(store, "tally")
    updates = [lane for lane in page.timeline.lanes if lane.label == "update add"]
    assert [[b.kind for b in lane.bars] for lane in updates] == [["update"], ["failed"]]
    assert all(b.end is not None for lane in updates for b in lane.bars)
    assert page.timeline.svg().count('class="bar update"') == 1


_declined: list[bool] = [True]


@aion.activity
async def hold(amount: int) -> int:
    return amount


@aion.activity(retry=aion.RetryPolicy(max_attempts=1))
async def debit(amount: int) -> str:
    if _declined[0]:
        raise RuntimeError("declined")
    return f"debited {amount}"


@aion.workflow
async def pay(ctx: aion.WorkflowContext, amount: int) -> str:
    return await ctx.run(debit, await ctx.run(hold, amount))


async def test_the_page_offers_the_reset_points_and_links_a_reset_run_both_ways(
    store_url: Callable[[], str], autojump_clock: object
) -> None:
    _declined[0] = True
    url = store_url()
    async with aion.open_engine(url, workflows=[pay], activities=[hold, debit]) as engine:
        handle = await engine.start(pay, 5, workflow_id="pay")
        with trio.fail_after(60), pytest.raises(aion.WorkflowFailure):
            await handle.result()
        failed = await workflow_page(engine.store, "pay")
        kinds = dict(failed.reset_points)
        assert kinds[1] == "WorkflowStarted"
        assert failed.default_reset is not None
        assert kinds[failed.default_reset] == "ActivityCompleted"  # hold's: debit runs again
        assert failed.reset_to is None
        assert failed.reset_from is None
        _declined[0] = False
        new = await engine.reset("pay", to_seq=None, reason="fixed")
        with trio.fail_after(60):
            assert await new.result() == "debited 5"
        latest = await workflow_page(engine.store, "pay")
        assert latest.run_id == new.run_id
        assert latest.reset_from == (failed.run_id, failed.default_reset)
        old = await workflow_page(engine.store, "pay", failed.run_id)
        assert old.reset_to == (new.run_id, failed.default_reset)
        assert old.reset_from is None


def test_without_its_extra_the_console_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    # As if hypercorn were not installed: the command is listed, and running it names the extra.
    monkeypatch.setitem(sys.modules, "hypercorn", None)
    monkeypatch.setitem(sys.modules, "hypercorn.trio", None)
    for name in ("aion_trio._console.server", "aion_trio._console.web"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    result = CliRunner().invoke(cli, ["console", "--store", "memory://nothing"])
    assert result.exit_code == 2, result.output
    assert (
        "the console needs its extra (hypercorn is missing): pip install 'aion-trio[console]'"
        in result.output
    )
