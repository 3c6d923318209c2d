"""Mixture-of-Experts policies: a Qwen3-MoE model built from the recipe's config trains with the torch
backend, generates with the hf engine and follows the trainer by bf16 deltas through a real
nats-server; expert fields fail at load where they do not apply; ``unrouted_experts: hold`` keeps
an expert no token reached out of the step (weights and AdamW moments), where plain AdamW's
momentum moves it. (Training with the deepspeed backend: tests/test_train_deepspeed.py.)"""

from __future__ import annotations

import pytest
import torch

from astraflow.config import RecipeError, load_recipe, parse_recipe
from astraflow.models import build_model, encode_prompt, load_tokenizer
from astraflow.rollout.engines.base import GenerationRequest, SamplingParams
from astraflow.rollout.engines.hf import HFEngine
from astraflow.streams.plane import Plane
from astraflow.tasks import load_split
from astraflow.train.experts import expert_params, quiet_experts
from astraflow.train.synthetic import sample_batches
from astraflow.train.torch_backend import TorchBackend
from astraflow.weights.delta import state_digest
from astraflow.weights.publish import WeightPublisher
from astraflow.weights.sync import WeightSync

pytestmark = pytest.mark.timeout(240)
MOE = {"arch": "qwen3_moe", "hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
       "num_experts": 8, "experts_per_token": 2, "moe_intermediate_size": 32}


def policy(model: dict, lr: float = 3e-3, **trainer):
    return parse_recipe({"name": "t", "model": model, "trainer": {"lr": lr, **trainer}}).policies["solver"]


def batches_for(pcfg, n: int, groups: int = 2, size: int = 4, seed: int = 0):
    tok = load_tokenizer(pcfg.model.tokenizer)
    train, _ = load_split(parse_recipe({"name": "t"}).data)
    return sample_batches(build_model(pcfg.model, tok), tok, [p.prompt for p in train[:16]], n_batches=n, groups_per_batch=groups,
                          group_size=size, max_new_tokens=4, seed=seed)


@pytest.mark.parametrize(("model", "trainer", "message"), [
    ({"num_experts": 4}, {}, "model: Value error, num_experts applies only to arch qwen3_moe (arch is qwen2)"),
    ({**MOE, "experts_per_token": 9}, {}, "experts_per_token (9) must not exceed num_experts (8)"),
    ({**MOE, "pretrained": "Qwen/Qwen3-30B-A3B"}, {}, "a pretrained model brings its own architecture"),
    ({}, {"unrouted_experts": "hold"}, "policies.solver: Value error, trainer.unrouted_experts: hold applies only to Mixture-of-Experts"),
    (MOE, {"unrouted_experts": "hold", "backend": "deepspeed"}, "hold needs the torch backend"),
])
def test_expert_fields_fail_at_load_where_they_do_not_apply(model, trainer, message):
    with pytest.raises(RecipeError) as e:
        parse_recipe({"name": "t", "model": model, "trainer": trainer})
    assert message in str(e.value)


def test_the_moe_recipe_builds_a_sparse_model(repo_root):
    pcfg = load_recipe(repo_root / "recipes" / "arithmetic" / "moe.yaml").policies["solver"]
    assert (pcfg.model.arch, pcfg.model.num_experts, pcfg.model.experts_per_token) == ("qwen3_moe", 8, 2)
    model = build_model(pcfg.model, load_tokenizer(pcfg.model.tokenizer))
    experts = expert_params(model)
    assert len(experts) == 2 * pcfg.model.num_layers and all(p.shape[0] == 8 for p in experts)
    assert model.config.norm_topk_prob and not model.config.output_router_logits


async def test_moe_trains_generates_and_syncs_by_delta(plane: Plane):
    pcfg = policy(MOE, lr=3e-4, unrouted_experts="hold")  # the recipe's lr: a step changes well under half the bf16 values
    tok = load_tokenizer(pcfg.model.tokenizer)
    batches = batches_for(pcfg, 3)
    torch.manual_seed(0)
    backend = TorchBackend(build_model(pcfg.model, tok), tok, pcfg.trainer)
    engine = HFEngine(build_model(pcfg.model.model_copy(update={"seed": 7}), tok), tok)  # other weights until synced
    sync = WeightSync(plane, "solver", engine)
    publisher = WeightPublisher(plane, "solver", keyframe_every=10)
    anns = [await publisher.publish(backend.state_dict_bf16(), 0)]
    losses = []
    for v, b in enumerate(batches, start=1):
        losses.append(backend.step(b)["loss"])
        anns.append(await publisher.publish(backend.state_dict_bf16(), v, [b.batch_id]))
        await sync.goto(v)
        assert engine.version == v
        assert state_digest(backend.state_dict_bf16()) == anns[-1].state_digest == state_digest(
            {k: t.to(torch.bfloat16) for k, t in engine.state_view().items()})  # the engine holds exactly the trained bf16 weights
    assert [a.encoding for a in anns] == ["keyframe", "delta", "delta", "delta"]
    assert all(torch.isfinite(torch.tensor(losses)))
    prompt = encode_prompt(tok, "3+4=")
    (done,) = engine.generate([GenerationRequest(prompt, SamplingParams(max_new_tokens=5, temperature=1.0, seed=1))])
    assert len(done.token_ids) >= 1 and done.versions == [3] * len(done.token_ids)
    assert all(lp <= 0 for lp in done.logprobs)


def _two_steps(unrouted: str, batches) -> tuple[TorchBackend, dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor, dict]:
    """Step 1 routes tokens to most experts (momentum), step 2 to fewer: the experts quiet in step 2 but not in step 1."""
    pcfg = policy({**MOE, "num_experts": 16, "experts_per_token": 1}, unrouted_experts=unrouted, weight_decay=0.1)
    tok = load_tokenizer(pcfg.model.tokenizer)
    backend = TorchBackend(build_model(pcfg.model, tok), tok, pcfg.trainer)
    params = expert_params(backend.module)
    quiet: list[torch.Tensor] = []
    backend.opt.register_step_pre_hook(lambda opt, a, k: quiet.append(torch.stack([quiet_experts(p.grad) for p in params])))
    backend.step(batches[0])
    before = {id(p): p.detach().clone() for p in params}
    moments = {id(p): backend.opt.state[p]["exp_avg"].clone() for p in params}
    backend.step(batches[1])
    return backend, before, moments, quiet[1] & ~quiet[0], {id(p): p for p in params}


def test_hold_keeps_unrouted_experts_out_of_the_step_where_adamw_moves_them():
    pcfg = policy({**MOE, "num_experts": 16, "experts_per_token": 1})
    big, small = batches_for(pcfg, 1, groups=4, size=4, seed=1)[0], batches_for(pcfg, 1, groups=1, size=1, seed=2)[0]
    for unrouted in ("step", "hold"):
        backend, before, moments, newly_quiet, params = _two_steps(unrouted, [big, small])
        assert newly_quiet.any(), "the seeds must leave an expert that had momentum without tokens in step 2"
        for i, (key, p) in enumerate(params.items()):
            rows = newly_quiet[i]
            if not rows.any():
                continue
            moved = (p.detach()[rows] != before[key][rows]).any()
            kept_moments = torch.equal(backend.opt.state[p]["exp_avg"][rows], moments[key][rows])
            if unrouted == "hold":
                assert not moved and kept_moments  # weights and moments as they were
            else:
                assert moved and not kept_moments  # momentum (and decay) moved an expert that got no gradient
        busy = ~newly_quiet
        assert all((p.detach()[busy[i]] != before[key][busy[i]]).any() for i, (key, p) in enumerate(params.items()))
