"""Payload codecs: bytes-to-bytes steps applied to encoded payloads before they are stored.

A :class:`Codec` turns bytes into bytes and back (compression, encryption).  A
:class:`CodecChain` applies its codecs in order to a payload's JSON text and
wraps the result in an *envelope*, itself a small JSON document, so every store
keeps holding valid JSON payloads::

    {"$aion_codec":["zlib","aes-gcm"],"data":"<base64>"}

The envelope lists the codecs that made it, so decoding follows what was
written, not what is configured now: adding a codec later still reads older
payloads, and a payload written before any codec (plain JSON) is read as it is.

Where the chain runs: at the store boundary (:mod:`aion_trio._codec_store`) on
every append and read, and around remote activity dispatch.  Workflow code,
replay and the recorder only ever see plain payloads, so a codec never runs
during replay and a codec method may be ``async`` (a KMS call).
"""

from __future__ import annotations

import base64
import binascii
import inspect
import json
import os
import zlib
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from typing import Any, Protocol, final, runtime_checkable

import attrs

from ._errors import PayloadCodecError
from ._events import ActivityError, ErrorInfo, Event, EventBody
from ._payload import Payload

#: The envelope's first key; its text starts with this prefix (a cheap test, no JSON parse).
ENVELOPE_KEY = "$aion_codec"
_PREFIX = '{"' + ENVELOPE_KEY + '":'
#: Payload fields the engine itself reads from stored events: left as they are.
_ENGINE_FIELDS = frozenset({"options"})


@runtime_checkable
class Codec(Protocol):
    """One step of a codec chain: bytes to bytes, and back.

    ``name`` is recorded in every payload the step encodes (keep it stable: it
    is how the payload is decoded later).  ``encode`` and ``decode`` may be
    plain methods or ``async def`` (awaited at the store boundary, never during
    replay).  ``decode`` raises on bytes it cannot decode (a wrong key, a
    tampered payload); the chain turns that into :class:`PayloadCodecError`.
    """

    @property
    def name(self) -> str: ...

    def encode(self, data: bytes) -> bytes | Awaitable[bytes]: ...

    def decode(self, data: bytes) -> bytes | Awaitable[bytes]: ...


async def _call(step: Any, data: bytes) -> bytes:
    result = step(data)
    if inspect.isawaitable(result):
        result = await result
    if not isinstance(result, (bytes, bytearray)):
        raise TypeError(f"a codec step returned {type(result).__name__}, not bytes")
    return bytes(result)


def is_encoded(payload: Payload) -> bool:
    """Whether ``payload`` is a codec envelope (not plain JSON data)."""
    return payload.json.startswith(_PREFIX)


def envelope_codecs(payload: Payload) -> list[str]:
    """The codec names an envelope lists, in the order they were applied."""
    data = json.loads(payload.json)
    names = data.get(ENVELOPE_KEY) if isinstance(data, dict) else None
    return [str(n) for n in names] if isinstance(names, list) else []


def describe_encoded(payload: Payload) -> str:
    """How to show an envelope to a reader without its codecs: ``<encrypted>`` (or ``<compressed>``)."""
    try:
        names = envelope_codecs(payload)
    except ValueError:  # pragma: no cover - a Payload holds valid JSON
        names = []
    return "<compressed>" if names and all(n == ZlibCodec.name for n in names) else "<encrypted>"


@final
class CodecChain:
    """Codecs applied in order on encode, in reverse on decode.

    Build it from a sequence of :class:`Codec` objects (the engine's
    ``EngineConfig(codecs=[...])`` does).  Codec names must be unique.
    """

    __slots__ = ("_by_name", "_codecs", "_names")

    def __init__(self, codecs: Iterable[Codec]) -> None:
        codec_list = list(codecs)
        if not codec_list:
            raise ValueError("a codec chain needs at least one codec")
        by_name: dict[str, Codec] = {}
        for codec in codec_list:
            if not isinstance(codec, Codec):
                raise TypeError(
                    f"{codec!r} is not a codec: it needs a 'name' and 'encode'/'decode' methods (bytes to bytes)"
                )
            name = codec.name
            if not isinstance(name, str) or not name or name.strip() != name or '"' in name:
                raise ValueError(f"codec name must be a non-empty str without quotes or spaces, got {name!r}")
            if name in by_name:
                raise ValueError(f"two codecs in one chain are named {name!r}")
            by_name[name] = codec
        self._codecs = tuple(codec_list)
        self._by_name = by_name
        self._names = [c.name for c in codec_list]

    @classmethod
    def of(cls, value: object) -> CodecChain:
        """A chain from a chain, a single codec or a sequence of codecs."""
        if isinstance(value, CodecChain):
            return value
        if isinstance(value, Codec):
            return cls([value])
        if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
            raise TypeError(f"codecs must be a Codec, a sequence of codecs or a CodecChain, got {value!r}")
        return cls(value)

    @property
    def codecs(self) -> tuple[Codec, ...]:
        """The chain's codecs, in the order they encode (decoding runs them backwards)."""
        return self._codecs

    def __repr__(self) -> str:
        return f"CodecChain({list(self._codecs)!r})"

    async def encode(self, payload: Payload) -> Payload:
        """``payload`` through every codec, as an envelope."""
        data = payload.json.encode("utf-8")
        for codec in self._codecs:
            data = await _call(codec.encode, data)
        names = ",".join(f'"{n}"' for n in self._names)
        text = _PREFIX + "[" + names + '],"data":"' + base64.b64encode(data).decode("ascii") + '"}'
        return Payload.trusted(text)

    async def decode(self, payload: Payload, *, workflow_id: str, seq: int | None, what: str) -> Payload:
        """The plain payload inside an envelope (a plain payload as it is).

        Raises :class:`PayloadCodecError` naming ``workflow_id``, ``seq`` and
        ``what`` when the envelope names a codec this chain lacks, or a codec
        refuses its bytes (a wrong or missing key, a tampered payload).
        """
        if not is_encoded(payload):
            return payload

        def fail(detail: str) -> PayloadCodecError:
            return PayloadCodecError(workflow_id, seq, what, detail)

        try:
            envelope = json.loads(payload.json)
            names = envelope[ENVELOPE_KEY]
            data = base64.b64decode(envelope["data"], validate=True)
        except (ValueError, KeyError, TypeError, binascii.Error):
            raise fail("the codec envelope is malformed") from None
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise fail("the codec envelope is malformed")
        for name in reversed(names):
            codec = self._by_name.get(name)
            if codec is None:
                raise fail(
                    f"encoded with codec {name!r}, which is not configured (configured: {', '.join(self._names)})"
                )
            try:
                data = await _call(codec.decode, data)
            except PayloadCodecError:
                raise
            except Exception as exc:
                raise fail(f"codec {name!r} cannot decode it: {type(exc).__name__}: {exc}") from exc
        try:
            text = data.decode("utf-8")
            json.loads(text)
        except ValueError:
            raise fail("decoded bytes are not JSON text (a codec returned something else)") from None
        return Payload.trusted(text)

    # -- events ---------------------------------------------------------------

    async def encode_event(self, event: Event) -> Event:
        """``event`` with every payload of its body encoded (the same event if it has none)."""
        body = await _map_body(event.body, self.encode)
        return event if body is event.body else attrs.evolve(event, body=body)

    async def decode_event(self, event: Event) -> Event:
        """``event`` with every encoded payload of its body decoded; a payload that does not
        decode raises :class:`~aion_trio.PayloadCodecError` naming the workflow and seq."""

        async def decode(payload: Payload, field: str = "") -> Payload:
            return await self.decode(
                payload,
                workflow_id=event.workflow_id,
                seq=event.seq,
                what=f"{type(event.body).__name__}.{field}",
            )

        body = await _map_body(event.body, decode, named=True)
        return event if body is event.body else attrs.evolve(event, body=body)


async def _map_body(body: EventBody, transform: Any, *, named: bool = False) -> EventBody:
    """``body`` with each user payload passed through ``transform`` (the same object if none changed)."""
    changes: dict[str, Any] = {}
    for field in attrs.fields(type(body)):
        name = field.name
        if name in _ENGINE_FIELDS:
            continue
        value = getattr(body, name)
        if isinstance(value, Payload):
            new = await (transform(value, name) if named else transform(value))
            if new is not value:
                changes[name] = new
        elif isinstance(value, (ErrorInfo, ActivityError)) and value.details is not None:
            details = value.details
            new = await (transform(details, f"{name}.details") if named else transform(details))
            if new is not details:
                changes[name] = attrs.evolve(value, details=new)
    return attrs.evolve(body, **changes) if changes else body


# -- the codecs that ship --------------------------------------------------------


@final
@attrs.frozen
class ZlibCodec:
    """Compression with the standard library's zlib (``level`` 1-9, default 6)."""

    name = "zlib"
    level: int = attrs.field(default=6)

    @level.validator
    def _check_level(self, attribute: attrs.Attribute[int], value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 9:
            raise ValueError(f"zlib level must be an int from 0 to 9, got {value!r}")

    def encode(self, data: bytes) -> bytes:
        return zlib.compress(data, self.level)

    def decode(self, data: bytes) -> bytes:
        return zlib.decompress(data)


_AES_VERSION = 1
_NONCE_BYTES = 12


def _check_keys(
    instance: object, attribute: attrs.Attribute[Mapping[str, bytes]], value: Mapping[str, bytes]
) -> None:
    if not isinstance(value, Mapping) or not value:
        raise ValueError("AesGcmCodec needs keys: a non-empty mapping of key id to a 16, 24 or 32 byte key")
    for key_id, key in value.items():
        if not isinstance(key_id, str) or not key_id or len(key_id.encode("utf-8")) > 255:
            raise ValueError(f"key ids must be non-empty str of at most 255 bytes, got {key_id!r}")
        if not isinstance(key, bytes) or len(key) not in (16, 24, 32):
            raise ValueError(f"key {key_id!r} must be 16, 24 or 32 bytes (AES-128/192/256)")


@final
@attrs.frozen
class AesGcmCodec:
    """AES-GCM encryption (the ``cryptography`` package: ``pip install aion-trio[encryption]``).

    ``keys`` maps key ids to keys (16, 24 or 32 bytes); ``current`` is the id
    new payloads are encrypted with.  Each payload carries the id of its key,
    so rotating is adding a key and making it current: payloads written with
    an older key still decrypt while its key is listed.  A payload whose key is
    not listed, or whose bytes were changed, does not decrypt.
    """

    name = "aes-gcm"
    keys: Mapping[str, bytes] = attrs.field(validator=_check_keys, repr=False)
    current: str = attrs.field()
    _ciphers: dict[str, Any] = attrs.field(init=False, repr=False, eq=False)

    @current.validator
    def _check_current(self, attribute: attrs.Attribute[str], value: str) -> None:
        if value not in self.keys:
            raise ValueError(
                f"current key id {value!r} is not among the keys ({', '.join(sorted(self.keys))})"
            )

    def __attrs_post_init__(self) -> None:
        try:
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        except ImportError:  # pragma: no cover - depends on the environment
            raise ImportError(
                "AesGcmCodec needs the 'cryptography' package: pip install 'aion-trio[encryption]'"
            ) from None
        object.__setattr__(self, "_ciphers", {key_id: AESGCM(key) for key_id, key in self.keys.items()})

    def encode(self, data: bytes) -> bytes:
        key_id = self.current.encode("utf-8")
        header = bytes([_AES_VERSION, len(key_id)]) + key_id
        nonce = os.urandom(_NONCE_BYTES)
        # The header is authenticated too: changing the key id breaks the tag.
        return header + nonce + bytes(self._ciphers[self.current].encrypt(nonce, data, header))

    def decode(self, data: bytes) -> bytes:
        if len(data) < 2 or data[0] != _AES_VERSION:
            raise ValueError("not an aes-gcm payload of a known format")
        end = 2 + data[1]
        key_id = data[2:end].decode("utf-8", "replace")
        cipher = self._ciphers.get(key_id)
        if cipher is None:
            raise LookupError(f"no key with id {key_id!r} (known: {', '.join(sorted(self.keys))})")
        nonce = data[end : end + _NONCE_BYTES]
        try:
            return bytes(cipher.decrypt(nonce, data[end + _NONCE_BYTES :], data[:end]))
        except Exception as exc:  # cryptography's InvalidTag: a wrong key or changed bytes
            raise ValueError(
                f"authentication failed with key {key_id!r}: wrong key or tampered payload"
            ) from exc

    @staticmethod
    def key_id_of(data: bytes) -> str:
        """The key id an encrypted payload's bytes carry."""
        return data[2 : 2 + data[1]].decode("utf-8", "replace")


def chain_or_none(value: CodecChain | Codec | Sequence[Codec] | None) -> CodecChain | None:
    """``EngineConfig.codecs``' converter: ``None`` or an empty sequence is no chain."""
    if value is None:
        return None
    if not isinstance(value, (CodecChain, Codec)) and isinstance(value, Sequence) and not value:
        return None
    return CodecChain.of(value)
