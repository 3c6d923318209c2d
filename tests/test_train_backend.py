"""The torch backend on real token batches: losses wired in, gradient accumulation equal to the
full batch, M2PO's mask over the whole batch, bf16, the frozen KL reference, checkpoints."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from factories import sampled_batches

from astraflow.config import TrainerConfig, parse_recipe
from astraflow.models import build_model
from astraflow.train.backend import build_backend
from astraflow.train.batching import first_predicting, micro_batches, to_tensors
from astraflow.train.checkpoint import Checkpointer, CheckpointMeta
from astraflow.train.losses.functional import m2po_mask
from astraflow.train.torch_backend import TorchBackend
from astraflow.train.vetting import suspects_of

MODEL = {"hidden_size": 32, "intermediate_size": 64, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1}


@pytest.fixture(scope="module")
def setup():
    return sampled_batches(MODEL, 2, seed=3)


def trainer_cfg(base: TrainerConfig, **over: object) -> TrainerConfig:
    """``base`` with ``over`` validated as a recipe's trainer section (``loss: {type: m2po, tau: 0.02}``)."""
    return TrainerConfig.model_validate({**base.model_dump(), **over})


def _run(setup, **over) -> tuple[list[dict[str, float]], dict[str, torch.Tensor]]:
    pcfg, tok, batches = setup
    torch.manual_seed(0)
    backend = TorchBackend(build_model(pcfg.model, tok), tok, trainer_cfg(pcfg.trainer, **over))
    metrics = [backend.step(b) for b in batches]
    return metrics, backend.full_state()


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("over", [
    {"loss": "ppo"},
    {"loss": "ppo", "agg": "seq-mean-token-mean"},
    {"loss": {"type": "decoupled_ppo", "recompute_prox": True}, "kl_coef": 0.5, "kl_estimator": "k1"},
    {"loss": {"type": "decoupled_ppo", "tis_cap": 1.5}, "agg": "seq-mean-token-sum"},
    {"loss": {"type": "m2po", "tau": 0.02}, "kl_coef": 0.1},
])
def test_micro_batches_accumulate_to_the_full_batch_step(setup, over):
    _, tok, batches = setup
    assert len(micro_batches(to_tensors(batches[0], tok.pad_token_id), 40)) >= 3
    full_m, full_w = _run(setup, **over)
    split_m, split_w = _run(setup, micro_batch_tokens=40, **over)
    assert split_m[0]["micro_batches"] >= 3 and full_m[0]["micro_batches"] == 1
    for a, b in zip(full_m, split_m):
        for key in ("loss", "pg_loss", "grad_norm", "kl", "clip_frac", "m2po_masked_frac", "tis_weight_mean"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key
    assert _max_diff(full_w, split_w) < 1e-6
    unchanged = build_model(setup[0].model, tok).state_dict()
    assert max(float((full_w[k] - unchanged[k]).abs().max()) for k in full_w) > 1e-4  # it did train


def test_logits_from_the_first_predicting_position_on_train_as_logits_everywhere(setup):
    """The forward computes logits from the first position that predicts a completion token on (``logits_to_keep``):
    the same loss, gradient norm and weights as with logits at every position, on prompts of several lengths."""
    pcfg, tok, batches = setup
    x = to_tensors(batches[0], tok.pad_token_id)
    assert first_predicting(x) > 0 and len(set(x.logit_index[:, 0].tolist())) > 1
    runs = []
    for keep in (True, False):
        torch.manual_seed(0)
        backend = TorchBackend(build_model(pcfg.model, tok), tok, pcfg.trainer)
        assert backend.keeps_logits
        backend.keeps_logits = keep
        runs.append(([backend.step(b) for b in batches], backend.full_state()))
    (kept_m, kept_w), (all_m, all_w) = runs
    for a, b in zip(kept_m, all_m, strict=True):
        for key in ("loss", "pg_loss", "grad_norm", "entropy"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key
    assert _max_diff(kept_w, all_w) < 1e-6


def test_m2po_masks_over_the_whole_batch(setup):
    """A mask computed per micro-batch would differ: here the step's masked fraction is the full batch's."""
    pcfg, tok, batches = setup
    backend = TorchBackend(
        build_model(pcfg.model, tok), tok, trainer_cfg(pcfg.trainer, loss={"type": "m2po", "tau": 0.02}, micro_batch_tokens=40)
    )
    x = to_tensors(batches[0], tok.pad_token_id)
    with torch.no_grad():
        lp = backend._full_logprobs(x, micro_batches(x, None))
    keep = m2po_mask(lp, x.behave_logprobs, x.advantages, x.mask, tau=0.02)
    expected = float((x.mask.bool() & ~keep).sum() / x.mask.sum())
    assert 0 < expected < 1
    assert backend.step(batches[0])["m2po_masked_frac"] == pytest.approx(expected, abs=1e-6)


def test_bf16_mixed_precision_keeps_fp32_weights_and_tracks_fp32(setup):
    fp32_m, fp32_w = _run(setup)
    bf16_m, bf16_w = _run(setup, precision="bf16")
    assert all(t.dtype == torch.float32 for t in bf16_w.values())
    assert bf16_m[0]["loss"] == pytest.approx(fp32_m[0]["loss"], rel=2e-2, abs=2e-3)
    v0 = build_model(setup[0].model, setup[1]).state_dict()
    u32 = torch.cat([(fp32_w[k] - v0[k]).flatten() for k in v0])  # the fp32 update
    u16 = torch.cat([(bf16_w[k] - v0[k]).flatten() for k in v0])
    assert float(torch.nn.functional.cosine_similarity(u32, u16, dim=0)) > 0.95


def test_kl_reference_is_the_frozen_version_0(setup):
    pcfg, tok, batches = setup
    model = build_model(pcfg.model, tok)
    v0 = {k: v.clone() for k, v in model.state_dict().items()}
    backend = TorchBackend(model, tok, pcfg.trainer.model_copy(update={"kl_coef": 1.0, "kl_estimator": "k3", "lr": 1e-2}))
    first = backend.step(batches[0])
    second = backend.step(batches[1])
    assert first["kl"] == pytest.approx(0.0, abs=1e-6)  # π_θ = π_ref before the first update
    assert second["kl"] > 1e-5
    ref = backend.reference_state()
    assert all(torch.equal(ref[k], v0[k]) for k in v0)


def test_checkpoint_roundtrip_continues_bit_exactly(setup, tmp_path):
    pcfg, tok, batches = setup
    cfg = pcfg.trainer.model_copy(update={"kl_coef": 0.1})
    a = TorchBackend(build_model(pcfg.model, tok), tok, cfg)
    a.step(batches[0])
    ckpt = Checkpointer(tmp_path / "ck", keep=2)
    path = ckpt.save(a, CheckpointMeta(version=1, policy="solver", trained=[batches[0].batch_id], last_batch_ids=[batches[0].batch_id]))
    assert sorted(p.name for p in path.iterdir()) == ["meta.json", "model.safetensors", "optimizer.safetensors", "rng-0.pt"]
    assert (tmp_path / "ck" / "reference.safetensors").exists()

    # a fresh process would build a different model: the checkpoint must bring all of it back
    b = TorchBackend(build_model(pcfg.model.model_copy(update={"seed": 7}), tok), tok, cfg)
    (tmp_path / "ck" / ".tmp-v00000002").mkdir()  # a save that died half-way is ignored and cleaned
    again = Checkpointer(tmp_path / "ck", keep=2)
    assert not (tmp_path / "ck" / ".tmp-v00000002").exists()
    found_path, meta = again.latest()
    assert found_path == path and meta.version == 1 and meta.trained == [batches[0].batch_id]
    again.load(b, found_path)
    ma, mb = a.step(batches[1]), b.step(batches[1])
    assert ma["loss"] == mb["loss"]
    assert _max_diff(a.full_state(), b.full_state()) == 0.0
    assert all(torch.equal(x, y) for x, y in zip(a.reference_state().values(), b.reference_state().values()))

    for v in (2, 3):
        again.save(a, CheckpointMeta(version=v, policy="solver", trained=[]))
    assert sorted(p.name for p in (tmp_path / "ck").glob("v*")) == ["v00000002", "v00000003"]


def test_a_checkpoint_with_the_optimizer_state_of_older_versions_still_loads(setup, tmp_path):
    """Checkpoints written before the optimizer state was a safetensors file hold ``optimizer.pt`` (``torch.save``)."""
    pcfg, tok, batches = setup
    a = TorchBackend(build_model(pcfg.model, tok), tok, pcfg.trainer)
    a.step(batches[0])
    path = Checkpointer(tmp_path / "ck").save(a, CheckpointMeta(version=1, policy="solver", trained=[]))
    torch.save(a.opt.state_dict(), path / "optimizer.pt")
    (path / "optimizer.safetensors").unlink()
    b = TorchBackend(build_model(pcfg.model.model_copy(update={"seed": 7}), tok), tok, pcfg.trainer)
    b.load(path)
    assert a.step(batches[1])["loss"] == b.step(batches[1])["loss"]
    assert _max_diff(a.full_state(), b.full_state()) == 0.0


def test_a_restart_with_another_lr_restores_the_checkpoint_and_retunes_after(setup, tmp_path):
    """The checkpoint brings back the learning rate it was trained with (the replay of announced versions needs it);
    retune() then sets the recipe's, and the next step moves the weights as a run at that rate would."""
    pcfg, tok, batches = setup
    a = TorchBackend(build_model(pcfg.model, tok), tok, trainer_cfg(pcfg.trainer, lr=1e-4, weight_decay=0.0))
    a.step(batches[0])
    ckpt = Checkpointer(tmp_path / "ck", keep=2)
    path = ckpt.save(a, CheckpointMeta(version=1, policy="solver", trained=[batches[0].batch_id]))
    assert a.retune() == {}  # the recipe's values already

    def restarted(lr: float) -> TorchBackend:
        b = TorchBackend(build_model(pcfg.model, tok), tok, trainer_cfg(pcfg.trainer, lr=lr, weight_decay=0.01))
        ckpt.load(b, path)
        return b

    b = restarted(1e-2)
    assert {g["lr"] for g in b.opt.param_groups} == {1e-4}  # as trained, for the replay
    assert b.retune() == {"lr": (1e-4, 1e-2), "weight_decay": (0.0, 0.01)}
    assert {g["lr"] for g in b.opt.param_groups} == {1e-2} and b.retune() == {}
    before = b.full_state()
    b.step(batches[1])
    same = restarted(1e-4)  # the same step at the checkpoint's rate moves the weights less
    same.step(batches[1])
    assert _max_diff(b.full_state(), before) > 5 * _max_diff(same.full_state(), before)


def test_background_snapshot_writes_what_save_writes_as_of_when_it_was_taken(setup, tmp_path):
    """Group commit: the snapshot is a copy taken at once (the step after it does not leak into the file), written
    later as a checkpoint that loads to the same trainer as a synchronous save at that point (tied weights too)."""
    pcfg, tok, batches = setup
    cfg = pcfg.trainer.model_copy(update={"kl_coef": 0.1})
    torch.manual_seed(0)
    a = TorchBackend(build_model(pcfg.model, tok), tok, cfg)
    assert any(p.untyped_storage().data_ptr() == q.untyped_storage().data_ptr()  # the model ties weights
               for n, p in a.module.state_dict().items() for m, q in a.module.state_dict().items() if n < m)
    a.step(batches[0])
    ckpt = Checkpointer(tmp_path / "ck", keep=3)
    synchronous = ckpt.save(a, CheckpointMeta(version=1, policy="solver", trained=["b0"]))
    expected = a.full_state()
    snap = ckpt.snapshot(a, CheckpointMeta(version=2, policy="solver", trained=["b0"]))
    assert snap is not None and snap.reference is None  # the reference file exists already
    a.step(batches[1])  # training goes on while the snapshot waits to be written
    written = ckpt.write(snap)
    assert ckpt.latest() == (written, CheckpointMeta(**{**snap.meta.__dict__}))
    for path in (synchronous, written):  # both restore the trainer as of the snapshot, bit for bit
        b = TorchBackend(build_model(pcfg.model.model_copy(update={"seed": 7}), tok), tok, cfg)
        ckpt.load(b, path)
        assert _max_diff(b.full_state(), expected) == 0.0
        c = TorchBackend(build_model(pcfg.model.model_copy(update={"seed": 8}), tok), tok, cfg)
        ckpt.load(c, synchronous)
        assert b.step(batches[1])["loss"] == c.step(batches[1])["loss"]
        assert _max_diff(b.full_state(), c.full_state()) == 0.0 and _max_diff(b.full_state(), a.full_state()) == 0.0


def test_registry_and_config_errors_say_what_to_do(setup):
    pcfg, tok, _ = setup
    with pytest.raises(ValueError, match="registered"):
        build_backend("jax", build_model(pcfg.model, tok), tok, pcfg.trainer)
    with pytest.raises(ValueError, match=r"loss.recompute_prox\n.*not an option of loss ppo \(it is an option of decoupled_ppo\)"):
        TrainerConfig(loss={"type": "ppo", "recompute_prox": True})
    with pytest.raises(ValueError, match="trainer.zero_stage"):
        parse_recipe({"name": "t", "trainer": {"zero_stage": 4}})


@pytest.mark.parametrize("loss,over", [("ppo", {}), ({"type": "m2po", "tau": 0.02}, {"micro_batch_tokens": 40})])
def test_a_trajectory_whose_logprobs_the_model_contradicts_is_left_out_of_the_step(setup, loss, over):
    """A node's fabricated logprobs (-0.05 a token: the model gives these tokens far less) make the row's gap nats per
    token: the row is left out, counted, named (its row, whichever micro-batch ran it, and the node its subject named),
    and the step is the one the batch would give with that row's mask zero."""
    pcfg, tok, batches = setup
    batch = batches[0]
    k = len(batch.trajectories) - 3
    t = batch.trajectories[k]
    forged = t.model_copy(update={"logprobs": np.full(len(t.logprobs) // 4, -0.05, "<f4").tobytes()})
    muted = forged.model_copy(update={"loss_mask": np.zeros(len(t.loss_mask), "<u1").tobytes()})
    senders = [f"node{i % 2}" for i in range(len(batch.trajectories))]
    lying = replace(batch, trajectories=[*batch.trajectories[:k], forged, *batch.trajectories[k + 1:]], senders=senders)
    silent = replace(batch, trajectories=[*batch.trajectories[:k], muted, *batch.trajectories[k + 1:]])
    out, named = {}, {}
    for name, b in (("lying", lying), ("silent", silent), ("honest", batch)):
        torch.manual_seed(0)
        backend = TorchBackend(build_model(pcfg.model, tok), tok, trainer_cfg(pcfg.trainer, loss=loss, **over))
        out[name] = backend.step(b), backend.full_state()
        named[name] = suspects_of(b, backend.suspects)
    assert out["lying"][0]["suspect_trajectories"] == 1 and out["honest"][0]["suspect_trajectories"] == 0
    assert over.get("micro_batch_tokens") is None or out["lying"][0]["micro_batches"] > 1
    (suspect,) = named["lying"]
    assert (suspect.traj_id, suspect.node) == (t.traj_id, senders[k])
    assert suspect.gap == pytest.approx(out["lying"][0]["logprob_gap_max"], abs=1e-3)
    assert named["honest"] == named["silent"] == []
    assert out["honest"][0]["logprob_gap_max"] < 1.0 < 4.0 < out["lying"][0]["logprob_gap_max"]
    # ppo: the left-out tokens still count in the normaliser; m2po: its plan sees the whole batch's logprobs, and so the gap
    ratio = out["lying"][0]["tokens"] / out["silent"][0]["tokens"] if loss == "ppo" else 1.0
    assert out["lying"][0]["pg_loss"] == pytest.approx(out["silent"][0]["pg_loss"] / ratio, rel=1e-4, abs=1e-7)
    # AdamW's first step does not see the normaliser's scale (g/(|g|+eps): float rounding of near-zero gradients, ~1e-5)
    assert _max_diff(out["lying"][1], out["silent"][1]) < 2e-5
    torch.manual_seed(0)
    unchecked = TorchBackend(build_model(pcfg.model, tok), tok, trainer_cfg(pcfg.trainer, loss=loss, max_logprob_gap=None, **over))
    assert unchecked.step(lying)["suspect_trajectories"] == 0 and unchecked.suspects == {}
