"""Replay speed of one long history in a fresh process (issue 17, fast replay).

Usage::

    python bench/replay.py [--steps 10000] [--stores sqlite,memory] [--repeat 3]
                           [--codecs none,zlib+aes-gcm] [--dir DIR] [--seconds S]

A workflow of ``--steps`` activity steps (each ``ctx.run(increment, value)``)
is run live on ``memory://``; it then parks on a signal that never comes, so
its history (``1 + 3 x steps`` events: the start, and each step's
``ActivityScheduled``, ``ActivityStarted``, ``ActivityCompleted``; 30,001 for
10,000 steps) belongs to a running workflow.  For SQLite the history is
copied into a fresh database file.  Then, ``--repeat`` times, a FRESH
subprocess (nothing imported, nothing compiled or cached yet) measures:

- ``fetch`` (SQLite): the rows of that history read with apsw alone (rows/s);
- ``decode`` (SQLite): those rows turned into events by the store's codec
  (events/s; ``decode_warm``: the same rows decoded a second time, the decoders
  compiled already), and ``read_history``: the store's whole read (fetch + decode);
- ``replay``: ``open_engine`` on the store until the workflow answers a query
  (a query waits until the run has replayed its history and parked): the
  recovery of the run against its whole history (events/s over that time,
  engine opening included; ``open_s`` is when ``open_engine`` returned).

For ``memory`` the subprocess builds the history itself (a named memory store
lives only in its process), closes that engine and opens a second one on the
same store: events are objects there, so only ``replay`` is measured.

``--codecs``: each store is measured once per codec configuration: ``none``
(payloads stored as their JSON text, the default engine) and ``zlib+aes-gcm``
(``EngineConfig(codecs=[ZlibCodec(), AesGcmCodec(...)])``: the history is
stored encrypted, and ``read_history`` and ``replay`` decode it through the
chain).  The JSON lines' ``store`` is ``sqlite`` or ``sqlite+zlib+aes-gcm``
(the same for memory); ``fetch`` and ``decode`` (the store's own rows) are
measured as they are.

Each ``*_per_s`` figure is over wall time; ``*_per_cpu_s`` is over the CPU
time of the process (every thread), which other processes on a shared
machine disturb less.  One JSON line per measurement, then a ``summary`` line per store and figure
(best and median of the repeats).  ``--seconds S`` below 5 shrinks the
history to a smoke run (tox's ``bench`` env); the numbers are then
meaningless.  Run it on two checkouts by pointing ``PYTHONPATH`` at each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from _common import emitter, run_in_scratch

emit = emitter("replay")
WORKFLOW_ID = "replay-bench"


CODEC_CONFIGS = ("none", "zlib+aes-gcm")


def engine_config(codec: str) -> Any:
    """The engine configuration of a ``--codecs`` name."""
    import aion_trio as aion

    if codec == "none":
        return aion.EngineConfig()
    if codec == "zlib+aes-gcm":
        key = bytes(range(32))
        return aion.EngineConfig(
            codecs=[aion.ZlibCodec(), aion.AesGcmCodec(keys={"bench": key}, current="bench")]
        )
    raise SystemExit(f"unknown codec configuration {codec!r}; use one of {', '.join(CODEC_CONFIGS)}")


def definitions() -> tuple[Any, Any]:
    import aion_trio as aion

    @aion.activity(name="increment")
    async def increment(x: int) -> int:
        return x + 1

    @aion.workflow(name="long_chain")
    async def long_chain(ctx: aion.WorkflowContext, steps: int) -> int:
        value = 0
        ctx.set_query_handler("progress", lambda: value)
        for _ in range(steps):
            value = await ctx.run(increment, value)
        await ctx.wait_signal("finish")
        return int(value)

    return long_chain, increment


async def build_history(url: str, steps: int, codec: str = "none") -> list[Any]:
    """Run the workflow live on ``url`` until it parks after its last step; its history."""
    import trio

    import aion_trio as aion

    long_chain, increment = definitions()
    config = engine_config(codec)
    async with aion.open_engine(url, workflows=[long_chain], activities=[increment], config=config) as engine:
        await engine.start(long_chain, steps, workflow_id=WORKFLOW_ID)
        # Poll: the workflow parks on a signal that never comes once its steps are done.
        for _ in range(12_000):
            if await engine.query(WORKFLOW_ID, "progress") == steps:
                break
            await trio.sleep(0.05)
        else:
            raise RuntimeError(f"the workflow did not finish its {steps} steps in 10 minutes")
        history = list(await engine.history(WORKFLOW_ID))
    expected = 1 + 3 * steps
    if len(history) != expected:
        raise RuntimeError(f"the built history has {len(history)} events, expected {expected}")
    return history


async def replay_once(url: str, steps: int, codec: str = "none") -> dict[str, float]:
    """Open an engine on ``url`` and wait until the workflow answers (it has replayed)."""
    import trio

    import aion_trio as aion

    long_chain, increment = definitions()
    config = engine_config(codec)
    began = time.perf_counter()
    cpu = time.process_time()
    async with aion.open_engine(url, workflows=[long_chain], activities=[increment], config=config) as engine:
        opened = time.perf_counter()
        with trio.fail_after(600):
            answer = await engine.query(WORKFLOW_ID, "progress")
        done = time.perf_counter()
        cpu = time.process_time() - cpu
        if answer != steps:
            raise RuntimeError(f"the replayed workflow answered {answer}, expected {steps}")
    return {"open_s": opened - began, "replay_s": done - began, "replay_cpu_s": cpu}


def child_sqlite(path: str, steps: int, codec: str = "none") -> None:
    """One fresh process on the SQLite file: fetch, decode, read_history, replay."""
    import trio

    import aion_trio as aion

    events = 1 + 3 * steps
    import apsw  # the SQLite binding the store uses

    from aion_trio_sqlite import _codec  # the store's row decoder (the decode step alone)

    conn = apsw.Connection(path, flags=apsw.SQLITE_OPEN_READONLY)
    sql = "SELECT seq, recorded_at, type, data FROM events WHERE workflow_id = ? ORDER BY seq"
    t0 = time.perf_counter()
    rows = conn.execute(sql, (WORKFLOW_ID,)).fetchall()
    t1 = time.perf_counter()
    c1 = time.process_time()
    decoded = _codec.decode_events(WORKFLOW_ID, rows, path)
    c2 = time.process_time()
    t2 = time.perf_counter()
    # Again, the decoders compiled now: the steady cost per event, without the first use's.
    c3 = time.process_time()
    _codec.decode_events(WORKFLOW_ID, rows, path)
    c4 = time.process_time()
    conn.close()
    if len(rows) != events or len(decoded) != events:
        raise RuntimeError(f"read {len(rows)} rows, decoded {len(decoded)} events, expected {events}")

    async def read_and_replay() -> dict[str, float]:
        chain = engine_config(codec).codecs
        async with aion.open_store(f"sqlite:///{path}") as store:
            events_store: Any = store.events
            if chain is not None:  # read as the engine does: through the chain
                from aion_trio._codec_store import CodecEventStore

                events_store = CodecEventStore(events_store, chain)
            began = time.perf_counter()
            history = await events_store.read_history(WORKFLOW_ID)
            read_s = time.perf_counter() - began
        if len(history) != events:
            raise RuntimeError(f"read_history gave {len(history)} events, expected {events}")
        return {"read_history_s": read_s, **await replay_once(f"sqlite:///{path}", steps, codec)}

    timings = trio.run(read_and_replay)
    print(
        json.dumps(
            {
                "events": events,
                "fetch_rows_per_s": round(events / (t1 - t0)),
                "decode_events_per_s": round(events / (t2 - t1)),
                "decode_events_per_cpu_s": round(events / max(c2 - c1, 1e-6)),
                "decode_warm_events_per_cpu_s": round(events / max(c4 - c3, 1e-6)),
                "read_history_events_per_s": round(events / timings["read_history_s"]),
                "replay_events_per_s": round(events / timings["replay_s"]),
                "replay_events_per_cpu_s": round(events / timings["replay_cpu_s"]),
                "replay_s": round(timings["replay_s"], 4),
                "open_s": round(timings["open_s"], 4),
            }
        )
    )


def child_memory(steps: int, codec: str = "none") -> None:
    """One fresh process: build the history on a named memory store, then replay it."""
    import trio

    url = "memory://replay-bench"
    events = 1 + 3 * steps

    async def build_and_replay() -> dict[str, float]:
        await build_history(url, steps, codec)
        return await replay_once(url, steps, codec)

    timings = trio.run(build_and_replay)
    print(
        json.dumps(
            {
                "events": events,
                "replay_events_per_s": round(events / timings["replay_s"]),
                "replay_events_per_cpu_s": round(events / timings["replay_cpu_s"]),
                "replay_s": round(timings["replay_s"], 4),
                "open_s": round(timings["open_s"], 4),
            }
        )
    )


def run_child(args: list[str]) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), *args], check=True, capture_output=True, text=True
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=None, help="activity steps (default 10,000)")
    parser.add_argument("--stores", default="sqlite,memory")
    parser.add_argument(
        "--codecs", default=",".join(CODEC_CONFIGS), help="codec configurations: none, zlib+aes-gcm"
    )
    parser.add_argument("--repeat", type=int, default=3, help="fresh processes per store")
    parser.add_argument("--dir", default=None)
    parser.add_argument("--seconds", type=float, default=None, help="below 5: a smoke run")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, *rest = args.child
        if kind == "sqlite":
            child_sqlite(rest[0], int(rest[1]), rest[2])
        else:
            child_memory(int(rest[0]), rest[1])
        return
    steps = args.steps
    repeat = args.repeat
    if steps is None:
        steps = 10_000
        if args.seconds is not None and args.seconds < 5:
            steps, repeat = 100, 1
    stores = [s for s in args.stores.split(",") if s]
    codecs = [c for c in args.codecs.split(",") if c]
    for codec in codecs:
        engine_config(codec)  # an unknown name is refused before anything runs

    def body(directory: str) -> None:
        import trio

        import aion_trio as aion

        emit({"kind": "setup", "steps": steps, "events": 1 + 3 * steps, "python": sys.version.split()[0]})
        results: dict[str, list[dict[str, Any]]] = {}
        for codec in codecs:
            suffix = "" if codec == "none" else f"+{codec}"
            if "sqlite" in stores:
                path = os.path.join(directory, f"replay{suffix}.db")
                chain = engine_config(codec).codecs

                async def copy(path: str, codec: str, chain: Any) -> None:
                    history = await build_history(f"memory://replay-bench-{os.getpid()}-{codec}", steps)
                    if chain is not None:  # stored as an engine with the chain writes it
                        history = [await chain.encode_event(e) for e in history]
                    async with aion.open_store(f"sqlite:///{path}") as store:
                        await store.events.append(WORKFLOW_ID, history, 0)

                trio.run(copy, path, codec, chain)
                label = f"sqlite{suffix}"
                results[label] = []
                for i in range(repeat):
                    record = run_child(["--child", "sqlite", path, str(steps), codec])
                    emit({"kind": "run", "store": label, "repeat": i, **record})
                    results[label].append(record)
            if "memory" in stores:
                label = f"memory{suffix}"
                results[label] = []
                for i in range(repeat):
                    record = run_child(["--child", "memory", str(steps), codec])
                    emit({"kind": "run", "store": label, "repeat": i, **record})
                    results[label].append(record)
        for store, records in results.items():
            for figure in records[0]:
                if figure.endswith(("_per_s", "_per_cpu_s")):
                    values = [r[figure] for r in records]
                    emit(
                        {
                            "kind": "summary",
                            "store": store,
                            "figure": figure,
                            "best": max(values),
                            "median": round(statistics.median(values)),
                        }
                    )

    run_in_scratch("aion-replay-", args.dir, body, emit)


if __name__ == "__main__":
    main()
