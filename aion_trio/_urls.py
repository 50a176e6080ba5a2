"""Store URLs: their scheme, and their text with credentials hidden.

Only parsing: which plugin opens a scheme is the registry's business
(:class:`aion_trio.plugin.StoreRegistry`).
"""

from __future__ import annotations

import re
import urllib.parse

from ._errors import InvalidStoreUrl

#: Query options whose value is a credential (libpq's ``password``, ``sslpassword``, ...).
_SECRET_OPTION = re.compile(r"(?i)(pass|secret|token|key)")


def redact_url(url: object) -> str:
    """``url`` with its credentials replaced by ``***``, for every message and log line.

    The password of ``scheme://user:password@host/...`` and the value of any
    query option whose name mentions a password, secret, token or key
    (``?password=...``, ``sslpassword=...``) are hidden; the rest is kept, so
    the message still says which store.  The one redaction used by the core,
    the CLI and the store plugins.
    """
    if not isinstance(url, str):
        return repr(url)
    scheme, sep, rest = url.partition("://")
    if not sep:  # no scheme (a mistyped URL): the same rules over the whole text
        scheme, rest = "", url
    rest, hash_, fragment = rest.partition("#")
    rest, question, query = rest.partition("?")
    netloc, slash, path = rest.partition("/")
    userinfo, at, hostport = netloc.rpartition("@")
    if at and ":" in userinfo:
        userinfo = userinfo.split(":", 1)[0] + ":***"
    if query:
        pairs = []
        for pair in query.split("&"):
            name, equals, _ = pair.partition("=")
            secret = equals and _SECRET_OPTION.search(urllib.parse.unquote_plus(name))
            pairs.append(f"{name}=***" if secret else pair)
        query = "&".join(pairs)
    return f"{scheme}{sep}{userinfo}{at}{hostport}{slash}{path}{question}{query}{hash_}{fragment}"


def url_scheme(url: str) -> str:
    """The lower-cased scheme of ``url``; :class:`InvalidStoreUrl` when it has none."""
    if not isinstance(url, str):
        raise InvalidStoreUrl(f"a store URL must be a str, got {type(url).__name__}")
    scheme, sep, _rest = url.partition("://")
    if not sep or not scheme:
        raise InvalidStoreUrl(
            f"{redact_url(url)!r} is not a store URL; expected scheme://..., e.g. sqlite:///path/to/file.db "
            "or memory://"
        )
    return scheme.lower()
