"""One LISTEN connection per opened store, shared by everything that waits for a NOTIFY.

Notifications only wake waiters sooner: every waiter also polls, so a lost
notification (a dropped connection, a server restart, ``pg_terminate_backend``)
costs at most one poll interval, never work.

A :class:`Listener` is a thread holding one connection.  Subscribers name a
channel and a callback; the thread LISTENs on every subscribed channel
(channels subscribed later are added on the live connection), calls each
channel's callbacks with ``(channel, payload)`` for every notification, and,
after every (re)connect, with ``(channel, None)``: notifications sent while
it was not listening are lost, so a subscriber that keeps state should
re-check.  Callbacks run in the listener thread and must be quick and
thread-safe; :func:`deliver_to_trio` hands notifications to a Trio run.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import final

import psycopg
import trio
from psycopg import sql

from ._url import PostgresUrl

logger = logging.getLogger("aion_trio.postgres")

Callback = Callable[[str, "str | None"], None]
"""``(channel, payload)``; payload ``None``: (re)listening, notifications may have been lost."""

#: How long the thread waits for notifications before looking for new subscriptions.
_TICK = 0.2


@final
class Listener:
    """A dedicated connection, held in a daemon thread, LISTENing for its subscribers."""

    def __init__(self, url: PostgresUrl, name: str) -> None:
        self._url = url
        self._name = name
        self._lock = threading.Lock()
        self._subscribers: dict[str, list[Callback]] = {}
        self._listening: dict[str, threading.Event] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.connects = 0
        """How many times the connection was (re)opened (operators, tests)."""
        self.backend_pid: int | None = None
        """The server process of the current connection (``None`` before the first)."""

    def subscribe(self, channel: str, callback: Callback) -> threading.Event:
        """Call ``callback`` for ``channel``'s notifications; the returned event is set once
        the channel is LISTENed on a live connection.  Starts the thread on first use."""
        with self._lock:
            self._subscribers.setdefault(channel, []).append(callback)
            listening = self._listening.setdefault(channel, threading.Event())
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(
                    target=self._run, name=f"aion_trio LISTEN {self._name}", daemon=True
                )
                self._thread.start()
        return listening

    def unsubscribe(self, channel: str, callback: Callback) -> None:
        """Stop calling ``callback`` (the channel stays LISTENed: harmless)."""
        with self._lock, contextlib.suppress(KeyError, ValueError):
            self._subscribers[channel].remove(callback)

    def _callbacks(self, channel: str) -> list[Callback]:
        with self._lock:
            return list(self._subscribers.get(channel, ()))

    def _run(self) -> None:
        while not self._stop.is_set():
            listening: set[str] = set()
            try:
                with psycopg.connect(self._url.conninfo, autocommit=True) as conn:
                    self.backend_pid = conn.info.backend_pid
                    self.connects += 1
                    while not self._stop.is_set():
                        with self._lock:
                            wanted = [c for c in self._subscribers if c not in listening]
                        for channel in wanted:
                            conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
                            listening.add(channel)
                            self._listening[channel].set()
                            for callback in self._callbacks(channel):
                                callback(channel, None)
                        for note in conn.notifies(timeout=_TICK):
                            for callback in self._callbacks(note.channel):
                                callback(note.channel, note.payload)
            except psycopg.Error as exc:
                with self._lock:
                    for channel in listening:
                        self._listening[channel].clear()
                if not self._stop.is_set():
                    logger.warning(
                        "%s: the LISTEN connection (%s) dropped (reconnecting; polling covers the gap): %s",
                        self._url.location,
                        self._name,
                        str(exc).strip(),
                    )
                    self._stop.wait(_TICK)

    def close(self) -> None:
        """Stop the thread and close its connection (blocks up to a few seconds)."""
        self._stop.set()
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join(timeout=5.0)


@contextlib.contextmanager
def deliver_to_trio(
    listener: Listener, channels: Sequence[str], prefix: str, deliver: Callable[[str, str], None]
) -> Iterator[None]:
    """Within the block, call ``deliver(channel, rest)`` in this Trio run for each
    notification on ``channels`` whose payload is ``prefix + rest`` (call from Trio)."""
    token = trio.lowlevel.current_trio_token()

    def callback(channel: str, payload: str | None) -> None:
        if payload is None or not payload.startswith(prefix):
            return
        with contextlib.suppress(trio.RunFinishedError):
            token.run_sync_soon(deliver, channel, payload[len(prefix) :])

    for channel in channels:
        listener.subscribe(channel, callback)
    try:
        yield
    finally:
        for channel in channels:
            listener.unsubscribe(channel, callback)
