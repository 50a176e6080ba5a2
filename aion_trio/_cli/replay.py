"""``aion-trio replay``: recorded histories replayed against the current code (a CI check).

Exit status 0 when every run matches, 1 when a run diverged or could not be
replayed (an unknown workflow type), 2 for a usage problem (no histories, an
unreadable file, a bad filter).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import click

from .._errors import InvalidHistory, InvalidQuery
from .._store import VisibilityFilter
from .._urls import redact_url
from .errors import UsageProblem, run
from .options import DEFAULT_LIST_LIMIT, filter_options, module_option, store_url, visibility_filter
from .stores import open_for_reading
from .userapp import App, load_app

if TYPE_CHECKING:
    # Imported when the command runs: aion_trio.testing imports trio.testing (and so
    # pytest), which every other command would pay for.
    from ..testing import History, ReplayReport, ReplayResult

EXIT_DIVERGED = 1


@click.command()
@click.argument("paths", nargs=-1, metavar="[FILE_OR_DIR]...")
@module_option
@click.option(
    "--store",
    "store",
    metavar="URL",
    help="Replay the histories of this store's workflows that match the filters below, instead of files.",
)
@click.option(
    "--active",
    is_flag=True,
    help="With --store: replay every active workflow of the store (the runs the next engine resumes), "
    "with no row limit; the pre-deploy check. Not with the filters below.",
)
@filter_options
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of objects, one per run.")
def replay(
    paths: tuple[str, ...],
    module: str,
    store: str | None,
    active: bool,
    statuses: tuple[str, ...],
    workflow_type: str | None,
    task_queue: str | None,
    started_after: str | None,
    started_before: str | None,
    closed_after: str | None,
    closed_before: str | None,
    attrs_: tuple[str, ...],
    limit: int,
    offset: int,
    as_json: bool,
) -> None:
    """Replay recorded histories against the workflows of MODULE:ATTR; report each run.

    Histories are files of JSON lines as 'aion-trio history ID --json' prints them
    (several workflows may follow one another in a file), directories of such files
    (*.jsonl, *.json), or, with --store, the workflows of a store that match the
    filters (as for 'aion-trio list'). Each run replays without running anything; it
    matches, or diverges at an event (its seq, what history holds, what the code did).

    With --store URL --active, every workflow the store lists as active (the ones an
    engine opening on it resumes), however many: run it with the new code before a
    deploy. An engine opening with lazy recovery (the default) checks a sleeping run
    against its history only when the run wakes; this checks them all now, and
    changes nothing in the store.

    \b
    Exit status: 0 every run matches; 1 a run diverged or could not be replayed
    (e.g. its workflow type is not in MODULE:ATTR); 2 a usage problem.
    \b
    Examples:
      aion-trio history order-7 --json > histories/order-7.jsonl
      aion-trio replay histories/ -m shop.workflows:app
      aion-trio replay --store sqlite:///prod-copy.db --status running -m shop.workflows:app
      aion-trio replay --store sqlite:///prod.db --active -m shop.workflows:app
    """
    if active and store is None:
        raise UsageProblem("--active replays the active workflows of a store: give --store URL")
    filtered = bool(
        statuses
        or workflow_type
        or task_queue
        or started_after
        or started_before
        or closed_after
        or closed_before
        or attrs_
        or offset
        or limit != DEFAULT_LIST_LIMIT
    )
    if active and filtered:
        raise UsageProblem("--active replays every active workflow: leave out the filters")
    if paths and store is not None:
        raise UsageProblem("give history files or directories, or --store URL, not both")
    if not paths and store is None:
        raise UsageProblem("give history files or directories, or --store URL (with filters) to replay from")
    from ..testing import read_histories

    app = load_app(module)
    if store is None:
        try:
            histories = [history for path in paths for history in read_histories(path)]
        except InvalidHistory as exc:
            raise UsageProblem(str(exc)) from None
        report = run("", lambda: _replay(app, histories))
    elif active:
        url = store_url(store)
        report = run(url, lambda: _replay_active(app, url))
    else:
        url = store_url(store)
        try:
            page = visibility_filter(
                statuses=statuses,
                workflow_type=workflow_type,
                task_queue=task_queue,
                started_after=started_after,
                started_before=started_before,
                closed_after=closed_after,
                closed_before=closed_before,
                attrs_=attrs_,
                limit=limit,
                offset=offset,
            )
        except InvalidQuery as exc:
            raise UsageProblem(f"bad filter: {exc}") from None
        report = run(url, lambda: _replay_store(app, url, page))
    if as_json:
        click.echo(json.dumps([_result_json(r) for r in report.results], indent=2, ensure_ascii=False))
    else:
        for result in report.results:
            click.echo(result.describe())
        counts = {v: sum(1 for r in report.results if r.verdict == v) for v in ("match", "diverged", "error")}
        click.echo(
            f"{len(report.results)} run{'' if len(report.results) == 1 else 's'} replayed: "
            f"{counts['match']} match, {counts['diverged']} diverged, {counts['error']} could not be replayed"
        )
    if not report.ok:
        raise SystemExit(EXIT_DIVERGED)


async def _replay(app: App, histories: list[History]) -> ReplayReport:
    from ..testing import History, replay

    chain = app.codecs
    if chain is not None:
        # Histories exported without the codec hold its envelopes: decode them first.
        decoded = []
        for history in histories:  # not a nested comprehension: Python 3.10 refuses an await there
            decoded.append(History(history.source, [await chain.decode_event(e) for e in history.events]))
        histories = decoded
    return await replay(app.workflows, histories, activities=app.activities)


async def _replay_store(app: App, url: str, page: VisibilityFilter) -> ReplayReport:
    from ..testing import History

    async with open_for_reading(url, app.codecs) as opened:
        rows = await opened.visibility.list(page)
        histories = [
            History(
                f"{redact_url(url)} ({row.workflow_id})", await opened.events.read_history(row.workflow_id)
            )
            for row in rows
        ]
    return await _replay(app, [h for h in histories if h.events])


async def _replay_active(app: App, url: str) -> ReplayReport:
    from ..testing import History

    async with open_for_reading(url, app.codecs) as opened:
        workflow_ids = sorted(await opened.events.list_active())
        histories = [
            History(f"{redact_url(url)} ({workflow_id})", await opened.events.read_history(workflow_id))
            for workflow_id in workflow_ids
        ]
    return await _replay(app, [h for h in histories if h.events])


def _result_json(result: ReplayResult) -> dict[str, Any]:
    return {
        "source": result.source,
        "workflow_id": result.workflow_id,
        "run_id": result.run_id,
        "workflow_type": result.workflow_type,
        "complete": result.complete,
        "verdict": result.verdict,
        "seq": result.seq,
        "expected": result.expected,
        "got": result.got,
        "error": None if result.error is None else str(result.error),
    }
