"""``open_engine``: the one place the engine's services are built and wired together."""

from __future__ import annotations

import contextlib
import functools
import sys
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping
from datetime import timedelta
from typing import Any

import attrs
import trio

from .. import _children as children
from .._activities import (
    ActivityDispatcher,
    DecodingDispatcher,
    DelegatingDispatcher,
    EncodingDispatcher,
    InProcessDispatcher,
)
from .._admission import StorePermits
from .._clock import EngineClock, TrioClock
from .._cluster import ClusterServices, LeaseGatedDispatcher
from .._codec_store import BulkRead, CodecEventStore, decoding_bulk_reads
from .._completion import handle_run_exit
from .._definitions import ActivityDefinition, ActivityLoop, WorkflowDefinition, index_definitions
from .._epoch import EngineEpoch
from .._errors import AionInternalError, FlowControlUnsupported
from .._inbox import InboxDrainer, Ownership
from .._observe import ObserverHub, build_hub
from .._ownership import OwnerIdentity, wall_now
from .._plugins import default_plugin_manager, open_store
from .._registry import Registry
from .._run_port import LeasePort
from .._store import (
    BulkHistoryReads,
    ClusterStore,
    CommandInbox,
    EventStore,
    FlowStore,
    OwnedStore,
    Store,
    VisibilityStore,
)
from .._transient import Transient
from .._watchdog import LoopWatchdog
from . import collector
from .client import Engine, serve_inbox
from .config import EngineConfig
from .core import EngineCore
from .dispatch import ActivityDispatch
from .local import LocalCommands
from .log import logger
from .recorders import Recorders
from .recovery import Recovery
from .residency import ResidencyService
from .runner import Runner
from .steps import StepRecorder, park_if_closing
from .teardown import RunTeardown
from .timers import Timers
from .visibility import VisibilityRows
from .window import ScheduleWindow

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup  # type: ignore[import-not-found,unused-ignore]


@contextlib.asynccontextmanager
async def open_engine(
    store: str | Store,
    *,
    workflows: Iterable[WorkflowDefinition[Any]] = (),
    activities: Iterable[ActivityDefinition[Any]] = (),
    config: EngineConfig | None = None,
    dispatcher: ActivityDispatcher | None = None,
    drain_timeout: float | None = None,
    observers: Iterable[object] = (),
) -> AsyncIterator[Engine]:
    """Open an engine over ``store`` (a URL such as ``sqlite:///orders.db`` or an opened store).

    The engine's epoch lives exactly as long as the ``async with`` block: every
    background task runs in its nursery, so leaving the block cancels and
    joins them all.  On normal exit the shutdown is graceful (stop admitting,
    optional drain, close the latch, cancel, join, close the store); on an
    exception the latch closes first.  A store given as an object is not
    closed (its opener owns it).  ``drain_timeout`` overrides the config's:
    seconds in-flight activity attempts may run on to record their outcome;
    what still runs then is parked (nothing recorded) and re-dispatched by the
    next engine on the store.

    A store with the :class:`~aion_trio.OwnedStore` capability (SQLite,
    memory) is claimed first: if another live engine owns it,
    :class:`~aion_trio.StoreOwned` names it and nothing is written.  The claim
    is renewed every ``config.owner_heartbeat`` seconds of wall-clock time and
    released on exit; should another process take it over (this engine was
    taken for dead), the engine stops and :class:`~aion_trio.StoreTakenOver` is
    raised.  A store with a :class:`~aion_trio.CommandInbox` is drained after
    recovery and then every ``config.inbox_poll_interval`` seconds
    (:meth:`Engine.drain_inbox` drains at once).
    ``dispatcher``: runs activity attempts instead of this process (default:
    the registered activities run here); one that is a
    :class:`~aion_trio.DelegatingDispatcher` is handed the in-process
    dispatcher for the work it keeps local.
    ``observers``: callables ``observer(event)`` (or plugin objects implementing
    ``aion_trio_observe``) handed each :class:`ObserverEvent`, after the
    observers plugins registered through the ``aion_trio`` entry points.
    """
    if config is None:
        config = EngineConfig()
    elif not isinstance(config, EngineConfig):
        raise TypeError(f"open_engine(config=...) takes an EngineConfig, got {config!r}")
    if not isinstance(store, (str, Store)):
        raise TypeError(f"open_engine's store is a URL (str) or an opened store, got {store!r}")
    if drain_timeout is not None:
        config = attrs.evolve(config, drain_timeout=drain_timeout)
    workflow_map, activity_map = index_definitions(workflows, activities)
    hub = build_hub(observers, default_plugin_manager())
    clock = config.clock
    async with contextlib.AsyncExitStack() as stack:
        if collector.enter(config.gc_thresholds, freezes=config.gc_freeze is not None):
            stack.callback(collector.leave)
        if config.loop_stall_warning is not None:
            watchdog = LoopWatchdog(config.loop_stall_warning)
            watchdog.start()
            stack.callback(watchdog.stop)
        if isinstance(store, str):
            opened: Store = await stack.enter_async_context(open_store(store))
        else:
            opened = store
        # One owner per store: claim it before anything is written;
        # StoreOwned names the live owner.  Released after the epoch has joined.
        service_threads = trio.CapacityLimiter(2)
        ownership: Ownership | None = None
        if isinstance(opened, OwnedStore):
            claim = await opened.claim_owner(
                OwnerIdentity.current(),
                now=wall_now(),
                stale_after=timedelta(seconds=config.owner_stale_after),
            )
            if claim.replaced is not None:
                logger.warning(
                    "took the store over from a dead owner: %s (its pid is gone or its heartbeat stopped)",
                    claim.replaced.describe(),
                )
            ownership = Ownership(store=opened, claim=claim, heartbeat=config.owner_heartbeat)
            stack.push_async_callback(ownership.release)
        asyncio_loop = None
        if any(a.loop is ActivityLoop.ASYNCIO for a in activity_map.values()):
            import trio_asyncio

            asyncio_loop = await stack.enter_async_context(trio_asyncio.open_loop())
        limiter = trio.CapacityLimiter(config.max_activity_threads)
        in_process = InProcessDispatcher(activity_map, config.codec, asyncio_loop, limiter)
        # After the epoch has joined: name the activity threads still running.
        stack.callback(in_process.log_unaccounted_threads)
        delegating: object = dispatcher
        kept_local: ActivityDispatcher = in_process
        if dispatcher is not None and config.codecs is not None:
            # A given dispatcher sends attempts elsewhere: their payloads leave encoded.
            kept_local = DecodingDispatcher(in_process, config.codecs)
            dispatcher = EncodingDispatcher(dispatcher, config.codecs)
        if isinstance(delegating, DelegatingDispatcher):
            delegating.use_in_process(kept_local)
        # Cluster mode: per-workflow ownership fenced by the store.
        cluster = opened if isinstance(opened, ClusterStore) else None
        chosen: ActivityDispatcher = dispatcher or in_process
        if cluster is not None:
            chosen = LeaseGatedDispatcher(chosen, cluster, service_threads)
        try:
            async with trio.open_nursery() as nursery:
                epoch = EngineEpoch(nursery)
                core = build_core(
                    store=opened,
                    epoch=epoch,
                    workflows=workflow_map,
                    activities=activity_map,
                    config=config,
                    clock=clock or TrioClock.start(),
                    dispatcher=chosen,
                    observers=hub,
                    cluster=cluster,
                    service_threads=service_threads,
                )
                services: ClusterServices | None = None
                if cluster is not None:
                    services = ClusterServices(
                        core, cluster, opened if isinstance(opened, CommandInbox) else None
                    )
                    core.cluster_services = services
                local = LocalCommands(core)
                engine = Engine(core, local=local, ownership=ownership, threads=in_process)
                # Children cancel and terminate a child as any client does (cluster mode: at its owner).
                core.client_commands = engine
                if ownership is not None:
                    core.recorders.on_store_fenced = ownership.fenced
                try:
                    if ownership is not None:
                        # Not epoch.spawn: losing the claim must end the engine, not be logged.
                        nursery.start_soon(ownership.keep_alive, epoch, name="owner-heartbeat")
                    epoch.spawn(core.timers.serve, name="timer-service")
                    pools = core.activity_dispatch.pools
                    permits = pools.permits
                    if permits is not None and ownership is not None:
                        # The one engine serving the store: a wait recorded there was
                        # left by an engine that died (docs/flow-control.md).
                        await permits.store.clear_flow_waiters()
                    if permits is not None and (pools.leases_permits or pools.bounded):
                        epoch.spawn(permits.keep_alive, name="flow-permit-renewal")
                    epoch.spawn(core.residency.serve, name="residency-service")
                    if config.activity_schedule_window:
                        epoch.spawn(core.window.serve, name="deferral-service")
                    if services is not None:
                        epoch.spawn(services.waker, name="cluster-waker")
                        # Not epoch.spawn: a node fenced out of everything must end the engine.
                        nursery.start_soon(services.until_fenced_out, name="cluster-fence-watch")
                    if config.gc_freeze == "startup":
                        collector.freeze()
                    await core.recovery.recover()
                    if config.gc_freeze == "recovered":
                        collector.freeze()
                    if isinstance(opened, CommandInbox):
                        drainer = InboxDrainer(
                            commands=local, inbox=opened, config=config, limiter=service_threads
                        )
                        serve_inbox(engine, drainer)
                        await drainer.drain()
                        if services is not None:
                            services.drain = drainer.drain  # on every wake-up, after the sweep
                        elif config.inbox_poll_interval is not None:
                            epoch.spawn(drainer.poll_forever, name="inbox-poller")
                    if services is not None:
                        epoch.spawn(services.sweeper, name="cluster-sweeper")
                    # Durable schedules: fired by the one engine owning the store, or in
                    # cluster mode by the node holding each schedule's claim.
                    epoch.spawn(engine.schedules.serve, name="schedule-service")
                    epoch.spawn(engine.queues.serve, name="workflow-queue-service")
                    yield engine
                except BaseException:
                    epoch.begin_close()
                    raise
                else:
                    epoch.stop_admitting()
                    if config.drain_timeout:
                        with trio.move_on_after(config.drain_timeout):
                            await epoch.wait_attempts_idle()
                    await core.window.write_all()
                    if core.recovery.guard is not None:
                        await core.recovery.guard.close()
                    epoch.begin_close()
                finally:
                    # The collector pauses while every run is cancelled and joined (see
                    # collector.pause); resumed once the epoch has joined.
                    collector.pause()
                    stack.callback(collector.resume)
                    nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            # Background tasks never raise (their failures are logged), so a
            # group here carries the body's own exception: re-raise it alone.
            if len(group.exceptions) == 1:
                raise group.exceptions[0] from None
            if group.split(trio.Cancelled)[1] is None:
                # Only cancellation (the caller's scope cancelled the engine, e.g. during
                # the drain): let the cancel scope that owns it catch it.
                raise
            raise AionInternalError(
                f"several errors escaped the engine epoch; please report this: {group!r}"
            ) from group


def flow_permits(
    store: Store,
    config: EngineConfig,
    clock: EngineClock,
    cluster: ClusterStore | None,
    epoch: EngineEpoch | None = None,
) -> StorePermits | None:
    """The store's permits for the limits' rates and cluster-wide bounds (``None``: the
    store has none; rates are then counted in memory, and a cluster-wide bound refused)."""
    limits = [*config.task_queue_limits.values(), *config.activity_limits.values()]
    if not isinstance(store, FlowStore):
        if any(limit.cluster_concurrency is not None for limit in limits):
            raise FlowControlUnsupported(type(store).__name__, "FlowLimit(cluster_concurrency=...)")
        return None
    holder = cluster.node_id if cluster is not None else f"engine-{uuid.uuid4()}"
    return StorePermits(
        store,
        holder=holder,
        ttl=config.flow_permit_ttl,
        now=clock.now,
        spawn=epoch.spawn if epoch is not None else None,
    )


def bulk_reads(store: Store, config: EngineConfig) -> BulkRead | None:
    """The store's ``read_histories`` (``BulkHistoryReads``), decoding through the codec
    chain as the event store's reads do; ``None``: the store reads one history at a time."""
    if not isinstance(store, BulkHistoryReads):
        return None
    if config.codecs is None:
        return store.read_histories
    return decoding_bulk_reads(store.read_histories, config.codecs)


def _gate_append(epoch: EngineEpoch, workflow_id: str) -> None:
    epoch.gate(workflow_id, None, "append encoded events")


def build_core(
    *,
    store: Store,
    epoch: EngineEpoch,
    workflows: Mapping[str, WorkflowDefinition[Any]],
    activities: Mapping[str, ActivityDefinition[Any]],
    config: EngineConfig,
    clock: EngineClock,
    dispatcher: ActivityDispatcher,
    observers: ObserverHub | None,
    cluster: ClusterStore | None,
    service_threads: trio.CapacityLimiter,
) -> EngineCore:
    """Build the engine's services and wire them: each is given the handles it shares and
    the others' entry points it calls, and the core (the hub the engine's callers reach
    it through) is handed them all."""
    events: EventStore = store.events
    visibility: VisibilityStore = store.visibility
    if observers is not None:
        events = observers.wrap_events(events)
        visibility = observers.wrap_visibility(visibility)
    if config.codecs is not None:
        # Outermost: observers time the store alone.  The epoch gate is checked again
        # after encoding, since an async codec awaits between the recorder's gate and the write.
        events = CodecEventStore(events, config.codecs, gate=functools.partial(_gate_append, epoch))
    registry = Registry()
    stuck: dict[str, str] = {}
    transient = Transient(config.completion_retry, epoch, observers)
    cluster_mode = cluster is not None
    core = EngineCore(
        store=store,
        events=events,
        visibility=visibility,
        epoch=epoch,
        workflows=workflows,
        activities=activities,
        config=config,
        clock=clock,
        dispatcher=dispatcher,
        observers=observers,
        cluster=cluster,
        registry=registry,
        stuck=stuck,
        transient=transient,
        service_threads=service_threads,
    )
    # Services built later are reached through these closures (called only once all exist).
    teardown: RunTeardown
    recovery: Recovery
    recorders = Recorders(
        events=events,
        epoch=epoch,
        clock=clock,
        registry=registry,
        forget=lambda workflow_id: teardown.forget_workflow(workflow_id),
        recover=lambda workflow_id: recovery.recover_one(workflow_id),
        observers=observers,
        cluster=cluster,
    )
    timers = Timers(
        events=events,
        clock=clock,
        epoch=epoch,
        transient=transient,
        cluster_mode=cluster_mode,
        recorder_for=recorders.recorder_for,
        deadline_teardown=lambda recorder, run_id: teardown.deadline_teardown(recorder, run_id),
    )
    visibility_rows = VisibilityRows(
        visibility=visibility,
        epoch=epoch,
        config=config,
        cluster=cluster,
        history_of=recorders.history_of,
        stuck_reason=stuck.get,
    )
    window = ScheduleWindow(
        clock=clock,
        epoch=epoch,
        config=config,
        cluster_mode=cluster_mode,
        park_if_closing=functools.partial(park_if_closing, epoch),
    )
    steps: StepRecorder
    residency: ResidencyService
    runner = Runner(
        recorders=recorders,
        registry=registry,
        epoch=epoch,
        clock=clock,
        codec=config.codec,
        workflows=workflows,
        stuck=stuck,
        port_for=lambda lease: LeasePort(core, steps, lease, on_parked=residency.parked),
        run_exit=functools.partial(handle_run_exit, core),
        upsert_visibility=visibility_rows.upsert_quietly,
        recover=lambda workflow_id: recovery.recover_one(workflow_id),
        guard=functools.partial(children.guarded, core),
        arm_timer=timers.arm,
        left=lambda lease: residency.left(lease),
        determinism_guard=config.determinism_guard,
    )
    activity_dispatch = ActivityDispatch(
        permits=flow_permits(store, config, clock, cluster, epoch),
        epoch=epoch,
        config=config,
        clock=clock,
        dispatcher=dispatcher,
        transient=transient,
        registry=registry,
        cluster_mode=cluster_mode,
        held=lambda recorder, request, resume: recovery.held(recorder, request, resume),
        mark_stuck=runner.mark_stuck,
        reacquire=recorders.recorder_for,
    )
    steps = StepRecorder(
        epoch=epoch,
        config=config,
        transient=transient,
        cluster_mode=cluster_mode,
        window=window,
        inflight=activity_dispatch.inflight,
        children_hub=core,
        loaded_recorder=recorders.loaded_recorder,
        dispatch=activity_dispatch.dispatch,
        arm_timer=timers.arm,
        forget_timer=timers.forget,
        mark_stuck=runner.mark_stuck,
        refresh_visibility=visibility_rows.refresh_soon,
    )
    teardown = RunTeardown(
        events=events,
        epoch=epoch,
        config=config,
        clock=clock,
        registry=registry,
        stuck=stuck,
        cluster=cluster,
        timers=timers,
        activity_dispatch=activity_dispatch,
        completion_hub=core,
        run_closed=core.run_closed,
        upsert_visibility=visibility_rows.upsert,
    )
    recovery = Recovery(
        events=events,
        read_histories=bulk_reads(store, config),
        cluster=cluster,
        epoch=epoch,
        config=config,
        observers=observers,
        transient=transient,
        workflows=workflows,
        stuck=stuck,
        registry=registry,
        recorders=recorders,
        runner=runner,
        timers=timers,
        activity_dispatch=activity_dispatch,
        visibility_rows=visibility_rows,
        teardown=teardown,
        hub=core,
        children_hub=core,
    )
    residency = ResidencyService(
        config=config,
        epoch=epoch,
        registry=registry,
        recorders=recorders,
        inflight=activity_dispatch.inflight,
        holds_run=activity_dispatch.holds_run,
        watching=steps.watching,
        live_runs=lambda: runner.live_runs,
        revive=recovery.revive,
        observers=observers,
    )
    recorders.ensure_resident = residency.ensure_resident
    core.attach(
        residency=residency,
        recorders=recorders,
        runner=runner,
        timers=timers,
        activity_dispatch=activity_dispatch,
        visibility_rows=visibility_rows,
        window=window,
        steps=steps,
        teardown=teardown,
        recovery=recovery,
    )
    return core
