"""The PostgreSQL store (``postgresql://``, also ``postgres://``) for aion_trio.

URLs
----
A libpq connection URL plus this store's own query options::

    postgresql://user:password@host:5432/dbname?schema=aion_trio&statement_timeout=30

``schema`` (default ``aion_trio``; 1-63 of ``[a-z0-9_]``) is the PostgreSQL
schema that holds the tables; it is created if missing, so one database can
hold many isolated stores.  ``statement_timeout`` and ``lock_timeout``
(seconds, defaults 30 and 10; 0 disables) are set on every connection, so
the *server* stops a statement or lock wait that takes too long; either
surfaces as :class:`~aion_trio.BackendUnavailable`.  ``pool_size`` (default
4) is both the connection pool's maximum and the number of worker threads the
store uses at once (a store with a ``node`` keeps one connection and thread
more, for its lease renewals alone, so a busy node still renews on time); ``pool_timeout`` (seconds, default 30) bounds the wait
for a pooled connection.  ``append_batch`` (default 32, 1 to 64) is the most
appends (and, likewise, visibility upserts) written in one call when they
queue for a worker slot together (1: every write alone; see *Ownership and
fencing*).  ``node`` and ``lease_ttl`` (seconds, default 30)
turn on per-workflow ownership (below).  Every other option goes to libpq
(``sslmode``, ``application_name``, ``connect_timeout``, which defaults to
10 seconds here); libpq refuses unknown ones, and so does the parser.
``connect_wait`` (seconds, default 60; 0 disables) is how long opening the
store waits for a server it cannot reach (refused, no answer, starting up,
too many connections), retrying with backoff from 0.1 s doubling to 5 s and
logging a warning per failed attempt: an engine or worker started while the
database is down waits for it instead of failing at start.  A wrong
password or database name fails at once.

Driver and threads
------------------
The plugin's registration imports neither psycopg nor the store: a process
that opens only other stores never loads the driver.  They are imported when
a ``postgresql://`` URL is opened or a name of this package is first used; a
missing driver then raises :class:`aion_trio.plugin.PluginLoadError` saying
what to install.
psycopg 3's synchronous API with a ``psycopg_pool.ConnectionPool``; every
database call runs in ``trio.to_thread.run_sync`` under the store's own
``trio.CapacityLimiter``.  Worker threads are never abandoned: a call
cancelled before its thread started raised ``trio.Cancelled`` and did
nothing; once started, its transaction commits or rolls back and the call
returns normally (the cancellation arrives at the caller's next checkpoint).
So a cancelled ``append`` that raised ``Cancelled`` wrote nothing, and one that
returned wrote its whole batch.  A statement that hangs is bounded by
``statement_timeout``, not by Trio cancellation; a connection that stops
answering altogether (a partition: the server never sees the timeout) is
abandoned by the store once a call on it has run :func:`hang_bound` seconds
(``statement_timeout`` plus a tenth of it, at least 1 s): its socket is shut
down, the pool replaces it, and the call fails with
:class:`~aion_trio.BackendUnavailable` (outcome unknown; a retry is safe), so
no worker thread or connection is held forever.

Schema
------
Numbered migrations recorded in the ``aion_schema_version`` table, each in one
transaction under a transaction-level advisory lock keyed on the schema name,
so concurrent first opens are safe.  A schema newer than this code is refused
with :class:`~aion_trio.DatabaseTooNew`; a schema holding another program's
tables with :class:`~aion_trio.NotAnAionDatabase`.

Ownership and fencing
---------------------
A store opened with ``?node=NAME`` registers a row in ``nodes`` with a lease
(``lease_expires_at``, judged by the database's ``clock_timestamp()``, never a
client clock), renewed in the background every ``lease_ttl / 3`` seconds and
released on close.  Each open of a node id is a new *incarnation* that fences
every older one; so an open is refused with :class:`~aion_trio.NodeInUse`
(naming its host and pid) while another live process holds the id's lease,
unless that process is gone on this host (a node restarted after a crash
takes over at once).  An engine whose node was fenced out anyway stops,
raising :class:`~aion_trio.StoreTakenOver` out of ``open_engine``.  Each workflow row has ``owner_node`` and ``owner_epoch``.
The first append of a workflow by a node (or :meth:`PostgresEventStore.claim`)
claims it: allowed when it is unowned, owned by this node id, or owned by a
node whose lease has expired; every claim bumps ``owner_epoch``.  Every
append is one call of the server-side function ``aion_append``, which in one
transaction checks the fence (:class:`~aion_trio.WorkflowFenced`), then the expected
seq (:class:`~aion_trio.SequenceConflict`), and writes the events (each
stamped with the epoch), the workflow row and the timer rows the batch causes.
A node whose workflow was claimed by another gets ``WorkflowFenced`` on its next
append and writes nothing, so a history never forks.  Appends that queue for
a worker slot together are written by the first slot to come free, up to
``append_batch`` of them in one call of ``aion_append_batch`` (migration 9):
one round trip and one transaction, each append an ``aion_append`` in a
subtransaction of its own, so each is all or nothing on its own and a refused
one reaches only its caller.  An append cancelled before its batch was taken
raised ``trio.Cancelled`` and wrote nothing; once taken, it is written and its
call returns normally.  A store opened without
``node`` does no claiming and refuses to append to workflows a node owns.

Cluster mode
------------
Opened with a node, the store is a :class:`PostgresClusterStore`: it offers
:class:`aion_trio.plugin.ClusterStore` (re-claiming this node's workflows,
claiming orphans with ``FOR UPDATE SKIP LOCKED``, a local lease judgement, a
LISTEN connection in a thread backed by polling) and
:class:`aion_trio.plugin.CommandInbox` (the ``inbox`` table, migration 2), so
engines on several machines share the schema; see the README.

Remote activity workers
-----------------------
:func:`open_task_dispatcher` gives an engine a :class:`PostgresTaskDispatcher`
(``open_engine(store, ..., dispatcher=...)``) that turns attempts on chosen
task queues into ``activity_tasks`` rows; ``aion-trio worker
--activities-only`` processes (or ``aion_trio.run_activity_worker``) claim
them with ``FOR UPDATE SKIP LOCKED`` under leases renewed by heartbeat and
write outcomes guarded by the attempt token; a reaper returns expired leases
to their queues.  ``task_lease_ttl`` and ``poll_interval`` (seconds, defaults
30 and 1) tune them.  See the README.
"""

from __future__ import annotations

import importlib
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any

from aion_trio.plugin import PluginLoadError, Store, StoreRegistry, hookimpl

if TYPE_CHECKING:
    from ._hangwatch import hang_bound as hang_bound
    from ._schema import SCHEMA_VERSION as SCHEMA_VERSION
    from ._store import (
        NodeLease as NodeLease,
        PostgresClusterStore as PostgresClusterStore,
        PostgresEventStore as PostgresEventStore,
        PostgresStore as PostgresStore,
        PostgresVisibilityStore as PostgresVisibilityStore,
        open_postgres_store as open_postgres_store,
    )
    from ._tasks import (
        PostgresTaskDispatcher as PostgresTaskDispatcher,
        open_task_dispatcher as open_task_dispatcher,
        reap_expired as reap_expired,
    )
    from ._url import PostgresUrl as PostgresUrl, parse_postgres_url as parse_postgres_url

__all__ = [
    "SCHEMA_VERSION",
    "NodeLease",
    "PostgresClusterStore",
    "PostgresEventStore",
    "PostgresStore",
    "PostgresTaskDispatcher",
    "PostgresUrl",
    "PostgresVisibilityStore",
    "hang_bound",
    "open_postgres_store",
    "open_task_dispatcher",
    "parse_postgres_url",
    "reap_expired",
]

# Where each public name is defined.  The plugin's registration (every process
# that opens any store loads it) imports none of them: they need psycopg and
# psycopg_pool, which are imported on first use of a name or of a
# postgresql:// URL.
_LAZY = {
    "SCHEMA_VERSION": "_schema",
    "NodeLease": "_store",
    "PostgresClusterStore": "_store",
    "PostgresEventStore": "_store",
    "PostgresStore": "_store",
    "PostgresTaskDispatcher": "_tasks",
    "PostgresUrl": "_url",
    "PostgresVisibilityStore": "_store",
    "hang_bound": "_hangwatch",
    "open_postgres_store": "_store",
    "open_task_dispatcher": "_tasks",
    "parse_postgres_url": "_url",
    "reap_expired": "_tasks",
}
_PUBLIC_CLASSES = (
    "NodeLease",
    "PostgresClusterStore",
    "PostgresEventStore",
    "PostgresStore",
    "PostgresTaskDispatcher",
    "PostgresUrl",
    "PostgresVisibilityStore",
)
_loaded = False


def _load() -> None:
    """Import every public name into this module; ``PluginLoadError`` if the driver is missing."""
    global _loaded
    if _loaded:
        return
    try:
        modules = {
            name: importlib.import_module(f".{name}", __name__) for name in sorted(set(_LAZY.values()))
        }
    except ImportError as exc:
        missing = exc.name or str(exc)
        raise PluginLoadError(
            f"the PostgreSQL store (aion-trio-postgres) cannot import {missing!r}: {exc}; "
            "install its driver with pip install 'psycopg[binary]>=3.1' 'psycopg-pool>=3.2' "
            "(or reinstall aion-trio-postgres)"
        ) from exc
    for name, module in _LAZY.items():
        globals()[name] = getattr(modules[module], name)
    for name in _PUBLIC_CLASSES:
        globals()[name].__module__ = __name__
    _loaded = True


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    _load()
    return globals()[name]


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def _open(url: str) -> AbstractAsyncContextManager[Store]:
    # The scheme's opener: imports the driver and the store only when a
    # postgresql:// URL is opened.
    _load()
    opener: Any = globals()["open_postgres_store"]
    result: AbstractAsyncContextManager[Store] = opener(url)
    return result


_DESCRIPTION = (
    "PostgreSQL (postgresql://user@host/db?schema=NAME; ?node=NAME for per-workflow ownership with fencing)"
)


@hookimpl
def aion_trio_register_stores(registry: StoreRegistry) -> None:
    registry.add("postgresql", _open, description=_DESCRIPTION)
    registry.add("postgres", _open, description=_DESCRIPTION)
