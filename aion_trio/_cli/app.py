"""The ``aion-trio`` command group: one ``Error: ...`` line for every error, and the
commands of the other modules added to it."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from typing import Any

import click

from .._demo import demo_command
from .._version import __version__
from .errors import EXIT_INTERRUPTED, fail
from .options import CODEC_ENV, CODECS_META, DEFAULT_STORE, STORE_ENV
from .read import event, history, list_, show, stores
from .replay import replay
from .schedules import schedule
from .userapp import load_codecs
from .worker import worker
from .writes import activity, cancel, query, reopen, reset, signal, start, terminate, update

PROG_NAME = "aion-trio"

#: Commands of the entry points layered above the CLI, loaded by name when asked for: they
#: build on the CLI's modules (which cannot import them back), and need extras of their own.
LAZY_COMMANDS = {"console": "aion_trio._console.command:console"}


class Cli(click.Group):
    """click's group, except that every error is one ``Error: ...`` line on stderr.

    click prints usage errors as usage text plus a hint plus the error; here the
    hint is folded into the one line, so scripts and people read the same thing.
    """

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.UsageError as exc:
            hint = f"; see '{exc.ctx.command_path} --help'" if exc.ctx is not None else ""
            fail(f"{exc.format_message().rstrip('.')}{hint}", exc.exit_code)
        except click.ClickException as exc:
            fail(exc.format_message(), exc.exit_code)
        except click.Abort as exc:
            if isinstance(exc.__context__, KeyboardInterrupt):
                fail("interrupted", EXIT_INTERRUPTED)
            fail("aborted", 1)
        sys.exit(rv if isinstance(rv, int) else 0)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *LAZY_COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in LAZY_COMMANDS:
            module, _, attr = LAZY_COMMANDS[cmd_name].partition(":")
            command: click.Command = getattr(importlib.import_module(module), attr)
            return command
        return super().get_command(ctx, cmd_name)


@click.group(cls=Cli, invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "-V", "--version", prog_name=PROG_NAME, message="%(prog)s %(version)s")
@click.option(
    "--store",
    "store",
    envvar=STORE_ENV,
    default=DEFAULT_STORE,
    show_default=True,
    metavar="URL",
    help=f"Store URL, or a path to a SQLite file (env: {STORE_ENV}); commands also take --store.",
)
@click.option(
    "--codec",
    "codec",
    envvar=CODEC_ENV,
    metavar="MODULE:ATTR",
    help=f"Payload codecs the store was written with (env: {CODEC_ENV}): a codec, a sequence of "
    "codecs or a CodecChain; payloads are decoded through it (without it, encrypted ones show as "
    "<encrypted>).  Commands with -m also take the app's .codecs.",
)
@click.pass_context
def cli(ctx: click.Context, store: str, codec: str | None) -> None:
    """aion-trio: durable, event-sourced workflows embedded in Trio applications.

    Commands work on the store given by --store URL or $AION_TRIO_STORE
    (default sqlite:///aion.db, i.e. ./aion.db); a plain path is a SQLite file.
    """
    if codec:
        ctx.meta[CODECS_META] = load_codecs(codec)
    if ctx.invoked_subcommand is None:
        click.echo(ctx.get_help())


# click lists a group's commands sorted by name: the order here is free.
for _command in (
    stores,
    list_,
    show,
    history,
    replay,
    event,
    start,
    signal,
    query,
    update,
    cancel,
    terminate,
    reopen,
    reset,
    activity,
    worker,
    schedule,
    demo_command,
):
    cli.add_command(_command)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``aion-trio`` console script."""
    cli.main(args=list(argv) if argv is not None else None, prog_name=PROG_NAME)
