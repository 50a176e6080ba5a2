"""A click ``CliRunner`` that keeps stdout and stderr apart on every supported click.

click 8.1 (the floor) mixes them unless asked not to, and then ``result.stderr``
raises; click 8.2 keeps them apart always and refuses the argument.
"""

from __future__ import annotations

from click.testing import CliRunner


def cli_runner() -> CliRunner:
    try:
        return CliRunner(mix_stderr=False)  # type: ignore[call-arg,unused-ignore]
    except TypeError:  # click >= 8.2 keeps stdout and stderr apart anyway
        return CliRunner()
