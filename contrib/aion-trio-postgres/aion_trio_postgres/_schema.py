"""The schema: numbered migrations recorded in a version table, connection setup.

Runs in worker threads only (every function here blocks).  Each migration is
one transaction that first takes a transaction-level advisory lock keyed on
the schema name and re-reads the version table under it, so any number of
processes opening a new schema at once apply each migration exactly once.  A
schema that holds tables but no version table belongs to someone else and is
refused before anything is written to it.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql

from aion_trio.plugin import DatabaseTooNew, NotAnAionDatabase, WorkflowStatus, is_active_status

from ._url import PostgresUrl

VERSION_TABLE = "aion_schema_version"
ACTIVE_STATUSES = tuple(s.value for s in WorkflowStatus if is_active_status(s))

# SQLSTATEs the server-side functions raise (class "AI" is not used by PostgreSQL).
SQLSTATE_NOT_OWNER = "AI001"
SQLSTATE_SEQUENCE_CONFLICT = "AI002"

_APPEND_FUNCTION = """
CREATE FUNCTION aion_append(
    p_workflow_id text, p_expected bigint, p_node text, p_incarnation bigint, p_epoch bigint,
    p_recorded_at timestamptz[], p_types text[], p_data text[], p_status text,
    p_timer_ids text[], p_timer_fire_at timestamptz[], p_dropped_timers text[]
) RETURNS bigint LANGUAGE plpgsql AS $fn$
-- One append, all or nothing: the fence, the expected seq, the events, the
-- workflow row and the timer rows the batch causes.  Returns the owner epoch
-- the events were written under.  Raising rolls the whole call back.
DECLARE
    v_head bigint;
    v_owner text;
    v_epoch bigint;
    v_lease timestamptz;
    v_incarnation bigint;
BEGIN
    IF p_node IS NOT NULL THEN
        -- A newer incarnation of this node (the same node id opened again)
        -- fences every older one.  FOR SHARE: a re-registration waits for us.
        SELECT incarnation INTO v_incarnation FROM nodes WHERE node_id = p_node FOR SHARE;
        IF v_incarnation IS DISTINCT FROM p_incarnation THEN
            RAISE EXCEPTION USING ERRCODE = 'AI001',
                MESSAGE = format('node %s incarnation %s has been superseded (current incarnation: %s)',
                                 p_node, p_incarnation, coalesce(v_incarnation::text, 'none'));
        END IF;
    END IF;
    INSERT INTO workflows (workflow_id) VALUES (p_workflow_id) ON CONFLICT (workflow_id) DO NOTHING;
    SELECT head, owner_node, owner_epoch INTO v_head, v_owner, v_epoch
        FROM workflows WHERE workflow_id = p_workflow_id FOR UPDATE;
    IF p_node IS NULL THEN
        IF v_owner IS NOT NULL THEN
            RAISE EXCEPTION USING ERRCODE = 'AI001',
                MESSAGE = format('owned by node %s (epoch %s); a store opened without ?node= may not '
                                 'append to it', v_owner, v_epoch);
        END IF;
    ELSIF p_epoch IS NULL THEN
        -- A claim: free, ours, or held by a node whose lease has run out by
        -- the database clock.  Every claim bumps the fencing epoch.
        IF v_owner IS NOT NULL AND v_owner <> p_node THEN
            SELECT lease_expires_at INTO v_lease FROM nodes WHERE node_id = v_owner;
            IF FOUND AND v_lease > clock_timestamp() THEN
                RAISE EXCEPTION USING ERRCODE = 'AI001',
                    MESSAGE = format('owned by node %s (epoch %s) whose lease runs until %s',
                                     v_owner, v_epoch, v_lease);
            END IF;
        END IF;
        v_owner := p_node;
        v_epoch := v_epoch + 1;
    ELSIF v_owner IS DISTINCT FROM p_node OR v_epoch <> p_epoch THEN
        RAISE EXCEPTION USING ERRCODE = 'AI001',
            MESSAGE = format('now owned by node %s with epoch %s; this node held epoch %s',
                             coalesce(v_owner, '(none)'), v_epoch, p_epoch);
    END IF;
    IF v_head <> p_expected THEN
        RAISE EXCEPTION USING ERRCODE = 'AI002', MESSAGE = 'sequence conflict', DETAIL = v_head::text;
    END IF;
    INSERT INTO events (workflow_id, seq, recorded_at, type, data, owner_epoch)
        SELECT p_workflow_id, p_expected + e.n, e.recorded_at, e.type, e.data, v_epoch
        FROM unnest(p_recorded_at, p_types, p_data) WITH ORDINALITY AS e (recorded_at, type, data, n);
    UPDATE workflows
        SET head = p_expected + cardinality(p_types), status = coalesce(p_status, status),
            owner_node = v_owner, owner_epoch = v_epoch
        WHERE workflow_id = p_workflow_id;
    IF cardinality(p_dropped_timers) > 0 THEN
        DELETE FROM timers WHERE workflow_id = p_workflow_id AND timer_id = ANY (p_dropped_timers);
    END IF;
    IF cardinality(p_timer_ids) > 0 THEN
        INSERT INTO timers (workflow_id, timer_id, fire_at)
            SELECT p_workflow_id, t.timer_id, t.fire_at FROM unnest(p_timer_ids, p_timer_fire_at) AS t (timer_id, fire_at)
            ON CONFLICT (workflow_id, timer_id) DO UPDATE SET fire_at = excluded.fire_at;
    END IF;
    RETURN v_epoch;
END
$fn$
"""

_CLAIM_FUNCTION = """
CREATE FUNCTION aion_claim(p_workflow_id text, p_node text, p_incarnation bigint)
RETURNS bigint LANGUAGE plpgsql AS $fn$
-- An explicit claim (no events): the same rules as a claiming append.
DECLARE
    v_owner text;
    v_epoch bigint;
    v_lease timestamptz;
    v_incarnation bigint;
BEGIN
    SELECT incarnation INTO v_incarnation FROM nodes WHERE node_id = p_node FOR SHARE;
    IF v_incarnation IS DISTINCT FROM p_incarnation THEN
        RAISE EXCEPTION USING ERRCODE = 'AI001',
            MESSAGE = format('node %s incarnation %s has been superseded (current incarnation: %s)',
                             p_node, p_incarnation, coalesce(v_incarnation::text, 'none'));
    END IF;
    INSERT INTO workflows (workflow_id) VALUES (p_workflow_id) ON CONFLICT (workflow_id) DO NOTHING;
    SELECT owner_node, owner_epoch INTO v_owner, v_epoch
        FROM workflows WHERE workflow_id = p_workflow_id FOR UPDATE;
    IF v_owner IS NOT NULL AND v_owner <> p_node THEN
        SELECT lease_expires_at INTO v_lease FROM nodes WHERE node_id = v_owner;
        IF FOUND AND v_lease > clock_timestamp() THEN
            RAISE EXCEPTION USING ERRCODE = 'AI001',
                MESSAGE = format('owned by node %s (epoch %s) whose lease runs until %s',
                                 v_owner, v_epoch, v_lease);
        END IF;
    END IF;
    UPDATE workflows SET owner_node = p_node, owner_epoch = v_epoch + 1 WHERE workflow_id = p_workflow_id;
    RETURN v_epoch + 1;
END
$fn$
"""

_APPEND_BATCH_FUNCTION = """
CREATE FUNCTION aion_append_batch(
    p_node text, p_incarnation bigint,
    p_workflow_ids text[], p_expected bigint[], p_epochs bigint[], p_statuses text[],
    p_event_ends integer[], p_recorded_at timestamptz[], p_types text[], p_data text[],
    p_timer_ends integer[], p_timer_ids text[], p_timer_fire_at timestamptz[],
    p_dropped_ends integer[], p_dropped_timers text[]
) RETURNS TABLE (epoch bigint, state text, message text, detail text) LANGUAGE plpgsql AS $fn$
-- Several appends in one transaction (one round trip, one commit), each all or
-- nothing on its own: item i is aion_append of its slice of the flat arrays
-- (events p_event_ends[i-1]+1 .. p_event_ends[i], likewise the timers), run in a
-- subtransaction, so a refused item (fenced, sequence conflict) writes nothing
-- and the others commit.  One row per item, in order: the epoch, or the error.
DECLARE
    e0 integer := 0;
    t0 integer := 0;
    d0 integer := 0;
BEGIN
    FOR i IN 1 .. coalesce(cardinality(p_workflow_ids), 0) LOOP
        BEGIN
            epoch := aion_append(
                p_workflow_ids[i], p_expected[i], p_node, p_incarnation, p_epochs[i],
                p_recorded_at[e0 + 1 : p_event_ends[i]], p_types[e0 + 1 : p_event_ends[i]],
                p_data[e0 + 1 : p_event_ends[i]], p_statuses[i],
                p_timer_ids[t0 + 1 : p_timer_ends[i]], p_timer_fire_at[t0 + 1 : p_timer_ends[i]],
                p_dropped_timers[d0 + 1 : p_dropped_ends[i]]);
            state := NULL;
            message := NULL;
            detail := NULL;
        EXCEPTION WHEN OTHERS THEN
            GET STACKED DIAGNOSTICS state = RETURNED_SQLSTATE, message = MESSAGE_TEXT,
                detail = PG_EXCEPTION_DETAIL;
            epoch := NULL;
        END;
        RETURN NEXT;
        e0 := p_event_ends[i];
        t0 := p_timer_ends[i];
        d0 := p_dropped_ends[i];
    END LOOP;
END
$fn$
"""

ACTIVE_LIST = ", ".join(f"'{s}'" for s in ACTIVE_STATUSES)
"""The active statuses as SQL text: code constants (never user values)."""

MIGRATIONS: tuple[tuple[str, ...], ...] = (
    # 1: the initial schema.  Text that is sorted (ids) uses the "C" collation:
    # code-point order whatever the database's default collation says.
    (
        "CREATE TABLE nodes ("
        ' node_id text COLLATE "C" PRIMARY KEY, incarnation bigint NOT NULL,'
        " lease_expires_at timestamptz NOT NULL, started_at timestamptz NOT NULL,"
        " renewed_at timestamptz NOT NULL)",
        # head: the last seq (0 until the first append commits).  A row with
        # head 0 only exists for an explicit claim of a workflow without events.
        "CREATE TABLE workflows ("
        ' workflow_id text COLLATE "C" PRIMARY KEY, head bigint NOT NULL DEFAULT 0, status text,'
        ' owner_node text COLLATE "C", owner_epoch bigint NOT NULL DEFAULT 0)',
        # Literal on purpose: a migration never changes once released.  list_active
        # computes its status list from the code (ACTIVE_LIST); while the two agree
        # the planner uses this index.
        "CREATE INDEX workflows_active ON workflows (workflow_id) WHERE status IN ('running', 'continued_as_new')",
        "CREATE INDEX workflows_by_owner ON workflows (owner_node, workflow_id)",
        # owner_epoch per event: the fencing epoch it was written under, so
        # "epochs never decrease along a history" can be checked in SQL.
        "CREATE TABLE events ("
        ' workflow_id text COLLATE "C" NOT NULL, seq bigint NOT NULL, recorded_at timestamptz NOT NULL,'
        " type text NOT NULL, data text NOT NULL, owner_epoch bigint NOT NULL,"
        " PRIMARY KEY (workflow_id, seq))",
        "CREATE TABLE timers ("
        ' workflow_id text COLLATE "C" NOT NULL, timer_id text COLLATE "C" NOT NULL,'
        " fire_at timestamptz NOT NULL, PRIMARY KEY (workflow_id, timer_id))",
        "CREATE INDEX timers_by_fire_at ON timers (fire_at, workflow_id, timer_id)",
        "CREATE TABLE visibility ("
        ' workflow_id text COLLATE "C" PRIMARY KEY, run_id text NOT NULL, workflow_type text NOT NULL,'
        " status text NOT NULL, start_time timestamptz NOT NULL, close_time timestamptz,"
        " task_queue text NOT NULL, failed_step text, failure_reason text, stuck_reason text,"
        " search_attributes text NOT NULL)",
        "CREATE INDEX visibility_by_start ON visibility (start_time, workflow_id)",
        "CREATE INDEX visibility_by_type ON visibility (workflow_type, start_time)",
        # One row per attribute (part 0) plus one per element of a list value
        # (parts 1..n, kind 'elem').  Numbers are exact numerics: ints of any
        # size and floats (as their exact binary value) compare as Python does.
        "CREATE TABLE search_attrs ("
        ' workflow_id text COLLATE "C" NOT NULL, key text COLLATE "C" NOT NULL, part integer NOT NULL,'
        ' kind text NOT NULL, num numeric, txt text COLLATE "C",'
        " PRIMARY KEY (workflow_id, key, part))",
        "CREATE INDEX search_attrs_by_num ON search_attrs (key, kind, num)",
        "CREATE INDEX search_attrs_by_txt ON search_attrs (key, kind, txt)",
        _APPEND_FUNCTION,
        _CLAIM_FUNCTION,
    ),
    # 2: cluster mode's command inbox.  A command for a workflow another node
    # owns waits here until that node (or the next one to claim the workflow)
    # applies it; acked rows keep their outcome for the sender.
    (
        "CREATE TABLE inbox ("
        ' id bigserial PRIMARY KEY, workflow_id text COLLATE "C" NOT NULL, type text NOT NULL,'
        " data text NOT NULL, enqueued_at timestamptz NOT NULL DEFAULT clock_timestamp(),"
        " outcome text, acked boolean NOT NULL DEFAULT false)",
        "CREATE INDEX inbox_pending ON inbox (workflow_id, id) WHERE NOT acked",
    ),
    # 3: activity tasks for remote workers: one row per dispatched
    # attempt.  ``attempt`` is the completion token; the unique key makes a
    # re-dispatch after recovery find the row it wrote before.  Times come from
    # the database clock.  ``lost_count`` counts the times a worker lost the
    # attempt (lease reaped or released on shutdown): the engine re-dispatches
    # the same attempt without consuming budget.
    (
        "CREATE TABLE activity_tasks ("
        " id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,"
        ' workflow_id text COLLATE "C" NOT NULL, run_id text COLLATE "C" NOT NULL,'
        " activity_id integer NOT NULL, attempt integer NOT NULL,"
        ' task_queue text COLLATE "C" NOT NULL, activity_type text NOT NULL,'
        " input text NOT NULL, options text NOT NULL,"
        " attempt_timeout double precision, heartbeat_timeout double precision,"
        " status text NOT NULL DEFAULT 'pending'"
        " CHECK (status IN ('pending', 'running', 'done', 'cancelled')),"
        " worker_id text, lease_expires_at timestamptz, heartbeat_at timestamptz, heartbeat_details text,"
        " lost_count integer NOT NULL DEFAULT 0,"
        " outcome text CHECK (outcome IN ('completed', 'failed')), result text, error text,"
        " created_at timestamptz NOT NULL DEFAULT clock_timestamp(), claimed_at timestamptz,"
        " finished_at timestamptz,"
        " UNIQUE (workflow_id, run_id, activity_id, attempt))",
        "CREATE INDEX activity_tasks_pending ON activity_tasks (task_queue, id) WHERE status = 'pending'",
        "CREATE INDEX activity_tasks_leases ON activity_tasks (lease_expires_at) WHERE status = 'running'",
    ),
    # 4: inbox commands' request ids (idempotency keys): a command queued again
    # under its request id is found here and not added twice.
    (
        'ALTER TABLE inbox ADD COLUMN request_id text COLLATE "C"',
        "CREATE UNIQUE INDEX inbox_by_request ON inbox (request_id) WHERE request_id IS NOT NULL",
    ),
    # 5: who holds a node id's lease (host, pid and aion_trio's process mark), so
    # a second live process opened with the same id is refused naming it.
    ("ALTER TABLE nodes ADD COLUMN host text, ADD COLUMN pid integer, ADD COLUMN process text",),
    # 6: recoveries begun and not finished, per workflow (aion_trio.RecoveryCounts);
    # a row exists only while its count is not zero.
    ('CREATE TABLE recoveries (workflow_id text COLLATE "C" PRIMARY KEY, count integer NOT NULL)',),
    # 7: durable schedules (aion_trio.ScheduleStore): the engine's JSON text under a
    # version bumped by every write (compare-and-set; the engines of a cluster claim a
    # schedule through it).
    (
        'CREATE TABLE schedules (schedule_id text COLLATE "C" PRIMARY KEY, version integer NOT NULL,'
        " data text NOT NULL)",
    ),
    # 8: flow control (aion_trio.FlowStore): permits held until they expire (their
    # engine renews them), the starts a rate counts, and the runs of workflow
    # queues (seq: their order of arrival).  Each change of one key or queue runs
    # under a transaction-scoped advisory lock on it.
    (
        "CREATE TABLE flow_permits (permit_id bigserial PRIMARY KEY, key text NOT NULL,"
        " holder text NOT NULL, expires_at timestamptz NOT NULL)",
        "CREATE INDEX flow_permits_by_key ON flow_permits (key, expires_at)",
        "CREATE TABLE flow_starts (key text NOT NULL, at timestamptz NOT NULL)",
        "CREATE INDEX flow_starts_by_key ON flow_starts (key, at)",
        'CREATE TABLE flow_runs (seq bigserial PRIMARY KEY, queue text COLLATE "C" NOT NULL,'
        ' workflow_id text COLLATE "C" NOT NULL, partition_key text NOT NULL, priority integer NOT NULL,'
        " dedup_id text, state text NOT NULL, data text NOT NULL, UNIQUE (queue, workflow_id))",
        "CREATE INDEX flow_runs_by_order ON flow_runs (queue, priority, seq)",
    ),
    # 9: appends that arrive together share one round trip and one commit
    # (aion_append_batch: each item its own subtransaction around aion_append).
    (_APPEND_BATCH_FUNCTION,),
    # 10: attempts waiting for a flow-control slot (aion_trio.FlowWaiter), one row per
    # waiting activity of a run, so a reader of the database (aion-trio show) sees the
    # wait.  Written only by a wait that blocks; expires_at (renewed by its engine with
    # its permits) makes the row of a node that died lapse.
    (
        'CREATE TABLE flow_waiters (workflow_id text COLLATE "C" NOT NULL, run_id text COLLATE "C" NOT NULL,'
        " activity_id bigint NOT NULL, attempt integer NOT NULL, pool text NOT NULL,"
        " limit_text text NOT NULL, priority integer NOT NULL, since timestamptz NOT NULL,"
        " holder text NOT NULL, expires_at timestamptz NOT NULL,"
        " PRIMARY KEY (workflow_id, run_id, activity_id))",
        "CREATE INDEX flow_waiters_by_holder ON flow_waiters (holder)",
    ),
)

SCHEMA_VERSION = len(MIGRATIONS)
"""The newest schema version this code knows."""

_SQL_LOCK = "SELECT pg_advisory_xact_lock(hashtextextended('aion_trio_postgres:' || %s, 0))"
_SQL_SCHEMA_EXISTS = "SELECT oid FROM pg_namespace WHERE nspname = %s"
_SQL_TABLES = (
    "SELECT relname FROM pg_class WHERE relnamespace = %s AND relkind IN ('r', 'p', 'v', 'm', 'f')"
    " ORDER BY relname"
)
_SQL_CREATE_VERSION_TABLE = (
    f"CREATE TABLE {VERSION_TABLE} (version integer PRIMARY KEY,"
    " applied_at timestamptz NOT NULL DEFAULT clock_timestamp())"
)
_SQL_VERSION = f"SELECT coalesce(max(version), 0) FROM {VERSION_TABLE}"
_SQL_RECORD_VERSION = f"INSERT INTO {VERSION_TABLE} (version) VALUES (%s)"
_SQL_CONFIGURE = (
    "SELECT set_config('search_path', %s, false), set_config('statement_timeout', %s, false),"
    " set_config('lock_timeout', %s, false), set_config('TimeZone', 'UTC', false)"
)


def configure(conn: psycopg.Connection[Any], url: PostgresUrl) -> None:
    """Per-connection settings: the schema, the server-side timeouts, UTC."""
    conn.execute(
        _SQL_CONFIGURE,
        (
            url.schema,
            f"{round(url.statement_timeout * 1000):d}",
            f"{round(url.lock_timeout * 1000):d}",
        ),
    )


def _found_version(conn: psycopg.Connection[Any], url: PostgresUrl, *, create: bool) -> int:
    """Inside the locked transaction: the schema's version (0: new), creating the schema if asked."""
    row = conn.execute(_SQL_SCHEMA_EXISTS, (url.schema,)).fetchone()
    if row is None:
        if not create:
            return 0
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(url.schema)))
        conn.execute(_SQL_CREATE_VERSION_TABLE)
        return 0
    tables = [r[0] for r in conn.execute(_SQL_TABLES, (row[0],))]
    if VERSION_TABLE not in tables:
        if tables:
            shown = ", ".join(tables[:5]) + (", ..." if len(tables) > 5 else "")
            raise NotAnAionDatabase(
                url.location,
                f"schema {url.schema} holds tables of another program ({shown}) and no aion_trio "
                f"{VERSION_TABLE} table; choose another schema with ?schema=NAME",
            )
        if create:
            conn.execute(_SQL_CREATE_VERSION_TABLE)
        return 0
    found = conn.execute(_SQL_VERSION).fetchone()
    version = int(found[0]) if found is not None else 0
    if version > SCHEMA_VERSION:
        raise DatabaseTooNew(url.location, version, SCHEMA_VERSION)
    return version


def migrate(conn: psycopg.Connection[Any], url: PostgresUrl) -> int:
    """Bring the schema to :data:`SCHEMA_VERSION`; return the version found before.

    ``conn`` is in autocommit mode and configured (search_path = the schema).
    """
    with conn.transaction():
        # Checked without the lock first, so a too-new or foreign schema is
        # refused even while another process holds the lock for a long time.
        before = _found_version(conn, url, create=False)
    if before == SCHEMA_VERSION:
        return before
    for version in range(1, SCHEMA_VERSION + 1):
        with conn.transaction():
            conn.execute(_SQL_LOCK, (url.schema,))
            current = _found_version(conn, url, create=True)
            if current >= version:
                continue
            for statement in MIGRATIONS[version - 1]:
                conn.execute(statement)
            conn.execute(_SQL_RECORD_VERSION, (version,))
    return before
