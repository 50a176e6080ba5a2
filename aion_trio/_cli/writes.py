"""The write commands: ``start``, ``signal``, ``query``, ``update``, ``cancel``, ``terminate``,
``reopen``, ``reset`` and ``activity complete|fail|heartbeat``, applied by an engine opened here or queued for the store's live owner."""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import click
import trio

from .._activities import TaskToken
from .._chain import ChainState, follow_chain, settled_result
from .._codec_store import CodecEventStore
from .._codecs import CodecChain
from .._commands import (
    ActivityCommand,
    CancelCommand,
    Command,
    CommandOutcome,
    QueryCommand,
    ReopenCommand,
    ResetCommand,
    SignalCommand,
    SignalWithStartCommand,
    StartCommand,
    TerminateCommand,
    UpdateCommand,
    signal_with_start_outcome,
)
from .._engine import Engine, EngineConfig, IdReusePolicy, open_engine
from .._errors import InvalidActivityToken, StoreOwned
from .._events import Event, UpdateCompleted
from .._ids import new_workflow_id, validate_caller_request_id, validate_task_queue
from .._ownership import claim_is_live, wall_now
from .._payload import Payload
from .._plugins import open_store
from .._store import CommandInbox, OwnedStore, Store
from .._urls import redact_url
from .errors import UsageProblem, UserError, run
from .options import F, json_argument, module_option, resolve_store, store_option
from .stores import load_registry, open_for_reading
from .userapp import App, check_type, load_app

DEFAULT_QUEUE_TIMEOUT = 30.0
_DIRECT = "no worker owns the store: applied directly by this process"
_OUTCOME_POLL = 0.05
_RESULT_POLL = 0.1


def _queue_timeout_option(fn: F) -> F:
    return click.option(
        "--queue-timeout",
        type=click.FloatRange(min=0),
        default=DEFAULT_QUEUE_TIMEOUT,
        show_default=True,
        metavar="SECONDS",
        help="When a running worker owns the store: how long to wait for it to apply the queued command.",
    )(fn)


def _vetted_request_id(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is None:
        return None
    try:
        return validate_caller_request_id(value, "--request-id")
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _request_id_option(fn: F) -> F:
    return click.option(
        "--request-id",
        metavar="KEY",
        callback=_vetted_request_id,
        help="Idempotency key: the same command again with the same KEY records nothing more, so a "
        "retry after a crash or a time-out is safe (docs/concepts.md, Request ids).",
    )(fn)


@attrs.define
class _Delivered:
    """How a write command reached the store: applied here, or queued for its owner."""

    queued: bool
    value: Any = None
    command_id: int | None = None
    owner: str = ""
    outcome: CommandOutcome | None = None


async def _live_owner(opened: Store) -> str | None:
    """``"pid N on HOST"`` of the store's live owner, or ``None`` (no owner, or a dead one)."""
    if not isinstance(opened, OwnedStore):
        return None
    claim = await opened.current_owner()
    if claim is None or not claim_is_live(claim, wall_now()):
        return None
    return f"pid {claim.identity.pid} on {claim.identity.host}"


async def apply_or_queue(
    url: str,
    app: App,
    command: Command,
    direct: Callable[[Engine], Awaitable[Any]],
    *,
    wait: bool,
    queue_timeout: float,
) -> _Delivered:
    """With no live owner, open an engine here and run ``direct``; else queue ``command`` in the
    store's inbox for the owner and (``wait``) poll for its outcome, at most ``queue_timeout``s.

    The one way a command reaches a store: the write commands here and the console's actions."""
    async with open_store(url, registry=load_registry()) as opened:
        owner = await _live_owner(opened)
        if owner is None:
            try:
                async with open_engine(
                    opened,
                    workflows=app.workflows,
                    activities=app.activities,
                    config=EngineConfig(codecs=app.codecs),
                ) as engine:
                    return _Delivered(queued=False, value=await direct(engine))
            except StoreOwned as exc:  # a worker claimed the store between the check and the open
                owner = f"pid {exc.pid} on {exc.host}"
        if not isinstance(opened, CommandInbox):
            raise UserError(
                f"the store {redact_url(url)!r} is owned by {owner} and has no command inbox; stop that process first"
            )
        command_id = await opened.enqueue_command(command)
        click.echo(f"queued for the running worker ({owner}) as command #{command_id}", err=True)
        delivered = _Delivered(queued=True, command_id=command_id, owner=owner)
        if not wait:
            return delivered
        with trio.move_on_after(queue_timeout):
            while delivered.outcome is None:
                delivered.outcome = await opened.command_outcome(command_id)
                if delivered.outcome is None:
                    await trio.sleep(_OUTCOME_POLL)
            if not delivered.outcome.ok:
                raise UserError(delivered.outcome.message)
            click.echo(f"applied by the worker: {delivered.outcome.message}", err=True)
            return delivered
        raise UserError(
            f"command #{command_id} is still queued after {queue_timeout:g}s: the worker ({owner}) has not "
            "applied it yet; it stays queued, and the store's owner (that worker, or the next engine to "
            "open the store) applies it"
        )


async def _poll_result(url: str, workflow_id: str, run_id: str, codecs: CodecChain | None) -> Any:
    """Wait for a run another process executes, reading the store until it settles."""
    async with open_for_reading(url, codecs) as opened:
        while True:
            position = follow_chain(await opened.events.read_history(workflow_id), run_id)
            if position.state is ChainState.SETTLED:
                return settled_result(workflow_id, position).value()
            run_id = position.run_id  # the chain stands there: look on from it
            await trio.sleep(_RESULT_POLL)


@click.command()
@store_option
@module_option
@click.argument("workflow_type", metavar="TYPE")
@click.argument("args_json", nargs=-1, metavar="[ARGS_JSON]...")
@click.option("--id", "workflow_id", metavar="ID", help="Workflow id (default: a new UUID).")
@click.option("--task-queue", metavar="QUEUE", help="Task queue of the run (default: the engine's).")
@click.option(
    "--id-reuse",
    type=click.Choice([p.value for p in IdReusePolicy], case_sensitive=False),
    default=IdReusePolicy.ALLOW_DUPLICATE.value,
    show_default=True,
    help="What to do when the id already exists.",
)
@click.option(
    "--wait/--no-wait",
    default=True,
    show_default=True,
    help="Wait for the result (printed as JSON) or return once the start is durable.",
)
@_request_id_option
@_queue_timeout_option
def start(
    store: str | None,
    module: str,
    workflow_type: str,
    args_json: tuple[str, ...],
    workflow_id: str | None,
    task_queue: str | None,
    id_reuse: str,
    wait: bool,
    request_id: str | None,
    queue_timeout: float,
) -> None:
    """Start a workflow of TYPE with JSON arguments, e.g. start checkout '{"id": 7}' --id order-7.

    If a worker ('aion-trio worker') owns the store, the start is queued in
    the store's command inbox and that worker applies it (the id is generated
    here when --id is not given); otherwise an engine opens here with the
    module's definitions (resuming the store's other running workflows while
    it is open). With --no-wait it returns once the start is recorded; the run
    continues in the store's owner, or in the next engine to open the store.
    """
    url = resolve_store(store)
    args = [json_argument(text, f"argument {i}") for i, text in enumerate(args_json, 1)]
    app = load_app(module)
    check_type(app, workflow_type, args)
    if request_id is not None and workflow_id is None:
        raise UsageProblem("--request-id needs --id: a retry must name the same workflow")
    wid = workflow_id if workflow_id is not None else new_workflow_id()
    try:
        if task_queue is not None:
            validate_task_queue(task_queue, "--task-queue")
        command = StartCommand(
            workflow_id=wid,
            workflow_type=workflow_type,
            args=Payload.of(args),
            id_reuse=id_reuse.lower(),
            task_queue=task_queue,
            request_id=request_id,
        )
    except (TypeError, ValueError) as exc:
        raise UsageProblem(str(exc)) from None

    async def direct(engine: Engine) -> tuple[str, Any]:
        handle = await engine.start(
            workflow_type,
            *args,
            workflow_id=wid,
            task_queue=task_queue,
            id_reuse=IdReusePolicy(id_reuse.lower()),
            request_id=request_id,
        )
        verb = "started" if handle.created else "attached to existing"
        click.echo(f"{verb} workflow {handle.workflow_id!r} run {handle.run_id} ({_DIRECT})", err=True)
        return handle.run_id, (await handle.result() if wait else None)

    async def go() -> tuple[str, Any]:
        delivered = await apply_or_queue(url, app, command, direct, wait=True, queue_timeout=queue_timeout)
        if not delivered.queued:
            run_id, result = delivered.value
            return run_id, result
        assert delivered.outcome is not None
        run_id = delivered.outcome.run_id
        assert run_id is not None
        return run_id, (await _poll_result(url, wid, run_id, app.codecs) if wait else None)

    run_id, result = run(url, go)
    if wait:
        click.echo(json.dumps(result, ensure_ascii=False))
    else:
        click.echo(json.dumps({"workflow_id": wid, "run_id": run_id}))


def _wait_option(fn: F) -> F:
    return click.option(
        "--wait/--no-wait",
        default=True,
        show_default=True,
        help="When a worker owns the store: wait for it to apply the queued command (see --queue-timeout).",
    )(fn)


def _write_command(
    url: str,
    app: App,
    command: Command,
    direct: Callable[[Engine], Awaitable[str]],
    wait: bool,
    queue_timeout: float,
) -> None:
    delivered = run(
        url, lambda: apply_or_queue(url, app, command, direct, wait=wait, queue_timeout=queue_timeout)
    )
    if not delivered.queued:
        click.echo(f"{delivered.value} ({_DIRECT})", err=True)


@click.command()
@store_option
@module_option
@click.argument("workflow_id")
@click.argument("name")
@click.argument("payload_json", required=False, metavar="[PAYLOAD_JSON]")
@click.option(
    "--start",
    "start_type",
    metavar="TYPE",
    help="Signal-with-start: if the workflow is not running, start a run of TYPE with the signal "
    "(one atomic write); if it is, signal it.",
)
@click.option(
    "--start-arg",
    "start_args_json",
    multiple=True,
    metavar="ARG_JSON",
    help="With --start: an argument of the run to start, as JSON (repeat for each).",
)
@_wait_option
@_request_id_option
@_queue_timeout_option
def signal(
    store: str | None,
    module: str,
    workflow_id: str,
    name: str,
    payload_json: str | None,
    start_type: str | None,
    start_args_json: tuple[str, ...],
    wait: bool,
    request_id: str | None,
    queue_timeout: float,
) -> None:
    """Send signal NAME with a JSON payload (default null) to a running workflow.

    With --start TYPE (and --start-arg for each argument), a workflow that is
    not running is started with the signal in one write (signal-with-start).
    If a worker owns the store the signal is queued for it (and, with --wait,
    this waits for its outcome); otherwise an engine opens here and records it.
    """
    url = resolve_store(store)
    payload = json_argument(payload_json, "PAYLOAD_JSON") if payload_json is not None else None
    app = load_app(module)
    if start_type is None:
        if start_args_json:
            raise UsageProblem("--start-arg needs --start TYPE")
        command = _command(
            lambda: SignalCommand(
                workflow_id=workflow_id, name=name, payload=Payload.of(payload), request_id=request_id
            )
        )

        async def direct(engine: Engine) -> str:
            await engine.signal(workflow_id, name, payload, request_id=request_id)
            return f"signal {name!r} recorded for workflow {workflow_id!r}"

        _write_command(url, app, command, direct, wait, queue_timeout)
        return
    workflow_type = start_type
    args = [json_argument(text, f"--start-arg {i}") for i, text in enumerate(start_args_json, 1)]
    check_type(app, workflow_type, args)
    command = _command(
        lambda: SignalWithStartCommand(
            workflow_id=workflow_id,
            workflow_type=workflow_type,
            args=Payload.of(args),
            signal_name=name,
            payload=Payload.of(payload),
            request_id=request_id,
        )
    )

    async def direct_with_start(engine: Engine) -> str:
        handle = await engine.signal_with_start(
            workflow_type, *args, workflow_id=workflow_id, signal=name, payload=payload, request_id=request_id
        )
        outcome = signal_with_start_outcome(workflow_id, name, handle.run_id, created=handle.created)
        return outcome.message

    _write_command(url, app, command, direct_with_start, wait, queue_timeout)


@click.command()
@store_option
@module_option
@click.argument("workflow_id")
@click.argument("name")
@click.argument("args_json", nargs=-1, metavar="[ARGS_JSON]...")
@_queue_timeout_option
def query(
    store: str | None,
    module: str,
    workflow_id: str,
    name: str,
    args_json: tuple[str, ...],
    queue_timeout: float,
) -> None:
    """Ask a workflow's query handler NAME (with JSON arguments); prints the JSON answer.

    A closed workflow is answered by replaying its history.  Read-only: nothing is recorded.  If a worker owns the store the query is
    queued for it and this waits for the answer; otherwise an engine opens here
    (replaying the run) and answers.
    """
    url = resolve_store(store)
    args = [json_argument(text, "ARGS_JSON") for text in args_json]
    app = load_app(module)
    command = _command(lambda: QueryCommand(workflow_id=workflow_id, name=name, args=Payload.of(args)))

    async def direct(engine: Engine) -> str:
        return json.dumps(
            await engine.query(workflow_id, name, *args), ensure_ascii=False, separators=(",", ":")
        )

    delivered = run(
        url, lambda: apply_or_queue(url, app, command, direct, wait=True, queue_timeout=queue_timeout)
    )
    if delivered.queued:
        assert delivered.outcome is not None
        click.echo(delivered.outcome.message)
    else:
        click.echo(delivered.value)


@click.command()
@store_option
@module_option
@click.argument("workflow_id")
@click.argument("name")
@click.argument("args_json", nargs=-1, metavar="[ARGS_JSON]...")
@click.option(
    "--update-id",
    metavar="KEY",
    callback=_vetted_request_id,
    help="The update's id: the same update again with the same KEY is not run again; it prints the "
    "recorded result (default: a fresh id).",
)
@_queue_timeout_option
def update(
    store: str | None,
    module: str,
    workflow_id: str,
    name: str,
    args_json: tuple[str, ...],
    update_id: str | None,
    queue_timeout: float,
) -> None:
    """Send update NAME (with JSON arguments) to a running workflow; prints its JSON result.

    The workflow's validator may reject it (nothing is recorded); an accepted
    update is recorded, its handler runs in the workflow and its result (or
    error) is recorded and printed.  If a worker owns the store the update is
    queued for it and this waits (at most --queue-timeout) for the result.
    """
    url = resolve_store(store)
    args = [json_argument(text, "ARGS_JSON") for text in args_json]
    app = load_app(module)
    key = update_id or f"update-{uuid.uuid4().hex}"
    command = _command(
        lambda: UpdateCommand(workflow_id=workflow_id, name=name, update_id=key, args=Payload.of(args))
    )

    def dumps(value: Any) -> str:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))

    async def direct(engine: Engine) -> str:
        return dumps(await engine.update(workflow_id, name, *args, update_id=key))

    async def queued() -> str:
        async with open_store(url, registry=load_registry()) as opened:
            events = opened.events if app.codecs is None else CodecEventStore(opened.events, app.codecs)
            with trio.move_on_after(queue_timeout):
                while True:
                    body = _update_outcome(await events.read_history(workflow_id), key)
                    if body is not None:
                        if body.error is not None:
                            raise UserError(
                                f"update {name!r} ({key}) of workflow {workflow_id!r} failed: "
                                f"{body.error.type}: {body.error.message}"
                            )
                        assert body.result is not None
                        return dumps(body.result.value())
                    await trio.sleep(_RESULT_POLL)
        raise UserError(
            f"update {key!r} was accepted but has no result after {queue_timeout:g}s; run this again "
            f"with --update-id {key} to wait for it (the handler does not run twice)"
        )

    delivered = run(
        url, lambda: apply_or_queue(url, app, command, direct, wait=True, queue_timeout=queue_timeout)
    )
    click.echo(run(url, queued) if delivered.queued else delivered.value)


def _update_outcome(history: list[Event], update_id: str) -> UpdateCompleted | None:
    for event in history:
        if isinstance(event.body, UpdateCompleted) and event.body.update_id == update_id:
            return event.body
    return None


def _command(build: Callable[[], Command]) -> Command:
    try:
        return build()
    except (TypeError, ValueError) as exc:
        raise UsageProblem(str(exc)) from None


_REASON = click.option("--reason", default="", metavar="TEXT", help="Why (recorded in the history).")


@click.command()
@store_option
@module_option
@click.argument("workflow_id")
@_REASON
@_wait_option
@_request_id_option
@_queue_timeout_option
def cancel(
    store: str | None,
    module: str,
    workflow_id: str,
    reason: str,
    wait: bool,
    request_id: str | None,
    queue_timeout: float,
) -> None:
    """Ask a running workflow to cancel: it sees WorkflowCancelled at its next await, may
    compensate, and ends Cancelled. Queued for the store's worker if one owns it."""
    url = resolve_store(store)
    app = load_app(module)
    command = _command(lambda: CancelCommand(workflow_id=workflow_id, reason=reason, request_id=request_id))

    async def direct(engine: Engine) -> str:
        await engine.cancel(workflow_id, reason, request_id=request_id)
        return f"cancellation requested for workflow {workflow_id!r}"

    _write_command(url, app, command, direct, wait, queue_timeout)


@click.command()
@store_option
@module_option
@click.argument("workflow_id")
@_REASON
@_wait_option
@_request_id_option
@_queue_timeout_option
def terminate(
    store: str | None,
    module: str,
    workflow_id: str,
    reason: str,
    wait: bool,
    request_id: str | None,
    queue_timeout: float,
) -> None:
    """End a running workflow at once, without running its code (its activities are cancelled).
    Queued for the store's worker if one owns it."""
    url = resolve_store(store)
    app = load_app(module)
    command = _command(
        lambda: TerminateCommand(workflow_id=workflow_id, reason=reason, request_id=request_id)
    )

    async def direct(engine: Engine) -> str:
        await engine.terminate(workflow_id, reason, request_id=request_id)
        return f"workflow {workflow_id!r} terminated"

    _write_command(url, app, command, direct, wait, queue_timeout)


@click.command()
@store_option
@module_option
@click.argument("workflow_id")
@_wait_option
@_request_id_option
@_queue_timeout_option
def reopen(
    store: str | None, module: str, workflow_id: str, wait: bool, request_id: str | None, queue_timeout: float
) -> None:
    """Reopen a failed or cancelled workflow run: it replays (with fixed code) and carries on.
    Queued for the store's worker if one owns it."""
    url = resolve_store(store)
    app = load_app(module)
    command = _command(lambda: ReopenCommand(workflow_id=workflow_id, request_id=request_id))

    async def direct(engine: Engine) -> str:
        handle = await engine.reopen(workflow_id, request_id=request_id)
        return f"reopened workflow {handle.workflow_id!r} run {handle.run_id}"

    _write_command(url, app, command, direct, wait, queue_timeout)


@click.command()
@store_option
@module_option
@click.argument("workflow_id")
@click.option(
    "--to-seq",
    type=click.IntRange(min=1),
    default=None,
    help="The event of the latest run to replay up to (a reset point); default: its last step "
    "that did not fail.",
)
@_REASON
@_wait_option
@_request_id_option
@_queue_timeout_option
def reset(
    store: str | None,
    module: str,
    workflow_id: str,
    to_seq: int | None,
    reason: str,
    wait: bool,
    request_id: str | None,
    queue_timeout: float,
) -> None:
    """Reset a workflow: a new run replays the latest run's history up to an event and goes on
    from there with the current code (what came after runs again); the old run ends as reset.
    Queued for the store's worker if one owns it."""
    url = resolve_store(store)
    app = load_app(module)
    command = _command(
        lambda: ResetCommand(workflow_id=workflow_id, to_seq=to_seq, reason=reason, request_id=request_id)
    )

    async def direct(engine: Engine) -> str:
        handle = await engine.reset(workflow_id, to_seq=to_seq, reason=reason, request_id=request_id)
        return f"reset workflow {handle.workflow_id!r}: new run {handle.run_id}"

    _write_command(url, app, command, direct, wait, queue_timeout)


@click.group()
def activity() -> None:
    """Complete, fail or heartbeat an activity attempt by its task token (async completion).

    \b
    An activity that called aion_trio.complete_async() stays open until one of
    these settles it (or its timeouts expire it); its token comes from
    aion_trio.activity_info().task_token, e.g.:
        aion-trio activity complete -m myapp.flows:app TOKEN '{"approved": true}'
    """


def _token_workflow(token: str) -> str:
    try:
        return TaskToken.parse(token).workflow_id
    except InvalidActivityToken as exc:
        raise click.BadParameter(str(exc), param_hint="TOKEN") from None


@activity.command("complete")
@store_option
@module_option
@click.argument("token")
@click.argument("result_json", required=False, default="null", metavar="[RESULT_JSON]")
@_wait_option
@_queue_timeout_option
def activity_complete(
    store: str | None, module: str, token: str, result_json: str, wait: bool, queue_timeout: float
) -> None:
    """Complete the activity attempt TOKEN names with RESULT_JSON (default null).

    Refused, recording nothing, if the attempt is not open (it timed out or
    failed, a later attempt runs, the activity settled); completing an attempt
    already completed is accepted and records nothing.  Queued for the store's
    worker if one owns it.
    """
    url = resolve_store(store)
    result = json_argument(result_json, "RESULT_JSON")
    app = load_app(module)
    workflow_id = _token_workflow(token)
    command = _command(
        lambda: ActivityCommand(
            workflow_id=workflow_id, token=token, action="complete", payload=Payload.of(result)
        )
    )

    async def direct(engine: Engine) -> str:
        await engine.complete_activity(token, result)
        return f"activity attempt of workflow {workflow_id!r} completed"

    _write_command(url, app, command, direct, wait, queue_timeout)


@activity.command("fail")
@store_option
@module_option
@click.argument("token")
@click.argument("message")
@click.option(
    "--type", "error_type", default="ActivityFailed", show_default=True, help="The error's type name."
)
@click.option(
    "--non-retryable", is_flag=True, help="A final failure: no further attempt, whatever the retry policy."
)
@_wait_option
@_queue_timeout_option
def activity_fail(
    store: str | None,
    module: str,
    token: str,
    message: str,
    error_type: str,
    non_retryable: bool,
    wait: bool,
    queue_timeout: float,
) -> None:
    """Fail the activity attempt TOKEN names with MESSAGE; its retry policy decides what follows.

    Refused like 'activity complete'; failing an attempt already failed is
    accepted and records nothing.
    """
    url = resolve_store(store)
    app = load_app(module)
    workflow_id = _token_workflow(token)
    command = _command(
        lambda: ActivityCommand(
            workflow_id=workflow_id,
            token=token,
            action="fail",
            error_type=error_type,
            message=message,
            non_retryable=non_retryable,
        )
    )

    async def direct(engine: Engine) -> str:
        await engine.fail_activity(token, message, error_type=error_type, non_retryable=non_retryable)
        return f"activity attempt of workflow {workflow_id!r} failed"

    _write_command(url, app, command, direct, wait, queue_timeout)


@activity.command("heartbeat")
@store_option
@module_option
@click.argument("token")
@click.argument("details_json", required=False, default="null", metavar="[DETAILS_JSON]")
@_wait_option
@_queue_timeout_option
def activity_heartbeat(
    store: str | None, module: str, token: str, details_json: str, wait: bool, queue_timeout: float
) -> None:
    """Heartbeat the open activity attempt TOKEN names, with DETAILS_JSON for its next attempt."""
    url = resolve_store(store)
    details = json_argument(details_json, "DETAILS_JSON")
    app = load_app(module)
    workflow_id = _token_workflow(token)
    command = _command(
        lambda: ActivityCommand(
            workflow_id=workflow_id, token=token, action="heartbeat", payload=Payload.of(details)
        )
    )

    async def direct(engine: Engine) -> str:
        await engine.heartbeat_activity(token, details)
        return f"activity attempt of workflow {workflow_id!r}: heartbeat taken"

    _write_command(url, app, command, direct, wait, queue_timeout)
