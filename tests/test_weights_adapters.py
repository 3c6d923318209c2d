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
    assert 0 < pub.bytes_sent < full_bytes / 4  # four versions of adapters cost less than a quarter of one full keyframe
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

