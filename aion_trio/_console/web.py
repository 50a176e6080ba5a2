"""The console's web application (Starlette, on Trio through anyio): the pages, their live
streams (server-sent events), the actions, and the per-launch token that guards them all."""

from __future__ import annotations

import hmac
import re
import secrets
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import attrs
import click
import trio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from .._cli.errors import describe_error
from .._cli.options import json_argument
from .._cli.userapp import App
from .._cli.writes import apply_or_queue
from .._commands import (
    CancelCommand,
    Command,
    ReopenCommand,
    ResetCommand,
    SignalCommand,
    TerminateCommand,
)
from .._engine import Engine
from .._errors import WorkflowNotFound
from .._payload import Payload
from .._store import Store
from .._urls import redact_url
from .data import BadFilter, ListQuery, list_page, workflow_page
from .pages import actions_form, e, layout, list_body, list_live, message_page, workflow_body, workflow_live

COOKIE = "aion_trio_console"
#: What ends a line in an event stream: each piece of a fragment goes out as one data line.
_LINES = re.compile(r"\r\n|\r|\n")
STATIC = Path(__file__).parent / "static"
MAX_FORM = 1 << 20
ACTIONS = ("signal", "cancel", "terminate", "reopen", "reset")
#: Outcomes kept for the page an action redirects to (the oldest dropped first).
_OUTCOMES_KEPT = 200


@attrs.define
class Settings:
    store_url: str
    app: App | None
    """The user's definitions (``--module``): actions need them, as the CLI's write commands do."""
    read_only: bool
    token: str = attrs.field(factory=lambda: secrets.token_urlsafe(24))
    csrf: str = attrs.field(factory=lambda: secrets.token_urlsafe(24))
    refresh: float = 1.0
    """Seconds between two looks at the store for a live page."""
    queue_timeout: float = 30.0

    def actions_off(self) -> str | None:
        if self.read_only:
            return "The console runs with --read-only: actions are disabled."
        if self.app is None:
            return "Actions need the workflows' definitions: start the console with --module MODULE:ATTR."
        return None


class TokenGate:
    """Every request carries the launch's token: ``?token=`` once (it becomes a cookie and the
    browser is sent on without it in the address), then the cookie.  Anything else is refused."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self.token = token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        given = request.query_params.get("token")
        if given is not None:
            if not hmac.compare_digest(given.encode(), self.token.encode()):
                await _refuse(scope, receive, send)
                return
            rest = [(k, v) for k, v in request.query_params.multi_items() if k != "token"]
            target = request.url.path + ("?" + urllib.parse.urlencode(rest) if rest else "")
            response: Response = RedirectResponse(target, status_code=303)
            response.set_cookie(COOKIE, self.token, httponly=True, samesite="strict", path="/")
            await response(scope, receive, send)
            return
        cookie = request.cookies.get(COOKIE, "")
        if not hmac.compare_digest(cookie.encode(), self.token.encode()):
            await _refuse(scope, receive, send)
            return
        await self.app(scope, receive, send)


async def _refuse(scope: Scope, receive: Receive, send: Send) -> None:
    body = message_page(
        "Forbidden",
        "This console needs the token printed when it started: open the URL it printed "
        "(http://HOST:PORT/?token=...).",
    )
    await HTMLResponse(body, status_code=403)(scope, receive, send)


def build_app(store: Store, settings: Settings) -> ASGIApp:
    """The console's ASGI application over an opened store."""
    outcomes: dict[str, tuple[bool, str]] = {}
    shown_store = redact_url(settings.store_url)

    def page(title: str, body: str) -> HTMLResponse:
        return HTMLResponse(layout(title, body, store=shown_store, read_only=settings.read_only))

    async def list_view(request: Request) -> Response:
        query = ListQuery.from_params(_multi(request))
        try:
            result, error = await list_page(store, query), None
        except BadFilter as exc:
            result, error = None, f"Bad filter: {exc}"
        response = page("Workflows", list_body(query, result, error))
        if error is not None:
            response.status_code = 400
        return response

    async def list_stream(request: Request) -> Response:
        query = ListQuery.from_params(_multi(request))

        async def render() -> tuple[str, str]:
            try:
                result = await list_page(store, query)
            except BadFilter as exc:
                return "bad", list_live(query, None, f"Bad filter: {exc}")
            return result.fingerprint(), list_live(query, result, None)

        return _stream(request, render, settings.refresh)

    async def workflow_view(request: Request) -> Response:
        workflow_id = request.path_params["workflow_id"]
        try:
            data = await workflow_page(store, workflow_id, request.query_params.get("run"))
        except WorkflowNotFound:
            return HTMLResponse(
                layout(
                    "Not found",
                    f'<p class="error">No workflow {e(workflow_id)} in this store.</p>',
                    store=shown_store,
                    read_only=settings.read_only,
                ),
                status_code=404,
            )
        off = settings.actions_off()
        actions = actions_form(
            workflow_id,
            csrf=settings.csrf,
            enabled=off is None,
            why_not=off or "",
            reset_points=data.reset_points,
            default_reset=data.default_reset,
        )
        outcome = outcomes.get(request.query_params.get("outcome", ""))
        return page(workflow_id, workflow_body(data, actions=actions, outcome=outcome))

    async def workflow_stream(request: Request) -> Response:
        workflow_id = request.path_params["workflow_id"]
        run_id = request.query_params.get("run")

        async def render() -> tuple[str, str]:
            try:
                data = await workflow_page(store, workflow_id, run_id)
            except WorkflowNotFound:
                return "gone", '<p class="error">The workflow is gone from the store.</p>'
            return data.fingerprint(), workflow_live(data)

        return _stream(request, render, settings.refresh)

    async def action(request: Request) -> Response:
        name = request.path_params["action"]
        if name not in ACTIONS:
            return PlainTextResponse(f"unknown action {name!r}", status_code=404)
        declared = request.headers.get("content-length", "0")
        if not declared.isdigit() or int(declared) > MAX_FORM:
            return PlainTextResponse("form too large", status_code=413)
        body = await request.body()
        if len(body) > MAX_FORM:
            return PlainTextResponse("form too large", status_code=413)
        form = {
            k: v[-1]
            for k, v in urllib.parse.parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True).items()
        }
        off = settings.actions_off()
        if off is not None or settings.app is None:
            return HTMLResponse(message_page("Forbidden", off or ""), status_code=403)
        if not _same_origin(request) or not hmac.compare_digest(
            form.get("csrf", "").encode(), settings.csrf.encode()
        ):
            return HTMLResponse(
                message_page("Forbidden", "The form's CSRF check failed: reload the page and try again."),
                status_code=403,
            )
        workflow_id = form.get("workflow_id", "")
        ok, message = await issue(settings, settings.app, name, workflow_id, form)
        key = secrets.token_urlsafe(8)
        outcomes[key] = (ok, message)
        while len(outcomes) > _OUTCOMES_KEPT:
            del outcomes[next(iter(outcomes))]
        target = f"/workflows/{urllib.parse.quote(workflow_id, safe='')}?outcome={key}"
        return RedirectResponse(target, status_code=303)

    routes = [
        Route("/", list_view),
        Route("/live/list", list_stream),
        Route("/workflows/{workflow_id:path}", workflow_view),
        Route("/live/workflows/{workflow_id:path}", workflow_stream),
        Route("/actions/{action}", action, methods=["POST"]),
        Mount("/static", app=StaticFiles(directory=STATIC), name="static"),
    ]
    return TokenGate(Starlette(routes=routes), settings.token)


def _multi(request: Request) -> dict[str, list[str]]:
    params: dict[str, list[str]] = {}
    for key, value in request.query_params.multi_items():
        params.setdefault(key, []).append(value)
    return params


def _same_origin(request: Request) -> bool:
    """A browser's POST names its origin: it must be this console's (no Origin: not a browser's)."""
    origin = request.headers.get("origin")
    if origin is None:
        return True
    return urllib.parse.urlsplit(origin).netloc == request.headers.get("host", "")


def _stream(request: Request, render: Callable[[], Awaitable[tuple[str, str]]], every: float) -> Response:
    """Server-sent events: an ``update`` with the live part's HTML each time it changes."""

    async def events() -> AsyncIterator[str]:
        # What the page already shows: no update until it changes.
        last = request.query_params.get("seen")
        idle = 0.0
        while not await request.is_disconnected():
            fingerprint, fragment = await render()
            if fingerprint != last:
                last = fingerprint
                idle = 0.0
                yield "event: update\n" + "".join(f"data: {line}\n" for line in _LINES.split(fragment)) + "\n"
            elif idle >= 15:
                idle = 0.0
                yield ": still here\n\n"
            await trio.sleep(every)
            idle += every

    return StreamingResponse(
        events(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
    )


async def issue(
    settings: Settings, app: App, name: str, workflow_id: str, form: dict[str, str]
) -> tuple[bool, str]:
    """Send one command the way the CLI's write commands do (``apply_or_queue``): to the store's
    live worker through its inbox, or applied here by an engine when no worker owns the store."""
    reason = form.get("reason", "")
    command: Command
    direct: Callable[[Engine], Awaitable[str]]
    try:
        if not workflow_id:
            raise ValueError("no workflow id")
        if name == "signal":
            signal_name = form.get("name", "").strip()
            if not signal_name:
                raise ValueError("the signal needs a name")
            payload = json_argument(form.get("payload", "").strip() or "null", "the payload")
            command = SignalCommand(workflow_id=workflow_id, name=signal_name, payload=Payload.of(payload))

            async def direct(engine: Engine) -> str:
                await engine.signal(workflow_id, signal_name, payload)
                return f"signal {signal_name!r} recorded for workflow {workflow_id!r}"

        elif name == "cancel":
            command = CancelCommand(workflow_id=workflow_id, reason=reason)

            async def direct(engine: Engine) -> str:
                await engine.cancel(workflow_id, reason)
                return f"cancellation requested for workflow {workflow_id!r}"

        elif name == "terminate":
            command = TerminateCommand(workflow_id=workflow_id, reason=reason)

            async def direct(engine: Engine) -> str:
                await engine.terminate(workflow_id, reason)
                return f"workflow {workflow_id!r} terminated"

        elif name == "reset":
            given = form.get("to_seq", "").strip()
            if given and not given.isdigit():
                raise ValueError(f"the reset point must be an event's seq, got {given!r}")
            to_seq = int(given) if given else None
            command = ResetCommand(workflow_id=workflow_id, to_seq=to_seq, reason=reason)

            async def direct(engine: Engine) -> str:
                handle = await engine.reset(workflow_id, to_seq=to_seq, reason=reason)
                return f"reset workflow {handle.workflow_id!r}: new run {handle.run_id}"

        else:
            command = ReopenCommand(workflow_id=workflow_id)

            async def direct(engine: Engine) -> str:
                handle = await engine.reopen(workflow_id)
                return f"reopened workflow {handle.workflow_id!r} run {handle.run_id}"

    except click.ClickException as exc:
        return False, f"{name} not sent: {exc.format_message()}"
    except (TypeError, ValueError) as exc:
        return False, f"{name} not sent: {exc}"
    try:
        delivered = await apply_or_queue(
            settings.store_url, app, command, direct, wait=True, queue_timeout=settings.queue_timeout
        )
    except Exception as exc:
        message = describe_error(exc, settings.store_url)
        if message is None:
            raise
        return False, f"{name} failed: {message}"
    if delivered.queued:
        assert delivered.outcome is not None
        return True, f"applied by the worker ({delivered.owner}): {delivered.outcome.message}"
    return True, f"{delivered.value} (no worker owns the store: applied directly by the console)"


def token_url(binds: list[str], token: str) -> str:
    return f"{binds[0]}/?token={token}"
