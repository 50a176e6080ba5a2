"""SQLite store append throughput against the raw SQLite commit rate.

Usage::

    python bench/store_append.py [--dir DIR] [--seconds S]

For each durability level (``synchronous=FULL``, then ``NORMAL``), in one run
and on one file system (``--dir``, default a fresh temporary directory):

(a) ``raw``: single-row commits with apsw and the store's pragmas (WAL, the
    same ``synchronous``, ``busy_timeout`` and WAL auto-checkpoint), each its own
    ``BEGIN IMMEDIATE`` ... ``COMMIT``: the physical limit of one-at-a-time
    durable writes;
(b) ``store``: ``events.append`` throughput with 1, 16 and 256 concurrent
    workflows, each appending 3-event batches in a loop (each ``append``
    awaited before the next, as the recorder does).

(c) ``floor``: round trips of an empty write (``remove_timer`` of a timer
    that does not exist: a ``BEGIN IMMEDIATE`` ... ``COMMIT`` that writes no
    page, so no fsync) through the store, one at a time: what the store adds
    to a commit.  Alone on an idle loop such a write commits inline, on the
    Trio thread (the store's ``inline_commits``); with ``?inline_commits=off``
    it would be handed to the writer thread and back.  One writer's append
    pays it on top of its commit, so
    ``raw period / (raw period + floor period)`` bounds the 1-writer ratio.

Prints one JSON line per result: events/s, appends/s, commits/s and the
ratios to (a), and for (b) the process CPU time per append
(``cpu_us_per_append``: both threads, Trio and writer; it moves far less with
the machine's load than the rates do, so it is the number to compare across
runs on a shared machine).  The ``environment`` and closing ``load`` lines
carry the 1-minute load average.  The disk's fsync latency drifts while other processes use it,
so each (b) measurement runs in ROUNDS slices with (a) sampled before, between
and after them (the store stays open, idle, meanwhile), and each ratio uses
the mean of those samples (``raw_commits_per_s`` in the line); the ``raw``
line summarises every sample of that level.  Targets (FULL): 256 writers: events/s >= 5x raw commits/s;
1 writer: appends/s >= 0.7x raw commits/s.  Not part of the test run.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta, timezone

import apsw
import trio

import aion_trio
import aion_trio.plugin
from aion_trio import ActivityCompleted, ActivityScheduled, ActivityStarted, Event, OwnerIdentity, Payload
from aion_trio_sqlite import DEFAULT_BUSY_TIMEOUT, DEFAULT_WAL_AUTOCHECKPOINT, open_sqlite_store

WRITERS = (1, 16, 256)
BATCH = 3
# Store slices per measurement, each bracketed by raw slices (ROUNDS + 1 of them).
ROUNDS = 3
TARGETS = {1: ("appends_ratio", 0.7), 256: ("events_ratio", 5.0)}


def emit(record: dict[str, object]) -> None:
    print(json.dumps({"bench": "store_append", **record}), flush=True)


def raw_commits_per_s(path: str, synchronous: str, seconds: float) -> float:
    """Single-row commits per second with the store's pragmas, appending to the file at ``path``."""
    conn = apsw.Connection(path)
    conn.set_busy_timeout(round(DEFAULT_BUSY_TIMEOUT * 1000))
    conn.wal_autocheckpoint(DEFAULT_WAL_AUTOCHECKPOINT)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = FULL" if synchronous == "FULL" else "PRAGMA synchronous = NORMAL")
    conn.execute(
        "CREATE TABLE IF NOT EXISTS events (workflow_id TEXT NOT NULL, seq INTEGER NOT NULL,"
        " recorded_at INTEGER NOT NULL, type TEXT NOT NULL, data TEXT NOT NULL,"
        " PRIMARY KEY (workflow_id, seq)) WITHOUT ROWID"
    )
    data = '{"activity_id":0,"result":"receipt-1","attempt":1}'
    first = conn.execute("SELECT coalesce(max(seq), 0) FROM events WHERE workflow_id = 'raw'").fetchall()[0][
        0
    ]
    n = 0
    start = time.perf_counter()
    deadline = start + seconds
    while True:
        conn.execute("BEGIN IMMEDIATE")
        n += 1
        conn.execute(
            "INSERT INTO events VALUES (?, ?, ?, ?, ?)",
            ("raw", first + n, 1_700_000_000_000_000 + n, "ActivityCompleted", data),
        )
        conn.execute("COMMIT")
        if n % 64 == 0 and time.perf_counter() >= deadline:
            break
    elapsed = time.perf_counter() - start
    conn.close()
    return n / elapsed


def _bodies(i: int) -> tuple[ActivityScheduled, ActivityStarted, ActivityCompleted]:
    return (
        ActivityScheduled(
            activity_id=i, activity_type="charge", input=Payload.of({"order": i, "amount": 12.5})
        ),
        ActivityStarted(activity_id=i, attempt=1),
        ActivityCompleted(activity_id=i, result=Payload.of({"receipt": f"r-{i}"}), attempt=1),
    )


async def _claim(store: aion_trio.plugin.OwnedStore) -> None:
    # As an engine does: an owned store checks its claim in every write transaction.
    await store.claim_owner(
        OwnerIdentity.current(), now=datetime.now(timezone.utc), stale_after=timedelta(seconds=30)
    )


async def store_run(
    path: str, synchronous: str, writers: int, seconds: float, between: Callable[[], Awaitable[float]]
) -> tuple[dict[str, float], list[float]]:
    """Append for ``seconds`` in ROUNDS slices, calling ``between`` (a raw slice) before, between and after.

    Returns the store's rates and the raw rates ``between`` returned.  The
    store stays open across slices; each workflow keeps its head (a cancelled
    append either wrote nothing or returned normally, so the head stays right).
    """
    url = "sqlite:///" + path + ("?synchronous=NORMAL" if synchronous == "NORMAL" else "")
    appended = 0
    bodies = [_bodies(i) for i in range(64)]
    now = datetime.now(timezone.utc)
    heads = [0] * writers

    async def workflow(w: int) -> None:
        nonlocal appended
        wid = f"wf-{w}"
        while True:
            head = heads[w]
            batch = [
                Event(workflow_id=wid, seq=head + k + 1, recorded_at=now, body=body)
                for k, body in enumerate(bodies[(head // BATCH) % 64])
            ]
            await store.events.append(wid, batch, head)
            heads[w] = head + BATCH
            appended += 1

    raw: list[float] = []
    elapsed = cpu = 0.0
    commits = events = 0
    async with open_sqlite_store(url) as store:
        await _claim(store)
        raw.append(await between())
        for _ in range(ROUNDS):
            before = store.events.statistics()
            cpu_start = time.process_time()
            start = trio.current_time()
            with trio.move_on_after(seconds / ROUNDS):
                async with trio.open_nursery() as nursery:
                    for w in range(writers):
                        nursery.start_soon(workflow, w)
            elapsed += trio.current_time() - start
            cpu += time.process_time() - cpu_start
            after = store.events.statistics()
            commits += after.commits - before.commits
            events += after.events - before.events
            raw.append(await between())
    result = {
        "events_per_s": events / elapsed,
        "appends_per_s": appended / elapsed,
        "commits_per_s": commits / elapsed,
        "appends_per_commit": appended / max(commits, 1),
        "cpu_us_per_append": 1e6 * cpu / max(appended, 1),
    }
    return result, raw


async def floor_run(path: str, synchronous: str, seconds: float) -> float:
    """Empty-write round trips per second through the store's writer thread."""
    url = "sqlite:///" + path + ("?synchronous=NORMAL" if synchronous == "NORMAL" else "")
    async with open_sqlite_store(url) as store:
        await _claim(store)
        n = 0
        start = trio.current_time()
        deadline = start + seconds
        while True:
            await store.events.remove_timer("floor", "named:absent")
            n += 1
            if n % 64 == 0 and trio.current_time() >= deadline:
                break
        return n / (trio.current_time() - start)


async def raw_slice(directory: str, synchronous: str, seconds: float, samples: list[float]) -> float:
    # One file per durability level, appended to by every slice: past its
    # first slices its WAL has grown and is reused after each checkpoint, so
    # commits no longer extend the file (an fsync that also has to persist
    # a new file size is slower).  The store's file gets there during its run.
    path = os.path.join(directory, f"raw-{synchronous.lower()}.db")
    rate = await trio.to_thread.run_sync(raw_commits_per_s, path, synchronous, seconds)
    samples.append(rate)
    return rate


async def main_async(directory: str, seconds: float) -> None:
    emit(
        {
            "kind": "environment",
            "python": platform.python_version(),
            "apsw": apsw.apsw_version(),
            "sqlite": apsw.sqlite_lib_version(),
            "aion_trio": aion_trio.__version__,
            "cpus": os.cpu_count(),
            "dir": directory,
            "seconds": seconds,
            "load_1min": round(os.getloadavg()[0], 2),
        }
    )
    for synchronous in ("FULL", "NORMAL"):
        level = synchronous.lower()
        raw_samples: list[float] = []

        # The disk's fsync latency drifts (other processes share it), so every
        # store measurement is bracketed by raw slices and compared with their mean.
        results = []
        for writers in WRITERS:
            between = functools.partial(
                raw_slice, directory, synchronous, seconds / (ROUNDS + 1), raw_samples
            )
            path = os.path.join(directory, f"store-{level}-{writers}.db")
            result, raw = await store_run(path, synchronous, writers, seconds, between)
            results.append((writers, result, sum(raw) / len(raw)))
        floor = await floor_run(os.path.join(directory, f"floor-{level}.db"), synchronous, seconds / 2)
        emit(
            {
                "kind": "raw",
                "synchronous": synchronous,
                "commits_per_s": round(sum(raw_samples) / len(raw_samples), 1),
                "min": round(min(raw_samples), 1),
                "max": round(max(raw_samples), 1),
                "slices": len(raw_samples),
            }
        )
        raw_mean = sum(raw_samples) / len(raw_samples)
        emit(
            {
                "kind": "floor",
                "synchronous": synchronous,
                "empty_writes_per_s": round(floor, 1),
                "empty_write_us": round(1e6 / floor, 1),
                # One writer cannot beat raw commits + this round trip.
                "appends_ratio_bound": round((1 / raw_mean) / (1 / raw_mean + 1 / floor), 2),
            }
        )
        for writers, result, reference in results:
            record: dict[str, object] = {
                "kind": "store",
                "synchronous": synchronous,
                "writers": writers,
                "batch": BATCH,
                **{k: round(v, 1) for k, v in result.items()},
                "raw_commits_per_s": round(reference, 1),
                "events_ratio": round(result["events_per_s"] / reference, 2),
                "appends_ratio": round(result["appends_per_s"] / reference, 2),
                "commits_ratio": round(result["commits_per_s"] / reference, 2),
            }
            if synchronous == "FULL" and writers in TARGETS:
                key, target = TARGETS[writers]
                record["target"] = f"{key} >= {target}"
                record["target_met"] = record[key] >= target  # type: ignore[operator]
            emit(record)
    emit({"kind": "load", "load_1min": round(os.getloadavg()[0], 2)})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", help="directory for the database files (default: a fresh temporary one)")
    parser.add_argument("--seconds", type=float, default=3.0, help="duration of each measurement")
    args = parser.parse_args(argv)
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
        directory = tempfile.mkdtemp(prefix="aion-bench-", dir=args.dir)
    else:
        directory = tempfile.mkdtemp(prefix="aion-bench-")
    try:
        trio.run(main_async, directory, args.seconds)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
