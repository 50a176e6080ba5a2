"""The README's Python blocks run, in order, in one namespace (as a reader would paste them)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

pytestmark = pytest.mark.slow  # runs the README, including a SQLite example

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(encoding="utf-8"), flags=re.S | re.M)


def test_the_readme_blocks_execute_and_its_examples_give_what_they_say(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    blocks = python_blocks()
    assert len(blocks) >= 5, "control: the README's python blocks were found"
    namespace: dict[str, Any] = {"__name__": "readme"}
    for number, block in enumerate(blocks, 1):
        exec(compile(block, f"README.md python block {number}", "exec"), namespace)
    aion = namespace["aion"]
    clock = trio.testing.MockClock(autojump_threshold=0)

    # The opening example: a two-day durable sleep on SQLite, under the mock clock.
    trio.run(namespace["main"], clock=clock)
    assert "{'receipt': 'charged 7'}" in capsys.readouterr().out
    assert (tmp_path / "orders.db").exists()

    # The query example answers 50 after one signal, and records nothing.
    async def queries() -> None:
        async with aion.open_engine("memory://", workflows=[namespace["tally"]]) as engine:
            await engine.start(namespace["tally"], workflow_id="tally-1")
            before = len(await engine.history("tally-1"))
            await namespace["ask"](engine)
            assert len(await engine.history("tally-1")) == before + 1  # the signal only
            await engine.signal("tally-1", "add", None)
            assert await engine.result("tally-1") == 5

    trio.run(queries, clock=trio.testing.MockClock(autojump_threshold=0))
    assert capsys.readouterr().out.strip() == "50"
