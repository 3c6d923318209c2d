"""LoRA on the torch backend (``trainer.lora``, train/lora.py): only the adapters train, a version is the adapters alone
(or the merged full weights under the base model's names with ``announce: merged``), a checkpoint brings the adapted
model and its optimizer back exactly, announced adapters or full weights load back (the approximate resume), and the
recipe refuses what cannot be."""

from __future__ import annotations

import pytest
import torch
from factories import sampled_batches

from astraflow.config import TrainerConfig
from astraflow.models import build_model
from astraflow.train.checkpoint import Checkpointer, CheckpointMeta
from astraflow.train.torch_backend import TorchBackend
from astraflow.weights.adapters import merged_weight

pytest.importorskip("peft", reason="peft is not installed (pip install 'astraflow[lora]')")

MODEL = {"hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1}
ADAPTED = tuple(f"{m}.weight" for m in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))


@pytest.fixture(scope="module")
def setup():
    return sampled_batches(MODEL, 3, seed=3)


def lora(base: TrainerConfig, **over: object) -> TrainerConfig:
    return TrainerConfig.model_validate({**base.model_dump(), "lr": 1e-2, "lora": {"rank": 4, "alpha": 8}, **over})


def _max_diff(a, b) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_only_the_adapters_train_and_a_version_is_the_adapters(setup):
    pcfg, tok, batches = setup
    torch.manual_seed(0)
    model = build_model(pcfg.model, tok)
    v0 = {k: v.detach().clone() for k, v in model.state_dict().items()}
    b = TorchBackend(model, tok, lora(pcfg.trainer))
    assert set(b.full_state()) == set(v0) and _max_diff(b.full_state(), v0) == 0.0  # B = 0: version 0 is the base model
    trained = {n for n, p in b.module.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert sum(len(g["params"]) for g in b.opt.param_groups) == len(trained)  # the optimizer holds the adapters alone
    for x in batches:
        b.step(x)
    after = b.full_state()
    changed = {k for k in v0 if not torch.equal(after[k], v0[k])}
    assert changed == {k for k in v0 if k.endswith(ADAPTED)}  # every adapted weight moved, nothing else did
    for key in changed:  # W = W0 + (alpha / r) B A, from the adapter's own matrices
        layer = b.module.get_base_model().get_submodule(key.removesuffix(".weight"))
        w0, a, bb = layer.base_layer.weight, layer.lora_A["default"].weight, layer.lora_B["default"].weight
        assert torch.equal(w0, v0[key])  # the base stays frozen
        assert torch.allclose(after[key], v0[key] + (8 / 4) * bb @ a, atol=1e-6)
    image = b.state_dict_bf16()  # a version: the adapters alone, named after the layers they adapt
    layers = {k.removesuffix(".weight") for k in changed}
    assert set(image) == {m + s for m in layers for s in (".lora_A", ".lora_B")}
    assert all(t.dtype == torch.bfloat16 for t in image.values())
    base = b.base_bf16()
    assert base is not None and set(base) == set(v0) and _max_diff({k: t.float() for k, t in base.items()}, v0) < 1e-2
    for m in layers:  # what a node serves: W0 + s B A from the announced bf16 adapters, the trainer's weights to bf16 rounding
        w = merged_weight(v0[m + ".weight"], image[m + ".lora_A"], image[m + ".lora_B"], 8 / 4)
        assert torch.allclose(w, after[m + ".weight"], atol=2e-3)
    merged = TorchBackend(build_model(pcfg.model, tok), tok, lora(pcfg.trainer, lora={"rank": 4, "alpha": 8, "announce": "merged"}))
    assert set(merged.state_dict_bf16()) == set(v0) and merged.base_bf16() is None  # announce: merged: the full weights
    node = build_model(pcfg.model, tok)  # what a node builds: the merged weights load into it as they are
    node.load_state_dict(after)


def test_a_checkpoint_brings_the_adapters_and_their_optimizer_back_exactly(setup, tmp_path):
    pcfg, tok, batches = setup
    torch.manual_seed(0)
    a = TorchBackend(build_model(pcfg.model, tok), tok, lora(pcfg.trainer, kl_coef=0.1))
    a.step(batches[0])
    ckpt = Checkpointer(tmp_path / "ck", keep=2)
    path = ckpt.save(a, CheckpointMeta(version=1, policy="solver", trained=[batches[0].batch_id]))
    torch.manual_seed(1)  # another process: other adapters at the start, another base
    b = TorchBackend(build_model(pcfg.model.model_copy(update={"seed": 7}), tok), tok, lora(pcfg.trainer, kl_coef=0.1))
    ckpt.load(b, path)
    assert _max_diff(a.full_state(), b.full_state()) == 0.0
    ma, mb = a.step(batches[1]), b.step(batches[1])
    assert ma["loss"] == mb["loss"] and ma["kl"] == mb["kl"]
    assert _max_diff(a.full_state(), b.full_state()) == 0.0


def test_announced_weights_load_back(setup):
    """The approximate resume puts the announced full weights under the adapters (the merged weights are those), or the
    announced adapters in place of the trainer's."""
    pcfg, tok, batches = setup
    b = TorchBackend(build_model(pcfg.model, tok), tok, lora(pcfg.trainer))
    b.step(batches[0])
    other = {k: v + 0.01 for k, v in build_model(pcfg.model.model_copy(update={"seed": 9}), tok).state_dict().items()}
    b.load_weights(other)
    assert _max_diff(b.full_state(), other) < 1e-6
    b.step(batches[1])  # and it trains on from there
    assert _max_diff(b.full_state(), other) > 0.0
    a = TorchBackend(build_model(pcfg.model, tok), tok, lora(pcfg.trainer))
    a.step(batches[0])
    adapters = a.state_dict_bf16()  # an announced LoRA version loads as the adapters, over the base the trainer holds
    c = TorchBackend(build_model(pcfg.model, tok), tok, lora(pcfg.trainer))
    c.load_weights(adapters)
    assert _max_diff({k: t.float() for k, t in c.state_dict_bf16().items()}, {k: t.float() for k, t in adapters.items()}) == 0.0
    with pytest.raises(ValueError, match="adapters do not match"):
        c.load_weights({k: t for k, t in adapters.items() if "layers.0." not in k})


def test_the_recipe_refuses_what_cannot_be(setup):
    pcfg, tok, _ = setup
    with pytest.raises(ValueError, match="rank"):
        lora(pcfg.trainer, lora={"rank": 0})
    with pytest.raises((ValueError, RuntimeError), match="target_modules|gate_projx"):
        TorchBackend(build_model(pcfg.model, tok), tok, lora(pcfg.trainer, lora={"target_modules": ["gate_projx"]}))
