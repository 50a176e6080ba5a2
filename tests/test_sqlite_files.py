"""The SQLite store's files on disk: who may read them, and what happens when one is lost.

Histories hold business data, so the database and its ``-wal`` and ``-shm``
files are created ``0600`` whatever the umask (docs/operating.md).
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

import aion_trio as aion


@aion.workflow
async def noop(ctx: aion.WorkflowContext) -> str:
    await ctx.sleep(60)
    return "done"


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    previous = os.umask(mask)
    try:
        yield
    finally:
        os.umask(previous)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize("mask", [0o022, 0o000, 0o077])
async def test_the_database_wal_and_shm_are_created_0600_whatever_the_umask(
    tmp_path: Path, mask: int
) -> None:
    db = tmp_path / "orders.db"
    with umask(mask):
        async with aion.open_engine(f"sqlite:///{db}", workflows=[noop]) as engine:
            await engine.start(noop, workflow_id="w")
            files = [db, Path(f"{db}-wal"), Path(f"{db}-shm")]
            assert {f.name: oct(mode(f)) for f in files} == {f.name: "0o600" for f in files}


async def test_an_existing_database_keeps_the_permissions_its_owner_gave_it(tmp_path: Path) -> None:
    db = tmp_path / "shared.db"
    async with aion.open_store(f"sqlite:///{db}"):
        pass
    os.chmod(db, 0o640)
    with umask(0o022):
        async with aion.open_engine(f"sqlite:///{db}", workflows=[noop]) as engine:
            await engine.start(noop, workflow_id="w")
            assert mode(db) == 0o640
            assert mode(Path(f"{db}-wal")) == 0o640  # SQLite gives it the database's bits
