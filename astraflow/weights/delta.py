"""Bit-exact codec for weight versions: keyframes (full state) and deltas (changes since v-1).

Pure: no I/O, no messaging. The codec works on the *bits* of the dtype recorded in the payload
(bf16 and fp16 as uint16, fp32 as uint32), so decoding is bit-exact; NaNs, signed zeros and
subnormals survive. Applying a delta requires each state tensor to have exactly the payload's
name, shape and dtype; a model running in another dtype keeps a bf16 image, applies deltas onto
the image and copies it into the model.

RL updates under bf16 are bit-for-bit sparse (95-99.6 % of values unchanged per step): a tiny
update flips a value only where it crosses a rounding boundary, by one ulp. Tensors are cut into
chunks of ``chunk_elements`` values. Per chunk, a delta stores the changed positions ``i_0 < i_1
< ...`` (relative to the chunk) as gaps ``g_k = i_k - i_{k-1} - 1`` (``i_{-1} = -1``) of
``width`` bytes (the fewest that hold the largest gap), and the wrapping differences ``new_bits
- base_bits`` zigzag-mapped (0, -1, 1, -2 -> 0, 1, 2, 3: a one-ulp step is 1 or 2). Where most
values change, a dense plane of zigzag differences is cheaper. A keyframe chunk stores the bits.
Values are split into byte planes (all lowest bytes, then the next, ...) and each plane is its
own zstd frame (content size and checksum written): the exponent plane of weights compresses to
~1/3, mantissa planes do not and zstd stores them raw at memory speed; high gap and difference
planes are runs of zeros. Chunks compress and decompress in parallel. A small state of one dtype (under
``PARALLEL_MIN_ELEMENTS`` values) is encoded whole, its chunks spans of whole-state arrays: the same bytes, without a
dozen numpy calls per chunk.

The payload streams: the head and layout are known before anything is encoded, and each tensor's
section (index, then frames) follows in layout order, so a publisher sends sections as they are
encoded (`iter_encode_delta`, `iter_encode_keyframe`) and a node works while fetching:
`DeltaApplier` applies each section once all its bytes are in, every frame of it checked first;
`KeyframeDecoder` decodes each chunk once its frames are in. The whole-payload functions are thin
wrappers over the same code; `apply_delta` checks the whole payload before touching the state.

Byte layout (integers little-endian)::

    payload := head | layout | section * n_tensors                          (layout order)
    head    := b"AFWV" | u16 format_version | u8 kind (1 keyframe, 2 delta) | u8 flags (0)
               | u32 n_tensors | u32 chunk_elements | u32 layout_len | u32 crc32(layout)  (24 B)
    layout  := (u16 name_len | name (utf-8) | u8 dtype (1 bf16, 2 fp16, 3 fp32) | u8 ndim
               | u64 dim * ndim) * n_tensors
    section := u32 index_len | u32 crc32(index) | index | frame * (planes of its chunks)
    index   := chunk * ceil(numel / chunk_elements)         (chunk j holds values [j C, (j+1) C))
    chunk   := u8 mode | u8 width | u32 n_changed | u32 frame_len * planes
    frame   := zstd(plane), in index order; a plane holds one byte of each of `count` values:
      mode 0 UNCHANGED  n_changed = 0                 planes: none
      mode 1 SPARSE     0 < n_changed <= chunk_len    gaps (width planes), differences (itemsize)
      mode 2 DENSE      0 < n_changed <= chunk_len    zigzag differences (itemsize planes)
      mode 3 RAW        n_changed = chunk_len         the bits (itemsize planes); keyframes only
    count is n_changed for SPARSE planes, chunk_len otherwise.

`state_digest` is sha256 over b"AFSD2" then, per tensor in sorted name order, ``u64 len(meta) |
meta | sha256(raw bytes)`` with meta = ``name \\0 dtype \\0 shape``: tensors hash in parallel.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import struct
import threading
import zlib
from collections import deque
from collections.abc import (
    Callable,
    Generator,
    Iterable,
    Iterator,
    Mapping,
    MutableMapping,
)
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from itertools import accumulate, pairwise
from typing import NamedTuple, TypeVar

import numpy as np
import torch
import zstandard

DELTA_FORMAT_VERSION = 2
MAGIC = b"AFWV"
KIND_KEYFRAME, KIND_DELTA = 1, 2
MODE_UNCHANGED, MODE_SPARSE, MODE_DENSE, MODE_RAW = 0, 1, 2, 3
CHUNK_ELEMENTS = 1 << 22  # values per chunk: the unit of parallel work (8 MB of bf16)
MAX_CHUNK_ELEMENTS = 1 << 31  # so gaps fit 4 bytes and frames a u32
# Fast strategy with a 64-entry hash table: planes are almost all literals, which zstd Huffman-codes;
# a small table finds few short matches and is 2.5x faster than level 1 on exponent planes, and smaller.
_ZSTD_PARAMS = zstandard.ZstdCompressionParameters(
    strategy=zstandard.STRATEGY_FAST, window_log=17, hash_log=6, chain_log=6, search_log=1, min_match=7,
    write_checksum=1, write_content_size=1)
DENSE_RATIO = 0.75  # dense planes once the sparse ones would exceed this share of them
WORKERS = min(4, os.cpu_count() or 1)  # numpy, zstd and hashlib release the GIL
PARALLEL_MIN_ELEMENTS = 1 << 22  # below this (8 MB of bf16), handing work to threads costs more than it saves
_BLOCK = 1 << 17  # values per pass when splitting or joining byte planes (fits in L2)

_HEAD = struct.Struct("<4sHBBIIII")
_SECTION_HEAD = struct.Struct("<II")
_CHUNK_ROW = struct.Struct("<BBI")
_U64 = struct.Struct("<Q")
log = logging.getLogger(__name__)
_T = TypeVar("_T")
_R = TypeVar("_R")
_local = threading.local()


class DeltaError(ValueError):
    """A payload or state the codec refuses; the message names the tensor where there is one."""


@dataclass(frozen=True)
class DeltaStats:
    """Sizes of one payload; model_bytes are the raw bytes of the whole state."""

    n_elements: int
    n_changed: int
    payload_bytes: int
    model_bytes: int
    changed: frozenset[str] = frozenset()  # names of the tensors a delta changes (empty for a keyframe's stats)

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
class _Tensor:
    """One tensor's row in the layout."""

    name: str
    bits: _Bits
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.bits.itemsize


@dataclass(frozen=True)
class _Chunk:
    """One chunk's row in a section index."""

    mode: int
    width: int
    n_changed: int
    frame_lens: tuple[int, ...]


class _Part(NamedTuple):
    """One chunk of a parsed section: values [start, end) of the tensor, its row, its unread frames."""

    start: int
    end: int
    row: _Chunk
    frames: list[memoryview]


class _Section(NamedTuple):
    tensor: _Tensor
    parts: list[_Part]


# ---------------------------------------------------------------- states


def to_bf16_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached contiguous CPU bf16 copies of a state of floating-point tensors, in one buffer: each tensor a view of
    it, right after the one before, in the state's order. Whoever takes the whole state then reads it in one pass
    (:func:`whole_of`: a delta's differences, the digest, the finite check) instead of a call per tensor."""
    for name, t in state.items():
        if not t.is_floating_point():
            raise DeltaError(f"tensor {name!r}: dtype {t.dtype} is not floating point")
    sources = [t.detach() for t in state.values()]
    buffer = torch.empty(sum(t.numel() for t in sources), dtype=torch.bfloat16)
    views = [part.view(t.shape) for part, t in zip(buffer.split_with_sizes([t.numel() for t in sources]), sources)]
    if all(t.device.type == "cpu" for t in sources):
        torch._foreach_copy_(views, sources)  # one call: a copy per tensor costs more than the copying at this size
    else:
        for view, t in zip(views, sources):
            view.copy_(t)
    return dict(zip(state, views))


def whole_of(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The CPU buffer ``tensors`` are views of, each right after the one before (as :func:`to_bf16_state` lays them
    out), as one flat tensor of their values in this order; None where they are laid out otherwise."""
    if not tensors:
        return None
    first = tensors[0]
    storage = first.untyped_storage()
    start = at = first.storage_offset()  # in values (an empty tensor's data_ptr is 0)
    for t in tensors:
        if (t.device.type != "cpu" or t.dtype != first.dtype or not t.is_contiguous() or t.storage_offset() != at
                or t.untyped_storage().data_ptr() != storage.data_ptr()):
            return None
        at += t.numel()
    whole: torch.Tensor = torch.empty(0, dtype=first.dtype).set_(storage, start, (at - start,), (1,))
    return whole


def _tensor_sha256(t: torch.Tensor) -> bytes:
    t = t.detach().to("cpu").contiguous()
    if not t.numel():  # the flat view of an empty tensor may have stride 0
        return hashlib.sha256().digest()
    return hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().data).digest()


def state_digest(state: Mapping[str, torch.Tensor]) -> str:
    """sha256 hex over sorted names, dtypes, shapes and each tensor's sha256 (see the module doc)."""
    names = sorted(state)
    parallel = sum(t.numel() for t in state.values()) >= PARALLEL_MIN_ELEMENTS
    whole = None if parallel else whole_of(list(state.values()))
    if whole is not None:  # a small state in one buffer: each tensor's bytes a slice of it
        raw = whole.view(torch.uint8).numpy()
        bounds = pairwise(accumulate((t.numel() * t.element_size() for t in state.values()), initial=0))
        hashes = {n: hashlib.sha256(raw[a:b].data).digest() for n, (a, b) in zip(state, bounds)}
    else:
        by_size = sorted(names, key=lambda n: -state[n].numel() * state[n].element_size())  # largest first
        hashes = dict(zip(by_size, _map(_tensor_sha256, [state[n] for n in by_size], parallel)))
    h = hashlib.sha256(b"AFSD2")
    for name in names:
        t = state[name]
        meta = f"{name}\0{t.dtype}\0{tuple(t.shape)}".encode()
        h.update(_U64.pack(len(meta)) + meta + hashes[name])
    return h.hexdigest()


def _layout_of(state: Mapping[str, torch.Tensor]) -> list[_Tensor]:
    layout = []
    for name, t in state.items():
        if len(name.encode()) > 0xFFFF:
            raise DeltaError(f"tensor name longer than 65535 bytes: {name[:64]!r}...")
        bits = _BY_DTYPE.get(t.dtype)
        if bits is None:
            raise DeltaError(f"tensor {name!r}: dtype {t.dtype} unsupported (bf16, fp16, fp32 only)")
        layout.append(_Tensor(name, bits, tuple(t.shape)))
    return layout


def _require_layout(state: Mapping[str, torch.Tensor], layout: list[_Tensor], what: str) -> None:
    names = {t.name for t in layout}
    missing, extra = sorted(names - set(state)), sorted(set(state) - names)
    if missing or extra:
        raise DeltaError(f"{what} tensor set differs: missing {missing[:5]}, extra {extra[:5]}")
    for row in layout:
        t = state[row.name]
        if tuple(t.shape) != row.shape:
            raise DeltaError(f"tensor {row.name!r}: {what} shape {tuple(t.shape)} != {row.shape}")
        if t.dtype != row.bits.dtype:
            raise DeltaError(f"tensor {row.name!r}: {what} dtype {t.dtype} != {row.bits.dtype}")


def _require_no_aliases(state: Mapping[str, torch.Tensor]) -> None:
    """Differences added twice into shared memory would corrupt it: refuse aliased tensors."""
    spans = sorted(  # (device, first byte, past the last byte, name); strides are >= 0
        (str(t.device), t.data_ptr(), t.data_ptr() + t.element_size() * (1 + sum(
            (n - 1) * s for n, s in zip(t.shape, t.stride()))), name)
        for name, t in state.items() if t.numel())
    for (dev_a, _, end_a, a), (dev_b, start_b, _, b) in pairwise(spans):
        if dev_a == dev_b and start_b < end_a:
            raise DeltaError(f"tensors {a!r} and {b!r} share memory; apply onto unaliased "
                             "tensors (e.g. a to_bf16_state copy)")


def _flat_bits(t: torch.Tensor, bits: _Bits) -> np.ndarray:
    """1-D unsigned view of the tensor's bits (a CPU contiguous copy only when needed)."""
    t = t.detach().to("cpu").contiguous()
    return t.view(bits.int_dtype).numpy().reshape(-1).view(bits.np_uint)


# ---------------------------------------------------------------- threads


_pool_lock = threading.Lock()
_shared: list[ThreadPoolExecutor] = []


def _workers() -> ThreadPoolExecutor:
    """The codec's WORKERS threads, started once per process: starting a pool per call costs more than a small
    state's whole apply (milliseconds on a busy machine). Jobs never submit jobs, so callers cannot deadlock it."""
    with _pool_lock:
        if not _shared:
            _shared.append(ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="weights-codec"))
        return _shared[0]


def _map(fn: Callable[[_T], _R], items: Iterable[_T], parallel: bool) -> Iterator[_R]:
    """fn over items, results in order; on the WORKERS threads with at most 2 * WORKERS in flight."""
    if WORKERS < 2 or not parallel:
        yield from map(fn, items)
        return
    pool = _workers()
    window: deque[Future[_R]] = deque()
    try:
        for item in items:
            window.append(pool.submit(fn, item))
            if len(window) >= 2 * WORKERS:
                yield window.popleft().result()
        while window:
            yield window.popleft().result()
    finally:  # an error or an abandoned generator: what has not started never runs; the rest finishes
        for f in window:
            f.cancel()
        for f in window:
            if not f.cancelled():
                f.exception()


def _zstd() -> tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor]:
    """This thread's compressor and decompressor (zstd contexts are not thread-safe)."""
    if (pair := getattr(_local, "zstd", None)) is None:
        pair = _local.zstd = (zstandard.ZstdCompressor(compression_params=_ZSTD_PARAMS), zstandard.ZstdDecompressor())
    return pair


# ---------------------------------------------------------------- planes


def _scratch(slot: str, n: int, dtype: type[np.generic]) -> np.ndarray:
    """n values of this thread's reusable buffer `slot`: on a fresh allocation, faulting the pages
    in costs more than the pass over them. Valid until the thread asks for the slot again."""
    bufs: dict[str, np.ndarray] = _local.__dict__.setdefault("scratch", {})
    size = n * np.dtype(dtype).itemsize
    if (buf := bufs.get(slot)) is None or buf.size < size:
        buf = bufs[slot] = np.empty(size, dtype=np.uint8)
    return buf[:size].view(dtype)


def _blocks(n: int) -> Iterator[slice]:
    """Spans of _BLOCK values: a pass per plane over a block that stays in cache, not over the chunk."""
    return (slice(a, a + _BLOCK) for a in range(0, n, _BLOCK))


def _to_planes(*parts: tuple[np.ndarray, int]) -> list[np.ndarray]:
    """(unsigned values, nbytes) -> nbytes uint8 planes each, plane k = (values >> 8k) & 0xFF, in
    this thread's scratch."""
    out = _scratch("planes", sum(v.size * k for v, k in parts), np.uint8)
    planes: list[np.ndarray] = []
    for values, nbytes in parts:
        n, first = values.size, sum(p.size for p in planes)
        mine = [out[first + k * n:first + (k + 1) * n] for k in range(nbytes)]
        for b in _blocks(n):
            for k, plane in enumerate(mine):
                np.right_shift(values[b], 8 * k, out=plane[b], casting="unsafe")
        planes += mine
    return planes


def _from_planes(planes: list[np.ndarray], out: np.ndarray) -> np.ndarray:
    """Inverse of _to_planes into `out` (Horner: out = ((p_n-1 << 8) | p_n-2) << 8 ...)."""
    for b in _blocks(out.size):
        o = out[b]
        if len(planes) == 1:
            np.copyto(o, planes[0][b], casting="unsafe")
            continue
        np.left_shift(planes[-1][b], 8, out=o, dtype=out.dtype)
        for k in range(len(planes) - 2, -1, -1):
            np.bitwise_or(o, planes[k][b], out=o, casting="unsafe")
            if k:
                o <<= 8
    return out


def _zigzag(diff: np.ndarray) -> np.ndarray:
    """Wrapping differences -> zigzag (0, -1, 1, -2 ... -> 0, 1, 2, 3 ...), in place."""
    sign = diff.view(f"i{diff.itemsize}") >> (8 * diff.itemsize - 1)  # 0 or all ones
    diff <<= 1
    diff ^= sign.view(diff.dtype)
    return diff


def _unzigzag(z: np.ndarray) -> np.ndarray:
    """Inverse of _zigzag, in place: (z >> 1) ^ -(z & 1)."""
    sign = z & 1
    np.negative(sign, out=sign)
    z >>= 1
    z ^= sign
    return z


def _compress(planes: list[np.ndarray]) -> list[bytes]:
    c = _zstd()[0]
    return [c.compress(p.data) for p in planes]


def _decompress(name: str, frames: list[memoryview], count: int) -> list[np.ndarray]:
    """Frames of `count` bytes each, checked (content size before decoding, then the checksum)."""
    out = []
    try:
        d = _zstd()[1]
        for frame in frames:
            if zstandard.get_frame_parameters(frame).content_size != count:
                raise DeltaError(f"tensor {name!r}: frame size does not match its index")
            plane = d.decompress(frame)
            if len(plane) != count:
                raise DeltaError(f"tensor {name!r}: frame of {len(plane)} bytes, expected {count}")
            out.append(np.frombuffer(plane, dtype=np.uint8))
    except zstandard.ZstdError as exc:
        raise DeltaError(f"tensor {name!r}: corrupt data: {exc}") from exc
    return out


# ---------------------------------------------------------------- encoding


class _Encoded(NamedTuple):
    chunk: _Chunk
    frames: list[bytes]


def _encoded(mode: int, width: int, n_changed: int, planes: list[np.ndarray]) -> _Encoded:
    frames = _compress(planes)
    return _Encoded(_Chunk(mode, width, n_changed, tuple(len(f) for f in frames)), frames)


def _keyframe_chunk(bits: np.ndarray) -> _Encoded:
    return _encoded(MODE_RAW, 0, bits.size, _to_planes((bits, bits.itemsize)))


def _positions(diff: np.ndarray) -> np.ndarray:
    """Where diff is not zero. numpy finds the true values of a bool mask several times faster than the nonzero
    values of an integer array (3.1 against 0.6 ms for a million values, 15 % of them changed)."""
    return np.flatnonzero(np.not_equal(diff, 0, out=_scratch("nonzero", diff.size, np.bool_)))


def _gaps(idx: np.ndarray) -> np.ndarray:
    """g_k = i_k - i_{k-1} - 1 with i_{-1} = -1, for sorted positions below 2**32."""
    gaps = np.empty(idx.size, dtype=np.uint32)
    gaps[0] = idx[0]
    np.subtract(idx[1:], idx[:-1], out=gaps[1:], casting="unsafe")
    gaps[1:] -= 1
    return gaps


def _delta_chunk(pair: tuple[np.ndarray, np.ndarray]) -> _Encoded:
    """Sparse planes cost m (width + size) bytes against n size dense: dense once that passes DENSE_RATIO. Since
    width >= 1, the count m alone may settle it before the positions and gaps are worked out."""
    base, new = pair
    diff = np.subtract(new, base, out=_scratch("diff", new.size, new.dtype.type))  # wrapping: zero where unchanged
    m, size = int(np.count_nonzero(diff)), new.itemsize
    if m == 0:
        return _Encoded(_Chunk(MODE_UNCHANGED, 0, 0, ()), [])
    sparse_budget = DENSE_RATIO * new.size * size  # bytes the sparse planes may take
    if m * (1 + size) <= sparse_budget:
        idx = _positions(diff)
        gaps = _gaps(idx)
        width = max(1, (int(gaps.max()).bit_length() + 7) // 8)
        if m * (width + size) <= sparse_budget:
            return _encoded(MODE_SPARSE, width, m, _to_planes((gaps, width), (_zigzag(np.take(diff, idx)), size)))
    return _encoded(MODE_DENSE, 0, m, _to_planes((_zigzag(diff), size)))


def _planes_of_all(values: np.ndarray, nbytes: int, slot: str) -> list[np.ndarray]:
    """_to_planes of one array whole, in this thread's scratch `slot`: a span's plane is a slice of it."""
    n = values.size
    out = _scratch(slot, n * nbytes, np.uint8)
    return [np.right_shift(values, 8 * k, out=out[k * n:(k + 1) * n], casting="unsafe") for k in range(nbytes)]


def _whole_delta_chunks(layout: list[_Tensor], base: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor],
                        chunk: int) -> list[_Encoded]:
    """What _delta_chunk gives chunk by chunk, worked out over a small state of one dtype at once: the
    differences, counts, positions, gaps and planes of the whole state in a few numpy passes, each chunk then a
    span of them. On a state of many small tensors, a dozen numpy calls per chunk cost more than the work. Two states
    in one buffer each (:func:`to_bf16_state`, the trainer's images) are read in place, not gathered first."""
    offsets = list(accumulate((t.numel for t in layout), initial=0))
    spans = [(o + a, o + b) for t, o in zip(layout, offsets) for a, b in _chunk_spans(t.numel, chunk)]
    if not spans:
        return []
    bits, total = layout[0].bits, offsets[-1]
    size = bits.itemsize
    diff = _scratch("whole_diff", total, bits.np_uint)
    wholes = [whole_of([state[t.name] for t in layout]) for state in (base, new)]
    if wholes[0] is not None and wholes[1] is not None:
        np.subtract(_flat_bits(wholes[1], bits), _flat_bits(wholes[0], bits), out=diff)  # wrapping: zero where unchanged
    else:
        old = _scratch("whole_base", total, bits.np_uint)
        np.concatenate([_flat_bits(base[t.name], bits) for t in layout], out=old)
        np.concatenate([_flat_bits(new[t.name], bits) for t in layout], out=diff)
        diff -= old
    changed = np.not_equal(diff, 0, out=_scratch("nonzero", total, np.bool_))
    starts = np.array([s for s, _ in spans], dtype=np.int64)
    counts = [int(np.count_nonzero(changed[s:e])) for s, e in spans]
    # the count alone settles a dense chunk (see _delta_chunk): its positions are not looked for
    dense = [m * (1 + size) > DENSE_RATIO * (e - s) * size for (s, e), m in zip(spans, counts)]
    for (s, e), d in zip(spans, dense):
        if d:
            changed[s:e] = False
    idx = np.flatnonzero(changed)  # the positions in chunks that may be sparse (bool masks: see _positions)
    lo = np.searchsorted(idx, starts)
    has = lo < np.searchsorted(idx, np.array([e for _, e in spans], dtype=np.int64))  # chunks with positions
    # g_k = i_k - i_{k-1} - 1 within a chunk; a chunk's first gap counts from its start (i_{-1} = start - 1)
    gaps = np.empty(idx.size, dtype=np.uint32)
    np.subtract(idx[1:], idx[:-1], out=gaps[1:], casting="unsafe")
    gaps[1:] -= 1
    gaps[lo[has]] = idx[lo[has]] - starts[has]
    # a chunk's width: the bytes of its largest gap (its positions run from its first to the next chunk's first)
    chunk_widths = np.zeros(len(spans), dtype=np.int64)
    if idx.size:
        top = np.maximum.reduceat(gaps, lo[has])
        chunk_widths[has] = 1 + (top > 0xFF) + (top > 0xFFFF) + (top > 0xFFFFFF)
    widths = chunk_widths.tolist()
    sparse = [bool(w) and m * (w + size) <= DENSE_RATIO * (e - s) * size for (s, e), m, w in zip(spans, counts, widths)]
    gap_planes = _planes_of_all(gaps, max((w for w, ok in zip(widths, sparse) if ok), default=0), "whole_gaps")
    change_planes = _planes_of_all(_zigzag(diff[idx]), size, "whole_changes")
    # dense chunks' planes: of the whole state once they hold a good part of it, else chunk by chunk
    in_dense = sum(e - s for (s, e), m, ok in zip(spans, counts, sparse) if m and not ok)
    zig_planes = _planes_of_all(_zigzag(diff), size, "whole_zig") if 4 * in_dense >= total else None
    out: list[_Encoded] = []
    for (s, e), a, m, w, ok in zip(spans, lo.tolist(), counts, widths, sparse):
        if m == 0:
            out.append(_Encoded(_Chunk(MODE_UNCHANGED, 0, 0, ()), []))
        elif ok:
            out.append(_encoded(MODE_SPARSE, w, m, [p[a:a + m] for p in gap_planes[:w] + change_planes]))
        elif zig_planes is not None:
            out.append(_encoded(MODE_DENSE, 0, m, [p[s:e] for p in zig_planes]))
        else:  # its planes are compressed before the scratch is used again
            out.append(_encoded(MODE_DENSE, 0, m, _planes_of_all(_zigzag(diff[s:e]), size, "whole_zig")))
    return out


def _chunk_spans(numel: int, chunk: int) -> Iterator[tuple[int, int]]:
    """[start, end) of each chunk (lazy: a corrupt layout may claim a huge numel)."""
    return ((a, min(a + chunk, numel)) for a in range(0, numel, chunk))


def _head(kind: int, layout: list[_Tensor], chunk: int) -> bytes:
    rows = bytearray()
    for t in layout:
        name = t.name.encode()
        rows += struct.pack(f"<H{len(name)}sBB{len(t.shape)}Q", len(name), name, t.bits.code, len(t.shape), *t.shape)
    return _HEAD.pack(MAGIC, DELTA_FORMAT_VERSION, kind, 0, len(layout), chunk, len(rows), zlib.crc32(rows)) + rows


def _section(encoded: list[_Encoded]) -> list[bytes]:
    index = b"".join(_CHUNK_ROW.pack(e.chunk.mode, e.chunk.width, e.chunk.n_changed)
                     + struct.pack(f"<{len(e.frames)}I", *e.chunk.frame_lens) for e in encoded)
    return [_SECTION_HEAD.pack(len(index), zlib.crc32(index)) + index] + [f for e in encoded for f in e.frames]


def _iter_encode(kind: int, layout: list[_Tensor], encode: Callable[[], Iterator[_Encoded]],
                 chunk: int) -> Generator[bytes, None, tuple[int, int, frozenset[str]]]:
    """Yields the payload piece by piece (head + layout, then each section once all its chunks are
    encoded); `encode()` yields one chunk's encoding after another, in layout order. Returns (changed values,
    payload bytes, names of the tensors with a changed value)."""
    head = _head(kind, layout, chunk)
    yield head
    results = encode()
    n_changed, size, changed = 0, len(head), set()
    for t in layout:
        encoded = [next(results) for _ in _chunk_spans(t.numel, chunk)]
        n_tensor = sum(e.chunk.n_changed for e in encoded)
        n_changed += n_tensor
        if n_tensor:
            changed.add(t.name)
        for piece in _section(encoded):
            size += len(piece)
            yield piece
    return n_changed, size, frozenset(changed)


def _check_chunk(chunk: int) -> None:
    if not 1 <= chunk <= MAX_CHUNK_ELEMENTS:
        raise DeltaError(f"chunk_elements {chunk} outside [1, {MAX_CHUNK_ELEMENTS}]")


def iter_encode_keyframe(state: Mapping[str, torch.Tensor], chunk_elements: int = CHUNK_ELEMENTS) -> Iterator[bytes]:
    """The keyframe payload of `state`, piece by piece as it is encoded (pieces concatenate to it)."""
    layout = _layout_of(state)
    _check_chunk(chunk_elements)

    def work() -> Iterator[np.ndarray]:
        for t in layout:  # a tensor's bits are fetched (copied if on another device) when its chunks start
            bits = _flat_bits(state[t.name], t.bits)
            yield from (bits[a:b] for a, b in _chunk_spans(t.numel, chunk_elements))

    yield from _iter_encode(KIND_KEYFRAME, layout, lambda: _map(_keyframe_chunk, work(), _large(layout)), chunk_elements)


def encode_keyframe(state: Mapping[str, torch.Tensor]) -> bytes:
    """The full state, bits byte-planed, one zstd frame per plane of each chunk."""
    return b"".join(iter_encode_keyframe(state))


def iter_encode_delta(base: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor],
                      chunk_elements: int = CHUNK_ELEMENTS) -> Generator[bytes, None, DeltaStats]:
    """The delta turning `base` into `new`, piece by piece as it is encoded; returns its DeltaStats.

    Both states must hold the same names, shapes and dtypes (checked before the first piece).
    """
    layout = _layout_of(new)
    _require_layout(base, layout, "base")
    _check_chunk(chunk_elements)

    def work() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for t in layout:
            b, n = _flat_bits(base[t.name], t.bits), _flat_bits(new[t.name], t.bits)
            yield from ((b[i:j], n[i:j]) for i, j in _chunk_spans(t.numel, chunk_elements))

    def encode() -> Iterator[_Encoded]:
        if _large(layout) or len({t.bits for t in layout}) > 1:
            return _map(_delta_chunk, work(), _large(layout))
        return iter(_whole_delta_chunks(layout, base, new, chunk_elements))

    n_changed, size, changed = yield from _iter_encode(KIND_DELTA, layout, encode, chunk_elements)
    return _stats(layout, n_changed, size, changed)


def encode_delta(base: Mapping[str, torch.Tensor],
                 new: Mapping[str, torch.Tensor]) -> tuple[bytes, DeltaStats]:
    """Delta turning `base` into `new`; both must hold the same names, shapes and dtypes."""
    pieces, parts = iter_encode_delta(base, new), []
    try:
        while True:
            parts.append(next(pieces))
    except StopIteration as end:  # the generator's return value
        return b"".join(parts), end.value


def naive_delta_size(base: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]) -> int:
    """Bytes of the naive format: one (uint32 index, value) pair per changed element."""
    layout = _layout_of(new)
    _require_layout(base, layout, "base")
    return sum((4 + t.bits.itemsize) * int(np.count_nonzero(
        _flat_bits(base[t.name], t.bits) != _flat_bits(new[t.name], t.bits))) for t in layout)


def _stats(layout: list[_Tensor], n_changed: int, payload_bytes: int, changed: frozenset[str] = frozenset()) -> DeltaStats:
    return DeltaStats(n_elements=sum(t.numel for t in layout), n_changed=n_changed,
                      payload_bytes=payload_bytes, model_bytes=sum(t.nbytes for t in layout), changed=changed)


# ---------------------------------------------------------------- parsing


class _Pieces:
    """Bytes received so far, taken from the front; zero-copy when one piece holds what is taken."""

    def __init__(self) -> None:
        self._pieces: deque[memoryview] = deque()
        self.size = 0
        self.total = 0

    def add(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        if view.nbytes:
            self._pieces.append(view)
            self.size += view.nbytes
            self.total += view.nbytes

    def take(self, n: int) -> memoryview:
        """The next n bytes (n <= size): a slice of the first piece, or one copy when they span pieces."""
        first = self._pieces[0] if self._pieces else None
        if first is not None and n < first.nbytes:  # the common case: a slice of the first piece
            self._pieces[0] = first[n:]
            self.size -= n
            return first[:n]
        parts, left = [], n
        while left:
            piece = self._pieces.popleft()
            parts.append(piece[:left])
            if left < piece.nbytes:
                self._pieces.appendleft(piece[left:])
            left -= parts[-1].nbytes
        self.size -= n
        return parts[0] if len(parts) == 1 else memoryview(b"".join(parts))


def _parse_layout(rows: memoryview, n_tensors: int) -> list[_Tensor]:
    layout: list[_Tensor] = []
    pos = 0
    try:
        for _ in range(n_tensors):
            (name_len,) = struct.unpack_from("<H", rows, pos)
            name = bytes(rows[pos + 2:pos + 2 + name_len]).decode()
            code, ndim = struct.unpack_from("<BB", rows, pos + 2 + name_len)
            shape = struct.unpack_from(f"<{ndim}Q", rows, pos + 4 + name_len)
            pos += 4 + name_len + 8 * ndim
            if code not in _BY_CODE:
                raise DeltaError(f"tensor {name!r}: unknown dtype code {code}")
            layout.append(_Tensor(name, _BY_CODE[code], tuple(shape)))
    except (struct.error, UnicodeDecodeError) as exc:
        raise DeltaError(f"corrupt layout: {exc}") from exc
    if pos != len(rows) or len({t.name for t in layout}) != len(layout):
        raise DeltaError("corrupt layout: trailing bytes or repeated names")
    return layout


def _planes_of(mode: int, width: int, itemsize: int) -> int:
    return {MODE_UNCHANGED: 0, MODE_SPARSE: width + itemsize, MODE_DENSE: itemsize, MODE_RAW: itemsize}[mode]


def _row_ok(mode: int, width: int, n_changed: int, n: int) -> bool:
    """A chunk row's counts fit its mode and its n values."""
    if mode == MODE_UNCHANGED:
        return n_changed == 0 and width == 0
    if mode == MODE_SPARSE:
        return 0 < n_changed <= n and 1 <= width <= 4
    return width == 0 and (0 < n_changed <= n if mode == MODE_DENSE else n_changed == n)


def _parse_index(t: _Tensor, index: memoryview, chunk: int, kind: int) -> list[tuple[int, int, _Chunk]]:
    modes = (MODE_RAW,) if kind == KIND_KEYFRAME else (MODE_UNCHANGED, MODE_SPARSE, MODE_DENSE)
    rows: list[tuple[int, int, _Chunk]] = []
    pos = 0
    try:
        for a, b in _chunk_spans(t.numel, chunk):
            mode, width, n_changed = _CHUNK_ROW.unpack_from(index, pos)
            if mode not in modes or not _row_ok(mode, width, n_changed, b - a):
                raise DeltaError(f"tensor {t.name!r}: corrupt chunk at {a} (mode {mode}, width {width}, "
                                 f"{n_changed} of {b - a} changed)")
            k = _planes_of(mode, width, t.bits.itemsize)
            lens = struct.unpack_from(f"<{k}I", index, pos + _CHUNK_ROW.size)
            pos += _CHUNK_ROW.size + 4 * k
            if not all(lens):
                raise DeltaError(f"tensor {t.name!r}: empty frame at {a}")
            rows.append((a, b, _Chunk(mode, width, n_changed, lens)))
    except struct.error as exc:
        raise DeltaError(f"tensor {t.name!r}: corrupt index: {exc}") from exc
    if pos != len(index):
        raise DeltaError(f"tensor {t.name!r}: corrupt index: trailing bytes")
    return rows


class _Reader:
    """Incremental parser: feed() bytes in any split, get what they complete (indexes checked, frames
    unread): whole sections, or with by_part each chunk as a one-part section as soon as its frames
    are in. The head and layout are checked (magic, version, kind, crc) as they arrive."""

    def __init__(self, kind: int, by_part: bool = False) -> None:
        self.kind = kind
        self.by_part = by_part
        self.layout: list[_Tensor] | None = None
        self._pieces = _Pieces()
        self._state = "head"  # then layout, (section, index, frames of each chunk) per tensor, done
        self._need = _HEAD.size  # bytes the current state reads
        self._next = 0  # the tensor whose section comes next
        self._rows: list[tuple[int, int, _Chunk]] = []  # its index, once read
        self._parts: list[_Part] = []  # its chunks read so far
        self._n_tensors = self._chunk = self._crc = 0  # from the head; _crc: of what the state reads

    @property
    def done(self) -> bool:
        return self._state == "done"

    @property
    def received(self) -> int:
        return self._pieces.total

    def feed(self, data: bytes | bytearray | memoryview) -> list[_Section]:
        """Sections (or parts) completed by `data` (kept by reference: do not change it afterwards)."""
        self._pieces.add(data)
        out: list[_Section] = []
        while not self.done and self._pieces.size >= self._need:
            out += self._step(self._pieces.take(self._need))
        if self.done and self._pieces.size:
            raise DeltaError(f"{self._pieces.size} bytes past the last section: corrupt payload")
        return out

    def close(self) -> None:
        if not self.done:
            where = "head" if self.layout is None else f"section of tensor {self.layout[self._next].name!r}"
            raise DeltaError(f"payload truncated after {self.received} bytes, in the {where}")

    def _step(self, data: memoryview) -> list[_Section]:
        if self._state == "head":
            self._read_head(data)
        elif self._state == "layout":
            if zlib.crc32(data) != self._crc:
                raise DeltaError("layout corrupt (crc mismatch)")
            self.layout = _parse_layout(data, self._n_tensors)
            self._start_section()
        elif self._state == "section":
            self._need, self._crc = _SECTION_HEAD.unpack(data)
            self._state = "index"
        elif self._state == "index":
            assert self.layout is not None
            t = self.layout[self._next]
            if zlib.crc32(data) != self._crc:
                raise DeltaError(f"tensor {t.name!r}: index corrupt (crc mismatch)")
            self._rows, self._parts = _parse_index(t, data, self._chunk, self.kind), []
            return self._next_part()
        else:
            a, b, row = self._rows[len(self._parts)]
            ends = list(accumulate(row.frame_lens, initial=0))
            self._parts.append(_Part(a, b, row, [data[i:j] for i, j in pairwise(ends)]))
            return self._next_part()
        return []

    def _read_head(self, data: memoryview) -> None:
        magic, version, kind, flags, n_tensors, chunk, layout_len, crc = _HEAD.unpack(data)
        if magic != MAGIC:
            raise DeltaError(f"bad magic {bytes(magic)!r}: not an astraflow weight payload")
        if version != DELTA_FORMAT_VERSION:
            raise DeltaError(f"format version {version} != supported {DELTA_FORMAT_VERSION}")
        if kind != self.kind or flags:
            raise DeltaError(f"payload kind {kind} (flags {flags}) where {self.kind} was expected")
        _check_chunk(chunk)
        self._n_tensors, self._chunk, self._need, self._crc = n_tensors, chunk, layout_len, crc
        self._state = "layout"

    def _start_section(self) -> None:
        assert self.layout is not None
        self._state, self._need = ("section", _SECTION_HEAD.size) if self._next < len(self.layout) else ("done", 0)

    def _next_part(self) -> list[_Section]:
        """What the last step completed; then read the next chunk's frames, or the next section."""
        assert self.layout is not None
        t = self.layout[self._next]
        out = [_Section(t, self._parts[-1:])] if self.by_part and self._parts else []
        if len(self._parts) < len(self._rows):
            self._state, self._need = "frames", sum(self._rows[len(self._parts)][2].frame_lens)
            return out
        self._next += 1
        self._start_section()
        return out if self.by_part else [_Section(t, self._parts)]


def _read_all(payload: bytes | bytearray | memoryview, kind: int) -> tuple[_Reader, list[_Section]]:
    reader = _Reader(kind)
    sections = reader.feed(payload)
    reader.close()
    return reader, sections


def changed_tensors(payload: bytes | bytearray | memoryview) -> set[str]:
    """Names of the tensors a delta changes, from its checked head, layout and indexes (no decoding)."""
    _, sections = _read_all(payload, KIND_DELTA)
    return {s.tensor.name for s in sections if any(p.row.mode != MODE_UNCHANGED for p in s.parts)}


# ---------------------------------------------------------------- decoding


def _decode_raw(t: _Tensor, part: _Part, out: np.ndarray) -> None:
    """A keyframe chunk's bits into out[start:end]."""
    _from_planes(_decompress(t.name, part.frames, part.end - part.start), out[part.start:part.end])


class _Change(NamedTuple):
    """A decoded, checked chunk of a delta: positions in the tensor (None when dense) and differences."""

    start: int
    end: int
    idx: np.ndarray | None
    diff: np.ndarray


def _decode_change(t: _Tensor, part: _Part) -> _Change:
    c, n, np_uint = part.row, part.end - part.start, t.bits.np_uint
    if c.mode == MODE_DENSE:
        planes = _decompress(t.name, part.frames, n)
        diff = _from_planes(planes, np.empty(n, dtype=np_uint))
        if np.count_nonzero(diff) != c.n_changed:
            raise DeltaError(f"tensor {t.name!r}: chunk at {part.start} changes other than {c.n_changed} values")
        return _Change(part.start, part.end, None, _unzigzag(diff))
    m = c.n_changed
    planes = _decompress(t.name, part.frames, m)
    gaps = _from_planes(planes[:c.width], np.empty(m, dtype=np.uint32))
    diff = _from_planes(planes[c.width:], np.empty(m, dtype=np_uint))
    if int(gaps.max()) >= n:  # so g + 1 below cannot wrap
        raise DeltaError(f"tensor {t.name!r}: chunk at {part.start}: position gap beyond its {n} values")
    gaps[1:] += 1
    idx = np.cumsum(gaps, dtype=np.int64)  # i_k = g_0 + (g_1 + 1) + ... + (g_k + 1)
    if idx[-1] >= n or np.count_nonzero(diff) != m:
        raise DeltaError(f"tensor {t.name!r}: chunk at {part.start}: position beyond its {n} values or no change")
    return _Change(part.start, part.end, idx, _unzigzag(diff))


def _decode_section(section: _Section) -> tuple[_Tensor, list[_Change]]:
    t = section.tensor
    return t, [_decode_change(t, p) for p in section.parts if p.row.mode != MODE_UNCHANGED]


def _add_in_place(target: torch.Tensor, bits: _Bits, changes: list[_Change]) -> None:
    """Add the wrapping differences into the tensor's own storage (the tensor object is kept). A dense chunk adds
    through numpy (a call costs a fraction of torch's on small tensors), a sparse one through torch's index_add_
    (faster than numpy's fancy indexing); both wrap alike and release the GIL."""
    if not changes:
        return
    view = target.detach().view(bits.int_dtype)
    direct = view.device.type == "cpu" and view.is_contiguous()
    work = view if direct else view.to("cpu").contiguous()
    flat = work.reshape(-1)
    values = flat.numpy().view(bits.np_uint)
    for ch in changes:
        if ch.idx is None:
            part = values[ch.start:ch.end]
            np.add(part, ch.diff, out=part)
        else:
            flat[ch.start:ch.end].index_add_(0, torch.from_numpy(ch.idx), torch.from_numpy(ch.diff.view(f"i{bits.itemsize}")))
    if not direct:
        view.copy_(work)


def _large(layout: list[_Tensor]) -> bool:
    return sum(t.numel for t in layout) >= PARALLEL_MIN_ELEMENTS


def apply_delta(state: MutableMapping[str, torch.Tensor], payload: bytes | bytearray | memoryview) -> DeltaStats:
    """Apply a delta in place onto exactly its base; its stats name the tensors it changed.

    Validates the whole payload (head, layout, every index, frame and position) and its fit to the
    state (same names, shapes and dtypes; no two tensors sharing memory) before touching any
    tensor: a refusal raises DeltaError and leaves the state as it was. Values change in the
    tensors' own storage, so views into model parameters see the new version.
    """
    reader, sections = _read_all(payload, KIND_DELTA)
    assert reader.layout is not None
    _require_layout(state, reader.layout, "state")
    _require_no_aliases(state)
    parallel = _large(reader.layout)
    decoded = list(_map(_decode_section, sections, parallel))  # may refuse
    for _ in _map(lambda d: _add_in_place(state[d[0].name], d[0].bits, d[1]), decoded, parallel):
        pass  # nothing refuses past this point
    changed = frozenset(t.name for t, changes in decoded if changes)
    return _stats(reader.layout, sum(p.row.n_changed for s in sections for p in s.parts), reader.received, changed)


class _Streaming:
    """Runs the jobs of each section a _Reader completes on worker threads (at most 2 * WORKERS in
    flight, so feed() blocks while the workers are behind); a job's error is raised by the next
    feed() or by close(), and from then on by every call."""

    def __init__(self, kind: int, by_part: bool = False) -> None:
        self._reader = _Reader(kind, by_part)
        self._pool: ThreadPoolExecutor | None = None  # the shared workers, for a large state
        self._running: deque[Future[None]] = deque()
        self._error: BaseException | None = None

    @property
    def received(self) -> int:
        """Bytes fed so far."""
        return self._reader.received

    def _on_layout(self, layout: list[_Tensor]) -> None:
        """Check the layout before any section runs (subclasses)."""

    def _jobs(self, section: _Section) -> list[Callable[[], None]]:
        raise NotImplementedError

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """The next bytes of the payload, split anywhere (kept by reference: do not change them)."""
        self._guard(lambda: self._feed(data))

    def _feed(self, data: bytes | bytearray | memoryview) -> None:
        had_layout = self._reader.layout is not None
        sections = self._reader.feed(data)
        if not had_layout and (layout := self._reader.layout) is not None:
            self._on_layout(layout)
            if WORKERS > 1 and _large(layout):
                self._pool = _workers()
        for job in (j for s in sections for j in self._jobs(s)):
            self._run(job)
        while self._running and self._running[0].done():
            self._running.popleft().result()

    def _run(self, job: Callable[[], None]) -> None:
        if self._pool is None:
            job()
            return
        self._running.append(self._pool.submit(job))
        if len(self._running) > 2 * WORKERS:
            self._running.popleft().result()

    def _finish(self) -> None:
        """Check the payload ended after its last section and wait for every job."""
        self._guard(self._drain)

    def _drain(self) -> None:
        self._reader.close()
        while self._running:
            self._running.popleft().result()

    def _guard(self, step: Callable[[], None]) -> None:
        if self._error is not None:
            raise self._error
        try:
            step()
        except BaseException as exc:
            self._error = exc
            for f in self._running:
                f.cancel()
            for f in self._running:  # the started ones finish (their errors are this one's consequence)
                if not f.cancelled():
                    f.exception()
            raise


class DeltaApplier(_Streaming):
    """Applies a delta payload onto `state` in place while its bytes arrive.

    feed() takes the payload in pieces split anywhere. The layout is checked against the state
    (names, shapes, dtypes, no aliasing) before any section runs; each tensor section is checked
    whole (index crc, every frame's size and checksum, every position) before any of its values
    is written, then added in place. A refusal raises DeltaError (from feed() or close()) and the
    refused section's tensor is untouched; sections before it (and others in flight) may be
    applied, so the caller's state digest tells whether the state is the new version.
    close() checks the payload ended after its last section and returns its DeltaStats.
    """

    def __init__(self, state: MutableMapping[str, torch.Tensor]) -> None:
        super().__init__(KIND_DELTA)
        self.state = state
        self.changed: set[str] = set()  # names of the tensors whose sections change values, as sections arrive
        self._n_changed = 0
        self._changed: set[str] = set()

    def _on_layout(self, layout: list[_Tensor]) -> None:
        _require_layout(self.state, layout, "state")
        _require_no_aliases(self.state)

    def _jobs(self, section: _Section) -> list[Callable[[], None]]:
        n = sum(p.row.n_changed for p in section.parts)
        self._n_changed += n
        if n:
            self._changed.add(section.tensor.name)
        target = self.state[section.tensor.name]
        if any(p.row.mode != MODE_UNCHANGED for p in section.parts):
            self.changed.add(section.tensor.name)

        def job() -> None:
            t, changes = _decode_section(section)
            _add_in_place(target, t.bits, changes)

        return [job]

    def close(self) -> DeltaStats:
        self._finish()
        assert self._reader.layout is not None
        return _stats(self._reader.layout, self._n_changed, self._reader.received, frozenset(self._changed))


class KeyframeDecoder(_Streaming):
    """Decodes a keyframe payload while its bytes arrive, each chunk as soon as its frames are in:
    feed() pieces split anywhere, close() returns fresh contiguous CPU tensors, bit-identical to the
    encoded state, in payload order; with ``pin``, in pinned host memory (a node whose engine is on a
    GPU: its installs then copy without blocking, ``weights/load.py``), or in pageable memory where
    none can be pinned (the installs then block; said once, the version still applies)."""

    def __init__(self, pin: bool = False) -> None:
        super().__init__(KIND_KEYFRAME, by_part=True)
        self.pin = pin
        self._out: dict[str, torch.Tensor] = {}
        self._flat: dict[str, np.ndarray] = {}  # their bits, which the chunks fill (disjoint ranges)

    def _on_layout(self, layout: list[_Tensor]) -> None:
        for t in layout:
            signed = self._host_empty(t.shape, t.bits.int_dtype)
            self._out[t.name] = signed.view(t.bits.dtype)
            self._flat[t.name] = signed.numpy().reshape(-1).view(t.bits.np_uint)

    def _host_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if self.pin:
            try:
                return torch.empty(shape, dtype=dtype, pin_memory=True)
            except RuntimeError as e:  # page-locked memory exhausted (or no accelerator): pageable, and blocking installs
                self.pin = False
                log.warning("keyframe: cannot pin host memory (%s); decoding into pageable memory", str(e)[:200])
        return torch.empty(shape, dtype=dtype)

    def _jobs(self, section: _Section) -> list[Callable[[], None]]:
        t = section.tensor
        return [partial(_decode_raw, t, p, self._flat[t.name]) for p in section.parts]

    def close(self) -> dict[str, torch.Tensor]:
        self._finish()
        return self._out


def decode_keyframe(payload: bytes | bytearray | memoryview) -> dict[str, torch.Tensor]:
    """Fresh contiguous CPU tensors, bit-identical to the encoded state."""
    decoder = KeyframeDecoder()
    decoder.feed(payload)
    return decoder.close()
