"""The fault proxy the partition tests put between a node and PostgreSQL (``_faultproxy.py``).

An echo server in the test's loop stands for the database, the proxy runs in
its own thread, and a client connects through it; one PostgreSQL test shows
a real connection through it, and cut off by it.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator

import psycopg
import pytest
import trio
from _faultproxy import ProxyControl, running_proxy


@pytest.fixture
async def echo_port(nursery: trio.Nursery) -> int:
    async def echo(stream: trio.SocketStream) -> None:
        async with stream:
            try:
                async for data in stream:
                    received.append(data)
                    await stream.send_all(data)
            except trio.BrokenResourceError:
                pass

    received: list[bytes] = []
    listeners = await nursery.start(functools.partial(trio.serve_tcp, echo, 0, host="127.0.0.1"))
    return int(listeners[0].socket.getsockname()[1])


@pytest.fixture
def proxy(echo_port: int) -> Iterator[ProxyControl]:
    with running_proxy("127.0.0.1", echo_port) as control:
        yield control
    for stream in _opened:
        stream.socket.close()
    _opened.clear()


_opened: list[trio.SocketStream] = []


async def connect(proxy: ProxyControl) -> trio.SocketStream:
    with trio.fail_after(5):
        stream = await trio.open_tcp_stream("127.0.0.1", proxy.port)
    _opened.append(stream)
    return stream


async def round_trip(stream: trio.SocketStream, data: bytes, seconds: float = 5) -> bytes:
    await stream.send_all(data)
    got = b""
    with trio.fail_after(seconds):
        while len(got) < len(data):
            chunk = await stream.receive_some()
            assert chunk, "the proxy closed the connection"
            got += chunk
    return got


async def nothing_within(stream: trio.SocketStream, seconds: float) -> bool:
    with trio.move_on_after(seconds):
        await stream.receive_some()
        return False
    return True


async def test_pass_forwards_both_ways(proxy: ProxyControl) -> None:
    stream = await connect(proxy)
    assert await round_trip(stream, b"hello") == b"hello"
    assert await round_trip(stream, b"x" * 200_000) == b"x" * 200_000
    assert proxy.accepted == 1


async def test_latency_delays_every_round_trip(proxy: ProxyControl) -> None:
    stream = await connect(proxy)
    proxy.passing(latency=0.2)
    began = time.monotonic()
    assert await round_trip(stream, b"slow") == b"slow"
    assert time.monotonic() - began >= 0.2
    proxy.passing()
    began = time.monotonic()
    await round_trip(stream, b"fast")
    assert time.monotonic() - began < 0.2


async def test_blackhole_answers_nothing_and_loses_nothing(proxy: ProxyControl) -> None:
    stream = await connect(proxy)
    await round_trip(stream, b"before")
    proxy.blackhole()
    await stream.send_all(b"during")
    assert await nothing_within(stream, 0.3)
    # A new connection is accepted but never answered either.
    late = await connect(proxy)
    await late.send_all(b"late")
    assert await nothing_within(late, 0.2)
    proxy.passing()
    with trio.fail_after(5):
        assert await stream.receive_some() == b"during"
        assert await late.receive_some() == b"late"


async def test_send_only_delivers_to_the_server_but_never_back(proxy: ProxyControl, echo_port: int) -> None:
    stream = await connect(proxy)
    await round_trip(stream, b"a")
    proxy.send_only()
    await stream.send_all(b"one-way")
    assert await nothing_within(stream, 0.3)
    proxy.passing()
    with trio.fail_after(5):
        assert await stream.receive_some() == b"one-way"


async def test_refuse_refuses_new_connections_and_keeps_open_ones(proxy: ProxyControl) -> None:
    stream = await connect(proxy)
    await round_trip(stream, b"accepted")  # out of the listen queue, which a refusal resets
    port = proxy.port
    proxy.refuse()
    await trio.sleep(0.1)  # the proxy's accept task has ended: its loop must go on without it
    with pytest.raises(OSError):
        await trio.open_tcp_stream("127.0.0.1", port)
    assert await round_trip(stream, b"still") == b"still"
    proxy.passing()
    again = await connect(proxy)
    assert proxy.port == port
    assert await round_trip(again, b"back") == b"back"


async def test_reset_aborts_every_open_connection(proxy: ProxyControl) -> None:
    streams = [await connect(proxy) for _ in range(3)]
    for stream in streams:
        await round_trip(stream, b"up")
    assert proxy.reset() == 3
    for stream in streams:
        with trio.fail_after(5), pytest.raises(trio.BrokenResourceError):
            await stream.receive_some()
    fresh = await connect(proxy)
    assert await round_trip(fresh, b"new") == b"new"


async def test_a_postgres_query_through_the_proxy_waits_out_a_blackhole(pg_url: str) -> None:
    host_port = pg_url.split("@", 1)[1].split("/", 1)[0]
    host, _, port = host_port.partition(":")
    with (
        running_proxy(host, int(port or 5432)) as proxy,
        psycopg.connect(proxy.url(pg_url), autocommit=True, connect_timeout=5) as conn,
    ):
        assert conn.execute("SELECT 41 + 1").fetchone() == (42,)
        proxy.blackhole()
        answered = trio.Event()

        def query() -> object:
            try:
                return conn.execute("SELECT 'after the partition'").fetchone()
            finally:
                trio.from_thread.run_sync(answered.set)

        async with trio.open_nursery() as nursery:
            result: list[object] = []

            async def run() -> None:
                result.append(await trio.to_thread.run_sync(query))

            nursery.start_soon(run)
            with trio.move_on_after(0.3):
                await answered.wait()
            assert not answered.is_set(), "a query answered through the blackhole"
            proxy.passing()
            with trio.fail_after(5):
                await answered.wait()
        assert result == [("after the partition",)]
