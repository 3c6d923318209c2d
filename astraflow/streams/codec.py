"""msgpack encoding of wire messages, zstd above a threshold, schema version and size checks.

Layout: one flag byte (``0x01`` raw msgpack, ``0x02`` zstd-compressed msgpack) then the body
``{"k": kind, "d": fields}``. Decoding never raises anything but :class:`DecodeError`, whose
message is the reason written to the dead-letter queue.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgpack
import zstandard
from pydantic import ValidationError

from astraflow.streams.messages import KINDS, SCHEMA_VERSION, WIRE, Message

RAW, ZSTD = b"\x01", b"\x02"
COMPRESS_ABOVE = 16 * 1024
MAX_DECOMPRESSED = 256 * 1024 * 1024

M = TypeVar("M", bound=Message)
_zc = zstandard.ZstdCompressor(level=1)  # token arrays compress as well at level 1 as at 3 (a group of 8: 30.6 -> 11.9 KB), 22 % faster
_zd = zstandard.ZstdDecompressor()


class DecodeError(ValueError):
    """The payload is not a valid message of the expected kind; ``str(err)`` is the reason."""


class MessageTooLarge(ValueError):
    """An encoded message exceeds the server's max_payload: put it in the object store or split it."""


def encode(msg: Message, max_payload: int | None = None) -> bytes:
    body = msgpack.packb({"k": msg.kind, "d": msg.model_dump(mode="python")}, use_bin_type=True)
    data = ZSTD + _zc.compress(body) if len(body) > COMPRESS_ABOVE else RAW + body
    if max_payload is not None and len(data) > max_payload:
        raise MessageTooLarge(f"{msg.kind} encodes to {len(data)} bytes > max_payload {max_payload}")
    return data


def decode(data: bytes, expected: type[M]) -> M:
    return _validate(expected, _envelope(data, expected)[1])


def decode_any(data: bytes, *kinds: type[Message]) -> Message:
    """Decode a message of any of ``kinds`` (a stream that carries several, as TRAJ carries trajectories, their groups
    and bundles of groups); the caller narrows the type."""
    kind, fields = _envelope(data, *kinds)
    return _validate(next(k for k in kinds if k.kind == kind), fields)


def envelope(data: bytes, *kinds: type[Message]) -> tuple[type[Message], Any]:
    """The kind (one of ``kinds``) and the unvalidated fields of ``data``: for a reader that validates only part of a
    message (:func:`validate` each part it reads); ``DecodeError`` when ``data`` is not an envelope of one of them."""
    kind, fields = _envelope(data, *kinds)
    return next(k for k in kinds if k.kind == kind), fields


def validate(expected: type[M], fields: Any) -> M:
    """``fields`` as an ``expected``, checked as strictly as :func:`decode` checks a whole message."""
    return _validate(expected, fields)


def _validate(expected: type[M], fields: Any) -> M:
    if isinstance(fields, dict) and fields.get("v", SCHEMA_VERSION) != SCHEMA_VERSION:
        raise DecodeError(f"schema version {fields.get('v')} not supported (this build speaks {SCHEMA_VERSION})")
    try:  # strict: what the exported schemas accept (no lists for packed arrays, no strings for numbers)
        return expected.model_validate(fields, strict=True, context=WIRE)
    except ValidationError as e:
        raise DecodeError(f"invalid {expected.kind}: {e.errors(include_url=False)}") from None
    except Exception as e:  # a validator that met a value it did not expect: the message is refused, the reader lives on
        raise DecodeError(f"invalid {expected.kind}: {type(e).__name__}: {e}") from None


def fields_of(data: bytes, *expected: type[Message]) -> dict[str, Any]:
    """The fields of an envelope of one of ``expected``'s kinds as sent, unvalidated ({} when ``data`` is not one): to
    read the ids of a message that failed its model. Nothing in them is checked: the caller checks what it reads."""
    try:
        fields = _envelope(data, *expected)[1]
    except DecodeError:
        return {}
    return fields if isinstance(fields, dict) else {}


def _envelope(data: bytes, *expected: type[Message]) -> tuple[str, Any]:
    """The kind and unvalidated fields of ``data``, an envelope of one of ``expected``'s kinds; DecodeError when it is
    not one."""
    if not data:
        raise DecodeError("empty payload")
    flag, body = data[:1], data[1:]
    try:
        if flag == ZSTD:
            body = _zd.decompress(body, max_output_size=MAX_DECOMPRESSED)
        elif flag != RAW:
            raise DecodeError(f"unknown encoding flag {flag!r}")
        obj = msgpack.unpackb(body, raw=False)
    except DecodeError:
        raise
    except Exception as e:  # msgpack / zstd raise many types
        raise DecodeError(f"undecodable payload: {type(e).__name__}: {e}") from None
    if not isinstance(obj, dict) or "k" not in obj or "d" not in obj:
        raise DecodeError("payload is not an astraflow envelope")
    if obj["k"] not in [m.kind for m in expected]:
        known = "known" if obj["k"] in KINDS else "unknown"
        raise DecodeError(f"expected {' or '.join(m.kind for m in expected)}, got {known} kind {obj['k']!r}")
    return obj["k"], obj["d"]
