"""Abandoning connections that stop answering (a partition, a dead peer, a hung server).

``statement_timeout`` makes the *server* stop a slow statement, but a
connection whose server never answers (the network dropped it, the server
host froze) leaves the calling thread blocked in ``recv`` for as long as TCP
keeps it open: hours.  :class:`HangWatch` bounds every database call of the
store: one thread watches the calls in progress, and a call still running
``statement_timeout`` plus a margin after it began has its connection's
socket shut down.  The blocked call then fails at once (psycopg raises
``OperationalError``), the pool discards the broken connection, and the
caller gets :class:`~aion_trio.BackendUnavailable` and retries: no worker
thread or pooled connection is held forever.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any, final

logger = logging.getLogger("aion_trio.postgres")


def hang_bound(statement_timeout: float) -> float | None:
    """Seconds a call may run before its connection is abandoned (``None``: never, the
    timeout is disabled): ``statement_timeout`` plus a tenth of it, at least one second."""
    if statement_timeout <= 0:
        return None
    return statement_timeout + max(1.0, statement_timeout / 10)


def shut_down(conn: Any) -> None:
    """Shut the connection's socket down both ways (its blocked reader wakes with an error)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        fd = conn.pgconn.socket
        # A second socket object on the same descriptor: shutdown acts on the connection,
        # and closing the duplicate leaves psycopg's descriptor to psycopg.
        with socket.socket(fileno=socket.dup(fd)) as sock:
            sock.shutdown(socket.SHUT_RDWR)


@final
class HangWatch:
    """Watches the calls in progress; abandons the connection of one running past ``bound``."""

    def __init__(self, bound: float | None, location: str) -> None:
        self.bound = bound
        self.location = location
        self.abandoned = 0
        """Connections shut down for not answering (statistics, tests)."""
        self._cond = threading.Condition()
        self._calls: dict[int, tuple[float, Any, str]] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._closed = False
        # When the watcher wakes next (monotonic; inf: it waits for a call).  Every call's
        # deadline is its start plus one bound, so a new call is never due before the calls
        # already watched: the watcher is woken only when it waits for none.
        self._wake_at = float("inf")

    @contextlib.contextmanager
    def watching(self, conn: Any, doing: str) -> Iterator[list[bool]]:
        """Watch one call on ``conn``; the yielded list holds ``True`` once it was abandoned."""
        abandoned: list[bool] = []
        if self.bound is None:
            yield abandoned
            return
        key = next(self._ids)
        deadline = time.monotonic() + self.bound
        with self._cond:
            self._calls[key] = (deadline, conn, doing)
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(
                    target=self._run, name=f"aion hang watch {self.location}", daemon=True
                )
                self._thread.start()
            if deadline < self._wake_at:
                self._wake_at = deadline
                self._cond.notify()
        try:
            yield abandoned
        finally:
            with self._cond:
                if self._calls.pop(key, None) is None:
                    abandoned.append(True)

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                now = time.monotonic()
                overdue = [(key, entry) for key, entry in self._calls.items() if entry[0] <= now]
                for key, _entry in overdue:
                    del self._calls[key]
                    self.abandoned += 1
                if not overdue:
                    soonest = min((entry[0] for entry in self._calls.values()), default=None)
                    self._wake_at = float("inf") if soonest is None else soonest
                    self._cond.wait(None if soonest is None else soonest - now)
                    continue
            for _key, (_deadline, conn, doing) in overdue:
                logger.warning(
                    "%s: %s got no answer within %.1fs (statement_timeout + margin): abandoning its connection",
                    self.location,
                    doing,
                    self.bound,
                )
                shut_down(conn)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(5)
