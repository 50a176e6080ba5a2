"""A child process for the WAL crash test: appends batches to one SQLite store until killed.

Usage: python -m tests.procs.wal_writer STORE_PATH

Workflows ``w-0`` .. ``w-7`` take turns appending batches of 4 markers, each
carrying a 2 KiB string, so the WAL fills quickly.  After each ``append``
returns (durable) the process prints ``ACK <workflow> <last seq>``.
"""

from __future__ import annotations

import sys
from datetime import datetime, timedelta, timezone
from typing import Any

import trio

from aion_trio import Event, MarkerRecorded, Payload
from aion_trio_sqlite import open_sqlite_store

WORKFLOWS = 8
BATCH = 4
T0 = datetime(2041, 5, 6, tzinfo=timezone.utc)


def marker(workflow_id: str, seq: int) -> Event:
    """The event at ``seq`` of ``workflow_id`` (the test rebuilds it to compare)."""
    return Event(
        workflow_id=workflow_id,
        seq=seq,
        recorded_at=T0 + timedelta(microseconds=seq),
        body=MarkerRecorded(name=f"{workflow_id}-{seq}", value=Payload.of({"pad": f"{seq:06d}" * 341})),
    )


async def main(path: str, **options: Any) -> None:
    """Append until killed; ``options`` go to ``open_sqlite_store``."""
    heads = [0] * WORKFLOWS
    async with open_sqlite_store(f"sqlite:///{path}", **options) as store:
        while True:
            for w in range(WORKFLOWS):
                wid = f"w-{w}"
                batch = [marker(wid, heads[w] + k + 1) for k in range(BATCH)]
                await store.events.append(wid, batch, heads[w])
                heads[w] += BATCH
                print(f"ACK {wid} {heads[w]}", flush=True)


if __name__ == "__main__":
    trio.run(main, sys.argv[1])
