"""The public surface and the dependency arrows that must never exist
(docs/architecture.md, "How the layering is enforced").

The exported names are literal lists: changing the surface must change this
file, on purpose, in the same commit.
"""

from __future__ import annotations
import __future__

import ast
import inspect
import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest

import aion_trio
import aion_trio.events
import aion_trio.plugin
import aion_trio.projections

PACKAGE_DIR = Path(aion_trio.__file__).parent
REPO_DIR = Path(__file__).resolve().parent.parent  # not PACKAGE_DIR.parent: tox tests an installed wheel


def public_names(module: types.ModuleType) -> list[str]:
    """Names a user can import: not private, not a submodule, not a ``__future__`` flag."""
    return sorted(
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and not isinstance(value, types.ModuleType)
        and not isinstance(value, __future__._Feature)
    )


# fmt: off
AION_TRIO_NAMES = [
    "ActivityAdvisoryExhausted", "ActivityAttemptClosed", "ActivityAttemptEnded", "ActivityAttemptStarted",
    "ActivityCancelled", "ActivityCommand", "ActivityCompleted", "ActivityDefinition", "ActivityDispatcher",
    "ActivityError", "ActivityFailed", "ActivityFailure", "ActivityFallbackRouted", "ActivityHandle",
    "ActivityInfo", "ActivityOptions", "ActivityOutcome", "ActivityRequest", "ActivityScheduled",
    "ActivityStarted", "ActivityTaskQueues", "AdmissionTimeout", "AesGcmCodec", "AionError",
    "AionInternalError", "AttemptCancelled", "BackendUnavailable", "BulkHistoryReads", "CancelCommand",
    "CannotReopen", "CannotReset", "ChildHandle", "ChildWorkflowCancelled", "ChildWorkflowCompleted",
    "ChildWorkflowFailed", "ChildWorkflowFailure", "ChildWorkflowStarted", "Codec", "CodecChain", "Command",
    "CommandDecodeError", "CommandInbox", "CommandNotAnswered", "CommandOutcome", "CompleteAsync",
    "CompletionRetryConfig", "DatabaseCorrupt", "DatabaseTooNew", "DelegatingDispatcher", "Engine",
    "EngineClock", "EngineConfig", "EngineEpochClosed", "EngineError", "EngineStatistics", "ErrorInfo",
    "Event", "EventBody", "EventDecodeError", "EventStore", "Exponential", "FailureCause", "Fixed",
    "FlowControlUnsupported", "FlowError", "FlowGrant", "FlowLimit", "FlowStore", "FlowWaiter", "IdReusePolicy",
    "InvalidActivityToken", "InvalidArguments", "InvalidBatch", "InvalidHistory", "InvalidQuery",
    "InvalidSchedule", "InvalidStoreUrl", "Linear", "MarkerRecorded", "NoTaskQueues", "NodeInUse",
    "NonDeterminismError", "NonDeterministicCall", "NotAnAionDatabase", "NotFound", "NotOwner", "NotRunning",
    "Observer", "ObserverEvent", "OutcomeKind", "Overlap", "OwnedStore", "OwnerClaim", "OwnerIdentity",
    "ParentClosePolicy", "Payload", "PayloadCodec", "PayloadCodecError", "PayloadDecodeError", "PayloadError",
    "PayloadNotSerializable", "PayloadTooLarge", "PendingActivity", "PendingCommand", "PluginError",
    "PolicyRefused", "PoolStatistics", "QueryCommand", "QueryError", "QueryFailed", "QueryReadOnly",
    "QueryUnavailable", "QueueDeduplicated", "QueuedHandle", "QueuedRun", "RecoveryCounts",
    "RecoveryFinished", "ReopenCommand", "ResetCommand", "RetryPolicy", "RunEvicted", "RunHandle",
    "RunRecovered", "RunReloaded", "RunStart", "RunStuck", "Schedule", "ScheduleAction", "ScheduleActionKind",
    "ScheduleActionRecord",
    "ScheduleAlreadyExists", "ScheduleConflict", "ScheduleDescription", "ScheduleError", "ScheduleNotFound",
    "SchedulePolicy", "ScheduleSpec", "ScheduleState", "ScheduleStore", "Schedules", "SchedulesUnsupported",
    "SearchAttributesUpserted", "SearchOp", "SearchPredicate", "SequenceConflict", "SerializationError",
    "SignalCommand", "SignalReceived", "SignalWithStartCommand", "StartCommand", "Store", "StoreDecodeError",
    "StoreEncodeError", "StoreError", "StoreOpenError", "StoreOperation", "StoreOwned", "StorePathError",
    "StoreSchemeConflict", "StoreTakenOver", "StoredSchedule", "TerminalError", "TerminateCommand", "Timeout",
    "TimeoutKind", "TimeoutScope", "TimerCancelCause", "TimerCancelled", "TimerFired", "TimerHandle",
    "TimerStarted", "TransientRetry", "UnknownActivityType", "UnknownQuery", "UnknownQueue", "UnknownStoreScheme",
    "UnknownWorkflowType", "UpdateAccepted", "UpdateCommand", "UpdateCompleted", "UpdateError", "UpdateFailed",
    "UpdateRejected", "UpdateUnavailable", "VisibilityFilter", "VisibilityRow", "VisibilityStore", "WorkerLost",
    "WorkflowAlreadyStarted", "WorkflowCancelRequested", "WorkflowCancelled", "WorkflowCommandError",
    "WorkflowCompleted", "WorkflowContext", "WorkflowContinuedAsNew", "WorkflowDefinition",
    "WorkflowDescription", "WorkflowFailed", "WorkflowFailure", "WorkflowFenced", "WorkflowNotFound",
    "WorkflowRelinquished", "WorkflowReopened", "WorkflowReset", "WorkflowRunEnded", "WorkflowRunStarted",
    "WorkflowStarted", "WorkflowStatus", "WorkflowTimedOut", "ZlibCodec", "activity", "activity_cancelled",
    "activity_info", "complete_async", "heartbeat", "open_engine", "open_store", "report_heartbeat_details",
    "run_activity_worker", "schedule_tick_time", "unsafe_nondeterminism", "workflow",
]

PLUGIN_NAMES = [
    "ADMITTED", "BackendUnavailable", "BulkHistoryReads", "CancelCommand", "ClusterStore", "Command",
    "CommandDecodeError", "CommandInbox",
    "CommandOutcome", "DISABLE_ENV", "DatabaseCorrupt", "DatabaseTooNew", "ENTRY_POINT_GROUP", "Event",
    "EventBody", "EventDecodeError", "EventStore", "FlowGrant", "FlowStore", "FlowWaiter", "InvalidBatch", "InvalidQuery", "InvalidStoreUrl",
    "NodeInUse", "NotAnAionDatabase", "NotFound", "NotOwner", "OwnedStore", "OwnerClaim", "OwnerIdentity",
    "PendingCommand", "PluginLoadError", "QUEUED", "QueuedRun", "RecoveryCounts", "ReopenCommand", "ResetCommand", "ScheduleAlreadyExists",
    "ScheduleConflict", "ScheduleStore", "SearchOp", "SearchPredicate", "SearchValue", "SequenceConflict",
    "SerializationError", "SignalCommand", "SignalWithStartCommand", "StartCommand", "Store",
    "StoreDecodeError", "StoreEncodeError", "StoreError", "StoreOpenError", "StoreOpener", "StoreOwned",
    "StorePathError", "StoreRegistry", "StoreScheme", "StoreTakenOver", "StoredSchedule", "TerminateCommand",
    "ThreadRenewal", "TimerEntry", "VisibilityFilter", "VisibilityRow", "VisibilityStore", "WorkflowFenced",
    "WorkflowStatus", "body_data_json", "body_from_data_json", "build_registry", "claim_is_live",
    "command_data_json", "command_from_data_json", "decide_claim", "decide_renew", "event_from_json",
    "event_to_json", "events_from_rows", "fenced_write", "format_datetime", "hold_mock_time", "hookimpl",
    "hookspec", "is_active_status", "make_plugin_manager", "outcome_from_json", "outcome_to_json",
    "owner_alive", "parse_datetime", "pid_alive", "process_mark", "rate_window", "redact_url", "signal_recorded_outcome",
    "status_after", "this_host", "validate_batch", "validate_flow_key", "validate_flow_waiter", "validate_schedule_write", "validate_workflow_ids",
]

PROJECTIONS_NAMES = [
    "AttemptRecord", "FailureSummary", "OutstandingTimer", "activity_settled", "current_lease_terminal",
    "failure", "is_active", "is_active_status", "last_step", "latest_run_id", "next_delivery_attempt",
    "outstanding_timers", "reset_points", "retry_trail", "run_ids", "run_segment", "run_status", "scheduled_activities",
    "search_attributes", "start_event", "status_after", "timer_resolved", "unsettled_activities",
    "workflow_status",
]
EVENTS_NAMES = [
    "ActivityAdvisoryExhausted", "ActivityCancelled", "ActivityCompleted", "ActivityError", "ActivityFailed",
    "ActivityFallbackRouted", "ActivityScheduled", "ActivityStarted", "ChildWorkflowCancelled",
    "ChildWorkflowCompleted", "ChildWorkflowFailed", "ChildWorkflowStarted", "ErrorInfo", "Event", "EventBody",
    "FailureCause", "MarkerRecorded", "SearchAttributesUpserted", "SignalReceived", "TimeoutKind",
    "TimerCancelCause", "TimerCancelled", "TimerFired", "TimerStarted", "UpdateAccepted", "UpdateCompleted",
    "WorkflowCancelRequested", "WorkflowCancelled", "WorkflowCompleted", "WorkflowContinuedAsNew",
    "WorkflowFailed", "WorkflowReopened", "WorkflowReset", "WorkflowStarted", "WorkflowStatus",
    "WorkflowTimedOut",
]
# fmt: on


@pytest.mark.parametrize(
    ("module", "expected"),
    [
        (aion_trio, AION_TRIO_NAMES),
        (aion_trio.plugin, PLUGIN_NAMES),
        (aion_trio.projections, PROJECTIONS_NAMES),
        (aion_trio.events, EVENTS_NAMES),
    ],
    ids=["aion_trio", "aion_trio.plugin", "aion_trio.projections", "aion_trio.events"],
)
def test_public_names_are_pinned(module: types.ModuleType, expected: list[str]) -> None:
    assert expected == sorted(expected), "keep the pinned list sorted"
    actual = public_names(module)
    added = sorted(set(actual) - set(expected))
    removed = sorted(set(expected) - set(actual))
    assert (added, removed) == ([], []), f"{module.__name__}: surface changed; update this test on purpose"


def test_version_and_subpackages_are_reachable() -> None:
    assert isinstance(aion_trio.__version__, str)
    assert aion_trio.projections.__name__ == "aion_trio.projections"
    from aion_trio import projections  # explicitly re-exported by aion_trio

    assert projections is aion_trio.projections


def test_public_name_helper_ignores_submodules_and_future_flags() -> None:
    # Control for the helper itself: otherwise the pins above could pass vacuously.
    fake = types.ModuleType("fake")
    exec("from __future__ import annotations\nimport json\nX = 1\n_y = 2\ndef f(): pass\n", vars(fake))
    assert public_names(fake) == ["X", "f"]


def _objects_with_module(module: types.ModuleType) -> list[tuple[str, object]]:
    return [
        (name, value)
        for name in public_names(module)
        # get_origin: on Python 3.10, generic aliases such as Callable[...] pass isclass().
        if (inspect.isclass(value := getattr(module, name)) or inspect.isfunction(value))
        and typing.get_origin(value) is None
    ]


def test_public_classes_and_functions_say_they_live_in_aion_trio() -> None:
    objects = _objects_with_module(aion_trio)
    assert len(objects) > 50
    # Event classes say where they all live: aion_trio.events.
    wrong = {
        name: obj.__module__
        for name, obj in objects
        if obj.__module__ not in ("aion_trio", "aion_trio.events")
    }  # type: ignore[attr-defined]
    assert wrong == {}, (
        "re-exported objects must be fixed up to say aion_trio (see _util.fixup_module_metadata)"
    )
    assert repr(aion_trio.SequenceConflict) == "<class 'aion_trio.SequenceConflict'>"


@pytest.mark.parametrize(
    "module", [aion_trio.plugin, aion_trio.projections, aion_trio.events], ids=lambda m: m.__name__
)
def test_no_public_object_says_it_lives_in_a_private_module(module: types.ModuleType) -> None:
    objects = _objects_with_module(module)
    private = {name: obj.__module__ for name, obj in objects if obj.__module__.startswith("aion_trio._")}  # type: ignore[attr-defined]
    assert private == {}
    allowed = {"aion_trio", "aion_trio.plugin", "aion_trio.projections", "aion_trio.events"}
    assert {obj.__module__ for _, obj in objects} <= allowed  # type: ignore[attr-defined]


def test_methods_of_public_classes_are_fixed_up_too() -> None:
    assert aion_trio.Payload.of.__module__ == "aion_trio"
    assert aion_trio.PayloadCodec.encode.__module__ == "aion_trio"


# --------------------------------------------------------------------------
# Dependency arrows (ast scans, so nothing needs to be imported to check)
# --------------------------------------------------------------------------

DOMAIN_MODEL = {"_ids", "_payload", "_events", "_wire", "_projections"}
#: The error module is a leaf every layer may use; it imports only the stdlib.
DOMAIN_MAY_ALSO_IMPORT = {"_errors"}
THIRD_PARTY_ALLOWED_IN_DOMAIN = {"attrs"}


def imported_modules(source: str, module_name: str, *, is_package: bool = False) -> set[str]:
    """Absolute dotted names ``source`` imports (``from . import x`` resolved against ``module_name``).

    Calls of ``importlib.import_module("...")`` and ``__import__("...")`` with a
    literal name count too.
    """
    package = module_name if is_package else module_name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base = ".".join(base_parts[: len(base_parts) - node.level + 1])
                target = f"{base}.{node.module}" if node.module else base
                if node.module is None:
                    out.update(f"{target}.{alias.name}" for alias in node.names)
                else:
                    out.add(target)
            else:
                assert node.module is not None
                out.add(node.module)
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in ("import_module", "__import__") and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    out.add(arg.value)
    return out


def _module_files() -> dict[str, Path]:
    """Every module of the package by dotted name (``__init__.py`` under its package's name)."""
    files = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = path
    return files


def _imports_of(name: str, path: Path) -> set[str]:
    return imported_modules(path.read_text(encoding="utf-8"), name, is_package=path.name == "__init__.py")


def domain_violations(module_name: str, source: str, allowed_private: set[str]) -> set[str]:
    bad = set()
    for name in imported_modules(source, module_name):
        top = name.split(".")[0]
        if top == "aion_trio":
            parts = name.split(".")
            if len(parts) < 2 or parts[1] not in allowed_private:
                bad.add(name)
        elif top not in sys.stdlib_module_names and top not in THIRD_PARTY_ALLOWED_IN_DOMAIN:
            bad.add(name)
    return bad


def test_the_domain_model_imports_only_itself_the_stdlib_and_attrs() -> None:
    files = _module_files()
    checked = 0
    for short in sorted(DOMAIN_MODEL):
        name = f"aion_trio.{short}"
        source = files[name].read_text(encoding="utf-8")
        assert domain_violations(name, source, DOMAIN_MODEL | DOMAIN_MAY_ALSO_IMPORT) == set(), name
        checked += 1
    assert checked == len(DOMAIN_MODEL)
    errors = files["aion_trio._errors"].read_text(encoding="utf-8")
    assert domain_violations("aion_trio._errors", errors, set()) == set()


def test_the_domain_scan_catches_forbidden_imports() -> None:
    # Control: the checker is not vacuous.
    source = (
        "from __future__ import annotations\n"
        "import json\nimport attrs\n"
        "from ._events import Event\n"
        "from ._store import EventStore\n"
        "from . import _engine\n"
        "import trio\n"
        "import aion_trio._recorder\n"
        "importlib.import_module('aion_trio._context')\n"
    )
    assert domain_violations("aion_trio._wire", source, DOMAIN_MODEL) == {
        "aion_trio._store",
        "aion_trio._engine",
        "trio",
        "aion_trio._recorder",
        "aion_trio._context",
    }


def forbidden_plugin_imports(names: set[str]) -> set[str]:
    """Imports of store plugins or contrib packages: anything named ``aion_trio_*``, or ``plugins``/``contrib``."""
    return {
        n
        for n in names
        if n.split(".")[0].startswith("aion_trio_") or n.split(".")[0] in ("plugins", "contrib")
    }


def test_the_core_never_imports_a_plugin_or_contrib_package() -> None:
    files = _module_files()
    assert "aion_trio._plugins" in files  # the scan sees the whole package
    plugin_packages = {p.name for p in (REPO_DIR / "plugins").iterdir() if p.is_dir()}
    assert {"aion_trio_memory", "aion_trio_sqlite"} <= plugin_packages
    contrib = REPO_DIR / "contrib"
    contrib_packages = (
        {p.name for p in contrib.glob("*/*") if (p / "__init__.py").exists()} if contrib.exists() else set()
    )
    assert all(name.startswith("aion_trio_") for name in plugin_packages | contrib_packages), (
        "plugin and contrib packages are named aion_trio_*, which is what the scan below forbids"
    )
    bad = {}
    for name, path in files.items():
        found = forbidden_plugin_imports(_imports_of(name, path))
        if found:
            bad[name] = sorted(found)
    assert bad == {}


def test_the_plugin_scan_catches_forbidden_imports() -> None:
    source = (
        "import aion_trio_memory\n"
        "from aion_trio_sqlite._store import X\n"
        "import importlib\nimportlib.import_module('aion_trio_postgres')\n"
        "import aion_trio.plugin\n"
        "from .. import _errors\n"
    )
    found = forbidden_plugin_imports(imported_modules(source, "aion_trio.testing._kit"))
    assert found == {"aion_trio_memory", "aion_trio_sqlite._store", "aion_trio_postgres"}


def test_relative_imports_are_resolved() -> None:
    assert imported_modules("from .._errors import X\nfrom . import _kit", "aion_trio.testing._flaky") == {
        "aion_trio._errors",
        "aion_trio.testing._kit",
    }
    assert imported_modules("from ._events import E", "aion_trio._wire") == {"aion_trio._events"}
    assert imported_modules(
        "from ._errors import E\nfrom . import projections", "aion_trio", is_package=True
    ) == {
        "aion_trio._errors",
        "aion_trio.projections",
    }
    files = _module_files()
    assert "aion_trio._errors" in _imports_of("aion_trio", files["aion_trio"])
    assert "aion_trio._urls" in _imports_of("aion_trio.plugin", files["aion_trio.plugin"])


def test_every_exported_error_is_defined_in_the_errors_module() -> None:
    # A command refused on another node is rebuilt as the class the owner named,
    # looked up in aion_trio._errors: an error exported from elsewhere would come back as AionError.
    import aion_trio._errors as errors

    exported = {
        name: value
        for name in public_names(aion_trio)
        if isinstance(value := getattr(aion_trio, name), type) and issubclass(value, aion_trio.AionError)
    }
    assert len(exported) > 20
    assert {name for name, cls in exported.items() if getattr(errors, name, None) is not cls} == set()


def test_importing_the_engine_does_not_import_pytest() -> None:
    # trio.testing imports pytest: about 0.2 s of CPU in every process that imports
    # aion_trio (each CLI call, each engine process) if the engine imported it.
    code = (
        "import sys\n"
        "import aion_trio, aion_trio.events, aion_trio.plugin, aion_trio.projections, aion_trio._cli\n"
        "import aion_trio_memory, aion_trio_sqlite\n"
        "print(sorted(m for m in ('pytest', 'trio.testing') if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == "[]", done.stdout + done.stderr
