"""The pytest plugin ``bench/suite_time.py`` loads into each measured run (``-p``).

With ``AION_BENCH_SUITE_SELECT`` naming a JSON list of node ids, only those tests
run (the rest are reported as deselected).  With ``AION_BENCH_SUITE_OUT`` naming
a file, it writes there, as JSON, every test that ran (or, under
``--collect-only``, was collected) with its outcome and its CPU time: user +
system of this process and of the children it reaped, over the test's setup,
call and teardown.  Session- and module-scoped fixtures are charged to the
first test that sets them up, so a file's sum is the CPU its tests cost.
Not a script: running it does nothing.
"""

from __future__ import annotations

import json
import os
import resource
from collections.abc import Generator
from typing import Any

import pytest

SELECT_ENV = "AION_BENCH_SUITE_SELECT"
OUT_ENV = "AION_BENCH_SUITE_OUT"


def cpu_seconds() -> float:
    """User + system time of this process and of the children it has reaped."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class SuiteTime:
    def __init__(self, select: set[str] | None, out: str | None) -> None:
        self.select = select
        self.out = out
        self.collected: list[str] = []
        self.tests: dict[str, dict[str, Any]] = {}

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        if self.select is not None:
            kept = [item for item in items if item.nodeid in self.select]
            dropped = [item for item in items if item.nodeid not in self.select]
            if dropped:
                config.hook.pytest_deselected(items=dropped)
            items[:] = kept
        self.collected = [item.nodeid for item in items]

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(
        self, item: pytest.Item, nextitem: pytest.Item | None
    ) -> Generator[None, object, object]:
        began = cpu_seconds()
        try:
            return (yield)
        finally:
            entry = self.tests.setdefault(item.nodeid, {"outcome": "passed", "cpu_s": 0.0})
            entry["cpu_s"] += cpu_seconds() - began

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        entry = self.tests.setdefault(report.nodeid, {"outcome": "passed", "cpu_s": 0.0})
        if report.failed:
            entry["outcome"] = "failed"
        elif report.skipped and entry["outcome"] == "passed":
            # An xfail that failed as expected is reported as skipped with wasxfail.
            entry["outcome"] = "xfailed" if hasattr(report, "wasxfail") else "skipped"

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.out:
            with open(self.out, "w", encoding="utf-8") as file:
                json.dump({"collected": self.collected, "tests": self.tests}, file)


def pytest_configure(config: pytest.Config) -> None:
    select_path = os.environ.get(SELECT_ENV)
    select: set[str] | None = None
    if select_path:
        with open(select_path, encoding="utf-8") as file:
            select = set(json.load(file))
    config.pluginmanager.register(SuiteTime(select, os.environ.get(OUT_ENV)), "aion-bench-suite-time")
