"""CPU time of the test suite on two checkouts, measured in interleaved pairs.

Usage::

    python bench/suite_time.py --old CHECKOUT --new CHECKOUT [--pairs N]
        [--old-python PY] [--new-python PY] [--files PATH ...] [--worst K]
        [--dir DIR] [--seconds S]

Each checkout runs its own test files with its own interpreter (default
``CHECKOUT/.venv/bin/python``, else this one), on the memory store, with
``-m "not slow" -p no:randomly -p no:cacheprovider``.  Both run the same
tests: the node ids the old checkout collects that the new one collects too,
plus, file by file, the old tests the new checkout renamed (an old-only and a
new-only id in one file, paired by name similarity; the pairs are printed).
Tests only one side has are left out on both.

The figure is CPU time, not wall time: user + system of the pytest process and
every child it reaped (``os.wait4``), which moves far less than wall time with
the load of other processes on a shared machine.  The runs are interleaved,
the order alternating (old-new, new-old, ...), so a drift of the machine's
speed over the measurement falls on both sides alike.  A pytest plugin
(``bench/_suite_time_plugin.py``) keeps the selected tests and records each
test's CPU time, from which the files whose ratio is worst are reported.

Prints one JSON line per result: ``selection`` (how many tests, the renames),
``run`` (one pytest run: cpu_s, user_s, sys_s, wall_s, the part of cpu_s spent
in tests, outcomes, failed tests), ``pair`` (old and new CPU and their ratio),
``summary`` (medians of old and new CPU and wall time, median/median ratio and
the median of the pair ratios), and ``file`` lines for the ``--worst`` files by
median CPU ratio.  A run with a failed test is reported and still counted; a
run that did not run every selected test (pytest exit 2 or more) ends the
measurement.  Measure checkouts nobody edits meanwhile (a worktree of their
own): the new side's code is whatever its checkout holds when each run starts.

``--seconds S`` (the bench env's smoke run): stop starting pairs once S
seconds have passed (at least one pair); below 60 s and without ``--files``
only ``tests/test_ids.py`` is measured.  Not part of the test run.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from typing import Any

from _common import emitter, run_in_scratch
from _suite_time_plugin import OUT_ENV, SELECT_ENV

emit = emitter("suite_time")
HERE = os.path.dirname(os.path.abspath(__file__))
PLUGIN = "_suite_time_plugin"
PYTEST_ARGS = ["-q", "-m", "not slow", "-p", "no:randomly", "-p", "no:cacheprovider", "-p", PLUGIN]
SMOKE_FILES = ["tests/test_ids.py"]
# Below this similarity an old-only and a new-only test in one file are not a rename.
RENAME_CUTOFF = 0.6


class Side:
    def __init__(self, name: str, checkout: str, python: str | None) -> None:
        self.name = name
        self.checkout = os.path.abspath(checkout)
        venv_python = os.path.join(self.checkout, ".venv", "bin", "python")
        self.python = python or (venv_python if os.path.exists(venv_python) else sys.executable)
        # The venv's own pytest script, as a developer runs it: ``python -m pytest``
        # would put the checkout itself first on sys.path.
        script = os.path.join(os.path.dirname(self.python), "pytest")
        self.command = [script] if os.path.exists(script) else [self.python, "-m", "pytest"]


def pytest_env(scratch: str, select: str | None, out: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("AION_TRIO_TEST_STORE", None)  # the memory store
    env["PYTHONPATH"] = os.pathsep.join(p for p in (scratch, env.get("PYTHONPATH", "")) if p)
    env[OUT_ENV] = out
    if select is None:
        env.pop(SELECT_ENV, None)
    else:
        env[SELECT_ENV] = select
    return env


def run_pytest(
    side: Side, scratch: str, files: list[str], args: list[str], select: str | None
) -> dict[str, Any]:
    """One pytest run in ``side``'s checkout: its rusage, wall time and the plugin's record."""
    out = os.path.join(scratch, f"{side.name}-out.json")
    if os.path.exists(out):
        os.remove(out)
    began = time.perf_counter()
    process = subprocess.Popen(
        [*side.command, *PYTEST_ARGS, *args, *files],
        cwd=side.checkout,
        env=pytest_env(scratch, select, out),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    assert process.stdout is not None
    output = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - began
    if not os.path.exists(out):
        sys.stderr.write(output.decode(errors="replace")[-4000:])
        raise SystemExit(f"{side.name}: pytest wrote no record (exit {process.returncode})")
    with open(out, encoding="utf-8") as file:
        record: dict[str, Any] = json.load(file)
    record.update(
        exit=process.returncode,
        user_s=usage.ru_utime,
        sys_s=usage.ru_stime,
        cpu_s=usage.ru_utime + usage.ru_stime,
        wall_s=wall,
        output=output.decode(errors="replace"),
    )
    return record


def match_renames(old_only: list[str], new_only: list[str]) -> list[tuple[str, str]]:
    """Pair old-only with new-only ids of the same file whose names are alike, best first."""
    by_file: dict[str, tuple[list[str], list[str]]] = defaultdict(lambda: ([], []))
    for nodeid in old_only:
        by_file[nodeid.split("::", 1)[0]][0].append(nodeid)
    for nodeid in new_only:
        by_file[nodeid.split("::", 1)[0]][1].append(nodeid)
    pairs: list[tuple[str, str]] = []
    for olds, news in by_file.values():
        scored = sorted(
            ((difflib.SequenceMatcher(None, o, n).ratio(), o, n) for o in olds for n in news),
            reverse=True,
        )
        used_old: set[str] = set()
        used_new: set[str] = set()
        for score, o, n in scored:
            if score >= RENAME_CUTOFF and o not in used_old and n not in used_new:
                pairs.append((o, n))
                used_old.add(o)
                used_new.add(n)
    return sorted(pairs)


def per_file(record: dict[str, Any]) -> dict[str, float]:
    totals: dict[str, float] = defaultdict(float)
    for nodeid, entry in record["tests"].items():
        totals[nodeid.split("::", 1)[0]] += entry["cpu_s"]
    return totals


def outcomes(record: dict[str, Any]) -> dict[str, int]:
    counts: dict[str, int] = defaultdict(int)
    for entry in record["tests"].values():
        counts[entry["outcome"]] += 1
    return dict(counts)


def measure(directory: str, options: argparse.Namespace) -> None:
    scratch = os.path.join(directory, "plugin")
    os.makedirs(scratch)
    shutil.copy(os.path.join(HERE, PLUGIN + ".py"), scratch)
    old = Side("old", options.old, options.old_python)
    new = Side("new", options.new, options.new_python)
    files = options.files or (SMOKE_FILES if options.seconds is not None and options.seconds < 60 else [])
    # The old checkout's test files; each side runs its own copy of them.
    old_files = files or ["tests"]
    began = time.monotonic()

    # Collecting also compiles both trees' bytecode before anything is timed.
    old_ids = run_pytest(old, scratch, old_files, ["--collect-only"], None)["collected"]
    new_files = [
        path
        for path in {nodeid.split("::", 1)[0] for nodeid in old_ids}
        if os.path.exists(os.path.join(new.checkout, path))
    ]
    new_ids = run_pytest(new, scratch, sorted(new_files), ["--collect-only"], None)["collected"]
    common = set(old_ids) & set(new_ids)
    renames = match_renames(sorted(set(old_ids) - common), sorted(set(new_ids) - common))
    old_select = sorted(common | {o for o, _ in renames})
    new_select = sorted(common | {n for _, n in renames})
    selected_files = sorted({nodeid.split("::", 1)[0] for nodeid in old_select})
    paths = {}
    for side, select in ((old, old_select), (new, new_select)):
        paths[side.name] = os.path.join(directory, f"{side.name}-select.json")
        with open(paths[side.name], "w", encoding="utf-8") as file:
            json.dump(select, file)
    emit(
        {
            "kind": "selection",
            "old": {"checkout": old.checkout, "python": old.python, "collected": len(old_ids)},
            "new": {"checkout": new.checkout, "python": new.python, "collected": len(new_ids)},
            "tests": len(old_select),
            "files": len(selected_files),
            "renamed": [{"old": o, "new": n} for o, n in renames],
            "left_out_old": len(old_ids) - len(old_select),
            "left_out_new": len(new_ids) - len(new_select),
        }
    )

    runs: dict[str, list[dict[str, Any]]] = {"old": [], "new": []}
    for index in range(options.pairs):
        if index and options.seconds is not None and time.monotonic() - began >= options.seconds:
            break
        order = (old, new) if index % 2 == 0 else (new, old)
        for side in order:
            record = run_pytest(side, scratch, selected_files, [], paths[side.name])
            missing = sorted(set(old_select if side is old else new_select) - set(record["tests"]))
            runs[side.name].append(record)
            emit(
                {
                    "kind": "run",
                    "pair": index + 1,
                    "side": side.name,
                    "cpu_s": round(record["cpu_s"], 2),
                    "user_s": round(record["user_s"], 2),
                    "sys_s": round(record["sys_s"], 2),
                    "wall_s": round(record["wall_s"], 2),
                    # The rest of cpu_s: starting pytest, importing and collecting.
                    "in_tests_cpu_s": round(sum(entry["cpu_s"] for entry in record["tests"].values()), 2),
                    "exit": record["exit"],
                    "outcomes": outcomes(record),
                    "failed": sorted(k for k, v in record["tests"].items() if v["outcome"] == "failed"),
                    "not_run": missing[:10],
                    "loadavg_1m": round(os.getloadavg()[0], 2),
                }
            )
            if record["exit"] not in (0, 1) or missing:
                # Not a measurement of the selected tests (a collection error, an interrupted run).
                sys.stderr.write(record["output"][-4000:])
                raise SystemExit(
                    f"{side.name}: pytest exited {record['exit']}, {len(missing)} selected tests not run"
                )
        emit(
            {
                "kind": "pair",
                "pair": index + 1,
                "order": "-".join(side.name for side in order),
                "old_cpu_s": round(runs["old"][-1]["cpu_s"], 2),
                "new_cpu_s": round(runs["new"][-1]["cpu_s"], 2),
                "ratio": round(runs["new"][-1]["cpu_s"] / runs["old"][-1]["cpu_s"], 3),
            }
        )

    def median(side: str, key: str) -> float:
        return float(statistics.median(record[key] for record in runs[side]))

    pair_ratios = [n["cpu_s"] / o["cpu_s"] for o, n in zip(runs["old"], runs["new"], strict=True)]
    emit(
        {
            "kind": "summary",
            "pairs": len(pair_ratios),
            "old_cpu_median_s": round(median("old", "cpu_s"), 2),
            "new_cpu_median_s": round(median("new", "cpu_s"), 2),
            "ratio": round(median("new", "cpu_s") / median("old", "cpu_s"), 3),
            "pair_ratio_median": round(statistics.median(pair_ratios), 3),
            "pair_ratio_min": round(min(pair_ratios), 3),
            "pair_ratio_max": round(max(pair_ratios), 3),
            "old_wall_median_s": round(median("old", "wall_s"), 2),
            "new_wall_median_s": round(median("new", "wall_s"), 2),
        }
    )

    old_files_cpu = [per_file(record) for record in runs["old"]]
    new_files_cpu = [per_file(record) for record in runs["new"]]
    rows = []
    for path in selected_files:
        old_cpu = statistics.median(totals.get(path, 0.0) for totals in old_files_cpu)
        new_cpu = statistics.median(totals.get(path, 0.0) for totals in new_files_cpu)
        rows.append((new_cpu / old_cpu if old_cpu else float("inf"), path, old_cpu, new_cpu))
    for ratio, path, old_cpu, new_cpu in sorted(rows, reverse=True)[: options.worst]:
        emit(
            {
                "kind": "file",
                "file": path,
                "old_cpu_median_s": round(old_cpu, 3),
                "new_cpu_median_s": round(new_cpu, 3),
                "delta_s": round(new_cpu - old_cpu, 3),
                "ratio": round(ratio, 3),
            }
        )


def main() -> None:
    this_checkout = os.path.dirname(HERE)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--old", default=this_checkout, help="the old checkout (default: this one)")
    parser.add_argument("--new", default=this_checkout, help="the new checkout (default: this one)")
    parser.add_argument("--old-python", help="the old side's interpreter (default CHECKOUT/.venv/bin/python)")
    parser.add_argument("--new-python", help="the new side's interpreter (default CHECKOUT/.venv/bin/python)")
    parser.add_argument("--pairs", type=int, default=4, help="old/new run pairs (default 4)")
    parser.add_argument(
        "--files", nargs="*", help="test files or directories (default: the old checkout's suite)"
    )
    parser.add_argument(
        "--worst", type=int, default=10, help="files reported by worst CPU ratio (default 10)"
    )
    parser.add_argument("--dir", help="where the scratch directory goes")
    parser.add_argument("--seconds", type=float, help="stop starting pairs after S seconds (smoke runs)")
    options = parser.parse_args()
    run_in_scratch("aion-suite-time-", options.dir, lambda directory: measure(directory, options), emit)


if __name__ == "__main__":
    main()
