"""The conformance kit as test classes: each scenario is a visible ``test_<scenario>`` method.

A store author subclasses a suite and gives it the store factory as a pytest
fixture (:class:`EventStoreSuite` shows how); each method runs one scenario
(its body is the scenario function of the same name, in
``_event_scenarios``, ``_visibility_scenarios`` or ``_control_scenarios``).
The classes are the one list of scenarios: the pytest-free checkers
(``check_event_store`` and friends) call these same methods, in this order.

Nothing here imports pytest (so ``aion_trio.testing`` imports without it);
``aion_trio.testing.pytest_plugin`` supplies the fallback fixtures, the marker
and the Trio runner glue.
"""

from __future__ import annotations

from . import (
    _control_scenarios as ctl,
    _event_scenarios as ev,
    _flow_scenarios as fl,
    _visibility_scenarios as vis,
)
from ._kit import OpenKeyedStore, OpenStore, run_scenario


class EventStoreSuite:
    """Every event-store conformance scenario as a ``test_<scenario>`` method.

    Subclass it in a test module named ``Test...``, enable the plugin and
    provide an ``open_event_store`` fixture returning the factory (a
    zero-argument callable returning an async context manager that yields a
    fresh, isolated :class:`~aion_trio.EventStore`, or a ``Store`` bundle)::

        pytest_plugins = ["aion_trio.testing.pytest_plugin"]

        class TestMyEventStore(EventStoreSuite):
            @pytest.fixture
            def open_event_store(self, tmp_path):
                return lambda: open_my_store(tmp_path / f"{uuid.uuid4()}.db")

    The test methods are async: run them with pytest-trio (``trio_mode =
    true``); without pytest-trio the plugin runs them with ``trio.run``.  A
    subclass may override one (to mark it ``xfail``, say); the override is
    then an ordinary test of its own.
    """

    async def test_round_trip_every_event_type(self, open_event_store: OpenStore) -> None:
        await run_scenario("event", ev.round_trip_every_event_type, open_event_store)

    async def test_read_history_ranges(self, open_event_store: OpenStore) -> None:
        await run_scenario("event", ev.read_history_ranges, open_event_store)

    async def test_stale_expected_seq_writes_nothing(self, open_event_store: OpenStore) -> None:
        await run_scenario("event", ev.stale_expected_seq_writes_nothing, open_event_store)

    async def test_ahead_of_head_expected_seq_refused(self, open_event_store: OpenStore) -> None:
        await run_scenario("event", ev.ahead_of_head_expected_seq_refused, open_event_store)

    async def test_invalid_batches_refused(self, open_event_store: OpenStore) -> None:
        await run_scenario("event", ev.invalid_batches_refused, open_event_store)

    async def test_concurrent_appends_one_winner(self, open_event_store: OpenStore) -> None:
        await run_scenario("event", ev.concurrent_appends_one_winner, open_event_store)

    async def test_concurrent_appends_to_many_workflows(self, open_event_store: OpenStore) -> None:
        await run_scenario("event", ev.concurrent_appends_to_many_workflows, open_event_store)

    async def test_large_history(self, open_event_store: OpenStore) -> None:
        await run_scenario("event", ev.large_history, open_event_store)

    async def test_list_active_follows_projection(self, open_event_store: OpenStore) -> None:
        await run_scenario("event", ev.list_active_follows_projection, open_event_store)

    async def test_list_workflow_ids_sorted(self, open_event_store: OpenStore) -> None:
        await run_scenario("event", ev.list_workflow_ids_sorted, open_event_store)

    async def test_timer_due_boundary_inclusive(self, open_event_store: OpenStore) -> None:
        await run_scenario("event", ev.timer_due_boundary_inclusive, open_event_store)

    async def test_timer_reschedule_upserts(self, open_event_store: OpenStore) -> None:
        await run_scenario("event", ev.timer_reschedule_upserts, open_event_store)

    async def test_timer_remove(self, open_event_store: OpenStore) -> None:
        await run_scenario("event", ev.timer_remove, open_event_store)

    async def test_timer_ordering_and_utc(self, open_event_store: OpenStore) -> None:
        await run_scenario("event", ev.timer_ordering_and_utc, open_event_store)

    async def test_every_method_is_a_checkpoint(self, open_event_store: OpenStore) -> None:
        await run_scenario("event", ev.every_method_is_a_checkpoint, open_event_store)

    async def test_use_after_close(self, open_event_store: OpenStore) -> None:
        await run_scenario("event", ev.use_after_close, open_event_store)

    async def test_cancelled_append_is_all_or_nothing(self, open_event_store: OpenStore) -> None:
        await run_scenario("event", ev.cancelled_append_is_all_or_nothing, open_event_store)


class VisibilityStoreSuite:
    """Every visibility-store conformance scenario as a ``test_<scenario>`` method.

    Same use as :class:`EventStoreSuite`, with an ``open_visibility_store``
    fixture whose factory yields a fresh :class:`~aion_trio.VisibilityStore`
    (or a ``Store`` bundle).
    """

    async def test_visibility_upsert_get_round_trip(self, open_visibility_store: OpenStore) -> None:
        await run_scenario("visibility", vis.visibility_upsert_get_round_trip, open_visibility_store)

    async def test_visibility_upsert_replaces(self, open_visibility_store: OpenStore) -> None:
        await run_scenario("visibility", vis.visibility_upsert_replaces, open_visibility_store)

    async def test_visibility_get_unknown_is_none(self, open_visibility_store: OpenStore) -> None:
        await run_scenario("visibility", vis.visibility_get_unknown_is_none, open_visibility_store)

    async def test_visibility_filters_by_field(self, open_visibility_store: OpenStore) -> None:
        await run_scenario("visibility", vis.visibility_filters_by_field, open_visibility_store)

    async def test_visibility_time_ranges_inclusive(self, open_visibility_store: OpenStore) -> None:
        await run_scenario("visibility", vis.visibility_time_ranges_inclusive, open_visibility_store)

    async def test_visibility_search_predicates(self, open_visibility_store: OpenStore) -> None:
        await run_scenario("visibility", vis.visibility_search_predicates, open_visibility_store)

    async def test_visibility_ordering(self, open_visibility_store: OpenStore) -> None:
        await run_scenario("visibility", vis.visibility_ordering, open_visibility_store)

    async def test_visibility_paging(self, open_visibility_store: OpenStore) -> None:
        await run_scenario("visibility", vis.visibility_paging, open_visibility_store)

    async def test_visibility_count_ignores_paging(self, open_visibility_store: OpenStore) -> None:
        await run_scenario("visibility", vis.visibility_count_ignores_paging, open_visibility_store)

    async def test_visibility_values_bound_safely(self, open_visibility_store: OpenStore) -> None:
        await run_scenario("visibility", vis.visibility_values_bound_safely, open_visibility_store)

    async def test_visibility_randomized_against_oracle(self, open_visibility_store: OpenStore) -> None:
        await run_scenario("visibility", vis.visibility_randomized_against_oracle, open_visibility_store)

    async def test_visibility_every_method_is_a_checkpoint(self, open_visibility_store: OpenStore) -> None:
        await run_scenario("visibility", vis.visibility_every_method_is_a_checkpoint, open_visibility_store)

    async def test_visibility_use_after_close(self, open_visibility_store: OpenStore) -> None:
        await run_scenario("visibility", vis.visibility_use_after_close, open_visibility_store)


class OwnedStoreSuite:
    """Every ownership scenario (:data:`~aion_trio.testing.OWNED_STORE_SCENARIOS`) as a
    ``test_<scenario>`` method, for stores with the optional :class:`~aion_trio.OwnedStore`
    capability.

    Provide an ``open_owned_store`` fixture returning a *keyed* factory
    (``factory(key)``: the same key opens the same store again, see
    :func:`~aion_trio.testing.check_owned_store`)::

        class TestMyOwnership(OwnedStoreSuite):
            @pytest.fixture
            def open_owned_store(self, tmp_path):
                return lambda key: aion_trio.open_store(f"mystore:///{tmp_path}/{key}.db")
    """

    async def test_owner_claim_round_trip(self, open_owned_store: OpenKeyedStore) -> None:
        await run_scenario("owner", ctl.owner_claim_round_trip, open_owned_store)

    async def test_owner_live_owner_refuses(self, open_owned_store: OpenKeyedStore) -> None:
        await run_scenario("owner", ctl.owner_live_owner_refuses, open_owned_store)

    async def test_owner_reclaim_by_same_token_refreshes(self, open_owned_store: OpenKeyedStore) -> None:
        await run_scenario("owner", ctl.owner_reclaim_by_same_token_refreshes, open_owned_store)

    async def test_owner_dead_pid_taken_over(self, open_owned_store: OpenKeyedStore) -> None:
        await run_scenario("owner", ctl.owner_dead_pid_taken_over, open_owned_store)

    async def test_owner_stale_heartbeat_taken_over(self, open_owned_store: OpenKeyedStore) -> None:
        await run_scenario("owner", ctl.owner_stale_heartbeat_taken_over, open_owned_store)

    async def test_owner_renew_extends_the_claim(self, open_owned_store: OpenKeyedStore) -> None:
        await run_scenario("owner", ctl.owner_renew_extends_the_claim, open_owned_store)

    async def test_owner_renew_after_takeover_is_not_owner(self, open_owned_store: OpenKeyedStore) -> None:
        await run_scenario("owner", ctl.owner_renew_after_takeover_is_not_owner, open_owned_store)

    async def test_owner_release_frees_the_store(self, open_owned_store: OpenKeyedStore) -> None:
        await run_scenario("owner", ctl.owner_release_frees_the_store, open_owned_store)

    async def test_owner_claim_survives_reopen(self, open_owned_store: OpenKeyedStore) -> None:
        await run_scenario("owner", ctl.owner_claim_survives_reopen, open_owned_store)

    async def test_owner_concurrent_takeover_one_winner(self, open_owned_store: OpenKeyedStore) -> None:
        await run_scenario("owner", ctl.owner_concurrent_takeover_one_winner, open_owned_store)

    async def test_owner_every_method_is_a_checkpoint(self, open_owned_store: OpenKeyedStore) -> None:
        await run_scenario("owner", ctl.owner_every_method_is_a_checkpoint, open_owned_store)

    async def test_owner_use_after_close(self, open_owned_store: OpenKeyedStore) -> None:
        await run_scenario("owner", ctl.owner_use_after_close, open_owned_store)


class CommandInboxSuite:
    """Every command-inbox scenario (:data:`~aion_trio.testing.COMMAND_INBOX_SCENARIOS`)
    as a ``test_<scenario>`` method, with an ``open_command_inbox`` keyed-factory fixture
    (as for :class:`OwnedStoreSuite`)."""

    async def test_inbox_round_trip_every_command_type(self, open_command_inbox: OpenKeyedStore) -> None:
        await run_scenario("inbox", ctl.inbox_round_trip_every_command_type, open_command_inbox)

    async def test_inbox_fifo_order(self, open_command_inbox: OpenKeyedStore) -> None:
        await run_scenario("inbox", ctl.inbox_fifo_order, open_command_inbox)

    async def test_inbox_ack_removes_from_pending(self, open_command_inbox: OpenKeyedStore) -> None:
        await run_scenario("inbox", ctl.inbox_ack_removes_from_pending, open_command_inbox)

    async def test_inbox_outcome_readable(self, open_command_inbox: OpenKeyedStore) -> None:
        await run_scenario("inbox", ctl.inbox_outcome_readable, open_command_inbox)

    async def test_inbox_survives_reopen(self, open_command_inbox: OpenKeyedStore) -> None:
        await run_scenario("inbox", ctl.inbox_survives_reopen, open_command_inbox)

    async def test_inbox_concurrent_enqueues_from_two_handles(
        self, open_command_inbox: OpenKeyedStore
    ) -> None:
        await run_scenario("inbox", ctl.inbox_concurrent_enqueues_from_two_handles, open_command_inbox)

    async def test_inbox_enqueue_once_per_request_id(self, open_command_inbox: OpenKeyedStore) -> None:
        await run_scenario("inbox", ctl.inbox_enqueue_once_per_request_id, open_command_inbox)

    async def test_inbox_every_method_is_a_checkpoint(self, open_command_inbox: OpenKeyedStore) -> None:
        await run_scenario("inbox", ctl.inbox_every_method_is_a_checkpoint, open_command_inbox)

    async def test_inbox_use_after_close(self, open_command_inbox: OpenKeyedStore) -> None:
        await run_scenario("inbox", ctl.inbox_use_after_close, open_command_inbox)


class RecoveryCountsSuite:
    """Every recovery-count scenario (:data:`~aion_trio.testing.RECOVERY_COUNTS_SCENARIOS`)
    as a ``test_<scenario>`` method, with an ``open_recovery_counts`` keyed-factory fixture
    (as for :class:`OwnedStoreSuite`)."""

    async def test_recoveries_count_and_clear(self, open_recovery_counts: OpenKeyedStore) -> None:
        await run_scenario("recoveries", ctl.recoveries_count_and_clear, open_recovery_counts)

    async def test_recoveries_survive_reopen(self, open_recovery_counts: OpenKeyedStore) -> None:
        await run_scenario("recoveries", ctl.recoveries_survive_reopen, open_recovery_counts)

    async def test_recoveries_bad_ids_refused(self, open_recovery_counts: OpenKeyedStore) -> None:
        await run_scenario("recoveries", ctl.recoveries_bad_ids_refused, open_recovery_counts)

    async def test_recoveries_every_method_is_a_checkpoint(
        self, open_recovery_counts: OpenKeyedStore
    ) -> None:
        await run_scenario("recoveries", ctl.recoveries_every_method_is_a_checkpoint, open_recovery_counts)

    async def test_recoveries_use_after_close(self, open_recovery_counts: OpenKeyedStore) -> None:
        await run_scenario("recoveries", ctl.recoveries_use_after_close, open_recovery_counts)


class ScheduleStoreSuite:
    """Every schedule-store scenario (:data:`~aion_trio.testing.SCHEDULE_STORE_SCENARIOS`)
    as a ``test_<scenario>`` method, with an ``open_schedule_store`` keyed-factory fixture
    (as for :class:`OwnedStoreSuite`)."""

    async def test_schedules_create_read_list(self, open_schedule_store: OpenKeyedStore) -> None:
        await run_scenario("schedules", ctl.schedules_create_read_list, open_schedule_store)

    async def test_schedules_duplicate_create_refused(self, open_schedule_store: OpenKeyedStore) -> None:
        await run_scenario("schedules", ctl.schedules_duplicate_create_refused, open_schedule_store)

    async def test_schedules_write_compare_and_set(self, open_schedule_store: OpenKeyedStore) -> None:
        await run_scenario("schedules", ctl.schedules_write_compare_and_set, open_schedule_store)

    async def test_schedules_concurrent_writers_one_wins(self, open_schedule_store: OpenKeyedStore) -> None:
        await run_scenario("schedules", ctl.schedules_concurrent_writers_one_wins, open_schedule_store)

    async def test_schedules_delete(self, open_schedule_store: OpenKeyedStore) -> None:
        await run_scenario("schedules", ctl.schedules_delete, open_schedule_store)

    async def test_schedules_survive_reopen(self, open_schedule_store: OpenKeyedStore) -> None:
        await run_scenario("schedules", ctl.schedules_survive_reopen, open_schedule_store)

    async def test_schedules_bad_input_refused(self, open_schedule_store: OpenKeyedStore) -> None:
        await run_scenario("schedules", ctl.schedules_bad_input_refused, open_schedule_store)

    async def test_schedules_every_method_is_a_checkpoint(self, open_schedule_store: OpenKeyedStore) -> None:
        await run_scenario("schedules", ctl.schedules_every_method_is_a_checkpoint, open_schedule_store)

    async def test_schedules_use_after_close(self, open_schedule_store: OpenKeyedStore) -> None:
        await run_scenario("schedules", ctl.schedules_use_after_close, open_schedule_store)


class FlowStoreSuite:
    """Every flow-store scenario (:data:`~aion_trio.testing.FLOW_STORE_SCENARIOS`) as a
    ``test_<scenario>`` method, with an ``open_flow_store`` keyed-factory fixture (as for
    :class:`OwnedStoreSuite`)."""

    async def test_flow_permits_bound_concurrency(self, open_flow_store: OpenKeyedStore) -> None:
        await run_scenario("flow", fl.flow_permits_bound_concurrency, open_flow_store)

    async def test_flow_permits_expire_and_renew(self, open_flow_store: OpenKeyedStore) -> None:
        await run_scenario("flow", fl.flow_permits_expire_and_renew, open_flow_store)

    async def test_flow_rate_window(self, open_flow_store: OpenKeyedStore) -> None:
        await run_scenario("flow", fl.flow_rate_window, open_flow_store)

    async def test_flow_concurrent_acquirers_respect_the_bound(self, open_flow_store: OpenKeyedStore) -> None:
        await run_scenario("flow", fl.flow_concurrent_acquirers_respect_the_bound, open_flow_store)

    async def test_flow_state_survives_reopen(self, open_flow_store: OpenKeyedStore) -> None:
        await run_scenario("flow", fl.flow_state_survives_reopen, open_flow_store)

    async def test_flow_runs_enqueue_and_dedup(self, open_flow_store: OpenKeyedStore) -> None:
        await run_scenario("flow", fl.flow_runs_enqueue_and_dedup, open_flow_store)

    async def test_flow_runs_admitted_in_order_within_bounds(self, open_flow_store: OpenKeyedStore) -> None:
        await run_scenario("flow", fl.flow_runs_admitted_in_order_within_bounds, open_flow_store)

    async def test_flow_runs_admitted_at_the_rate(self, open_flow_store: OpenKeyedStore) -> None:
        await run_scenario("flow", fl.flow_runs_admitted_at_the_rate, open_flow_store)

    async def test_flow_waiters_recorded_replaced_and_removed(self, open_flow_store: OpenKeyedStore) -> None:
        await run_scenario("flow", fl.flow_waiters_recorded_replaced_and_removed, open_flow_store)

    async def test_flow_waiters_lapse_unless_renewed(self, open_flow_store: OpenKeyedStore) -> None:
        await run_scenario("flow", fl.flow_waiters_lapse_unless_renewed, open_flow_store)

    async def test_flow_every_method_is_a_checkpoint(self, open_flow_store: OpenKeyedStore) -> None:
        await run_scenario("flow", fl.flow_every_method_is_a_checkpoint, open_flow_store)

    async def test_flow_use_after_close(self, open_flow_store: OpenKeyedStore) -> None:
        await run_scenario("flow", fl.flow_use_after_close, open_flow_store)


class BulkHistoryReadsSuite:
    """Every bulk-history-read scenario (:data:`~aion_trio.testing.BULK_HISTORY_READS_SCENARIOS`)
    as a ``test_<scenario>`` method, with an ``open_bulk_history_store`` keyed-factory fixture
    (as for :class:`OwnedStoreSuite`; the store it yields has ``events`` too, to write the
    histories it reads)."""

    async def test_histories_read_many(self, open_bulk_history_store: OpenKeyedStore) -> None:
        await run_scenario("histories", ctl.histories_read_many, open_bulk_history_store)

    async def test_histories_large_batch(self, open_bulk_history_store: OpenKeyedStore) -> None:
        await run_scenario("histories", ctl.histories_large_batch, open_bulk_history_store)

    async def test_histories_bad_ids_refused(self, open_bulk_history_store: OpenKeyedStore) -> None:
        await run_scenario("histories", ctl.histories_bad_ids_refused, open_bulk_history_store)

    async def test_histories_every_method_is_a_checkpoint(
        self, open_bulk_history_store: OpenKeyedStore
    ) -> None:
        await run_scenario("histories", ctl.histories_every_method_is_a_checkpoint, open_bulk_history_store)

    async def test_histories_use_after_close(self, open_bulk_history_store: OpenKeyedStore) -> None:
        await run_scenario("histories", ctl.histories_use_after_close, open_bulk_history_store)


SUITES: dict[type, str] = {
    EventStoreSuite: "open_event_store",
    VisibilityStoreSuite: "open_visibility_store",
    OwnedStoreSuite: "open_owned_store",
    CommandInboxSuite: "open_command_inbox",
    RecoveryCountsSuite: "open_recovery_counts",
    ScheduleStoreSuite: "open_schedule_store",
    FlowStoreSuite: "open_flow_store",
    BulkHistoryReadsSuite: "open_bulk_history_store",
}
"""Each suite and the name of the factory fixture its methods take."""


def scenario_names(suite: type) -> tuple[str, ...]:
    """The scenarios of ``suite``, in the order its methods are defined (and run)."""
    return tuple(name.removeprefix("test_") for name in vars(suite) if name.startswith("test_"))
