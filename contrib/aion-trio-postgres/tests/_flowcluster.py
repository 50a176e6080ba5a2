"""Engine processes on one schema, for the multi-node flow-control tests (issue 18).

``Nodes`` spawns node scripts (``flow_node.py``, ``flow_queue_node.py``), each
an engine in cluster mode on one schema, with their side-table settings in the
environment (``FLOW_SIDE_URL``, ``FLOW_SCHEMA``, ``FLOW_NODE``); the test reads
the side tables and the store through :meth:`Nodes.query`, waits with
:func:`wait_for` (bounded; a timeout fails with every node's log) and counts the
runs or attempts that overlapped with :func:`peak_overlap`, on the database's
clock.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
import trio

HERE = Path(__file__).parent


class Nodes:
    """The engine processes of one test, on schema ``schema`` of the server at ``base``."""

    def __init__(self, base: str, schema: str, tmp: Path) -> None:
        self.base, self.schema, self.tmp = base, schema, tmp
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def spawn(self, name: str, script: str, *args: str, env: dict[str, str] | None = None) -> None:
        """Start ``script`` (in this directory) as node ``name``: ``--url --schema --node``, then ``args``."""
        environ = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
            "FLOW_SIDE_URL": self.base,
            "FLOW_SCHEMA": self.schema,
            "FLOW_NODE": name,
            **(env or {}),
        }
        argv = [sys.executable, str(HERE / script), "--url", self.base, "--schema", self.schema]
        argv += ["--node", name, *args]
        with (self.tmp / f"{name}.log").open("wb") as out:
            self.procs[name] = subprocess.Popen(
                argv, cwd=HERE, env=environ, stdout=out, stderr=subprocess.STDOUT
            )

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    def logs(self) -> str:
        return "\n".join(f"--- {name}\n{self.log(name)[-3000:]}" for name in self.procs)

    def query(self, text: str, params: Any = None) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.base, autocommit=True) as conn:
            conn.execute("SELECT set_config('search_path', %s, false)", (self.schema,))
            cur = conn.execute(text, params)
            return cur.fetchall() if cur.description else []

    def kill(self, name: str) -> datetime:
        """SIGKILL node ``name``, wait for it to die; the database's clock just after."""
        proc = self.procs[name]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        assert proc.returncode == -signal.SIGKILL, proc.returncode
        return self.query("SELECT clock_timestamp()")[0][0]  # type: ignore[no-any-return]

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


async def wait_for(what: str, check: Callable[[], object], nodes: Nodes, seconds: float = 90) -> None:
    """Poll ``check`` (other processes write what it looks at) until true; fail after ``seconds``."""
    with trio.move_on_after(seconds):
        while not check():
            exited = {name: p.returncode for name, p in nodes.procs.items() if p.poll() not in (None, -9)}
            if exited:
                pytest.fail(f"a node exited while waiting for {what}: {exited}\n{nodes.logs()}")
            await trio.sleep(0.1)
        return
    pytest.fail(f"timed out waiting for {what}\n{nodes.logs()}")


def peak_overlap(
    nodes: Nodes, table: str, killed: str, killed_at: datetime, where: str = "TRUE", per: str = "o.id"
) -> int:
    """The most rows of side table ``table`` (``id``, ``began``, ``ended``, ``node``) open
    at one moment, of those matching ``where``, counting distinct values of ``per`` (the
    default: every row); a row of the killed node that never logged its end counts until
    the kill."""
    rows = nodes.query(
        f"SELECT max(n) FROM (SELECT (SELECT count(DISTINCT {per}) FROM {table} o WHERE ({where})"
        " AND o.began <= s.began"
        " AND coalesce(o.ended, CASE WHEN o.node = %s THEN %s END, 'infinity') > s.began) AS n"
        f" FROM {table} s WHERE ({where})) AS counts",
        (killed, killed_at),
    )
    return int(rows[0][0] or 0)
