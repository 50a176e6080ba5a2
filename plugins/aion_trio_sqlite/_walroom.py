"""Zero-filled room past the end of the WAL file (``synchronous=FULL`` only).

With ``synchronous=FULL`` every commit ends in an ``fdatasync`` of the WAL.
While the WAL file grows, each commit also changes the file's size, and the
filesystem journals that change inside the same sync.  SQLite grows the WAL
from empty after every open (the last connection to close deletes it) until
the first checkpoint lets it start again from the top (about
:data:`~._schema.DEFAULT_WAL_AUTOCHECKPOINT` pages: 16 MiB, a thousand
commits or more), so that is the state a freshly started engine commits in.
Measured on ext4 on a 2-vCPU VM, one-row commits: 354 us at the end of a
growing WAL, 226 us inside zero-filled room (raw ``fdatasync`` of one 4 KiB
page: 269 us extending the file, 165 us overwriting).

So the writer thread keeps room: after a commit (the WAL hook tells it how
many frames the WAL holds), if less than :data:`LOW_WATER` bytes are left
before the end of the room, it writes zeros past the file's end and syncs
them once: :data:`FIRST` bytes the first time (a store that commits a
handful of times pays about a millisecond), :data:`CHUNK` after that (one
extension per ~250 frames while the WAL grows, none once it is reused from
the top).  ``posix_fallocate`` would not do: it leaves unwritten extents,
whose first write is again a metadata change (measured: no gain).

Safety: zeros are never a valid frame (recovery stops at the first frame whose
salts do not match the header), so the room changes nothing SQLite reads.  The
zeros go past the end of the file only, never over a byte SQLite wrote, and
only while this connection holds the WAL write lock (``BEGIN IMMEDIATE``):
another process writing the same file (a command sent through the inbox)
cannot append frames meanwhile.  The room is an optimisation, never a reason
for a write to fail: an error stops it, with one warning.
"""

from __future__ import annotations

import logging
import os

import apsw

logger = logging.getLogger("aion_trio.sqlite")

FIRST = 256 * 1024
"""Bytes of the first stretch of room."""
CHUNK = 1024 * 1024
"""Bytes of every later stretch."""
LOW_WATER = 128 * 1024
"""Room left (bytes past the WAL's last frame) below which more is made."""
_HEADER = 32
_FRAME_HEADER = 24
_ZEROS = bytes(256 * 1024)


class WalRoom:
    """Keeps zero-filled room past the last frame of the WAL; used by the writer thread only."""

    __slots__ = ("_end", "_frame", "_path", "extensions", "stopped")

    def __init__(self, wal_path: str, page_size: int) -> None:
        self._path = wal_path
        self._frame = page_size + _FRAME_HEADER
        #: The file size this room last made (0: none yet).
        self._end = 0
        self.extensions = 0
        self.stopped = False

    def wanted(self, frames: int) -> bool:
        """Whether the WAL, holding ``frames`` frames, needs more room."""
        return not self.stopped and _HEADER + frames * self._frame + LOW_WATER > self._end

    def keep(self, conn: apsw.Connection, frames: int) -> None:
        """Make room if :meth:`wanted`; outside any transaction of ``conn``."""
        if not self.wanted(frames):
            return
        try:
            conn.execute("BEGIN IMMEDIATE")
        except apsw.Error:
            return  # another process holds the write lock: try after a later commit
        try:
            self._extend(_HEADER + frames * self._frame)
        except Exception as exc:
            self.stopped = True
            logger.warning(
                "%s: stopped keeping room in the WAL file (commits stay correct, only slower while "
                "it grows): %s",
                self._path,
                exc,
            )
        finally:
            conn.execute("ROLLBACK")

    def _extend(self, used: int) -> None:
        # Under the write lock: the file's size cannot change until ROLLBACK.
        fd = os.open(self._path, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            size = os.fstat(fd).st_size
            if size >= used + LOW_WATER:
                # Written before (frames of an earlier pass through the file): room already.
                self._end = size
                return
            target = max(size, used) + (FIRST if self._end == 0 else CHUNK)
            offset = size
            while offset < target:
                offset += os.pwrite(fd, _ZEROS[: target - offset], offset)
            if hasattr(os, "fdatasync"):
                os.fdatasync(fd)
            else:  # pragma: no cover - macOS and Windows
                os.fsync(fd)
        finally:
            os.close(fd)
        self._end = target
        self.extensions += 1
