"""Bad input gets a typed error and writes nothing (docs/errors.md).

One table of bad requests over the public API, and one over the CLI.  Each
case runs against a store that already holds work (a completed workflow and
one waiting for a signal); the store's whole content -- every history, every
visibility row, the due-timer index and the command inbox -- is snapshotted
before and after, and must not have changed.  Runs on the store selected by
``AION_TRIO_TEST_STORE`` (the CLI cases on SQLite, the CLI's default).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import trio
from _clirunner import cli_runner

import aion_trio as aion
from aion_trio import _cli
from aion_trio.plugin import CommandInbox, Store

ROOT = Path(__file__).resolve().parent.parent
FAR_FUTURE = datetime(9000, 1, 1, tzinfo=timezone.utc)


@aion.activity
async def shout(text: str) -> str:
    return text.upper()


@aion.workflow
async def greet(ctx: aion.WorkflowContext, name: str, punctuation: str = "!") -> str:
    return f"hello {name}{punctuation}"


@aion.workflow
async def waiter(ctx: aion.WorkflowContext) -> object:
    return await ctx.wait_signal("go")


WORKFLOWS = [greet, waiter]


async def snapshot(store: Store) -> dict[str, Any]:
    """Everything the store holds that a request could have written."""
    events = store.events
    ids = sorted(await events.list_workflow_ids())
    histories = {wid: await events.read_history(wid) for wid in ids}
    rows = await store.visibility.list(aion.VisibilityFilter())
    timers = sorted(await events.expired_timers(FAR_FUTURE), key=repr)
    inbox = await store.pending_commands(limit=1000) if isinstance(store, CommandInbox) else None
    return {"histories": histories, "visibility": rows, "timers": timers, "inbox": inbox}


async def _seed(engine: aion.Engine) -> None:
    await (await engine.start(greet, "ann", workflow_id="done")).result()
    await engine.start(waiter, workflow_id="waiting", search_attributes={"tier": "gold"})
    await settled(engine)


async def settled(engine: aion.Engine) -> None:
    """Wait until the completed run's row says so: its bookkeeping runs after ``result()`` returns."""
    with trio.fail_after(10):
        # A thread-backed store's write: no event to wait on.
        while await engine.count(status=aion.WorkflowStatus.COMPLETED) != 1:  # noqa: ASYNC110
            await trio.sleep(0.01)


Request = Callable[[aion.Engine], Awaitable[object]]


async def _open_with(**kwargs: Any) -> None:
    async with aion.open_engine("memory://", **kwargs):
        pass  # pragma: no cover - refused before the block


async def _open_store(url: str) -> None:
    async with aion.open_store(url):
        pass  # pragma: no cover - refused before the block


def _sync(fn: Callable[[], object]) -> Request:
    async def call(engine: aion.Engine) -> object:
        return fn()

    return call


# (id, request, expected error, what the message must say)
API_CASES: list[tuple[str, Request, type[BaseException], str]] = [
    (
        "start without an argument",
        lambda e: e.start(greet),
        aion.InvalidArguments,
        "missing the argument 'name'",
    ),
    (
        "start with too many arguments",
        lambda e: e.start(greet, "a", "!", 3),
        aion.InvalidArguments,
        "1 more than",
    ),
    ("start by name without an argument", lambda e: e.start("greet"), aion.InvalidArguments, "'name'"),
    (
        "lone surrogate workflow id",
        lambda e: e.start(greet, "a", workflow_id="x\ud800"),
        ValueError,
        "surrogate",
    ),
    (
        "lone surrogate argument",
        lambda e: e.start(greet, "a\udc80"),
        aion.PayloadNotSerializable,
        "surrogate",
    ),
    ("huge int argument", lambda e: e.start(greet, 10**5000), aion.PayloadNotSerializable, "too large"),
    ("timeout 1e300", lambda e: e.start(greet, "a", timeout=1e300), ValueError, "100 years"),
    ("timeout timedelta.max", lambda e: e.start(greet, "a", timeout=timedelta.max), ValueError, "100 years"),
    ("timeout as a str", lambda e: e.start(greet, "a", timeout="5"), TypeError, "timeout must be a duration"),
    ("huge int timeout", lambda e: e.start(greet, "a", timeout=10**400), ValueError, "finite"),
    (
        "search attributes as a list",
        lambda e: e.start(greet, "a", search_attributes=["x"]),
        TypeError,
        "mapping",
    ),
    (
        "lone surrogate search attribute",
        lambda e: e.start(greet, "a", search_attributes={"k": "\ud800"}),
        ValueError,
        "surrogate",
    ),
    ("empty task queue", lambda e: e.start(greet, "a", task_queue=""), ValueError, "task_queue"),
    ("blank task queue", lambda e: e.start(greet, "a", task_queue="  "), ValueError, "task_queue"),
    ("id reuse as a str", lambda e: e.start(greet, "a", id_reuse="use_existing"), TypeError, "IdReusePolicy"),
    ("unknown status filter", lambda e: e.list(status="runnin"), aion.InvalidQuery, "'running'"),
    ("status filter of ints", lambda e: e.list(status=[1]), aion.InvalidQuery, "WorkflowStatus"),
    (
        "signal a huge int",
        lambda e: e.signal("waiting", "go", 10**5000),
        aion.PayloadNotSerializable,
        "too large",
    ),
    ("signal with an empty name", lambda e: e.signal("waiting", ""), ValueError, "signal name"),
    ("lone surrogate signal name", lambda e: e.signal("waiting", "go\udc80"), ValueError, "surrogate"),
    ("signal a lone surrogate id", lambda e: e.signal("w\ud800", "go"), ValueError, "surrogate"),
    ("lone surrogate cancel reason", lambda e: e.cancel("waiting", "why\ud800"), ValueError, "surrogate"),
    ("lone surrogate terminate reason", lambda e: e.terminate("waiting", "\ud800"), ValueError, "surrogate"),
    ("describe a lone surrogate id", lambda e: e.describe("\ud800"), ValueError, "surrogate"),
    ("open_engine(config=5)", lambda e: _open_with(config=5), TypeError, "EngineConfig"),
    ("open_engine(store=5)", lambda e: aion.open_engine(5).__aenter__(), TypeError, "URL"),  # type: ignore[arg-type]
    ("sqlite:///%ff", lambda e: _open_store("sqlite:///%ff"), aion.InvalidStoreUrl, "UTF-8"),
    ("@activity(5)", _sync(lambda: aion.activity(5)), TypeError, "decorates a function"),  # type: ignore[call-overload]
    ("@activity(name='')", _sync(lambda: aion.activity(name="")(lambda: 1)), ValueError, "non-empty"),
    ("@workflow(name='')", _sync(lambda: aion.workflow(name="")(waiter.fn)), ValueError, "non-empty"),
    ("@workflow(5)", _sync(lambda: aion.workflow(5)), TypeError, "async def"),  # type: ignore[call-overload]
    (
        "EngineConfig(drain_timeout='5')",
        _sync(lambda: aion.EngineConfig(drain_timeout="5")),  # type: ignore[arg-type]
        ValueError,
        "drain_timeout must be a number",
    ),
    ("EngineConfig(codec=5)", _sync(lambda: aion.EngineConfig(codec=5)), TypeError, "PayloadCodec"),  # type: ignore[arg-type]
    (
        "EngineConfig(owner_heartbeat=True)",
        _sync(lambda: aion.EngineConfig(owner_heartbeat=True)),
        ValueError,
        "owner_heartbeat",
    ),
    (
        "EngineConfig(default_task_queue='')",
        _sync(lambda: aion.EngineConfig(default_task_queue="")),
        ValueError,
        "task_queue",
    ),
    ("EngineConfig(clock=5)", _sync(lambda: aion.EngineConfig(clock=5)), TypeError, "EngineClock"),  # type: ignore[arg-type]
    (
        "activity timeout timedelta.max",
        _sync(lambda: aion.activity(timeout=timedelta.max)(shout.fn)),
        ValueError,
        "100 years",
    ),
    ("activity timeout as a str", _sync(lambda: aion.activity(timeout="1")(shout.fn)), TypeError, "timeout"),  # type: ignore[call-overload]
    ("backoff of 1e300", _sync(lambda: aion.Fixed(1e300)), ValueError, "100 years"),
]


@pytest.mark.parametrize(
    ("request_", "error", "says"), [c[1:] for c in API_CASES], ids=[c[0] for c in API_CASES]
)
async def test_a_bad_request_is_refused_with_a_typed_error_and_writes_nothing(
    store_url: Callable[[], str], request_: Request, error: type[BaseException], says: str
) -> None:
    async with aion.open_engine(store_url(), workflows=WORKFLOWS, activities=[shout]) as engine:
        await _seed(engine)
        before = await snapshot(engine.store)
        with pytest.raises(error, match=says) as caught:
            with trio.fail_after(5):
                await request_(engine)
        assert not isinstance(caught.value, (AttributeError, OverflowError, UnicodeError))
        assert await snapshot(engine.store) == before
        # The engine is unharmed: the waiting run still takes its signal.
        await engine.signal("waiting", "go", 1)
        assert await engine.result("waiting") == 1


def test_invalid_arguments_names_the_parameter() -> None:
    with pytest.raises(aion.InvalidArguments) as caught:
        greet.check_arguments([])
    assert (caught.value.kind, caught.value.name, caught.value.parameter) == ("workflow", "greet", "name")
    assert caught.value.signature == "(name, punctuation='!')"
    assert isinstance(caught.value, TypeError)
    with pytest.raises(aion.InvalidArguments) as extra:
        shout.check_arguments(["a", "b"])
    assert extra.value.parameter is None
    assert extra.value.kind == "activity"
    greet.check_arguments(["a"])
    greet.check_arguments(["a", "?"])


async def test_a_status_filter_takes_the_status_name(store_url: Callable[[], str]) -> None:
    async with aion.open_engine(store_url(), workflows=WORKFLOWS) as engine:
        await _seed(engine)
        assert [r.workflow_id for r in await engine.list(status="running")] == ["waiting"]
        assert [
            r.workflow_id for r in await engine.list(status=["completed", aion.WorkflowStatus.RUNNING])
        ] == [
            "done",
            "waiting",
        ]
        assert await engine.count(status="COMPLETED") == 1
        await engine.signal("waiting", "go")


# --------------------------------------------------------------------------
# Inside workflow code: the command is refused where it is issued, nothing of it
# is recorded, and the run fails with the error (as on any exception).
# --------------------------------------------------------------------------


@aion.workflow
async def sleeps_a_str(ctx: aion.WorkflowContext) -> None:
    await ctx.sleep("0.1")  # type: ignore[arg-type]


@aion.workflow
async def sleeps_forever(ctx: aion.WorkflowContext) -> None:
    await ctx.sleep(timedelta.max)


@aion.workflow
async def calls_without_argument(ctx: aion.WorkflowContext) -> str:
    return await ctx.run(shout)


@aion.workflow
async def starts_child_without_argument(ctx: aion.WorkflowContext) -> str:
    return await ctx.child(greet)


@aion.workflow
async def continues_without_argument(ctx: aion.WorkflowContext, n: int) -> int:
    if n:
        raise ctx.continue_as_new()
    return n


COMMAND_CASES = [
    (sleeps_a_str, (), "TypeError", "sleep duration must be a duration"),
    (sleeps_forever, (), "ValueError", "100 years"),
    (
        calls_without_argument,
        (),
        "InvalidArguments",
        "activity 'shout' takes (text): missing the argument 'text'",
    ),
    (starts_child_without_argument, (), "InvalidArguments", "child workflow 'greet'"),
    (continues_without_argument, (1,), "InvalidArguments", "continue-as-new of workflow"),
]


@pytest.mark.parametrize(
    ("workflow", "args", "error_type", "says"), COMMAND_CASES, ids=[c[0].name for c in COMMAND_CASES]
)
async def test_a_bad_command_fails_the_run_and_records_nothing_of_it(
    store_url: Callable[[], str],
    workflow: aion.WorkflowDefinition[Any],
    args: tuple[object, ...],
    error_type: str,
    says: str,
) -> None:
    async with aion.open_engine(store_url(), workflows=[*WORKFLOWS, workflow], activities=[shout]) as engine:
        run = await engine.start(workflow, *args, workflow_id="bad")
        with trio.fail_after(5):
            with pytest.raises(aion.WorkflowFailure) as caught:
                await run.result()
        assert caught.value.error is not None
        assert caught.value.error.type == error_type
        assert says in caught.value.error.message
        kinds = [type(e.body).__name__ for e in await engine.history("bad")]
        assert kinds == ["WorkflowStarted", "WorkflowFailed"]
        assert [r.workflow_id for r in await engine.list()] == ["bad"]


# --------------------------------------------------------------------------
# The command line: one error line, exit 2 (a usage error), the store untouched
# --------------------------------------------------------------------------

CLI_APP = "tests.procs.cli_app:app"

CLI_CASES: list[tuple[str, list[str], str]] = [
    ("start without the workflow's argument", ["start", "hello", "--id", "x", "-m", CLI_APP], "'name'"),
    (
        "start with an extra argument",
        ["start", "hello", '"a"', '"b"', "--id", "x", "-m", CLI_APP],
        "more than",
    ),
    (
        "start with a huge int argument",
        ["start", "hello", "1" * 5000, "--id", "x", "-m", CLI_APP],
        "argument 1",
    ),
    (
        "start with an empty task queue",
        ["start", "hello", '"a"', "--task-queue", "", "-m", CLI_APP],
        "--task-queue",
    ),
    ("an empty --store on the command", ["list", "--store", ""], "store is empty"),
    ("a store path that is not UTF-8", ["list", "--store", "sqlite:///%ff"], "UTF-8"),
]


@pytest.mark.parametrize(("args", "says"), [c[1:] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES])
def test_a_bad_cli_request_is_one_error_line_with_exit_2_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], says: str
) -> None:
    db = tmp_path / "orders.db"
    url = f"sqlite:///{db}"

    async def seed() -> None:
        from procs.cli_app import activities, workflows

        async with aion.open_engine(url, workflows=workflows, activities=activities) as engine:
            await (await engine.start("hello", "ann", workflow_id="done")).result()
            await engine.start("approval", 7, workflow_id="waiting")
            await settled(engine)

    async def contents() -> dict[str, Any]:
        async with aion.open_store(url) as store:
            return await snapshot(store)

    monkeypatch.chdir(ROOT)
    trio.run(seed)
    before = trio.run(contents)
    monkeypatch.setenv(_cli.STORE_ENV, url)
    result = cli_runner().invoke(_cli.cli, args, prog_name="aion-trio")
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert result.exit_code == 2, lines
    assert len(lines) == 1, lines
    assert lines[0].startswith("Error: ")
    assert says in lines[0]
    assert trio.run(contents) == before
    assert not (ROOT / "aion.db").exists()


def test_an_empty_group_store_is_refused_not_taken_for_the_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    result = cli_runner().invoke(_cli.cli, ["--store", "", "list"], prog_name="aion-trio")
    assert result.exit_code == 2
    assert "store is empty" in result.stdout + result.stderr
    assert list(tmp_path.iterdir()) == []  # no ./aion.db
