"""The ``worker`` command: serve the user's definitions (or only activities, from task
queues) until SIGINT/SIGTERM, then drain."""

from __future__ import annotations

import contextlib
import functools
import logging
import signal as signal_module
import sys
from collections.abc import AsyncIterator, Sequence
from typing import Any

import attrs
import click
import trio

from .._definitions import ActivityDefinition
from .._engine import Engine, EngineConfig, open_engine
from .._events import WorkflowStatus
from .._logs import ContextLogger
from .._observe import ObserverEvent, WorkflowRunEnded, WorkflowRunStarted
from .._taskqueues import run_activity_worker
from .._urls import redact_url
from .errors import UsageProblem, UserError, run
from .options import configured_codecs, resolve_store, store_option
from .userapp import App, load_activities, load_app

DEFAULT_DRAIN_TIMEOUT = 10.0

worker_log = ContextLogger("aion_trio.worker")


@attrs.define
class _Lifecycle:
    """What the worker's signal watcher and drain watcher report back."""

    signals: int = 0
    signal_name: str = ""
    drain_deadline: float | None = None
    idle_at: float | None = None
    forced: bool = False


async def _watch_signals(
    receiver: Any, stop: trio.Event, hard_stop: trio.CancelScope, state: _Lifecycle
) -> None:
    async for signum in receiver:
        state.signals += 1
        if state.signals == 1:
            state.signal_name = signal_module.Signals(signum).name
            stop.set()
        else:
            worker_log.warning(
                "%s received again: stopping now; unfinished activity attempts are parked for the next engine",
                signal_module.Signals(signum).name,
            )
            state.forced = True
            hard_stop.cancel()


async def _watch_drain(engine: Engine, state: _Lifecycle) -> None:
    await engine.epoch.wait_attempts_idle()
    state.idle_at = trio.current_time()


@contextlib.asynccontextmanager
async def _until_signalled() -> AsyncIterator[tuple[_Lifecycle, trio.Event, trio.Nursery]]:
    """A worker's lifetime: ``stop`` is set by the first SIGINT/SIGTERM; a second one
    cancels the body at once.  Yields (state, stop, a nursery cancelled on the way out)."""
    state = _Lifecycle()
    stop = trio.Event()
    with trio.open_signal_receiver(signal_module.SIGINT, signal_module.SIGTERM) as receiver:
        async with trio.open_nursery() as nursery:
            hard_stop = trio.CancelScope()
            nursery.start_soon(_watch_signals, receiver, stop, hard_stop, state)
            with hard_stop:
                yield state, stop, nursery
            nursery.cancel_scope.cancel()


def _log_runs(event: ObserverEvent) -> None:
    """The worker's observer: one info line when a workflow run starts, one when it ends."""
    if isinstance(event, (WorkflowRunStarted, WorkflowRunEnded)):
        fields = {
            "workflow_id": event.workflow_id,
            "run_id": event.run_id,
            "workflow_type": event.workflow_type,
        }
        if isinstance(event, WorkflowRunStarted):
            worker_log.info("%s started", event.workflow_type, extra=fields)
        else:
            worker_log.info("%s ended %s", event.workflow_type, event.status.value, extra=fields)


async def _serve(url: str, app: App, drain_timeout: float) -> _Lifecycle:
    async with _until_signalled() as (state, stop, nursery):
        worker_log.info("opening store %s for %s (%s)", redact_url(url), app.spec, app.describe())
        async with open_engine(
            url,
            workflows=app.workflows,
            activities=app.activities,
            config=EngineConfig(codecs=app.codecs),
            drain_timeout=drain_timeout,
            observers=[_log_runs],
        ) as engine:
            running = await engine.count(status=WorkflowStatus.RUNNING)
            worker_log.info(
                "ready: serving %s; %d running workflow(s) in the store; stop with SIGINT or SIGTERM",
                app.describe(),
                running,
            )
            await stop.wait()
            in_flight = engine.statistics().epoch.in_flight_attempts
            if drain_timeout:
                worker_log.info(
                    "%s received: draining %d in-flight activity attempt(s) for up to %gs "
                    "(send it again to stop at once)",
                    state.signal_name,
                    in_flight,
                    drain_timeout,
                )
                state.drain_deadline = trio.current_time() + drain_timeout
                nursery.start_soon(_watch_drain, engine, state)
            else:
                worker_log.info(
                    "%s received: stopping without a drain (%d in-flight activity attempt(s) parked)",
                    state.signal_name,
                    in_flight,
                )
    return state


async def _serve_activities(
    url: str,
    activities: Sequence[ActivityDefinition[Any]],
    queues: Sequence[str],
    concurrency: int,
    drain_timeout: float,
) -> _Lifecycle:
    async with _until_signalled() as (state, stop, _):
        worker_log.info("opening store %s for activity queue(s) %s", redact_url(url), ", ".join(queues))
        async with trio.open_nursery() as inner:
            worker_id = await inner.start(
                functools.partial(
                    run_activity_worker,
                    url,
                    activities,
                    queues,
                    concurrency=concurrency,
                    drain_timeout=drain_timeout,
                    stop=stop,
                    codecs=configured_codecs(),
                )
            )
            worker_log.info(
                "ready: activity worker %s runs %d activity type(s) from queue(s) %s, up to %d at once; "
                "stop with SIGINT or SIGTERM",
                worker_id,
                len(activities),
                ", ".join(queues),
                concurrency,
            )
            await stop.wait()
            worker_log.info(
                "%s received: no new claims; running attempts may finish for up to %gs, then go back "
                "to their queues (send it again to stop at once)",
                state.signal_name,
                drain_timeout,
            )
    return state


def _worker_activities_only(
    url: str,
    module: str | None,
    activities_spec: str | None,
    queues: Sequence[str],
    concurrency: int,
    drain_timeout: float,
) -> None:
    if module is not None:
        raise UsageProblem(
            "--activities-only takes no MODULE:ATTR argument; name the activities with --activities MODULE:ATTR"
        )
    if activities_spec is None:
        raise UsageProblem(
            "--activities-only needs --activities MODULE:ATTR (the activities this worker runs)"
        )
    if not queues:
        raise UsageProblem("--activities-only needs at least one --queue QUEUE (the task queues to serve)")
    activities = load_activities(activities_spec)
    state = run(url, lambda: _serve_activities(url, activities, queues, concurrency, drain_timeout))
    if state.forced:
        raise UserError("stopped by a second signal; running attempts went back to their queues")
    worker_log.info("stopped; unfinished attempts went back to their queues")


@click.command()
@store_option
@click.argument("module", metavar="MODULE:ATTR", required=False)
@click.option(
    "--activities-only",
    is_flag=True,
    help="Run only activities, claimed from the store's task queues (a store with task queues, "
    "e.g. postgresql://); needs --activities and --queue.",
)
@click.option(
    "--activities",
    "activities_spec",
    metavar="MODULE:ATTR",
    help="With --activities-only: where the activities are (an object or module with 'activities').",
)
@click.option(
    "--queue",
    "queues",
    multiple=True,
    metavar="QUEUE",
    help="With --activities-only: a task queue to serve (repeat for several).",
)
@click.option(
    "--concurrency",
    type=click.IntRange(min=1),
    default=10,
    show_default=True,
    help="With --activities-only: attempts run at once.",
)
@click.option(
    "--drain-timeout",
    type=click.FloatRange(min=0),
    default=DEFAULT_DRAIN_TIMEOUT,
    show_default=True,
    metavar="SECONDS",
    help="On SIGINT/SIGTERM, how long in-flight activity attempts may run on to record their outcome.",
)
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False),
    default="warning",
    show_default=True,
    help="Level of the engine's own log lines (lifecycle lines are always shown).",
)
def worker(
    store: str | None,
    module: str | None,
    activities_only: bool,
    activities_spec: str | None,
    queues: tuple[str, ...],
    concurrency: int,
    drain_timeout: float,
    log_level: str,
) -> None:
    """Serve the workflows and activities of MODULE:ATTR until SIGINT or SIGTERM.

    \b
    MODULE:ATTR names an object with a 'workflows' sequence of
    @aion_trio.workflow functions and an optional 'activities' sequence of
    @aion_trio.activity functions, e.g. in myapp/flows.py:
        app = types.SimpleNamespace(workflows=[checkout], activities=[charge])
    and run 'aion-trio worker myapp.flows:app'.  A bare MODULE uses the
    module's own lists named 'workflows' and 'activities'.  The current
    directory is on the import path.

    On open the engine resumes every running workflow in the store. On the
    first SIGINT/SIGTERM it stops admitting work and lets in-flight activity
    attempts finish for up to --drain-timeout seconds; what is still running
    then is parked and re-dispatched by the next engine. A second signal stops
    at once. Exit status 0 after a graceful stop.

    \b
    With --activities-only the process runs no engine: it claims activity
    tasks of the --queue queues from the store (one with task queues, such
    as postgresql://) and runs the activities of --activities MODULE:ATTR:
        aion-trio worker --activities-only --store postgresql://... \\
            --queue payments --activities myapp.acts:app --concurrency 20
    On SIGINT/SIGTERM it claims no more, lets running attempts finish for up
    to --drain-timeout seconds and hands the rest back to their queues.
    """
    url = resolve_store(store)
    if not activities_only and (activities_spec is not None or queues):
        raise UsageProblem("--activities and --queue only apply with --activities-only")
    if not activities_only and module is None:
        raise UsageProblem("missing argument 'MODULE:ATTR' (or use --activities-only)")
    app = None if activities_only else load_app(module or "")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    package_log = logging.getLogger("aion_trio")
    package_log.addHandler(handler)
    package_log.setLevel(log_level.upper())
    worker_log.setLevel(logging.INFO)
    try:
        if app is None:
            _worker_activities_only(url, module, activities_spec, queues, concurrency, drain_timeout)
            return
        state = run(url, lambda: _serve(url, app, drain_timeout))
        if state.forced:
            raise UserError("stopped by a second signal before the drain finished; unfinished work is parked")
        if (
            state.drain_deadline is not None
            and state.idle_at is not None
            and state.idle_at < state.drain_deadline
        ):
            worker_log.info("drained: every in-flight activity attempt recorded its outcome; store closed")
        elif state.drain_deadline is not None:
            worker_log.info(
                "drain timeout: unfinished activity attempts were parked (nothing recorded) and the next "
                "engine on this store re-dispatches them; store closed"
            )
        else:
            worker_log.info("stopped; store closed")
    finally:
        package_log.removeHandler(handler)
