"""The conformance kit against our stores, in both forms, and the kit's own promises.

* pytest-free: ``check_event_store`` / ``check_visibility_store`` against the
  memory store, the SQLite store and ``FlakyStore`` with nothing armed;
* pytest: ``EventStoreSuite`` / ``VisibilityStoreSuite`` subclasses for the
  same stores (one test per scenario);
* the kit itself: importable without pytest, one source of truth for the
  scenario names, samples that cover every event type and survive the wire,
  actionable errors, and the pytest plugin's behaviour (through pytester).

``tests/test_kit_catches_broken_stores.py`` shows each scenario can fail.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import pickle
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing

import aion_trio
from aion_trio._events import EVENT_TYPES
from aion_trio.plugin import event_from_json, event_to_json
from aion_trio.testing import (
    BULK_HISTORY_READS_SCENARIOS,
    COMMAND_INBOX_SCENARIOS,
    EVENT_STORE_SCENARIOS,
    FLOW_STORE_SCENARIOS,
    OWNED_STORE_SCENARIOS,
    RECOVERY_COUNTS_SCENARIOS,
    SCHEDULE_STORE_SCENARIOS,
    VISIBILITY_STORE_SCENARIOS,
    BulkHistoryReadsSuite,
    CommandInboxSuite,
    ConformanceError,
    EventStoreSuite,
    FlakyStore,
    FlakyStoreBundle,
    FlowStoreSuite,
    OwnedStoreSuite,
    RecoveryCountsSuite,
    ScheduleStoreSuite,
    VisibilityStoreSuite,
    _samples,
    _suite as suite_module,
    check_bulk_history_reads,
    check_command_inbox,
    check_event_store,
    check_flow_store,
    check_owned_store,
    check_recovery_counts,
    check_schedule_store,
    check_visibility_store,
)

pytest_plugins = ["pytester", "aion_trio.testing.pytest_plugin"]

Factory = Callable[[], contextlib.AbstractAsyncContextManager[Any]]


def memory_factory() -> Factory:
    """A fresh private memory store per call (the opener yields a Store bundle)."""
    return lambda: aion_trio.open_store("memory://")


def sqlite_factory(directory: Path) -> Factory:
    """A fresh SQLite file per call under ``directory``."""
    counter = itertools.count()
    return lambda: aion_trio.open_store(f"sqlite:///{directory}/kit-{next(counter)}.db")


def flaky_factory() -> Factory:
    """A FlakyStoreBundle (nothing armed) over a fresh memory store per call."""

    @contextlib.asynccontextmanager
    async def open_flaky() -> AsyncIterator[FlakyStoreBundle]:
        async with aion_trio.open_store("memory://") as inner:
            yield FlakyStoreBundle(inner)

    return open_flaky


def memory_keyed() -> Callable[[str], contextlib.AbstractAsyncContextManager[Any]]:
    """The same key reopens the same named memory store."""
    return lambda key: aion_trio.open_store(f"memory://kit-{key}")


def sqlite_keyed(directory: Path) -> Callable[[str], contextlib.AbstractAsyncContextManager[Any]]:
    """The same key reopens the same SQLite file (several handles: several connections)."""
    return lambda key: aion_trio.open_store(f"sqlite:///{directory}/{key}.db")


# --------------------------------------------------------------------------
# The pytest-free form
# --------------------------------------------------------------------------


async def test_memory_store_passes_the_ownership_and_inbox_checks() -> None:
    await check_owned_store(memory_keyed())
    await check_command_inbox(memory_keyed())
    await check_recovery_counts(memory_keyed())
    await check_schedule_store(memory_keyed())
    await check_flow_store(memory_keyed())
    await check_bulk_history_reads(memory_keyed())


async def test_sqlite_store_passes_the_ownership_and_inbox_checks(tmp_path: Path) -> None:
    await check_owned_store(sqlite_keyed(tmp_path))
    await check_command_inbox(sqlite_keyed(tmp_path))
    await check_recovery_counts(sqlite_keyed(tmp_path))
    await check_schedule_store(sqlite_keyed(tmp_path))
    await check_flow_store(sqlite_keyed(tmp_path))
    await check_bulk_history_reads(sqlite_keyed(tmp_path))


async def test_memory_store_passes_check_event_store() -> None:
    await check_event_store(memory_factory())


async def test_memory_store_passes_check_visibility_store() -> None:
    await check_visibility_store(memory_factory())


async def test_sqlite_store_passes_check_event_store(tmp_path: Path) -> None:
    await check_event_store(sqlite_factory(tmp_path))


async def test_sqlite_store_passes_check_visibility_store(tmp_path: Path) -> None:
    await check_visibility_store(sqlite_factory(tmp_path))


async def test_unarmed_flaky_store_passes_check_event_store() -> None:
    await check_event_store(flaky_factory())


async def test_unarmed_flaky_visibility_store_passes_check_visibility_store() -> None:
    await check_visibility_store(flaky_factory())


async def test_plugin_memory_factories_pass_the_kit(
    memory_event_store_factory: Factory, memory_visibility_store_factory: Factory
) -> None:
    await check_event_store(memory_event_store_factory)
    await check_visibility_store(memory_visibility_store_factory)


async def test_kit_runs_under_an_autojump_clock(autojump_clock: trio.testing.MockClock) -> None:
    # No scenario sleeps or depends on Trio time, so virtual time never moves.
    before = trio.current_time()
    await check_event_store(memory_factory())
    await check_visibility_store(memory_factory())
    assert trio.current_time() == before


async def test_scenarios_select_a_subset_in_the_given_order() -> None:
    ran: list[str] = []

    @contextlib.asynccontextmanager
    async def recording() -> AsyncIterator[Any]:
        async with aion_trio.open_store("memory://") as store:
            ran.append("opened")
            yield store

    await check_event_store(recording, scenarios=["timer_remove", "read_history_ranges"])
    assert ran == ["opened", "opened"]


async def test_unknown_scenario_name_lists_the_known_ones() -> None:
    with pytest.raises(
        ValueError, match=r"unknown event store scenario.*'nope'.*round_trip_every_event_type"
    ):
        await check_event_store(memory_factory(), scenarios=["nope"])
    with pytest.raises(ValueError, match="visibility_ordering"):
        await check_visibility_store(memory_factory(), scenarios=["round_trip_every_event_type"])
    with pytest.raises(TypeError, match="single string"):
        await check_event_store(memory_factory(), scenarios="timer_remove")


async def test_factory_yielding_something_else_is_an_actionable_conformance_error() -> None:
    @contextlib.asynccontextmanager
    async def wrong() -> AsyncIterator[object]:
        yield object()

    with pytest.raises(
        ConformanceError, match=r"neither an EventStore \(it lacks append.*\) nor a Store bundle"
    ):
        await check_event_store(wrong, scenarios=["timer_remove"])
    with pytest.raises(ConformanceError, match="not an async context manager"):
        await check_event_store(lambda: object(), scenarios=["timer_remove"])  # type: ignore[arg-type,return-value]


async def test_unexpected_store_exception_becomes_conformance_error_with_cause() -> None:
    class Exploding:
        def __getattr__(self, name: str) -> Any:
            async def method(*args: Any) -> Any:
                raise RuntimeError(f"{name} exploded")

            return method

    @contextlib.asynccontextmanager
    async def exploding() -> AsyncIterator[Any]:
        yield Exploding()

    with pytest.raises(ConformanceError) as info:
        await check_event_store(exploding, scenarios=["timer_remove"])
    assert info.value.scenario == "timer_remove"
    assert "RuntimeError: schedule_timer exploded" in info.value.detail
    assert isinstance(info.value.__cause__, RuntimeError)


def test_conformance_error_is_an_assertion_error_with_fields() -> None:
    exc = ConformanceError("timer_remove", "observed 1, expected 2")
    assert isinstance(exc, AssertionError)
    assert (exc.scenario, exc.detail) == ("timer_remove", "observed 1, expected 2")
    assert str(exc) == "store conformance scenario 'timer_remove' failed: observed 1, expected 2"
    clone = pickle.loads(pickle.dumps(exc))
    assert (type(clone), clone.scenario, clone.detail) == (ConformanceError, exc.scenario, exc.detail)


# --------------------------------------------------------------------------
# The pytest form
# --------------------------------------------------------------------------


class TestMemoryEventStore(EventStoreSuite):
    @pytest.fixture
    def open_event_store(self) -> Factory:
        return memory_factory()


class TestMemoryVisibilityStore(VisibilityStoreSuite):
    @pytest.fixture
    def open_visibility_store(self) -> Factory:
        return memory_factory()


class TestSqliteEventStore(EventStoreSuite):
    @pytest.fixture
    def open_event_store(self, tmp_path: Path) -> Factory:
        return sqlite_factory(tmp_path)


class TestSqliteVisibilityStore(VisibilityStoreSuite):
    @pytest.fixture
    def open_visibility_store(self, tmp_path: Path) -> Factory:
        return sqlite_factory(tmp_path)


class TestMemoryOwnershipAndInbox(
    OwnedStoreSuite,
    CommandInboxSuite,
    RecoveryCountsSuite,
    ScheduleStoreSuite,
    FlowStoreSuite,
    BulkHistoryReadsSuite,
):
    @pytest.fixture
    def open_owned_store(self) -> Callable[[str], Any]:
        return memory_keyed()

    @pytest.fixture
    def open_flow_store(self) -> Callable[[str], Any]:
        return memory_keyed()

    @pytest.fixture
    def open_bulk_history_store(self) -> Callable[[str], Any]:
        return memory_keyed()

    @pytest.fixture
    def open_schedule_store(self) -> Callable[[str], Any]:
        return memory_keyed()

    @pytest.fixture
    def open_recovery_counts(self) -> Callable[[str], Any]:
        return memory_keyed()

    @pytest.fixture
    def open_command_inbox(self) -> Callable[[str], Any]:
        return memory_keyed()


class TestSqliteOwnershipAndInbox(
    OwnedStoreSuite,
    CommandInboxSuite,
    RecoveryCountsSuite,
    ScheduleStoreSuite,
    FlowStoreSuite,
    BulkHistoryReadsSuite,
):
    @pytest.fixture
    def open_owned_store(self, tmp_path: Path) -> Callable[[str], Any]:
        return sqlite_keyed(tmp_path)

    @pytest.fixture
    def open_flow_store(self, tmp_path: Path) -> Callable[[str], Any]:
        return sqlite_keyed(tmp_path)

    @pytest.fixture
    def open_bulk_history_store(self, tmp_path: Path) -> Callable[[str], Any]:
        return sqlite_keyed(tmp_path)

    @pytest.fixture
    def open_schedule_store(self, tmp_path: Path) -> Callable[[str], Any]:
        return sqlite_keyed(tmp_path)

    @pytest.fixture
    def open_recovery_counts(self, tmp_path: Path) -> Callable[[str], Any]:
        return sqlite_keyed(tmp_path)

    @pytest.fixture
    def open_command_inbox(self, tmp_path: Path) -> Callable[[str], Any]:
        return sqlite_keyed(tmp_path)


class TestFlakyStoreUnarmed(EventStoreSuite, VisibilityStoreSuite):
    """One class can take both mixins: the scenario names never collide."""

    @pytest.fixture
    def open_event_store(self) -> Factory:
        return flaky_factory()

    @pytest.fixture
    def open_visibility_store(self) -> Factory:
        return flaky_factory()


SUITES = [
    (EventStoreSuite, EVENT_STORE_SCENARIOS, "event"),
    (VisibilityStoreSuite, VISIBILITY_STORE_SCENARIOS, "visibility"),
    (OwnedStoreSuite, OWNED_STORE_SCENARIOS, "owner"),
    (CommandInboxSuite, COMMAND_INBOX_SCENARIOS, "inbox"),
    (RecoveryCountsSuite, RECOVERY_COUNTS_SCENARIOS, "recoveries"),
    (ScheduleStoreSuite, SCHEDULE_STORE_SCENARIOS, "schedules"),
    (FlowStoreSuite, FLOW_STORE_SCENARIOS, "flow"),
    (BulkHistoryReadsSuite, BULK_HISTORY_READS_SCENARIOS, "histories"),
]


@pytest.mark.parametrize(("suite", "names", "kind"), SUITES, ids=lambda v: getattr(v, "__name__", "x"))
def test_each_scenario_is_a_method_written_in_its_suite(
    suite: type, names: tuple[str, ...], kind: str
) -> None:
    # The scenario list is the suite's methods, in the order they are written.
    assert names == tuple(n.removeprefix("test_") for n in vars(suite) if n.startswith("test_"))
    module_source = inspect.getsource(suite_module)
    start = module_source.index(f"\nclass {suite.__name__}:")
    end = module_source.find("\nclass ", start + 1)
    source = module_source[start : end if end != -1 else None]
    positions = [source.find(f"\n    async def test_{name}(") for name in names]
    assert -1 not in positions, "every test method is written in the class body"
    assert positions == sorted(positions)


@pytest.mark.parametrize(("suite", "names", "kind"), SUITES, ids=lambda v: getattr(v, "__name__", "x"))
async def test_each_method_runs_the_scenario_it_is_named_after(
    suite: type, names: tuple[str, ...], kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran: list[tuple[str, str, object]] = []

    async def record(kind: str, scenario: Any, open_store: object) -> None:
        ran.append((kind, scenario.__name__, open_store))

    monkeypatch.setattr(suite_module, "run_scenario", record)
    factory = object()
    for name in names:
        await getattr(suite(), f"test_{name}")(factory)
    assert ran == [(kind, name, factory) for name in names]


def test_every_scenario_function_belongs_to_one_suite_and_says_what_it_checks() -> None:
    from aion_trio.testing import _control_scenarios, _event_scenarios, _flow_scenarios, _visibility_scenarios

    functions = {
        name: value
        for module in (_event_scenarios, _visibility_scenarios, _control_scenarios, _flow_scenarios)
        for name, value in vars(module).items()
        if inspect.iscoroutinefunction(value) and not name.startswith("_")
    }
    every = [name for _, names, _ in SUITES for name in names]
    assert len(set(every)) == len(every)
    assert sorted(functions) == sorted(every)
    assert [name for name, f in functions.items() if not (f.__doc__ or "").strip()] == []


def test_scenario_lists_cover_the_brief() -> None:
    assert len(EVENT_STORE_SCENARIOS) >= 15
    assert len(VISIBILITY_STORE_SCENARIOS) >= 12
    assert EVENT_STORE_SCENARIOS[0] == "round_trip_every_event_type"


# --------------------------------------------------------------------------
# Samples
# --------------------------------------------------------------------------


def test_full_samples_cover_every_event_type() -> None:
    assert _samples.missing_types() == []
    assert [type(b).__name__ for b in _samples.full_bodies()] == list(EVENT_TYPES)


def _values(obj: Any) -> list[Any]:
    out = []
    for field in attrs.fields(type(obj)):
        value = getattr(obj, field.name)
        out.append((field.name, value))
        if attrs.has(type(value)) and not isinstance(value, aion_trio.Payload):
            out += [(f"{field.name}.{n}", v) for n, v in _values(value)]
    return out


@pytest.mark.parametrize("body", _samples.full_bodies(), ids=lambda b: type(b).__name__)
def test_full_samples_set_every_field(body: Any) -> None:
    unset = [name for name, value in _values(body) if value is None]
    assert unset == []


@pytest.mark.parametrize(
    "event",
    _samples.batch("wire", 1, [*_samples.full_bodies(), *_samples.minimal_bodies()]),
    ids=lambda e: f"{e.seq}-{e.type}",
)
def test_samples_survive_the_wire_form(event: aion_trio.Event) -> None:
    # The kit never asks for more than a JSON-backed store can give.
    from aion_trio.testing._kit import strict_equal

    again = event_from_json(event_to_json(event))
    assert again == event
    assert strict_equal(again, event)


def test_sample_times_are_far_from_now() -> None:
    assert _samples.BASE_TIME.year >= 2040


# --------------------------------------------------------------------------
# Packaging promises and the pytest plugin
# --------------------------------------------------------------------------


def test_kit_imports_without_pytest() -> None:
    code = textwrap.dedent(
        """
        import sys
        sys.modules["pytest"] = None  # any "import pytest" now fails
        import aion_trio.testing as t
        assert "pytest" not in [m for m in sys.modules if sys.modules[m] is not None]
        print(len(t.EVENT_STORE_SCENARIOS), t.EventStoreSuite.__name__)
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(len(EVENT_STORE_SCENARIOS)), "EventStoreSuite"]


def test_public_names_say_aion_trio_testing() -> None:
    import aion_trio.testing as t

    for name in (
        "ConformanceError",
        "FlakyStore",
        "FlakyStoreBundle",
        "FlakyVisibilityStore",
        "EventStoreSuite",
    ):
        assert getattr(t, name).__module__ == "aion_trio.testing"
    assert check_event_store.__module__ == "aion_trio.testing"
    assert FlakyStore.__doc__
    assert check_visibility_store.__doc__


_INI = """
[pytest]
addopts = -p no:cacheprovider --strict-markers --strict-config
filterwarnings = error
"""

_MODULE_HEAD = """
import contextlib
import pytest
import aion_trio
from aion_trio.testing import EventStoreSuite, VisibilityStoreSuite

pytest_plugins = ["aion_trio.testing.pytest_plugin"]
"""


def _run(pytester: pytest.Pytester, ini: str, body: str, *args: str) -> pytest.RunResult:
    pytester.makeini(ini)
    pytester.makepyfile(test_store=_MODULE_HEAD + textwrap.dedent(body))
    return pytester.runpytest_inprocess(*args)


def test_plugin_runs_a_suite_subclass_in_trio_mode(pytester: pytest.Pytester) -> None:
    result = _run(
        pytester,
        _INI + "trio_mode = true\n",
        """
        class TestMine(EventStoreSuite, VisibilityStoreSuite):
            @pytest.fixture
            def open_event_store(self):
                return lambda: aion_trio.open_store("memory://")

            @pytest.fixture
            def open_visibility_store(self):
                return lambda: aion_trio.open_store("memory://")
        """,
    )
    result.assert_outcomes(passed=len(EVENT_STORE_SCENARIOS) + len(VISIBILITY_STORE_SCENARIOS))


def test_plugin_marks_every_suite_test(pytester: pytest.Pytester) -> None:
    result = _run(
        pytester,
        _INI + "trio_mode = true\n",
        """
        from aion_trio.testing import CommandInboxSuite, OwnedStoreSuite, RecoveryCountsSuite

        class TestMine(EventStoreSuite, OwnedStoreSuite, CommandInboxSuite):
            pass

        class TestRecoveries(RecoveryCountsSuite):  # a suite alone, as a store with only this capability
            pass

        def test_other():
            pass
        """,
        "-m",
        "not aion_trio_conformance",
    )
    every = (
        EVENT_STORE_SCENARIOS + OWNED_STORE_SCENARIOS + COMMAND_INBOX_SCENARIOS + RECOVERY_COUNTS_SCENARIOS
    )
    result.assert_outcomes(passed=1, deselected=len(every))


def test_a_subclass_can_override_one_suite_method(pytester: pytest.Pytester) -> None:
    # The methods are real: an override (here an xfail of a scenario the store does not
    # keep) replaces the kit's test, which is then an ordinary test of the subclass.
    result = _run(
        pytester,
        _INI + "trio_mode = true\n",
        """
        class Reversed:
            def __init__(self, inner):
                self.inner = inner

            def __getattr__(self, name):
                return getattr(self.inner, name)

            async def list_workflow_ids(self):
                return list(reversed(await self.inner.list_workflow_ids()))

        @contextlib.asynccontextmanager
        async def open_reversed():
            async with aion_trio.open_store("memory://") as store:
                yield Reversed(store.events)

        class TestMine(EventStoreSuite):
            @pytest.fixture
            def open_event_store(self):
                return open_reversed

            @pytest.mark.xfail(reason="ids come back newest first", strict=True)
            async def test_list_workflow_ids_sorted(self, open_event_store):
                await super().test_list_workflow_ids_sorted(open_event_store)
        """,
        "-k",
        "list_workflow_ids_sorted or timer_remove",
    )
    result.assert_outcomes(passed=1, xfailed=1)
    result = pytester.runpytest_inprocess(
        "-m", "aion_trio_conformance", "-k", "list_workflow_ids or timer_remove"
    )
    # The override carries no kit marker: only the inherited timer_remove is selected.
    result.assert_outcomes(passed=1, deselected=len(EVENT_STORE_SCENARIOS) - 1)


def test_plugin_runs_suites_without_trio_mode_and_without_pytest_trio(pytester: pytest.Pytester) -> None:
    body = """
        class TestMine(VisibilityStoreSuite):
            @pytest.fixture
            def open_visibility_store(self):
                return lambda: aion_trio.open_store("memory://")

        def test_report_runner(request):
            print("pytest-trio loaded:", request.config.pluginmanager.has_plugin("trio"))
        """
    # trio_mode off: the plugin marks the suite's tests for pytest-trio.
    result = _run(pytester, _INI, body, "-s")
    result.assert_outcomes(passed=len(VISIBILITY_STORE_SCENARIOS) + 1)
    result.stdout.fnmatch_lines(["*pytest-trio loaded: True*"])
    # No pytest-trio at all: the plugin runs them with trio.run itself.
    result = pytester.runpytest_inprocess("-s", "-p", "no:trio")
    result.assert_outcomes(passed=len(VISIBILITY_STORE_SCENARIOS) + 1)
    result.stdout.fnmatch_lines(["*pytest-trio loaded: False*"])


def test_plugin_hands_suites_to_pytest_trio_so_async_fixtures_work(pytester: pytest.Pytester) -> None:
    # trio_mode off, but pytest-trio installed: the plugin marks the suite's
    # tests @pytest.mark.trio, so an async factory fixture is resolved too.
    result = _run(
        pytester,
        _INI,
        """
        class TestMine(EventStoreSuite):
            @pytest.fixture
            async def open_event_store(self):
                import trio
                await trio.lowlevel.checkpoint()
                return lambda: aion_trio.open_store("memory://")
        """,
        "-k",
        "timer_remove or read_history_ranges",
    )
    result.assert_outcomes(passed=2)


def test_plugin_explains_a_missing_factory_fixture(pytester: pytest.Pytester) -> None:
    result = _run(
        pytester,
        _INI + "trio_mode = true\n",
        """
        class TestForgetful(EventStoreSuite):
            pass
        """,
        "-k",
        "timer_remove",
    )
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        [
            "*comes from aion_trio.testing.EventStoreSuite but no 'open_event_store' fixture is defined*",
            "*class TestForgetful(EventStoreSuite):*",
            "*def open_event_store(self, tmp_path):*",
        ]
    )


def test_plugin_reports_a_failing_scenario_by_name(pytester: pytest.Pytester) -> None:
    result = _run(
        pytester,
        _INI + "trio_mode = true\n",
        """
        class Broken:
            def __init__(self, inner):
                self.inner = inner

            def __getattr__(self, name):
                return getattr(self.inner, name)

            async def list_workflow_ids(self):
                return list(reversed(await self.inner.list_workflow_ids()))

        @contextlib.asynccontextmanager
        async def open_broken():
            async with aion_trio.open_store("memory://") as store:
                yield Broken(store.events)

        class TestBroken(EventStoreSuite):
            @pytest.fixture
            def open_event_store(self):
                return open_broken
        """,
        "-k",
        "list_workflow_ids_sorted or timer_remove",
    )
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        ["*ConformanceError: store conformance scenario 'list_workflow_ids_sorted' failed*"]
    )


def test_plugin_flaky_store_fixture(pytester: pytest.Pytester) -> None:
    result = _run(
        pytester,
        _INI + "trio_mode = true\n",
        """
        from aion_trio import BackendUnavailable
        from aion_trio.testing import FlakyStore

        async def test_flaky(flaky_store):
            assert isinstance(flaky_store, FlakyStore)
            flaky_store.fail_next_reads(1)
            with pytest.raises(BackendUnavailable):
                await flaky_store.read_history("x")
            assert await flaky_store.read_history("x") == []
            assert await flaky_store.inner.list_workflow_ids() == []
        """,
    )
    result.assert_outcomes(passed=1)
