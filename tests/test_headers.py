"""Run headers: context a run carries in its history (``WorkflowStarted.headers``).

The starter passes them (``engine.start(..., headers=...)``), header hooks
(``aion_trio_start_headers``) add to them in the starter's task, children,
continue-as-new successors and reset runs inherit them, observers see them, and
a run resumed by another engine reports them (``RunRecovered``).
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Callable, Mapping

import pytest
import trio
import trio.testing

import aion_trio as aion
from aion_trio.plugin import hookimpl

#: What a caller's tracing library would hold: visible to a hook only in the caller's task.
CURRENT = contextvars.ContextVar[str]("CURRENT", default="none")


@aion.activity
async def echo(x: int) -> int:
    await trio.lowlevel.checkpoint()
    return x


@aion.workflow
async def leaf(ctx: aion.WorkflowContext, x: int) -> int:
    return await ctx.run(echo, x)


@aion.workflow
async def parent(ctx: aion.WorkflowContext, x: int) -> int:
    return await ctx.child(leaf, x, workflow_id="headers-child")


@aion.workflow
async def chain(ctx: aion.WorkflowContext, n: int) -> int:
    if n > 0:
        raise ctx.continue_as_new(n - 1)
    return await ctx.run(echo, 7)


@aion.workflow
async def waits(ctx: aion.WorkflowContext) -> str:
    await ctx.run(echo, 1)
    return str(await ctx.wait_signal("go"))


WORKFLOWS = [leaf, parent, chain, waits]


class Hook:
    """A header hook: records what it was told, adds the caller's context variable."""

    def __init__(self) -> None:
        self.starts: list[aion.RunStart] = []

    @hookimpl
    def aion_trio_start_headers(self, start: aion.RunStart) -> Mapping[str, str] | None:
        self.starts.append(start)
        return {"hook": f"{start.kind}:{CURRENT.get()}"}


def _started(history: list[aion.Event]) -> list[aion.WorkflowStarted]:
    return [e.body for e in history if isinstance(e.body, aion.WorkflowStarted)]


async def test_a_start_records_the_callers_headers_and_the_hooks_in_the_callers_task(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    hook = Hook()
    seen: list[aion.ObserverEvent] = []
    async with aion.open_engine(
        store_url(), workflows=WORKFLOWS, activities=[echo], observers=[hook, seen.append]
    ) as engine:
        token = CURRENT.set("span-1")
        try:
            run = await engine.start(leaf, 3, workflow_id="h-start", headers={"tenant": "acme"})
        finally:
            CURRENT.reset(token)
        assert await run.result() == 3
        (started,) = _started(await engine.history("h-start"))
    assert started.headers == {"tenant": "acme", "hook": "start:span-1"}
    assert [(s.kind, s.workflow_id, s.workflow_type, dict(s.headers)) for s in hook.starts] == [
        ("start", "h-start", "leaf", {"tenant": "acme"})
    ]
    (event,) = [e for e in seen if isinstance(e, aion.WorkflowRunStarted)]
    assert event.headers == started.headers
    (ended,) = [e for e in seen if isinstance(e, aion.WorkflowRunEnded)]
    assert ended.headers == started.headers
    assert len({event, ended, *hook.starts}) == 3, "frozen records, hashable with their headers"
    built = [
        aion.RunRecovered(workflow_id="w", run_id="r", workflow_type="t", headers={"a": "b"}) for _ in "xy"
    ]
    assert len({*built, aion.RunStart(kind="start", workflow_id="w", workflow_type="t")}) == 2


async def test_children_successors_and_reset_runs_inherit_headers_and_hooks_see_where_they_come_from(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    hook = Hook()
    async with aion.open_engine(
        store_url(), workflows=WORKFLOWS, activities=[echo], observers=[hook]
    ) as engine:
        up = await engine.start(parent, 5, workflow_id="h-parent", headers={"tenant": "acme"})
        assert await up.result() == 5
        ch = await engine.start(chain, 2, workflow_id="h-chain", headers={"tenant": "beta"})
        assert await ch.result() == 7
        (parent_start,) = _started(await engine.history("h-parent"))
        (child_start,) = _started(await engine.history("headers-child"))
        chain_starts = _started(await engine.history("h-chain"))
        await engine.reset("h-chain", reason="again")
        reset_start = _started(await engine.history("h-chain"))[-1]

    # The child inherits its parent run's headers; the hook was told whose child it is.
    assert child_start.headers == {"tenant": "acme", "hook": "child:none"}
    child_hook = next(s for s in hook.starts if s.kind == "child")
    assert (child_hook.parent_workflow_id, child_hook.parent_run_id) == ("h-parent", parent_start.run_id)
    assert child_hook.headers == parent_start.headers
    # Each successor inherits its predecessor's headers.
    assert [s.headers for s in chain_starts] == [
        {"tenant": "beta", "hook": "start:none"},
        {"tenant": "beta", "hook": "continue_as_new:none"},
        {"tenant": "beta", "hook": "continue_as_new:none"},
    ]
    successors = [s for s in hook.starts if s.kind == "continue_as_new"]
    assert [s.previous_run_id for s in successors] == [s.run_id for s in chain_starts[:2]]
    # A reset run inherits the headers of the run it resets.
    assert reset_start.reset_from_run_id == chain_starts[-1].run_id
    assert reset_start.headers == {"tenant": "beta", "hook": "reset:none"}
    (reset_hook,) = [s for s in hook.starts if s.kind == "reset"]
    assert reset_hook.previous_run_id == chain_starts[-1].run_id


async def test_without_hooks_headers_are_what_the_starter_passed_and_are_inherited(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    async with aion.open_engine(store_url(), workflows=WORKFLOWS, activities=[echo]) as engine:
        await (await engine.start(parent, 1, workflow_id="plain", headers={"tenant": "t"})).result()
        await (await engine.start(leaf, 1, workflow_id="none")).result()
        assert _started(await engine.history("headers-child"))[0].headers == {"tenant": "t"}
        assert _started(await engine.history("none"))[0].headers == {}


@pytest.mark.parametrize(
    ("headers", "error", "match"),
    [
        ({"tenant": 3}, TypeError, "header 'tenant' must have a str value"),
        ({"": "x"}, ValueError, "a header name must be a non-empty str"),
        ({f"k{i}": "v" for i in range(65)}, ValueError, "at most 64 headers"),
        ({"big": "x" * 9000}, ValueError, "at most 8192 are allowed"),
        (["traceparent"], TypeError, "headers must be a mapping"),
    ],
)
async def test_bad_headers_are_refused_before_anything_is_recorded(
    store_url: Callable[[], str],
    autojump_clock: trio.testing.MockClock,
    headers: object,
    error: type,
    match: str,
) -> None:
    async with aion.open_engine(store_url(), workflows=WORKFLOWS, activities=[echo]) as engine:
        with pytest.raises(error, match=match):
            await engine.start(leaf, 1, workflow_id="bad", headers=headers)  # type: ignore[arg-type]
        with pytest.raises(aion.WorkflowNotFound):
            await engine.history("bad")


async def test_a_hook_that_raises_or_returns_no_headers_is_logged_and_the_start_goes_on(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    class Broken:
        @hookimpl
        def aion_trio_start_headers(self, start: aion.RunStart) -> Mapping[str, str] | None:
            raise RuntimeError("hook bug")

    class Wrong:
        @hookimpl
        def aion_trio_start_headers(self, start: aion.RunStart) -> Mapping[str, str] | None:
            return {"n": 1}  # type: ignore[dict-item]

    caplog.set_level(logging.DEBUG, logger="aion_trio.observe")
    async with aion.open_engine(
        store_url(), workflows=WORKFLOWS, activities=[echo], observers=[Broken(), Wrong(), Hook()]
    ) as engine:
        await (await engine.start(leaf, 2, workflow_id="survives", headers={"a": "b"})).result()
        (started,) = _started(await engine.history("survives"))
    assert started.headers == {"a": "b", "hook": "start:none"}
    failures = [r for r in caplog.records if "aion_trio_start_headers" in r.getMessage()]
    assert len(failures) == 2


async def test_a_run_resumed_by_another_engine_is_reported_recovered_with_its_headers(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    url = store_url()
    async with aion.open_engine(url, workflows=WORKFLOWS, activities=[echo]) as engine:
        run = await engine.start(waits, workflow_id="resumed", headers={"traceparent": "t-1"})
        await trio.testing.wait_all_tasks_blocked()
    seen: list[aion.ObserverEvent] = []
    async with aion.open_engine(
        url, workflows=WORKFLOWS, activities=[echo], observers=[seen.append]
    ) as engine:
        await engine.signal("resumed", "go", "yes")
        assert await engine.result("resumed") == "yes"
    recovered = [e for e in seen if isinstance(e, aion.RunRecovered)]
    assert [(e.workflow_id, e.run_id, e.workflow_type, dict(e.headers)) for e in recovered] == [
        ("resumed", run.run_id, "waits", {"traceparent": "t-1"})
    ]
    assert not [e for e in seen if isinstance(e, aion.WorkflowRunStarted)]


async def test_a_failed_run_reports_its_error_to_observers(
    store_url: Callable[[], str], autojump_clock: trio.testing.MockClock
) -> None:
    @aion.workflow
    async def fails(ctx: aion.WorkflowContext) -> None:
        raise LookupError("no such order")

    seen: list[aion.ObserverEvent] = []
    async with aion.open_engine(store_url(), workflows=[fails], observers=[seen.append]) as engine:
        with pytest.raises(aion.WorkflowFailure):
            await (await engine.start(fails, workflow_id="fails")).result()
    (ended,) = [e for e in seen if isinstance(e, aion.WorkflowRunEnded)]
    assert (ended.status, ended.error_type, ended.error_message) == (
        aion.WorkflowStatus.FAILED,
        "LookupError",
        "no such order",
    )
