"""Weight codec at Qwen3-1.7B scale: keyframe, delta, streaming, digest, peak memory.

The state has the real names and shapes of Qwen3-1.7B (read from a ``Qwen3Config`` on the meta
device, no download: hidden 2048, 28 layers, 16 heads, 8 kv heads, head_dim 128, intermediate
6144, vocab 151936, tied embeddings; 1.72 B values, 3.44 GB in bf16), built tensor by tensor.

What is simulated, per tensor: fp32 master weights ``w ~ N(0, 0.02)`` (norm weights 1.0);
version 0 is ``bf16(w)``; one AdamW step at ``lr`` (1e-6) with decoupled weight decay 0.01,
``w <- w - lr * (sign(g) + 0.01 w)`` with ``g ~ N(0, 1)`` fresh per element: the update of
Adam's first (bias-corrected) step, whose ``m / sqrt(v)`` is exactly ``sign(g)``; later steps
have ``|m / sqrt(v)| <= 1``, so this is the densest update of that lr. Version 1 is ``bf16(w)``.
Masters come from a seeded generator, so each version is built on its own (tensor by tensor, the
master dropped at once): the keyframe runs hold version 0 only; the deltas apply onto version 0
itself, put back by a reverse delta after each run.

Measured, each the best of ``--repeats`` in wall and in CPU seconds (all threads), the codecs
interleaved repeat by repeat: keyframe encode / decode (GB/s of raw bf16 bytes),
delta encode / apply (and bytes per changed value), the streaming forms (pieces out of
``iter_encode_*``; ``DeltaApplier`` / ``KeyframeDecoder`` fed 2 MiB pieces, the object-store
chunk size), ``state_digest``, and the peak RSS each step adds above what was resident before
it (first run). ``--baseline FILE`` loads another ``delta.py`` (e.g. the previous codec,
``git show 178714a:astraflow/weights/delta.py > /tmp/delta_v1.py``) and measures its keyframe,
delta and digest side by side in the same run.

    python benchmarks/bench_weights_scale.py [--quick] [--baseline /tmp/delta_v1.py]

The last stdout line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from astraflow.weights import delta as codec

PIECE = 2 * 1024 * 1024  # the object store's chunk size: what a node receives at a time
THIS, BASELINE = "this", "baseline"
_T = TypeVar("_T")


QWEN3: dict[str, dict[str, Any]] = {  # Qwen3 configs by name: the real 1.7B shape, a ~100M one of the same family, a tiny one
    "1.7b": dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 intermediate_size=6144, vocab_size=151936),
    "100m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4, head_dim=64,
                 intermediate_size=2048, vocab_size=32768),
    "quick": dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  intermediate_size=768, vocab_size=8192),
}


def qwen3_layout(quick: bool | str) -> list[tuple[str, tuple[int, ...]]]:
    """Parameter names and shapes of Qwen3-1.7B (or a tiny Qwen3 with ``quick``, or a ``QWEN3`` preset by name), tied embeddings."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    preset = quick if isinstance(quick, str) else "quick" if quick else "1.7b"
    with torch.device("meta"):
        model = Qwen3ForCausalLM(Qwen3Config(**QWEN3[preset], tie_word_embeddings=True))
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


def simulate(layout: list[tuple[str, tuple[int, ...]]], lr: float, version: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """bf16 version ``version`` of fp32 masters after that many AdamW-like steps (see the module doc); the same seed
    gives the same masters and steps, so the versions can be built one at a time. Each tensor draws its master and
    first step from one generator (versions 0 and 1 draw alike), its later steps from a generator of its own (seeded
    by tensor and step), so every version draws the same values for what the versions share."""
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for i, (name, shape) in enumerate(layout):
        master = torch.ones(shape) if name.endswith("norm.weight") else torch.randn(shape, generator=gen).mul_(0.02)
        g = torch.randn(shape, generator=gen)  # the first step's draw
        for k in range(version):
            if k:
                g = None  # one draw resident at a time (the largest tensor's is 1.2 GB)
                g = torch.randn(shape, generator=torch.Generator().manual_seed(seed * 1_000_003 + i * 1_009 + k))
            master.sub_(g.sign_().add_(master, alpha=0.01), alpha=lr)  # w <- w - lr (sign(g) + wd w)
        state[name] = master.bfloat16()
    return state


def rss() -> tuple[int, int]:
    """(current, peak since the last reset) resident bytes of this process."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def trim() -> None:
    """Give free heap pages back, so each step starts from the same heap and its peak RSS shows."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def peak_extra(fn: Callable[[], _T]) -> tuple[_T, int]:
    """fn's result and the peak RSS it added above what was resident when it started."""
    trim()
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    before = rss()[0]
    out = fn()
    return out, rss()[1] - before


class Timer:
    """Best wall and CPU seconds of each figure over interleaved repeats (CPU: all threads of the process)."""

    def __init__(self) -> None:
        self.best: dict[tuple[str, str], tuple[float, float]] = {}

    def run(self, codec_name: str, figure: str, fn: Callable[[], _T]) -> _T:
        trim()
        wall, cpu = time.perf_counter(), time.process_time()
        out = fn()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        old = self.best.get((codec_name, figure), (math.inf, math.inf))
        self.best[codec_name, figure] = (min(old[0], wall), min(old[1], cpu))
        return out

    def figures(self, codec_name: str) -> dict[str, float]:
        out = {}
        for (name, figure), (wall, cpu) in self.best.items():
            if name == codec_name:
                out[f"{figure}_s"], out[f"{figure}_cpu_s"] = wall, cpu
        return out


def pieces(payload: bytes, size: int = PIECE) -> Iterator[memoryview]:
    view = memoryview(payload)
    return (view[i:i + size] for i in range(0, len(view), size))


def drain(it: Iterator[bytes]) -> int:
    """Consume an encoder's pieces as a publisher would (here: count them); the payload size."""
    return sum(len(p) for p in it)


def first_section_s(it: Iterator[bytes]) -> float:
    """Seconds until the encoder hands out its first section (after the head): when publishing can start."""
    start = time.perf_counter()
    next(it), next(it)
    return time.perf_counter() - start


def stream_decode(payload: bytes) -> dict[str, torch.Tensor]:
    decoder = codec.KeyframeDecoder()
    for piece in pieces(payload):
        decoder.feed(piece)
    return decoder.close()


def stream_apply(state: dict[str, torch.Tensor], payload: bytes) -> codec.DeltaStats:
    applier = codec.DeltaApplier(state)
    for piece in pieces(payload):
        applier.feed(piece)
    return applier.close()


def load_codec(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("delta_baseline", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def keyframe_phase(codecs: dict[str, ModuleType], state: dict[str, torch.Tensor], digest: str, repeats: int,
                   timer: Timer, out: dict[str, dict[str, Any]]) -> None:
    """Encode and decode with every codec (the streaming forms with this one), interleaved; one payload
    is resident at a time."""
    for name, mod in codecs.items():
        payload, out[name]["encode_rss"] = peak_extra(partial(mod.encode_keyframe, state))
        decoded, out[name]["decode_rss"] = peak_extra(partial(mod.decode_keyframe, payload))
        assert codec.state_digest(decoded) == digest, f"{name}: keyframe round trip"
        out[name]["bytes"] = len(payload)
        del decoded
        if mod is codec:
            size, out[name]["stream_encode_rss"] = peak_extra(lambda: drain(codec.iter_encode_keyframe(state)))
            out[name]["first_section_s"] = first_section_s(codec.iter_encode_keyframe(state))
            decoded, out[name]["stream_decode_rss"] = peak_extra(partial(stream_decode, payload))
            assert size == len(payload) and codec.state_digest(decoded) == digest, "streamed keyframe round trip"
            del decoded
        del payload
    for _ in range(repeats):
        for name, mod in codecs.items():
            payload = timer.run(name, "encode", partial(mod.encode_keyframe, state))
            timer.run(name, "decode", partial(mod.decode_keyframe, payload))
            if mod is codec:
                timer.run(name, "stream_encode", lambda: drain(codec.iter_encode_keyframe(state)))
                timer.run(name, "stream_decode", partial(stream_decode, payload))
            del payload


def delta_phase(codecs: dict[str, ModuleType], base: dict[str, torch.Tensor], new: dict[str, torch.Tensor],
                digests: tuple[str, str], repeats: int, timer: Timer, out: dict[str, dict[str, Any]]) -> None:
    """Encode with every codec, and apply onto the base itself (the streaming forms with this one); after
    each apply a reverse delta puts the base back, so no third copy of the state is needed."""
    reverse, _ = codec.encode_delta(new, base)

    def applied(what: str) -> None:
        assert codec.state_digest(base) == digests[1], f"{what}: delta round trip"
        codec.apply_delta(base, reverse)

    payloads = {}
    for name, mod in codecs.items():
        (payloads[name], stats), out[name]["encode_rss"] = peak_extra(partial(mod.encode_delta, base, new))
        _, out[name]["apply_rss"] = peak_extra(partial(mod.apply_delta, base, payloads[name]))
        applied(name)
        out[name].update(bytes=len(payloads[name]), n_changed=stats.n_changed)
    _, out[THIS]["stream_apply_rss"] = peak_extra(lambda: stream_apply(base, payloads[THIS]))
    applied("streamed")
    for _ in range(repeats):
        for name, mod in codecs.items():
            timer.run(name, "encode", partial(mod.encode_delta, base, new))
            timer.run(name, "apply", partial(mod.apply_delta, base, payloads[name]))
            applied(name)
        timer.run(THIS, "stream_encode", lambda: drain(codec.iter_encode_delta(base, new)))
        timer.run(THIS, "stream_apply", lambda: stream_apply(base, payloads[THIS]))
        applied("streamed")
    assert codec.state_digest(base) == digests[0], "base restored"


def copy_gbps(state: dict[str, torch.Tensor], model_bytes: int, repeats: int) -> float:
    """One thread copying the same bytes into preallocated arrays: a memory-speed reference."""
    src = [t.view(torch.int16).numpy() for t in state.values()]
    dst = [np.zeros_like(a) for a in src]  # pages faulted in before the timing

    def copy() -> None:
        for d, s in zip(dst, src, strict=True):
            np.copyto(d, s)

    timer = Timer()
    for _ in range(repeats):
        timer.run("", "copy", copy)
    return model_bytes / timer.best["", "copy"][0] / 1e9


def render(r: dict[str, Any], console: Console) -> None:
    mb = r["model_bytes"]
    names = list(r["codecs"])
    load = ", ".join(f"{x:.1f}" for x in r["loadavg"])
    table = Table(title=f"Weight codec at {r['params'] / 1e9:.2f} B params ({mb / 1e9:.2f} GB bf16), lr {r['lr']:g}, "
                        f"{r['cpu_count']} cores (load average {load}); best of {r['repeats']}, wall (CPU) seconds")
    table.add_column("figure")
    for name in names:
        table.add_column(f"{name}: format v{r['codecs'][name]['format_version']}", justify="right")
    if len(names) > 1:
        table.add_column(f"{names[1]} / {names[0]}", justify="right")

    def speed(phase: str, figure: str) -> tuple[Callable[[dict[str, Any]], str], Callable[[dict[str, Any]], float]]:
        def fmt(c: dict[str, Any]) -> str:
            wall, cpu = c[phase][f"{figure}_s"], c[phase][f"{figure}_cpu_s"]
            return f"{mb / wall / 1e9:.2f} GB/s ({wall:.2f} s, cpu {cpu:.2f} s)"
        return fmt, lambda c: c[phase][f"{figure}_s"]

    def value(phase: str, key: str, fmt: Callable[[float], str]) -> tuple[Callable[[dict[str, Any]], str],
                                                                              Callable[[dict[str, Any]], float]]:
        return lambda c: fmt(c[phase][key]), lambda c: c[phase][key]

    def row(label: str, cell: tuple[Callable[[dict[str, Any]], str], Callable[[dict[str, Any]], float]]) -> None:
        fmt, key = cell
        cells = [fmt(r["codecs"][n]) if _has(r["codecs"][n], key) else "" for n in names]
        if len(names) > 1:
            a, b = (r["codecs"][n] for n in names)
            cells.append(f"{key(b) / key(a):.2f}" if _has(a, key) and _has(b, key) and key(a) else "")
        table.add_row(label, *cells)

    def gb(b):
        return f"{b / 1e9:.3f} GB ({b / mb:.3f} of raw)"
    def gib(b):
        return f"{b / 2**30:.2f} GiB"
    row("keyframe payload", value("keyframe", "bytes", gb))
    row("keyframe encode", speed("keyframe", "encode"))
    row("keyframe encode, streamed pieces", speed("keyframe", "stream_encode"))
    row("keyframe encode, first section out after", value("keyframe", "first_section_s", lambda s: f"{s:.2f} s"))
    row("keyframe decode", speed("keyframe", "decode"))
    row("keyframe decode, fed 2 MiB pieces", speed("keyframe", "stream_decode"))
    row("delta payload", value("delta", "bytes", lambda b: f"{b / 1e6:.1f} MB"))
    row("delta bytes / changed value", value("delta", "bytes_per_changed", lambda b: f"{b:.3f}"))
    row("delta encode", speed("delta", "encode"))
    row("delta encode, streamed pieces", speed("delta", "stream_encode"))
    row("delta apply (whole payload checked first)", speed("delta", "apply"))
    row("delta apply, fed 2 MiB pieces", speed("delta", "stream_apply"))
    row("delta encode + apply", value("delta", "encode_apply_s", lambda s: f"{s:.2f} s"))
    row("state_digest", speed("digest", "digest"))
    for phase, step in (("keyframe", "encode"), ("keyframe", "stream_encode"), ("keyframe", "decode"),
                        ("keyframe", "stream_decode"), ("delta", "encode"), ("delta", "apply"), ("delta", "stream_apply")):
        row(f"peak RSS added: {phase} {step.replace('_', ' ')}", value(phase, f"{step}_rss", gib))
    console.print(table)
    d = r["codecs"][THIS]["delta"]
    console.print(
        f"changed values: {d['n_changed'] / 1e6:.1f} M of {r['params'] / 1e6:.0f} M "
        f"({100 * d['n_changed'] / r['params']:.2f} %); resident for the delta runs: "
        f"{r['rss_start'] / 2**30:.2f} GiB (two bf16 versions; one for the keyframe runs); "
        f"one-thread numpy copy of the state: {r['copy_gbps']:.2f} GB/s"
    )


def _has(c: dict[str, Any], key: Callable[[dict[str, Any]], float]) -> bool:
    try:
        key(c)
    except KeyError:
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny Qwen3, smoke run")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline", help="another delta.py to measure side by side (e.g. the previous codec)")
    args = parser.parse_args()
    console = Console(width=140)

    layout = qwen3_layout(args.quick)
    with console.status("building version 0"):
        v0 = simulate(layout, args.lr, version=0)
    model_bytes = sum(t.numel() * t.element_size() for t in v0.values())
    codecs = {THIS: codec} | ({BASELINE: load_codec(args.baseline)} if args.baseline else {})
    out: dict[str, dict[str, Any]] = {n: {"format_version": m.DELTA_FORMAT_VERSION} for n, m in codecs.items()}
    report: dict[str, Any] = {
        "quick": args.quick, "lr": args.lr, "repeats": args.repeats, "params": sum(t.numel() for t in v0.values()),
        "model_bytes": model_bytes, "cpu_count": os.cpu_count(), "workers": codec.WORKERS,
        "copy_gbps": copy_gbps(v0, model_bytes, args.repeats), "baseline_path": args.baseline, "codecs": out,
    }
    phases: dict[str, dict[str, dict[str, Any]]] = {"keyframe": {n: {} for n in codecs}, "delta": {n: {} for n in codecs}}
    timers = {"keyframe": Timer(), "delta": Timer(), "digest": Timer()}
    with console.status("keyframes"):
        keyframe_phase(codecs, v0, codec.state_digest(v0), args.repeats, timers["keyframe"], phases["keyframe"])
    with console.status("building version 1"):
        v1 = simulate(layout, args.lr, version=1)  # only now: a keyframe's payloads and decoded copy are gone
    report["rss_start"] = rss()[0]
    with console.status("deltas"):
        digests = (codec.state_digest(v0), codec.state_digest(v1))
        delta_phase(codecs, v0, v1, digests, args.repeats, timers["delta"], phases["delta"])
    with console.status("digests"):
        for _ in range(args.repeats):
            for name, mod in codecs.items():
                timers["digest"].run(name, "digest", partial(mod.state_digest, v1))
    for name in codecs:
        for phase, timer in timers.items():
            out[name][phase] = phases.get(phase, {}).get(name, {}) | timer.figures(name)
        d = out[name]["delta"]
        d.update(bytes_per_changed=d["bytes"] / d["n_changed"], encode_apply_s=d["encode_s"] + d["apply_s"])
    report["loadavg"] = os.getloadavg()
    render(report, console)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
