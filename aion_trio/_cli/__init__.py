"""The ``aion-trio`` command line.

Commands: ``stores``, ``list``, ``show``, ``history`` (read-only); ``start``,
``signal``, ``update``, ``cancel``, ``terminate``, ``reopen``, ``reset`` (writes), ``worker`` (serve
the user's definitions until SIGINT/SIGTERM, then drain) and ``console`` (a web
console, ``aion_trio._console``, loaded when it runs).

Writes and the store's owner
----------------------------
One engine owns a store at a time.  When a live worker owns it,
a write command is queued in the store's command inbox and the worker applies
it through its engine ("queued for the running worker (pid N on HOST)"); the
command waits (``--queue-timeout``) for the outcome and prints it.  With no
live owner, the command opens an engine in this process and applies the
write directly, and says so.

The store
---------
Every command but ``stores`` works on the store named by ``--store`` or the
``AION_TRIO_STORE`` environment variable: a store URL (``sqlite:///orders.db``,
``memory://``, any scheme a plugin registers) or a plain path, taken as a SQLite
file.  The default is ``sqlite:///aion.db``: ``aion.db`` in the current
directory.  The read-only commands open a SQLite store with ``?mode=ro``, so a
mistyped path is an error rather than a new, empty database.

The user module (``MODULE:ATTR``)
---------------------------------
``start``, ``signal`` and ``worker`` import ``MODULE`` (the current directory
is put on ``sys.path`` first) and read the definitions from ``ATTR``: any
object with a ``workflows`` sequence of ``@aion_trio.workflow`` functions and
an optional ``activities`` sequence of ``@aion_trio.activity`` functions (a
``types.SimpleNamespace`` will do).  Without ``:ATTR`` the module itself is
that object: module-level lists named ``workflows`` and ``activities``.

Output and errors
-----------------
Human output is rich tables on stdout (plain text when stdout is not a
terminal); ``--json`` prints JSON for machines.  Every error is one line,
``Error: ...``, on stderr: exit status 2 for a usage error (a bad option or
argument, a bad store URL, a store plugin that cannot be loaded), 130 for
an interrupt (SIGINT, Ctrl-C), 1 for anything else (a store that cannot be
opened, an unknown workflow, a failed run, ...).  Tracebacks are for bugs
only.  Tables fit the terminal, or ``PIPED_WIDTH`` columns when stdout is not
a terminal (``COLUMNS`` overrides both).
"""

from __future__ import annotations

from .app import PROG_NAME as PROG_NAME, cli as cli, main as main
from .options import DEFAULT_STORE as DEFAULT_STORE, STORE_ENV as STORE_ENV, store_url
from .userapp import App as App, load_activities as load_activities, load_app as load_app

#: The name the suite's error-message checks read (a store argument as the CLI resolves it).
_store_url = store_url
