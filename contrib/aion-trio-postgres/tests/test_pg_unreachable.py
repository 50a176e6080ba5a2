"""Opening the store while the database is down (issue 23 item 4, DBOS #150): wait, retry, say so.

The server is put out of reach by a fault proxy that refuses connections
(nothing listens on its port) or blackholes them; opening the store retries
with backoff, logging each failed attempt, for up to ``connect_wait``
seconds, and opens once the server answers.  A real ``aion-trio worker``
process started while the database is refused waits the same way.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import trio
from _faultproxy import ProxyControl
from aion_trio_postgres import open_postgres_store

from aion_trio import BackendUnavailable

HERE = Path(__file__).resolve().parent


def waiting_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "waiting for it" in r.getMessage()]


async def test_a_store_opened_while_the_server_refuses_waits_and_opens_once_it_answers(
    proxy: ProxyControl,
    fresh_store_url: Callable[..., str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="aion_trio.postgres")
    url = fresh_store_url(node="n1", lease_ttl=5, connect_wait=30)
    proxy.refuse()
    opened = trio.Event()

    async def open_it() -> None:
        async with open_postgres_store(proxy.url(url.split("?", 1)[0]) + "?" + url.split("?", 1)[1]) as store:
            opened.set()
            assert store.node is not None
            await store.renew_lease()

    second_retry = trio.Event()

    class Counter(logging.Handler):
        seen = 0

        def emit(self, record: logging.LogRecord) -> None:  # in the Trio thread: the open logs it
            self.seen += "waiting for it" in record.getMessage()
            if self.seen >= 2:
                second_retry.set()

    counter = Counter()
    logging.getLogger("aion_trio.postgres").addHandler(counter)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(open_it)
            with trio.fail_after(10):
                await second_retry.wait()
            assert not opened.is_set()
            proxy.passing()
            with trio.fail_after(10):
                await opened.wait()
    finally:
        logging.getLogger("aion_trio.postgres").removeHandler(counter)
    lines = waiting_lines(caplog)
    assert "attempt 1 failed, retrying in 0.1s" in lines[0], lines
    assert "attempt 2 failed, retrying in 0.2s" in lines[1], lines
    assert "connect_wait=0 fails at once" in lines[0]


async def test_a_server_that_stays_out_of_reach_fails_the_open_after_connect_wait(
    proxy: ProxyControl, fresh_store_url: Callable[..., str], caplog: pytest.LogCaptureFixture
) -> None:
    url = fresh_store_url(connect_wait=0.5)
    proxy.refuse()
    began = time.monotonic()
    with pytest.raises(
        BackendUnavailable, match=r"(?s)cannot connect .*gave up after \d+ attempts in connect_wait=0.5s"
    ):
        async with open_postgres_store(proxy.url(url.split("?", 1)[0]) + "?" + url.split("?", 1)[1]):
            pass  # pragma: no cover - refused
    assert 0.4 <= time.monotonic() - began < 5
    assert len(waiting_lines(caplog)) >= 2


async def test_connect_wait_zero_fails_at_once(
    proxy: ProxyControl, fresh_store_url: Callable[..., str]
) -> None:
    url = fresh_store_url(connect_wait=0)
    proxy.refuse()
    with pytest.raises(BackendUnavailable, match="cannot connect") as info:
        async with open_postgres_store(proxy.url(url.split("?", 1)[0]) + "?" + url.split("?", 1)[1]):
            pass  # pragma: no cover - refused
    assert "gave up" not in str(info.value)


@pytest.mark.slow
def test_a_worker_started_while_the_database_is_down_waits_for_it_then_serves(
    proxy: ProxyControl, fresh_store_url: Callable[..., str], tmp_path: Path
) -> None:
    url = fresh_store_url(connect_wait=60)
    base, query = url.split("?", 1)

    async def migrate() -> None:
        async with open_postgres_store(url):
            pass

    trio.run(migrate)
    proxy.refuse()
    log = tmp_path / "worker.log"
    args = [sys.executable, "-c", "from aion_trio._cli import main; main()", "worker", "--activities-only"]
    args += ["--store", f"{proxy.url(base)}?{query}", "--activities", "failover_app:app", "--queue", "remote"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    with log.open("wb") as out:
        worker = subprocess.Popen(args, cwd=HERE, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:

        def wait_for(text: str, count: int = 1) -> None:
            deadline = time.monotonic() + 30
            while log.read_text(errors="replace").count(text) < count:
                assert worker.poll() is None, f"the worker exited ({worker.returncode}):\n{log.read_text()}"
                assert time.monotonic() < deadline, f"no {text!r} in the worker's log:\n{log.read_text()}"
                time.sleep(0.05)

        wait_for("waiting for it", 3)
        assert "ready: activity worker" not in log.read_text()
        proxy.passing()
        wait_for("ready: activity worker")
    finally:
        worker.terminate()
        worker.wait(timeout=15)
    assert worker.returncode == 0, log.read_text()
