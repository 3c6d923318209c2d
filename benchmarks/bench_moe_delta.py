"""How sparse the weight deltas of a Mixture-of-Experts model are, beside a dense model, under AdamW.

For each model (a dense Qwen2 and Qwen3-MoE models built from a config, the arithmetic recipe's
width) and each optimizer setting (``trainer.unrouted_experts`` step / hold, weight decay 0 / 0.1),
the torch backend trains the same real-token batches (sampled from the model once per model) and,
after every step, compares the bf16 image with the previous one:

* ``quiet``: the share of experts (layer x expert) whose gradient row was exactly zero in the step
  (no token of the batch reached them; read from the gradients just before the optimizer step);
* ``unchanged``: the share of experts whose bf16 weights (their rows of ``gate_up_proj`` and
  ``down_proj``) did not change at all;
* ``elements_unchanged``: the share of all bf16 values that did not change (experts and the rest);
* ``delta_bytes``: the encoded delta (``weights/delta.py``), beside the keyframe's size.

Two batch sizes: the recipe's (8 groups of 8, up to 4 new tokens) and a small one (1 group of 4),
where experts go unrouted. Means over steps after the first (``--steps``).

Run: ``python benchmarks/bench_moe_delta.py [--steps 10]``. Last stdout line: JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

import torch

from astraflow.config import parse_recipe
from astraflow.models import build_model, load_tokenizer
from astraflow.tasks import load_split
from astraflow.train.experts import expert_params, quiet_experts
from astraflow.train.synthetic import sample_batches
from astraflow.train.torch_backend import TorchBackend
from astraflow.weights.delta import encode_delta, encode_keyframe

WIDTH = {"hidden_size": 64, "intermediate_size": 256, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}  # recipes/arithmetic
MODELS = {
    "dense": {"arch": "qwen2"},
    "moe-8x2": {"arch": "qwen3_moe", "num_experts": 8, "experts_per_token": 2, "moe_intermediate_size": 128},
    "moe-32x2": {"arch": "qwen3_moe", "num_experts": 32, "experts_per_token": 2, "moe_intermediate_size": 128},
}
OPTIMIZERS = {"step": {"unrouted_experts": "step"}, "step-wd0.1": {"unrouted_experts": "step", "weight_decay": 0.1},
              "hold": {"unrouted_experts": "hold"}, "hold-wd0.1": {"unrouted_experts": "hold", "weight_decay": 0.1}}
BATCHES = {"recipe": {"groups_per_batch": 8, "group_size": 8}, "small": {"groups_per_batch": 1, "group_size": 4}}


def expert_rows_changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], names: list[str]) -> torch.Tensor:
    """(layers x experts,) bool: an expert changed if any bf16 value of its rows did."""
    by_layer: dict[str, torch.Tensor] = {}
    for n in names:
        layer = n.rsplit(".experts.", 1)[0]
        rows = (before[n] != after[n]).flatten(1).any(dim=1)  # (E,)
        by_layer[layer] = by_layer[layer] | rows if layer in by_layer else rows
    return torch.cat(list(by_layer.values()))


def run(model_over: dict[str, Any], opt_over: dict[str, Any], batches: list[Any], lr: float) -> dict[str, Any]:
    recipe = parse_recipe({"name": "bench", "model": {**WIDTH, **model_over}, "trainer": {"lr": lr, **opt_over}})
    pcfg = recipe.policies["solver"]
    tok = load_tokenizer(pcfg.model.tokenizer)
    backend = TorchBackend(build_model(pcfg.model, tok), tok, pcfg.trainer)
    experts = dict((n, p) for n, p in backend.module.named_parameters() if any(p is q for q in expert_params(backend.module)))
    quiet: list[float] = []

    def count_quiet(opt: Any, args: Any, kwargs: Any) -> None:  # just before AdamW: the step's gradients
        if experts:
            quiet.append(float(torch.cat([quiet_experts(p.grad) for p in experts.values()]).float().mean()))

    backend.opt.register_step_pre_hook(count_quiet)
    prev = backend.state_dict_bf16()
    rows: list[dict[str, float]] = []
    for b in batches:
        backend.step(b)
        new = backend.state_dict_bf16()
        payload, stats = encode_delta(prev, new)
        row = {"elements_unchanged": 1 - stats.n_changed / stats.n_elements, "delta_bytes": len(payload)}
        if experts:
            row["unchanged"] = 1 - float(expert_rows_changed(prev, new, list(experts)).float().mean())
            row["quiet"] = quiet[-1]
        rows.append(row)
        prev = new
    timed = rows[1:]  # the first step has no moments yet: quiet experts stay put under any setting
    out = {k: round(statistics.mean(r[k] for r in timed), 4) for k in timed[0]}
    out["delta_bytes"] = int(out["delta_bytes"])
    out["keyframe_bytes"] = len(encode_keyframe(prev))
    return out


def main() -> dict[str, Any]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok = load_tokenizer("byt5")
    train, _ = load_split(parse_recipe({"name": "bench"}).data)
    prompts = [p.prompt for p in train[:64]]
    out: dict[str, Any] = {"width": WIDTH, "steps": args.steps, "lr": args.lr, "results": []}
    print(f"{'batch':<7} {'model':<9} {'optimizer':<11} {'quiet':>6} {'unchanged':>9} {'elem unch':>9} {'delta B':>8} {'keyframe B':>10}")
    for batch_name, shape in BATCHES.items():
        for model_name, model_over in MODELS.items():
            mcfg = parse_recipe({"name": "bench", "model": {**WIDTH, **model_over}}).policies["solver"].model
            batches = sample_batches(build_model(mcfg, tok), tok, prompts, n_batches=args.steps, max_new_tokens=4, seed=1, **shape)
            for opt_name, opt_over in OPTIMIZERS.items():
                if model_name == "dense" and opt_name.startswith("hold"):
                    continue  # hold applies to experts only
                r = run(model_over, opt_over, batches, args.lr)
                out["results"].append({"batch": batch_name, "model": model_name, "optimizer": opt_name, **r})
                print(f"{batch_name:<7} {model_name:<9} {opt_name:<11} {r.get('quiet', '-')!s:>6} {r.get('unchanged', '-')!s:>9} "
                      f"{r['elements_unchanged']:>9} {r['delta_bytes']:>8} {r['keyframe_bytes']:>10}")
    return out


if __name__ == "__main__":
    print(json.dumps(main()))
