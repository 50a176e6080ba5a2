"""A TCP proxy on loopback that injects network faults between one node and PostgreSQL.

One :class:`FaultProxy` per engine or worker process (so faults are per
node): the process's store URL names the proxy's port instead of the
server's.  The test switches the proxy between

``pass``
    bytes flow both ways (after :attr:`FaultProxy.latency` seconds of delay
    per chunk sent towards the server: a round trip gains that much);
``blackhole``
    a partition: the proxy stops reading and writing on every connection,
    and accepts new ones without answering or connecting them onwards.
    Nothing is lost: what was in flight flows once the partition heals, as
    TCP retransmission would deliver it;
``refuse``
    nothing listens on the port any more: a new connection is refused
    (``ECONNREFUSED``), the open ones go on;

and can :meth:`FaultProxy.reset` every open connection (an RST both ways).
``send_only`` (the node's bytes reach the server, the server's answers
never reach the node) is the asymmetric partition.

The proxy runs a Trio loop of its own in a thread (:func:`running_proxy`),
so a test that blocks its own loop in a synchronous query, or a benchmark
without Trio, does not stall the traffic.  Every control call applies the
change in the proxy's loop and returns once it took effect.
"""

from __future__ import annotations

import contextlib
import enum
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from typing import Any

import trio

CHUNK = 65536


class Mode(enum.Enum):
    PASS = "pass"
    BLACKHOLE = "blackhole"
    SEND_ONLY = "send_only"
    REFUSE = "refuse"


def _abort(stream: trio.SocketStream) -> None:
    """Close with an RST instead of a FIN (SO_LINGER 0)."""
    with contextlib.suppress(OSError):
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


class FaultProxy:
    """Forwards ``127.0.0.1:port`` to ``upstream``; its mode is switched by the control methods.

    Use it only through :func:`running_proxy`; every method but the
    properties runs in the proxy's own Trio loop.
    """

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.port = 0
        self.mode = Mode.PASS
        self.latency = 0.0
        self.accepted = 0
        self._changed = trio.Event()
        self._links: set[tuple[trio.SocketStream, trio.SocketStream | None, trio.CancelScope]] = set()
        self._listener: trio.SocketListener | None = None
        self._nursery: trio.Nursery | None = None

    # -- control (in the proxy's loop) -----------------------------------------

    def set_mode(self, mode: Mode, latency: float | None = None) -> None:
        if latency is not None:
            self.latency = latency
        self.mode = mode
        if mode is Mode.REFUSE and self._listener is not None:
            self._listener.socket.close()
            self._listener = None
        if mode is not Mode.REFUSE and self._listener is None and self._nursery is not None:
            self._listen()
        changed, self._changed = self._changed, trio.Event()
        changed.set()

    def reset(self) -> int:
        """Abort every open connection (both sides see a reset); returns how many."""
        links = list(self._links)
        for client, server, scope in links:
            _abort(client)
            if server is not None:
                _abort(server)
            scope.cancel()
        return len(links)

    @property
    def open_connections(self) -> int:
        return len(self._links)

    # -- forwarding ---------------------------------------------------------------

    async def _gate(self, towards_server: bool) -> None:
        """Wait while the mode stops traffic in this direction."""
        while self.mode is Mode.BLACKHOLE or (self.mode is Mode.SEND_ONLY and not towards_server):
            await self._changed.wait()

    async def _pump(
        self, src: trio.SocketStream, dst: trio.SocketStream, towards_server: bool, link: trio.CancelScope
    ) -> None:
        """Forward ``src`` to ``dst``; a reset or error on either side aborts the whole link."""
        try:
            while True:
                await self._gate(towards_server)
                data = await src.receive_some(CHUNK)
                if not data:
                    await dst.send_eof()
                    return
                if towards_server and self.latency > 0:
                    await trio.sleep(self.latency)
                await self._gate(towards_server)
                await dst.send_all(data)
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
            _abort(src)
            _abort(dst)
            link.cancel()

    async def _link(self, client: trio.SocketStream) -> None:
        self.accepted += 1
        with trio.CancelScope() as scope:
            entry: Any = (client, None, scope)
            self._links.add(entry)
            try:
                # A connection accepted during a partition is never answered until it heals.
                await self._gate(True)
                server = await trio.open_tcp_stream(*self.upstream)
                self._links.discard(entry)
                entry = (client, server, scope)
                self._links.add(entry)
                async with server, trio.open_nursery() as nursery:
                    nursery.start_soon(self._pump, client, server, True, scope)
                    nursery.start_soon(self._pump, server, client, False, scope)
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
                _abort(client)
            finally:
                self._links.discard(entry)
                client.socket.close()

    def _listen(self) -> None:
        """Bind (the same port again after ``refuse``) and accept in a task; listening on return."""
        plain = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        plain.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        plain.bind(("127.0.0.1", self.port))
        plain.listen(128)
        self.port = plain.getsockname()[1]
        listener = trio.SocketListener(trio.socket.from_stdlib_socket(plain))
        self._listener = listener
        assert self._nursery is not None
        self._nursery.start_soon(self._accept, listener)

    async def _accept(self, listener: trio.SocketListener) -> None:
        with listener.socket, contextlib.suppress(trio.ClosedResourceError, OSError):
            while True:
                stream = await listener.accept()
                assert self._nursery is not None
                self._nursery.start_soon(self._link, stream)

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._listen()
            task_status.started()
            await trio.sleep_forever()  # the nursery stays open while refusing (no accept task)


@contextlib.contextmanager
def running_proxy(upstream_host: str, upstream_port: int) -> Iterator[ProxyControl]:
    """Start a :class:`FaultProxy` in a thread of its own; stop it (and its connections) on exit."""
    proxy = FaultProxy(upstream_host, upstream_port)
    ready = threading.Event()
    box: dict[str, Any] = {}

    async def main() -> None:
        box["token"] = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            box["cancel"] = nursery.cancel_scope
            await nursery.start(proxy.serve)
            ready.set()

    def thread() -> None:
        try:
            trio.run(main)
        except BaseException as exc:  # reported by running_proxy
            box["error"] = exc
        finally:
            ready.set()

    worker = threading.Thread(target=thread, name=f"faultproxy->{upstream_port}", daemon=True)
    worker.start()
    if not ready.wait(10) or "error" in box:
        raise RuntimeError(f"the fault proxy did not start: {box.get('error')!r}")
    control = ProxyControl(proxy, box["token"])
    try:
        yield control
    finally:
        if worker.is_alive():
            control.call(box["cancel"].cancel)
            worker.join(10)
    if "error" in box:
        raise RuntimeError("the fault proxy failed") from box["error"]


class ProxyControl:
    """Thread-safe control of a running :class:`FaultProxy` (returns once the change is applied)."""

    def __init__(self, proxy: FaultProxy, token: trio.lowlevel.TrioToken) -> None:
        self._proxy = proxy
        self._token = token

    @property
    def port(self) -> int:
        return self._proxy.port

    @property
    def mode(self) -> Mode:
        return self._proxy.mode

    @property
    def accepted(self) -> int:
        """Connections accepted so far."""
        return self._proxy.accepted

    @property
    def open_connections(self) -> int:
        return self._proxy.open_connections

    def call(self, function: Callable[[], Any]) -> Any:
        done = threading.Event()
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = function()
            finally:
                done.set()

        self._token.run_sync_soon(run)
        if not done.wait(10):
            raise RuntimeError("the fault proxy did not answer")
        return box.get("value")

    def url(self, base: str) -> str:
        """``base`` (``postgresql://user@host:port/db``) with the proxy's host and port instead."""
        scheme, rest = base.split("://", 1)
        userinfo, _, hostpath = rest.rpartition("@")
        _hostport, _, path = hostpath.partition("/")
        user = f"{userinfo}@" if userinfo else ""
        return f"{scheme}://{user}127.0.0.1:{self.port}/{path}"

    def passing(self, latency: float = 0.0) -> None:
        self.call(lambda: self._proxy.set_mode(Mode.PASS, latency))

    def blackhole(self) -> None:
        self.call(lambda: self._proxy.set_mode(Mode.BLACKHOLE))

    def send_only(self) -> None:
        self.call(lambda: self._proxy.set_mode(Mode.SEND_ONLY))

    def refuse(self) -> None:
        self.call(lambda: self._proxy.set_mode(Mode.REFUSE))

    def reset(self) -> int:
        return int(self.call(self._proxy.reset))
