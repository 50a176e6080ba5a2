"""What a web console open on the same SQLite file costs a worker.

Usage::

    python bench/console.py [--dir DIR] [--seconds S] [--in-flight N] [--refresh R] [--reload L] [--pairs N]

A worker (an engine in this process) runs 10-step workflows on a fresh SQLite file,
``--in-flight`` (32) at a time, for ``--seconds`` (5) per phase; the phases alternate
without and with a console open on the same file: an ``aion-trio console --read-only``
subprocess (its live pages look at the store every ``--refresh`` seconds: 1, the
console's default) and a poller subprocess acting as a browser that keeps the list and one
workflow page open (their two server-sent-event streams) and reloads both pages every
``--reload`` seconds (0.5).  Phases alternate off, on, ``--pairs`` (2; 1 under a second) times: the
machine's drift falls on both sides alike; the medians are compared.  On a small machine
the console's and the poller's processes compete with the worker for the CPU: that is
part of what is measured.

Prints a JSON line per phase (steps/s, this process's CPU time per step, the poller's page
loads and live updates) and a ``ratio`` line: steps/s with the console over steps/s
without (target: >= 0.9), and the same for the CPU time per step, which moves far less
with the machine's load than the rates do.
Not part of the test run.
"""

from __future__ import annotations

import argparse
import functools
import http.client
import logging
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path

import trio

import aion_trio as aion

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import emitter, run_in_scratch

STEPS = 10
emit = emitter("console")
_done = [0]


@aion.activity
async def step(n: int) -> int:
    _done[0] += 1
    return n + 1


@aion.workflow
async def chain(ctx: aion.WorkflowContext) -> int:
    value = 0
    for _ in range(STEPS):
        value = await ctx.run(step, value)
    return value


def _script() -> str:
    return str(Path(sys.executable).parent / "aion-trio")


async def _spawn(args: list[str], **options: object) -> subprocess.Popen[str]:
    return await trio.to_thread.run_sync(functools.partial(subprocess.Popen, args, **options))  # type: ignore[arg-type]


def _read_url(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("aion-trio console on "):
        raise SystemExit(f"the console did not start: {line!r}")
    return line.rsplit(" ", 1)[1].strip()


async def _phase(engine: aion.Engine, seconds: float, in_flight: int) -> tuple[float, int, float]:
    """Steps per second while ``in_flight`` workflows run at a time for ``seconds``, the steps,
    and this process's CPU microseconds per step."""

    async def feeder() -> None:
        async def one() -> None:
            handle = await engine.start(chain)
            await handle.result()

        limiter = trio.Semaphore(in_flight)
        async with trio.open_nursery() as nursery:
            while True:
                await limiter.acquire()

                async def run_one() -> None:
                    try:
                        await one()
                    finally:
                        limiter.release()

                nursery.start_soon(run_one)

    before = _done[0]
    began = time.perf_counter()
    cpu = time.process_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(feeder)
        await trio.sleep(seconds)
        nursery.cancel_scope.cancel()
    steps = _done[0] - before
    cpu_us = (time.process_time() - cpu) * 1e6 / max(steps, 1)
    return steps / (time.perf_counter() - began), steps, cpu_us


def measure(
    directory: str, seconds: float, in_flight: int, refresh: float, reload: float, pairs: int
) -> None:
    db = os.path.join(directory, "bench.db")
    # The workflows still in flight when the engine closes each log that they stopped: noise here.
    logging.getLogger("aion_trio").setLevel(logging.CRITICAL)

    async def main() -> None:
        async with aion.open_engine(f"sqlite:///{db}", workflows=[chain], activities=[step]) as engine:
            first = await engine.start(chain, workflow_id="first")
            await first.result()
            rates: dict[bool, list[float]] = {False: [], True: []}
            cpus: dict[bool, list[float]] = {False: [], True: []}
            for console_on in [False, True] * pairs:
                console = poller = None
                if console_on:
                    console = await _spawn(
                        [
                            _script(),
                            "console",
                            "--store",
                            db,
                            "--read-only",
                            "--port",
                            "0",
                            "--refresh",
                            str(refresh),
                        ],
                        stdout=subprocess.PIPE,
                        stderr=subprocess.DEVNULL,
                        text=True,
                    )
                    url = await trio.to_thread.run_sync(_read_url, console)
                    poller = await _spawn(
                        [
                            sys.executable,
                            __file__,
                            "--poll",
                            url,
                            "first",
                            "--seconds",
                            str(seconds),
                            "--reload",
                            str(reload),
                        ],
                        stdout=subprocess.PIPE,
                        text=True,
                    )
                    # The phase begins once the "browser" has loaded both pages and follows them.
                    assert poller.stdout is not None
                    ready = await trio.to_thread.run_sync(poller.stdout.readline)
                    if ready.strip() != "ready":
                        raise SystemExit(f"the poller did not start: {ready!r}")
                try:
                    rate, steps, cpu_us = await _phase(engine, seconds, in_flight)
                finally:
                    polled = ""
                    if poller is not None:
                        polled = (await trio.to_thread.run_sync(poller.communicate))[0].strip()
                    if console is not None:
                        console.terminate()
                        await trio.to_thread.run_sync(console.wait)
                        assert console.stdout is not None
                        console.stdout.close()
                rates[console_on].append(rate)
                cpus[console_on].append(cpu_us)
                record: dict[str, object] = {
                    "kind": "phase",
                    "console": console_on,
                    "steps_per_s": round(rate, 1),
                    "cpu_us_per_step": round(cpu_us, 1),
                    "steps": steps,
                    "seconds": seconds,
                    "in_flight": in_flight,
                }
                if polled:
                    loads, updates = (int(x) for x in polled.split())
                    record.update(page_loads=loads, live_updates=updates)
                emit(record)
            off = statistics.median(rates[False])
            on = statistics.median(rates[True])
            cpu_off = statistics.median(cpus[False])
            cpu_on = statistics.median(cpus[True])
            emit(
                {
                    "kind": "ratio",
                    "pairs": pairs,
                    "steps_per_s_without": round(off, 1),
                    "steps_per_s_with_console": round(on, 1),
                    "with_over_without": round(on / off, 3) if off else None,
                    "cpu_us_per_step_without": round(cpu_off, 1),
                    "cpu_us_per_step_with_console": round(cpu_on, 1),
                    "cpu_with_over_without": round(cpu_on / cpu_off, 3) if cpu_off else None,
                    "loadavg_1m": round(os.getloadavg()[0], 2),
                    "target": "with_over_without >= 0.9",
                }
            )

    trio.run(main)


def poll(url: str, workflow_id: str, seconds: float, reload: float) -> None:
    """Act as a browser for ``seconds``: two live pages open, both pages reloaded in a loop;
    print the page loads and the live updates received."""
    parts = urllib.parse.urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port
    token = urllib.parse.parse_qs(parts.query)["token"][0]

    def connect() -> http.client.HTTPConnection:
        return http.client.HTTPConnection(host, port, timeout=30)

    login = connect()
    login.request("GET", f"/?token={token}")
    response = login.getresponse()
    response.read()
    cookie = (response.getheader("set-cookie") or "").split(";", 1)[0]
    login.close()
    headers = {"Cookie": cookie}
    updates = [0]
    started = threading.Barrier(3)

    streams: list[http.client.HTTPConnection] = []

    def follow(stream: http.client.HTTPConnection, path: str) -> None:
        stream.request("GET", path, headers=headers)
        body = stream.getresponse()
        started.wait()
        try:
            while True:
                line = body.fp.readline()  # type: ignore[union-attr]
                if not line:
                    return
                if line.startswith(b"event: update"):
                    updates[0] += 1
        except (OSError, ValueError):
            return  # the socket shut down at the end

    quoted = urllib.parse.quote(workflow_id, safe="")
    threads = []
    for path in ("/live/list", f"/live/workflows/{quoted}"):
        stream = connect()
        streams.append(stream)
        threads.append(threading.Thread(target=follow, args=(stream, path)))
    for thread in threads:
        thread.start()
    loads = 0
    page = connect()
    started.wait()
    deadline = time.monotonic() + seconds
    print("ready", flush=True)
    while time.monotonic() < deadline:
        for path in ("/", f"/workflows/{quoted}"):
            page.request("GET", path, headers=headers)
            page.getresponse().read()
            loads += 1
        time.sleep(reload)
    page.close()
    for stream in streams:
        if stream.sock is not None:
            stream.sock.shutdown(socket.SHUT_RDWR)
    for thread in threads:
        thread.join()
    print(loads, updates[0])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dir", default=None, help="where the scratch directory goes")
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each phase")
    parser.add_argument("--in-flight", type=int, default=32)
    parser.add_argument("--pairs", type=int, default=2, help="phases without then with the console")
    parser.add_argument("--refresh", type=float, default=1.0, help="the console's --refresh (its default)")
    parser.add_argument("--reload", type=float, default=0.5, help="seconds between two reloads of both pages")
    parser.add_argument("--poll", nargs=2, metavar=("URL", "WORKFLOW_ID"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.poll:
        poll(args.poll[0], args.poll[1], args.seconds, args.reload)
        return
    # A smoke run (tox's bench env: --seconds 0.2) starts the console once, not once per pair.
    pairs = args.pairs if args.seconds >= 1 else 1
    run_in_scratch(
        "aion-console-bench-",
        args.dir,
        lambda directory: measure(directory, args.seconds, args.in_flight, args.refresh, args.reload, pairs),
        emit,
    )


if __name__ == "__main__":
    main()
