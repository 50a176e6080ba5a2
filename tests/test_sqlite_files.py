"""The SQLite store's files on disk: who may read them, and what happens when one is lost.

Histories hold business data, so the database and its ``-wal`` and ``-shm``
files are created ``0600`` whatever the umask (docs/operating.md).
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import trio

import aion_trio as aion
from aion_trio.plugin import Store
from aion_trio_sqlite import _walguard

T0 = datetime(2031, 1, 2, tzinfo=timezone.utc)


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


# --------------------------------------------------------------------------
# A lost -wal file (aion_trio_sqlite._walguard)
# --------------------------------------------------------------------------


def _marker(workflow_id: str, seq: int) -> aion.Event:
    return aion.Event(
        workflow_id=workflow_id,
        seq=seq,
        recorded_at=T0 + timedelta(microseconds=seq),
        body=aion.MarkerRecorded(name=f"m{seq}", value=aion.Payload.of(seq)),
    )


async def _append(store: Store, workflow_id: str, head: int, n: int = 1) -> int:
    await store.events.append(workflow_id, [_marker(workflow_id, head + k + 1) for k in range(n)], head)
    return head + n


@pytest.mark.parametrize("inline", ["on", "off"])
async def test_a_deleted_wal_is_noticed_its_writes_saved_and_later_writes_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, inline: str
) -> None:
    monkeypatch.setattr(_walguard, "CHECK_INTERVAL", 0.0)  # check after every transaction
    db = tmp_path / "w.db"
    url = f"sqlite:///{db}?inline_commits={inline}"
    async with aion.open_store(url) as store:
        head = await _append(store, "a", 0, 3)
        os.unlink(f"{db}-wal")
        refused: str | None = None
        with trio.fail_after(5):
            # The check runs on the writer thread between transactions, so an append or
            # two may still be acknowledged (SQLite writes them to the deleted file).
            while refused is None:
                try:
                    head = await _append(store, "a", head)
                except aion.DatabaseCorrupt as exc:
                    refused = str(exc)
                else:
                    await trio.sleep(0.01)  # the thread's upkeep: nothing to wait on
        assert "-wal file" in refused
        assert "restart the engine" in refused
    assert "was deleted while the store was open" in caplog.text
    async with aion.open_store(f"sqlite:///{db}") as store:
        # Every acknowledged write was saved into the database file.
        assert [e.seq for e in await store.events.read_history("a")] == list(range(1, head + 1))


async def test_a_store_whose_acknowledged_history_went_backwards_refuses_to_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_walguard, "CHECK_INTERVAL", 0.0)
    db = tmp_path / "b.db"
    async with aion.open_store(f"sqlite:///{db}") as store:
        await _append(store, "a", 0, 2)
    old = db.read_bytes()
    async with aion.open_store(f"sqlite:///{db}") as store:
        await _append(store, "a", 2, 2)
        await _append(store, "z", 0)  # the mark follows the last acknowledged append
    db.write_bytes(old)  # an older copy put in place (as a lost -wal leaves it)
    with pytest.raises(aion.DatabaseCorrupt, match="went backwards") as caught:
        async with aion.open_store(f"sqlite:///{db}"):
            pass  # pragma: no cover - refused
    assert "b.db-mark" in str(caught.value)
    # The operator accepts the file as it is by deleting the mark.
    os.unlink(f"{db}-mark")
    async with aion.open_store(f"sqlite:///{db}") as store:
        assert len(await store.events.read_history("a")) == 2


async def test_a_new_database_file_forgets_a_left_over_mark(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_walguard, "CHECK_INTERVAL", 0.0)
    db = tmp_path / "n.db"
    async with aion.open_store(f"sqlite:///{db}") as store:
        await _append(store, "a", 0, 2)
    assert mode(Path(f"{db}-mark")) == 0o600
    for suffix in ("", "-wal", "-shm"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"{db}{suffix}")
    async with aion.open_store(f"sqlite:///{db}") as store:  # rm file.db: a new store, not a corrupt one
        assert await store.events.read_history("a") == []


@pytest.mark.slow
def test_a_wal_deleted_under_a_running_writer_then_sigkill_is_refused_at_the_next_open(
    tmp_path: Path,
) -> None:
    """The issue's sequence, with a real process: its -wal deleted, then SIGKILL.

    The child never checkpoints, so every acknowledged batch lives only in the
    -wal file.  It is stopped (SIGSTOP) before the file is deleted, so its guard
    cannot save the writes first: they are lost, and the next open must say so
    instead of treating the file as a new, empty store.
    """
    db = tmp_path / "k.db"
    mark = Path(f"{db}-mark")
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.procs.lost_wal_writer", str(db)],
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    acked = 0
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 60
        while acked < 200 or not mark.exists():
            line = proc.stdout.readline()
            assert line.startswith("ACK "), (
                f"writer stopped: {line!r} {proc.stderr.read() if proc.stderr else ''}"
            )
            acked += 1
            assert time.monotonic() < deadline, "the child never wrote its mark"
        os.kill(proc.pid, signal.SIGSTOP)
        os.unlink(f"{db}-wal")
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
    assert proc.returncode == -signal.SIGKILL

    async def reopen() -> list[str]:
        async with aion.open_store(f"sqlite:///{db}") as store:
            return list(await store.events.list_workflow_ids())

    with pytest.raises(aion.DatabaseCorrupt, match="went backwards"):
        trio.run(reopen)
    # Control: the loss is real.  Without the mark, the file opens as a store
    # that never held anything, the silent outcome this test pins against.
    mark.unlink()
    assert trio.run(reopen) == []
