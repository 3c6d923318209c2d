"""Weight-delta codec on real AdamW updates: size vs the naive format, and throughput.

Builds a ~100M-parameter Qwen2 model from a config (no downloads), keeps fp32 master weights,
runs a few AdamW steps on random tokens at each learning rate, casts every version to bf16 and
encodes version v against v-1. Reports, per lr: the sparsity seen, bytes per changed element
and payload of ours vs the naive (uint32 index, bf16 value) pairs vs a full bf16 sync, and
encode / apply throughput in GB/s of model bytes next to a plain memory copy.

    python benchmarks/bench_delta.py [--quick]

The last stdout line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from transformers import Qwen2ForCausalLM

from astraflow.weights.delta import (
    apply_delta,
    decode_keyframe,
    encode_delta,
    encode_keyframe,
    naive_delta_size,
    state_digest,
    to_bf16_state,
)

LRS = (1e-6, 1e-5)
REPEATS = 3  # timings: best of REPEATS per version, median over versions
_T = TypeVar("_T")


def build_model(quick: bool) -> Qwen2ForCausalLM:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if quick:
        cfg = Qwen2Config(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, intermediate_size=256, vocab_size=1000,
                          tie_word_embeddings=True)
    else:  # ~100M parameters
        cfg = Qwen2Config(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                          num_key_value_heads=4, intermediate_size=2048, vocab_size=32000,
                          tie_word_embeddings=True)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).float()


def timed(fn: Callable[[], _T]) -> tuple[_T, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def best_time(fn: Callable[[], object], setup: Callable[[], None] = lambda: None) -> float:
    times = []
    for _ in range(REPEATS):
        setup()
        times.append(timed(fn)[1])
    return min(times)


def memcpy_gbps(state: dict[str, torch.Tensor], model_bytes: int) -> dict[str, float]:
    """The physical limit: copy the same bytes (clone allocates; copy_/copyto reuse a buffer)."""
    tensors = list(state.values())
    outs = [torch.empty_like(t) for t in tensors]
    arrays = [t.view(torch.int16).numpy() for t in tensors]
    np_outs = [o.view(torch.int16).numpy() for o in outs]

    def torch_copy() -> None:
        for t, o in zip(tensors, outs, strict=True):
            o.copy_(t)

    def numpy_copy() -> None:
        for a, o in zip(arrays, np_outs, strict=True):
            np.copyto(o, a)

    def gbps(fn: Callable[[], object]) -> float:
        return model_bytes / best_time(fn) / 1e9

    return {"torch_clone_gbps": gbps(lambda: [t.clone() for t in tensors]),
            "torch_copy_gbps": gbps(torch_copy), "numpy_copy_gbps": gbps(numpy_copy)}


def run_lr(model: torch.nn.Module, init: dict[str, torch.Tensor], lr: float, steps: int,
           batch: tuple[int, int], vocab: int) -> dict[str, float]:
    """AdamW steps at `lr` from `init`; encode and apply each bf16 version against the last."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(init[name])
    params = dict(model.named_parameters())
    opt = torch.optim.AdamW(params.values(), lr=lr, weight_decay=0.01)
    prev = to_bf16_state(params)
    rows: list[dict[str, float]] = []
    for _ in range(steps):
        tokens = torch.randint(0, vocab, batch)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        cur = to_bf16_state(params)
        payload, stats = encode_delta(prev, cur)
        t_enc = best_time(lambda: encode_delta(prev, cur))
        target: dict[str, torch.Tensor] = {}

        def fresh_base() -> None:
            target.update({k: v.clone() for k, v in prev.items()})

        t_apply = best_time(lambda: apply_delta(target, payload), setup=fresh_base)
        assert state_digest(target) == state_digest(cur), "delta did not round-trip"
        rows.append({
            "sparsity": stats.sparsity,
            "n_changed": stats.n_changed,
            "payload_bytes": stats.payload_bytes,
            "naive_bytes": naive_delta_size(prev, cur),
            "encode_gbps": stats.model_bytes / t_enc / 1e9,
            "apply_gbps": stats.model_bytes / t_apply / 1e9,
        })
        prev = cur
    mean = {k: statistics.fmean(r[k] for r in rows) for k in rows[0]}
    median = {k: statistics.median(r[k] for r in rows) for k in ("encode_gbps", "apply_gbps")}
    return {
        "steps": steps,
        "sparsity_mean": mean["sparsity"],
        "sparsity_min": min(r["sparsity"] for r in rows),
        "changed_per_step": mean["n_changed"],
        "ours_bytes_per_changed": mean["payload_bytes"] / mean["n_changed"],
        "naive_bytes_per_changed": mean["naive_bytes"] / mean["n_changed"],
        "ours_payload_bytes": mean["payload_bytes"],
        "naive_payload_bytes": mean["naive_bytes"],
        "ours_vs_naive": mean["naive_bytes"] / mean["payload_bytes"],
        "encode_gbps_median": median["encode_gbps"],
        "encode_gbps_best": max(r["encode_gbps"] for r in rows),
        "apply_gbps_median": median["apply_gbps"],
        "apply_gbps_best": max(r["apply_gbps"] for r in rows),
    }


def keyframe_figures(state: dict[str, torch.Tensor], model_bytes: int) -> dict[str, float]:
    payload = encode_keyframe(state)
    assert state_digest(decode_keyframe(payload)) == state_digest(state), "keyframe round trip"
    t_enc = best_time(lambda: encode_keyframe(state))
    t_dec = best_time(lambda: decode_keyframe(payload))
    return {"keyframe_bytes": len(payload), "keyframe_encode_gbps": model_bytes / t_enc / 1e9,
            "keyframe_decode_gbps": model_bytes / t_dec / 1e9}


def render(report: dict, console: Console) -> None:
    mb = report["model_bytes"]
    table = Table(title=f"Weight deltas: {report['params'] / 1e6:.1f}M params, "
                        f"{mb / 1e6:.0f} MB bf16, AdamW, {report['threads']} torch threads")
    table.add_column("per step (mean)")
    for lr in report["lrs"]:
        table.add_column(f"lr {lr}", justify="right")
    lrs = list(report["lrs"].values())

    def row(label: str, fmt: Callable[[dict], str]) -> None:
        table.add_row(label, *(fmt(r) for r in lrs))

    row("unchanged bf16 values (min)",
        lambda r: f"{100 * r['sparsity_mean']:.2f} % ({100 * r['sparsity_min']:.2f} %)")
    row("changed elements", lambda r: f"{r['changed_per_step'] / 1e6:.2f} M")
    row("bytes / changed: ours", lambda r: f"{r['ours_bytes_per_changed']:.3f}")
    row("bytes / changed: naive pairs", lambda r: f"{r['naive_bytes_per_changed']:.3f}")
    row("payload: ours", lambda r: f"{r['ours_payload_bytes'] / 1e6:.2f} MB")
    row("payload: naive pairs", lambda r: f"{r['naive_payload_bytes'] / 1e6:.2f} MB")
    row("payload: full bf16 sync", lambda r: f"{mb / 1e6:.2f} MB")
    row("ours smaller than naive / full",
        lambda r: f"{r['ours_vs_naive']:.2f}x / {mb / r['ours_payload_bytes']:.0f}x")
    row("encode: median (best)",
        lambda r: f"{r['encode_gbps_median']:.2f} ({r['encode_gbps_best']:.2f}) GB/s")
    row("validate + apply in place: median (best)",
        lambda r: f"{r['apply_gbps_median']:.2f} ({r['apply_gbps_best']:.2f}) GB/s")
    row("memory copy: torch clone", lambda r: f"{report['torch_clone_gbps']:.2f} GB/s")
    row("memory copy: torch copy_ / numpy copyto",
        lambda r: f"{report['torch_copy_gbps']:.2f} / {report['numpy_copy_gbps']:.2f} GB/s")
    console.print(table)
    console.print(f"keyframe: {report['keyframe_bytes'] / 1e6:.1f} MB "
                  f"({report['keyframe_bytes'] / mb:.3f} of bf16), encode "
                  f"{report['keyframe_encode_gbps']:.2f} GB/s, decode "
                  f"{report['keyframe_decode_gbps']:.2f} GB/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, smoke run")
    parser.add_argument("--steps", type=int, default=None, help="AdamW steps per lr")
    args = parser.parse_args()
    steps = args.steps or (2 if args.quick else 4)
    console = Console(width=100)

    model = build_model(args.quick)
    init = {k: v.detach().clone() for k, v in model.named_parameters()}
    bf16 = to_bf16_state(init)
    model_bytes = sum(t.numel() * 2 for t in bf16.values())
    report: dict = {
        "quick": args.quick,
        "params": sum(t.numel() for t in bf16.values()),
        "model_bytes": model_bytes,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        **memcpy_gbps(bf16, model_bytes),
        **keyframe_figures(bf16, model_bytes),
        "lrs": {},
    }
    for lr in LRS:
        with console.status(f"AdamW at lr {lr:g}"):
            report["lrs"][f"{lr:g}"] = run_lr(model, init, lr, steps, batch=(2, 32),
                                              vocab=model.config.vocab_size)
    render(report, console)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
