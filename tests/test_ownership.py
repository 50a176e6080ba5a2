"""One owner per embedded store, and the command inbox the owner drains.

Engine-level: the claim at open, refusal naming a live owner (from a real
second process), takeover of a SIGKILLed owner's claim, release at close,
losing the claim, and inbox commands applied at open and by ``drain_inbox``.
The worker-subprocess side (commands applied by a running worker) is in
``tests/test_cli.py``.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path

import apsw
import attrs
import pytest
import trio

import aion_trio as aion
from aion_trio import (
    CancelCommand,
    CommandOutcome,
    EngineConfig,
    NotOwner,
    OwnerIdentity,
    Payload,
    ReopenCommand,
    SignalCommand,
    StartCommand,
    StoreOwned,
    StoreTakenOver,
    TerminateCommand,
)
from aion_trio.plugin import OwnerClaim, process_mark, this_host

ROOT = Path(__file__).resolve().parent.parent


@aion.activity
async def greet(name: str) -> str:
    return f"hello {name}"


@aion.workflow
async def approval(ctx: aion.WorkflowContext, order: int) -> dict[str, object]:
    decision = await ctx.wait_signal("approve")
    return {"order": order, "decision": decision}


@aion.workflow
async def hello(ctx: aion.WorkflowContext, name: str) -> str:
    return await ctx.run(greet, name)


WORKFLOWS = [approval, hello]
QUIET = EngineConfig(inbox_poll_interval=None)


def _opener(url: str, extra: str = "") -> str:
    """A child process that opens an engine on ``url``, says READY, and waits to be killed."""
    return textwrap.dedent(
        f"""
        import sys, trio, aion_trio
        async def main():
            try:
                async with aion_trio.open_engine({url!r}):
                    print("READY", flush=True)
                    {extra or "await trio.sleep_forever()"}
            except aion_trio.StoreOwned as exc:
                print(f"OWNED pid={{exc.pid}} host={{exc.host}} since={{exc.since.isoformat()}}", flush=True)
                print(exc, file=sys.stderr)
                sys.exit(3)
        trio.run(main)
        """
    )


def _sqlite(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path}/owned.db"


async def test_a_second_engine_in_another_process_is_refused_naming_the_owner(tmp_path: Path) -> None:
    url = _sqlite(tmp_path)
    async with aion.open_engine(url, workflows=WORKFLOWS, activities=[greet], config=QUIET) as engine:
        claim = engine.owner_claim
        assert claim is not None
        assert (claim.identity.pid, claim.identity.host) == (os.getpid(), this_host())
        with trio.fail_after(60):
            result = await trio.run_process(
                [sys.executable, "-c", _opener(url)], capture_stdout=True, capture_stderr=True, check=False
            )
        assert result.returncode == 3, result.stderr
        line = result.stdout.decode().strip()
        assert line == f"OWNED pid={os.getpid()} host={this_host()} since={claim.since.isoformat()}"
        message = result.stderr.decode()
        assert f"is owned by a live engine: pid {os.getpid()} on host {this_host()!r}" in message
        # Still ours, and still serving.
        handle = await engine.start(hello, "x", workflow_id="still-mine")
        assert await handle.result() == "hello x"


async def test_a_second_engine_in_this_process_is_refused_and_the_first_keeps_its_claim(
    store_url: Callable[[], str],
) -> None:
    url = store_url()
    async with aion.open_engine(url, workflows=WORKFLOWS, config=QUIET) as first:
        with pytest.raises(StoreOwned) as refused:
            async with aion.open_engine(url, workflows=WORKFLOWS, config=QUIET):
                pytest.fail("the second engine opened")  # pragma: no cover
        assert (refused.value.pid, refused.value.host) == (os.getpid(), this_host())
        owner = await first.store.current_owner()  # type: ignore[attr-defined]
        assert owner is not None
        assert first.owner_claim is not None
        assert owner.identity == first.owner_claim.identity


async def test_the_claim_is_released_when_the_engine_closes(store_url: Callable[[], str]) -> None:
    url = store_url()
    async with aion.open_engine(url, config=QUIET):
        pass
    async with aion.open_store(url) as store:
        assert await store.current_owner() is None  # type: ignore[attr-defined]
    # ... so the next engine opens at once.
    async with aion.open_engine(url, config=QUIET) as engine:
        assert engine.owner_claim is not None


def test_a_sigkilled_owner_is_taken_over_by_the_next_engine(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url = _sqlite(tmp_path)
    with subprocess.Popen(
        [sys.executable, "-c", _opener(url)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    ) as child:
        try:
            assert child.stdout is not None
            assert child.stdout.readline().strip() == "READY"
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=60)  # reaped: the pid is gone, not a zombie
        finally:
            if child.poll() is None:  # pragma: no cover - only if the child failed to start
                child.kill()
                child.wait()

    async def reopen() -> tuple[object, object]:
        async with aion.open_store(url) as store:
            left = await store.current_owner()  # type: ignore[attr-defined]
        async with aion.open_engine(url, config=QUIET) as engine:
            return left, engine.owner_claim

    with caplog.at_level(logging.WARNING, logger="aion_trio.engine"):
        left, taken = trio.run(reopen)
    assert left is not None
    assert left.identity.pid == child.pid  # type: ignore[attr-defined]
    assert taken is not None
    assert taken.identity.pid == os.getpid()  # type: ignore[attr-defined]
    assert any(
        f"took the store over from a dead owner: pid {child.pid} on host {this_host()!r}" in r.getMessage()
        for r in caplog.records
    )


async def test_an_engine_whose_claim_was_taken_over_stops_with_not_owner(tmp_path: Path) -> None:
    url = _sqlite(tmp_path)
    fast = EngineConfig(inbox_poll_interval=None, owner_heartbeat=0.02, owner_stale_after=0.05)
    engines: list[aion.Engine] = []

    async def serve_until_taken_over(store: aion.Store) -> None:
        async with aion.open_engine(store, workflows=WORKFLOWS, config=fast) as engine:
            engines.append(engine)
            # Another process judges this engine dead (its clock is far ahead) and takes over.
            usurper = OwnerIdentity(pid=1, host="elsewhere.invalid", started_at=aion_now(), token="usurper")
            await store.claim_owner(  # type: ignore[attr-defined]
                usurper, now=aion_now() + timedelta(hours=1), stale_after=timedelta(hours=1)
            )
            await trio.sleep_forever()  # the next heartbeat ends the engine

    async with aion.open_store(url) as store:
        with (
            trio.fail_after(30),
            pytest.raises(StoreTakenOver, match="lost its claim on the store") as stopped,
        ):
            await serve_until_taken_over(store)
        assert isinstance(stopped.value, NotOwner)  # the common base still catches it
        assert stopped.value.shard == "store"
        assert not engines[0].epoch.is_open
        owner = await store.current_owner()  # type: ignore[attr-defined]
        assert owner is not None
        assert owner.identity.token == "usurper"


def aion_now() -> datetime:
    return datetime.now(timezone.utc)


async def test_commands_queued_with_no_owner_are_applied_at_the_next_open(
    store_url: Callable[[], str],
) -> None:
    url = store_url()
    async with aion.open_engine(url, workflows=WORKFLOWS, activities=[greet], config=QUIET) as engine:
        await engine.start(approval, 7, workflow_id="ap")
        done = await engine.start("hello", "ann", workflow_id="done")
        assert await done.result() == "hello ann"
    async with aion.open_store(url) as store:
        inbox: aion.CommandInbox = store  # type: ignore[assignment]
        assert await store.current_owner() is None  # type: ignore[attr-defined]
        ids = [
            await inbox.enqueue_command(
                SignalCommand(workflow_id="ap", name="approve", payload=Payload.of("yes"))
            ),
            await inbox.enqueue_command(CancelCommand(workflow_id="nobody", reason="typo")),
            await inbox.enqueue_command(
                StartCommand(workflow_id="hi", workflow_type="hello", args=Payload.of(["zoe"]))
            ),
            # Refusals that do not depend on how far other workflows got meanwhile:
            await inbox.enqueue_command(TerminateCommand(workflow_id="done", reason="late")),
            await inbox.enqueue_command(ReopenCommand(workflow_id="done")),
        ]
    async with aion.open_engine(url, workflows=WORKFLOWS, activities=[greet], config=QUIET) as engine:
        inbox = engine.store  # type: ignore[assignment]
        assert await inbox.pending_commands() == []
        outcomes = [await inbox.command_outcome(i) for i in ids]
        assert await engine.result("ap") == {"order": 7, "decision": "yes"}
        assert await engine.result("hi") == "hello zoe"
        history = await engine.history("hi")
    start_run = history[0].body.run_id  # type: ignore[attr-defined]
    assert outcomes == [
        CommandOutcome(ok=True, message="signal 'approve' recorded for workflow 'ap'"),
        CommandOutcome(
            ok=False, message="workflow 'nobody' does not exist in this store", error_type="WorkflowNotFound"
        ),
        CommandOutcome(ok=True, message=f"started workflow 'hi' run {start_run}", run_id=start_run),
        CommandOutcome(
            ok=False,
            message="cannot terminate workflow 'done': it is completed, not running; nothing was recorded",
            error_type="NotRunning",
        ),
        CommandOutcome(
            ok=False,
            message=f"cannot reopen workflow 'done' (run {done.run_id}): it is completed; only failed or "
            "cancelled runs can be reopened; nothing was recorded",
            error_type="CannotReopen",
        ),
    ]


async def test_drain_inbox_applies_commands_in_order_through_the_recorder(
    store_url: Callable[[], str],
) -> None:
    url = store_url()
    async with aion.open_engine(url, workflows=WORKFLOWS, activities=[greet], config=QUIET) as engine:
        await engine.start(approval, 1, workflow_id="ap")
        inbox: aion.CommandInbox = engine.store  # type: ignore[assignment]
        for n in range(3):
            await inbox.enqueue_command(
                SignalCommand(workflow_id="ap", name=f"note-{n}", payload=Payload.of(n))
            )
        await inbox.enqueue_command(SignalCommand(workflow_id="ap", name="approve", payload=Payload.of(True)))
        assert await engine.drain_inbox() == 4
        assert await engine.drain_inbox() == 0
        assert await engine.result("ap") == {"order": 1, "decision": True}
        signals = [e.body for e in await engine.history("ap") if isinstance(e.body, aion.SignalReceived)]
    assert [(s.name, s.payload.value()) for s in signals] == [
        ("note-0", 0),
        ("note-1", 1),
        ("note-2", 2),
        ("approve", True),
    ]


async def test_engine_config_checks_the_ownership_settings() -> None:
    with pytest.raises(ValueError, match=r"owner_stale_after .* must be at least twice owner_heartbeat"):
        EngineConfig(owner_heartbeat=5, owner_stale_after=9)
    with pytest.raises(ValueError, match=r"inbox_poll_interval must be > 0"):
        EngineConfig(inbox_poll_interval=0)


async def test_a_store_without_the_capabilities_opens_without_a_claim() -> None:
    from aion_trio.testing import FlakyStoreBundle

    async with aion.open_store("memory://") as inner:
        async with aion.open_engine(FlakyStoreBundle(inner), workflows=WORKFLOWS, config=QUIET) as engine:
            assert engine.owner_claim is None
            assert await engine.drain_inbox() == 0
        assert await inner.current_owner() is None  # type: ignore[attr-defined]


def test_wall_clock_heartbeats_renew_the_claim(tmp_path: Path) -> None:
    """Heartbeats run on the wall clock in a thread: they renew while the body waits."""
    url = _sqlite(tmp_path)
    fast = EngineConfig(inbox_poll_interval=None, owner_heartbeat=0.01, owner_stale_after=10)

    async def run() -> tuple[object, object]:
        async with aion.open_engine(url, config=fast) as engine:
            first = engine.owner_claim
            deadline = time.monotonic() + 30
            while engine.statistics().owner_renewals < 3:
                assert time.monotonic() < deadline, "no heartbeats"
                await trio.sleep(0.01)
            async with aion.open_store(url) as other:
                stored = await other.current_owner()  # type: ignore[attr-defined]
            return first, stored

    first, stored = trio.run(run)
    assert stored.renewed_at > first.renewed_at  # type: ignore[attr-defined]
    assert stored.since == first.since  # type: ignore[attr-defined]


# --------------------------------------------------------------------------
# A live owner that stalls is not taken over; a resumed zombie writes nothing (issue 14, item 8)
# --------------------------------------------------------------------------


def _stored_owner(path: str) -> tuple[str, int]:
    """``(token, renewed_at in µs)`` of the owner row, read with a connection of its own (no Trio)."""
    conn = apsw.Connection(path, flags=apsw.SQLITE_OPEN_READONLY)
    try:
        [(token, renewed)] = conn.execute("SELECT token, renewed_at FROM owner WHERE id = 1").fetchall()
    finally:
        conn.close()
    return token, renewed


def test_heartbeats_go_on_while_the_trio_loop_is_blocked(tmp_path: Path) -> None:
    path = str(tmp_path / "blocked.db")
    fast = EngineConfig(inbox_poll_interval=None, owner_heartbeat=0.01, owner_stale_after=10)

    @aion.activity
    async def hog() -> int:
        # Blocks the Trio thread (never yields) and watches the claim from outside the loop.
        _, first = _stored_owner(path)
        seen = {first}
        deadline = time.monotonic() + 30
        while len(seen) < 4 and time.monotonic() < deadline:
            time.sleep(0.005)  # noqa: ASYNC251 - blocking the loop is the point
            seen.add(_stored_owner(path)[1])
        return len(seen) - 1

    @aion.workflow
    async def hogging(ctx: aion.WorkflowContext) -> int:
        return await ctx.run(hog)

    async def run() -> int:
        async with aion.open_engine(
            f"sqlite:///{path}", workflows=[hogging], activities=[hog], config=fast
        ) as e:
            handle = await e.start(hogging, workflow_id="hog")
            with trio.fail_after(60):
                return await handle.result()  # type: ignore[no-any-return]

    assert trio.run(run) == 3  # three renewals landed while the loop was blocked


async def test_a_write_through_a_handle_whose_claim_was_taken_over_is_refused_and_writes_nothing(
    tmp_path: Path,
) -> None:
    url = _sqlite(tmp_path)
    async with aion.open_store(url) as zombie, aion.open_store(url) as usurper:
        mine = await zombie.claim_owner(  # type: ignore[attr-defined]
            OwnerIdentity.current(), now=aion_now(), stale_after=timedelta(seconds=30)
        )
        first = aion.Event(
            workflow_id="w",
            seq=1,
            recorded_at=aion_now(),
            body=aion.MarkerRecorded(name="m", value=Payload.of(None)),
        )
        await zombie.events.append("w", [first], 0)
        # Judged dead by a clock far ahead (this process's own claim goes by its heartbeat).
        taker = OwnerIdentity(pid=1, host="elsewhere.invalid", started_at=aion_now(), token="taker")
        await usurper.claim_owner(  # type: ignore[attr-defined]
            taker, now=aion_now() + timedelta(hours=1), stale_after=timedelta(hours=1)
        )
        second = attrs.evolve(first, seq=2)
        with pytest.raises(StoreTakenOver, match="appending events refused, nothing written") as refused:
            await zombie.events.append("w", [second], 1)
        assert "now held by pid 1 on host 'elsewhere.invalid'" in str(refused.value)
        with pytest.raises(StoreTakenOver):
            await zombie.events.schedule_timer("w", "t", aion_now())
        with pytest.raises(StoreTakenOver):
            await zombie.renew_owner(mine, now=aion_now())  # type: ignore[attr-defined]
        caught: list[NotOwner] = []
        try:  # the common base still catches it
            await zombie.events.append("w", [second], 1)
        except NotOwner as exc:
            caught.append(exc)
        assert [type(exc) for exc in caught] == [StoreTakenOver]
        assert [e.seq for e in await usurper.events.read_history("w")] == [1]
        assert await usurper.events.expired_timers(aion_now() + timedelta(days=1)) == []
        # The new owner writes; a command from anyone is still queued (the inbox is for non-owners).
        await usurper.events.append("w", [second], 1)
        assert await zombie.enqueue_command(CancelCommand(workflow_id="w")) >= 1  # type: ignore[attr-defined]


def test_a_same_host_owner_whose_process_lives_is_live_however_old_its_heartbeat() -> None:
    from aion_trio.plugin import claim_is_live

    parent = os.getppid()  # a live process on this host that is not this one
    mark = process_mark(parent)
    owner = OwnerIdentity(pid=parent, host=this_host(), started_at=aion_now(), token="t", process=mark)
    ancient = OwnerClaim(
        identity=owner,
        since=aion_now(),
        renewed_at=aion_now() - timedelta(days=1),
        stale_after=timedelta(seconds=1),
    )
    assert claim_is_live(ancient, aion_now())
    if mark is not None:
        # The same pid, but another process (its start mark differs): the pid was reused.
        reused = attrs.evolve(ancient, identity=attrs.evolve(owner, process=mark + "-earlier"))
        assert not claim_is_live(reused, aion_now())
    # This very process's own claim (an engine here never released it) goes by its heartbeat.
    mine = attrs.evolve(ancient, identity=OwnerIdentity.current())
    assert not claim_is_live(mine, aion_now())
    assert claim_is_live(attrs.evolve(mine, renewed_at=aion_now()), aion_now())


def _types(url: str, workflow_id: str) -> list[str]:
    conn = apsw.Connection(url.removeprefix("sqlite:///"), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        rows = conn.execute("SELECT type FROM events WHERE workflow_id = ? ORDER BY seq", (workflow_id,))
        return [t for (t,) in rows]
    finally:
        conn.close()


def _stop_between_writes(child: subprocess.Popen[str], url: str) -> None:
    """SIGSTOP ``child`` at a moment it holds no write lock on the store (else resume, retry)."""
    conn = apsw.Connection(url.removeprefix("sqlite:///"))
    try:
        for _ in range(500):
            child.send_signal(signal.SIGSTOP)
            try:
                conn.execute("BEGIN IMMEDIATE")
                conn.execute("ROLLBACK")
                return
            except apsw.BusyError:
                child.send_signal(signal.SIGCONT)
                time.sleep(0.005)
    finally:
        conn.close()
    pytest.fail("the child never paused between two writes")


_ZOMBIE = textwrap.dedent(
    """
    import socket, sys, trio, aion_trio
    socket.gethostname = lambda: "zombie-host.invalid"  # an owner on another host
    from tests.procs.cli_app import gate, gated
    async def main():
        config = aion_trio.EngineConfig(inbox_poll_interval=None, owner_heartbeat=5, owner_stale_after=10)
        try:
            async with aion_trio.open_engine(
                sys.argv[1], workflows=[gated], activities=[gate], config=config
            ) as engine:
                await engine.start(gated, sys.argv[2], workflow_id="z")
                print("READY", flush=True)
                await trio.sleep_forever()
        except aion_trio.NotOwner as exc:
            print(f"NOTOWNER {type(exc).__name__} {exc}", flush=True)
            sys.exit(4)
    trio.run(main)
    """
)


def test_a_resumed_zombie_is_fenced_and_writes_nothing(tmp_path: Path) -> None:
    """SIGSTOP an owner on "another host", take its store over, SIGCONT it: its in-flight
    activity finishes, and the append of its outcome is refused (StoreTakenOver) and ends the engine
    at once, long before its next heartbeat would have noticed."""
    url, gate = _sqlite(tmp_path), tmp_path / "gate"
    with subprocess.Popen(
        [sys.executable, "-c", _ZOMBIE, url, str(gate)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as child:
        try:
            assert child.stdout is not None
            assert child.stdout.readline().strip() == "READY"
            deadline = time.monotonic() + 60
            while "ActivityStarted" not in _types(url, "z"):  # the attempt is in flight, and recorded
                assert time.monotonic() < deadline, "the attempt never started"
                assert child.poll() is None, "the child exited early"
                time.sleep(0.01)
            _stop_between_writes(child, url)

            async def take_over() -> tuple[object, list[str]]:
                async with aion.open_store(url) as store:
                    claim = await store.claim_owner(  # type: ignore[attr-defined]
                        OwnerIdentity.current(),
                        now=aion_now() + timedelta(hours=1),
                        stale_after=timedelta(hours=1),
                    )
                    return claim, [type(e.body).__name__ for e in await store.events.read_history("z")]

            claim, before = trio.run(take_over)
            assert claim.replaced.host == "zombie-host.invalid"  # type: ignore[attr-defined]
            gate.touch()  # the zombie's attempt may now finish
            child.send_signal(signal.SIGCONT)
            out, err = child.communicate(timeout=4)  # its heartbeat (5 s) would come later
        finally:
            if child.poll() is None:
                child.send_signal(signal.SIGCONT)
                child.kill()
                child.wait()
    assert child.returncode == 4, err
    assert out.startswith("NOTOWNER StoreTakenOver "), out
    assert "refused, nothing written" in out

    async def after() -> tuple[list[str], object]:
        async with aion.open_store(url) as store:
            history = [type(e.body).__name__ for e in await store.events.read_history("z")]
            return history, await store.current_owner()  # type: ignore[attr-defined]

    history, owner = trio.run(after)
    assert history == before  # the zombie wrote nothing
    assert "ActivityCompleted" not in history
    assert owner.identity.token == claim.identity.token  # type: ignore[attr-defined]
