"""Credentials in store URLs never reach a message or a log line (one helper: ``redact_url``).

The PostgreSQL plugin's own refusals are pinned in contrib/aion-trio-postgres's
tests; these pin the helper and the core's and the CLI's uses of it.
"""

from __future__ import annotations

import logging

import pytest
from click.testing import CliRunner

import aion_trio as aion
from aion_trio import _cli
from aion_trio.plugin import redact_url

SECRET = "hunter2"


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (f"postgresql://bob:{SECRET}@db:5432/x", "postgresql://bob:***@db:5432/x"),
        (f"postgresql://bob:{SECRET}@db/x?schema=a", "postgresql://bob:***@db/x?schema=a"),
        (f"postgresql://:{SECRET}@db/x", "postgresql://:***@db/x"),
        (f"postgresql://bob@db/x?password={SECRET}&schema=a", "postgresql://bob@db/x?password=***&schema=a"),
        (f"postgresql://db/x?sslpassword={SECRET}#f", "postgresql://db/x?sslpassword=***#f"),
        (f"postgresql://db/x?api_token={SECRET}", "postgresql://db/x?api_token=***"),
        (f"bob:{SECRET}@db/x", "bob:***@db/x"),  # a URL missing its scheme
        ("postgresql://bob@db/x?schema=a", "postgresql://bob@db/x?schema=a"),
        ("sqlite:///orders.db?synchronous=NORMAL", "sqlite:///orders.db?synchronous=NORMAL"),
        ("memory://", "memory://"),
    ],
)
def test_redact_url_hides_passwords_and_keeps_the_rest(url: str, shown: str) -> None:
    assert redact_url(url) == shown


@pytest.mark.parametrize(
    ("url", "error"),
    [
        (f"bob:{SECRET}@db/x", aion.InvalidStoreUrl),
        (f"sqlite://bob:{SECRET}@host/x.db", aion.InvalidStoreUrl),
        (f"sqlite:///x.db?password={SECRET}", aion.InvalidStoreUrl),
        (f"memory://bob:{SECRET}@host/x", aion.InvalidStoreUrl),
    ],
)
async def test_a_refused_store_url_never_repeats_its_credentials(url: str, error: type[Exception]) -> None:
    with pytest.raises(error) as info:
        async with aion.open_store(url):
            pass  # pragma: no cover - refused before
    assert SECRET not in str(info.value)
    assert "***" in str(info.value)


@pytest.mark.parametrize("url", [f"nosuch://bob:{SECRET}@h/x", f"sqlite://bob:{SECRET}@host/x.db"])
def test_the_cli_line_for_a_bad_store_never_repeats_its_credentials(url: str) -> None:
    result = CliRunner().invoke(_cli.cli, ["list", "--store", url], prog_name="aion-trio")
    assert result.exit_code == 2
    assert result.output.startswith("Error: bad store "), result.output
    assert SECRET not in result.output
    assert ":***@" in result.output, "control: the URL is shown, redacted"


def test_the_worker_never_logs_its_store_urls_credentials(caplog: pytest.LogCaptureFixture) -> None:
    url = f"memory://bob:{SECRET}@host/x"
    with caplog.at_level(logging.INFO, logger="aion_trio"):
        result = CliRunner().invoke(_cli.cli, ["--store", url, "worker", "tests.procs.cli_app:app"])
    opening = [r.getMessage() for r in caplog.records if r.getMessage().startswith("opening store")]
    assert opening, f"control: the worker logged its store ({result.output!r})"
    assert SECRET not in "\n".join(opening)
    assert SECRET not in result.output
