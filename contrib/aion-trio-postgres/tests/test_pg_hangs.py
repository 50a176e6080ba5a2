"""A connection that stops answering mid-call is abandoned, and its call fails retryably (issue 23 item 6).

The fault proxy blackholes the store's connections (the server never
answers, nothing is closed: a partition or a frozen server host), so the
server-side ``statement_timeout`` cannot help.  Each call blocked on such a
connection fails with ``BackendUnavailable`` within ``statement_timeout`` +
its margin (the store shuts the connection's socket down); the pool replaces
the connections and, once the network heals, every worker thread and
connection serves calls again: none was held forever.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import trio
from _faultproxy import ProxyControl
from aion_trio_postgres import hang_bound, open_postgres_store

from aion_trio import BackendUnavailable

POOL = 2
STATEMENT_TIMEOUT = 0.5


def test_the_bound_is_the_statement_timeout_and_a_margin() -> None:
    assert hang_bound(0) is None
    assert hang_bound(0.5) == 1.5
    assert hang_bound(30) == 33.0


async def test_calls_on_connections_that_stopped_answering_fail_in_bounded_time_and_the_pool_recovers(
    proxy: ProxyControl, fresh_store_url: Callable[..., str]
) -> None:
    url = fresh_store_url(statement_timeout=STATEMENT_TIMEOUT, pool_size=POOL, pool_timeout=2)
    base, query = url.split("?", 1)
    bound = hang_bound(STATEMENT_TIMEOUT)
    assert bound is not None
    async with open_postgres_store(f"{proxy.url(base)}?{query}") as store:
        async with trio.open_nursery() as nursery:  # every pooled connection opened and used
            for _ in range(POOL):
                nursery.start_soon(store.events.list_active)
        proxy.blackhole()
        errors: list[tuple[float, BaseException]] = []
        began = time.monotonic()

        async def hung_call() -> None:
            try:
                await store.events.list_active()
            except BackendUnavailable as exc:
                errors.append((time.monotonic() - began, exc))

        with trio.fail_after(bound + 5):
            async with trio.open_nursery() as nursery:
                for _ in range(POOL):
                    nursery.start_soon(hung_call)
        assert len(errors) == POOL, errors
        # A call on a pooled connection is abandoned at the bound; one that found the pool
        # still connecting its second connection (into the blackhole) times out waiting for it.
        abandoned = [(took, exc) for took, exc in errors if "abandoned" in str(exc)]
        assert abandoned, errors
        for took, exc in abandoned:
            assert bound - 0.1 <= took <= bound + 3, (took, exc)
            assert "no answer within 1.5s" in str(exc)
        for took, exc in errors:
            assert took <= max(bound, 2) + 3, (took, exc)
        proxy.passing()
        # Every worker thread and pooled connection is free again: POOL calls at once answer.
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                for _ in range(POOL):
                    nursery.start_soon(store.events.list_active)
