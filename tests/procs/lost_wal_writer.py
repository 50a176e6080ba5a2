"""A child process for the lost-WAL test: appends batches to one SQLite store until killed.

Usage: python -m tests.procs.lost_wal_writer STORE_PATH

As ``wal_writer``, but the writer never checkpoints (every acknowledged batch
lives only in the ``-wal`` file) and the store's guard checks the ``-wal``
and updates its mark every 20 ms.
"""

from __future__ import annotations

import sys

import trio

from aion_trio_sqlite import _walguard, open_sqlite_store

from .wal_writer import BATCH, WORKFLOWS, marker


async def main(path: str) -> None:
    heads = [0] * WORKFLOWS
    async with open_sqlite_store(f"sqlite:///{path}", wal_autocheckpoint=10**9) as store:
        while True:
            for w in range(WORKFLOWS):
                wid = f"w-{w}"
                batch = [marker(wid, heads[w] + k + 1) for k in range(BATCH)]
                await store.events.append(wid, batch, heads[w])
                heads[w] += BATCH
                print(f"ACK {wid} {heads[w]}", flush=True)


if __name__ == "__main__":
    _walguard.CHECK_INTERVAL = 0.02
    trio.run(main, sys.argv[1])
