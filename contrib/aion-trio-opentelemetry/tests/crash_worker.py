"""A traced engine that a test SIGKILLs mid-run (the first process of the crash test).

``python crash_worker.py DB SPANS``: opens an engine on the SQLite file ``DB``,
starts ``two_steps`` inside a caller's span, and once its first activity's
result is durable (the run publishes it next, then waits for the signal ``go``) prints ``READY``
and waits to be killed.  Finished spans are written to ``SPANS``, one JSON
object per line, as they end.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

import trio
from aion_trio_opentelemetry import TracingObserver
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

import aion_trio as aion


@aion.activity
async def step(n: int) -> int:
    await trio.lowlevel.checkpoint()
    return n + 1


@aion.workflow
async def two_steps(ctx: aion.WorkflowContext) -> int:
    first = await ctx.run(step, 1)
    await ctx.set_event("first", first)  # recorded after the step's result
    await ctx.wait_signal("go")
    return await ctx.run(step, first)


def span_record(span: ReadableSpan) -> dict[str, object]:
    """What the test compares of a span, in both processes."""
    context = span.get_span_context()
    assert context is not None
    return {
        "name": span.name,
        "trace_id": f"{context.trace_id:032x}",
        "span_id": f"{context.span_id:016x}",
        "parent_id": f"{span.parent.span_id:016x}" if span.parent is not None else None,
        "attributes": dict(span.attributes or {}),
    }


class FileExporter(SpanExporter):
    """Appends each finished span to a file (flushed at once: the process gets SIGKILLed)."""

    def __init__(self, path: Path) -> None:
        self._path = path

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with self._path.open("a", encoding="utf-8") as out:
            for span in spans:
                out.write(json.dumps(span_record(span)) + "\n")
        return SpanExportResult.SUCCESS


async def main(db: str, spans: str) -> None:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(FileExporter(Path(spans))))
    tracer = provider.get_tracer("crash-test")
    async with aion.open_engine(
        f"sqlite:///{db}", workflows=[two_steps], activities=[step], observers=[TracingObserver(provider)]
    ) as engine:
        with tracer.start_as_current_span("request"):
            await engine.start(two_steps, workflow_id="crashy")
        assert await engine.get_event("crashy", "first", timeout=60) == 2
        print("READY", flush=True)
        await trio.sleep_forever()


if __name__ == "__main__":
    trio.run(main, sys.argv[1], sys.argv[2])
