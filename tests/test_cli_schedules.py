"""``aion-trio schedule``: the commands change stored schedules, the owning engine fires them."""

from __future__ import annotations

import json
from pathlib import Path

import trio
from click.testing import CliRunner, Result

import aion_trio as aion
from aion_trio import _cli


def run_cli(*args: str) -> Result:
    try:
        runner = CliRunner(mix_stderr=False)  # type: ignore[call-arg,unused-ignore]
    except TypeError:  # click >= 8.2 keeps stdout and stderr apart anyway
        runner = CliRunner()
    return runner.invoke(_cli.cli, list(args), prog_name="aion-trio")


@aion.workflow
async def report(ctx: aion.WorkflowContext, region: str) -> str:
    return f"report {region}"


def test_schedule_commands_create_show_pause_trigger_backfill_delete(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path}/s.db"
    created = run_cli(
        "--store",
        store,
        "schedule",
        "create",
        "nightly",
        "report",
        "--cron",
        "0 2 * * *",
        "--tz",
        "Europe/Paris",
        "--args",
        '["eu"]',
        "--memo",
        '{"team": "ops"}',
    )
    assert created.exit_code == 0, created.stderr
    assert "created schedule 'nightly'" in created.stdout
    listed = run_cli("--store", store, "schedule", "list", "--json")
    assert [s["schedule_id"] for s in json.loads(listed.stdout)] == ["nightly"]
    shown = json.loads(run_cli("--store", store, "schedule", "show", "nightly", "--json").stdout)
    assert len(shown["next_times"]) == 10
    assert all(t.endswith(("T01:00:00Z", "T00:00:00Z")) for t in shown["next_times"])  # 02:00 Paris
    assert shown["action"]["args"] == ["eu"]
    assert shown["action"]["memo"] == {"team": "ops"}

    assert run_cli("--store", store, "schedule", "pause", "nightly", "--note", "migration").exit_code == 0
    table = run_cli("--store", store, "schedule", "show", "nightly").stdout
    assert "paused: migration" in table
    assert "Next actions: none" in table
    assert run_cli("--store", store, "schedule", "unpause", "nightly").exit_code == 0
    assert run_cli("--store", store, "schedule", "trigger", "nightly").exit_code == 0
    backfilled = run_cli(
        "--store",
        store,
        "schedule",
        "backfill",
        "nightly",
        "--start",
        "2026-11-01T00:00Z",
        "--end",
        "2026-11-02T12:00Z",
    )
    assert backfilled.exit_code == 0, backfilled.stderr
    waiting = json.loads(run_cli("--store", store, "schedule", "show", "nightly", "--json").stdout)["state"][
        "pending"
    ]
    assert len(waiting) == 3  # the trigger, and the ticks of Nov 1 and 2 (01:00Z)

    async def fire() -> list[str]:
        async with aion.open_engine(store, workflows=[report]) as engine:
            with trio.fail_after(30):
                while (await engine.schedules.describe("nightly")).schedule.state.started_count < 3:  # noqa: ASYNC110
                    await trio.sleep(0.01)
            return sorted(r.workflow_id for r in await engine.list())

    ran = trio.run(fire)
    assert ran[:2] == ["nightly@2026-11-01T01:00:00Z", "nightly@2026-11-02T01:00:00Z"]
    assert ran[2].startswith("nightly@manual@")
    shown_text = run_cli("--store", store, "schedule", "show", "nightly").stdout
    assert "Recent actions" in shown_text
    assert shown_text.count("started") >= 3

    assert run_cli("--store", store, "schedule", "delete", "nightly").exit_code == 0
    assert "No schedules" in run_cli("--store", store, "schedule", "list").stdout


def test_schedule_errors_are_one_line(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path}/s.db"
    bad = run_cli("--store", store, "schedule", "create", "x", "report", "--cron", "61 * * * *")
    assert bad.exit_code == 2
    assert "invalid schedule cron expression" in bad.stderr
    assert run_cli("--store", store, "schedule", "create", "x", "report", "--interval", "60").exit_code == 0
    again = run_cli("--store", store, "schedule", "create", "x", "report", "--interval", "60")
    assert again.exit_code == 1
    assert "already exists" in again.stderr
    missing = run_cli("--store", store, "schedule", "show", "nope")
    assert missing.exit_code == 1
    assert missing.stderr.strip() == "Error: schedule 'nope' does not exist in this store"
