"""Memory over a long stream of short workflows, and the memory store's append cost (issue 17).

Usage::

    python bench/memory_stream.py [--dir DIR] [--seconds S] [--workflows 20000] [--store sqlite|memory]

``stream``: one engine (SQLite in ``--dir`` by default, or ``memory://``) runs
``--warmup`` short workflows (one activity each), then ``--workflows`` more,
100 in flight; the resident set (``/proc/self/statm``) is sampled after the
warm-up and at each tenth of the stream.  ``growth_mib`` is the last sample
minus the first: flat after warm-up is the goal (< 20 MiB for 20,000).

``append``: the memory store's ``append`` of one event to a history already
``L`` events long, for growing ``L`` (microseconds per append, the mean of
1,000 appends at each length): flat in ``L`` when an append does not copy the
history.

A tiny budget (``--seconds 0.2``) runs 500 workflows and short histories.  The
script runs unchanged on an older checkout (use that checkout's interpreter).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from datetime import datetime, timezone
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import emitter, run_in_scratch

emit = emitter("memory_stream")

IN_FLIGHT = 100
SAMPLES = 10


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def stream(args: argparse.Namespace, directory: str) -> None:
    import trio

    import aion_trio as aion

    @aion.activity(name="touch")
    async def touch(x: int) -> int:
        return x + 1

    @aion.workflow(name="short")
    async def short(ctx: aion.WorkflowContext, x: int) -> int:
        return int(await ctx.run(touch, x))

    total = args.workflows if args.seconds >= 10 else min(args.workflows, 500)
    warmup = args.warmup if args.seconds >= 10 else min(args.warmup, 100)
    url = f"sqlite:///{directory}/stream.db" if args.store == "sqlite" else "memory://"
    config = aion.EngineConfig(loop_stall_warning=None)

    async def run_block(engine: Any, first: int, count: int) -> None:
        ids = iter(range(first, first + count))

        async def worker() -> None:
            for i in ids:
                handle = await engine.start(short, i, workflow_id=f"short-{i}")
                if await handle.result() != i + 1:
                    raise RuntimeError(f"short-{i} returned a wrong result")

        async with trio.open_nursery() as nursery:
            for _ in range(min(IN_FLIGHT, count)):
                nursery.start_soon(worker)

    async def main() -> dict[str, Any]:
        samples: list[float] = []
        async with aion.open_engine(url, workflows=[short], activities=[touch], config=config) as engine:
            await run_block(engine, 0, warmup)
            gc.collect()
            samples.append(rss_mib())
            began = time.perf_counter()
            step = max(1, total // SAMPLES)
            done = 0
            while done < total:
                count = min(step, total - done)
                await run_block(engine, warmup + done, count)
                done += count
                gc.collect()
                samples.append(rss_mib())
            elapsed = time.perf_counter() - began
            statistics = engine.statistics()
        return {
            "kind": "stream",
            "store": args.store,
            "warmup": warmup,
            "workflows": total,
            "rss_mib_after_warmup": round(samples[0], 1),
            "rss_mib_end": round(samples[-1], 1),
            "growth_mib": round(samples[-1] - samples[0], 1),
            "rss_mib_samples": [round(s, 1) for s in samples],
            "workflows_per_s": round(total / elapsed, 1),
            "registered_leases_at_end": statistics.registered_leases,
            "loaded_recorders_at_end": statistics.loaded_recorders,
        }

    emit(trio.run(main))


def appends(args: argparse.Namespace) -> None:
    import trio

    import aion_trio as aion
    from aion_trio.events import Event, MarkerRecorded, WorkflowStarted

    lengths = (1_000, 10_000, 50_000, 100_000) if args.seconds >= 10 else (500, 2_000)
    at = datetime(2026, 1, 1, tzinfo=timezone.utc)
    value = aion.Payload.of(None)
    run_id = "00000000-0000-4000-8000-000000000001"

    async def main() -> dict[str, Any]:
        per_append: dict[str, float] = {}
        async with aion.open_store("memory://") as store:
            events = store.events
            start = WorkflowStarted(workflow_type="long", input=aion.Payload.of([]), run_id=run_id)
            await events.append("long", [Event(workflow_id="long", seq=1, recorded_at=at, body=start)], 0)
            head = 1
            for length in lengths:
                timed = 1_000
                while head < length - timed:
                    body = MarkerRecorded(name=f"m{head}", value=value)
                    await events.append(
                        "long", [Event(workflow_id="long", seq=head + 1, recorded_at=at, body=body)], head
                    )
                    head += 1
                began = time.perf_counter()
                for _ in range(timed):
                    body = MarkerRecorded(name=f"m{head}", value=value)
                    await events.append(
                        "long", [Event(workflow_id="long", seq=head + 1, recorded_at=at, body=body)], head
                    )
                    head += 1
                per_append[str(length)] = round((time.perf_counter() - began) / timed * 1e6, 2)
        values = list(per_append.values())
        return {
            "kind": "append",
            "store": "memory",
            "us_per_append_at_history_length": per_append,
            "longest_over_shortest": round(values[-1] / values[0], 2),
        }

    emit(trio.run(main))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="parent of the scratch directory")
    parser.add_argument(
        "--seconds", type=float, default=600.0, help="a budget below 10 s runs the small sizes"
    )
    parser.add_argument("--workflows", type=int, default=20_000)
    parser.add_argument("--warmup", type=int, default=2_000)
    parser.add_argument("--store", choices=("sqlite", "memory"), default="sqlite")
    args = parser.parse_args(argv)

    def body(directory: str) -> None:
        appends(args)
        stream(args, directory)

    run_in_scratch("aion-memory-stream-", args.dir, body, emit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
