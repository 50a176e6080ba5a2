"""The determinism guard: calls that break replay refused in workflow code, without a sandbox.

Workflow code must not read a clock, draw random numbers, do I/O or start
threads: on replay it would get another answer than the live run did.  The
guard turns such a call into :class:`~aion_trio.NonDeterministicCall`, naming
the safe alternative, at almost no cost:

* a context variable holds the task running workflow code, set by
  :func:`run_workflow_code` while the engine (or the replayer) hands control
  to the code, so activities, query handlers, the engine's other tasks and
  worker threads are never guarded;
* the entry points below are replaced once (:func:`install`) by wrappers
  that return at once unless the calling task is running workflow code;
  then they look up the stack for whom the call is made: a call the engine
  makes on the code's behalf (``ctx.run`` recording a step, the recorder
  reading the clock, a store's I/O) passes an ``aion_trio`` frame before
  reaching the workflow's entry and is let through, a call from the code
  itself (or a library it calls) reaches the entry and is refused.

Module attributes are replaced (``time.time``, ``random.random``,
``uuid.uuid4``, ``trio.sleep``, ``trio.current_time``, ``open``, ...), so a
call through the module is caught wherever the name was looked up.  A name
bound before the guard was installed (``from time import time``,
``from datetime import datetime``) is rebound in each workflow's own module
(``datetime`` becomes a subclass whose ``now``/``utcnow``/``today`` are
guarded and whose instances are plain datetimes).
"""

from __future__ import annotations

import builtins
import contextlib
import contextvars
import datetime as _datetime
import functools
import random
import socket
import sys
import threading
import time
import types
import uuid
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Any, TypeVar

import trio

from ._errors import NonDeterministicCall

T = TypeVar("T")

#: The task running workflow code now (``None`` outside workflow code).
_WORKFLOW_TASK: contextvars.ContextVar[trio.lowlevel.Task | None] = contextvars.ContextVar(
    "aion_trio_workflow_task", default=None
)
#: Callers in these packages are the engine (or a logger) working for the code: let through.
_ENGINE_SIDE = ("aion_trio", "logging")
_NOW = "ctx.now()"
_SLEEP = "ctx.sleep() or ctx.sleep_until()"
_RANDOM = "ctx.random()"
_UUID = "ctx.uuid4()"
_ACTIVITY = "an activity (ctx.run)"

_installed = False
_originals: dict[int, Any] = {}  # id(original) -> its guarded replacement


async def run_workflow_code(fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """``await fn(*args)`` with the guard on for the code (the stack's marker of the workflow's entry)."""
    token = _WORKFLOW_TASK.set(trio.lowlevel.current_task())
    try:
        return await fn(*args)
    finally:
        _WORKFLOW_TASK.reset(token)


_ENTRY = run_workflow_code.__code__


@contextlib.contextmanager
def unsafe_nondeterminism() -> Iterator[None]:
    """``with aion_trio.unsafe_nondeterminism():`` -- workflow code that is known to be safe
    (a clock read only logged, a cache lookup) may make the calls the guard refuses."""
    token = _WORKFLOW_TASK.set(None)
    try:
        yield
    finally:
        _WORKFLOW_TASK.reset(token)


def check(call: str, instead: str) -> None:
    """Raise :class:`NonDeterministicCall` if workflow code itself is making ``call`` now."""
    owner = _WORKFLOW_TASK.get()
    if owner is None:
        return
    try:
        task = trio.lowlevel.current_task()
    except RuntimeError:  # a worker thread: never workflow code
        return
    if task is not owner:
        return  # a task the code's task started (the engine's, or one of its own)
    frame: types.FrameType | None = sys._getframe(2)
    while frame is not None:
        if frame.f_code is _ENTRY:
            raise NonDeterministicCall(call, instead)
        module = frame.f_globals.get("__name__", "")
        if isinstance(module, str) and module.startswith(_ENGINE_SIDE):
            return
        frame = frame.f_back


def _guarded(original: Callable[..., Any], call: str, instead: str) -> Callable[..., Any]:
    @functools.wraps(original)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        if _WORKFLOW_TASK.get() is not None:
            check(call, instead)
        return original(*args, **kwargs)

    guarded.__aion_unguarded__ = original  # type: ignore[attr-defined]
    _originals[id(original)] = guarded
    return guarded


def unguarded(fn: T) -> T:
    """``fn`` itself, not its guarded replacement: for the engine's hot paths (its clock reads),
    which never run as workflow code and so need not pay the guard's check."""
    return getattr(fn, "__aion_unguarded__", fn)


def _patch(owner: Any, name: str, call: str, instead: str) -> None:
    original = getattr(owner, name)
    if id(original) in _originals:
        return
    setattr(owner, name, _guarded(original, call, instead))


class _GuardedDatetimeMeta(type):
    """Instances of the real ``datetime`` count as instances of the guarded one."""

    def __instancecheck__(cls, instance: object) -> bool:
        return isinstance(instance, _datetime.datetime)

    def __subclasscheck__(cls, subclass: type) -> bool:
        return issubclass(subclass, _datetime.datetime)


class GuardedDatetime(_datetime.datetime, metaclass=_GuardedDatetimeMeta):
    """``datetime`` as a workflow module sees it: ``now``, ``utcnow`` and ``today`` are guarded."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        return _datetime.datetime(*args, **kwargs)

    @classmethod
    def now(cls, tz: _datetime.tzinfo | None = None) -> Any:
        if _WORKFLOW_TASK.get() is not None:
            check("datetime.now()", _NOW)
        return _datetime.datetime.now(tz)

    @classmethod
    def utcnow(cls) -> Any:
        if _WORKFLOW_TASK.get() is not None:
            check("datetime.utcnow()", _NOW)
        return _datetime.datetime.utcnow()

    @classmethod
    def today(cls) -> Any:
        if _WORKFLOW_TASK.get() is not None:
            check("datetime.today()", _NOW)
        return _datetime.datetime.today()


GuardedDatetime.__name__ = GuardedDatetime.__qualname__ = "datetime"
GuardedDatetime.__module__ = "datetime"


def _guarded_datetime_module() -> types.ModuleType:
    module = types.ModuleType("datetime", _datetime.__doc__)
    module.__dict__.update({k: v for k, v in vars(_datetime).items() if k not in ("__name__", "__doc__")})
    module.datetime = GuardedDatetime  # type: ignore[attr-defined]
    return module


_GUARDED_DATETIME_MODULE = _guarded_datetime_module()

_RANDOM_FUNCTIONS = (
    "random",
    "uniform",
    "randint",
    "randrange",
    "choice",
    "choices",
    "shuffle",
    "sample",
    "gauss",
    "normalvariate",
    "expovariate",
    "triangular",
    "betavariate",
    "getrandbits",
    "randbytes",
)


def install(workflow_functions: Iterable[Callable[..., Any]] = ()) -> None:
    """Replace the entry points once (idempotent), and rebind the names each workflow's
    module bound to the originals before (``from time import time``, ``from datetime import datetime``)."""
    global _installed
    if not _installed:
        _installed = True
        for name in ("time", "time_ns", "monotonic", "monotonic_ns", "perf_counter", "perf_counter_ns"):
            _patch(time, name, f"time.{name}()", _NOW)
        _patch(trio, "current_time", "trio.current_time()", _NOW)
        _patch(trio, "sleep", "trio.sleep()", _SLEEP)
        _patch(trio, "sleep_until", "trio.sleep_until()", _SLEEP)
        for name in _RANDOM_FUNCTIONS:
            if hasattr(random, name):
                _patch(random, name, f"random.{name}()", _RANDOM)
        _patch(uuid, "uuid1", "uuid.uuid1()", _UUID)
        _patch(uuid, "uuid4", "uuid.uuid4()", _UUID)
        _patch(builtins, "open", "open()", _ACTIVITY)
        _patch(trio, "open_file", "trio.open_file()", _ACTIVITY)
        _patch(socket.socket, "__init__", "a socket", _ACTIVITY)
        _patch(threading.Thread, "start", "starting a thread", _ACTIVITY)
        _patch(trio.to_thread, "run_sync", "trio.to_thread.run_sync()", _ACTIVITY)
    for fn in workflow_functions:
        namespace = getattr(fn, "__globals__", None)
        if isinstance(namespace, dict):
            _rebind(namespace)


def _rebind(namespace: dict[str, Any]) -> None:
    for name, value in list(namespace.items()):
        if value is _datetime.datetime:
            namespace[name] = GuardedDatetime
        elif value is _datetime:
            namespace[name] = _GUARDED_DATETIME_MODULE
        else:
            guarded = _originals.get(id(value))
            if guarded is not None and not isinstance(value, type):
                namespace[name] = guarded
