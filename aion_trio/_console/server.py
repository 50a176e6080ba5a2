"""Serving the console: the store opened for reading, hypercorn on Trio, the token's URL."""

from __future__ import annotations

import logging
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from .._cli.stores import open_for_reading
from .web import Settings, build_app

#: Seconds the server gives open requests (a live page's stream) to finish when it stops.
GRACEFUL = 0.5


async def serve_console(
    settings: Settings,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the console until cancelled; ``task_status.started`` gets the URL with the token.

    The store is opened for reading (a SQLite file with ``mode=ro``), so the console
    never writes to it itself; its actions go the CLI's way (``apply_or_queue``).
    """
    async with open_for_reading(settings.store_url) as store:
        config = Config()
        config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
        config.graceful_timeout = GRACEFUL
        config.accesslog = None
        config.errorlog = logging.getLogger("aion_trio.console")
        app: Any = build_app(store, settings)
        async with trio.open_nursery() as nursery:
            binds: list[str] = await nursery.start(_serve, app, config)
            task_status.started(f"{binds[0]}/?token={settings.token}")


async def _serve(app: Any, config: Config, *, task_status: trio.TaskStatus[list[str]]) -> None:
    await serve(app, config, shutdown_trigger=trio.sleep_forever, task_status=task_status)
