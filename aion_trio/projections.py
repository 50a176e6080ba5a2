"""Projections over event histories: status, settlement, timers, failures.

Pure functions of event lists; usable by store authors and tools without an
engine.
"""

from __future__ import annotations

from ._projections import (
    AttemptRecord as AttemptRecord,
    FailureSummary as FailureSummary,
    OutstandingTimer as OutstandingTimer,
    activity_settled as activity_settled,
    current_lease_terminal as current_lease_terminal,
    failure as failure,
    is_active as is_active,
    is_active_status as is_active_status,
    last_step as last_step,
    latest_run_id as latest_run_id,
    next_delivery_attempt as next_delivery_attempt,
    outstanding_timers as outstanding_timers,
    reset_points as reset_points,
    retry_trail as retry_trail,
    run_ids as run_ids,
    run_segment as run_segment,
    run_status as run_status,
    scheduled_activities as scheduled_activities,
    search_attributes as search_attributes,
    start_event as start_event,
    status_after as status_after,
    timer_resolved as timer_resolved,
    unsettled_activities as unsettled_activities,
    workflow_status as workflow_status,
)
from ._util import fixup_module_metadata as _fixup_module_metadata

_fixup_module_metadata(__name__, globals())
del _fixup_module_metadata
