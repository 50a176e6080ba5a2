"""The SQLite store (``sqlite://``): the embedded default, on apsw.

URLs
----
``sqlite:///`` followed by the path of the database file.  The path after the
third slash is taken as written: when it starts with ``/`` it is absolute
(``sqlite:////var/lib/app/aion.db`` is ``/var/lib/app/aion.db``), otherwise
it is relative to the current working directory at open time
(``sqlite:///aion.db``).  ``%XX`` escapes are decoded (write ``?`` and ``#``
as ``%3F`` and ``%23``).  The file is created if missing; its directory must
exist.  Query options: ``?synchronous=NORMAL`` trades the durability of the
last commits on power loss for speed; the default is ``FULL``.  ``?mode=ro``
opens an existing aion_trio database for reading only: a missing file is a
:class:`~aion_trio.StorePathError` (nothing is created), an empty or foreign
file is refused, nothing is migrated, and a write is refused with
:class:`~aion_trio.StorePathError` (the ``aion-trio`` CLI's read-only commands
open stores this way); ``mode=rw`` is the default.  Anything else is refused
with :class:`~aion_trio.InvalidStoreUrl`.

Durability and the file
-----------------------
WAL journal; ``synchronous=FULL`` unless the URL opts into ``NORMAL``; writes
in ``BEGIN IMMEDIATE`` transactions; ``busy_timeout`` on every connection
(default 5 s, :func:`open_sqlite_store` ``busy_timeout=``).  The file is
stamped with ``PRAGMA application_id`` = :data:`APPLICATION_ID` and its schema
version is ``PRAGMA user_version``, advanced by numbered migrations, each in
one transaction.  A file that is not ours is refused before anything is
written to it.

Threads
-------
No database call runs on the Trio thread.  One writer thread owns the only
writing connection and *group-commits*: every write queued while a commit
is in flight goes into the next transaction, and each ``append`` returns only
once its own batch is committed.  A few reader threads (two by default) each
own a read connection.  A Trio task hands its request over and parks; a
request cancelled before a thread took it is withdrawn (nothing happened), one
already taken completes and the call returns normally.

apsw 3.54 has an async mode with a Trio controller (``Connection.as_async``,
``apsw.aio.Trio``).  Measured here (2 vCPUs, 5000 sequential one-row reads):
apsw async mode 2,500-2,900 calls/s, ``trio.to_thread.run_sync`` with a
``CapacityLimiter(1)`` 5,500 calls/s, a dedicated thread woken directly
7,000-12,800 calls/s.  It was not chosen: it is the slowest of the three, and
its cancellation interrupts the statement in progress, which breaks the
append contract and would let one caller's cancellation abort a transaction
that a whole group shares.

Throughput (``bench/store_append.py``, 2 vCPUs, ext4 on a virtio disk shared
with other jobs; 3-event batches; ratios against raw single-row commits with
the same pragmas, sampled right before and after each run)::

    synchronous=FULL   raw 7,900 commits/s (5,900-8,800 across the run)
      1 writer     2,520 appends/s   0.33x raw    (1 append per commit)
      16 writers  10,000 appends/s   30,000 events/s   3.4x raw
      256 writers 11,200 appends/s   33,500 events/s   4.6x raw  (4.2x-7.0x over runs)
    synchronous=NORMAL raw 72,000 commits/s
      1 writer     6,500 appends/s;  256 writers 35,700 events/s

Group commit makes 256 writers CPU-bound (~35,000 events/s whatever the
disk); about half of the Trio thread's time then goes to encoding events
(``body_data_json``).  One writer is latency-bound: an append waits for
two cross-thread wake-ups (measured 70-100 us per round trip on this VM,
against 115 us for a whole raw commit) plus encoding and its own, larger
commit (three larger rows: about twice the WAL bytes of a raw one-row
commit), so it reaches 0.33x of raw here, short of the 0.7x target; it was
0.56x in a run where other jobs slowed fsync to ~4 ms.
"""

from __future__ import annotations

from aion_trio.plugin import StoreRegistry, hookimpl

from ._schema import APPLICATION_ID as APPLICATION_ID, SCHEMA_VERSION as SCHEMA_VERSION
from ._store import (
    DEFAULT_BUSY_TIMEOUT as DEFAULT_BUSY_TIMEOUT,
    SqliteEventStore as SqliteEventStore,
    SqliteStore as SqliteStore,
    SqliteVisibilityStore as SqliteVisibilityStore,
    open_sqlite_store as open_sqlite_store,
)
from ._threads import WriterStatistics as WriterStatistics
from ._url import SqliteUrl as SqliteUrl, parse_sqlite_url as parse_sqlite_url

__all__ = [
    "APPLICATION_ID",
    "DEFAULT_BUSY_TIMEOUT",
    "SCHEMA_VERSION",
    "SqliteEventStore",
    "SqliteStore",
    "SqliteUrl",
    "SqliteVisibilityStore",
    "WriterStatistics",
    "open_sqlite_store",
    "parse_sqlite_url",
]

for _obj in (SqliteEventStore, SqliteStore, SqliteVisibilityStore, SqliteUrl, WriterStatistics):
    _obj.__module__ = __name__
del _obj


@hookimpl
def aion_trio_register_stores(registry: StoreRegistry) -> None:
    registry.add(
        "sqlite",
        open_sqlite_store,
        description="SQLite file (sqlite:////abs/path.db or sqlite:///rel.db; ?synchronous=NORMAL to trade durability for speed; ?mode=ro to only read)",
    )
