"""The ``aion-trio`` command line.

For now it reports what is installed: the version and the registered store
schemes.  Engine commands arrive with the engine.

Output conventions: human output is a rich table on stdout; ``--json`` prints
one JSON document on stdout for machines.  Every error is one line,
``Error: ...``, on stderr, with a non-zero exit status: 2 for a usage error
(click's convention) or a store plugin that cannot be loaded, 1 otherwise.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ._errors import PluginError
from ._plugins import ENTRY_POINT_GROUP, StoreRegistry, build_registry, make_plugin_manager
from ._version import __version__

PROG_NAME = "aion-trio"
EXIT_PLUGIN_ERROR = 2


class PluginsUnavailable(click.ClickException):
    """The installed store plugins could not be loaded (exit status 2)."""

    exit_code = EXIT_PLUGIN_ERROR


def _one_line(message: str) -> str:
    return " ".join(message.split())


class _Cli(click.Group):
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
            _fail(f"{exc.format_message().rstrip('.')}{hint}", exc.exit_code)
        except click.ClickException as exc:
            _fail(exc.format_message(), exc.exit_code)
        except click.Abort:
            _fail("aborted", 1)
        sys.exit(rv if isinstance(rv, int) else 0)


def _fail(message: str, exit_code: int) -> NoReturn:
    click.echo(f"Error: {_one_line(message)}", err=True)
    sys.exit(exit_code)


def _load_registry() -> StoreRegistry:
    """A fresh registry from the installed entry points (a CLI run is one-shot: no cache)."""
    try:
        return build_registry(make_plugin_manager())
    except PluginError as exc:
        raise PluginsUnavailable(f"cannot load the store plugins: {exc}") from exc
    except Exception as exc:
        # Whatever a plugin raised while loading or registering, the user's fix is
        # the same: repair, uninstall or disable that plugin.
        raise PluginsUnavailable(f"cannot load the store plugins: {type(exc).__name__}: {exc}") from exc


@click.group(cls=_Cli, invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "-V", "--version", prog_name=PROG_NAME, message="%(prog)s %(version)s")
@click.pass_context
def cli(ctx: click.Context) -> None:
    """aion-trio: durable, event-sourced workflows embedded in Trio applications."""
    if ctx.invoked_subcommand is None:
        click.echo(ctx.get_help())


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of objects instead of a table.")
def stores(as_json: bool) -> None:
    """List the store URL schemes that installed plugins register.

    Plugins are found through the 'aion_trio' entry-point group; set
    AION_TRIO_DISABLE_PLUGINS=name[,name...] (or '*') to skip some.
    """
    schemes = _load_registry().schemes()
    if as_json:
        data = [{"scheme": s.scheme, "plugin": s.plugin, "description": s.description} for s in schemes]
        click.echo(json.dumps(data, indent=2))
        return
    console = Console()
    if not schemes:
        console.print(
            Text(
                f"No store plugins are registered (entry-point group {ENTRY_POINT_GROUP!r}).", style="yellow"
            )
        )
        return
    table = Table(title="Store schemes")
    table.add_column("Scheme", no_wrap=True, style="bold")
    table.add_column("Plugin", no_wrap=True)
    table.add_column("Description")
    for s in schemes:
        # Text, not markup: a description is plugin-supplied and may contain '[...]'.
        table.add_row(Text(f"{s.scheme}://"), Text(s.plugin), Text(s.description))
    console.print(table)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``aion-trio`` console script."""
    cli.main(args=list(argv) if argv is not None else None, prog_name=PROG_NAME)
