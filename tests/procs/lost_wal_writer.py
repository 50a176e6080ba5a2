"""A child process for the lost-WAL test: appends batches to one SQLite store until killed.

Usage: python -m tests.procs.lost_wal_writer STORE_PATH

As ``wal_writer``, but the writer never checkpoints (every acknowledged batch
lives only in the ``-wal`` file) and the store's guard checks the ``-wal``
and updates its mark every 20 ms.
"""

from __future__ import annotations

import sys
from functools import partial

import trio

from aion_trio_sqlite import _walguard

from .wal_writer import main

if __name__ == "__main__":
    _walguard.CHECK_INTERVAL = 0.02
    trio.run(partial(main, sys.argv[1], wal_autocheckpoint=10**9))
