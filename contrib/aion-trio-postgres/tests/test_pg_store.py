"""The PostgreSQL store beyond the conformance kit: URLs, migrations, server-side
timeouts, error mapping, cancellation with a worker thread in flight, the
timer rows an append writes, and concurrent visibility upserts.

Waits on the database ("until the append's backend is blocked on our lock")
poll ``pg_stat_activity``: they wait for an observed condition, never for a
guessed amount of time.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator, Sequence
from datetime import datetime, timedelta, timezone
from typing import Any

import aion_trio_postgres
import psycopg
import psycopg.errors
import pytest
import trio
import trio.testing
from aion_trio_postgres import SCHEMA_VERSION, open_postgres_store, parse_postgres_url
from conftest import drop_schema, new_schema_name

import aion_trio
from aion_trio import (
    AionInternalError,
    BackendUnavailable,
    DatabaseCorrupt,
    DatabaseTooNew,
    Event,
    InvalidStoreUrl,
    MarkerRecorded,
    NotAnAionDatabase,
    Payload,
    SerializationError,
    StoreDecodeError,
    StoreEncodeError,
    TimerCancelCause,
    TimerCancelled,
    TimerFired,
    TimerStarted,
)
from aion_trio.plugin import VisibilityRow, WorkflowStatus

T0 = datetime(2030, 1, 1, tzinfo=timezone.utc)


def markers(workflow_id: str, first: int, count: int, tag: str = "m") -> list[Event]:
    return [
        Event(
            workflow_id=workflow_id,
            seq=seq,
            recorded_at=T0 + timedelta(seconds=seq),
            body=MarkerRecorded(name=tag, value=Payload.of(seq)),
        )
        for seq in range(first, first + count)
    ]


def query(url: str, schema: str | None, text: str, params: Any = None) -> list[tuple[Any, ...]]:
    with psycopg.connect(url, autocommit=True) as conn:
        if schema is not None:
            conn.execute("SELECT set_config('search_path', %s, false)", (schema,))
        cur = conn.execute(text, params)
        return cur.fetchall() if cur.description else []


class RowLock:
    """Hold a workflow's row lock from another session (a writer stalled mid-transaction)."""

    def __init__(self, url: str, schema: str, workflow_id: str) -> None:
        self._conn = psycopg.connect(url)
        self._conn.execute("SELECT set_config('search_path', %s, false)", (schema,))
        self._conn.execute("SELECT 1 FROM workflows WHERE workflow_id = %s FOR UPDATE", (workflow_id,))

    @property
    def pid(self) -> int:
        return self._conn.info.backend_pid

    def release(self) -> None:
        if not self._conn.closed:
            self._conn.rollback()
            self._conn.close()


@contextlib.contextmanager
def locked_workflow_row(url: str, schema: str, workflow_id: str) -> Iterator[RowLock]:
    lock = RowLock(url, schema, workflow_id)
    try:
        yield lock
    finally:
        lock.release()


async def wait_for_waiters(url: str, locks: Sequence[RowLock]) -> None:
    """Return once a backend waits on each of ``locks`` (the store's transaction is in flight)."""
    text = "SELECT count(*) FROM pg_stat_activity WHERE %s = ANY (pg_blocking_pids(pid))"
    with trio.fail_after(20):
        for lock in locks:
            # An outside condition (another process's lock queue): polled, no event exists.
            while True:
                if (await trio.to_thread.run_sync(query, url, None, text, (lock.pid,)))[0][0] >= 1:
                    break
                await trio.sleep(0.01)


@pytest.fixture
async def store_and_schema(pg_url: str) -> AsyncIterator[tuple[aion_trio_postgres.PostgresStore, str]]:
    schema = new_schema_name()
    try:
        async with open_postgres_store(f"{pg_url}?schema={schema}&pool_size=2") as store:
            yield store, schema
    finally:
        await trio.to_thread.run_sync(drop_schema, pg_url, schema)


# --------------------------------------------------------------------------
# URLs and registration
# --------------------------------------------------------------------------


def test_url_options_and_defaults() -> None:
    parsed = parse_postgres_url(
        "postgresql://app:s3cret@db.example:6543/prod?schema=aion_x&statement_timeout=2.5"
        "&lock_timeout=0&pool_size=8&node=n-1&lease_ttl=12&sslmode=disable"
    )
    assert (parsed.schema, parsed.statement_timeout, parsed.lock_timeout) == ("aion_x", 2.5, 0.0)
    assert (parsed.pool_size, parsed.node, parsed.lease_ttl) == (8, "n-1", 12.0)
    assert parsed.location == "postgresql://app@db.example:6543/prod (schema aion_x)"
    assert "s3cret" not in repr(parsed)
    assert "sslmode=disable" in parsed.conninfo
    assert "schema" not in parsed.conninfo
    default = parse_postgres_url("postgres://h/db")
    assert (default.schema, default.statement_timeout, default.lock_timeout, default.node) == (
        "aion_trio",
        30.0,
        10.0,
        None,
    )
    assert "connect_timeout=10" in default.conninfo


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("mysql://h/db", "not a postgresql:// URL"),
        ("postgresql://h/db?schema=Bad-Name", "schema='Bad-Name'"),
        ("postgresql://h/db?schema=pg_x", "schema='pg_x'"),
        ("postgresql://h/db?statement_timeout=-1", "statement_timeout='-1'"),
        ("postgresql://h/db?lock_timeout=soon", "lock_timeout='soon'"),
        ("postgresql://h/db?pool_size=0", "pool_size='0'"),
        ("postgresql://h/db?lease_ttl=0", "lease_ttl='0'"),
        ("postgresql://h/db?schema=a&schema=b", "given twice"),
        ("postgresql://h/db?bogus=1", "libpq refuses it"),
        ("postgresql://u:pw@h/", "names no database"),
        ("postgresql://h/db#frag", "#fragment"),
    ],
)
def test_bad_urls_are_refused_with_a_reason(url: str, says: str) -> None:
    with pytest.raises(InvalidStoreUrl, match=None) as info:
        parse_postgres_url(url)
    assert says in str(info.value)
    assert "pw" not in str(info.value)


SECRET = "hunter2"


@pytest.mark.parametrize(
    "url",
    [
        f"postgresql://bob:{SECRET}@h/db?schema=Bad-Name",
        f"postgresql://bob:{SECRET}@h/db?pool_size=0",
        f"postgresql://bob:{SECRET}@h/db?schema=a&schema=b",
        f"postgresql://bob:{SECRET}@h/db?bogus=1",
        f"postgresql://bob:{SECRET}@h/db#frag",
        f"postgresql://bob:{SECRET}@h/",
        f"postgresql://bob@h/db?password={SECRET}&pool_size=0",
        f"postgresql://bob@h/db?sslpassword={SECRET}&lease_ttl=0",
        f"postgresql://bob@h/db?password={SECRET}#frag",
    ],
)
def test_a_refused_url_never_repeats_its_credentials(url: str) -> None:
    # Through the public opener, as a user meets it, and the CLI's error line.
    assert SECRET not in _refusal(url, InvalidStoreUrl)
    result = _cli_list(url)
    assert result.exit_code == 2
    assert "bad store" in result.output
    assert SECRET not in result.output


def test_a_store_that_cannot_be_reached_never_repeats_its_password(caplog: pytest.LogCaptureFixture) -> None:
    # connect_wait: a few retries, each logged, none repeating the password either.
    url = f"postgresql://bob:{SECRET}@127.0.0.1:1/db?connect_timeout=1&pool_timeout=1&connect_wait=0.3"
    assert SECRET not in _refusal(url, aion_trio.StoreError)
    result = _cli_list(url)
    assert result.exit_code == 1
    assert "127.0.0.1" in result.output
    assert SECRET not in result.output
    assert SECRET not in caplog.text


def _refusal(url: str, error: type[Exception]) -> str:
    """The message ``open_store(url)`` refuses ``url`` with (and its causes')."""

    async def go() -> None:
        async with aion_trio.open_store(url):
            pass  # pragma: no cover - refused before

    with pytest.raises(error) as info:
        trio.run(go)
    messages, exc = [], info.value
    while exc is not None:
        messages.append(str(exc))
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return " | ".join(messages)


def _cli_list(url: str) -> Any:
    from click.testing import CliRunner

    from aion_trio import _cli

    return CliRunner().invoke(_cli.cli, ["list", "--store", url], prog_name="aion-trio")


async def test_found_through_the_entry_point_under_both_schemes(pg_url: str) -> None:
    schema = new_schema_name()
    try:
        for head, scheme in enumerate(("postgresql", "postgres")):
            url = pg_url.replace("postgresql://", f"{scheme}://", 1) + f"?schema={schema}"
            async with aion_trio.open_store(url) as store:
                assert isinstance(store, aion_trio_postgres.PostgresStore)
                await store.events.append("wf", markers("wf", head + 1, 1), head)
                assert len(await store.events.read_history("wf")) == head + 1
    finally:
        await trio.to_thread.run_sync(drop_schema, pg_url, schema)


class _BodyError(Exception):
    pass


@pytest.mark.parametrize("node", [None, "n1"])
async def test_an_error_in_the_body_propagates_unwrapped(pg_url: str, node: str | None) -> None:
    schema = new_schema_name()
    try:
        with pytest.raises(_BodyError):
            async with open_postgres_store(f"{pg_url}?schema={schema}", node=node, renew_every=0.5):
                raise _BodyError
    finally:
        await trio.to_thread.run_sync(drop_schema, pg_url, schema)


# --------------------------------------------------------------------------
# Migrations
# --------------------------------------------------------------------------


def _versions(url: str, schema: str) -> list[int]:
    return [r[0] for r in query(url, schema, "SELECT version FROM aion_schema_version ORDER BY version")]


async def test_a_new_schema_is_migrated_and_recorded_once(pg_url: str) -> None:
    schema = new_schema_name()
    try:
        for _ in range(2):
            async with open_postgres_store(f"{pg_url}?schema={schema}"):
                pass
        assert _versions(pg_url, schema) == list(range(1, SCHEMA_VERSION + 1))
    finally:
        drop_schema(pg_url, schema)


async def test_concurrent_first_opens_migrate_exactly_once(pg_url: str) -> None:
    """Several processes' worth of first opens at once: all succeed, each migration applied once."""
    schema = new_schema_name()
    opened: list[int] = []
    url = f"{pg_url}?schema={schema}"
    all_open = trio.Event()
    release = trio.Event()

    async def one() -> None:
        async with open_postgres_store(url) as store:
            opened.append(1)
            if len(opened) == 6:
                all_open.set()
            await release.wait()
            await store.events.list_workflow_ids()

    try:
        async with trio.open_nursery() as nursery:
            for _ in range(6):
                nursery.start_soon(one)
            with trio.fail_after(30):
                await all_open.wait()
            release.set()
        assert _versions(pg_url, schema) == list(range(1, SCHEMA_VERSION + 1))
    finally:
        drop_schema(pg_url, schema)


async def test_a_schema_newer_than_the_code_is_refused_untouched(pg_url: str) -> None:
    schema = new_schema_name()
    try:
        async with open_postgres_store(f"{pg_url}?schema={schema}") as store:
            await store.events.append("wf", markers("wf", 1, 2), 0)
        query(pg_url, schema, "INSERT INTO aion_schema_version (version) VALUES (%s)", (SCHEMA_VERSION + 1,))
        with pytest.raises(DatabaseTooNew) as info:
            async with open_postgres_store(f"{pg_url}?schema={schema}"):
                pass  # pragma: no cover - refused
        assert (info.value.found, info.value.supported) == (SCHEMA_VERSION + 1, SCHEMA_VERSION)
        assert "upgrade aion-trio" in str(info.value)
        assert schema in str(info.value)
        assert _versions(pg_url, schema) == [*range(1, SCHEMA_VERSION + 1), SCHEMA_VERSION + 1]
        assert query(pg_url, schema, "SELECT count(*) FROM events")[0][0] == 2
    finally:
        drop_schema(pg_url, schema)


async def test_another_programs_schema_is_refused_untouched(pg_url: str) -> None:
    schema = new_schema_name()
    query(pg_url, None, f"CREATE SCHEMA {schema}")
    query(pg_url, None, f"CREATE TABLE {schema}.customers (id int)")
    try:
        with pytest.raises(NotAnAionDatabase, match="customers"):
            async with open_postgres_store(f"{pg_url}?schema={schema}"):
                pass  # pragma: no cover - refused
        tables = query(
            pg_url,
            None,
            "SELECT table_name FROM information_schema.tables WHERE table_schema = %s",
            (schema,),
        )
        assert tables == [("customers",)]
    finally:
        drop_schema(pg_url, schema)


# --------------------------------------------------------------------------
# Connection settings, errors, cancellation
# --------------------------------------------------------------------------


async def test_server_side_timeouts_are_set_on_every_connection(pg_url: str) -> None:
    schema = new_schema_name()
    url = f"{pg_url}?schema={schema}&statement_timeout=1.5&lock_timeout=0.25&pool_size=3"
    try:
        async with open_postgres_store(url) as store:
            backend = store._backend

            def settings(_: Any) -> list[tuple[Any, ...]]:
                with backend.pool.connection() as conn:
                    return conn.execute(
                        "SELECT current_setting('statement_timeout'), current_setting('lock_timeout'),"
                        " current_setting('search_path'), current_setting('TimeZone')"
                    ).fetchall()

            seen = await trio.to_thread.run_sync(settings, None)
            assert seen == [("1500ms", "250ms", schema, "UTC")]
    finally:
        drop_schema(pg_url, schema)


async def append_while_locked(
    store: aion_trio_postgres.PostgresStore, lock: RowLock, events: list[Event], expected: int
) -> BaseException | None:
    """Append while ``lock`` is held; release it after 15 s at the latest, so a store that
    waits forever fails the test instead of hanging it."""
    outcome: list[BaseException | None] = []
    done = trio.Event()

    async def attempt() -> None:
        try:
            await store.events.append(events[0].workflow_id, events, expected)
            outcome.append(None)
        except Exception as exc:
            outcome.append(exc)
        done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(attempt)
        with trio.move_on_after(15):
            await done.wait()
        lock.release()
    return outcome[0]


async def test_lock_timeout_surfaces_as_backend_unavailable(pg_url: str) -> None:
    schema = new_schema_name()
    try:
        async with open_postgres_store(f"{pg_url}?schema={schema}&lock_timeout=0.2") as store:
            await store.events.append("wf", markers("wf", 1, 1), 0)
            with locked_workflow_row(pg_url, schema, "wf") as lock:
                error = await append_while_locked(store, lock, markers("wf", 2, 1), 1)
            assert isinstance(error, BackendUnavailable)
            assert "lock_timeout" in str(error)
            assert isinstance(error.__cause__, psycopg.errors.LockNotAvailable)
            assert len(await store.events.read_history("wf")) == 1
    finally:
        drop_schema(pg_url, schema)


async def test_statement_timeout_surfaces_as_backend_unavailable(pg_url: str) -> None:
    schema = new_schema_name()
    try:
        url = f"{pg_url}?schema={schema}&lock_timeout=0&statement_timeout=0.3"
        async with open_postgres_store(url) as store:
            await store.events.append("wf", markers("wf", 1, 1), 0)
            with locked_workflow_row(pg_url, schema, "wf") as lock:
                error = await append_while_locked(store, lock, markers("wf", 2, 1), 1)
            assert isinstance(error, BackendUnavailable)
            assert "statement_timeout" in str(error)
            assert isinstance(error.__cause__, psycopg.errors.QueryCanceled)
            assert len(await store.events.read_history("wf")) == 1
    finally:
        drop_schema(pg_url, schema)


async def test_an_unreachable_server_is_backend_unavailable_with_the_cause() -> None:
    with pytest.raises(BackendUnavailable, match="cannot connect") as info:
        async with open_postgres_store(
            "postgresql://postgres@127.0.0.1:1/test?connect_timeout=2&connect_wait=0"
        ):
            pass  # pragma: no cover - refused
    assert isinstance(info.value.__cause__, psycopg.OperationalError)


async def test_a_table_dropped_under_the_store_is_reported_as_corrupt(
    store_and_schema: tuple[aion_trio_postgres.PostgresStore, str], pg_url: str
) -> None:
    store, schema = store_and_schema
    query(pg_url, schema, "DROP TABLE events CASCADE")
    with pytest.raises(DatabaseCorrupt, match="missing") as info:
        await store.events.read_history("wf")
    assert isinstance(info.value.__cause__, psycopg.errors.UndefinedTable)


async def test_text_postgresql_cannot_hold_is_an_encode_error(
    store_and_schema: tuple[aion_trio_postgres.PostgresStore, str],
) -> None:
    store, _ = store_and_schema
    row = VisibilityRow(
        workflow_id="wf", run_id="r", workflow_type="a\x00b", status=WorkflowStatus.RUNNING, start_time=T0
    )
    with pytest.raises(StoreEncodeError, match=r"cannot encode.*cannot store") as info:
        await store.visibility.upsert(row)
    assert isinstance(info.value, SerializationError)  # the common base still catches it
    assert isinstance(info.value.__cause__, psycopg.DataError)
    assert await store.visibility.count() == 0
    # No stored id can hold NUL, so such an id is simply unknown.
    assert await store.events.read_history("nul\x00id") == []
    assert await store.visibility.get("nul\x00id") is None


async def test_an_event_body_postgresql_cannot_hold_is_an_encode_error_and_writes_nothing(
    store_and_schema: tuple[aion_trio_postgres.PostgresStore, str],
) -> None:
    store, _ = store_and_schema
    bad = [
        Event(
            workflow_id="wf", seq=1, recorded_at=T0, body=MarkerRecorded(name="m\ud800", value=Payload.of(1))
        )
    ]
    caught: list[SerializationError] = []
    try:
        await store.events.append("wf", bad, 0)
    except SerializationError as exc:  # the common base still catches it
        caught.append(exc)
    assert [type(exc) for exc in caught] == [StoreEncodeError]
    assert (caught[0].workflow_id, caught[0].seq) == ("wf", 1)
    assert await store.events.read_history("wf") == []


async def test_a_damaged_event_row_is_a_decode_error(
    store_and_schema: tuple[aion_trio_postgres.PostgresStore, str], pg_url: str
) -> None:
    store, schema = store_and_schema
    await store.events.append("wf", markers("wf", 1, 2), 0)
    query(pg_url, schema, "UPDATE events SET type = 'NoSuchEvent' WHERE workflow_id = 'wf' AND seq = 2")
    with pytest.raises(
        StoreDecodeError, match=r"cannot decode workflow 'wf' seq 2.*unknown event type"
    ) as info:
        await store.events.read_history("wf")
    assert isinstance(info.value, SerializationError)
    assert (info.value.workflow_id, info.value.seq) == ("wf", 2)


async def test_a_cancelled_append_whose_thread_started_finishes_and_returns(
    store_and_schema: tuple[aion_trio_postgres.PostgresStore, str], pg_url: str
) -> None:
    """Cancelled while its transaction waits in the database: the thread is not abandoned,
    the append returns normally with the batch committed, and the cancellation lands at
    the caller's next checkpoint."""
    store, schema = store_and_schema
    await store.events.append("wf", markers("wf", 1, 1), 0)
    outcome: list[str] = []
    scope = trio.CancelScope()

    async def append() -> None:
        with scope:
            await store.events.append("wf", markers("wf", 2, 2), 1)
            outcome.append("returned")
            await trio.lowlevel.checkpoint()
            outcome.append("not cancelled")  # pragma: no cover - the bug this test catches
        if scope.cancelled_caught:
            outcome.append("cancelled at the next checkpoint")

    with locked_workflow_row(pg_url, schema, "wf") as lock:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(append)
            await wait_for_waiters(pg_url, [lock])
            scope.cancel()
            await trio.testing.wait_all_tasks_blocked()
            assert outcome == []  # still waiting for its transaction, not abandoned
            lock.release()  # the nursery now waits for the append to finish
    assert outcome == ["returned", "cancelled at the next checkpoint"]
    assert [e.seq for e in await store.events.read_history("wf")] == [1, 2, 3]


async def test_an_append_cancelled_before_its_thread_started_writes_nothing(
    store_and_schema: tuple[aion_trio_postgres.PostgresStore, str], pg_url: str
) -> None:
    """pool_size=2: two appends stalled in the database hold both worker slots; a third,
    cancelled while waiting for a slot, raises Cancelled and never reaches the database."""
    store, schema = store_and_schema
    for wid in ("a", "b", "c"):
        await store.events.append(wid, markers(wid, 1, 1), 0)
    third: list[str] = []

    async def stalled(wid: str) -> None:
        await store.events.append(wid, markers(wid, 2, 1), 1)

    async def waiting() -> None:
        try:
            await store.events.append("c", markers("c", 2, 1), 1)
        except trio.Cancelled:
            third.append("raised Cancelled")
            raise
        third.append("returned")  # pragma: no cover - the bug this test catches

    with (
        locked_workflow_row(pg_url, schema, "a") as lock_a,
        locked_workflow_row(pg_url, schema, "b") as lock_b,
    ):
        async with trio.open_nursery() as outer:
            # One after the other: started together, the two would share one batch and one slot.
            outer.start_soon(stalled, "a")
            await wait_for_waiters(pg_url, [lock_a])
            outer.start_soon(stalled, "b")
            await wait_for_waiters(pg_url, [lock_a, lock_b])
            assert store._backend.limiter.borrowed_tokens == 2
            async with trio.open_nursery() as inner:
                inner.start_soon(waiting)
                await trio.testing.wait_all_tasks_blocked()
                assert store._backend.limiter.statistics().tasks_waiting == 1
                inner.cancel_scope.cancel()
            assert third == ["raised Cancelled"]
            lock_a.release()
            lock_b.release()
    assert [e.seq for e in await store.events.read_history("c")] == [1]
    assert [e.seq for e in await store.events.read_history("a")] == [1, 2]


# --------------------------------------------------------------------------
# Appends that arrive together: one call, one transaction, each item on its own
# --------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def slot_held(
    store: aion_trio_postgres.PostgresStore, pg_url: str, schema: str, nursery: trio.Nursery
) -> AsyncIterator[RowLock]:
    """Both worker slots of a ``pool_size=2`` store taken by appends stalled on row locks
    ("hold-a", "hold-b"), until the block ends; what is appended meanwhile queues."""
    heads = {}
    for wid in ("hold-a", "hold-b"):
        heads[wid] = len(await store.events.read_history(wid)) + 1
        await store.events.append(wid, markers(wid, heads[wid], 1), heads[wid] - 1)
    with (
        locked_workflow_row(pg_url, schema, "hold-a") as lock_a,
        locked_workflow_row(pg_url, schema, "hold-b") as lock_b,
    ):
        seq = heads["hold-a"]
        nursery.start_soon(store.events.append, "hold-a", markers("hold-a", seq + 1, 1), seq)
        await wait_for_waiters(pg_url, [lock_a])
        seq = heads["hold-b"]
        nursery.start_soon(store.events.append, "hold-b", markers("hold-b", seq + 1, 1), seq)
        await wait_for_waiters(pg_url, [lock_a, lock_b])
        assert store._backend.limiter.borrowed_tokens == 2
        yield lock_a
        lock_a.release()
        lock_b.release()


def log_transactions(pg_url: str, schema: str) -> None:
    """From now on, record the (top-level) transaction that writes each event (a test-only trigger)."""
    for text in (
        "CREATE TABLE test_event_tx (workflow_id text, tx bigint)",
        "CREATE FUNCTION test_event_tx() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
        " INSERT INTO test_event_tx VALUES (NEW.workflow_id, txid_current()); RETURN NULL; END $$",
        "CREATE TRIGGER test_event_tx AFTER INSERT ON events FOR EACH ROW EXECUTE FUNCTION test_event_tx()",
    ):
        query(pg_url, schema, text)


def transactions(pg_url: str, schema: str, workflow_ids: Sequence[str]) -> int:
    """How many transactions wrote the events of ``workflow_ids`` (since :func:`log_transactions`)."""
    text = "SELECT count(DISTINCT tx) FROM test_event_tx WHERE workflow_id = ANY (%s)"
    return int(query(pg_url, schema, text, (list(workflow_ids),))[0][0])


async def test_appends_queued_together_are_written_in_one_transaction_in_call_order(
    store_and_schema: tuple[aion_trio_postgres.PostgresStore, str], pg_url: str
) -> None:
    """With every worker slot busy, appends queue; the next free slot writes them all in one
    call and one transaction, two appends of one workflow in the order they were called."""
    store, schema = store_and_schema
    log_transactions(pg_url, schema)
    ids = [f"q{i}" for i in range(6)]
    async with trio.open_nursery() as nursery, slot_held(store, pg_url, schema, nursery):
        for wid in ids:
            nursery.start_soon(store.events.append, wid, markers(wid, 1, 1), 0)
            await trio.testing.wait_all_tasks_blocked()
        # Called after q0's first append: written after it, in the same transaction.
        nursery.start_soon(store.events.append, "q0", markers("q0", 2, 2), 1)
        await trio.testing.wait_all_tasks_blocked()
        assert store.events._appends.queued() == 7
        batches = store.events._appends.batches
    assert store.events._appends.batches == batches + 1
    assert transactions(pg_url, schema, ids) == 1
    assert [e.seq for e in await store.events.read_history("q0")] == [1, 2, 3]
    for wid in ids[1:]:
        assert [e.seq for e in await store.events.read_history(wid)] == [1]


async def test_a_refused_append_in_a_batch_writes_nothing_and_the_others_commit(
    store_and_schema: tuple[aion_trio_postgres.PostgresStore, str], pg_url: str
) -> None:
    """In one batch: a sequence conflict and an append to a workflow a node owns (fenced for a
    store without a node) are refused with their typed errors and write nothing; the others
    commit, in one transaction."""
    store, schema = store_and_schema
    log_transactions(pg_url, schema)
    await store.events.append("conflict", markers("conflict", 1, 2), 0)
    async with open_postgres_store(f"{pg_url}?schema={schema}&node=owner", renew_every=None) as owner:
        await owner.events.append("owned", markers("owned", 1, 1), 0)
    outcomes: dict[str, BaseException | None] = {}

    async def append(wid: str, expected: int) -> None:
        try:
            await store.events.append(wid, markers(wid, expected + 1, 1, tag="new"), expected)
        except (aion_trio.SequenceConflict, aion_trio.WorkflowFenced) as exc:
            outcomes[wid] = exc
        else:
            outcomes[wid] = None

    async with trio.open_nursery() as nursery, slot_held(store, pg_url, schema, nursery):
        for wid, expected in (("ok-1", 0), ("conflict", 1), ("owned", 1), ("ok-2", 0)):
            nursery.start_soon(append, wid, expected)
            await trio.testing.wait_all_tasks_blocked()
        assert store.events._appends.queued() == 4
    conflict, fenced = outcomes["conflict"], outcomes["owned"]
    assert isinstance(conflict, aion_trio.SequenceConflict)
    assert (conflict.expected, conflict.found) == (1, 2)
    assert isinstance(fenced, aion_trio.WorkflowFenced)
    assert "owned by node owner" in str(fenced)
    assert outcomes["ok-1"] is None
    assert outcomes["ok-2"] is None
    assert transactions(pg_url, schema, ["ok-1", "ok-2"]) == 1
    assert [e.body.name for e in await store.events.read_history("conflict")] == ["m", "m"]
    assert [e.seq for e in await store.events.read_history("owned")] == [1]


async def test_a_batch_the_server_cannot_take_is_written_one_by_one(
    store_and_schema: tuple[aion_trio_postgres.PostgresStore, str], pg_url: str
) -> None:
    """A value no PostgreSQL text can hold fails the whole statement; the batch is then
    written append by append, so only the append holding it gets the encode error."""
    store, schema = store_and_schema
    bad = [
        Event(
            workflow_id="bad", seq=1, recorded_at=T0, body=MarkerRecorded(name="m\ud800", value=Payload.of(1))
        )
    ]
    errors: list[BaseException] = []

    async def append_bad() -> None:
        with pytest.raises(StoreEncodeError) as info:
            await store.events.append("bad", bad, 0)
        errors.append(info.value)

    async with trio.open_nursery() as nursery, slot_held(store, pg_url, schema, nursery):
        nursery.start_soon(store.events.append, "good-1", markers("good-1", 1, 1), 0)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(append_bad)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(store.events.append, "good-2", markers("good-2", 1, 1), 0)
        await trio.testing.wait_all_tasks_blocked()
        assert store.events._appends.queued() == 3
    assert len(errors) == 1
    assert await store.events.read_history("bad") == []
    for wid in ("good-1", "good-2"):
        assert [e.seq for e in await store.events.read_history(wid)] == [1]


@pytest.mark.parametrize("cancelled", ["leader", "follower"])
async def test_a_queued_append_cancelled_before_its_batch_was_taken_writes_nothing(
    store_and_schema: tuple[aion_trio_postgres.PostgresStore, str], pg_url: str, cancelled: str
) -> None:
    """Two appends queue (the first waits for a slot for both, the second behind it); the one
    cancelled raises Cancelled and never reaches the database, the other is written."""
    store, schema = store_and_schema
    names = {"leader": "first", "follower": "second"}
    raised: list[str] = []

    async def append(wid: str) -> None:
        try:
            await store.events.append(wid, markers(wid, 1, 1), 0)
        except trio.Cancelled:
            raised.append(wid)
            raise

    async with trio.open_nursery() as nursery, slot_held(store, pg_url, schema, nursery):
        scopes = {}
        for wid in ("first", "second"):
            scopes[wid] = trio.CancelScope()

            async def run(wid: str = wid) -> None:
                with scopes[wid]:
                    await append(wid)

            nursery.start_soon(run)
            await trio.testing.wait_all_tasks_blocked()
        assert store.events._appends.queued() == 2
        scopes[names[cancelled]].cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert raised == [names[cancelled]]
        assert store.events._appends.queued() == 1
    kept = "second" if cancelled == "leader" else "first"
    assert await store.events.read_history(names[cancelled]) == []
    assert [e.seq for e in await store.events.read_history(kept)] == [1]


async def test_an_append_cancelled_once_its_batch_was_taken_is_written_and_returns(
    store_and_schema: tuple[aion_trio_postgres.PostgresStore, str], pg_url: str
) -> None:
    """A batch in flight (stalled on a row lock): cancelling the caller of an append in it
    (not the one whose task writes the batch) changes nothing until the batch is written;
    the call returns normally and the cancellation arrives at its next checkpoint."""
    store, schema = store_and_schema
    await store.events.append("locked", markers("locked", 1, 1), 0)
    log_transactions(pg_url, schema)
    outcome: list[str] = []
    scope = trio.CancelScope()

    async def member() -> None:
        with scope:
            await store.events.append("member", markers("member", 1, 1), 0)
            outcome.append("returned")
            await trio.lowlevel.checkpoint()
            outcome.append("not cancelled")  # pragma: no cover - the bug this test catches
        if scope.cancelled_caught:
            outcome.append("cancelled at the next checkpoint")

    with locked_workflow_row(pg_url, schema, "locked") as lock:
        async with trio.open_nursery() as nursery, slot_held(store, pg_url, schema, nursery) as held:
            nursery.start_soon(store.events.append, "locked", markers("locked", 2, 1), 1)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(member)
            await trio.testing.wait_all_tasks_blocked()
            assert store.events._appends.queued() == 2
            held.release()  # one slot frees: the batch of both is taken, and stalls on "locked"
            await wait_for_waiters(pg_url, [lock])
            assert store.events._appends.queued() == 0
            scope.cancel()
            await trio.testing.wait_all_tasks_blocked()
            assert outcome == []
            lock.release()
    assert outcome == ["returned", "cancelled at the next checkpoint"]
    assert transactions(pg_url, schema, ["locked", "member"]) == 1
    assert [e.seq for e in await store.events.read_history("member")] == [1]


async def test_visibility_upserts_queued_together_share_one_transaction_each_error_its_own(
    store_and_schema: tuple[aion_trio_postgres.PostgresStore, str], pg_url: str
) -> None:
    """Upserts queued behind busy worker slots are written in one transaction; one holding
    text no PostgreSQL text can hold makes the batch fall back to one by one, and only its
    caller gets the StoreEncodeError."""
    store, schema = store_and_schema

    def row(wid: str, wtype: str = "t") -> VisibilityRow:
        return VisibilityRow(
            workflow_id=wid,
            run_id="r",
            workflow_type=wtype,
            status=WorkflowStatus.RUNNING,
            start_time=T0,
            search_attributes={"k": wid},
        )

    errors: list[BaseException] = []

    async def upsert_bad() -> None:
        with pytest.raises(StoreEncodeError) as info:
            await store.visibility.upsert(row("bad", "a\x00b"))
        errors.append(info.value)

    async with trio.open_nursery() as nursery, slot_held(store, pg_url, schema, nursery):
        for wid in ("v1", "v2", "v3"):
            nursery.start_soon(store.visibility.upsert, row(wid))
            await trio.testing.wait_all_tasks_blocked()
        assert store.visibility._upserts.queued() == 3
        batches = store.visibility._upserts.batches
    assert store.visibility._upserts.batches == batches + 1
    text = "SELECT count(DISTINCT xmin::text) FROM visibility WHERE workflow_id = ANY (%s)"
    assert query(pg_url, schema, text, (["v1", "v2", "v3"],)) == [(1,)]
    async with trio.open_nursery() as nursery, slot_held(store, pg_url, schema, nursery):
        nursery.start_soon(store.visibility.upsert, row("v4"))
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(upsert_bad)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(store.visibility.upsert, row("v5"))
        await trio.testing.wait_all_tasks_blocked()
        assert store.visibility._upserts.queued() == 3
    assert len(errors) == 1
    assert await store.visibility.get("bad") is None
    for wid in ("v1", "v2", "v3", "v4", "v5"):
        found = await store.visibility.get(wid)
        assert found is not None
        assert found.search_attributes == {"k": wid}


async def test_a_node_lease_is_renewed_while_every_worker_slot_is_taken(pg_url: str) -> None:
    """pool_size=2 with a node id: two timer reads stalled in the database (another session
    locks the timers table) hold both worker slots and a third call waits for one; the lease
    renewal does not queue behind them (its own slot and connection), so a node busy with its
    workflows keeps its lease instead of losing them all to a claim."""
    schema = new_schema_name()
    url = f"{pg_url}?schema={schema}&pool_size=2&node=busy&lease_ttl=30"
    try:
        async with open_postgres_store(url, renew_every=None) as store:
            assert store.node is not None
            before = store.node.expires_at
            read: list[int] = []

            async def stalled() -> None:
                read.append(len(await store.events.expired_timers(T0)))

            with psycopg.connect(pg_url) as locker:
                locker.execute("SELECT set_config('search_path', %s, false)", (schema,))
                locker.execute("LOCK TABLE timers IN ACCESS EXCLUSIVE MODE")
                blocked = "SELECT count(*) FROM pg_stat_activity WHERE %s = ANY (pg_blocking_pids(pid))"
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(stalled)
                    nursery.start_soon(stalled)
                    with trio.fail_after(20):
                        # An outside condition (the server's lock queue): polled, no event exists.
                        params = (locker.info.backend_pid,)
                        while True:
                            if (await trio.to_thread.run_sync(query, pg_url, None, blocked, params))[0][
                                0
                            ] >= 2:
                                break
                            await trio.sleep(0.01)
                    nursery.start_soon(stalled)
                    await trio.testing.wait_all_tasks_blocked()
                    assert store._backend.limiter.borrowed_tokens == 2
                    assert store._backend.limiter.statistics().tasks_waiting == 1
                    # Well inside lock_timeout (10 s), which would free a slot otherwise.
                    with trio.fail_after(5):
                        expires = await store.renew_lease()
                    assert expires > before
                    assert store.lease_valid()
                    locker.rollback()
            assert read == [0, 0, 0]
    finally:
        await trio.to_thread.run_sync(drop_schema, pg_url, schema)


# --------------------------------------------------------------------------
# What an append writes besides events
# --------------------------------------------------------------------------


async def test_an_append_writes_and_removes_the_timer_rows_its_events_cause(
    store_and_schema: tuple[aion_trio_postgres.PostgresStore, str],
) -> None:
    store, _ = store_and_schema
    events = store.events
    fire_a, fire_b = T0 + timedelta(hours=1), T0 + timedelta(hours=2)

    def ev(seq: int, body: Any) -> Event:
        return Event(workflow_id="wf", seq=seq, recorded_at=T0, body=body)

    await events.append(
        "wf",
        [
            ev(1, MarkerRecorded(name="m", value=Payload.of(1))),
            ev(2, TimerStarted(timer_id="named:a", fire_at=fire_a)),
            ev(3, TimerStarted(timer_id="named:b", fire_at=fire_b)),
            ev(4, TimerStarted(timer_id="named:c", fire_at=fire_a)),
            ev(5, TimerCancelled(timer_id="named:c", cause=TimerCancelCause.WORKFLOW_INTENT)),
        ],
        0,
    )
    due = await events.expired_timers(fire_b)
    assert [(t.timer_id, t.fire_at) for t in due] == [("named:a", fire_a), ("named:b", fire_b)]
    await events.append("wf", [ev(6, TimerFired(timer_id="named:a"))], 5)
    assert [t.timer_id for t in await events.expired_timers(fire_b)] == ["named:b"]


async def test_events_are_stamped_with_the_epoch_they_were_written_under(
    store_and_schema: tuple[aion_trio_postgres.PostgresStore, str], pg_url: str
) -> None:
    store, schema = store_and_schema
    await store.events.append("wf", markers("wf", 1, 3), 0)
    rows = query(pg_url, schema, "SELECT seq, owner_epoch FROM events ORDER BY seq")
    assert rows == [(1, 0), (2, 0), (3, 0)]
    assert query(pg_url, schema, "SELECT head, owner_node FROM workflows") == [(3, None)]


async def test_concurrent_upserts_of_one_visibility_row_never_collide(
    store_and_schema: tuple[aion_trio_postgres.PostgresStore, str], pg_url: str
) -> None:
    """Racing upserts of one workflow's row from two processes' stores (each store keeps its
    own calls in order, so the race is between stores) all succeed; the search rows left
    are exactly those of the row that won."""
    store, schema = store_and_schema
    errors: list[BaseException] = []

    def row(n: int) -> VisibilityRow:
        return VisibilityRow(
            workflow_id="wf",
            run_id=f"run-{n}",
            workflow_type="t",
            status=WorkflowStatus.RUNNING,
            start_time=T0,
            search_attributes={"n": n, "tags": ("a", "b", str(n))},
        )

    async def upsert(target: aion_trio_postgres.PostgresStore, n: int) -> None:
        try:
            await target.visibility.upsert(row(n))
        except Exception as exc:  # collected: the assertion names them
            errors.append(exc)

    async with (
        open_postgres_store(f"{pg_url}?schema={schema}") as other,
        open_postgres_store(f"{pg_url}?schema={schema}") as third,
    ):
        stores = [store, other, third]
        for _ in range(5):
            async with trio.open_nursery() as nursery:
                for n in range(9):
                    nursery.start_soon(upsert, stores[n % 3], n)
            assert errors == []
            final = await store.visibility.get("wf")
            assert final is not None
            n = int(final.run_id.removeprefix("run-"))
            assert final == row(n)
            search = query(pg_url, schema, "SELECT key, part, num, txt FROM search_attrs ORDER BY key, part")
            assert [(k, p) for k, p, _, _ in search] == [
                ("n", 0),
                ("tags", 0),
                ("tags", 1),
                ("tags", 2),
                ("tags", 3),
            ]
            assert search[0][2] == n
            assert search[4][3] == str(n)


def test_unexpected_errors_are_internal_errors_naming_the_sqlstate() -> None:
    from aion_trio_postgres._mapping import backend_error

    original = psycopg.errors.UniqueViolation("duplicate key")
    mapped = backend_error(original, "somewhere", "writing")
    assert isinstance(mapped, AionInternalError)
    assert mapped.__cause__ is original
    transient = backend_error(psycopg.errors.SerializationFailure("retry"), "somewhere", "writing")
    assert isinstance(transient, BackendUnavailable)
    assert transient.__cause__ is not None


async def test_upserts_of_one_workflow_apply_in_call_order(
    store_and_schema: tuple[aion_trio_postgres.PostgresStore, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine derives each row from the history it holds when it calls upsert, so a
    later upsert must win even when the earlier one's worker thread is slow to run it.
    Fault injection: the first upsert's thread stalls before touching the database."""
    import threading

    from aion_trio_postgres._store import _Backend

    store, _ = store_and_schema
    gate = threading.Event()
    reached = threading.Event()
    original = _Backend._call
    stalled: list[str] = []

    def slow_first_upsert(self: Any, doing: str, function: Any) -> Any:
        if doing == "writing a visibility row" and not stalled:
            stalled.append(doing)
            reached.set()
            gate.wait(timeout=30)
        return original(self, doing, function)

    monkeypatch.setattr(_Backend, "_call", slow_first_upsert)

    def row(status: WorkflowStatus) -> VisibilityRow:
        closed = None if status is WorkflowStatus.RUNNING else T0 + timedelta(seconds=1)
        return VisibilityRow(
            workflow_id="wf", run_id="r", workflow_type="t", status=status, start_time=T0, close_time=closed
        )

    second_done = trio.Event()

    async def second() -> None:
        await store.visibility.upsert(row(WorkflowStatus.COMPLETED))
        second_done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(store.visibility.upsert, row(WorkflowStatus.RUNNING))
        # The first upsert's thread is parked at the gate once `reached` is set.
        assert await trio.to_thread.run_sync(reached.wait, 20)
        nursery.start_soon(second)
        # The second either overtakes (the bug: it finishes while the first is parked)
        # or queues behind the first; wait until one of the two is observed.
        with trio.fail_after(20):
            while True:  # a worker thread's progress: polled, no event exists
                if second_done.is_set() or store.visibility._order.waiting("wf"):
                    break
                await trio.sleep(0.005)
        gate.set()
    got = await store.visibility.get("wf")
    assert got is not None
    assert got.status is WorkflowStatus.COMPLETED


async def test_list_active_matches_the_partial_index(
    store_and_schema: tuple[aion_trio_postgres.PostgresStore, str], pg_url: str
) -> None:
    """The index literal of migration 1 names exactly the statuses the code calls active."""
    from aion_trio.plugin import is_active_status

    _, schema = store_and_schema
    (definition,), *_ = query(
        pg_url,
        None,
        "SELECT indexdef FROM pg_indexes WHERE schemaname = %s AND indexname = 'workflows_active'",
        (schema,),
    )
    for status in WorkflowStatus:
        assert (f"'{status.value}'" in definition) is is_active_status(status), (status, definition)


async def test_a_terminated_connection_is_transient_and_the_pool_recovers(
    store_and_schema: tuple[aion_trio_postgres.PostgresStore, str], pg_url: str
) -> None:
    """pg_terminate_backend on the store's connections: the next call fails with
    BackendUnavailable (the retryable error, cause kept); a retry gets a fresh connection."""
    store, _ = store_and_schema
    await store.events.append("wf", markers("wf", 1, 1), 0)
    backend = store._backend

    def pids(_: Any) -> set[int]:
        with backend.pool.connection() as a, backend.pool.connection() as b:
            return {a.info.backend_pid, b.info.backend_pid}

    victims = await trio.to_thread.run_sync(pids, None)
    terminated = query(
        pg_url, None, "SELECT pg_terminate_backend(pid) FROM unnest(%s::int[]) AS pid", (sorted(victims),)
    )
    assert terminated == [(True,), (True,)]
    with pytest.raises(BackendUnavailable) as info:
        await store.events.read_history("wf")
    assert isinstance(info.value.__cause__, psycopg.OperationalError)
    history: list[Event] = []
    for _ in range(3):  # each dead pooled connection fails one call, then is replaced
        try:
            history = await store.events.read_history("wf")
            break
        except BackendUnavailable:
            continue
    assert [e.seq for e in history] == [1]
    await store.events.append("wf", markers("wf", 2, 1), 1)
