"""The visibility rows this engine writes: each built from a workflow's history.

A row is an index for listing and counting, never the truth: history is.  A
row that could not be written is rewritten later (the next refresh, or the
reconciliation at recovery and on cluster sweeps).
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

import attrs
import trio

from .._epoch import EngineEpoch
from .._errors import EngineEpochClosed, StoreError
from .._events import Event, WorkflowFailed, WorkflowStarted, WorkflowStatus
from .._projections import failure, latest_run, search_attributes_of
from .._store import ClusterStore, VisibilityFilter, VisibilityRow, VisibilityStore
from .config import EngineConfig
from .log import logger


def fingerprint(row: VisibilityRow) -> tuple[Any, ...]:
    """Every field of ``row`` as plain values (mappings as sorted pairs, enums as their
    values): equal exactly when the rows are, and, holding no container the cycle
    collector must track, dropped from its watch (a row per running workflow is kept)."""
    return tuple(_plain(getattr(row, name)) for name in _ROW_FIELDS)


_ROW_FIELDS = tuple(field.name for field in attrs.fields(VisibilityRow))
#: Field values that are plain already (most of a row): returned as they are, at once.
_SCALARS = frozenset({str, int, float, bool, type(None), datetime})


def _plain(value: Any) -> Any:
    if type(value) in _SCALARS:
        return value
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Mapping):
        return tuple(sorted((key, _plain(item)) for key, item in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_plain(item) for item in value)
    return value


@attrs.define(eq=False)
class _Refresh:
    """A background visibility refresh of one workflow."""

    again: bool = True
    done: trio.Event = attrs.field(factory=trio.Event)


class VisibilityRows:
    """Builds, writes, refreshes and reconciles this engine's visibility rows."""

    def __init__(
        self,
        *,
        visibility: VisibilityStore,
        epoch: EngineEpoch,
        config: EngineConfig,
        cluster: ClusterStore | None,
        history_of: Callable[[str], Awaitable[Sequence[Event]]],
        stuck_reason: Callable[[str], str | None],
    ) -> None:
        self._visibility = visibility
        self._epoch = epoch
        self._config = config
        #: Cluster mode: the store's node capability (a row another node owns is not ours).
        self._cluster = cluster
        #: A workflow's history for a reader (wakes no evicted run, caches nothing).
        self._history_of = history_of
        self._stuck_reason = stuck_reason
        # Background visibility refreshes in flight, by workflow id.
        self._visibility_owed: dict[str, _Refresh] = {}
        #: The row last written (or found stored) per running workflow, as its
        #: :func:`fingerprint` (no object the collector tracks): an upsert of the
        #: same row again is skipped, so a store that batches its index writes (SQLite's
        #: riders) is not made to wait for a write that changes nothing.  A closed
        #: workflow's entry is dropped (its row is final); a failed write drops it too.
        self._written: dict[str, tuple[Any, ...]] = {}
        #: Whether the rows already stored were read into ``_written`` (once, at the first
        #: upsert: a reopened engine's recovery then rewrites no unchanged row).  Cluster
        #: mode does not: other nodes write rows of the same store.
        self._primed = cluster is not None

    def row(self, workflow_id: str, history: Sequence[Event]) -> VisibilityRow | None:
        latest = latest_run(history)  # one pass over a long history, not one per field
        if latest is None:
            return None
        segment = latest.segment
        start = segment[0]
        assert isinstance(start.body, WorkflowStarted)
        status = latest.status
        terminal = latest.terminal
        # Only a failed run has a failure to summarise (it looks for the terminal again).
        failed = (
            failure(segment) if terminal is not None and isinstance(terminal.body, WorkflowFailed) else None
        )
        return VisibilityRow(
            workflow_id=workflow_id,
            run_id=latest.run_id,
            workflow_type=start.body.workflow_type,
            status=status,
            start_time=start.recorded_at,
            close_time=terminal.recorded_at if terminal is not None else None,
            task_queue=start.body.task_queue,
            failed_step=failed.failed_step if failed else None,
            failure_reason=failed.reason if failed else None,
            search_attributes=search_attributes_of(segment, latest.kinds),
            stuck_reason=self._stuck_reason(workflow_id) if status is WorkflowStatus.RUNNING else None,
        )

    async def upsert(self, workflow_id: str) -> None:
        """Write the workflow's row as its history says, unless it is the row last written."""
        if not self._primed:
            await self.running_rows()
        await self.write(workflow_id, await self._history_of(workflow_id))

    async def write(
        self, workflow_id: str, history: Sequence[Event], *, stored: VisibilityRow | None = None
    ) -> None:
        """Write the row ``history`` gives, unless that very row is already there: ``stored``
        (the caller's fresh read) or else the row this engine last wrote (or found stored).
        Then nothing is written, nor waited for (SQLite's riders)."""
        row = self.row(workflow_id, history)
        if row is None:
            return
        key = fingerprint(row)
        # The row last written or found stored (the sweep's read of the stored rows noted
        # them: no second fingerprint of the same row), else the caller's ``stored``.
        known = self._written.get(workflow_id)
        if known is None and stored is not None:
            known = fingerprint(stored)
        if key == known:
            return
        # Dropped first: a write of unknown outcome leaves nothing remembered.
        self._written.pop(workflow_id, None)
        await self._visibility.upsert(row)
        if row.status is WorkflowStatus.RUNNING and self._cluster is None:
            self._written[workflow_id] = key

    async def running_rows(self) -> dict[str, VisibilityRow] | None:
        """The rows that say Running, by workflow id (one read; ``None`` if it fails).

        Outside cluster mode they are also remembered as written (at most once): a
        reopened engine then rewrites no unchanged row.  Cluster mode remembers none,
        since other nodes write rows of the same store."""
        first = not self._primed
        self._primed = True
        try:
            rows = await self._visibility.list(VisibilityFilter(status=WorkflowStatus.RUNNING))
        except StoreError as exc:
            logger.warning("visibility rows not read (each is rewritten once): %s", exc)
            return None
        if first and self._cluster is None:
            for row in rows:
                self._written.setdefault(row.workflow_id, fingerprint(row))
        return {row.workflow_id: row for row in rows}

    async def upsert_if_changed(
        self, workflow_id: str, history: Sequence[Event], known: VisibilityRow | None
    ) -> None:
        """Recovery: :meth:`write` against ``known`` (the stored row).  Never raises."""
        try:
            await self.write(workflow_id, history, stored=known)
        except StoreError as exc:
            logger.warning(
                "visibility not updated (it is reconciled from history later): %s",
                exc,
                extra={"workflow_id": workflow_id},
            )

    async def upsert_quietly(self, workflow_id: str) -> None:
        try:
            await self.upsert(workflow_id)
        except StoreError as exc:
            logger.warning(
                "visibility not updated (it is reconciled from history later): %s",
                exc,
                extra={"workflow_id": workflow_id},
            )

    async def refresh_soon(self, workflow_id: str) -> None:
        """Refresh the workflow's visibility row in a background task instead of waiting for it.

        One refresh task per workflow at a time (a request while one runs makes
        it go round again, building the row from the history of that moment),
        shielded and bounded like the terminal's bookkeeping, so a closing
        engine still writes it.  The engine's own visibility queries first wait
        for the refreshes owed when they are called (:meth:`settled`).
        If no task can be spawned (the epoch is closing), the refresh runs here.
        """
        owed = self._visibility_owed.get(workflow_id)
        if owed is not None:
            owed.again = True
            return
        try:
            self._epoch.spawn(
                self._refresh,
                workflow_id,
                name=f"visibility:{workflow_id}",
                workflow_id=workflow_id,
            )
        except EngineEpochClosed:
            await self.upsert_quietly(workflow_id)
            return
        self._visibility_owed[workflow_id] = _Refresh()

    async def _refresh(self, workflow_id: str) -> None:
        owed = self._visibility_owed[workflow_id]
        try:
            with trio.CancelScope(shield=True), trio.move_on_after(self._config.bookkeeping_timeout):
                while owed.again:
                    owed.again = False
                    await self.upsert_quietly(workflow_id)
        finally:
            del self._visibility_owed[workflow_id]
            owed.done.set()

    async def settled(self) -> None:
        """Wait for the background visibility refreshes owed now (read-your-writes for queries)."""
        for owed in list(self._visibility_owed.values()):
            await owed.done.wait()

    async def reconcile(self, active: set[str], running: Mapping[str, VisibilityRow] | None = None) -> None:
        """Rows that still say Running for workflows history says are not active are rewritten
        (an engine killed between a terminal and its index update leaves one).  ``running``:
        those rows as already read (by :meth:`running_rows`)."""
        if running is not None:
            rows = list(running.values())
        else:
            try:
                rows = await self._visibility.list(VisibilityFilter(status=WorkflowStatus.RUNNING))
            except StoreError as exc:
                logger.warning("visibility reconciliation skipped: %s", exc)
                return
        for row in rows:
            if row.workflow_id not in active:
                if (
                    self._cluster is not None
                    and await self._cluster.command_target(row.workflow_id) is not None
                ):
                    continue  # another node owns it: its rows are that node's to write
                await self.upsert_quietly(row.workflow_id)
