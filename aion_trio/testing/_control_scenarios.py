"""Conformance scenarios for the optional capabilities :class:`~aion_trio.OwnedStore`,
:class:`~aion_trio.CommandInbox`, :class:`~aion_trio.RecoveryCounts`,
:class:`~aion_trio.ScheduleStore` and :class:`~aion_trio.BulkHistoryReads`.

These scenarios open stores through a *keyed* factory, ``open_store(key)``:
the same key opens the same store again (a second handle at the same time, or
a reopen after close), which is how they check concurrency between handles
and durability.  Every time the scenarios pass is chosen by them (``now=``),
so nothing depends on the wall clock.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import attrs
import trio

from .._commands import (
    CancelCommand,
    CommandOutcome,
    ReopenCommand,
    SignalCommand,
    StartCommand,
    TerminateCommand,
)
from .._errors import NotFound, ScheduleAlreadyExists, ScheduleConflict, StoreOwned, StoreTakenOver
from .._ownership import OwnerClaim, OwnerIdentity, pid_alive, this_host
from .._payload import Payload
from . import _samples as s
from ._kit import ScenarioContext, short

DEAD_PID = 2**31 - 1
"""A pid no process has (beyond every kernel's pid range)."""
OTHER_HOST = "elsewhere.invalid"
"""A host name that is never this host, so only the heartbeat decides liveness."""
STALE = timedelta(seconds=10)
CONTENDERS = 4


def _at(seconds: float) -> Any:
    return s.BASE_TIME + timedelta(seconds=seconds)


def _identity(tag: str, *, pid: int | None = None, host: str | None = None) -> OwnerIdentity:
    return OwnerIdentity(
        pid=os.getpid() if pid is None else pid,
        host=this_host() if host is None else host,
        started_at=s.BASE_TIME - timedelta(minutes=1),
        token=f"token-{tag}",
    )


def _core(claim: OwnerClaim | None) -> Any:
    """What a stored claim must keep (``replaced`` is informative and need not be stored)."""
    if claim is None:
        return None
    return (claim.identity, claim.since, claim.renewed_at, claim.stale_after)


async def _claim_ok(ctx: ScenarioContext, store: Any, identity: OwnerIdentity, at: float) -> OwnerClaim:
    try:
        claim: OwnerClaim = await store.claim_owner(identity, now=_at(at), stale_after=STALE)
    except Exception as exc:
        ctx.fail(
            f"claim_owner({identity.token}, now=BASE+{at}s) raised {type(exc).__name__}: {exc}; "
            "expected it to succeed"
        )
    if not isinstance(claim, OwnerClaim) or claim.identity != identity:
        ctx.fail(f"claim_owner({identity.token}) returned {short(claim)}, expected a claim for that identity")
    return claim


async def _expect_refused(
    ctx: ScenarioContext, store: Any, identity: OwnerIdentity, at: float, owner: OwnerIdentity, what: str
) -> None:
    with ctx.expect_raises(StoreOwned, what) as raised:
        await store.claim_owner(identity, now=_at(at), stale_after=STALE)
    found = raised.value
    ctx.expect_equal((found.pid, found.host), (owner.pid, owner.host), f"{what}: the owner StoreOwned names")


async def _expect_owner(ctx: ScenarioContext, store: Any, expected: OwnerClaim | None, what: str) -> None:
    current = await store.current_owner()
    ctx.expect_equal(_core(current), _core(expected), what)


@contextlib.asynccontextmanager
async def _no_dead_pid(ctx: ScenarioContext) -> AsyncIterator[None]:
    if pid_alive(DEAD_PID):  # pragma: no cover - would mean the platform reuses any pid
        ctx.fail(f"pid {DEAD_PID} exists on this host; the scenario needs a pid no process has")
    yield


# --------------------------------------------------------------------------
# Ownership
# --------------------------------------------------------------------------


async def owner_claim_round_trip(ctx: ScenarioContext) -> None:
    """No owner at first; a claim is returned with now as since and renewed_at, and current_owner reads it."""
    async with ctx.open() as store:
        await _expect_owner(ctx, store, None, "current_owner() of a fresh store")
        a = _identity("a")
        claim = await _claim_ok(ctx, store, a, 0)
        ctx.expect_equal(
            (claim.since, claim.renewed_at, claim.stale_after), (_at(0), _at(0), STALE), "the returned claim"
        )
        await _expect_owner(ctx, store, claim, "current_owner() after the claim")


async def owner_live_owner_refuses(ctx: ScenarioContext) -> None:
    """A live owner's claim refuses every other claimant with StoreOwned naming it, and stays."""
    async with ctx.open() as store:
        a = _identity("a")
        claim = await _claim_ok(ctx, store, a, 0)
        await _expect_refused(ctx, store, _identity("b"), 1, a, "a second claimant on this host")
        await _expect_refused(
            ctx, store, _identity("c", host=OTHER_HOST), 9.9, a, "a claimant on another host"
        )
        await _expect_owner(ctx, store, claim, "current_owner() after refused claims")


async def owner_reclaim_by_same_token_refreshes(ctx: ScenarioContext) -> None:
    """The owner claiming again (same token) succeeds, keeps since and moves renewed_at."""
    async with ctx.open() as store:
        a = _identity("a")
        await _claim_ok(ctx, store, a, 0)
        again = await _claim_ok(ctx, store, a, 5)
        ctx.expect_equal((again.since, again.renewed_at), (_at(0), _at(5)), "the re-claimed claim")
        await _expect_owner(ctx, store, again, "current_owner() after the re-claim")


async def owner_dead_pid_taken_over(ctx: ScenarioContext) -> None:
    """A same-host owner whose pid is gone is taken over at once, heartbeat fresh or not."""
    async with _no_dead_pid(ctx), ctx.open() as store:
        dead = _identity("dead", pid=DEAD_PID)
        await _claim_ok(ctx, store, dead, 0)
        b = _identity("b")
        claim = await _claim_ok(ctx, store, b, 1)
        ctx.expect_equal((claim.since, claim.renewed_at), (_at(1), _at(1)), "the takeover claim")
        await _expect_owner(ctx, store, claim, "current_owner() after the takeover")


async def owner_stale_heartbeat_taken_over(ctx: ScenarioContext) -> None:
    """An owner on another host is live until now - renewed_at reaches stale_after, then taken over."""
    async with ctx.open() as store:
        far = _identity("far", host=OTHER_HOST, pid=1)
        await _claim_ok(ctx, store, far, 0)
        b = _identity("b")
        await _expect_refused(ctx, store, b, 9.999, far, "a claim just before the heartbeat is stale")
        claim = await _claim_ok(ctx, store, b, STALE.total_seconds())
        await _expect_owner(ctx, store, claim, "current_owner() after taking over a stale claim")


async def owner_renew_extends_the_claim(ctx: ScenarioContext) -> None:
    """renew_owner moves renewed_at (durably), so the claim stays live stale_after past the renewal."""
    async with ctx.open() as store:
        far = _identity("far", host=OTHER_HOST, pid=1)
        claim = await _claim_ok(ctx, store, far, 0)
        renewed = await store.renew_owner(claim, now=_at(8))
        ctx.expect_equal((renewed.since, renewed.renewed_at), (_at(0), _at(8)), "the renewed claim")
        await _expect_owner(ctx, store, renewed, "current_owner() after the renewal")
        b = _identity("b")
        await _expect_refused(ctx, store, b, 15, far, "a claim 7s after the renewal")
        await _claim_ok(ctx, store, b, 18)


async def owner_renew_after_takeover_is_not_owner(ctx: ScenarioContext) -> None:
    """An owner taken over (or released) gets StoreTakenOver (a NotOwner) from renew_owner, and the
    new claim stays.  The bare NotOwner base is refused: the engine must know the whole store is lost."""
    async with ctx.open() as store:
        far = _identity("far", host=OTHER_HOST, pid=1)
        old = await _claim_ok(ctx, store, far, 0)
        b = _identity("b")
        new = await _claim_ok(ctx, store, b, 11)
        with ctx.expect_raises(StoreTakenOver, "renew_owner() of the taken-over claim"):
            await store.renew_owner(old, now=_at(12))
        await _expect_owner(ctx, store, new, "current_owner() after the stale owner's renewal")
        await store.release_owner(new)
        with ctx.expect_raises(StoreTakenOver, "renew_owner() of a released claim"):
            await store.renew_owner(new, now=_at(13))
        await _expect_owner(ctx, store, None, "current_owner() after the refused renewal")


async def owner_release_frees_the_store(ctx: ScenarioContext) -> None:
    """release_owner drops only its own claim; afterwards anyone may claim at once; it is idempotent."""
    async with ctx.open() as store:
        a, b = _identity("a"), _identity("b")
        claim = await _claim_ok(ctx, store, a, 0)
        stranger = OwnerClaim(identity=b, since=_at(0), renewed_at=_at(0), stale_after=STALE)
        await store.release_owner(stranger)
        await _expect_owner(ctx, store, claim, "current_owner() after a release by a non-owner")
        await store.release_owner(claim)
        await _expect_owner(ctx, store, None, "current_owner() after the owner released")
        await store.release_owner(claim)
        await _claim_ok(ctx, store, b, 1)


async def owner_claim_survives_reopen(ctx: ScenarioContext) -> None:
    """A claim left behind (the owner never released) is still there after closing and reopening."""
    a = _identity("a")
    async with ctx.open() as store:
        claim = await _claim_ok(ctx, store, a, 0)
    async with ctx.open() as store:
        await _expect_owner(ctx, store, claim, "current_owner() after reopening")
        await _expect_refused(ctx, store, _identity("b"), 1, a, "a claimant after reopening")


async def owner_concurrent_takeover_one_winner(ctx: ScenarioContext) -> None:
    """Several handles taking over one dead claim at once: exactly one wins, the others are
    refused naming the winner, and the stored claim is the winner's."""
    async with _no_dead_pid(ctx), contextlib.AsyncExitStack() as stack:
        handles = [await stack.enter_async_context(ctx.open()) for _ in range(CONTENDERS)]
        await _claim_ok(ctx, handles[0], _identity("dead", pid=DEAD_PID), 0)
        won: list[OwnerClaim] = []
        refused: list[StoreOwned] = []
        other: list[BaseException] = []

        async def contend(index: int) -> None:
            try:
                won.append(
                    await handles[index].claim_owner(_identity(f"c{index}"), now=_at(1), stale_after=STALE)
                )
            except StoreOwned as exc:
                refused.append(exc)
            except Exception as exc:
                other.append(exc)

        async with trio.open_nursery() as nursery:
            for index in range(CONTENDERS):
                nursery.start_soon(contend, index)
        ctx.expect(not other, f"concurrent claims raised unexpected errors: {short(other)}")
        ctx.expect_equal(
            (len(won), len(refused)), (1, CONTENDERS - 1), "concurrent takeovers (winners, refused)"
        )
        await _expect_owner(ctx, handles[-1], won[0], "current_owner() after the race")


async def owner_every_method_is_a_checkpoint(ctx: ScenarioContext) -> None:
    """Every ownership method is a Trio checkpoint, refusals included."""
    async with ctx.open() as store:
        a = _identity("a")
        holder: list[OwnerClaim] = []

        async def claim() -> None:
            holder.append(await store.claim_owner(a, now=_at(0), stale_after=STALE))

        await ctx.expect_checkpoint("claim_owner()", claim)
        await ctx.expect_checkpoint(
            "a refused claim_owner()",
            lambda: store.claim_owner(_identity("b"), now=_at(1), stale_after=STALE),
            raises=StoreOwned,
        )
        await ctx.expect_checkpoint("current_owner()", store.current_owner)
        await ctx.expect_checkpoint("renew_owner()", lambda: store.renew_owner(holder[0], now=_at(2)))
        await ctx.expect_checkpoint("release_owner()", lambda: store.release_owner(holder[0]))


async def owner_use_after_close(ctx: ScenarioContext) -> None:
    """After the store is closed, ownership methods raise trio.ClosedResourceError."""
    async with ctx.open() as store:
        await store.aclose()
        with ctx.expect_raises(trio.ClosedResourceError, "claim_owner() after aclose()"):
            await store.claim_owner(_identity("a"), now=_at(0), stale_after=STALE)
        with ctx.expect_raises(trio.ClosedResourceError, "current_owner() after aclose()"):
            await store.current_owner()


# --------------------------------------------------------------------------
# The command inbox
# --------------------------------------------------------------------------


def _every_command() -> list[Any]:
    return [
        StartCommand(
            workflow_id="wf-ünï/1",
            workflow_type="checkout",
            args=Payload.of([{"id": 7, "items": ["a", "ß"], "price": 2.5, "ok": True, "none": None}, 2**53]),
            id_reuse="use_existing",
            task_queue="eu-1",
        ),
        StartCommand(workflow_id="wf-2", workflow_type="hello"),
        SignalCommand(
            workflow_id="wf-ünï/1", name="approve", payload=Payload.of({"by": "ops", "n": [1, 2.0]})
        ),
        SignalCommand(workflow_id="wf-2", name="poke"),
        CancelCommand(workflow_id="wf-2", reason="customer asked \N{SNOWMAN}", request_id="client-'1' ✓"),
        TerminateCommand(workflow_id="wf-3", reason=""),
        ReopenCommand(workflow_id="wf-3"),
    ]


def _signal(n: int) -> SignalCommand:
    return SignalCommand(workflow_id=f"wf-{n % 3}", name=f"s{n}", payload=Payload.of(n))


async def _enqueue_all(store: Any, commands: list[Any]) -> list[int]:
    return [await store.enqueue_command(c) for c in commands]


def _expect_increasing(ctx: ScenarioContext, ids: list[int], what: str) -> None:
    ok = all(isinstance(i, int) and not isinstance(i, bool) for i in ids) and all(
        a < b for a, b in itertools.pairwise(ids)
    )
    ctx.expect(ok, f"{what}: command ids {short(ids)} are not increasing ints")


async def _expect_pending(
    ctx: ScenarioContext, store: Any, expected: list[tuple[int, Any]], what: str
) -> None:
    pending = await store.pending_commands(1000)
    ctx.expect_equal([(p.command_id, p.command) for p in pending], expected, what)


async def inbox_round_trip_every_command_type(ctx: ScenarioContext) -> None:
    """Every command type, with unicode and nested JSON payloads, comes back equal, in order."""
    async with ctx.open() as store:
        commands = _every_command()
        ids = await _enqueue_all(store, commands)
        _expect_increasing(ctx, ids, "enqueue_command()")
        await _expect_pending(ctx, store, list(zip(ids, commands, strict=True)), "pending_commands()")


async def inbox_fifo_order(ctx: ScenarioContext) -> None:
    """pending_commands is oldest first, and limit takes the oldest."""
    async with ctx.open() as store:
        commands = [_signal(n) for n in range(25)]
        ids = await _enqueue_all(store, commands)
        _expect_increasing(ctx, ids, "enqueue_command()")
        first = await store.pending_commands(10)
        ctx.expect_equal(
            [(p.command_id, p.command) for p in first],
            list(zip(ids, commands, strict=True))[:10],
            "pending_commands(limit=10)",
        )
        await _expect_pending(ctx, store, list(zip(ids, commands, strict=True)), "pending_commands()")


async def inbox_ack_removes_from_pending(ctx: ScenarioContext) -> None:
    """An acked command leaves pending_commands, the rest keep their order; a second ack keeps
    the first outcome."""
    async with ctx.open() as store:
        commands = [_signal(n) for n in range(5)]
        ids = await _enqueue_all(store, commands)
        first = CommandOutcome.success("signal 's2' recorded")
        await store.ack_command(ids[2], first)
        await store.ack_command(ids[0], CommandOutcome(ok=False, message="no", error_type="NotRunning"))
        expected = [(ids[i], commands[i]) for i in (1, 3, 4)]
        await _expect_pending(ctx, store, expected, "pending_commands() after two acks")
        await store.ack_command(ids[2], CommandOutcome.success("again"))
        ctx.expect_equal(await store.command_outcome(ids[2]), first, "the outcome after a second ack")
        await _expect_pending(ctx, store, expected, "pending_commands() after a second ack")


async def inbox_outcome_readable(ctx: ScenarioContext) -> None:
    """command_outcome is None while pending, the acked outcome after; unknown ids are NotFound."""
    async with ctx.open() as store:
        ids = await _enqueue_all(store, [StartCommand(workflow_id="w", workflow_type="t"), _signal(1)])
        ctx.expect_equal(await store.command_outcome(ids[0]), None, "command_outcome() while pending")
        ok = CommandOutcome.success("started workflow 'w' run r-1", run_id="r-1")
        bad = CommandOutcome(
            ok=False,
            message="cannot signal 's1' to workflow 'wf-1': it is completed",
            error_type="NotRunning",
        )
        await store.ack_command(ids[0], ok)
        await store.ack_command(ids[1], bad)
        ctx.expect_equal(await store.command_outcome(ids[0]), ok, "command_outcome() of a success")
        ctx.expect_equal(await store.command_outcome(ids[1]), bad, "command_outcome() of a refusal")
        unknown = max(ids) + 1000
        with ctx.expect_raises(NotFound, "command_outcome() of an unknown id"):
            await store.command_outcome(unknown)
        with ctx.expect_raises(NotFound, "ack_command() of an unknown id"):
            await store.ack_command(unknown, ok)


async def inbox_survives_reopen(ctx: ScenarioContext) -> None:
    """Pending commands and outcomes survive closing and reopening; later ids stay larger."""
    commands = [_signal(n) for n in range(3)]
    outcome = CommandOutcome.success("done")
    async with ctx.open() as store:
        ids = await _enqueue_all(store, commands)
        await store.ack_command(ids[1], outcome)
    async with ctx.open() as store:
        expected = [(ids[0], commands[0]), (ids[2], commands[2])]
        await _expect_pending(ctx, store, expected, "pending_commands() after reopening")
        ctx.expect_equal(await store.command_outcome(ids[1]), outcome, "command_outcome() after reopening")
        later = await store.enqueue_command(_signal(9))
        ctx.expect(later > max(ids), f"an id given after reopening ({later}) is not above the earlier {ids}")


async def inbox_concurrent_enqueues_from_two_handles(ctx: ScenarioContext) -> None:
    """Two handles enqueueing at once: distinct ids, every command pending once, in id order."""
    per_handle = 10
    async with ctx.open() as first, ctx.open() as second:
        got: list[tuple[int, Any]] = []

        async def send(store: Any, base: int) -> None:
            for n in range(base, base + per_handle):
                command = _signal(n)
                got.append((await store.enqueue_command(command), command))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send, first, 0)
            nursery.start_soon(send, second, 100)
        ids = [cid for cid, _ in got]
        ctx.expect(len(set(ids)) == len(ids), f"concurrent enqueues gave duplicate ids: {sorted(ids)}")
        await _expect_pending(ctx, first, sorted(got, key=lambda p: p[0]), "pending_commands()")


async def inbox_enqueue_once_per_request_id(ctx: ScenarioContext) -> None:
    """A command queued again under its request id (a client retrying after an ambiguous
    failure) adds nothing and gets the first one's id, pending or acked, across handles and
    a reopen; commands without one, or with another, are queued each time."""
    keyed = SignalCommand(workflow_id="wf-1", name="go", request_id="req-1")
    async with ctx.open() as first, ctx.open() as second:
        ids: list[int] = []

        async def send(store: Any) -> None:
            ids.append(await store.enqueue_command(keyed))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send, first)
            nursery.start_soon(send, second)
        ctx.expect(ids[0] == ids[1], f"one request id queued from two handles at once got ids {ids}")
        plain = [await first.enqueue_command(_signal(1)) for _ in range(2)]
        other = await first.enqueue_command(attrs.evolve(keyed, request_id="req-2"))
        ctx.expect(
            len({ids[0], *plain, other}) == 4, f"distinct commands share ids: {ids[0]}, {plain}, {other}"
        )
        await _expect_pending(
            ctx,
            first,
            [
                (ids[0], keyed),
                (plain[0], _signal(1)),
                (plain[1], _signal(1)),
                (other, attrs.evolve(keyed, request_id="req-2")),
            ],
            "pending_commands() after queueing one request id twice",
        )
        await first.ack_command(ids[0], CommandOutcome.success("done"))
    async with ctx.open() as store:
        again = await store.enqueue_command(keyed)
        ctx.expect_equal(again, ids[0], "enqueue_command() of an acked request id after reopening")
        ctx.expect_equal(await store.command_outcome(again), CommandOutcome.success("done"), "its outcome")
        pending = [p.command_id for p in await store.pending_commands(1000)]
        ctx.expect(ids[0] not in pending, f"the acked command is pending again: {pending}")


async def inbox_every_method_is_a_checkpoint(ctx: ScenarioContext) -> None:
    """Every inbox method is a Trio checkpoint, NotFound included."""
    async with ctx.open() as store:
        ids: list[int] = []

        async def enqueue() -> None:
            ids.append(await store.enqueue_command(_signal(1)))

        await ctx.expect_checkpoint("enqueue_command()", enqueue)
        await ctx.expect_checkpoint("pending_commands()", store.pending_commands)
        await ctx.expect_checkpoint("command_outcome()", lambda: store.command_outcome(ids[0]))
        await ctx.expect_checkpoint(
            "ack_command()", lambda: store.ack_command(ids[0], CommandOutcome.success("ok"))
        )
        await ctx.expect_checkpoint(
            "command_outcome() of an unknown id",
            lambda: store.command_outcome(ids[0] + 1000),
            raises=NotFound,
        )


async def inbox_use_after_close(ctx: ScenarioContext) -> None:
    """After the store is closed, inbox methods raise trio.ClosedResourceError."""
    async with ctx.open() as store:
        await store.aclose()
        with ctx.expect_raises(trio.ClosedResourceError, "enqueue_command() after aclose()"):
            await store.enqueue_command(_signal(1))
        with ctx.expect_raises(trio.ClosedResourceError, "pending_commands() after aclose()"):
            await store.pending_commands()


# --------------------------------------------------------------------------
# Recovery counts
# --------------------------------------------------------------------------


async def recoveries_count_and_clear(ctx: ScenarioContext) -> None:
    """Counts start at 0 and grow by one per call (an id given twice counts once), per workflow;
    clear drops them (an absent id is no error); recovery_counts lists those not zero."""
    async with ctx.open() as store:
        ctx.expect_equal(await store.recovery_counts(), {}, "recovery_counts() of a fresh store")
        ctx.expect_equal(await store.count_recoveries(["a", "b", "a"]), {"a": 1, "b": 1}, "the first count")
        ctx.expect_equal(await store.count_recoveries(["a"]), {"a": 2}, "counting a again")
        ctx.expect_equal(await store.count_recoveries([]), {}, "counting no workflow")
        ctx.expect_equal(await store.recovery_counts(), {"a": 2, "b": 1}, "recovery_counts()")
        await store.clear_recoveries(["a", "never-counted"])
        ctx.expect_equal(await store.recovery_counts(), {"b": 1}, "recovery_counts() after clearing a")
        ctx.expect_equal(await store.count_recoveries(["a"]), {"a": 1}, "a cleared count starts again")


async def recoveries_survive_reopen(ctx: ScenarioContext) -> None:
    """Counts survive closing and reopening the store."""
    async with ctx.open() as store:
        await store.count_recoveries(["wf-1", "wf-2"])
        await store.count_recoveries(["wf-1"])
    async with ctx.open() as store:
        ctx.expect_equal(
            await store.recovery_counts(), {"wf-1": 2, "wf-2": 1}, "recovery_counts() after reopening"
        )


async def recoveries_bad_ids_refused(ctx: ScenarioContext) -> None:
    """One str instead of a sequence is a TypeError, an empty id a ValueError; nothing is counted."""
    async with ctx.open() as store:
        with ctx.expect_raises(TypeError, "count_recoveries('abc')"):
            await store.count_recoveries("abc")
        with ctx.expect_raises(ValueError, "count_recoveries(['ok', ''])"):
            await store.count_recoveries(["ok", ""])
        ctx.expect_equal(await store.recovery_counts(), {}, "recovery_counts() after refused calls")


async def recoveries_every_method_is_a_checkpoint(ctx: ScenarioContext) -> None:
    """Every recovery-count method is a Trio checkpoint."""
    async with ctx.open() as store:
        await ctx.expect_checkpoint("count_recoveries()", lambda: store.count_recoveries(["a"]))
        await ctx.expect_checkpoint("clear_recoveries()", lambda: store.clear_recoveries(["a"]))
        await ctx.expect_checkpoint("recovery_counts()", store.recovery_counts)


async def recoveries_use_after_close(ctx: ScenarioContext) -> None:
    """After the store is closed, recovery-count methods raise trio.ClosedResourceError."""
    async with ctx.open() as store:
        await store.aclose()
        with ctx.expect_raises(trio.ClosedResourceError, "count_recoveries() after aclose()"):
            await store.count_recoveries(["a"])
        with ctx.expect_raises(trio.ClosedResourceError, "recovery_counts() after aclose()"):
            await store.recovery_counts()


# --------------------------------------------------------------------------
# Schedules
# --------------------------------------------------------------------------


def _stored(store_record: Any) -> Any:
    """What a stored schedule must keep: id, version, data."""
    if store_record is None:
        return None
    return (store_record.schedule_id, store_record.version, store_record.data)


async def schedules_create_read_list(ctx: ScenarioContext) -> None:
    """create stores version 1 and returns it; read gives it back (None for an unknown id);
    list gives every schedule ordered by id."""
    async with ctx.open() as store:
        ctx.expect_equal(await store.list_schedules(), [], "list_schedules() of a fresh store")
        ctx.expect_equal(await store.read_schedule("nope"), None, "read_schedule() of an unknown id")
        ctx.expect_equal(
            _stored(await store.create_schedule("b", '{"n": 2}')), ("b", 1, '{"n": 2}'), "create b"
        )
        ctx.expect_equal(
            _stored(await store.create_schedule("a", '{"n": 1}')), ("a", 1, '{"n": 1}'), "create a"
        )
        ctx.expect_equal(_stored(await store.read_schedule("b")), ("b", 1, '{"n": 2}'), "read_schedule('b')")
        ctx.expect_equal(
            [_stored(r) for r in await store.list_schedules()],
            [("a", 1, '{"n": 1}'), ("b", 1, '{"n": 2}')],
            "list_schedules() (ordered by id)",
        )


async def schedules_duplicate_create_refused(ctx: ScenarioContext) -> None:
    """Creating an id that exists raises ScheduleAlreadyExists and writes nothing."""
    async with ctx.open() as store:
        await store.create_schedule("s", "first")
        await store.write_schedule("s", "second", 1)
        with ctx.expect_raises(ScheduleAlreadyExists, "create_schedule() of an existing id"):
            await store.create_schedule("s", "other")
        ctx.expect_equal(_stored(await store.read_schedule("s")), ("s", 2, "second"), "the schedule after")


async def schedules_write_compare_and_set(ctx: ScenarioContext) -> None:
    """A write at the stored version bumps it by one; a stale or missing one raises
    ScheduleConflict naming both versions (0: absent) and writes nothing."""
    async with ctx.open() as store:
        await store.create_schedule("s", "v1")
        ctx.expect_equal(
            _stored(await store.write_schedule("s", "v2", 1)), ("s", 2, "v2"), "write at version 1"
        )
        with ctx.expect_raises(ScheduleConflict, "write_schedule() at a stale version") as stale:
            await store.write_schedule("s", "lost", 1)
        ctx.expect_equal(
            (stale.value.expected, stale.value.found), (1, 2), "the conflict's (expected, found)"
        )
        ctx.expect_equal(
            _stored(await store.read_schedule("s")), ("s", 2, "v2"), "the schedule after a stale write"
        )
        with ctx.expect_raises(ScheduleConflict, "write_schedule() of an unknown id") as missing:
            await store.write_schedule("nope", "x", 1)
        ctx.expect_equal(missing.value.found, 0, "the conflict's found for an unknown id")
        ctx.expect_equal(await store.read_schedule("nope"), None, "an unknown id after a refused write")


async def schedules_concurrent_writers_one_wins(ctx: ScenarioContext) -> None:
    """Several handles writing one schedule at the same version (and creating one id) at
    once: exactly one wins each race, the others are refused, and the winner's data is stored."""
    async with contextlib.AsyncExitStack() as stack:
        handles = [await stack.enter_async_context(ctx.open()) for _ in range(CONTENDERS)]
        await handles[0].create_schedule("s", "v1")
        won: list[str] = []
        refused: list[BaseException] = []
        other: list[BaseException] = []

        async def contend(index: int, create: bool) -> None:
            try:
                if create:
                    await handles[index].create_schedule("new", f"c{index}")
                else:
                    await handles[index].write_schedule("s", f"w{index}", 1)
                won.append(f"c{index}" if create else f"w{index}")
            except (ScheduleConflict, ScheduleAlreadyExists) as exc:
                refused.append(exc)
            except Exception as exc:
                other.append(exc)

        for create in (False, True):
            won.clear()
            refused.clear()
            async with trio.open_nursery() as nursery:
                for index in range(CONTENDERS):
                    nursery.start_soon(contend, index, create)
            what = "creates" if create else "writes"
            ctx.expect(not other, f"concurrent {what} raised unexpected errors: {short(other)}")
            ctx.expect_equal(
                (len(won), len(refused)), (1, CONTENDERS - 1), f"concurrent {what} (winners, refused)"
            )
            stored = await handles[-1].read_schedule("new" if create else "s")
            ctx.expect_equal(
                _stored(stored),
                ("new" if create else "s", 1 if create else 2, won[0]),
                f"the schedule after the {what}",
            )


async def schedules_delete(ctx: ScenarioContext) -> None:
    """delete removes a schedule (True) and is False for an absent one; the id can be created again."""
    async with ctx.open() as store:
        await store.create_schedule("s", "v1")
        await store.write_schedule("s", "v2", 1)
        ctx.expect_equal(await store.delete_schedule("s"), True, "delete_schedule() of a schedule")
        ctx.expect_equal(await store.delete_schedule("s"), False, "delete_schedule() again")
        ctx.expect_equal(await store.list_schedules(), [], "list_schedules() after delete")
        ctx.expect_equal(
            _stored(await store.create_schedule("s", "again")), ("s", 1, "again"), "create after delete"
        )


async def schedules_survive_reopen(ctx: ScenarioContext) -> None:
    """Schedules and their versions survive closing and reopening the store."""
    async with ctx.open() as store:
        await store.create_schedule("s", '{"k": "\u00e9"}')
        await store.write_schedule("s", '{"k": "\u00e9", "v": 2}', 1)
    async with ctx.open() as store:
        ctx.expect_equal(
            [_stored(r) for r in await store.list_schedules()],
            [("s", 2, '{"k": "\u00e9", "v": 2}')],
            "list_schedules() after reopening",
        )


async def schedules_bad_input_refused(ctx: ScenarioContext) -> None:
    """An empty id or a version below 1 is a ValueError, data that is not str a TypeError; nothing is written."""
    async with ctx.open() as store:
        with ctx.expect_raises(ValueError, "create_schedule('', ...)"):
            await store.create_schedule("", "x")
        with ctx.expect_raises(TypeError, "create_schedule('s', b'bytes')"):
            await store.create_schedule("s", b"bytes")
        await store.create_schedule("s", "x")
        with ctx.expect_raises(ValueError, "write_schedule('s', 'y', 0)"):
            await store.write_schedule("s", "y", 0)
        ctx.expect_equal(
            [_stored(r) for r in await store.list_schedules()],
            [("s", 1, "x")],
            "list_schedules() after refused calls",
        )


async def schedules_every_method_is_a_checkpoint(ctx: ScenarioContext) -> None:
    """Every schedule method is a Trio checkpoint, refusals included."""
    async with ctx.open() as store:
        await ctx.expect_checkpoint("create_schedule()", lambda: store.create_schedule("s", "x"))
        await ctx.expect_checkpoint(
            "create_schedule() refused", lambda: store.create_schedule("s", "x"), raises=ScheduleAlreadyExists
        )
        await ctx.expect_checkpoint("read_schedule()", lambda: store.read_schedule("s"))
        await ctx.expect_checkpoint("list_schedules()", store.list_schedules)
        await ctx.expect_checkpoint("write_schedule()", lambda: store.write_schedule("s", "y", 1))
        await ctx.expect_checkpoint(
            "write_schedule() refused", lambda: store.write_schedule("s", "z", 1), raises=ScheduleConflict
        )
        await ctx.expect_checkpoint("delete_schedule()", lambda: store.delete_schedule("s"))


async def schedules_use_after_close(ctx: ScenarioContext) -> None:
    """After the store is closed, schedule methods raise trio.ClosedResourceError."""
    async with ctx.open() as store:
        await store.aclose()
        with ctx.expect_raises(trio.ClosedResourceError, "create_schedule() after aclose()"):
            await store.create_schedule("s", "x")
        with ctx.expect_raises(trio.ClosedResourceError, "list_schedules() after aclose()"):
            await store.list_schedules()


# --------------------------------------------------------------------------
# Bulk history reads
# --------------------------------------------------------------------------


async def histories_read_many(ctx: ScenarioContext) -> None:
    """read_histories gives one key per distinct id, each what read_history gives: the whole
    history in ascending seq, [] for an unknown workflow."""
    async with ctx.open() as store:
        wide = s.batch("wide", 1, s.full_bodies())
        await store.events.append("wide", wide, 0)
        short_a = s.markers("short", 1, 2)
        short_b = s.markers("short", 3, 3)
        await store.events.append("short", short_a, 0)
        await store.events.append("short", short_b, 2)
        odd_id = "o'brien\"; DROP TABLE events; --žluť"
        odd = s.markers(odd_id, 1, 1)
        await store.events.append(odd_id, odd, 0)
        read = await store.read_histories(["short", "never-written", "wide", odd_id, "short"])
        ctx.expect(isinstance(read, dict), f"read_histories returned {short(read)}, expected a dict")
        ctx.expect_equal(
            sorted(read), sorted(["short", "never-written", "wide", odd_id]), "the keys of read_histories"
        )
        ctx.expect_equal(read["wide"], wide, "read_histories()['wide'] (every event type)")
        ctx.expect_equal(read["short"], [*short_a, *short_b], "read_histories()['short'] (two appends)")
        ctx.expect_equal(read[odd_id], odd, "a workflow id holding quotes and SQL text")
        ctx.expect_equal(read["never-written"], [], "the history of an unknown workflow")
        ctx.expect_equal(await store.read_histories([]), {}, "read_histories([])")


async def histories_large_batch(ctx: ScenarioContext) -> None:
    """A batch of more ids than one query may bind (stores split it) still answers every id."""
    async with ctx.open() as store:
        ids = [f"wf-{n:04d}" for n in range(1201)]
        written = {workflow_id: s.markers(workflow_id, 1, 2) for workflow_id in ids[::97] + ids[-1:]}
        for workflow_id, events in written.items():
            await store.events.append(workflow_id, events, 0)
        read = await store.read_histories(ids)
        ctx.expect_equal(len(read), len(ids), f"how many histories read_histories of {len(ids)} ids gave")
        for workflow_id in ids:
            ctx.expect_equal(
                read.get(workflow_id), written.get(workflow_id, []), f"read_histories()[{workflow_id!r}]"
            )


async def histories_bad_ids_refused(ctx: ScenarioContext) -> None:
    """One str instead of a sequence is a TypeError, an empty id a ValueError."""
    async with ctx.open() as store:
        with ctx.expect_raises(TypeError, "read_histories('abc')"):
            await store.read_histories("abc")
        with ctx.expect_raises(ValueError, "read_histories(['ok', ''])"):
            await store.read_histories(["ok", ""])


async def histories_every_method_is_a_checkpoint(ctx: ScenarioContext) -> None:
    """read_histories is a Trio checkpoint, with ids and without."""
    async with ctx.open() as store:
        await store.events.append("a", s.markers("a", 1, 1), 0)
        await ctx.expect_checkpoint("read_histories(['a', 'b'])", lambda: store.read_histories(["a", "b"]))
        await ctx.expect_checkpoint("read_histories([])", lambda: store.read_histories([]))


async def histories_use_after_close(ctx: ScenarioContext) -> None:
    """After the store is closed, read_histories raises trio.ClosedResourceError."""
    async with ctx.open() as store:
        await store.aclose()
        with ctx.expect_raises(trio.ClosedResourceError, "read_histories() after aclose()"):
            await store.read_histories(["a"])
