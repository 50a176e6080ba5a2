"""The Prometheus observer, end to end: real engines, a real HTTP endpoint on
127.0.0.1, scraped over a socket and parsed with prometheus-client's parser."""

from __future__ import annotations

import importlib.metadata
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import trio
import trio.testing
from aion_trio_prometheus import PrometheusObserver, start_metrics_server
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

import aion_trio as aion
import aion_trio_memory

ATTEMPTS: dict[str, int] = {}


@aion.activity(retry=aion.RetryPolicy(max_attempts=3, backoff=aion.Fixed(1.0)))
async def charge(order_id: str) -> str:
    # Every attempt takes 0.25 s of (mock) time; the first of each order fails.
    await trio.sleep(0.25)
    ATTEMPTS[order_id] = ATTEMPTS.get(order_id, 0) + 1
    if ATTEMPTS[order_id] == 1:
        raise ConnectionError("payment gateway timed out")
    return f"receipt-{order_id}"


@aion.workflow
async def order(ctx: aion.WorkflowContext, order_id: str) -> str:
    return await ctx.run(charge, order_id)


@aion.workflow
async def rejected(ctx: aion.WorkflowContext) -> None:
    raise ValueError("the order is invalid")


@aion.workflow
async def awaits_approval(ctx: aion.WorkflowContext) -> str:
    return str(await ctx.wait_signal("approve"))


WORKFLOWS = [order, rejected, awaits_approval]


@pytest.fixture
def memory_url() -> Iterator[str]:
    name = f"prom-{uuid.uuid4().hex}"
    yield f"memory://{name}"
    aion_trio_memory.forget(name)


def _scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def _get(samples: dict[tuple[str, Any], float], name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


async def test_metrics_scraped_over_http_count_runs_attempts_store_operations_and_recovery(
    memory_url: str, autojump_clock: trio.testing.MockClock
) -> None:
    ATTEMPTS.clear()
    registry = CollectorRegistry()
    observer = PrometheusObserver(registry)
    ops: list[aion.StoreOperation] = []

    def count_ops(event: aion.ObserverEvent) -> None:
        if isinstance(event, aion.StoreOperation):
            ops.append(event)

    async with aion.open_engine(
        memory_url, workflows=WORKFLOWS, activities=[charge], observers=[observer, count_ops]
    ) as engine:
        handles = [await engine.start(order, f"o{i}", workflow_id=f"order-{i}") for i in range(3)]
        bad = await engine.start(rejected, workflow_id="rejected-1")
        await engine.start(awaits_approval, workflow_id="approval-1")
        assert [await h.result() for h in handles] == ["receipt-o0", "receipt-o1", "receipt-o2"]
        with pytest.raises(aion.WorkflowFailure):
            await bad.result()
    # A second engine on the same store resumes the waiting run: a recovery with one resumed.
    async with aion.open_engine(
        memory_url, workflows=WORKFLOWS, activities=[charge], observers=[observer, count_ops]
    ) as engine:
        await engine.signal("approval-1", "approve", "yes")
        assert await engine.result("approval-1") == "yes"

    with start_metrics_server(0, registry=registry) as server:
        assert server.addr == "127.0.0.1"
        assert server.url == f"http://127.0.0.1:{server.port}/metrics"
        samples = await trio.to_thread.run_sync(_scrape, server.url)

    started = "aion_trio_workflow_runs_started_total"
    ended = "aion_trio_workflow_runs_ended_total"
    assert _get(samples, started, workflow_type="order") == 3
    assert _get(samples, started, workflow_type="rejected") == 1
    # Started once: the resumed run is replayed, not started again.
    assert _get(samples, started, workflow_type="awaits_approval") == 1
    assert _get(samples, ended, workflow_type="order", status="completed") == 3
    assert _get(samples, ended, workflow_type="rejected", status="failed") == 1
    assert _get(samples, ended, workflow_type="awaits_approval", status="completed") == 1

    assert _get(samples, "aion_trio_activity_attempts_total", activity_type="charge") == 6
    outcomes = "aion_trio_activity_attempt_outcomes_total"
    assert _get(samples, outcomes, activity_type="charge", outcome="failed") == 3
    assert _get(samples, outcomes, activity_type="charge", outcome="completed") == 3
    duration = "aion_trio_activity_attempt_duration_seconds"
    assert _get(samples, f"{duration}_count", activity_type="charge") == 6
    assert _get(samples, f"{duration}_sum", activity_type="charge") == pytest.approx(6 * 0.25)
    assert _get(samples, f"{duration}_bucket", activity_type="charge", le="0.1") == 0
    assert _get(samples, f"{duration}_bucket", activity_type="charge", le="0.25") == 6
    assert _get(samples, f"{duration}_bucket", activity_type="charge", le="+Inf") == 6

    store = "aion_trio_store_operation_duration_seconds_count"
    appends = sum(1 for op in ops if (op.store, op.operation) == ("events", "append"))
    assert appends >= 5 * 2, "control: starts, schedules, retries, outcomes and terminals were appended"
    assert _get(samples, store, store="events", operation="append") == appends
    upserts = sum(1 for op in ops if (op.store, op.operation) == ("visibility", "upsert"))
    assert upserts > 0
    assert _get(samples, store, store="visibility", operation="upsert") == upserts
    assert _get(samples, store, store="events", operation="list_active") == 2
    assert not any(name == "aion_trio_store_operation_errors_total" for name, _ in samples)

    assert _get(samples, "aion_trio_recoveries_total") == 2
    assert _get(samples, "aion_trio_recovery_resumed_workflows_total") == 1
    assert _get(samples, "aion_trio_recovery_duration_seconds_count") == 2


def test_the_server_listens_on_loopback_and_releases_its_port_on_close() -> None:
    registry = CollectorRegistry()
    PrometheusObserver(registry)(aion.RecoveryFinished(active=3, resumed=2, seconds=0.5))
    server = start_metrics_server(0, registry=registry)
    try:
        samples = _scrape(server.url)
        assert _get(samples, "aion_trio_recovery_resumed_workflows_total") == 2
    finally:
        server.close()
    server.close()  # idempotent
    with pytest.raises(OSError):
        _scrape(server.url)
    with pytest.raises(ValueError, match="port must be an int"):
        start_metrics_server(70000)


def test_a_failed_store_operation_is_counted_by_error_type() -> None:
    registry = CollectorRegistry()
    observer = PrometheusObserver(registry)
    observer(aion.StoreOperation(store="events", operation="append", seconds=0.002, ok=False, error_type="X"))
    assert (
        registry.get_sample_value(
            "aion_trio_store_operation_errors_total",
            {"store": "events", "operation": "append", "error_type": "X"},
        )
        == 1
    )
    assert (
        registry.get_sample_value(
            "aion_trio_store_operation_duration_seconds_count", {"store": "events", "operation": "append"}
        )
        == 1
    )


async def test_the_installed_entry_point_feeds_the_global_registry(
    memory_url: str, autojump_clock: trio.testing.MockClock
) -> None:
    names = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="aion_trio")}
    assert names.get("prometheus") == "aion_trio_prometheus"
    labels = {"workflow_type": "rejected", "status": "failed"}
    before = REGISTRY.get_sample_value("aion_trio_workflow_runs_ended_total", labels) or 0.0
    # No observers passed: the plugin comes in through the entry point.
    async with aion.open_engine(memory_url, workflows=WORKFLOWS, activities=[charge]) as engine:
        with pytest.raises(aion.WorkflowFailure):
            await (await engine.start(rejected, workflow_id="ep-rejected")).result()
    with start_metrics_server(0) as server:
        samples = await trio.to_thread.run_sync(_scrape, server.url)
    assert _get(samples, "aion_trio_workflow_runs_ended_total", **labels) == before + 1
