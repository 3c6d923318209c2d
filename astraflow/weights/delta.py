"""Bit-exact codec for weight versions: keyframes (full state) and deltas (changes since v-1).

Pure: no I/O, no messaging. The codec works on the *bits* of the dtype recorded in the payload
(bf16 and fp16 as uint16, fp32 as uint32), so decoding is bit-exact; NaNs, signed zeros and
subnormals survive. `apply_delta` requires each state tensor to have exactly the payload's name,
shape and dtype; a model running in another dtype keeps a bf16 image, applies deltas onto the
image and copies it into the model.

RL updates under bf16 are bit-for-bit sparse (97-99.6 % of values unchanged per step): a tiny
update flips a value only where it crosses a rounding boundary, by one ulp. Per tensor, a delta
stores the changed positions ``i_0 < i_1 < ...`` as gaps ``g_k = i_k - i_{k-1} - 1`` (``i_{-1}
= -1``) of ``width`` bytes (the fewest that hold the largest gap), and the wrapping differences
``new_bits - base_bits`` zigzag-mapped (0, -1, 1, -2 -> 0, 1, 2, 3: a one-ulp step is 1 or 2).
Both are split into byte planes (all lowest bytes, then the next, ...), so high planes are runs
of zeros. Where most values change, a dense plane of zigzag differences is cheaper. Each
tensor's section is its own zstd frame (content size and checksum written): tensors compress
and decompress in parallel, and damage is reported per tensor.

Byte layout (integers little-endian)::

    payload := header | table | frame * (tensors whose frame_len > 0), in table order
    header  := b"AFWV" | u16 format_version | u8 kind (1 keyframe, 2 delta) | u8 flags (0)
               | u32 n_tensors | u32 table_len | u32 crc32(table)                 (20 bytes)
    table   := entry * n_tensors
    entry   := u16 name_len | name (utf-8) | u8 dtype (1 bf16, 2 fp16, 3 fp32) | u8 ndim
               | u8 mode | u8 width | u64 dim * ndim | u64 n_changed | u64 frame_len
    frame   := zstd(section); the section's length follows from the entry:
      mode 0 UNCHANGED  n_changed = 0                        no frame
      mode 1 SPARSE     gap planes (n_changed * width) | diff planes (n_changed * itemsize)
      mode 2 DENSE      diff planes (numel * itemsize)
      mode 3 RAW        planes of the bits (numel * itemsize), n_changed = numel; keyframes only
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import struct
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import accumulate
from typing import NamedTuple, TypeVar

import numpy as np
import torch
import zstandard

DELTA_FORMAT_VERSION = 1
MAGIC = b"AFWV"
KIND_KEYFRAME, KIND_DELTA = 1, 2
MODE_UNCHANGED, MODE_SPARSE, MODE_DENSE, MODE_RAW = 0, 1, 2, 3
# Level 1, but matches of 7+ bytes only and a small hash table: planes are mostly literals;
# measured on real AdamW deltas ~20 % faster than plain level 1 (level 3: larger and slower).
_ZSTD_PARAMS = zstandard.ZstdCompressionParameters.from_level(
    1, min_match=7, hash_log=12, write_checksum=1, write_content_size=1)
DENSE_RATIO = 0.75  # dense plane once the sparse section would exceed this share of it
WORKERS = min(4, os.cpu_count() or 1)  # numpy and zstd release the GIL
PARALLEL_MIN_ELEMENTS = 1 << 20  # below this, starting threads costs more than it saves

_HEADER = struct.Struct("<4sHBBIII")
_ENTRY_FIXED = struct.Struct("<BBBB")
_U64 = struct.Struct("<Q")
_T = TypeVar("_T")


class DeltaError(ValueError):
    """A payload or state the codec refuses; the message names the tensor where there is one."""


@dataclass(frozen=True)
class DeltaStats:
    """Sizes of one payload; model_bytes are the raw bytes of the whole state."""

    n_elements: int
    n_changed: int
    payload_bytes: int
    model_bytes: int

    @property
    def sparsity(self) -> float:
        """Fraction of elements left unchanged (1.0 for an empty state)."""
        return 1.0 - self.n_changed / self.n_elements if self.n_elements else 1.0

    @property
    def bytes_per_changed(self) -> float:
        """Payload bytes per changed element (inf when nothing changed)."""
        return self.payload_bytes / self.n_changed if self.n_changed else math.inf


@dataclass(frozen=True)
class _Bits:
    code: int
    dtype: torch.dtype
    int_dtype: torch.dtype  # same-width integer dtype to view the bits through
    np_uint: type[np.unsignedinteger]
    itemsize: int


_SUPPORTED = (
    _Bits(1, torch.bfloat16, torch.int16, np.uint16, 2),
    _Bits(2, torch.float16, torch.int16, np.uint16, 2),
    _Bits(3, torch.float32, torch.int32, np.uint32, 4),
)
_BY_DTYPE = {b.dtype: b for b in _SUPPORTED}
_BY_CODE = {b.code: b for b in _SUPPORTED}


@dataclass(frozen=True)
class _Entry:
    """One tensor's row in the table."""

    name: str
    bits: _Bits
    shape: tuple[int, ...]
    mode: int
    width: int = 0
    n_changed: int = 0
    frame_len: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def section_len(self) -> int:
        if self.mode == MODE_SPARSE:
            return self.n_changed * (self.width + self.bits.itemsize)
        return self.numel * self.bits.itemsize if self.mode in (MODE_DENSE, MODE_RAW) else 0


def to_bf16_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached contiguous CPU bf16 copies of a state of floating-point tensors."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if not t.is_floating_point():
            raise DeltaError(f"tensor {name!r}: dtype {t.dtype} is not floating point")
        out[name] = t.detach().to(device="cpu", dtype=torch.bfloat16, copy=True,
                                  memory_format=torch.contiguous_format)
    return out


def state_digest(state: Mapping[str, torch.Tensor]) -> str:
    """sha256 hex over sorted names, dtypes, shapes and raw bytes."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().to("cpu").contiguous()
        meta = f"{name}\0{t.dtype}\0{tuple(t.shape)}".encode()
        h.update(_U64.pack(len(meta)) + meta)
        if t.numel():  # the flat view of an empty tensor may have stride 0
            h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def _bits_of(name: str, t: torch.Tensor) -> _Bits:
    if len(name.encode()) > 0xFFFF:
        raise DeltaError(f"tensor name longer than 65535 bytes: {name[:64]!r}...")
    bits = _BY_DTYPE.get(t.dtype)
    if bits is None:
        raise DeltaError(f"tensor {name!r}: dtype {t.dtype} unsupported (bf16, fp16, fp32 only)")
    return bits


def _flat_bits(t: torch.Tensor, bits: _Bits) -> np.ndarray:
    """1-D unsigned view of the tensor's bits (a CPU contiguous copy only when needed)."""
    t = t.detach().to("cpu").contiguous()
    return t.view(bits.int_dtype).numpy().reshape(-1).view(bits.np_uint)


def _to_planes(values: np.ndarray, nbytes: int) -> np.ndarray:
    """Unsigned integers -> (nbytes, n) uint8 planes, least significant byte first."""
    le = values.astype(values.dtype.newbyteorder("<"), copy=False)
    return np.ascontiguousarray(le.view(np.uint8).reshape(-1, values.itemsize).T[:nbytes])


def _from_planes(buf: np.ndarray, count: int, nbytes: int, dtype: type) -> np.ndarray:
    planes = buf.reshape(nbytes, count)
    out = planes[-1].astype(dtype)
    for k in range(nbytes - 2, -1, -1):
        out <<= 8
        out |= planes[k]
    return out


def _zigzag(diff: np.ndarray) -> np.ndarray:
    """Wrapping differences -> zigzag (0, -1, 1, -2 ... -> 0, 1, 2, 3 ...), in place."""
    sign = diff.view(f"i{diff.itemsize}") >> (8 * diff.itemsize - 1)  # 0 or all ones
    diff <<= 1
    diff ^= sign.view(diff.dtype)
    return diff


def _unzigzag(z: np.ndarray) -> np.ndarray:
    out = np.negative(z & 1)
    z >>= 1
    out ^= z
    return out


def _map(entries: list[_Entry], fn: Callable[..., _T], *iterables: Iterable) -> Iterator[_T]:
    """fn over tensors, results in order; on a few threads when the state is large."""
    if WORKERS < 2 or sum(e.numel for e in entries) < PARALLEL_MIN_ELEMENTS:
        yield from map(fn, *iterables)
        return
    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        yield from pool.map(fn, *iterables)


def _compress(parts: list[np.ndarray]) -> bytes:
    size = sum(p.nbytes for p in parts)
    if not size:
        return b""
    stream = zstandard.ZstdCompressor(compression_params=_ZSTD_PARAMS).compressobj(size=size)
    return b"".join([stream.compress(p.data) for p in parts if p.size] + [stream.flush()])


def _gaps(idx: np.ndarray, n: int) -> np.ndarray:
    """g_k = i_k - i_{k-1} - 1 with i_{-1} = -1, for sorted positions."""
    gaps: np.ndarray = np.empty(idx.size, dtype=np.uint32 if n <= 2**32 else np.uint64)
    gaps[0] = idx[0]
    np.subtract(idx[1:], idx[:-1], out=gaps[1:], casting="unsafe")
    gaps[1:] -= 1
    return gaps


def _delta_record(entry: _Entry, base: np.ndarray, new: np.ndarray) -> tuple[_Entry, bytes]:
    idx = np.flatnonzero(base != new)
    n, m, size = new.size, idx.size, entry.bits.itemsize
    if m == 0:
        return entry, b""
    gaps = _gaps(idx, n)
    width = max(1, (int(gaps.max()).bit_length() + 7) // 8)
    if m * (width + size) > DENSE_RATIO * n * size:
        entry = dataclasses.replace(entry, mode=MODE_DENSE, n_changed=m)
        parts = [_to_planes(_zigzag(new - base), size)]
    else:
        entry = dataclasses.replace(entry, mode=MODE_SPARSE, width=width, n_changed=m)
        diff = _zigzag(np.take(new, idx) - np.take(base, idx))
        parts = [_to_planes(gaps, width), _to_planes(diff, size)]
    frame = _compress(parts)
    return dataclasses.replace(entry, frame_len=len(frame)), frame


def _keyframe_record(entry: _Entry, t: torch.Tensor) -> tuple[_Entry, bytes]:
    frame = _compress([_to_planes(_flat_bits(t, entry.bits), entry.bits.itemsize)])
    return dataclasses.replace(entry, n_changed=entry.numel, frame_len=len(frame)), frame


def _pack(kind: int, records: Iterable[tuple[_Entry, bytes]]) -> tuple[bytes, list[_Entry]]:
    records = list(records)
    table = bytearray()
    for e, _ in records:
        name = e.name.encode()
        table += struct.pack("<H", len(name)) + name
        table += _ENTRY_FIXED.pack(e.bits.code, len(e.shape), e.mode, e.width)
        table += struct.pack(f"<{len(e.shape)}QQQ", *e.shape, e.n_changed, e.frame_len)
    header = _HEADER.pack(MAGIC, DELTA_FORMAT_VERSION, kind, 0, len(records), len(table),
                          zlib.crc32(table))
    return b"".join([header, table, *(f for _, f in records)]), [e for e, _ in records]


def encode_keyframe(state: Mapping[str, torch.Tensor]) -> bytes:
    """The full state, bits byte-planed, one zstd frame per tensor."""
    entries = [_Entry(n, _bits_of(n, t), tuple(t.shape), MODE_RAW) for n, t in state.items()]
    return _pack(KIND_KEYFRAME, _map(entries, _keyframe_record, entries, state.values()))[0]


def encode_delta(base: Mapping[str, torch.Tensor],
                 new: Mapping[str, torch.Tensor]) -> tuple[bytes, DeltaStats]:
    """Delta turning `base` into `new`; both must hold the same names, shapes and dtypes."""
    entries = _paired_entries(base, new)

    def record(e: _Entry) -> tuple[_Entry, bytes]:
        return _delta_record(e, _flat_bits(base[e.name], e.bits), _flat_bits(new[e.name], e.bits))

    payload, entries = _pack(KIND_DELTA, _map(entries, record, entries))
    return payload, _stats(entries, len(payload))


def naive_delta_size(base: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]) -> int:
    """Bytes of the naive format: one (uint32 index, value) pair per changed element."""
    return sum((4 + e.bits.itemsize) * int(np.count_nonzero(
        _flat_bits(base[e.name], e.bits) != _flat_bits(new[e.name], e.bits)))
        for e in _paired_entries(base, new))


def _paired_entries(base: Mapping[str, torch.Tensor],
                    new: Mapping[str, torch.Tensor]) -> list[_Entry]:
    entries = [_Entry(n, _bits_of(n, t), tuple(t.shape), MODE_UNCHANGED) for n, t in new.items()]
    _require_layout(base, entries, "base")
    return entries


def _stats(entries: list[_Entry], payload_bytes: int) -> DeltaStats:
    return DeltaStats(n_elements=sum(e.numel for e in entries),
                      n_changed=sum(e.n_changed for e in entries),
                      payload_bytes=payload_bytes,
                      model_bytes=sum(e.numel * e.bits.itemsize for e in entries))


def _require_layout(state: Mapping[str, torch.Tensor], entries: list[_Entry], what: str) -> None:
    names = {e.name for e in entries}
    missing, extra = sorted(names - set(state)), sorted(set(state) - names)
    if missing or extra:
        raise DeltaError(f"{what} tensor set differs: missing {missing[:5]}, extra {extra[:5]}")
    for e in entries:
        t = state[e.name]
        if tuple(t.shape) != e.shape:
            raise DeltaError(f"tensor {e.name!r}: {what} shape {tuple(t.shape)} != {e.shape}")
        if t.dtype != e.bits.dtype:
            raise DeltaError(f"tensor {e.name!r}: {what} dtype {t.dtype} != {e.bits.dtype}")


def _require_no_aliases(state: Mapping[str, torch.Tensor]) -> None:
    """Differences added twice into shared memory would corrupt it: refuse aliased tensors."""
    spans = sorted(  # (device, first byte, past the last byte, name); strides are >= 0
        (str(t.device), t.data_ptr(), t.data_ptr() + t.element_size() * (1 + sum(
            (n - 1) * s for n, s in zip(t.shape, t.stride()))), name)
        for name, t in state.items() if t.numel())
    for (dev_a, _, end_a, a), (dev_b, start_b, _, b) in zip(spans, spans[1:]):
        if dev_a == dev_b and start_b < end_a:
            raise DeltaError(f"tensors {a!r} and {b!r} share memory; apply onto unaliased "
                             "tensors (e.g. a to_bf16_state copy)")


def _check_entry(e: _Entry) -> None:
    ok = {
        MODE_UNCHANGED: e.n_changed == 0,
        MODE_SPARSE: 0 < e.n_changed <= e.numel and 1 <= e.width <= 8,
        MODE_DENSE: 0 < e.n_changed <= e.numel,
        MODE_RAW: e.n_changed == e.numel,
    }.get(e.mode, False)
    if not ok or (e.frame_len == 0) != (e.section_len == 0):
        raise DeltaError(f"tensor {e.name!r}: corrupt entry (mode {e.mode}, width {e.width}, "
                         f"{e.n_changed} of {e.numel} changed, frame of {e.frame_len} bytes)")


def _parse_table(table: bytes, n_tensors: int) -> list[_Entry]:
    entries: list[_Entry] = []
    pos = 0
    try:
        for _ in range(n_tensors):
            (name_len,) = struct.unpack_from("<H", table, pos)
            name = table[pos + 2:pos + 2 + name_len].decode()
            code, ndim, mode, width = _ENTRY_FIXED.unpack_from(table, pos + 2 + name_len)
            pos += 2 + name_len + _ENTRY_FIXED.size
            *shape, n_changed, frame_len = struct.unpack_from(f"<{ndim}QQQ", table, pos)
            pos += 8 * (ndim + 2)
            if code not in _BY_CODE:
                raise DeltaError(f"tensor {name!r}: unknown dtype code {code}")
            entries.append(_Entry(name, _BY_CODE[code], tuple(shape), mode, width, n_changed,
                                  frame_len))
            _check_entry(entries[-1])
    except (struct.error, UnicodeDecodeError) as exc:
        raise DeltaError(f"corrupt tensor table: {exc}") from exc
    if pos != len(table) or len({e.name for e in entries}) != len(entries):
        raise DeltaError("corrupt tensor table: trailing bytes or repeated names")
    return entries


def _unpack(payload: bytes, kind: int) -> list[tuple[_Entry, memoryview]]:
    """Validated entries of a payload of the given kind, each with its (unread) frame."""
    if len(payload) < _HEADER.size:
        raise DeltaError(f"payload of {len(payload)} bytes is shorter than the header")
    magic, version, got_kind, flags, n_tensors, table_len, crc = _HEADER.unpack_from(payload)
    if magic != MAGIC:
        raise DeltaError(f"bad magic {bytes(magic)!r}: not an astraflow weight payload")
    if version != DELTA_FORMAT_VERSION:
        raise DeltaError(f"format version {version} != supported {DELTA_FORMAT_VERSION}")
    if got_kind != kind or flags:
        raise DeltaError(f"payload kind {got_kind} (flags {flags}) where {kind} was expected")
    view = memoryview(payload)
    table = bytes(view[_HEADER.size:_HEADER.size + table_len])
    if len(table) != table_len or zlib.crc32(table) != crc:
        raise DeltaError("tensor table truncated or corrupt (crc mismatch)")
    entries = _parse_table(table, n_tensors)
    pos = _HEADER.size + table_len
    if (expected := pos + sum(e.frame_len for e in entries)) != len(payload):
        raise DeltaError(f"payload of {len(payload)} bytes, its table says {expected}: "
                         "truncated or corrupt")
    ends = list(accumulate([pos] + [e.frame_len for e in entries]))
    return [(e, view[a:b]) for e, a, b in zip(entries, ends, ends[1:])]


def _decompress(e: _Entry, frame: memoryview) -> np.ndarray:
    if not e.frame_len:
        return np.empty(0, dtype=np.uint8)
    try:
        if zstandard.get_frame_parameters(frame).content_size != e.section_len:
            raise DeltaError(f"tensor {e.name!r}: frame size does not match its entry")
        section = zstandard.ZstdDecompressor().decompress(frame)
    except zstandard.ZstdError as exc:
        raise DeltaError(f"tensor {e.name!r}: corrupt data: {exc}") from exc
    if len(section) != e.section_len:
        raise DeltaError(f"tensor {e.name!r}: {len(section)} bytes, expected {e.section_len}")
    return np.frombuffer(section, dtype=np.uint8)


def decode_keyframe(payload: bytes) -> dict[str, torch.Tensor]:
    """Fresh contiguous CPU tensors, bit-identical to the encoded state."""

    def tensor(record: tuple[_Entry, memoryview]) -> torch.Tensor:
        e, frame = record
        flat = _from_planes(_decompress(e, frame), e.numel, e.bits.itemsize, e.bits.np_uint)
        return torch.from_numpy(flat.view(f"i{e.bits.itemsize}")).view(e.bits.dtype).reshape(
            e.shape)

    records = _unpack(payload, KIND_KEYFRAME)
    entries = [e for e, _ in records]
    return dict(zip((e.name for e in entries), _map(entries, tensor, records), strict=True))


def changed_tensors(payload: bytes) -> set[str]:
    """Names of the tensors a delta changes, from its checked header and table (no decoding)."""
    return {e.name for e, _ in _unpack(payload, KIND_DELTA) if e.mode != MODE_UNCHANGED}


class _Change(NamedTuple):
    """A decoded, validated record: positions (None when dense) and wrapping differences."""

    entry: _Entry
    idx: np.ndarray | None
    diff: np.ndarray


def _decode_change(record: tuple[_Entry, memoryview]) -> _Change:
    e, frame = record
    sec, size, np_uint = _decompress(e, frame), e.bits.itemsize, e.bits.np_uint
    if e.mode == MODE_DENSE:
        return _Change(e, None, _unzigzag(_from_planes(sec, e.numel, size, np_uint)))
    m = e.n_changed
    gaps = _from_planes(sec[:m * e.width], m, e.width, np.uint64 if e.width > 4 else np.uint32)
    if int(gaps.max()) >= e.numel:
        raise DeltaError(f"tensor {e.name!r}: position gap beyond {e.numel} elements")
    idx = gaps.astype(np.int64)
    idx += 1
    np.cumsum(idx, out=idx)
    idx -= 1
    if idx[-1] >= e.numel:
        raise DeltaError(f"tensor {e.name!r}: changed position {idx[-1]} >= {e.numel}")
    return _Change(e, idx, _unzigzag(_from_planes(sec[m * e.width:], m, size, np_uint)))


def _add_in_place(t: torch.Tensor, change: _Change) -> None:
    """Add the wrapping differences into t's own storage (the tensor object is kept)."""
    view = t.detach().view(change.entry.bits.int_dtype)
    direct = view.device.type == "cpu" and view.is_contiguous()
    work = view if direct else view.to("cpu").contiguous()
    flat = work.numpy().reshape(-1).view(change.entry.bits.np_uint)
    if change.idx is None:
        flat += change.diff
    else:
        flat[change.idx] += change.diff
    if not direct:
        view.copy_(work)


def apply_delta(state: MutableMapping[str, torch.Tensor], payload: bytes) -> DeltaStats:
    """Apply a delta in place onto exactly its base.

    Validates the whole payload (header, table, every frame and position) and its fit to the
    state (same names, shapes and dtypes; no two tensors sharing memory) before touching any
    tensor: a refusal raises DeltaError and leaves the state as it was. Values change in the
    tensors' own storage, so views into model parameters see the new version.
    """
    records = _unpack(payload, KIND_DELTA)
    entries = [e for e, _ in records]
    _require_layout(state, entries, "state")
    _require_no_aliases(state)
    changed = [(e, f) for e, f in records if e.mode != MODE_UNCHANGED]
    changes = list(_map(entries, _decode_change, changed))  # may refuse
    for _ in _map(entries, _add_in_place, [state[c.entry.name] for c in changes], changes):
        pass  # nothing refuses past this point
    return _stats(entries, len(payload))
