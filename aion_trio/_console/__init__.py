"""The web console (``aion-trio console``): a page served by this process, on Trio
(hypercorn, Starlette over anyio), to see the store's workflows and act on them.

Modules, from the top: ``command`` (the click command), ``server`` (hypercorn and the
store opened for reading), ``web`` (the Starlette application: routes, live streams,
the token gate, the actions through the CLI's ``apply_or_queue``), ``pages`` (the
HTML), ``data`` (what is read from the store: the list's keyset pages, a workflow's
page) and ``timeline`` (a run's Gantt, as SVG).  Only ``command`` is imported without
the ``console`` extra installed; it imports the rest when the command runs.
"""

from .data import (
    BadFilter as BadFilter,
    ListQuery as ListQuery,
    list_page as list_page,
    workflow_page as workflow_page,
)
