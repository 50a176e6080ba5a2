"""A PostgreSQL server a test owns: its own data directory and port, stopped and restarted at will.

Never the shared server: :class:`OwnServer` runs ``initdb`` into a fresh
directory and ``pg_ctl`` on a free loopback port (``fsync=off``: its data
need not survive the machine).  Under root the binaries run as the
``postgres`` user (``runuser``), as PostgreSQL refuses to run as root.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest

PG_BIN_ENV = "AION_TRIO_TEST_PG_BIN"
DEFAULT_PG_BIN = "/usr/lib/postgresql/15/bin"


def pg_bin() -> Path:
    return Path(os.environ.get(PG_BIN_ENV, "").strip() or DEFAULT_PG_BIN)


def require_binaries() -> None:
    """Skip (with CI=true: fail) when initdb/pg_ctl are missing."""
    if (pg_bin() / "initdb").exists() and (pg_bin() / "pg_ctl").exists():
        return
    message = f"no initdb/pg_ctl in {pg_bin()}; set {PG_BIN_ENV} to PostgreSQL's bin directory"
    if os.environ.get("CI", "").strip().lower() in ("1", "true", "yes"):
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class OwnServer:
    def __init__(self) -> None:
        # A directory of its own under the system temporary directory, which the
        # postgres user can reach (pytest's tmp_path is private to the test's user).
        self.directory = Path(tempfile.mkdtemp(prefix="aion-pg-"))
        self.data = self.directory / "data"
        self.port = _free_port()
        self._as_postgres = os.geteuid() == 0
        if self._as_postgres:
            shutil.chown(self.directory, "postgres")
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-N")

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, tool: str, *args: str) -> None:
        command = [str(pg_bin() / tool), *args]
        if self._as_postgres:
            command = ["runuser", "-u", "postgres", "--", *command]
        subprocess.run(command, check=True, capture_output=True, timeout=60)

    def start(self) -> None:
        options = f"-p {self.port} -k {self.directory} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run(
            "pg_ctl",
            "-D",
            str(self.data),
            "-l",
            str(self.directory / "server.log"),
            "-o",
            options,
            "-w",
            "start",
        )

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")

    def destroy(self) -> None:
        try:
            self.stop("immediate")
        except subprocess.CalledProcessError:
            pass  # not running
        shutil.rmtree(self.directory, ignore_errors=True)
