"""Zero-filled room ahead of the write-ahead log's end.

With ``synchronous=FULL`` every commit syncs the WAL file.  A commit that
makes the file longer also changes its size and block map, and syncing that
metadata costs the file system a journal commit of its own: on ext4 here, a
growing WAL commits about half as fast as one whose frames overwrite bytes
the file already has (measured with plain apsw: about 3,000 against 5,900
single-row commits/s).  SQLite only overwrites once a checkpoint has let it
restart the WAL from the beginning, and the file disappears when the last
connection closes, so a fresh or reopened store spends its first
``wal_autocheckpoint`` pages growing the file commit by commit.

:class:`WalRoom` keeps a chunk of zeros, written and synced, beyond the WAL's
end.  SQLite ignores them: a frame is valid only with the header's salts and
a matching checksum, which zeros never have (the same holds for the stale
frames a restarted WAL leaves behind).  The writer thread calls
:meth:`WalRoom.after_commit` between transactions; a ``stat`` tells whether
the file outgrew the zeros, and only then does it add the next chunk, under
``BEGIN IMMEDIATE``: the write lock keeps every connection, in any process,
from appending frames meanwhile, and the empty transaction writes nothing.
The cost is one slower commit per chunk instead of a slow sync per commit.
"""

from __future__ import annotations

import os
from typing import final

import apsw

#: Zero bytes added beyond the WAL's end each time the file outgrows them.
DEFAULT_WAL_ROOM = 1 << 20

_ZEROS = bytes(64 * 1024)


@final
class WalRoom:
    """Keeps ``chunk`` bytes of synced zeros beyond the end of ``path``-wal."""

    def __init__(self, conn: apsw.Connection, path: str, chunk: int) -> None:
        self._conn = conn
        self._wal = path + "-wal"
        self._chunk = chunk
        #: Where the zeros this process wrote end (the file's size right after).
        self._zeroed_to = 0
        #: The size seen last (a smaller one means the file was truncated).
        self._seen = 0
        #: After a failed attempt, the size the file must reach before the next.
        self._next_try = 0
        #: Chunks added, and attempts that failed (for tests).
        self.extensions = 0
        self.failures = 0

    def after_commit(self) -> None:
        """Between transactions, in the writer thread: add a chunk if the WAL outgrew the last.

        Never raises: room ahead is an optimisation, and a failure (another
        process holding the write lock, a full disk) only means slower syncs;
        it is tried again once the file has grown by another chunk.
        """
        try:
            size = os.stat(self._wal).st_size
        except OSError:
            return
        if size < self._seen:
            # Truncated (a TRUNCATE checkpoint, or journal_size_limit): start again from there.
            self._zeroed_to = min(self._zeroed_to, size)
            self._next_try = 0
        self._seen = size
        # An empty WAL gets room only after SQLite has written its header.
        if size == 0 or size <= self._zeroed_to or size < self._next_try:
            return
        try:
            self._extend()
        except (apsw.Error, OSError):
            self._next_try = size + self._chunk
            self.failures += 1

    def _extend(self) -> None:
        conn = self._conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            # Under the write lock no connection appends frames: measure it again.
            size = os.stat(self._wal).st_size
            if size == 0:
                return
            with open(self._wal, "r+b") as wal:
                wal.seek(size)
                remaining = self._chunk
                while remaining > 0:
                    remaining -= wal.write(_ZEROS[: min(remaining, len(_ZEROS))])
                wal.flush()
                os.fsync(wal.fileno())
            self._zeroed_to = self._seen = size + self._chunk
            self.extensions += 1
        finally:
            conn.execute("COMMIT")
