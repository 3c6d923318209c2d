"""LoRA versions on the weight plane (``trainer.lora.announce: adapter``; weights/adapters.py), against a real
nats-server: a version carries the adapters alone, against the base model's digest; a node serves them merged into a
copy of its own model when that is the base, fetches the base the trainer stored when a warm start changed it, and
refuses, with the reason, adapters over a base it neither holds nor can fetch."""

from __future__ import annotations

import pytest
import torch
from factories import sampled_batches

from astraflow.config import TrainerConfig
from astraflow.models import build_model
from astraflow.rollout.engines.hf import HFEngine
from astraflow.streams.messages import WeightVersion
from astraflow.train.torch_backend import TorchBackend
from astraflow.weights.delta import state_digest, to_bf16_state
from astraflow.weights.publish import WeightPublisher
from astraflow.weights.sync import WeightSync

pytest.importorskip("peft", reason="peft is not installed (pip install 'astraflow[lora]')")

MODEL = {"hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1}
SCALE = 8 / 4


@pytest.fixture(scope="module")
def setup():
    return sampled_batches(MODEL, 3, seed=5)


def trainer(setup, warm: float = 0.0) -> tuple[TorchBackend, str]:
    """A LoRA backend over the recipe's model (``warm``: every weight moved first, as a full warm start does), and the
    digest of the model as the recipe builds it (what every node holds)."""
    pcfg, tok, _ = setup
    model = build_model(pcfg.model, tok)
    built = state_digest(to_bf16_state(model.state_dict()))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(warm * torch.randn_like(p))
    cfg = TrainerConfig.model_validate({**pcfg.trainer.model_dump(), "lr": 1e-2, "lora": {"rank": 4, "alpha": 8}})
    return TorchBackend(model, tok, cfg), built


def node(setup, seed: int | None = None) -> HFEngine:
    pcfg, tok, _ = setup
    model_cfg = pcfg.model if seed is None else pcfg.model.model_copy(update={"seed": seed})
    return HFEngine(build_model(model_cfg, tok), tok)


async def publish_versions(plane, setup, backend: TorchBackend, built: str) -> WeightPublisher:
    pub = WeightPublisher(plane, "solver")
    base = backend.base_bf16()
    assert base is not None
    await pub.adapt(base, SCALE, built)
    await pub.publish(backend.state_dict_bf16(), 0, force_keyframe=True)
    for v, batch in enumerate(setup[2], start=1):
        backend.step(batch)
        await pub.publish(backend.state_dict_bf16(), v)
    return pub


def served_like_trainer(engine: HFEngine, backend: TorchBackend) -> float:
    """The largest difference between the node's weights and the trainer's merged weights."""
    view, want = engine.state_view(), backend.full_state()
    assert set(view) == set(want)
    return max(float((view[k].float() - want[k]).abs().max()) for k in want)


async def test_a_version_is_its_adapters_and_a_node_serves_them_on_its_own_model(plane, setup):
    backend, built = trainer(setup)
    pub = await publish_versions(plane, setup, backend, built)
    assert pub.adapter is not None and pub.adapter.base is None  # the base is the recipe's model: nothing stored
    full_bytes = sum(t.numel() * 2 for t in backend.full_state().values())
    assert 0 < pub.bytes_sent < full_bytes / 2  # four versions of adapters cost less than half of one full keyframe
    engine = node(setup)
    sync = WeightSync(plane, "solver", engine)
    await sync.wait_for(len(setup[2]), timeout=30)
    assert engine.version == len(setup[2]) and sync.stats["bases"] == 0
    assert served_like_trainer(engine, backend) < 5e-3  # W0 + s B A from bf16 adapters: the trainer's to bf16 rounding
    late = node(setup)  # a late joiner rebuilds the chain of adapters onto its own model
    joined = WeightSync(plane, "solver", late)
    await joined.wait_for(len(setup[2]), timeout=30)
    assert torch.equal(torch.cat([t.flatten().float() for t in late.state_view().values()]),
                       torch.cat([t.flatten().float() for t in engine.state_view().values()]))


async def test_a_node_over_another_base_refuses_the_version_and_says_why(plane, setup):
    backend, built = trainer(setup)
    await publish_versions(plane, setup, backend, built)
    engine = node(setup, seed=7)  # another model: the adapters would mean something else on it
    before = {k: t.clone() for k, t in engine.state_view().items()}
    sync = WeightSync(plane, "solver", engine)
    assert not await sync.refresh(wait=1.0)
    assert engine.version == -1 and sync.stats["base_refused"] == 1 and sync.stats["keyframe_requests"] == 0
    assert "base" in sync.last_error and "model.seed" in sync.last_error
    assert all(torch.equal(before[k], t) for k, t in engine.state_view().items())  # nothing was written


async def test_a_base_a_warm_start_changed_travels_once_and_nodes_check_it(plane, setup):
    backend, built = trainer(setup, warm=0.05)  # a warm start trained every weight: no node builds this base
    pub = await publish_versions(plane, setup, backend, built)
    spec = pub.adapter
    assert spec is not None and spec.base is not None
    engine = node(setup)
    sync = WeightSync(plane, "solver", engine)
    await sync.wait_for(len(setup[2]), timeout=30)
    assert sync.stats["bases"] == 1 and sync.stats["base_refused"] == 0
    assert served_like_trainer(engine, backend) < 5e-3
    again = WeightPublisher(plane, "solver")  # a restarted trainer reuses the stored base instead of storing it again
    anns = await plane.history(plane.names.weights("solver"), WeightVersion)
    assert (await again.adapt(backend.base_bf16() or {}, SCALE, built, anns)).base == spec.base and again.bytes_sent == 0



async def test_several_policies_share_one_base_each_served_with_its_own_adapter(plane, setup):
    """``rollout.shared_base``: one base, one adapter per policy (peft, unmerged). A batch mixing both policies gives each
    request what its policy's merged copy gives, each token under its own policy's version, and a version over another
    base is refused."""
    from astraflow.config import LoraConfig
    from astraflow.rollout.engines.base import GenerationRequest, SamplingParams
    from astraflow.rollout.engines.shared_base import SharedBase
    from astraflow.streams.plane import Topology

    pcfg, tok, batches = setup
    await plane.ensure_topology(Topology(policies=("solver", "verifier")))
    solver, built = trainer(setup)
    pcfg_v = TrainerConfig.model_validate({**pcfg.trainer.model_dump(), "lr": 2e-2, "lora": {"rank": 2, "alpha": 4}})
    verifier = TorchBackend(build_model(pcfg.model, tok), tok, pcfg_v)
    for name, backend, versions in (("solver", solver, 3), ("verifier", verifier, 1)):
        pub = WeightPublisher(plane, name)
        await pub.adapt(backend.base_bf16() or {}, 2.0, built)
        await pub.publish(backend.state_dict_bf16(), 0, force_keyframe=True)
        for v in range(1, versions + 1):
            backend.step(batches[v - 1])
            await pub.publish(backend.state_dict_bf16(), v)

    shared = SharedBase(build_model(pcfg.model, tok), tok, {"solver": LoraConfig(rank=4, alpha=8), "verifier": LoraConfig(rank=2, alpha=4)})
    views = {p: shared.view(p) for p in ("solver", "verifier")}
    for p, want in (("solver", 3), ("verifier", 1)):
        await WeightSync(plane, p, views[p]).wait_for(want, timeout=30)
    separate = {p: node(setup) for p in views}  # one merged copy per policy: what a node holds without a shared base
    for p, want in (("solver", 3), ("verifier", 1)):
        await WeightSync(plane, p, separate[p]).wait_for(want, timeout=30)
    held = sum(t.numel() for t in shared.engine.model.parameters())
    one = sum(t.numel() for t in separate["solver"].model.parameters())
    assert held < 1.5 * one  # one base and two adapters (a tenth of a model this small each), not two models

    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    prompts = [list(tok.encode("12+7=", add_special_tokens=False)), list(tok.encode("3+4=", add_special_tokens=False))]
    mixed = shared.engine.generate([GenerationRequest(prompts[0], params, "solver"), GenerationRequest(prompts[1], params, "verifier"),
                                    GenerationRequest(prompts[1], params, "solver")])
    for c, (p, prompt) in zip(mixed, (("solver", prompts[0]), ("verifier", prompts[1]), ("solver", prompts[1])), strict=True):
        (alone,) = separate[p].generate([GenerationRequest(prompt, params)])
        assert c.token_ids == alone.token_ids
        assert max(abs(a - b) for a, b in zip(c.logprobs, alone.logprobs, strict=True)) < 1e-2
        assert set(c.versions) == {3 if p == "solver" else 1}

    other, _ = trainer(setup, warm=0.05)  # a policy whose trainer starts from another base cannot share this one
    await plane.ensure_topology(Topology(policies=("critic",)))
    pub = WeightPublisher(plane, "critic")
    await pub.adapt(other.base_bf16() or {}, 2.0, built)
    await pub.publish(other.state_dict_bf16(), 0, force_keyframe=True)
    shared_critic = SharedBase(build_model(pcfg.model, tok), tok, {"critic": LoraConfig(rank=4, alpha=8)})
    sync = WeightSync(plane, "critic", shared_critic.view("critic"))
    assert not await sync.refresh(wait=1.0)
    assert sync.stats["base_refused"] == 1 and "shared_base" in sync.last_error and shared_critic.view("critic").version == -1


def test_the_recipe_says_what_a_shared_base_needs():
    from astraflow.config import RecipeError, parse_recipe

    lora = {"trainer": {"lora": {"rank": 4}}, "sft": {"steps": 0}}
    base = {"name": "t", "workflow": "solver_verifier", "reward": "math", "rollout": {"shared_base": True}}
    recipe = parse_recipe({**base, "model": MODEL, "policies": {"solver": lora, "verifier": lora}})
    from astraflow.rollout.node import make_handles

    handles = make_handles(recipe, rollout=True)  # what a node holds: one engine, a view per policy
    engines = {p: h.engine for p, h in handles.items()}
    assert engines["solver"].shared is engines["verifier"].shared and engines["solver"].version == -1  # type: ignore[attr-defined]
    for policies, said in (({"solver": lora, "verifier": {"sft": {"steps": 0}}}, "must train LoRA"),
                           ({"solver": lora, "verifier": {**lora, "model": {"hidden_size": 32}}}, "models differ")):
        with pytest.raises((RecipeError, ValueError), match=said):
            parse_recipe({**base, "policies": policies})
    vllm = {"name": "t", "sft": {"steps": 0}, "trainer": {"lora": {"rank": 8}}, "rollout": {"engine": {"type": "vllm", "max_lora_rank": 8}}}
    parse_recipe(vllm)  # vllm serves adapters through its LoRA support (tests/test_vllm_cpu.py), within its rank
    for over, said in (({"rollout": {"engine": {"type": "vllm"}}}, "takes whole states only"),
                       ({"trainer": {"lora": {"rank": 16}}}, "above rollout.engine.max_lora_rank"),
                       ({"sft": {"steps": 5}}, "over the model it loads")):
        with pytest.raises((RecipeError, ValueError), match=said):
            parse_recipe({**vllm, **over})
