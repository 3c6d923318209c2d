"""Check the sglang / vllm engines against the real engines, on a GPU or on a CPU (vLLM's CPU build).

    python examples/engine_check.py --engine vllm --mode inprocess   # vllm.LLM inside this process
    python examples/engine_check.py --engine vllm                    # a launched vLLM server (pause, reload, resume)
    python examples/engine_check.py --engine sglang                  # an SGLang server (a GPU)
    python examples/engine_check.py --engine vllm --lora [--mode inprocess]   # LoRA versions through vLLM's LoRA support
    python examples/engine_check.py --engine vllm --plane [--mode inprocess]  # then versions its worker fetches itself

Run it with the Python that has the engine installed (for vLLM on CPU: ``bash examples/vllm_cpu_env.sh``, then
``.venv-vllm/bin/python examples/engine_check.py …``). No download: the engine loads a tiny Qwen2 built from a
config (head size 32, which the CPU attention kernels support) and saved locally, so it runs on a machine without
internet. It applies weight version 0, generates, recomputes the behaviour logprobs of the same tokens with
transformers (teacher forcing, same temperature) and reports the largest difference; then applies version 1
(perturbed weights) and checks that tokens carry version 1 and that their logprobs are those of the new weights.
With ``--lora`` the versions are LoRA adapters (rank 8 on every linear layer, scale 2) over the model vLLM loaded, and
the logprobs are recomputed with the merged weights W0 + 2 B A; a version over another base must be refused.
With ``--plane``, after those two, versions 2-4 go through a real weight plane (an embedded nats-server): a trainer's publisher announces a
keyframe, a delta that changes one layer's ``gate_proj`` only (vLLM fuses it with ``up_proj``) and a delta that changes
every tensor; the node's
``WeightSync`` plans, and vLLM's worker fetches each from the object store and installs it in place
(``rollout/engines/worker_weights.py``); the report has each version's logprob check and generation stall.
Its report is one stdout line of JSON, starting ``{"engine"`` (vLLM may log after it), with ``ok``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import torch

from astraflow.config import ModelConfig, RolloutConfig
from astraflow.models import build_model, load_tokenizer
from astraflow.rollout.engines.base import GenerationRequest, SamplingParams
from astraflow.rollout.engines.registry import build_engine


def recompute(model: torch.nn.Module, prompt: list[int], ids: list[int], temperature: float) -> list[float]:
    seq = torch.tensor([prompt + ids])
    with torch.no_grad():
        logits = model(seq).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(ids)].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1).tolist()


def max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


def main() -> dict[str, object]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=["sglang", "vllm"], required=True)
    ap.add_argument("--mode", choices=["server", "inprocess"], default="server")
    ap.add_argument("--url", default=None, help="attach to a running server instead of launching one")
    ap.add_argument("--lora", action="store_true", help="versions are LoRA adapters (vllm, max_lora_rank 8)")
    ap.add_argument("--plane", action="store_true", help="versions through a weight plane, fetched by vLLM's worker")
    ap.add_argument("--partial", action="store_true", help="with --plane: partial rollouts, a version installed mid-generation")
    args = ap.parse_args()
    tok = load_tokenizer("byt5")
    mcfg = ModelConfig(hidden_size=64, intermediate_size=256, num_layers=2, num_heads=2, num_kv_heads=1, max_positions=256)
    options: dict[str, object] = {"type": args.engine, "url": args.url}
    if args.engine == "vllm":
        options["mode"] = args.mode
        options["max_lora_rank"] = 8 if args.lora else 0
    t0 = time.perf_counter()
    engine = build_engine(mcfg, RolloutConfig(engine=options, partial_rollouts=args.partial), tok)
    model = build_model(mcfg, tok).eval()
    out: dict[str, object] = {"engine": args.engine, "mode": args.mode, "build_s": round(time.perf_counter() - t0, 1)}
    try:
        if args.lora:
            return out | lora_check(engine, model, tok)
        engine.load_state(model.state_dict(), 0)
        params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=1)
        prompts = [list(tok("12+7=", add_special_tokens=False)["input_ids"]), list(tok("3+4=", add_special_tokens=False)["input_ids"])]
        t0 = time.perf_counter()
        comps = engine.generate([GenerationRequest(p, params) for p in prompts])
        out["tokens_per_s"] = round(sum(len(c.token_ids) for c in comps) / (time.perf_counter() - t0), 1)
        diffs = [
            max(abs(a - b) for a, b in zip(c.logprobs, recompute(model, p, c.token_ids, 1.0)))
            for p, c in zip(prompts, comps)
            if c.token_ids
        ]
        out.update(v0_versions=sorted({v for c in comps for v in c.versions}), v0_max_logprob_diff=max(diffs),
                   v0_tokens=[len(c.token_ids) for c in comps])
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        t0 = time.perf_counter()
        engine.load_state(model.state_dict(), 1)
        out["apply_s"] = round(time.perf_counter() - t0, 3)
        out["paused_updates"] = getattr(engine, "paused_updates", None)  # a server: each update between /pause and /resume
        comps1 = engine.generate([GenerationRequest(prompts[0], params)])
        out.update(
            v1_versions=sorted(set(comps1[0].versions)),
            v1_max_logprob_diff=max(abs(a - b) for a, b in zip(comps1[0].logprobs, recompute(model, prompts[0], comps1[0].token_ids, 1.0))),
        )
        if args.plane:
            out["plane"] = asyncio.run(plane_check(engine, model, tok, first=2, partial=args.partial))
        if args.engine == "vllm" and args.mode == "server" and args.url is None:  # a node died mid-update, one attaches
            engine.post("/pause?mode=keep")
            attached = build_engine(mcfg, RolloutConfig(engine={"type": "vllm", "url": engine.url}), tok)
            out["left_paused_resumed"] = not engine.post("/is_paused", method="GET")["is_paused"]
            attached.close()
    finally:
        engine.close()
    out["ok"] = (out.get("v0_versions") == [0] and out.get("v1_versions") == [1] and float(out["v0_max_logprob_diff"]) < 0.1  # type: ignore[arg-type]
                 and float(out.get("v1_max_logprob_diff", 9)) < 0.1  # type: ignore[arg-type]
                 and (not args.plane or out["plane"]["ok"]))  # type: ignore[index]
    return out


async def plane_check(engine: Any, model: torch.nn.Module, tok: Any, first: int, partial: bool = False) -> dict[str, object]:
    """Versions ``first`` .. ``first + 2`` through a weight plane (module doc); with ``partial`` one more, installed
    while a generation runs (``switch_check``)."""
    import tempfile

    from astraflow.streams.plane import NatsOptions, Plane
    from astraflow.streams.server import EmbeddedServer
    from astraflow.streams.topology import Topology
    from astraflow.weights.engine_held import EngineHeldImage
    from astraflow.weights.publish import WeightPublisher
    from astraflow.weights.sync import WeightSync

    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=1)
    prompt = list(tok("12+7=", add_special_tokens=False)["input_ids"])
    names = [n for n, _ in model.named_parameters()]
    gate = next(n for n in names if n.endswith("gate_proj.weight"))  # vLLM fuses it with up_proj: a part of a layer
    # a keyframe; a delta of one fused layer's part; a delta of every tensor
    changes = {first: ([], 0.0), first + 1: ([gate], 1.0), first + 2: (names, 0.05)}
    out: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as d, EmbeddedServer(d) as server:
        plane = await Plane.connect(NatsOptions(url=server.url), "enginecheck", "check")
        try:
            await plane.ensure_topology(Topology(policies=("solver",)))
            pub = WeightPublisher(plane, "solver", keyframe_every=100, max_delta_fraction=1.0)
            sync = WeightSync(plane, "solver", engine)
            out["worker_fetches"] = isinstance(sync.held, EngineHeldImage)
            gen = torch.Generator().manual_seed(0)
            for version, (changed, scale) in changes.items():
                before = {k: v.clone() for k, v in model.state_dict().items()}
                with torch.no_grad():
                    for name, p in model.named_parameters():
                        if name in changed:
                            p.add_(torch.randn(p.shape, generator=gen) * scale)
                ann = await pub.publish(model.state_dict(), version)
                await sync.wait_for(version, timeout=120)
                (c,) = engine.generate([GenerationRequest(prompt, params)])
                out[f"v{version}_encoding"] = ann.encoding
                out[f"v{version}_versions"] = sorted(set(c.versions))
                out[f"v{version}_max_logprob_diff"] = max_diff(c.logprobs, recompute(model, prompt, c.token_ids, 1.0))
                out[f"v{version}_stall_s"] = round(engine.stall_s, 4)
                if changed:  # the check tells the versions apart: the same tokens under the weights before differ
                    after = {k: v.clone() for k, v in model.state_dict().items()}
                    model.load_state_dict(before)
                    out[f"v{version}_diff_from_previous"] = max_diff(c.logprobs, recompute(model, prompt, c.token_ids, 1.0))
                    model.load_state_dict(after)
            if partial:
                out["partial"] = await switch_check(engine, model, tok, pub, sync, first + 3)
            out["sync_stats"] = dict(sync.stats)
            out["paused_updates"] = getattr(engine, "paused_updates", None)  # a server: the earlier two and these three
        finally:
            await plane.close()
    out["ok"] = (out["worker_fetches"] and [out[f"v{v}_encoding"] for v in changes] == ["keyframe", "delta", "delta"]
                 and all(out[f"v{v}_versions"] == [v] and float(out[f"v{v}_max_logprob_diff"]) < 0.1 for v in changes)  # type: ignore[arg-type]
                 and all(float(out[f"v{v}_diff_from_previous"]) > 0.1 for v in changes if changes[v][0])  # type: ignore[arg-type]
                 and (not partial or out["partial"]["ok"]))  # type: ignore[index]
    return out


async def switch_check(engine: Any, model: torch.nn.Module, tok: Any, pub: Any, sync: Any, version: int) -> dict[str, object]:
    """Partial rollouts: a version (every tensor changed) is published while long generations run back to back. The
    completions that switched carry the old version up to a token and the new one after it, and each token's logprob is
    that of the weights its version names, given everything before it (the new weights recomputed the prefix). A
    version that lands between two calls switches none of them (on a CPU the worker's fetch thread mostly gets the GIL
    while vLLM is idle, between calls): up to six versions are tried."""
    out: dict[str, object] = {"switches_before": getattr(engine, "switches", None)}
    for attempt in range(6):
        old_state = {k: v.clone() for k, v in model.state_dict().items()}
        calls = await generating_through(engine, model, tok, pub, sync, version + attempt)
        switched = [(p, c) for p, c in calls if len(set(c.versions)) > 1]
        if switched:
            break
    out.update(attempts=attempt + 1, completions=len(calls), switches=getattr(engine, "switches", None), old_tokens=[],
               new_tokens=[])
    new_state = {k: v.clone() for k, v in model.state_dict().items()}
    worst_match, least_change = 0.0, float("inf")
    for prompt, c in switched:
        k = c.versions.count(version + attempt - 1)
        out["old_tokens"].append(k)  # type: ignore[attr-defined]
        out["new_tokens"].append(len(c.versions) - k)  # type: ignore[attr-defined]
        if c.versions != [version + attempt - 1] * k + [version + attempt] * (len(c.versions) - k):
            out["bad_versions"] = c.versions
        model.load_state_dict(old_state)
        by_old = recompute(model, prompt, c.token_ids, 1.0)
        model.load_state_dict(new_state)
        by_new = recompute(model, prompt, c.token_ids, 1.0)
        worst_match = max(worst_match, max_diff(c.logprobs, by_old[:k] + by_new[k:]))
        least_change = min(least_change, max_diff(c.logprobs[k:], by_old[k:]))
    out["max_logprob_diff"] = round(worst_match, 4)
    out["new_tokens_diff_from_old_weights"] = round(least_change, 4)
    out["stall_s"] = round(engine.stall_s, 4)
    out["ok"] = "bad_versions" not in out and bool(switched) and worst_match < 0.1 and least_change > 0.1
    return out


async def generating_through(engine: Any, model: torch.nn.Module, tok: Any, pub: Any, sync: Any, version: int) -> list[Any]:
    """(prompt, completion) of every generation run back to back until ``version``, published meanwhile, is installed."""
    import threading

    params = SamplingParams(max_new_tokens=200, temperature=1.0)
    prompts = [list(tok(f"{a}+{a + 5}=", add_special_tokens=False)["input_ids"]) for a in (3, 14, 25, 36)]
    calls: list[tuple[list[int], Any]] = []

    def generations() -> None:
        while engine.version < version:
            calls.extend(zip(prompts, engine.generate([GenerationRequest(p, params) for p in prompts])))

    gen = threading.Thread(target=generations)
    gen.start()
    await asyncio.sleep(0.2)  # the generations are under way
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    await pub.publish(model.state_dict(), version)
    await sync.wait_for(version, timeout=120)
    await asyncio.to_thread(gen.join, 300)
    return calls


def lora_check(engine: Any, model: torch.nn.Module, tok: Any) -> dict[str, object]:
    from astraflow.config import LoraConfig
    from astraflow.streams.messages import AdapterSpec
    from astraflow.weights.adapters import merged_weight
    from astraflow.weights.delta import state_digest, to_bf16_state

    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    spec = AdapterSpec(base_digest=state_digest(to_bf16_state(base)), scale=2.0)
    adapted = tuple(f"{m}.weight" for m in LoraConfig().target_modules)  # every linear layer, as trainer.lora adapts by default
    layers = [n.removesuffix(".weight") for n in base if n.endswith(adapted)]
    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=1)
    prompt = list(tok("12+7=", add_special_tokens=False)["input_ids"])
    out: dict[str, object] = {"lora": True, "refused_other_base": engine.adapter_problem(spec.model_copy(update={"base_digest": "0" * 64}))
                              is not None}
    for version in (0, 1):
        gen = torch.Generator().manual_seed(version)
        adapters = {}
        for m in layers:
            w = base[m + ".weight"]
            adapters[m + ".lora_A"] = (torch.randn(8, w.shape[1], generator=gen) * 0.1).to(torch.bfloat16)
            adapters[m + ".lora_B"] = (torch.randn(w.shape[0], 8, generator=gen) * 0.1).to(torch.bfloat16)
        assert engine.adapter_problem(spec) is None
        t0 = time.perf_counter()
        engine.load_adapter(adapters, version, spec)
        out[f"v{version}_apply_s"] = round(time.perf_counter() - t0, 3)
        (c,) = engine.generate([GenerationRequest(prompt, params)])
        with torch.no_grad():  # what the adapters mean: the merged weights
            model.load_state_dict({**base, **{m + ".weight": merged_weight(base[m + ".weight"], adapters[m + ".lora_A"],
                                                                          adapters[m + ".lora_B"], spec.scale) for m in layers}})
        out[f"v{version}_versions"] = sorted(set(c.versions))
        out[f"v{version}_max_logprob_diff"] = max(abs(a - b) for a, b in zip(c.logprobs, recompute(model, prompt, c.token_ids, 1.0)))
        model.load_state_dict(base)
        (plain,) = [recompute(model, prompt, c.token_ids, 1.0)]
        out[f"v{version}_max_diff_from_base"] = max(abs(a - b) for a, b in zip(c.logprobs, plain))  # the adapters did something
    out["ok"] = (out["refused_other_base"] and out["v0_versions"] == [0] and out["v1_versions"] == [1]
                 and all(float(out[f"v{v}_max_logprob_diff"]) < 0.1 < float(out[f"v{v}_max_diff_from_base"]) for v in (0, 1)))  # type: ignore[arg-type]
    return out


if __name__ == "__main__":
    print(json.dumps(main()), flush=True)
