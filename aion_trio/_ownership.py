"""One owner per embedded store: identities, claims and the takeover rule.

Pure data and decisions shared by every store that offers the
:class:`~aion_trio.plugin.OwnedStore` capability; nothing here does I/O except
:func:`pid_alive` and :func:`process_mark`, which ask the operating system
about a process.

The rule
--------
A store holds at most one claim.  A claim names its owner (pid, host, the
time the owner started, the pid's process start mark, a random token) and
carries ``renewed_at``, the last heartbeat, and ``stale_after``, how long the
owner promised heartbeats keep coming.  At time ``now`` (the claimant's wall
clock) a claim is **live** when

* the owner is on this host (another process): its process exists, is not a
  zombie, and is the same process (its start mark, read from
  ``/proc/<pid>/stat`` where there is one, matches: a reused pid is not the
  owner).  The heartbeat does not matter: a live owner whose loop is blocked,
  or that is stopped (``SIGSTOP``), keeps its store;
* the owner is on another host, or is this very process (an engine of this
  process never released it): its heartbeat is fresh,
  ``now - renewed_at < stale_after``.

``claim_owner`` succeeds when there is no claim, when the claim is the
claimant's own (same token: a re-claim refreshes it), or when the claim is not
live (a *takeover*); otherwise it raises :class:`~aion_trio.StoreOwned` and
writes nothing.  The store evaluates the rule and writes the new claim in one
atomic step (one ``BEGIN IMMEDIATE`` transaction in SQLite, one lock in
memory), so of two processes taking over one dead claim at once exactly one
wins and the other is refused naming the winner.

A same-host owner killed with SIGKILL is taken over at once (its pid is gone);
an owner on another host only after ``stale_after`` without heartbeats.  The
owner's heartbeats come from a thread, so a Trio loop blocked by an activity
does not stop them.  An owner whose claim was taken
over finds out at its next renewal, or at its next write: a store that fences
(SQLite) checks in every write transaction that the stored claim is still the
writer's (its token, fresh on every claim), and refuses the write with
:class:`~aion_trio.StoreTakenOver`, writing nothing.
"""

from __future__ import annotations

import os
import secrets
import socket
from datetime import datetime, timedelta, timezone
from typing import final

import attrs

from ._errors import StoreOwned, StoreTakenOver

OWNER_SHARD = "store"
"""The ``shard`` a :class:`~aion_trio.StoreTakenOver` raised by ``renew_owner`` names."""


def this_host() -> str:
    """The host name claims record and compare (``socket.gethostname()``)."""
    return socket.gethostname()


def wall_now() -> datetime:
    """The wall clock ownership is judged by (aware UTC; never a mocked clock)."""
    return datetime.now(timezone.utc)


def pid_alive(pid: int) -> bool:
    """Whether a process with ``pid`` exists on this host (a zombie counts as dead)."""
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        return False
    if os.name == "nt":  # pragma: no cover - signal 0 would terminate the process there
        return True
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        return True  # it exists, under another user
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


def process_mark(pid: int) -> str | None:
    """What tells process ``pid`` apart from a later process given the same pid, or ``None``
    where the system does not say: the boot id and the start time in ``/proc/<pid>/stat``."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            started = stat.read().rsplit(")", 1)[1].split()[19]
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as boot:
            booted = boot.read().strip()
    except (OSError, IndexError):
        return None
    return f"{booted}:{started}"


def owner_alive(identity: OwnerIdentity) -> bool:
    """Whether the process ``identity`` names still runs (on this host): its pid exists and,
    where both marks are known, it is the same process, not a later one given that pid."""
    if not pid_alive(identity.pid):
        return False
    if identity.process is None:
        return True
    mark = process_mark(identity.pid)
    return mark is None or mark == identity.process


def _aware(instance: object, attribute: attrs.Attribute[datetime], value: datetime) -> None:
    if not isinstance(value, datetime) or value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(f"{attribute.name} must be a timezone-aware datetime, got {value!r}")


def _utc(value: datetime) -> datetime:
    return value.astimezone(timezone.utc) if isinstance(value, datetime) and value.tzinfo else value


@final
@attrs.frozen(kw_only=True)
class OwnerIdentity:
    """Who claims a store: a process on a host, told apart from a later one by ``token``."""

    pid: int
    host: str
    started_at: datetime = attrs.field(converter=_utc, validator=_aware)
    token: str
    #: :func:`process_mark` of ``pid`` when claimed (``None``: unknown, the pid alone decides).
    process: str | None = None

    def __attrs_post_init__(self) -> None:
        if isinstance(self.pid, bool) or not isinstance(self.pid, int) or self.pid <= 0:
            raise ValueError(f"pid must be a positive int, got {self.pid!r}")
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"host must be a non-empty str, got {self.host!r}")
        if not isinstance(self.token, str) or not self.token:
            raise ValueError(f"token must be a non-empty str, got {self.token!r}")

    @classmethod
    def current(cls, started_at: datetime | None = None) -> OwnerIdentity:
        """This process, now, with a fresh random token."""
        return cls(
            pid=os.getpid(),
            host=this_host(),
            started_at=started_at or wall_now(),
            token=secrets.token_hex(16),
            process=process_mark(os.getpid()),
        )

    def describe(self) -> str:
        """``pid N on host H``, for messages naming the owner."""
        return f"pid {self.pid} on host {self.host!r}"


def _positive(instance: object, attribute: attrs.Attribute[timedelta], value: timedelta) -> None:
    if not isinstance(value, timedelta) or value <= timedelta(0):
        raise ValueError(f"{attribute.name} must be a positive timedelta, got {value!r}")


@final
@attrs.frozen(kw_only=True)
class OwnerClaim:
    """A store's ownership record.

    ``since``: when this owner took the store; ``renewed_at``: its last
    heartbeat; ``stale_after``: how long the claim stays live without one.
    ``replaced`` is set on the claim a takeover returned: the dead owner it
    replaced (stores need not keep it).
    """

    identity: OwnerIdentity
    since: datetime = attrs.field(converter=_utc, validator=_aware)
    renewed_at: datetime = attrs.field(converter=_utc, validator=_aware)
    stale_after: timedelta = attrs.field(validator=_positive)
    replaced: OwnerIdentity | None = None

    def owned_error(self, location: str | None = None) -> StoreOwned:
        """The error refusing a claimant while this claim is live."""
        return StoreOwned(self.identity.pid, self.identity.host, self.since, location)


def claim_is_live(claim: OwnerClaim, now: datetime, *, host: str | None = None) -> bool:
    """The liveness rule (module docstring): on this host, a living owner process (this
    process: a fresh heartbeat); elsewhere, a fresh heartbeat."""
    here = this_host() if host is None else host
    owner = claim.identity
    if owner.host == here:
        if not owner_alive(owner):
            return False
        if owner.pid != os.getpid():
            return True
    return now - claim.renewed_at < claim.stale_after


def decide_claim(
    current: OwnerClaim | None,
    identity: OwnerIdentity,
    *,
    now: datetime,
    stale_after: timedelta,
    location: str | None = None,
) -> OwnerClaim:
    """The claim to store for ``identity``, or raise :class:`StoreOwned` (the reference rule).

    Call it and write its result in one atomic step with reading ``current``.
    """
    if current is not None and current.identity.token == identity.token:
        return OwnerClaim(identity=identity, since=current.since, renewed_at=now, stale_after=stale_after)
    if current is not None and claim_is_live(current, now):
        raise current.owned_error(location)
    return OwnerClaim(
        identity=identity,
        since=now,
        renewed_at=now,
        stale_after=stale_after,
        replaced=None if current is None else current.identity,
    )


def decide_renew(current: OwnerClaim | None, claim: OwnerClaim, *, now: datetime) -> OwnerClaim:
    """The renewed claim, or raise :class:`StoreTakenOver` if ``claim`` is no longer the stored one."""
    if current is None or current.identity.token != claim.identity.token:
        who = "nobody" if current is None else current.identity.describe()
        raise StoreTakenOver(
            OWNER_SHARD,
            f"this engine ({claim.identity.describe()}) lost its claim on the store, which is now held "
            f"by {who}; it stops writing (its heartbeats stopped for longer than {claim.stale_after}, "
            "so it was taken for dead)",
        )
    return attrs.evolve(current, renewed_at=max(now, current.renewed_at), replaced=None)


def fenced_write(location: str, holder: str | None, doing: str) -> StoreTakenOver:
    """The error of a write refused by a store's fence: the handle's claim is no longer the stored
    one (``holder`` describes the claim's new owner, ``None``: no claim)."""
    who = holder or "nobody"
    return StoreTakenOver(
        OWNER_SHARD,
        f"{location}: {doing} refused, nothing written: this engine's claim on the store was taken over "
        f"(it is now held by {who})",
    )
