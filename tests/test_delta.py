"""Weight-version codec: bit-exact round trips, refusals that touch nothing, and sizes."""

from __future__ import annotations

import hashlib
import struct
from itertools import pairwise

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from astraflow.weights.delta import (
    DELTA_FORMAT_VERSION,
    DeltaApplier,
    DeltaError,
    DeltaStats,
    KeyframeDecoder,
    apply_delta,
    changed_tensors,
    decode_keyframe,
    encode_delta,
    encode_keyframe,
    iter_encode_delta,
    iter_encode_keyframe,
    naive_delta_size,
    state_digest,
    to_bf16_state,
    whole_of,
)

DTYPES = {torch.bfloat16: np.uint16, torch.float16: np.uint16, torch.float32: np.uint32}
SHAPES = st.one_of(
    st.just(()),
    st.lists(st.integers(0, 9), min_size=1, max_size=3).map(tuple),
    st.sampled_from([(0,), (1,), (257,), (3, 0, 2), (1031,), (17, 61)]),
)
PROPERTY = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def bits(t: torch.Tensor) -> np.ndarray:
    """The tensor's raw bits as unsigned integers (copy)."""
    same_size = torch.int16 if t.element_size() == 2 else torch.int32
    return t.detach().contiguous().view(same_size).numpy().reshape(-1).view(DTYPES[t.dtype]).copy()


def from_bits(raw: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    signed = raw.view(np.int16 if raw.itemsize == 2 else np.int32).copy()
    return torch.from_numpy(signed).view(dtype).reshape(shape)


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and np.array_equal(bits(a[k]), bits(b[k])) for k in a)


def clone(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state.items()}


def random_tensor(rng: np.random.Generator, dtype: torch.dtype,
                  shape: tuple[int, ...]) -> torch.Tensor:
    """Realistic weights with a sprinkling of special values (NaN, inf, -0.0, subnormals)."""
    n = int(np.prod(shape))
    values = torch.from_numpy(rng.normal(0, 0.02, n).astype(np.float32)).to(dtype)
    raw = bits(values)
    special = rng.random(n) < 0.02
    raw[special] = rng.integers(0, np.iinfo(raw.dtype).max, int(special.sum()), dtype=raw.dtype,
                                endpoint=True)
    return from_bits(raw, dtype, shape)


def perturb(rng: np.random.Generator, t: torch.Tensor, fraction: float,
            small: bool) -> torch.Tensor:
    """Change about `fraction` of the elements: by a few ulps, or to arbitrary bits."""
    raw = bits(t).reshape(-1)
    pick = rng.random(raw.size) < fraction
    m = int(pick.sum())
    if small:
        step = rng.choice(np.array([1, 2, 3, -1, -2, -3], dtype=np.int64), m)
        raw[pick] = ((raw[pick].astype(np.int64) + step) % (1 << (8 * raw.itemsize))).astype(
            raw.dtype)
    else:
        raw[pick] = rng.integers(0, np.iinfo(raw.dtype).max, m, dtype=raw.dtype, endpoint=True)
    return from_bits(raw, t.dtype, tuple(t.shape))


@st.composite
def version_pairs(draw: st.DrawFn) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    base, new = {}, {}
    for i in range(draw(st.integers(0, 4))):
        dtype = draw(st.sampled_from(list(DTYPES)))
        name = f"layers.{i}.w"
        base[name] = random_tensor(rng, dtype, draw(SHAPES))
        fraction = draw(st.sampled_from([0.0, 1.0, 0.003, 0.05, 0.5, 0.9]) | st.floats(0, 1))
        new[name] = perturb(rng, base[name], fraction, small=draw(st.booleans()))
    return base, new


# ---------------------------------------------------------------- round trips


@PROPERTY
@given(version_pairs())
def test_delta_round_trip_is_bit_exact_and_in_place(pair):
    base, new = pair
    payload, stats = encode_delta(base, new)
    target = clone(base)
    objects = {k: (v, v.data_ptr()) for k, v in target.items()}

    applied = apply_delta(target, payload)

    assert same_bits(target, new)
    assert all(target[k] is t and t.data_ptr() == ptr for k, (t, ptr) in objects.items())
    changed = sum(int((bits(base[k]) != bits(new[k])).sum()) for k in base)
    assert stats == applied
    assert stats.n_changed == changed
    assert stats.n_elements == sum(t.numel() for t in base.values())
    assert stats.model_bytes == sum(t.numel() * t.element_size() for t in base.values())
    assert stats.payload_bytes == len(payload)


@PROPERTY
@given(version_pairs())
def test_keyframe_round_trip_is_bit_exact(pair):
    _, state = pair
    decoded = decode_keyframe(encode_keyframe(state))
    assert same_bits(decoded, state)
    assert list(decoded) == list(state)
    assert all(t.is_contiguous() for t in decoded.values())


def test_empty_state_round_trips():
    payload, stats = encode_delta({}, {})
    assert apply_delta({}, payload) == stats == DeltaStats(0, 0, len(payload), 0)
    assert stats.sparsity == 1.0
    assert decode_keyframe(encode_keyframe({})) == {}


def test_large_gaps_use_wider_positions():
    n = 1 << 20
    base = {"w": torch.zeros(n, dtype=torch.bfloat16)}
    new = clone(base)
    new["w"][[0, 300, 70_000, n - 1]] = 1.0  # gaps need 1, 2 and 3 bytes
    payload, stats = encode_delta(base, new)
    target = clone(base)
    apply_delta(target, payload)
    assert same_bits(target, new) and stats.n_changed == 4


def only_chunk_mode(payload: bytes) -> tuple[int, int]:
    """(mode, width) of the one chunk of a one-tensor payload: the first index row after the layout and section head."""
    (layout_len,) = struct.unpack_from("<I", payload, 16)
    mode, width, _ = struct.unpack_from("<BBI", payload, 24 + layout_len + 8)
    return mode, width


@pytest.mark.parametrize("changed, expect", [  # 1,000 bf16 values: dense is 2,000 B, sparse is chosen up to 1,500 B
    (np.arange(0, 1000, 4), (1, 1)),  # 250 a gap of 3 apart: 250 x (1 + 2) = 750 B sparse
    (np.arange(0, 1000, 2), (1, 1)),  # 500: 1,500 B sparse, just within
    (np.r_[1, np.arange(0, 1000, 2)], (2, 0)),  # 501: over 1,500 B sparse whatever the gaps
    (np.r_[np.arange(0, 399), 999], (2, 0)),  # 400 and one gap of 600: 2-byte gaps, 1,600 B sparse
    (np.r_[np.arange(0, 300), 999], (1, 2)),  # 301 and one gap of 699: 2-byte gaps, 1,204 B sparse
])
def test_a_chunk_is_sparse_or_dense_whichever_is_smaller(changed, expect):
    base = {"w": torch.zeros(1000, dtype=torch.bfloat16)}
    new = clone(base)
    new["w"][torch.as_tensor(changed)] = 1.0
    payload, stats = encode_delta(base, new)
    assert only_chunk_mode(payload) == expect
    target = clone(base)
    apply_delta(target, payload)
    assert same_bits(target, new) and stats.n_changed == len(changed)


@st.composite
def one_dtype_pairs(draw: st.DrawFn) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Several tensors of one dtype: a state the encoder works out whole."""
    rng, dtype = np.random.default_rng(draw(st.integers(0, 2**32 - 1))), draw(st.sampled_from(list(DTYPES)))
    base = {f"t{i}": random_tensor(rng, dtype, draw(SHAPES)) for i in range(draw(st.integers(1, 6)))}
    new = {k: perturb(rng, v, draw(st.sampled_from([0.0, 1.0, 0.003, 0.05, 0.4, 0.6, 0.9])), draw(st.booleans()))
           for k, v in base.items()}
    return base, new


@PROPERTY
@given(one_dtype_pairs(), st.sampled_from([1, 3, 64, 1000, 1 << 22]))
def test_a_small_state_worked_out_whole_encodes_as_chunk_by_chunk(pair, chunk_elements):
    base, new = pair
    whole = b"".join(iter_encode_delta(base, new, chunk_elements))
    with pytest.MonkeyPatch.context() as mp:  # every state counts as large: its chunks encode one by one
        mp.setattr("astraflow.weights.delta.PARALLEL_MIN_ELEMENTS", 0)
        by_chunk = b"".join(iter_encode_delta(base, new, chunk_elements))
    assert whole == by_chunk
    assert b"".join(iter_encode_delta(in_one_buffer(base), in_one_buffer(new), chunk_elements)) == whole  # read in place
    assert state_digest(in_one_buffer(new)) == state_digest(new)  # hashed in place
    target = clone(base)
    apply_delta(target, whole)
    assert same_bits(target, new)


def in_one_buffer(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copies of a state of one dtype laid out as ``to_bf16_state`` lays out an image, in the state's own dtype."""
    (dtype,) = {t.dtype for t in state.values()}
    buffer = torch.empty(sum(t.numel() for t in state.values()), dtype=dtype)
    at, out = 0, {}
    for name, t in state.items():
        out[name] = buffer[at:at + t.numel()].view(t.shape).copy_(t)
        at += t.numel()
    return out


def test_whole_of_finds_one_buffer_only_where_the_tensors_follow_each_other_in_it():
    image = to_bf16_state({"a": torch.randn(2, 3), "b": torch.randn(0), "c": torch.randn(()), "d": torch.randn(4)})
    whole = whole_of(list(image.values()))
    assert whole is not None and whole.shape == (11,)
    assert torch.equal(whole, torch.cat([t.reshape(-1) for t in image.values()]))
    assert whole_of([image["a"], image["d"]]) is None  # a gap
    assert whole_of([image["d"], image["a"]]) is None  # another order
    assert whole_of([image["a"], torch.randn(1).bfloat16()]) is None  # another buffer
    assert whole_of([image["a"][:, :2]]) is None  # not contiguous
    buffer = torch.zeros(4)
    assert whole_of([buffer[:2], buffer[2:].bfloat16()]) is None and whole_of([]) is None


def test_apply_writes_through_views_and_parameters():
    storage = torch.zeros(2, 6, dtype=torch.bfloat16)
    param = torch.nn.Parameter(torch.zeros(5, dtype=torch.bfloat16))
    target = {"row": storage[1], "strided": storage[0, ::2], "param": param}
    base = {k: v.detach().clone() for k, v in target.items()}
    new = {"row": base["row"] + 1, "strided": base["strided"] - 2, "param": base["param"] + 3}

    apply_delta(target, encode_delta(base, new)[0])

    assert storage[1].eq(1).all() and storage[0, ::2].eq(-2).all() and storage[0, 1::2].eq(0).all()
    assert param.detach().eq(3).all() and param.requires_grad


# ---------------------------------------------------------------- sizes


def test_sparse_update_beats_naive_pairs_by_far():
    rng = np.random.default_rng(0)
    base = {f"w{i}": random_tensor(rng, torch.bfloat16, (1024, 512)) for i in range(2)}
    new = {k: perturb(rng, v, 0.01, small=True) for k, v in base.items()}
    payload, stats = encode_delta(base, new)
    naive = naive_delta_size(base, new)
    assert naive == 6 * stats.n_changed
    assert 0.985 < stats.sparsity < 0.995
    assert stats.bytes_per_changed < 2.5
    assert len(payload) < naive / 2.4


def test_naive_size_counts_index_and_value_bytes():
    base = {"a": torch.zeros(4, dtype=torch.float32), "b": torch.zeros(3, dtype=torch.bfloat16)}
    new = {"a": torch.tensor([0.0, 1.0, 2.0, 0.0]), "b": torch.ones(3, dtype=torch.bfloat16)}
    assert naive_delta_size(base, new) == 2 * 8 + 3 * 6


def test_stats_properties():
    stats = DeltaStats(n_elements=1000, n_changed=10, payload_bytes=15, model_bytes=2000)
    assert stats.sparsity == pytest.approx(0.99)
    assert stats.bytes_per_changed == pytest.approx(1.5)
    assert DeltaStats(10, 0, 40, 20).bytes_per_changed == float("inf")


# ---------------------------------------------------------------- digest and bf16 copies


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(0, 31))
def test_digest_changes_on_any_bit(seed, bit):
    rng = np.random.default_rng(seed)
    state = {"a": random_tensor(rng, torch.float32, (7,)),
             "b": random_tensor(rng, torch.bfloat16, (3, 5))}
    name = "a" if seed % 2 else "b"
    raw = bits(state[name]).reshape(-1)
    pos = int(rng.integers(raw.size))
    raw[pos] ^= raw.dtype.type(1 << (bit % (8 * raw.itemsize)))
    flipped = dict(state, **{name: from_bits(raw, state[name].dtype, tuple(state[name].shape))})
    assert state_digest(flipped) != state_digest(state)
    assert state_digest(clone(state)) == state_digest(state)


def test_digest_covers_names_dtypes_and_shapes():
    t = torch.arange(6, dtype=torch.float16)
    ref = state_digest({"a": t})
    assert state_digest({"b": t}) != ref
    assert state_digest({"a": t.view(torch.bfloat16)}) != ref  # same bytes, other dtype
    assert state_digest({"a": t.reshape(2, 3)}) != ref  # same bytes, other shape
    assert state_digest({"a": t.reshape(2, 3).t()}) != ref
    assert len(ref) == 64 and int(ref, 16) >= 0


def test_to_bf16_state_makes_detached_contiguous_copies():
    src = {"p": torch.nn.Parameter(torch.randn(3, 4)), "h": torch.randn(4, 3).half().t(),
           "b": torch.randn(2, dtype=torch.bfloat16)}
    out = to_bf16_state(src)
    assert all(t.dtype == torch.bfloat16 and t.is_contiguous() and not t.requires_grad
               and t.device.type == "cpu" for t in out.values())
    assert whole_of(list(out.values())) is not None  # one buffer, in the state's order
    assert [t.shape for t in out.values()] == [t.shape for t in src.values()]
    assert all(torch.equal(out[k], src[k].detach().bfloat16()) for k in src)  # fp32, a transposed fp16, bf16
    out["b"] += 1
    assert not torch.equal(out["b"], src["b"])  # a copy even when already bf16
    with pytest.raises(DeltaError, match="'ids'"):
        to_bf16_state({"ids": torch.arange(3)})


# ---------------------------------------------------------------- refusals touch nothing


def small_pair() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], bytes]:
    rng = np.random.default_rng(1)
    base = {"a": random_tensor(rng, torch.bfloat16, (64, 32)),
            "b": random_tensor(rng, torch.float32, (40,)),
            "c": random_tensor(rng, torch.float16, ())}
    new = {k: perturb(rng, v, 0.3, small=True) for k, v in base.items()}
    return base, new, encode_delta(base, new)[0]


def refuses_untouched(target: dict[str, torch.Tensor], payload: bytes, match: str) -> None:
    before = clone(target)
    with pytest.raises(DeltaError, match=match):
        apply_delta(target, payload)
    assert same_bits(target, before)


@pytest.mark.parametrize("change, match", [
    (lambda s: s.update(extra=torch.zeros(2, dtype=torch.bfloat16)), "extra"),
    (lambda s: s.pop("b"), "'b'"),
    (lambda s: s.update(a=s["a"].reshape(32, 64)), "'a'.*shape"),
    (lambda s: s.update(b=s["b"].bfloat16()), "'b'.*dtype"),
    (lambda s: s.update(c=s["c"].reshape(1)), "'c'.*shape"),
])
def test_changed_tensor_set_refused_untouched(change, match):
    base, _, payload = small_pair()
    target = clone(base)
    change(target)
    refuses_untouched(target, payload, match)


def test_aliased_state_refused_untouched():
    base = {"emb": torch.zeros(4, 2, dtype=torch.bfloat16),
            "head": torch.zeros(4, 2, dtype=torch.bfloat16)}
    payload, _ = encode_delta(base, {k: v + 1 for k, v in base.items()})
    shared = torch.zeros(4, 2, dtype=torch.bfloat16)
    refuses_untouched({"emb": shared, "head": shared}, payload, "share memory")
    flat = torch.zeros(10, dtype=torch.bfloat16)
    overlapping = {"emb": flat[:8].view(4, 2), "head": flat[2:].view(4, 2)}
    refuses_untouched(overlapping, payload, "share memory")


def test_encode_refuses_mismatched_or_unsupported_states():
    base, new, _ = small_pair()
    with pytest.raises(DeltaError, match="'a'.*shape"):
        encode_delta(dict(base, a=base["a"].reshape(-1)), new)
    with pytest.raises(DeltaError, match="missing"):
        encode_delta({k: v for k, v in base.items() if k != "c"}, new)
    with pytest.raises(DeltaError, match="'d'.*unsupported"):
        encode_keyframe({"d": torch.zeros(2, dtype=torch.float64)})
    with pytest.raises(DeltaError, match="'i'.*unsupported"):
        encode_delta({"i": torch.zeros(2, dtype=torch.int64)},
                     {"i": torch.ones(2, dtype=torch.int64)})


@pytest.mark.parametrize("cut", [0, 3, 10, 19, 20, 40, -40, -5, -1])
def test_truncated_payload_refused_untouched(cut):
    base, _, payload = small_pair()
    refuses_untouched(clone(base), payload[:cut], ".")


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_corrupted_payload_is_refused_or_still_exact(data):
    base, new, payload = small_pair()
    pos = data.draw(st.integers(0, len(payload) - 1))
    flip = data.draw(st.integers(1, 255))
    corrupt = bytearray(payload)
    corrupt[pos] ^= flip
    target = clone(base)
    try:
        apply_delta(target, bytes(corrupt))
    except DeltaError:
        assert same_bits(target, base)
    else:  # only bytes that do not change the meaning (e.g. zstd window size) may pass
        assert same_bits(target, new)


def test_wrong_magic_version_and_kind_refused():
    base, new, payload = small_pair()
    refuses_untouched(clone(base), b"XXXX" + payload[4:], "magic")
    bumped = payload[:4] + (DELTA_FORMAT_VERSION + 1).to_bytes(2, "little") + payload[6:]
    refuses_untouched(clone(base), bumped, "version")
    refuses_untouched(clone(base), encode_keyframe(new), "kind")
    with pytest.raises(DeltaError, match="kind"):
        decode_keyframe(payload)
    with pytest.raises(DeltaError, match="magic"):
        decode_keyframe(b"\0" * 64)


def test_changed_tensors_reads_the_table_only():
    base, new, payload = small_pair()
    new = dict(new, c=base["c"].clone())
    payload, _ = encode_delta(base, new)
    assert changed_tensors(payload) == {"a", "b"}
    with pytest.raises(DeltaError, match="truncated"):
        changed_tensors(payload[:-1])


# ---------------------------------------------------------------- streaming


def encode_pieces(base, new, chunk_elements):
    """The pieces of iter_encode_delta and its returned stats."""
    it = iter_encode_delta(base, new, chunk_elements)
    pieces = []
    while True:
        try:
            pieces.append(next(it))
        except StopIteration as stop:
            return pieces, stop.value


def split(payload: bytes, cuts: list[int]) -> list[bytes]:
    bounds = sorted({0, len(payload), *(c % (len(payload) + 1) for c in cuts)})
    return [payload[a:b] for a, b in pairwise(bounds)]


@PROPERTY
@given(version_pairs(), st.integers(1, 600), st.lists(st.integers(0, 10**6), max_size=12))
def test_streamed_delta_matches_whole_and_applies_from_any_split(pair, chunk_elements, cuts):
    base, new = pair
    pieces, stats = encode_pieces(base, new, chunk_elements)
    payload = b"".join(pieces)
    assert stats.payload_bytes == len(payload) and stats.n_changed == encode_delta(base, new)[1].n_changed
    target = clone(base)
    applier = DeltaApplier(target)
    for piece in split(payload, cuts):
        applier.feed(piece)
    assert applier.close() == stats
    assert same_bits(target, new)
    other = clone(base)
    assert apply_delta(other, memoryview(payload)) == stats and same_bits(other, new)


@PROPERTY
@given(version_pairs(), st.integers(1, 600), st.lists(st.integers(0, 10**6), max_size=12))
def test_streamed_keyframe_decodes_from_any_split(pair, chunk_elements, cuts):
    _, state = pair
    payload = b"".join(iter_encode_keyframe(state, chunk_elements))
    decoder = KeyframeDecoder()
    for piece in split(payload, cuts):
        decoder.feed(piece)
    decoded = decoder.close()
    assert same_bits(decoded, state) and list(decoded) == list(state)
    assert same_bits(decode_keyframe(bytearray(payload)), state)


def test_whole_payload_is_the_streamed_pieces():
    base, new, payload = small_pair()
    pieces, stats = encode_pieces(base, new, 1 << 22)
    assert b"".join(pieces) == payload and stats == encode_delta(base, new)[1]
    assert b"".join(iter_encode_keyframe(new)) == encode_keyframe(new)


def test_encoder_checks_the_states_before_the_first_piece():
    base, new, _ = small_pair()
    pieces = iter_encode_delta(dict(base, a=base["a"].reshape(-1)), new)
    with pytest.raises(DeltaError, match="'a'.*shape"):
        next(pieces)
    with pytest.raises(DeltaError, match="chunk_elements"):
        next(iter_encode_keyframe(new, chunk_elements=0))


def section_spans(payload: bytes, itemsizes: dict[str, int]) -> dict[str, tuple[int, int]]:
    """Byte span of each tensor's section, read with the layout documented in the codec."""
    _, _, _, _, n_tensors, chunk, layout_len, _ = struct.unpack_from("<4sHBBIIII", payload)
    pos, names, numels = 24, [], []
    for _ in range(n_tensors):
        (name_len,) = struct.unpack_from("<H", payload, pos)
        names.append(payload[pos + 2:pos + 2 + name_len].decode())
        ndim = payload[pos + 3 + name_len]
        numels.append(int(np.prod(struct.unpack_from(f"<{ndim}Q", payload, pos + 4 + name_len))))
        pos += 4 + name_len + 8 * ndim
    assert pos == 24 + layout_len
    spans = {}
    for name, numel in zip(names, numels, strict=True):
        start = pos
        index_len, _ = struct.unpack_from("<II", payload, pos)
        row, pos = pos + 8, pos + 8 + index_len
        for _ in range(-(-numel // chunk)):
            mode, width, _ = struct.unpack_from("<BBI", payload, row)
            planes = [0, width + itemsizes[name], itemsizes[name], itemsizes[name]][mode]
            pos += sum(struct.unpack_from(f"<{planes}I", payload, row + 6))
            row += 6 + 4 * planes
        spans[name] = (start, pos)
    assert pos == len(payload)
    return spans


def three_tensor_pair() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], bytes]:
    rng = np.random.default_rng(2)
    base = {name: random_tensor(rng, torch.bfloat16, (300,)) for name in ("a", "b", "c")}
    new = {k: perturb(rng, v, 0.2, small=True) for k, v in base.items()}
    return base, new, encode_delta(base, new)[0]


def test_applier_never_applies_a_corrupted_section():
    base, new, payload = three_tensor_pair()
    start, end = section_spans(payload, {"a": 2, "b": 2, "c": 2})["b"]
    for pos in range(start, end):  # every byte of b's section: head, index, frames
        corrupt = bytearray(payload)
        corrupt[pos] ^= 0x5A
        target = clone(base)
        applier = DeltaApplier(target)
        with pytest.raises(DeltaError):
            applier.feed(bytes(corrupt[:end]))
            applier.feed(bytes(corrupt[end:]))
            applier.close()
        assert same_bits({"b": target["b"]}, {"b": base["b"]}), pos
        assert any(same_bits({"a": target["a"]}, {"a": v["a"]}) for v in (base, new))  # whole or not at all
        assert same_bits({"c": target["c"]}, {"c": base["c"]})
        with pytest.raises(DeltaError):  # a failed applier stays failed
            applier.feed(b"")


@pytest.mark.parametrize("cut_in", ["head", "a", "b", "c"])
def test_applier_refuses_a_truncated_payload(cut_in):
    base, new, payload = three_tensor_pair()
    spans = section_spans(payload, {"a": 2, "b": 2, "c": 2})
    cut = 10 if cut_in == "head" else (spans[cut_in][0] + spans[cut_in][1]) // 2
    target = clone(base)
    applier = DeltaApplier(target)
    applier.feed(payload[:cut])
    with pytest.raises(DeltaError, match="truncated"):
        applier.close()
    for name, (_start, end) in spans.items():  # whole sections applied, the cut one untouched
        assert same_bits({name: target[name]}, {name: (new if end <= cut else base)[name]})


def test_applier_refuses_trailing_bytes():
    base, _, payload = three_tensor_pair()
    applier = DeltaApplier(clone(base))
    with pytest.raises(DeltaError, match="past the last section"):
        applier.feed(payload + b"\0")


@pytest.mark.parametrize("change, match", [
    (lambda s: s.pop("b"), "missing"),
    (lambda s: s.update(b=s["b"].reshape(3, 100)), "'b'.*shape"),
    (lambda s: s.update(c=s["c"].half()), "'c'.*dtype"),
    (lambda s: s.update(d=torch.zeros(1, dtype=torch.bfloat16)), "extra"),
])
def test_applier_refuses_a_base_of_another_layout_before_touching_anything(change, match):
    base, _, payload = three_tensor_pair()
    target = clone(base)
    change(target)
    before = clone(target)
    applier = DeltaApplier(target)
    with pytest.raises(DeltaError, match=match):
        applier.feed(payload)
    assert same_bits(target, before)


def test_applier_on_a_base_of_other_values_is_caught_by_the_state_digest():
    base, new, payload = three_tensor_pair()
    other = {k: perturb(np.random.default_rng(3), v, 0.5, small=False) for k, v in base.items()}
    applier = DeltaApplier(other)
    applier.feed(payload)
    applier.close()  # the codec cannot know the values it was encoded against
    assert state_digest(other) != state_digest(new)


def test_applier_and_decoder_refuse_the_other_kind():
    base, new, payload = three_tensor_pair()
    with pytest.raises(DeltaError, match="kind"):
        DeltaApplier(clone(base)).feed(encode_keyframe(new))
    with pytest.raises(DeltaError, match="kind"):
        KeyframeDecoder().feed(payload)
    with pytest.raises(DeltaError, match="truncated"):
        KeyframeDecoder().close()


def test_applier_runs_sections_on_worker_threads(monkeypatch):
    monkeypatch.setattr("astraflow.weights.delta.PARALLEL_MIN_ELEMENTS", 1)
    monkeypatch.setattr("astraflow.weights.delta.WORKERS", 2)
    rng = np.random.default_rng(4)
    base = {f"w{i}": random_tensor(rng, torch.bfloat16, (64, 64)) for i in range(12)}
    new = {k: perturb(rng, v, 0.05, small=True) for k, v in base.items()}
    payload = b"".join(encode_pieces(base, new, 1000)[0])
    target = clone(base)
    applier = DeltaApplier(target)
    for piece in split(payload, list(range(0, len(payload), 777))):
        applier.feed(piece)
    applier.close()
    assert same_bits(target, new)
    assert same_bits(decode_keyframe(b"".join(iter_encode_keyframe(new, 1000))), new)
    corrupt = bytearray(payload)
    corrupt[-3] ^= 1  # in the last tensor's last frame
    target = clone(base)
    applier = DeltaApplier(target)
    with pytest.raises(DeltaError):
        applier.feed(bytes(corrupt))
        applier.close()
    assert same_bits({"w11": target["w11"]}, {"w11": base["w11"]})


def test_digest_is_sha256_over_names_dtypes_shapes_and_tensor_hashes():
    state = {"b": torch.arange(4, dtype=torch.bfloat16), "a": torch.ones(2, 3, dtype=torch.float32)}
    h = hashlib.sha256(b"AFSD2")
    for name in ("a", "b"):
        t = state[name]
        meta = f"{name}\0{t.dtype}\0{tuple(t.shape)}".encode()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        h.update(struct.pack("<Q", len(meta)) + meta + hashlib.sha256(raw).digest())
    assert state_digest(state) == h.hexdigest()


def test_a_keyframe_asked_for_pinned_memory_where_none_can_be_pinned_decodes_into_pageable_memory(caplog):
    """A node on a GPU decodes keyframes into pinned host memory; where pinning fails (page-locked memory exhausted;
    here: no accelerator at all) the keyframe still decodes, bit for bit, into pageable memory, and says so."""
    state = {"w": torch.randn(8, 4).to(torch.bfloat16), "b": torch.randn(3)}
    decoder = KeyframeDecoder(pin=True)
    decoder.feed(encode_keyframe(state))
    out = decoder.close()
    assert same_bits(out, state)
    if not torch.cuda.is_available():
        assert not any(t.is_pinned() for t in out.values())
        assert "cannot pin host memory" in caplog.text and decoder.pin is False
