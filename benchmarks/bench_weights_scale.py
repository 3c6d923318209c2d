"""Weight codec at Qwen3-1.7B scale: keyframe, delta, streaming, digest, peak memory.

The state has the real names and shapes of Qwen3-1.7B (read from a ``Qwen3Config`` on the meta
device, no download: hidden 2048, 28 layers, 16 heads, 8 kv heads, head_dim 128, intermediate
6144, vocab 151936, tied embeddings; 1.72 B values, 3.44 GB in bf16), built tensor by tensor.

What is simulated, per tensor: fp32 master weights ``w ~ N(0, 0.02)`` (norm weights 1.0);
version 0 is ``bf16(w)``; one AdamW step at ``lr`` (1e-6) with decoupled weight decay 0.01,
``w <- w - lr * (sign(g) + 0.01 w)`` with ``g ~ N(0, 1)`` fresh per element: the update of
Adam's first (bias-corrected) step, whose ``m / sqrt(v)`` is exactly ``sign(g)``; later steps
have ``|m / sqrt(v)| <= 1``, so this is the densest update of that lr. Version 1 is ``bf16(w)``.
The master is dropped once both versions of a tensor exist.

Measured, each the best of ``--repeats``: keyframe encode / decode (GB/s of raw bf16 bytes),
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
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from astraflow.weights import delta as codec

PIECE = 2 * 1024 * 1024  # the object store's chunk size: what a node receives at a time
_T = TypeVar("_T")


def qwen3_layout(quick: bool) -> list[tuple[str, tuple[int, ...]]]:
    """Parameter names and shapes of Qwen3-1.7B (or a tiny Qwen3 with --quick), tied embeddings."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if quick:
        cfg = Qwen3Config(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=64, intermediate_size=768, vocab_size=8192, tie_word_embeddings=True)
    else:
        cfg = Qwen3Config(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                          head_dim=128, intermediate_size=6144, vocab_size=151936, tie_word_embeddings=True)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg)
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


def simulate(layout: list[tuple[str, tuple[int, ...]]], lr: float,
             seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """bf16 versions 0 and 1 around one AdamW-like step of fp32 masters (see the module doc)."""
    gen = torch.Generator().manual_seed(seed)
    v0, v1 = {}, {}
    for name, shape in layout:
        master = torch.ones(shape) if name.endswith("norm.weight") else torch.randn(shape, generator=gen).mul_(0.02)
        v0[name] = master.bfloat16()
        step = torch.randn(shape, generator=gen).sign_().add_(master, alpha=0.01)  # sign(g) + wd * w
        v1[name] = master.sub_(step, alpha=lr).bfloat16()
    return v0, v1


def rss() -> tuple[int, int]:
    """(current, peak since the last reset) resident bytes of this process."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def peak_extra(fn: Callable[[], _T]) -> tuple[_T, int]:
    """fn's result and the peak RSS it added above what was resident when it started."""
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    before = rss()[0]
    out = fn()
    return out, rss()[1] - before


def best(fn: Callable[[], object], repeats: int, setup: Callable[[], None] = lambda: None) -> float:
    times = []
    for _ in range(repeats):
        setup()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def pieces(payload: bytes, size: int = PIECE) -> Iterator[memoryview]:
    view = memoryview(payload)
    return (view[i:i + size] for i in range(0, len(view), size))


def drain(it: Iterator[bytes]) -> int:
    """Consume an encoder's pieces as a publisher would (here: count them); the payload size."""
    return sum(len(p) for p in it)


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


def keyframe_figures(mod: ModuleType, state: dict[str, torch.Tensor], digest: str, repeats: int,
                     streaming: bool) -> dict[str, float]:
    payload, enc_rss = peak_extra(lambda: mod.encode_keyframe(state))
    t_enc = best(lambda: mod.encode_keyframe(state), repeats)
    decoded, dec_rss = peak_extra(lambda: mod.decode_keyframe(payload))
    assert codec.state_digest(decoded) == digest, "keyframe round trip"
    del decoded
    t_dec = best(lambda: mod.decode_keyframe(payload), repeats)
    out = {"bytes": len(payload), "encode_s": t_enc, "decode_s": t_dec, "encode_rss": enc_rss, "decode_rss": dec_rss}
    if streaming:
        size, out["stream_encode_rss"] = peak_extra(lambda: drain(codec.iter_encode_keyframe(state)))
        assert size == len(payload)
        out["stream_encode_s"] = best(lambda: drain(codec.iter_encode_keyframe(state)), repeats)
        decoded, out["stream_decode_rss"] = peak_extra(lambda: stream_decode(payload))
        assert codec.state_digest(decoded) == digest, "streamed keyframe round trip"
        del decoded
        out["stream_decode_s"] = best(lambda: stream_decode(payload), repeats)
    return out


def delta_figures(mod: ModuleType, base: dict[str, torch.Tensor], new: dict[str, torch.Tensor], digest: str,
                  repeats: int, streaming: bool) -> dict[str, float]:
    (payload, stats), enc_rss = peak_extra(lambda: mod.encode_delta(base, new))
    t_enc = best(lambda: mod.encode_delta(base, new), repeats)
    target: dict[str, torch.Tensor] = {}

    def fresh() -> None:
        target.clear()
        target.update({k: v.clone() for k, v in base.items()})

    fresh()
    _, apply_rss = peak_extra(lambda: mod.apply_delta(target, payload))
    assert codec.state_digest(target) == digest, "delta round trip"
    t_apply = best(lambda: mod.apply_delta(target, payload), repeats, setup=fresh)
    out = {"bytes": len(payload), "n_changed": stats.n_changed, "encode_s": t_enc, "apply_s": t_apply,
           "encode_rss": enc_rss, "apply_rss": apply_rss}
    if streaming:
        out["stream_encode_s"] = best(lambda: drain(codec.iter_encode_delta(base, new)), repeats)
        fresh()
        _, out["stream_apply_rss"] = peak_extra(lambda: stream_apply(target, payload))
        assert codec.state_digest(target) == digest, "streamed delta round trip"
        out["stream_apply_s"] = best(lambda: stream_apply(target, payload), repeats, setup=fresh)
    target.clear()
    return out


def digest_seconds(mod: ModuleType, state: dict[str, torch.Tensor], repeats: int) -> float:
    return best(lambda: mod.state_digest(state), repeats)


def copy_gbps(state: dict[str, torch.Tensor], model_bytes: int, repeats: int) -> float:
    """One thread copying the same bytes into preallocated arrays: a memory-speed reference."""
    src = [t.view(torch.int16).numpy() for t in state.values()]
    dst = [np.zeros_like(a) for a in src]  # pages faulted in before the timing

    def copy() -> None:
        for d, s in zip(dst, src, strict=True):
            np.copyto(d, s)

    return model_bytes / best(copy, repeats) / 1e9


def render(r: dict[str, Any], console: Console) -> None:
    mb = r["model_bytes"]
    has_base = "baseline" in r
    table = Table(title=f"Weight codec at {r['params'] / 1e9:.2f} B params ({mb / 1e9:.2f} GB bf16), lr {r['lr']:g}, "
                        f"{r['cpu_count']} cores")
    table.add_column("figure")
    table.add_column(f"codec v{r['format_version']}", justify="right")
    if has_base:
        table.add_column(f"baseline v{r['baseline']['format_version']}", justify="right")
        table.add_column("speed-up / ratio", justify="right")

    def gbps(s: float) -> str:
        return f"{mb / s / 1e9:.2f} GB/s ({s:.2f} s)"

    def gib(n: float) -> str:
        return f"{n / 2**30:.2f} GiB"

    def row(label: str, path: tuple[str, str], fmt: Callable[[float], str], better: str = "") -> None:
        new = r[path[0]].get(path[1])
        if new is None:
            return
        cells = [label, fmt(new)]
        if has_base:
            old = r["baseline"][path[0]].get(path[1])
            ratio = {"time": (old, new, "x"), "size": (new, old, "")}.get(better) if old else None
            cells += ["", ""] if old is None else [fmt(old), f"{ratio[0] / ratio[1]:.2f}{ratio[2]}" if ratio else ""]
        table.add_row(*cells)

    row("keyframe payload", ("keyframe", "bytes"), lambda b: f"{b / 1e9:.3f} GB ({b / mb:.3f} of raw)", "size")
    row("keyframe encode", ("keyframe", "encode_s"), gbps, "time")
    row("keyframe decode", ("keyframe", "decode_s"), gbps, "time")
    row("keyframe encode, streamed pieces", ("keyframe", "stream_encode_s"), gbps)
    row("keyframe decode, fed 2 MiB pieces", ("keyframe", "stream_decode_s"), gbps)
    row("delta payload", ("delta", "bytes"), lambda b: f"{b / 1e6:.1f} MB", "size")
    row("delta bytes / changed value", ("delta", "bytes_per_changed"), lambda b: f"{b:.3f}", "size")
    row("delta encode", ("delta", "encode_s"), gbps, "time")
    row("delta apply (all checked first)", ("delta", "apply_s"), gbps, "time")
    row("delta encode + apply", ("delta", "encode_apply_s"), lambda s: f"{s:.2f} s", "time")
    row("delta encode, streamed pieces", ("delta", "stream_encode_s"), gbps)
    row("delta apply, fed 2 MiB pieces", ("delta", "stream_apply_s"), gbps)
    row("state_digest", ("digest", "seconds"), gbps, "time")
    for phase, key in (("keyframe", "encode_rss"), ("keyframe", "decode_rss"), ("keyframe", "stream_encode_rss"),
                       ("keyframe", "stream_decode_rss"), ("delta", "encode_rss"), ("delta", "apply_rss"),
                       ("delta", "stream_apply_rss")):
        row(f"peak RSS added: {phase} {key.removesuffix('_rss').replace('_', ' ')}", (phase, key), gib, "size")
    console.print(table)
    d = r["delta"]
    console.print(f"changed values: {d['n_changed'] / 1e6:.1f} M of {r['params'] / 1e6:.0f} M "
                  f"({100 * d['n_changed'] / r['params']:.2f} %); resident before the runs: {gib(r['rss_start'])} "
                  f"(two bf16 versions); one-thread numpy copy of the state: {r['copy_gbps']:.2f} GB/s")


def measure(mod: ModuleType, v0: dict[str, torch.Tensor], v1: dict[str, torch.Tensor], digests: tuple[str, str],
            repeats: int, streaming: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"format_version": mod.DELTA_FORMAT_VERSION}
    out["keyframe"] = keyframe_figures(mod, v0, digests[0], repeats, streaming)
    out["delta"] = delta_figures(mod, v0, v1, digests[1], repeats, streaming)
    out["delta"]["bytes_per_changed"] = out["delta"]["bytes"] / out["delta"]["n_changed"]
    out["delta"]["encode_apply_s"] = out["delta"]["encode_s"] + out["delta"]["apply_s"]
    out["digest"] = {"seconds": digest_seconds(mod, v1, repeats)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny Qwen3, smoke run")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline", help="another delta.py to measure side by side (e.g. the previous codec)")
    args = parser.parse_args()
    console = Console(width=120)

    with console.status("building the state"):
        v0, v1 = simulate(qwen3_layout(args.quick), args.lr)
    model_bytes = sum(t.numel() * t.element_size() for t in v0.values())
    digests = (codec.state_digest(v0), codec.state_digest(v1))
    report: dict[str, Any] = {
        "quick": args.quick, "lr": args.lr, "repeats": args.repeats, "params": sum(t.numel() for t in v0.values()),
        "model_bytes": model_bytes, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "workers": codec.WORKERS, "rss_start": rss()[0], "copy_gbps": copy_gbps(v0, model_bytes, args.repeats),
    }
    with console.status("this codec"):
        report.update(measure(codec, v0, v1, digests, args.repeats, streaming=True))
    if args.baseline:
        with console.status("baseline codec"):
            report["baseline"] = {"path": args.baseline,
                                  **measure(load_codec(args.baseline), v0, v1, digests, args.repeats, streaming=False)}
    render(report, console)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
