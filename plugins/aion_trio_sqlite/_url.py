"""Parsing ``sqlite://`` store URLs (the rules are in the package docstring)."""

from __future__ import annotations

import os
import urllib.parse
from typing import Literal

import attrs

from aion_trio.plugin import InvalidStoreUrl, redact_url

Synchronous = Literal["FULL", "NORMAL"]

_PREFIX = "sqlite://"
_ACCEPTED = (
    "synchronous=FULL (the default) or synchronous=NORMAL; mode=rw (the default) or mode=ro; "
    "inline_commits=on (the default) or inline_commits=off"
)
_SYNC_ACCEPTED = "synchronous=FULL (the default) or synchronous=NORMAL"
_EXAMPLES = "sqlite:////absolute/path/store.db or sqlite:///relative/store.db"


@attrs.frozen(kw_only=True)
class SqliteUrl:
    """A parsed ``sqlite://`` URL: the database file and the durability level."""

    url: str
    path: str
    """Absolute path of the database file (a relative URL path is resolved against the cwd)."""
    synchronous: Synchronous = "FULL"
    read_only: bool = False
    """``mode=ro``: open an existing aion_trio database for reading only (nothing is created,
    migrated or written)."""
    inline_commits: bool = True
    """``inline_commits=off``: every commit on the writer thread, never on the Trio thread
    (see the package docstring, *Threads*)."""


def parse_sqlite_url(url: str, *, cwd: str | None = None) -> SqliteUrl:
    """Parse ``url`` or raise :class:`~aion_trio.InvalidStoreUrl` saying what is wrong."""
    if not isinstance(url, str) or not url[: len(_PREFIX)].lower() == _PREFIX:
        raise InvalidStoreUrl(f"{redact_url(url)!r} is not a sqlite:// URL (expected e.g. {_EXAMPLES})")
    rest = url[len(_PREFIX) :]
    if "#" in rest:
        raise InvalidStoreUrl(
            f"{redact_url(url)!r}: a sqlite:// URL has no #fragment (percent-encode '#' in paths as %23)"
        )
    rest, _, query = rest.partition("?")
    if not rest.startswith("/"):
        raise InvalidStoreUrl(
            f"{redact_url(url)!r}: a sqlite:// URL names no host; write three slashes before the path (e.g. {_EXAMPLES})"
        )
    try:
        path = urllib.parse.unquote(rest[1:], errors="strict")
    except UnicodeDecodeError as exc:
        raise InvalidStoreUrl(
            f"{redact_url(url)!r}: the path's percent-escapes are not UTF-8 ({exc.reason} at byte {exc.start}); "
            "percent-encode the path's UTF-8 bytes"
        ) from None
    if not path or path.endswith("/"):
        raise InvalidStoreUrl(f"{redact_url(url)!r} names no database file (expected e.g. {_EXAMPLES})")
    if "\x00" in path:
        raise InvalidStoreUrl(f"{redact_url(url)!r}: the path contains a NUL character")
    synchronous: Synchronous = "FULL"
    read_only = False
    inline_commits = True
    if query:
        try:
            pairs = urllib.parse.parse_qsl(query, keep_blank_values=True, strict_parsing=True)
        except ValueError as exc:
            raise InvalidStoreUrl(
                f"{redact_url(url)!r}: malformed query string ({exc}); accepted: {_ACCEPTED}"
            ) from None
        seen: set[str] = set()
        for name, value in pairs:
            if name in seen:
                raise InvalidStoreUrl(f"{redact_url(url)!r}: option {name!r} is given twice")
            seen.add(name)
            if name == "mode":
                if value.lower() not in ("ro", "rw"):
                    raise InvalidStoreUrl(
                        f"{redact_url(url)!r}: mode={value!r} is not accepted; use mode=ro or mode=rw"
                    )
                read_only = value.lower() == "ro"
                continue
            if name == "inline_commits":
                if value.lower() not in ("on", "off"):
                    raise InvalidStoreUrl(
                        f"{redact_url(url)!r}: inline_commits={value!r} is not accepted; use inline_commits=on or "
                        "inline_commits=off"
                    )
                inline_commits = value.lower() == "on"
                continue
            if name != "synchronous":
                raise InvalidStoreUrl(
                    f"{redact_url(url)!r}: unknown option {name!r}; accepted options: {_ACCEPTED}"
                )
            level = value.upper()
            if level == "FULL":
                synchronous = "FULL"
            elif level == "NORMAL":
                synchronous = "NORMAL"
            else:
                raise InvalidStoreUrl(
                    f"{redact_url(url)!r}: synchronous={value!r} is not accepted; use {_SYNC_ACCEPTED}"
                )
    base = cwd if cwd is not None else os.getcwd()
    return SqliteUrl(
        url=url,
        path=os.path.normpath(os.path.join(base, path)),
        synchronous=synchronous,
        read_only=read_only,
        inline_commits=inline_commits,
    )
