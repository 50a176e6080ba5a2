"""The OpenTelemetry observer, end to end: real engines, spans collected by the SDK's
in-memory exporter (and, for the crash test, a second process's spans written to a file)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
import trio.testing
from aion_trio_opentelemetry import TracingObserver
from crash_worker import span_record, step, two_steps
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

import aion_trio as aion
import aion_trio_memory

ATTEMPTS: dict[str, int] = {}


@aion.activity(retry=aion.RetryPolicy(max_attempts=3, backoff=aion.Fixed(1.0)))
async def charge(order_id: str) -> str:
    ATTEMPTS[order_id] = ATTEMPTS.get(order_id, 0) + 1
    await trio.sleep(0.25)
    if ATTEMPTS[order_id] < 3:
        raise ConnectionError(f"gateway timed out (try {ATTEMPTS[order_id]})")
    return f"receipt-{order_id}"


@aion.workflow
async def order(ctx: aion.WorkflowContext, order_id: str) -> str:
    return await ctx.run(charge, order_id)


@aion.workflow
async def ship(ctx: aion.WorkflowContext, n: int) -> int:
    return await ctx.run(step, n)


@aion.workflow
async def checkout(ctx: aion.WorkflowContext, n: int) -> int:
    return await ctx.child(ship, n, workflow_id=f"{ctx.workflow_id}/ship")


@aion.workflow
async def countdown(ctx: aion.WorkflowContext, n: int) -> int:
    if n > 0:
        raise ctx.continue_as_new(n - 1)
    return await ctx.run(step, 10)


@aion.workflow
async def rejected(ctx: aion.WorkflowContext) -> None:
    raise ValueError("the order is invalid")


WORKFLOWS = [order, ship, checkout, countdown, rejected, two_steps]
ACTIVITIES = [charge, step]


@pytest.fixture
def memory_url() -> Iterator[str]:
    name = f"otel-{uuid.uuid4().hex}"
    yield f"memory://{name}"
    aion_trio_memory.forget(name)


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def provider(exporter: InMemorySpanExporter) -> TracerProvider:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider


def _named(spans: tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


def _ids(span: ReadableSpan) -> tuple[int, int]:
    context = span.get_span_context()
    assert context is not None
    return context.trace_id, context.span_id


def _parent(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


async def test_the_run_span_is_a_child_of_the_callers_span_and_each_retry_is_its_own_span(
    memory_url: str,
    provider: TracerProvider,
    exporter: InMemorySpanExporter,
    autojump_clock: trio.testing.MockClock,
) -> None:
    ATTEMPTS.clear()
    tracer = provider.get_tracer("test")
    async with aion.open_engine(
        memory_url, workflows=WORKFLOWS, activities=ACTIVITIES, observers=[TracingObserver(provider)]
    ) as engine:
        with tracer.start_as_current_span("http POST /orders"):
            run = await engine.start(order, "o1", workflow_id="order-1")
        assert await run.result() == "receipt-o1"

    spans = exporter.get_finished_spans()
    (request,) = _named(spans, "http POST /orders")
    (workflow,) = _named(spans, "workflow order")
    attempts = sorted(_named(spans, "activity charge"), key=lambda s: s.attributes["aion.activity.attempt"])  # type: ignore[index]
    trace_id, request_id = _ids(request)
    assert _ids(workflow)[0] == trace_id
    assert _parent(workflow) == request_id
    assert dict(workflow.attributes or {}) == {
        "aion.workflow.id": "order-1",
        "aion.workflow.run_id": run.run_id,
        "aion.workflow.type": "order",
        "aion.workflow.status": "completed",
    }
    assert workflow.status.status_code is StatusCode.UNSET

    # Three attempts, three spans, each a child of the run's span.
    assert [s.attributes["aion.activity.attempt"] for s in attempts] == [1, 2, 3]  # type: ignore[index]
    assert {_ids(s)[0] for s in attempts} == {trace_id}
    assert {_parent(s) for s in attempts} == {_ids(workflow)[1]}
    for failed in attempts[:2]:
        assert failed.status.status_code is StatusCode.ERROR
        assert failed.attributes["error.type"] == "ConnectionError"  # type: ignore[index]
        assert failed.attributes["aion.activity.outcome"] == "failed"  # type: ignore[index]
        (exception,) = failed.events
        assert exception.name == "exception"
        assert exception.attributes == {
            "exception.type": "ConnectionError",
            "exception.message": f"gateway timed out (try {failed.attributes['aion.activity.attempt']})",  # type: ignore[index]
        }
    ok = attempts[2]
    assert ok.status.status_code is StatusCode.UNSET
    assert dict(ok.attributes or {}) == {
        "aion.workflow.id": "order-1",
        "aion.workflow.run_id": run.run_id,
        "aion.activity.id": 0,
        "aion.activity.type": "charge",
        "aion.activity.attempt": 3,
        "aion.activity.task_queue": "default",
        "aion.activity.outcome": "completed",
    }
    # Durations are the attempts' own (0.25 s of mock time is real time here: ~0), and
    # every attempt ends inside its run's span.
    assert all(workflow.start_time <= s.start_time <= s.end_time <= workflow.end_time for s in attempts)  # type: ignore[operator]


async def test_a_child_runs_span_is_a_child_of_its_parent_runs_span(
    memory_url: str,
    provider: TracerProvider,
    exporter: InMemorySpanExporter,
    autojump_clock: trio.testing.MockClock,
) -> None:
    tracer = provider.get_tracer("test")
    async with aion.open_engine(
        memory_url, workflows=WORKFLOWS, activities=ACTIVITIES, observers=[TracingObserver(provider)]
    ) as engine:
        with tracer.start_as_current_span("caller"):
            run = await engine.start(checkout, 4, workflow_id="c-1")
        assert await run.result() == 5

    spans = exporter.get_finished_spans()
    (caller,) = _named(spans, "caller")
    (parent,) = _named(spans, "workflow checkout")
    (child,) = _named(spans, "workflow ship")
    (activity,) = _named(spans, "activity step")
    trace_id = _ids(caller)[0]
    assert {_ids(s)[0] for s in (parent, child, activity)} == {trace_id}
    assert _parent(parent) == _ids(caller)[1]
    assert _parent(child) == _ids(parent)[1]
    assert _parent(activity) == _ids(child)[1]
    assert child.attributes["aion.workflow.parent_id"] == "c-1"  # type: ignore[index]
    assert child.attributes["aion.workflow.id"] == "c-1/ship"  # type: ignore[index]


async def test_continue_as_new_and_reset_runs_are_children_of_the_run_they_follow(
    memory_url: str,
    provider: TracerProvider,
    exporter: InMemorySpanExporter,
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with aion.open_engine(
        memory_url, workflows=WORKFLOWS, activities=ACTIVITIES, observers=[TracingObserver(provider)]
    ) as engine:
        run = await engine.start(countdown, 2, workflow_id="cd")  # no caller span: a new trace
        assert await engine.result("cd") == 11
        await engine.reset("cd", reason="once more")
        assert await engine.result("cd") == 11

    runs = sorted(
        _named(exporter.get_finished_spans(), "workflow countdown"), key=lambda s: s.start_time or 0
    )
    assert len(runs) == 4  # three runs of the chain, then the reset run
    first, second, third, reset = runs
    assert first.parent is None
    assert first.attributes["aion.workflow.run_id"] == run.run_id  # type: ignore[index]
    assert {_ids(s)[0] for s in runs} == {_ids(first)[0]}
    assert _parent(second) == _ids(first)[1]
    assert _parent(third) == _ids(second)[1]
    assert _parent(reset) == _ids(third)[1]
    assert [s.attributes["aion.workflow.status"] for s in runs] == [  # type: ignore[index]
        "continued_as_new",
        "continued_as_new",
        "completed",  # the reset of a closed run adds no second span for it
        "completed",
    ]
    assert second.attributes["aion.workflow.continued_from"] == first.attributes["aion.workflow.run_id"]  # type: ignore[index]
    assert reset.attributes["aion.workflow.reset_from"] == third.attributes["aion.workflow.run_id"]  # type: ignore[index]


async def test_a_failed_run_records_its_error_on_its_span(
    memory_url: str,
    provider: TracerProvider,
    exporter: InMemorySpanExporter,
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with aion.open_engine(
        memory_url, workflows=WORKFLOWS, activities=ACTIVITIES, observers=[TracingObserver(provider)]
    ) as engine:
        with pytest.raises(aion.WorkflowFailure):
            await (await engine.start(rejected, workflow_id="bad")).result()
    (span,) = _named(exporter.get_finished_spans(), "workflow rejected")
    assert span.status.status_code is StatusCode.ERROR
    assert span.status.description == "ValueError: the order is invalid"
    assert span.attributes["error.type"] == "ValueError"  # type: ignore[index]
    assert span.attributes["aion.workflow.status"] == "failed"  # type: ignore[index]
    (exception,) = span.events
    assert exception.attributes == {
        "exception.type": "ValueError",
        "exception.message": "the order is invalid",
    }


HERE = Path(__file__).parent


def test_a_run_resumed_in_another_process_after_sigkill_continues_the_same_trace(
    tmp_path: Path, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    db, spans_file = tmp_path / "orders.db", tmp_path / "spans.jsonl"
    line = ""
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "crash_worker.py"), str(db), str(spans_file)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "AION_TRIO_DISABLE_PLUGINS": "opentelemetry,prometheus"},
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the worker bounds its own wait (60 s) and exits if stuck
        if line.strip() == "READY":
            os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None and line.strip() != "READY":
            proc.kill()
        _, err = proc.communicate(timeout=30)  # reaps it and closes the pipes
    assert line.strip() == "READY", f"the worker did not get ready: {line!r}\n{err}"
    assert proc.returncode == -signal.SIGKILL
    first = [json.loads(line) for line in spans_file.read_text(encoding="utf-8").splitlines()]
    (request,) = [s for s in first if s["name"] == "request"]
    (step_one,) = [s for s in first if s["name"] == "activity step"]
    # The run's span was still open when the process died: it was never exported.
    assert not [s for s in first if s["name"] == "workflow two_steps"]
    assert step_one["trace_id"] == request["trace_id"]
    original_run_span = step_one["parent_id"]

    async def resume() -> int:
        with trio.fail_after(60):
            async with aion.open_engine(
                f"sqlite:///{db}",
                workflows=WORKFLOWS,
                activities=ACTIVITIES,
                observers=[TracingObserver(provider)],
            ) as engine:
                await engine.signal("crashy", "go")
                result: int = await engine.result("crashy")
                return result

    assert trio.run(resume) == 3
    second = [span_record(s) for s in exporter.get_finished_spans()]
    (run,) = [s for s in second if s["name"] == "workflow two_steps"]
    (step_two,) = [s for s in second if s["name"] == "activity step"]
    # The same trace, under the caller's span the first process recorded in history.
    assert run["trace_id"] == step_two["trace_id"] == request["trace_id"]
    assert run["parent_id"] == request["span_id"]
    assert run["span_id"] != original_run_span
    assert run["attributes"]["aion.workflow.resumed"] is True
    assert run["attributes"]["aion.workflow.status"] == "completed"
    assert step_two["parent_id"] == run["span_id"]
    assert step_two["attributes"]["aion.activity.id"] == 1
    assert step_one["attributes"]["aion.activity.id"] == 0


async def test_the_installed_entry_point_traces_into_the_global_provider(
    memory_url: str,
    exporter: InMemorySpanExporter,
    provider: TracerProvider,
    autojump_clock: trio.testing.MockClock,
) -> None:
    names = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="aion_trio")}
    assert names.get("opentelemetry") == "aion_trio_opentelemetry"
    trace.set_tracer_provider(provider)  # the only test that sets the process-wide provider
    tracer = trace.get_tracer("test")
    # No observers passed: the plugin comes in through the entry point.
    async with aion.open_engine(memory_url, workflows=WORKFLOWS, activities=ACTIVITIES) as engine:
        with tracer.start_as_current_span("caller"):
            run = await engine.start(checkout, 1, workflow_id="ep-1")
        assert await run.result() == 2
    spans = exporter.get_finished_spans()
    (caller,) = _named(spans, "caller")
    (parent,) = _named(spans, "workflow checkout")
    (child,) = _named(spans, "workflow ship")
    assert _parent(parent) == _ids(caller)[1]
    assert _parent(child) == _ids(parent)[1]
