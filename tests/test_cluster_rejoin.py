"""A cluster node rejoining after its lease lapsed (``_cluster.ClusterServices``).

The PostgreSQL suite (``test_pg_cluster``) runs the partition case end to end:
the lease seen invalid, then renewed.  Here the other way a lapse shows: the
process stalls (as under ``SIGSTOP`` or a paused VM) for longer than the
sweeper's interval allows, so by the time it runs again its lease may already
be renewed and it never saw it invalid.  The cluster store and the engine side
are fakes that record what the services ask of them; the stall is a real one
(a blocking ``time.sleep`` in the store's wait, which stops the whole process).
"""

from __future__ import annotations

import time

import attrs
import trio
import trio.testing

from aion_trio import EngineConfig, WorkflowFenced
from aion_trio._cluster import ClusterServices, late_wake_after

INTERVAL = 0.05


@attrs.define
class FakeCluster:
    """A cluster store whose lease is always valid; its wait number ``stall_on`` blocks the
    whole process for ``stall`` seconds (the sweeper is parked by then: it woke before)."""

    owners: dict[str, str | None]
    stall: float = 0.0
    stall_on: int = 0
    waits: int = 0
    looked_up: list[str] = attrs.Factory(list)

    @property
    def node_id(self) -> str:
        return "me"

    def lease_valid(self) -> bool:
        return True

    async def wait_for_work(self, timeout: float) -> None:  # noqa: ASYNC109 - the protocol's signature
        self.waits += 1
        if self.waits == self.stall_on:
            time.sleep(self.stall)  # noqa: ASYNC251 - the point: the whole process stops
            return
        await trio.sleep(timeout)

    async def claim_orphans(self, limit: int) -> list[str]:
        await trio.lowlevel.checkpoint()
        return []

    async def command_target(self, workflow_id: str) -> str | None:
        await trio.lowlevel.checkpoint()
        self.looked_up.append(workflow_id)
        return self.owners[workflow_id]


@attrs.define
class FakeEpoch:
    admitting: bool = True


@attrs.define
class FakeRegistry:
    def leases(self) -> list[object]:
        return []


@attrs.define
class FakeCore:
    """The engine side: holds ``held`` and records what it is told to drop."""

    held: list[str]
    config: EngineConfig = attrs.Factory(lambda: EngineConfig(sweep_interval=INTERVAL))
    epoch: FakeEpoch = attrs.Factory(FakeEpoch)
    registry: FakeRegistry = attrs.Factory(FakeRegistry)
    service_threads: trio.CapacityLimiter = attrs.Factory(lambda: trio.CapacityLimiter(2))
    dropped: list[tuple[str, WorkflowFenced]] = attrs.Factory(list)

    def held_workflows(self) -> list[str]:
        return list(self.held)

    def relinquish_lost(self, workflow_id: str, error: WorkflowFenced) -> None:
        self.dropped.append((workflow_id, error))
        self.held.remove(workflow_id)

    async def reconcile_visibility(self, active: set[str]) -> None:
        await trio.lowlevel.checkpoint()


async def _run_until(services: ClusterServices, cluster: FakeCluster, condition: object) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(services.waker)
        nursery.start_soon(services.sweeper)
        with trio.fail_after(10):
            while not condition():  # type: ignore[operator]  # noqa: ASYNC110 - polled fakes
                await trio.sleep(INTERVAL)
        nursery.cancel_scope.cancel()


async def test_a_stalled_node_checks_what_it_holds_and_drops_only_what_it_lost() -> None:
    cluster = FakeCluster(owners={"lost": "other", "kept": None, "orphaned": ""})
    core = FakeCore(held=["lost", "kept", "orphaned"])
    services = ClusterServices(core, cluster, None)  # type: ignore[arg-type]

    # Control: wake-ups at the sweep interval are no lapse: nothing is looked up.
    await _run_until(services, cluster, lambda: services.sweeps >= 5)
    assert (services.rejoins, cluster.looked_up) == (0, [])

    cluster.stall, cluster.stall_on = late_wake_after(INTERVAL) + 0.3, cluster.waits + 3
    await _run_until(services, cluster, lambda: services.rejoins >= 1)
    assert sorted(cluster.looked_up) == ["kept", "lost", "orphaned"]
    assert sorted(workflow_id for workflow_id, _ in core.dropped) == ["lost", "orphaned"]
    assert core.held == ["kept"]
    assert services.lost_on_rejoin == 2
    reasons = {workflow_id: str(error) for workflow_id, error in core.dropped}
    assert "node 'other' owns the workflow now" in reasons["lost"]
    assert "no live node owns the workflow now" in reasons["orphaned"]


async def test_after_a_rejoin_the_next_wake_ups_check_nothing_again() -> None:
    cluster = FakeCluster(owners={"kept": None}, stall=late_wake_after(INTERVAL) + 0.3, stall_on=3)
    core = FakeCore(held=["kept"])
    services = ClusterServices(core, cluster, None)  # type: ignore[arg-type]
    await _run_until(services, cluster, lambda: services.rejoins >= 1)
    looked = len(cluster.looked_up)
    sweeps = services.sweeps
    await _run_until(services, cluster, lambda: services.sweeps >= sweeps + 5)
    assert services.rejoins == 1
    assert len(cluster.looked_up) == looked == 1
    assert core.dropped == []
