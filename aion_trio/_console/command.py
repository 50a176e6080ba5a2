"""The ``aion-trio console`` command."""

from __future__ import annotations

import functools

import click
import trio

from .._cli.errors import CommandInterrupted, UsageProblem, run
from .._cli.options import MODULE_ENV, resolve_store, store_option
from .._cli.userapp import load_app

DEFAULT_PORT = 8233


@click.command()
@store_option
@click.option(
    "--module",
    "-m",
    "module",
    envvar=MODULE_ENV,
    metavar="MODULE:ATTR",
    help=f"The workflows' definitions (env: {MODULE_ENV}), as for 'aion-trio signal': the actions need "
    "them; without it the console only reads.",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="The address to listen on.")
@click.option(
    "--port", type=click.IntRange(0, 65535), default=DEFAULT_PORT, show_default=True, help="0: any free port."
)
@click.option(
    "--read-only", is_flag=True, help="Show workflows only: no signal, cancel, terminate, reopen or reset."
)
@click.option(
    "--refresh",
    type=click.FloatRange(min=0.05),
    default=1.0,
    show_default=True,
    metavar="SECONDS",
    help="How often a live page looks at the store.",
)
@click.option(
    "--queue-timeout",
    type=click.FloatRange(min=0),
    default=30.0,
    show_default=True,
    metavar="SECONDS",
    help="When a running worker owns the store: how long an action waits for it to apply the command.",
)
def console(
    store: str | None,
    module: str | None,
    host: str,
    port: int,
    read_only: bool,
    refresh: float,
    queue_timeout: float,
) -> None:
    """Serve a web console for the store on http://HOST:PORT until Ctrl-C.

    It lists the workflows (filters as 'aion-trio list' takes them), shows each
    one's summary, timeline and history, live, and sends signal, cancel,
    terminate, reopen and reset the way the write commands do (queued for the store's
    running worker, or applied here with --module's definitions). It prints a
    URL with a secret token made at launch: every request needs it (the browser
    keeps it as a cookie).
    """
    url = resolve_store(store)
    try:
        from .server import serve_console
        from .web import Settings
    except ImportError as exc:
        raise UsageProblem(
            f"the console needs its extra ({(exc.name or '?').split('.')[0]} is missing): "
            "pip install 'aion-trio[console]'"
        ) from None
    settings = Settings(
        store_url=url,
        app=load_app(module) if module else None,
        read_only=read_only,
        refresh=refresh,
        queue_timeout=queue_timeout,
    )

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            address = await nursery.start(functools.partial(serve_console, settings, host=host, port=port))
            click.echo(f"aion-trio console on {address}", nl=True)
            off = settings.actions_off()
            if off:
                click.echo(off, err=True)

    try:
        run(url, main)
    except CommandInterrupted:
        # Ctrl-C is how a console is stopped: not an error.
        click.echo("console stopped", err=True)
