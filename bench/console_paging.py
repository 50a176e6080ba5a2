"""The console's list page over a SQLite store of 100,000 workflows.

Usage::

    python bench/console_paging.py [--dir DIR] [--seconds S] [--workflows N] [--fill-concurrency C]

Fills a fresh SQLite store's visibility with ``--workflows`` (100,000; 5,000 when
``--seconds`` is under 1) rows through the store's own ``visibility.upsert`` (the SQLite
store has no batch path: ``C`` (256) upserts in flight at a time, which its writer commits
together), one start time a second apart, a mix of statuses, types and a search
attribute.  Only the rows: the list page reads nothing else.  Then starts an ``aion-trio
console --read-only`` subprocess on the file and times, over HTTP for ``--seconds`` (2)
each, the list pages a browser asks for: the first page, a page deep in (the keyset
cursor of the row half-way down), the first page filtered by a status, and the same
filtered by a search attribute.  Every list page carries the counts per status and the
total: their cost is in each figure; a ``counts`` line times them apart, in process.

Prints a JSON line for the fill (rows/s), one per page kind (median and p95 ms, the
rows the page shows) and the ``counts`` line.  Not part of the test run.
"""

from __future__ import annotations

import argparse
import http.client
import os
import statistics
import subprocess
import sys
import time
import urllib.parse
from datetime import datetime, timedelta, timezone
from pathlib import Path

import trio

import aion_trio as aion

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import emitter, percentile, run_in_scratch

emit = emitter("console_paging")
T0 = datetime(2031, 1, 1, tzinfo=timezone.utc)
#: One row in this many of each status (the rest completed): a status filter has rows to page.
MIX = (
    (aion.WorkflowStatus.FAILED, 10),
    (aion.WorkflowStatus.RUNNING, 7),
    (aion.WorkflowStatus.CANCELLED, 50),
)


def _status(i: int) -> aion.WorkflowStatus:
    for status, every in MIX:
        if i % every == 0:
            return status
    return aion.WorkflowStatus.COMPLETED


def _row(i: int) -> aion.VisibilityRow:
    status = _status(i)
    start = T0 + timedelta(seconds=i)
    return aion.VisibilityRow(
        workflow_id=f"wf-{i:07d}",
        run_id=f"run-{i:07d}",
        workflow_type=("order", "refund", "ship")[i % 3],
        status=status,
        start_time=start,
        close_time=None if status is aion.WorkflowStatus.RUNNING else start + timedelta(seconds=3),
        failure_reason="declined" if status is aion.WorkflowStatus.FAILED else None,
        search_attributes={"region": ("eu", "us", "ap", "sa")[i % 4], "amount": i % 1000},
    )


async def fill(url: str, n: int, concurrency: int) -> float:
    """Write ``n`` rows through the store's upsert; the rows per second."""
    began = time.perf_counter()
    async with aion.open_store(url) as store:
        limiter = trio.Semaphore(concurrency)

        async def one(i: int) -> None:
            try:
                await store.visibility.upsert(_row(i))
            finally:
                limiter.release()

        async with trio.open_nursery() as nursery:
            for i in range(n):
                await limiter.acquire()
                nursery.start_soon(one, i)
        assert await store.visibility.count() == n
    return n / (time.perf_counter() - began)


async def time_counts(url: str, seconds: float) -> list[float]:
    """Milliseconds to count every status once (what each list page does besides its rows)."""
    took: list[float] = []
    async with aion.open_store(url) as store:
        end = time.perf_counter() + seconds
        while not took or time.perf_counter() < end:
            began = time.perf_counter()
            for status in aion.WorkflowStatus:
                await store.visibility.count(aion.VisibilityFilter(status=frozenset({status})))
            await store.visibility.count(aion.VisibilityFilter())
            took.append((time.perf_counter() - began) * 1000)
    return took


def _script() -> str:
    return str(Path(sys.executable).parent / "aion-trio")


def _login(url: str) -> tuple[str, int, str]:
    parts = urllib.parse.urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    token = urllib.parse.parse_qs(parts.query)["token"][0]
    connection = http.client.HTTPConnection(host, port, timeout=60)
    connection.request("GET", f"/?token={token}")
    response = connection.getresponse()
    response.read()
    connection.close()
    return host, port, (response.getheader("set-cookie") or "").split(";", 1)[0]


def time_page(host: str, port: int, cookie: str, path: str, seconds: float) -> tuple[list[float], int, str]:
    """Milliseconds per GET of ``path`` (at least one) for ``seconds``, the rows it shows and
    the first one's id (a deep page's shows the cursor was followed, not ignored)."""
    connection = http.client.HTTPConnection(host, port, timeout=60)
    took: list[float] = []
    rows, first = 0, ""
    end = time.perf_counter() + seconds
    try:
        while not took or time.perf_counter() < end:
            began = time.perf_counter()
            connection.request("GET", path, headers={"Cookie": cookie})
            response = connection.getresponse()
            body = response.read()
            took.append((time.perf_counter() - began) * 1000)
            if response.status != 200:
                raise SystemExit(f"GET {path}: {response.status}")
            rows = body.count(b"<tr data-id=")
            at = body.find(b'<tr data-id="')
            first = body[at + 13 : body.find(b'"', at + 13)].decode() if at >= 0 else ""
    finally:
        connection.close()
    return took, rows, first


def main(directory: str, seconds: float, n: int, concurrency: int) -> None:
    db = os.path.join(directory, "paging.db")
    url = f"sqlite:///{db}"
    rate = trio.run(fill, url, n, concurrency)
    emit({"kind": "fill", "workflows": n, "rows_per_s": round(rate), "seconds": round(n / rate, 1)})
    counts = trio.run(time_counts, url, seconds)
    emit(
        {
            "kind": "counts",
            "workflows": n,
            "median_ms": round(statistics.median(counts), 2),
            "p95_ms": round(percentile(sorted(counts), 0.95), 2),
            "samples": len(counts),
        }
    )
    console = subprocess.Popen(
        [_script(), "console", "--store", url, "--read-only", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert console.stdout is not None
        line = console.stdout.readline()
        if not line.startswith("aion-trio console on "):
            raise SystemExit(f"the console did not start: {line!r}")
        host, port, cookie = _login(line.rsplit(" ", 1)[1].strip())
        # The row half-way down (newest first): its keyset cursor is where a deep page starts.
        middle = n // 2
        cursor = f"{(T0 + timedelta(seconds=middle)).isoformat()}|wf-{middle:07d}"
        pages = {
            "first_page": "/",
            "deep_page": "/?" + urllib.parse.urlencode({"after": cursor}),
            "status_failed": "/?status=failed",
            "status_failed_deep": "/?" + urllib.parse.urlencode({"status": "failed", "after": cursor}),
            "attr_region_eu": "/?" + urllib.parse.urlencode({"attr": "region=eu"}),
        }
        for kind, path in pages.items():
            took, rows, first = time_page(host, port, cookie, path, seconds)
            emit(
                {
                    "kind": kind,
                    "workflows": n,
                    "rows_shown": rows,
                    "first_row": first,
                    "median_ms": round(statistics.median(took), 1),
                    "p95_ms": round(percentile(sorted(took), 0.95), 1),
                    "samples": len(took),
                }
            )
    finally:
        console.terminate()
        console.wait()
        if console.stdout is not None:
            console.stdout.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--dir", default=None, help="where the scratch store goes (a temp dir)")
    parser.add_argument("--seconds", type=float, default=2.0, help="how long each page is timed")
    parser.add_argument("--workflows", type=int, default=None, help="rows (100,000; 5,000 under 1 s)")
    parser.add_argument("--fill-concurrency", type=int, default=256, help="upserts in flight")
    args = parser.parse_args()
    n = args.workflows if args.workflows is not None else (100_000 if args.seconds >= 1 else 5_000)
    run_in_scratch(
        "aion-console-paging-",
        args.dir,
        lambda directory: main(directory, args.seconds, n, args.fill_concurrency),
        emit,
    )
