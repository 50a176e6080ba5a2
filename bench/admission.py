"""Admission control: many starts at once, and the event loop's lag meanwhile (issue 17).

Usage::

    python bench/admission.py [--dir DIR] [--seconds S] [--starts 20000] [--store sqlite|memory]
    python bench/admission.py --modes timeouts [--timeout 0.5] [--starts 20000]

``--starts`` tasks call ``engine.start`` at the same moment (a short workflow:
one activity), then wait for its result.  A ticker task sleeps 5 ms at a time
and records how late each wake-up is: the event loop's lag, which every
timer, heartbeat and lease renewal of the engine suffers too.  One ``lag``
line per mode:

- ``unlimited``: no admission limits (the engine before ``EngineConfig``'s
  ``max_inflight_starts`` / ``max_inflight_activities``, or both set to ``None``);
- ``limited``: ``max_inflight_starts`` and ``max_inflight_activities`` set
  (``--limit``); on a checkout without them the line says ``unsupported``;
- ``timeouts`` (not run unless named in ``--modes``): ``--starts`` starts wait
  behind a full start pool (``max_inflight_starts=1``, its one slot held by a
  start whose append never returns) with ``admission_timeout`` ``--timeout``
  seconds, so all of them give up at about the same moment: the line gives the
  loop's longest stall meanwhile (``lag_max_ms``, ``cpu_lag_max_ms``) and the
  seconds from the deadline until the last of them was refused (``all_refused_s``);
  each waiter that leaves costs the pool's queue its removal;
- ``floor``: the same burst (20,000 tasks spawned in one loop, each run once in
  one Trio batch) with a no-op in place of ``engine.start`` and ``result``: what
  the harness costs the loop alone, so that the engine's share shows beside it.

Figures: lag p50/p99/max in ms; the same from the Trio thread's CPU time
(``cpu_lag_*``: its CPU time over each tick beyond the tick, about the lag the
burst would cause on an idle machine, since the wall lag also counts the turns
of other processes on a shared one); the time until every start returned and until
every workflow finished, starts/s, and the cycle collector's longest pause and
total time during the burst (``gc.callbacks``), the collections and longest
pause by generation, also in the collecting thread's CPU time (``thread_time``:
what the pause costs on an idle machine; wall pauses grow with the load): a full collection stops the loop
too, for longer the more objects the process holds.  Goal: p99 < 50 ms for 20,000 starts with
limits.  A tiny budget (``--seconds 0.2``) runs 500 starts.  The script runs
unchanged on an older checkout (use that checkout's interpreter).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import emitter, percentile, run_in_scratch

emit = emitter("admission")

TICK = 0.005


class LoopProfile:
    """A Trio instrument (``--profile``): the longest task steps by task name, and the
    batches of task steps the loop ran between two I/O waits (one batch is one stall
    of every timer: its length is what the ticker sees)."""

    def __init__(self) -> None:
        self.step_began = time.perf_counter()
        self.batch_began: float | None = None
        self.batch_steps = 0
        self.batch_names: dict[str, float] = {}
        self.by_name: dict[str, list[float]] = {}  # name -> [steps, seconds, longest]
        self.batches: list[tuple[float, int, dict[str, float]]] = []
        self.summary_at_end: dict[str, Any] = {}

    def after_io_wait(self, timeout: float) -> None:
        self.batch_began = time.perf_counter()
        self.batch_steps = 0
        self.batch_names = {}

    def before_io_wait(self, timeout: float) -> None:
        if self.batch_began is not None:
            self.batches.append((time.perf_counter() - self.batch_began, self.batch_steps, self.batch_names))
        self.batch_began = None

    def before_task_step(self, task: Any) -> None:
        self.step_began = time.perf_counter()

    def after_task_step(self, task: Any) -> None:
        took = time.perf_counter() - self.step_began
        name = task.name.rsplit(".", 1)[-1]
        figures = self.by_name.setdefault(name, [0, 0.0, 0.0])
        figures[0] += 1
        figures[1] += took
        figures[2] = max(figures[2], took)
        self.batch_steps += 1
        self.batch_names[name] = self.batch_names.get(name, 0.0) + took

    def summary(self) -> dict[str, Any]:
        longest = sorted(self.batches, key=lambda b: b[0], reverse=True)[:8]
        durations = sorted(b[0] for b in self.batches) or [0.0]
        return {
            "batches": len(self.batches),
            "batch_p99_ms": round(percentile(durations, 0.99) * 1000, 1),
            "longest_batches": [
                {
                    "ms": round(took * 1000, 1),
                    "steps": steps,
                    "top_ms": {
                        k: round(v * 1000, 1)
                        for k, v in sorted(names.items(), key=lambda kv: kv[1], reverse=True)[:4]
                    },
                }
                for took, steps, names in longest
            ],
            "tasks_by_seconds": {
                name: {"steps": int(f[0]), "s": round(f[1], 2), "longest_ms": round(f[2] * 1000, 1)}
                for name, f in sorted(self.by_name.items(), key=lambda kv: kv[1][1], reverse=True)[:10]
            },
        }


def measure_timeouts(args: argparse.Namespace, directory: str) -> dict[str, Any]:
    """``--starts`` starts behind a full pool all time out at once: the loop's longest stall."""
    import trio
    import trio.testing

    import aion_trio as aion

    record: dict[str, Any] = {"kind": "lag", "mode": "timeouts", "store": args.store}
    starts = args.starts if args.seconds >= 10 else min(args.starts, 500)
    url = f"sqlite:///{directory}/admission-timeouts.db" if args.store == "sqlite" else "memory://"
    held = trio.Event()

    class HeldEvents:
        """The store's events; the append of the workflow ``holder`` waits until the end."""

        def __init__(self, inner: Any) -> None:
            self.inner = inner

        async def append(self, workflow_id: str, events: Any, expected_seq: int) -> None:
            if workflow_id == "holder":
                await held.wait()
            await self.inner.append(workflow_id, events, expected_seq)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

    class HeldStore:
        def __init__(self, inner: Any) -> None:
            self.events = HeldEvents(inner.events)
            self.visibility = inner.visibility

        async def aclose(self) -> None:
            await trio.lowlevel.checkpoint()

    @aion.workflow(name="short")
    async def short(ctx: aion.WorkflowContext, x: int) -> int:
        return x

    config = aion.EngineConfig(max_inflight_starts=1, admission_timeout=args.timeout, loop_stall_warning=None)
    lags: list[float] = []
    cpu_lags: list[float] = []

    async def ticker(stop: trio.Event) -> None:
        while not stop.is_set():
            due = time.perf_counter() + TICK
            cpu = time.thread_time()
            await trio.sleep(TICK)
            lags.append(max(0.0, time.perf_counter() - due))
            cpu_lags.append(max(0.0, time.thread_time() - cpu - TICK))

    async def main() -> None:
        refused = 0
        last_refused = [0.0]

        async def one(i: int) -> None:
            nonlocal refused
            try:
                await engine.start(short, i, workflow_id=f"late-{i}")
            except aion.AdmissionTimeout:
                refused += 1
                last_refused[0] = time.perf_counter()

        async def hold(engine: Any) -> None:
            await (await engine.start(short, -1, workflow_id="holder")).result()

        async with (
            aion.open_store(url) as inner,
            aion.open_engine(HeldStore(inner), workflows=[short], config=config) as engine,
            trio.open_nursery() as outer,
        ):
            outer.start_soon(hold, engine)
            await trio.testing.wait_all_tasks_blocked()
            async with trio.open_nursery() as nursery:
                for i in range(starts):
                    nursery.start_soon(one, i)
                await trio.testing.wait_all_tasks_blocked()
                deadline = time.perf_counter() + args.timeout  # about: they queued by now
                stop = trio.Event()
                lags.clear()
                cpu_lags.clear()
                outer.start_soon(ticker, stop)
            stop.set()
            held.set()
        lags.sort()
        cpu_lags.sort()
        record.update(
            starts=starts,
            timeout_s=args.timeout,
            refused=refused,
            all_refused_s=round(max(0.0, last_refused[0] - deadline), 3),
            lag_max_ms=round(lags[-1] * 1000, 1),
            cpu_lag_max_ms=round(cpu_lags[-1] * 1000, 1),
            stalls_over_50ms=sum(lag > 0.05 for lag in lags),
            ticks=len(lags),
        )

    trio.run(main)
    return record


def measure(args: argparse.Namespace, directory: str, mode: str) -> dict[str, Any]:
    if mode == "timeouts":
        return measure_timeouts(args, directory)
    import attrs
    import trio
    import trio.testing

    import aion_trio as aion

    fields = {f.name for f in attrs.fields(aion.EngineConfig)}
    record: dict[str, Any] = {"kind": "lag", "mode": mode, "store": args.store}
    settings: dict[str, Any] = {"loop_stall_warning": None}
    if mode == "floor":
        pass  # the harness alone: the engine is opened, but the burst never calls it
    elif "max_inflight_starts" in fields:
        limit = args.limit if mode == "limited" else None
        settings.update(max_inflight_starts=limit, max_inflight_activities=limit)
        record["limit"] = limit
    elif mode == "limited":
        return {**record, "unsupported": "this checkout's EngineConfig has no admission limits"}

    @aion.activity(name="touch")
    async def touch(x: int) -> int:
        return x + 1

    @aion.workflow(name="short")
    async def short(ctx: aion.WorkflowContext, x: int) -> int:
        return int(await ctx.run(touch, x))

    starts = args.starts if args.seconds >= 10 else min(args.starts, 500)
    url = f"sqlite:///{directory}/admission-{mode}.db" if args.store == "sqlite" else "memory://"
    for key, value in json.loads(args.config).items():
        if key not in fields:
            return {**record, "unsupported": f"this checkout's EngineConfig has no {key}"}
        settings[key] = tuple(value) if isinstance(value, list) else value
    if args.config != "{}":
        record["config"] = json.loads(args.config)
    config = aion.EngineConfig(**settings)
    lags: list[float] = []
    pauses: list[float] = []  # the cycle collector's pauses during the burst
    gc_began = [0.0, 0.0]
    by_generation: list[list[float]] = [[], [], []]
    cpu_by_generation: list[list[float]] = [[], [], []]  # the collecting thread's CPU time

    def gc_timer(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            gc_began[:] = time.perf_counter(), time.thread_time()
        else:
            pauses.append(time.perf_counter() - gc_began[0])
            by_generation[info["generation"]].append(pauses[-1])
            cpu_by_generation[info["generation"]].append(time.thread_time() - gc_began[1])

    cpu_lags: list[float] = []

    async def ticker(stop: trio.Event) -> None:
        while not stop.is_set():
            due = time.perf_counter() + TICK
            cpu = time.thread_time()
            await trio.sleep(TICK)
            lags.append(max(0.0, time.perf_counter() - due))
            # The Trio thread's own CPU time over the tick, beyond the tick: about the
            # lag on an idle machine (the wall lag also counts other processes' turns).
            cpu_lags.append(max(0.0, time.thread_time() - cpu - TICK))

    profile = LoopProfile() if args.profile else None

    async def main() -> None:
        started_all: list[float] = []

        async with aion.open_engine(url, workflows=[short], activities=[touch], config=config) as engine:
            # Warm up the paths (imports, the first commits) before the burst.
            for i in range(20):
                await (await engine.start(short, i, workflow_id=f"warm-{i}")).result()
            stop = trio.Event()
            returned = 0
            async with trio.open_nursery() as outer:
                outer.start_soon(ticker, stop)
                await trio.sleep(TICK * 4)
                began = time.perf_counter()
                gc.callbacks.append(gc_timer)
                if profile is not None:
                    profile.__init__()  # type: ignore[misc]  # the burst only, not the warm-up

                async def one(i: int) -> None:
                    nonlocal returned
                    if mode == "floor":
                        # The same task, spawn and bookkeeping with a no-op for the
                        # engine's start and result: what the harness costs alone.
                        await trio.lowlevel.checkpoint()
                        returned += 1
                        if returned == starts:
                            started_all.append(time.perf_counter())
                        await trio.lowlevel.checkpoint()
                        return
                    handle = await engine.start(short, i, workflow_id=f"burst-{i}")
                    returned += 1
                    if returned == starts:
                        started_all.append(time.perf_counter())
                    if await handle.result() != i + 1:
                        raise RuntimeError(f"burst-{i} returned a wrong result")

                async with trio.open_nursery() as nursery:
                    for i in range(starts):
                        nursery.start_soon(one, i)
                finished = time.perf_counter()
                gc.callbacks.remove(gc_timer)
                if profile is not None:
                    profile.summary_at_end = profile.summary()
                stop.set()
        lags.sort()
        cpu_lags.sort()
        record.update(
            starts=starts,
            lag_p50_ms=round(percentile(lags, 0.50) * 1000, 1),
            lag_p99_ms=round(percentile(lags, 0.99) * 1000, 1),
            lag_max_ms=round(lags[-1] * 1000, 1),
            cpu_lag_p50_ms=round(percentile(cpu_lags, 0.50) * 1000, 1),
            cpu_lag_p99_ms=round(percentile(cpu_lags, 0.99) * 1000, 1),
            cpu_lag_max_ms=round(cpu_lags[-1] * 1000, 1),
            lag_p999_ms=round(percentile(lags, 0.999) * 1000, 1),
            cpu_lag_p999_ms=round(percentile(cpu_lags, 0.999) * 1000, 1),
            # Ticks late by more than the goal's 50 ms: each one a stall of every timer.
            stalls_over_50ms=sum(lag > 0.05 for lag in lags),
            cpu_stalls_over_50ms=sum(lag > 0.05 for lag in cpu_lags),
            ticks=len(lags),
            all_started_s=round(started_all[0] - began, 2),
            all_finished_s=round(finished - began, 2),
            starts_per_s=round(starts / (started_all[0] - began), 1),
            gc_pause_max_ms=round(max(pauses, default=0.0) * 1000, 1),
            gc_seconds=round(sum(pauses), 2),
            gc_collections=[len(g) for g in by_generation],
            gc_pause_max_ms_by_generation=[round(max(g, default=0.0) * 1000, 1) for g in by_generation],
            gc_cpu_pause_max_ms_by_generation=[
                round(max(g, default=0.0) * 1000, 1) for g in cpu_by_generation
            ],
            gc_cpu_seconds=round(sum(map(sum, cpu_by_generation)), 2),
        )

    trio.run(main, instruments=[profile] if profile is not None else [])
    if profile is not None:
        record["profile"] = profile.summary_at_end
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="parent of the scratch directory")
    parser.add_argument("--seconds", type=float, default=600.0, help="a budget below 10 s runs 500 starts")
    parser.add_argument("--starts", type=int, default=20_000)
    parser.add_argument("--limit", type=int, default=64, help="the limits of the 'limited' mode")
    parser.add_argument(
        "--timeout", type=float, default=0.5, help="admission_timeout of the 'timeouts' mode (seconds)"
    )
    parser.add_argument("--store", choices=("sqlite", "memory"), default="sqlite")
    parser.add_argument(
        "--modes", default="floor,unlimited,limited", help="comma-separated modes to run (also: timeouts)"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="instrument the loop: the longest batches of task steps and the costliest tasks",
    )
    parser.add_argument(
        "--config", default="{}", help="JSON: more EngineConfig settings (e.g. the gc settings)"
    )
    args = parser.parse_args(argv)

    def body(directory: str) -> None:
        for mode in args.modes.split(","):
            emit(measure(args, directory, mode))

    run_in_scratch("aion-admission-", args.dir, body, emit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
