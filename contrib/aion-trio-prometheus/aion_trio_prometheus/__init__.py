"""Prometheus metrics for aion_trio, fed by the engine's observer hook.

Installed, this package registers an ``aion_trio_observe`` hook through the
``aion_trio`` entry-point group: every engine in the process then counts into
prometheus-client's default registry (disable it with
``AION_TRIO_DISABLE_PLUGINS=prometheus``).  For a registry of your own, pass
``PrometheusObserver(registry)`` to ``open_engine(..., observers=[...])``.

Serve the metrics with :func:`start_metrics_server` (loopback by default)
or with any prometheus-client exposition you already run.

Metrics (label values are workflow and activity *types*, never ids, so the
series count stays bounded):

* ``aion_trio_workflow_runs_started_total``: workflow_type
* ``aion_trio_workflow_runs_ended_total``: workflow_type, status
* ``aion_trio_activity_attempts_total``: activity_type
* ``aion_trio_activity_attempt_outcomes_total``: activity_type, outcome
* ``aion_trio_activity_attempt_duration_seconds``: activity_type (histogram)
* ``aion_trio_store_operation_duration_seconds``: store, operation (histogram)
* ``aion_trio_store_operation_errors_total``: store, operation, error_type
* ``aion_trio_recoveries_total``: (none)
* ``aion_trio_recovery_resumed_workflows_total``: (none)
* ``aion_trio_recovery_duration_seconds``: (none; histogram)
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import final

import prometheus_client
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

import aion_trio
from aion_trio.plugin import hookimpl

__all__ = [
    "ACTIVITY_BUCKETS",
    "STORE_BUCKETS",
    "MetricsServer",
    "PrometheusObserver",
    "aion_trio_observe",
    "default_observer",
    "start_metrics_server",
]

#: Activity attempt durations, seconds: from a quick call to a slow job.
ACTIVITY_BUCKETS: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
#: Store operation latencies, seconds: an fsync'd commit is around a millisecond.
STORE_BUCKETS: tuple[float, ...] = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    1,
)


@final
class PrometheusObserver:
    """An aion_trio observer that counts into a prometheus-client registry.

    Call it with each :class:`aion_trio.ObserverEvent` (pass it in
    ``open_engine(..., observers=[observer])``).  Its metrics are registered
    on ``registry`` (default: prometheus-client's global one) when it is
    created, so create one per registry.
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        activity_buckets: Sequence[float] = ACTIVITY_BUCKETS,
        store_buckets: Sequence[float] = STORE_BUCKETS,
    ) -> None:
        self.registry = registry if registry is not None else REGISTRY
        r = self.registry
        self.runs_started = Counter(
            "aion_trio_workflow_runs_started",
            "Workflow runs started (new starts, continue-as-new successors, children).",
            ["workflow_type"],
            registry=r,
        )
        self.runs_ended = Counter(
            "aion_trio_workflow_runs_ended",
            "Workflow runs whose terminal was recorded, by final status.",
            ["workflow_type", "status"],
            registry=r,
        )
        self.activity_attempts = Counter(
            "aion_trio_activity_attempts",
            "Activity attempts dispatched.",
            ["activity_type"],
            registry=r,
        )
        self.activity_outcomes = Counter(
            "aion_trio_activity_attempt_outcomes",
            "Activity attempts ended, by outcome (completed, failed, timed_out, worker_lost, parked, cancelled).",
            ["activity_type", "outcome"],
            registry=r,
        )
        self.activity_duration = Histogram(
            "aion_trio_activity_attempt_duration_seconds",
            "How long activity attempts ran.",
            ["activity_type"],
            buckets=tuple(activity_buckets),
            registry=r,
        )
        self.store_duration = Histogram(
            "aion_trio_store_operation_duration_seconds",
            "Latency of store operations (events: append, read_history, ...; visibility: upsert, list, ...).",
            ["store", "operation"],
            buckets=tuple(store_buckets),
            registry=r,
        )
        self.store_errors = Counter(
            "aion_trio_store_operation_errors",
            "Store operations that raised, by exception type.",
            ["store", "operation", "error_type"],
            registry=r,
        )
        self.recoveries = Counter(
            "aion_trio_recoveries", "Recovery sweeps run (one per engine start).", registry=r
        )
        self.recovery_resumed = Counter(
            "aion_trio_recovery_resumed_workflows",
            "Workflows the recovery sweeps resumed.",
            registry=r,
        )
        self.recovery_duration = Histogram(
            "aion_trio_recovery_duration_seconds",
            "How long recovery sweeps took.",
            buckets=(0.01, 0.1, 0.5, 1, 5, 10, 30, 60, 300),
            registry=r,
        )

    def __call__(self, event: aion_trio.ObserverEvent) -> None:
        """Count one observer event (unknown kinds are ignored)."""
        if isinstance(event, aion_trio.StoreOperation):
            self.store_duration.labels(event.store, event.operation).observe(event.seconds)
            if not event.ok:
                self.store_errors.labels(event.store, event.operation, event.error_type or "unknown").inc()
        elif isinstance(event, aion_trio.ActivityAttemptStarted):
            self.activity_attempts.labels(event.activity_type).inc()
        elif isinstance(event, aion_trio.ActivityAttemptEnded):
            self.activity_outcomes.labels(event.activity_type, event.outcome).inc()
            self.activity_duration.labels(event.activity_type).observe(event.seconds)
        elif isinstance(event, aion_trio.WorkflowRunStarted):
            self.runs_started.labels(event.workflow_type).inc()
        elif isinstance(event, aion_trio.WorkflowRunEnded):
            self.runs_ended.labels(event.workflow_type, event.status.value).inc()
        elif isinstance(event, aion_trio.RecoveryFinished):
            self.recoveries.inc()
            self.recovery_resumed.inc(event.resumed)
            self.recovery_duration.observe(event.seconds)


_default_lock = threading.Lock()
_default: PrometheusObserver | None = None


def default_observer() -> PrometheusObserver:
    """The observer on prometheus-client's global registry (created on first use)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = PrometheusObserver()
        return _default


@hookimpl
def aion_trio_observe(event: aion_trio.ObserverEvent) -> None:
    """The entry-point hook: count into the global registry."""
    default_observer()(event)


@final
class MetricsServer:
    """A running ``/metrics`` HTTP endpoint (a daemon thread); :meth:`close` stops it."""

    def __init__(self, server: object, thread: threading.Thread, addr: str, port: int) -> None:
        self._server = server
        self._thread = thread
        self.addr = addr
        self.port = port

    @property
    def url(self) -> str:
        """The URL the metrics are served at (``http://host:port/metrics``)."""
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and release the port (idempotent)."""
        server = self._server
        if server is None:
            return
        self._server = None
        server.shutdown()  # type: ignore[attr-defined]
        server.server_close()  # type: ignore[attr-defined]
        self._thread.join()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_metrics_server(
    port: int = 0, addr: str = "127.0.0.1", registry: CollectorRegistry | None = None
) -> MetricsServer:
    """Serve ``registry`` (default: the global one) at ``http://addr:port/metrics``.

    Loopback by default: pass ``addr="0.0.0.0"`` deliberately to expose it.
    ``port=0`` picks a free port (read it from ``.port``).  The server runs in
    a daemon thread, outside Trio; it only reads the registry.
    """
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise ValueError(f"port must be an int in 0..65535, got {port!r}")
    server, thread = prometheus_client.start_http_server(
        port, addr=addr, registry=registry if registry is not None else REGISTRY
    )
    return MetricsServer(server, thread, addr, server.server_port)
