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
last commits on power loss for speed; the default is ``FULL``.
``?inline_commits=off`` keeps every commit on the writer thread (see
*Threads*); ``on`` is the default.  ``?mode=ro``
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
(default 5 s, :func:`open_sqlite_store` ``busy_timeout=``).  The writer
thread checkpoints the WAL (``PASSIVE``, between its transactions, after the
writers of the last one were woken) once a commit leaves it holding
:data:`DEFAULT_WAL_AUTOCHECKPOINT` pages (4000, SQLite's default being 1000;
``wal_autocheckpoint=``), which bounds the WAL file at about 16 MiB plus two
group commits, plus, with ``FULL``, the zero-filled room the writer keeps past
the WAL's last frame so that a commit's fsync does not also have to journal
a growing file's size (``_walroom``: up to ~1.1 MiB).  The file is
stamped with ``PRAGMA application_id`` = :data:`APPLICATION_ID` and its schema
version is ``PRAGMA user_version``, advanced by numbered migrations, each in
one transaction.  A file that is not ours is refused before anything is
written to it.

Threads
-------
One writer thread owns the only writing connection and *group-commits*: every
write queued while a commit is in flight goes into the next transaction, and
each ``append`` returns only once its own batch is committed.  A few reader
threads (two by default) each own a read connection.  A Trio task hands its
request over and parks; a request cancelled before a thread took it is
withdrawn (nothing happened), one already taken completes and the call
returns normally.

Two exceptions keep a lone workflow from paying for the hand-over (details in
``_threads``):

* **Inline commits.**  A lone write made while the Trio run has nothing else
  to do (no runnable task, no thread result waiting) and the writer thread is
  idle commits on the Trio thread itself: the loop would only have waited for
  it, and the hand-over costs two cross-CPU wake-ups, on a 2-vCPU VM ~90-200
  us each, as much as a commit.  The loop is blocked for that commit, fsync
  included, so: the write lock is only tried (another process holding it
  sends the write to the thread, which waits); inline commits stop while the
  moving average of commit times is above 2 ms (a slow disk) and for 1 s
  after a commit over 20 ms (a stall); checkpoints and WAL upkeep stay on
  the thread.  ``?inline_commits=off`` turns them off.
  ``WriterStatistics.inline_commits`` counts them.
* **Riders.**  A visibility row (a projection of history, reconciled from
  it at recovery) needs no commit of its own: the writer holds rows queued
  alone up to 5 ms for another write to join them, and an inline commit
  takes them along.  Without this, each row cost a workflow's next append a
  commit to wait behind.  ``upsert`` still returns only once committed.

Measured on one workflow of 10 steps run alone, back to back, SQLite
``FULL`` (2 vCPUs, ext4 on virtio; two engines in one process timed in
alternating blocks of 10 runs, 30 blocks, so both see the same machine):
p50 18.1 ms with ``inline_commits=off`` against 13.0 ms on (riders and room
in both), 0.72x; in an earlier pairing, before riders, 13.0 against 11.5 ms
(0.88x): the gain is the wake-up latency, which moves with the host.  Fresh
files in alternating blocks of 60 runs, without and with WAL room: 15.0 ->
13.2 ms (0.88x).  Throughput (1,000 x 10 steps, 100 in flight) is unchanged,
inline commits applying only when the loop is idle: 1,786 / 1,613 steps/s
on against 1,603 / 1,581 off.

apsw 3.54 has an async mode with a Trio controller (``Connection.as_async``,
``apsw.aio.Trio``).  Measured here (2 vCPUs, 5000 sequential one-row reads):
apsw async mode 2,500-2,900 calls/s, ``trio.to_thread.run_sync`` with a
``CapacityLimiter(1)`` 5,500 calls/s, a dedicated thread woken directly
7,000-12,800 calls/s.  It was not chosen: it is the slowest of the three, and
its cancellation interrupts the statement in progress, which breaks the
append contract and would let one caller's cancellation abort a transaction
that a whole group shares.

Throughput (``bench/store_append.py``, 2 vCPUs shared with other jobs, ext4
on a virtio disk; 3-event batches; ratios against raw single-row commits with
the same pragmas on a warmed file, sampled before, between and after three
store slices).  Two runs while other jobs loaded both CPUs (load 5-6) and
the disk (fsync ~2-5 ms)::

    synchronous=FULL   raw 404 / 338 commits/s
      1 writer       400 / 369 appends/s    0.82x / 0.98x raw
      16 writers   5,361 / 6,417 events/s   13.2x / 21.0x raw
      256 writers 11,361 / 10,325 events/s  35.9x / 31.1x raw
    synchronous=NORMAL raw 12,516 / 10,483 commits/s
      1 writer     2,495 / 1,917 appends/s; 256 writers 12,363 / 10,571 events/s

Those ratios are easy because fsync was slow.  What the store controls is
its CPU per event and its per-append latency.  Measured A/B against the code
before this tuning, in one sitting (NORMAL, fixed work, user+sys CPU):
256 writers 60 -> 33 us per event; one writer 153 -> 84 us per event and
1.2 ms -> 0.33-0.44 ms per append.  The gains: the wire encoder writes JSON
text directly (one generated concatenation per event type), the writer
thread sleeps on a lock of its own, a lone writer's head is a plain seek (a
two-key seek since, ``_writes.SQL_AT_HEAD``), and a lone writer is woken by
a byte on a socket it waits on rather than through ``run_sync_soon`` (see
``_threads``).  At 256 writers the Trio
thread is the bottleneck: about a third is the benchmark building its
``Event`` objects, the store's ``append`` about two fifths (encoding a
quarter of that), Trio parking and waking each caller the rest.  One writer
is latency-bound: every append pays a round trip through the writer thread
(the bench's ``floor`` line, an empty write) on top of a commit.

One writer, measured again on the same 2 vCPUs with the other jobs mostly
idle (load 0.5-1; the disk's interrupts go to CPU 1; an idle vCPU halts, and
waking a thread on the other vCPU takes ~45 us, ~52 us through epoll, between
two C threads too).  Two bench runs of this version, alternated with two of
the version before (lone appends check their head with ``SQL_AT_HEAD``; a
listener's byte is drained by the next listener)::

    synchronous=FULL   raw 3,368 / 3,805 commits/s
      1 writer   2,836 / 2,752 appends/s  0.84x / 0.72x raw  (before: 0.67x / 0.65x)
      floor         98 / 112 us
    synchronous=NORMAL 1 writer 6,926 / 6,163 appends/s (before: 5,849 / 6,076)

Where a FULL append's 341 us went, with the Trio thread on CPU 0 and the
writer on CPU 1 (means of 6,000 appends, instrumented copy): the bench
building 3 events 14 us, ``append`` checking and encoding them 13, waking
the writer thread 50, the writer taking the write and BEGIN 14, head check
and inserts 11, COMMIT 163, signalling 2, waking the Trio thread 64, Trio
resuming the task 8.  The two wake-ups are the machine's; only the ~50 us
of Python around them is the store's.  Where the scheduler puts the threads
moves the rest: both on CPU 1, 247 us; both on CPU 0, 336 us (a commit
whose completion interrupt lands on the other CPU costs ~70 us more); the
writer on CPU 0, 406 us.  The raw loop is one thread and pays at most that
interrupt hop, so its rate moves between ~3,000 and ~4,500 commits/s from
run to run, and the ratio with it: 0.7x held in these runs, but the figures
above put it at 0.55-0.7x when the raw thread sits on CPU 1 (~4,500/s) while
the store's two threads are split.

Pages and checkpoints (measured on the WAL's frames, which do not depend on
the machine's load).  One writer's commit of a 3-event batch writes 2.2 WAL
frames on average, the raw loop's single row 1.4: ``events`` is a WITHOUT
ROWID table, i.e. an index B-tree, and SQLite rebalances an overflowing index
leaf with its siblings instead of opening a new rightmost page (which it does
only for rowid tables), so about one append in four rewrites 4 pages.  A rowid
table would need an index on ``(workflow_id, seq)``, itself an index B-tree
written on every append: no fewer pages.  With 256 writers a group commit
dirties about a page per workflow, so SQLite's default auto-checkpoint (1000
pages) ran every few commits, each copying the same hot pages again and
fsyncing the database file inside the commit every writer of the group waits
on; hence :data:`DEFAULT_WAL_AUTOCHECKPOINT` (fixed work, 256 writers x 40
appends, 81 commits: fsyncs 134 -> 104, bytes written per append 10.1 ->
7.9 KB).  The checkpoint is the writer thread's own, between its
transactions (so no commit of this store races it and it always reaches the
WAL's end), instead of SQLite's auto-checkpoint inside the commit that
crosses the threshold: the writers of that commit are woken first.  Tried and
not kept: checkpointing from a thread of its own (``PASSIVE``, the writer's
auto-checkpoint off) -- while the writer keeps committing a passive
checkpoint never catches up with the WAL's end, so the WAL is not restarted
and grew past 3,000 pages, and paired runs were no faster; an ``eventfd`` instead of the socket pair for the lone writer's
wake-up (CPU per empty-write round trip 75 vs 78 us, inside the noise); a
pipe or an ``eventfd`` for waking the writer thread instead of its lock (one
writer: no difference, with the threads split or sharing a CPU); for a lone
append, an ``INSERT ... SELECT ... WHERE EXISTS`` checking the gap inside
the insert (SQLite spends more on it than on the separate two-key seek) or
a multi-row ``VALUES`` (no faster than ``executemany`` for 3 rows).  Not
tried: the writer thread spinning for the next request, since a spinning
Python thread holds the GIL that the Trio thread needs to submit it (and a
thread waiting for the GIL sleeps, so its vCPU halts all the same); pinning
both threads to one CPU, which takes the choice away from the scheduler and
still pays the interrupt hop on CPU 0.
"""

from __future__ import annotations

from aion_trio.plugin import StoreRegistry, hookimpl

from ._schema import (
    APPLICATION_ID as APPLICATION_ID,
    DEFAULT_WAL_AUTOCHECKPOINT as DEFAULT_WAL_AUTOCHECKPOINT,
    SCHEMA_VERSION as SCHEMA_VERSION,
)
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
    "DEFAULT_WAL_AUTOCHECKPOINT",
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
        description="SQLite file (sqlite:////abs/path.db or sqlite:///rel.db; ?synchronous=NORMAL to trade durability for speed; ?mode=ro to only read; ?inline_commits=off to keep every commit off the Trio thread)",
    )
