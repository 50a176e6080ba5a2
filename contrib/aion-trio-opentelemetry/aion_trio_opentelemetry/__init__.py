"""OpenTelemetry tracing for aion_trio, fed by the engine's observer and header hooks.

Installed, this package registers itself through the ``aion_trio``
entry-point group: every engine in the process then traces into
OpenTelemetry's global tracer provider (a no-op until the application sets
one; disable the plugin with ``AION_TRIO_DISABLE_PLUGINS=opentelemetry``).
For a provider of your own, pass ``TracingObserver(tracer_provider)`` to
``open_engine(..., observers=[...])``.

What is traced:

* **A span per workflow run** (``workflow <type>``), from its
  ``WorkflowStarted`` to its terminal.  Its parent is the span that was current
  in the task calling ``engine.start``; a child run's parent is its parent
  run's span, and a continue-as-new successor's or a reset run's is the run it
  follows, so one trace holds the whole tree.
* **A span per activity attempt** (``activity <type>``), a child of its run's
  span: retries are separate spans, each with its attempt number.
* **Errors on spans**: a failed or timed-out run or attempt has status
  ``ERROR``, the ``error.type`` attribute and an ``exception`` event.

The parent's context travels in the run's history (``WorkflowStarted.headers``,
as W3C ``traceparent``/``tracestate`` with the global propagator), so an engine
that resumes the run after a crash, in another process, continues the same
trace: the run gets a new span there (``aion.workflow.resumed`` true) under the
same parent, and its later activity attempts hang under that span.  The span
the crashed process held is lost with it (a span is exported when it ends).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Final, final

from opentelemetry import context as otel_context, propagate, trace
from opentelemetry.propagators.textmap import TextMapPropagator
from opentelemetry.trace import NonRecordingSpan, Span, SpanContext, SpanKind, Status, StatusCode
from opentelemetry.util.types import AttributeValue

import aion_trio
from aion_trio.plugin import hookimpl

__all__ = [
    "INSTRUMENTATION_NAME",
    "TracingObserver",
    "aion_trio_observe",
    "aion_trio_start_headers",
    "default_observer",
]

INSTRUMENTATION_NAME: Final = "aion_trio_opentelemetry"
"""The instrumentation scope name spans are created under."""
__version__: Final = "0.1.0.dev0"

#: How many ended runs' span contexts are kept, for a successor that starts after its
#: predecessor's span ended (continue-as-new, reset).
_ENDED_KEPT = 4096

_RunKey = tuple[str, str]
_AttemptKey = tuple[str, str, int, int]


@final
class TracingObserver:
    """An aion_trio observer that records OpenTelemetry spans.

    Pass it in ``open_engine(..., observers=[TracingObserver(provider)])``: it
    implements both ``aion_trio_observe`` (the spans) and
    ``aion_trio_start_headers`` (the context a run carries in its history).
    ``tracer_provider``: default the global one; ``propagator``: how context is
    written into a run's headers and read back (default the global text-map
    propagator, W3C trace context and baggage unless configured otherwise).
    Use one instance per process and engine set: it holds the spans of the runs
    that are live here.
    """

    def __init__(
        self,
        tracer_provider: trace.TracerProvider | None = None,
        *,
        propagator: TextMapPropagator | None = None,
    ) -> None:
        self._tracer = trace.get_tracer(INSTRUMENTATION_NAME, __version__, tracer_provider)
        self._propagator = propagator
        self._runs: dict[_RunKey, Span] = {}
        self._ended: OrderedDict[_RunKey, SpanContext] = OrderedDict()
        self._attempts: dict[_AttemptKey, Span] = {}

    # -- context in headers -----------------------------------------------------------

    def _textmap(self) -> TextMapPropagator:
        return self._propagator if self._propagator is not None else propagate.get_global_textmap()

    def _inject(self, context: otel_context.Context | None) -> dict[str, str]:
        carrier: dict[str, str] = {}
        self._textmap().inject(carrier, context=context)
        return carrier

    def _run_context(self, key: _RunKey) -> SpanContext | None:
        span = self._runs.get(key)
        if span is not None:
            return span.get_span_context()
        return self._ended.get(key)

    @hookimpl
    def aion_trio_start_headers(self, start: aion_trio.RunStart) -> Mapping[str, str] | None:
        """The context of the new run's parent span, as headers (``None``: nothing to add)."""
        if start.kind == "start":
            headers = self._inject(None)  # the caller's current context (this is its task)
        else:
            if start.kind == "child":
                key = (start.parent_workflow_id or "", start.parent_run_id or "")
            else:  # continue_as_new, reset: the run it follows
                key = (start.workflow_id, start.previous_run_id or "")
            parent = self._run_context(key)
            if parent is None or not parent.is_valid:
                return None  # the inherited headers stand (the same trace, one level up)
            headers = self._inject(trace.set_span_in_context(NonRecordingSpan(parent)))
        return headers or None

    # -- spans ---------------------------------------------------------------------------

    @hookimpl
    def aion_trio_observe(self, event: aion_trio.ObserverEvent) -> None:
        """Start or end the span ``event`` is about (other kinds are ignored)."""
        if isinstance(event, aion_trio.ActivityAttemptStarted):
            self._attempt_started(event)
        elif isinstance(event, aion_trio.ActivityAttemptEnded):
            self._attempt_ended(event)
        elif isinstance(event, aion_trio.WorkflowRunStarted):
            attributes = _run_attributes(event.workflow_id, event.run_id, event.workflow_type)
            if event.parent_workflow_id is not None:
                attributes["aion.workflow.parent_id"] = event.parent_workflow_id
            if event.continued_from is not None:
                attributes["aion.workflow.continued_from"] = event.continued_from
            if event.reset_from is not None:
                attributes["aion.workflow.reset_from"] = event.reset_from
            self._start_run(event.workflow_id, event.run_id, event.workflow_type, event.headers, attributes)
        elif isinstance(event, (aion_trio.RunRecovered, aion_trio.RunReloaded)):
            if (event.workflow_id, event.run_id) not in self._runs:
                attributes = _run_attributes(event.workflow_id, event.run_id, event.workflow_type)
                attributes["aion.workflow.resumed"] = True
                self._start_run(
                    event.workflow_id, event.run_id, event.workflow_type, event.headers, attributes
                )
        elif isinstance(event, aion_trio.WorkflowRunEnded):
            self._run_ended(event)

    def _start_run(
        self,
        workflow_id: str,
        run_id: str,
        workflow_type: str,
        headers: Mapping[str, str],
        attributes: dict[str, AttributeValue],
    ) -> Span:
        parent = self._textmap().extract(dict(headers))
        span = self._tracer.start_span(
            f"workflow {workflow_type}", context=parent, kind=SpanKind.INTERNAL, attributes=attributes
        )
        self._runs[(workflow_id, run_id)] = span
        return span

    def _run_ended(self, event: aion_trio.WorkflowRunEnded) -> None:
        key = (event.workflow_id, event.run_id)
        span = self._runs.pop(key, None)
        if span is None and key in self._ended:
            return  # a second terminal of an ended run (a reset of a closed run): its span is closed
        if span is None:  # ended before this process saw it start or resume
            attributes = _run_attributes(event.workflow_id, event.run_id, event.workflow_type)
            attributes["aion.workflow.resumed"] = True
            span = self._start_run(
                event.workflow_id, event.run_id, event.workflow_type, event.headers, attributes
            )
            del self._runs[key]
        status = event.status
        span.set_attribute("aion.workflow.status", status.value)
        if status is aion_trio.WorkflowStatus.FAILED:
            _record_error(span, event.error_type or "WorkflowFailed", event.error_message or "")
        elif status is aion_trio.WorkflowStatus.TIMED_OUT:
            _record_error(span, "WorkflowTimedOut", "the run passed its deadline")
        span.end()
        self._ended[key] = span.get_span_context()
        while len(self._ended) > _ENDED_KEPT:
            self._ended.popitem(last=False)

    def _attempt_started(self, event: aion_trio.ActivityAttemptStarted) -> None:
        run = self._runs.get((event.workflow_id, event.run_id))
        parent = trace.set_span_in_context(run) if run is not None else otel_context.Context()
        attributes: dict[str, AttributeValue] = {
            **_run_attributes(event.workflow_id, event.run_id, None),
            "aion.activity.id": event.activity_id,
            "aion.activity.type": event.activity_type,
            "aion.activity.attempt": event.attempt,
            "aion.activity.task_queue": event.task_queue,
        }
        key = (event.workflow_id, event.run_id, event.activity_id, event.attempt)
        self._attempts[key] = self._tracer.start_span(
            f"activity {event.activity_type}", context=parent, kind=SpanKind.INTERNAL, attributes=attributes
        )

    def _attempt_ended(self, event: aion_trio.ActivityAttemptEnded) -> None:
        span = self._attempts.pop((event.workflow_id, event.run_id, event.activity_id, event.attempt), None)
        if span is None:
            return
        span.set_attribute("aion.activity.outcome", event.outcome)
        if event.queued_seconds:
            span.set_attribute("aion.activity.queued_seconds", event.queued_seconds)
        if event.outcome in ("failed", "timed_out"):
            _record_error(span, event.error_type or event.outcome, event.error_message or "")
        span.end()


def _run_attributes(workflow_id: str, run_id: str, workflow_type: str | None) -> dict[str, AttributeValue]:
    attributes: dict[str, AttributeValue] = {"aion.workflow.id": workflow_id, "aion.workflow.run_id": run_id}
    if workflow_type is not None:
        attributes["aion.workflow.type"] = workflow_type
    return attributes


def _record_error(span: Span, error_type: str, message: str) -> None:
    """The semantic conventions' error attribute and exception event, and status ERROR."""
    span.set_attribute("error.type", error_type)
    span.add_event("exception", {"exception.type": error_type, "exception.message": message})
    span.set_status(Status(StatusCode.ERROR, f"{error_type}: {message}" if message else error_type))


_default_lock = threading.Lock()
_default: TracingObserver | None = None


def default_observer() -> TracingObserver:
    """The observer on the global tracer provider (created on first use)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = TracingObserver()
        return _default


@hookimpl
def aion_trio_observe(event: aion_trio.ObserverEvent) -> None:
    """The entry-point hook: spans on the global tracer provider."""
    default_observer().aion_trio_observe(event)


@hookimpl
def aion_trio_start_headers(start: aion_trio.RunStart) -> Mapping[str, str] | None:
    """The entry-point hook: the new run's parent context, with the global propagator."""
    return default_observer().aion_trio_start_headers(start)
