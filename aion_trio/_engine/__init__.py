"""The engine, as a package: configuration, the core, the client API and ``open_engine``.

Modules import downwards only: ``config`` and ``log`` at the bottom, then the
services (``timers``, ``dispatch``, ``recorders``, ``window``, ``visibility``;
``runner``, ``steps``, ``teardown``; ``recovery``), ``core``, ``describe``,
``client``, and ``wiring`` (``open_engine``, which builds and wires the
services) on top.
This module re-exports the names the rest of ``aion_trio`` imports from the engine.
"""

from __future__ import annotations

from .._commands import IdReusePolicy as IdReusePolicy
from .client import Engine as Engine, RunHandle as RunHandle
from .config import (
    EngineConfig as EngineConfig,
    EngineStatistics as EngineStatistics,
    PendingActivity as PendingActivity,
    WorkflowDescription as WorkflowDescription,
)
from .core import EngineCore as EngineCore
from .describe import describe_history as describe_history
from .queues import QueuedHandle as QueuedHandle
from .schedules import ScheduleDescription as ScheduleDescription, Schedules as Schedules
from .wiring import open_engine as open_engine
