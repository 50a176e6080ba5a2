"""The plugin's registration imports no driver: psycopg only when a postgresql:// URL is opened.

Every process that opens any store loads the ``aion_trio`` entry points, this
plugin among them; each check runs in a fresh interpreter, so what the
registration imported is seen in its ``sys.modules``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

DRIVER = ("psycopg", "psycopg_pool")


def run_fresh(code: str, *, cwd: Path) -> dict[str, object]:
    """Run ``code`` in a new interpreter; it prints one JSON object as its last line."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


OPEN_AND_LIST = """
    import json, sys
    import trio
    import aion_trio
    from aion_trio._plugins import default_registry

    async def main():
        async with aion_trio.open_store({url!r}) as store:
            pass
        {engine}

    trio.run(main)
    print(json.dumps({{
        "schemes": sorted(s.scheme for s in default_registry().schemes()),
        "loaded": sorted(m for m in sys.modules if m.split(".")[0] in ("psycopg", "psycopg_pool")),
        "plugin": "aion_trio_postgres" in sys.modules,
    }}))
"""


@pytest.mark.parametrize("url", ["memory://", "sqlite:///lazy.db"])
def test_opening_another_store_does_not_import_the_driver(url: str, tmp_path: Path) -> None:
    engine = "async with aion_trio.open_engine(" + repr(url) + ", workflows=[]):\n            pass"
    result = run_fresh(OPEN_AND_LIST.format(url=url, engine=engine), cwd=tmp_path)
    assert result["plugin"] is True, "control: the postgres plugin was loaded"
    assert {"postgres", "postgresql"} <= set(result["schemes"]), "control: its schemes are registered"  # type: ignore[arg-type]
    assert result["loaded"] == []


def test_a_public_name_imports_the_store_on_first_use(tmp_path: Path) -> None:
    result = run_fresh(
        """
        import json, sys
        import aion_trio_postgres
        before = "psycopg" in sys.modules
        store = aion_trio_postgres.PostgresStore
        url = aion_trio_postgres.parse_postgres_url("postgresql://u@h/d?schema=lazy")
        print(json.dumps({
            "before": before,
            "after": "psycopg" in sys.modules,
            "module": store.__module__,
            "schema": url.schema,
            "version": aion_trio_postgres.SCHEMA_VERSION,
            "public": sorted(set(aion_trio_postgres.__all__) - set(dir(aion_trio_postgres))),
        }))
        """,
        cwd=tmp_path,
    )
    assert result["before"] is False
    assert result["after"] is True
    assert result["module"] == "aion_trio_postgres"
    assert result["schema"] == "lazy"
    assert isinstance(result["version"], int)
    assert result["version"] > 0
    assert result["public"] == []


def test_a_missing_driver_fails_the_postgresql_open_not_the_plugin_load(tmp_path: Path) -> None:
    result = run_fresh(
        """
        import json, sys
        sys.modules["psycopg"] = None  # as if psycopg were not installed
        import trio
        import aion_trio
        from aion_trio.plugin import PluginLoadError

        async def main():
            async with aion_trio.open_store("memory://"):
                pass
            try:
                async with aion_trio.open_store("postgresql://u@127.0.0.1/d"):
                    pass
            except PluginLoadError as exc:
                return str(exc)
            return None

        print(json.dumps({"error": trio.run(main)}))
        """,
        cwd=tmp_path,
    )
    error = result["error"]
    assert isinstance(error, str), "opening postgresql:// without psycopg raised no PluginLoadError"
    assert "'psycopg'" in error
    assert "pip install 'psycopg[binary]" in error
