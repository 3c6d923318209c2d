"""Routing replay for Mixture-of-Experts policies (astraflow/moe_routing.py): the hf engine records the experts each
position was routed to, the trajectory carries them packed and checked, and the trainer measures where its own routing
differs or forces the recorded one. Real Qwen3-MoE models built from a config; real generation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from astraflow.config import RecipeError, parse_recipe
from astraflow.dataflow.validate import Limits, check_trajectory
from astraflow.models import build_model, encode_prompt, load_tokenizer, model_limits
from astraflow.moe_routing import RoutingRecorder, find_routers, routed, routing_shape
from astraflow.rollout.engines.base import GenerationRequest, SamplingParams
from astraflow.rollout.engines.hf import HFEngine
from astraflow.rollout.workflows.base import make_trajectory
from astraflow.streams.codec import decode, encode
from astraflow.streams.messages import Batch, Task, Trajectory, TrajRef
from astraflow.streams.trajectories import TrainingBatch, pack_arrays, unpack_arrays
from astraflow.train.batching import micro_batches, to_tensors
from astraflow.train.experts import expert_params
from astraflow.train.losses.functional import gather_logprobs
from astraflow.train.torch_backend import TorchBackend

pytestmark = pytest.mark.timeout(240)
MOE = {"arch": "qwen3_moe", "hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
       "num_experts": 8, "experts_per_token": 2, "moe_intermediate_size": 32}
TOK = load_tokenizer("byt5")
PROMPTS = ["3+4=", "12+19=", "7+8=", "1+15="]
SAMPLES = 3


def recipe(routing: str = "replayed", **model):
    return parse_recipe({"name": "t", "model": {**MOE, **model}, "trainer": {"routing": routing, "lr": 1e-3}})


def spread_routers(model, scale: float = 30.0) -> None:
    """A fresh model's routers sit near ties and its experts barely move the residual stream (weights ~0.02): spread
    both, as training does, so that which experts a token takes matters."""
    with torch.no_grad():
        for r in find_routers(model):
            r.weight.mul_(scale)
        for p in expert_params(model):
            p.mul_(scale ** 0.5)


def sampled(engine: HFEngine) -> list[Trajectory]:
    """The engine's completions of PROMPTS as one task's trajectories, with the routing it recorded."""
    prompts = [encode_prompt(TOK, p) for p in PROMPTS]
    comps = engine.generate([GenerationRequest(p, SamplingParams(5, 1.0, seed=3)) for p in prompts for _ in range(SAMPLES)])
    task = Task(task_id="t1", workflow="single_turn", policy="solver", prompt_id="p", prompt="-", group_size=len(comps))
    return [make_trajectory(task, "solver", i, len(comps), prompts[i // SAMPLES], c.token_ids, c.logprobs, c.versions, None,
                            1.0, c.finish_reason, "n", routing=c.routing) for i, c in enumerate(comps)]


def batch_of(trajs: list[Trajectory], seed: int = 0) -> TrainingBatch:
    adv = np.random.default_rng(seed).standard_normal(len(trajs)).astype("<f4")
    return TrainingBatch(Batch(batch_id="solver-b1", policy="solver", task_ids=["t1"], advantages=adv.tobytes(),
                               refs=[TrajRef(seq=i + 1, traj_id=t.traj_id, task_id="t1") for i, t in enumerate(trajs)]), trajs)


@pytest.fixture(scope="module")
def pair():
    """A trainer's fp32 model and an engine on the same weights, whose routers alone were perturbed (routing noise)."""
    pcfg = recipe().policies["solver"]
    torch.manual_seed(0)
    trainer = build_model(pcfg.model, TOK)
    spread_routers(trainer)
    engine_model = build_model(pcfg.model, TOK)
    engine_model.load_state_dict(trainer.state_dict())
    with torch.no_grad():
        for r in find_routers(engine_model):
            r.weight.add_(0.3 * torch.randn(r.weight.shape, generator=torch.Generator().manual_seed(1)))
    engine = HFEngine(engine_model, TOK)
    engine.set_version(0)
    engine.record_routing()
    return pcfg, trainer, engine, sampled(engine)


def logprobs_under(model, trajs: list[Trajectory], replay: bool | None) -> tuple[torch.Tensor, float]:
    """Mean |log π_model − log π_behave| per token, and the mismatch share (replay None: routing not in hand)."""
    x = to_tensors(batch_of(trajs), TOK.pad_token_id, routing=routing_shape(model) if replay is not None else None)
    with torch.no_grad(), routed(model, x.routing, bool(replay)) as counts:
        logits = model(input_ids=x.input_ids, attention_mask=x.attention_mask, use_cache=False).logits
    lp = gather_logprobs(logits[torch.arange(len(trajs))[:, None], x.logit_index], x.targets)
    gap = ((lp - x.behave_logprobs).abs() * x.mask).sum() / x.mask.sum()
    return gap, counts.share() if counts is not None else math.nan


def test_the_engine_records_every_position_that_shapes_a_logprob(pair):
    _, _, engine, trajs = pair
    for t in trajs:
        ids = t.routes()
        assert ids.shape == (len(t.prompt_tokens()) + len(t.completion()) - 1, 2, 2)  # positions x layers x top-k
        assert ids.max() < 8 and (np.sort(ids, -1)[..., 1] != np.sort(ids, -1)[..., 0]).all()  # distinct experts
    assert t.routing_layout.model_dump() == {"schema_version": 1, "layers": 2, "top_k": 2, "experts": 8}
    # what it recorded is what the engine's own model routes in one full forward over the same rows
    _, share = logprobs_under(engine.model, trajs, replay=False)
    assert share < 0.02


def test_replaying_the_engines_routing_brings_the_trainer_to_its_logprobs(pair):
    _, trainer, _, trajs = pair
    gap_free, _ = logprobs_under(trainer, trajs, replay=None)
    gap_own, share = logprobs_under(trainer, trajs, replay=False)
    gap_replayed, share_replayed = logprobs_under(trainer, trajs, replay=True)
    assert share > 0.2 and share_replayed > 0.2  # the routers disagree; replay still reports where its own would
    assert gap_own == gap_free  # measuring changes nothing
    assert gap_replayed < 0.7 * gap_own  # what is left: the engine's perturbed router weighs the same experts otherwise
    assert all(not r._forward_hooks for r in find_routers(trainer))  # the hooks go with the block


def test_under_replay_every_recorded_position_takes_the_recorded_experts(pair):
    _, trainer, _, trajs = pair
    model = build_model(recipe().policies["solver"].model, TOK)
    model.load_state_dict(trainer.state_dict())
    x = to_tensors(batch_of(trajs), TOK.pad_token_id, routing=routing_shape(model))
    with torch.no_grad(), routed(model, x.routing, replay=True):
        seen = RoutingRecorder(model)  # hooked after the replay: sees what the layers were given
        model(input_ids=x.input_ids, attention_mask=x.attention_mask, use_cache=False)
    known = x.routing[..., 0, 0] >= 0  # (B, L)
    for layer, calls in enumerate(seen.calls):
        took = calls[0].reshape(*x.input_ids.shape, -1)
        assert torch.equal(took[known], x.routing[:, :, layer][known].long())


def test_a_replayed_step_trains_the_router_and_splits_into_micro_batches_exactly(pair):
    pcfg, trainer, _, trajs = pair
    losses, grads = [], []
    for budget in (None, 40):
        backend = TorchBackend(build_model(pcfg.model, TOK), TOK, pcfg.trainer.model_copy(update={"micro_batch_tokens": budget}))
        backend.module.load_state_dict(trainer.state_dict())
        routers = find_routers(backend.module)
        backend.opt.register_step_pre_hook(lambda opt, a, k, rs=routers: grads.append([r.weight.grad.abs().sum() for r in rs]))
        x = to_tensors(batch_of(trajs), TOK.pad_token_id, routing=(2, 2, 8))
        if budget:
            assert len(micro_batches(x, budget)) > 1
        m = backend.step(batch_of(trajs))
        assert m["routing_mismatch"] > 0.2 and m["routing_bytes"] == np.mean([len(t.routing) for t in trajs])
        losses.append(m["loss"])
    assert losses[0] == pytest.approx(losses[1], abs=1e-5)
    assert all(g > 0 for g in grads[0])  # the router learns through the weights of the experts it was made to take


def test_routing_travels_whole_and_inline_or_offloaded(pair):
    t = pair[3][0]
    back = decode(encode(t), Trajectory)
    assert back.routing == t.routing and back.routing_layout == t.routing_layout
    assert unpack_arrays(pack_arrays(t))["routing"] == t.routing
    with pytest.raises(ValueError, match="routing: .* not a whole number of 4-byte positions"):
        Trajectory.model_validate({**t.model_dump(), "routing": t.routing + b"\x01"})
    with pytest.raises(ValueError, match=r"up to \d+ \(prompt \+ completion - 1\)"):
        Trajectory.model_validate({**t.model_dump(), "routing": t.routing + t.routing[:4]})
    with pytest.raises(ValueError, match="routing and routing_layout come together"):
        Trajectory.model_validate({**t.model_dump(), "routing": b""})


def test_the_dataflow_turns_away_routing_the_model_cannot_have(pair):
    pcfg, _, _, trajs = pair
    t = trajs[0]
    limits = Limits.of(recipe()).policies["solver"]
    assert check_trajectory(t, limits, len(trajs)) is None
    ids = t.routes().copy()

    def with_ids(a: np.ndarray, **layout) -> Trajectory:
        return Trajectory.model_validate({**t.model_dump(), "routing": a.astype("u1").tobytes(),
                                          "routing_layout": t.routing_layout.model_copy(update=layout)})

    beyond = ids.copy()
    beyond[0, 1, 0] = 8
    twice = ids.copy()
    twice[2, 0, 1] = twice[2, 0, 0]
    for bad, detail in [(with_ids(beyond), "expert id 8, the layers have 8 experts"),
                        (with_ids(twice), "an expert twice among one position's top-k"),
                        (with_ids(ids, experts=16), "of 16 experts; the model routes 2 layers x top-2 of 8")]:
        found = check_trajectory(bad, limits, len(trajs))
        assert found is not None and found.code == "routing" and detail in found.detail
    # a policy that records no routing does not read it
    assert check_trajectory(with_ids(beyond), Limits.of(recipe("own")).policies["solver"], len(trajs)) is None
    assert model_limits(pcfg.model).experts == 8


def test_routing_applies_only_to_mixture_of_experts():
    with pytest.raises(RecipeError, match="trainer.routing: replayed applies only to Mixture-of-Experts models"):
        parse_recipe({"name": "t", "trainer": {"routing": "replayed"}})
    dense = build_model(parse_recipe({"name": "t"}).policies["solver"].model, TOK)
    with pytest.raises(ValueError, match="recording routing needs a Mixture-of-Experts model"):
        HFEngine(dense, TOK).record_routing()


def test_routing_in_another_layout_is_left_to_the_trainer(pair):
    """The trainer takes recorded routing only in its model's layout; another row (or none) is routed by the model."""
    trajs = pair[3][:2]
    layout = trajs[1].routing_layout.model_copy(update={"experts": 16})
    other = Trajectory.model_validate({**trajs[1].model_dump(), "routing_layout": layout})
    x = to_tensors(batch_of([trajs[0], other]), TOK.pad_token_id, routing=(2, 2, 8))
    n = len(trajs[0].routes())
    assert (x.routing[0, :n] >= 0).all() and (x.routing[0, n:] == -1).all() and (x.routing[1] == -1).all()
    assert to_tensors(batch_of(trajs), TOK.pad_token_id).routing is None  # routing not asked for
