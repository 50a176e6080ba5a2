"""The engine's logger, shared by its modules."""

from __future__ import annotations

from .._logs import ContextLogger

logger = ContextLogger("aion_trio.engine")
