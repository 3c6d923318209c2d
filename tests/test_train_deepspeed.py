"""torch vs deepspeed (one process, CPU, gloo) on the same batches and seed.

Tolerances: fp32, ZeRO 0-3, with and without micro-batches: the same loss (relative 1e-6) and
the same updated weights (absolute 1e-6; observed <= 6e-8, the order of float32 rounding of a
differently ordered reduction). bf16 (torch autocast with fp32 weights vs deepspeed's bf16
weights with fp32 masters): losses within 2e-3 relative and the weight updates point the same
way (cosine > 0.99).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

deepspeed = pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install 'astraflow[deepspeed]')")

from astraflow.config import LoraConfig, TrainerConfig, parse_recipe  # noqa: E402
from astraflow.models import build_model, load_tokenizer  # noqa: E402
from astraflow.moe_routing import RoutingRecorder  # noqa: E402
from astraflow.streams.messages import RoutingLayout, Trajectory  # noqa: E402
from astraflow.streams.trajectories import TrainingBatch  # noqa: E402
from astraflow.tasks import load_split  # noqa: E402
from astraflow.train.backend import build_backend  # noqa: E402
from astraflow.train.checkpoint import Checkpointer, CheckpointMeta  # noqa: E402
from astraflow.train.lora import adapter_state  # noqa: E402
from astraflow.train.synthetic import sample_batches  # noqa: E402

MODEL = {"hidden_size": 32, "intermediate_size": 64, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1}


@pytest.fixture(scope="module")
def setup():
    env = dict(os.environ)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/astraflow-torch-ext"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    recipe = parse_recipe({"name": "t", "model": MODEL})
    pcfg = recipe.policies["solver"]
    tok = load_tokenizer("byt5")
    train, _ = load_split(recipe.data)
    batches = sample_batches(build_model(pcfg.model, tok), tok, [p.prompt for p in train[:8]], n_batches=2,
                             groups_per_batch=3, group_size=4, logprob_noise=0.4, seed=5)
    yield pcfg, tok, batches
    torch.set_num_threads(threads)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    os.environ.clear()
    os.environ.update(env)  # trainer processes started later must not inherit this process group's port


def _run(setup, backend: str, **over):
    pcfg, tok, batches = setup
    cfg = TrainerConfig.model_validate({**pcfg.trainer.model_dump(), "backend": backend, **over})  # as a recipe's trainer section
    b = build_backend(backend, build_model(pcfg.model, tok), tok, cfg)
    metrics = [b.step(x) for x in batches]
    return b, metrics, b.full_state()


def _max_diff(a, b) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("over", [{"zero_stage": 0}, {"zero_stage": 1}, {"zero_stage": 2, "micro_batch_tokens": 40},
                                  {"zero_stage": 3, "loss": "m2po", "micro_batch_tokens": 40}])
def test_same_loss_and_weights_as_torch_fp32(setup, over):
    _, ref_m, ref_w = _run(setup, "torch", **{k: v for k, v in over.items() if k != "zero_stage"})
    _, ds_m, ds_w = _run(setup, "deepspeed", **over)
    for a, b in zip(ref_m, ds_m):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6, abs=1e-7)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    assert _max_diff(ref_w, ds_w) < 1e-6


@pytest.mark.parametrize("zero_stage", [0, 2, 3])
def test_lora_same_loss_and_weights_as_torch(setup, zero_stage):
    """Adapters only (``trainer.lora``): the same losses, the same merged weights, the base frozen, at every stage."""
    pytest.importorskip("peft", reason="peft is not installed (pip install 'astraflow[lora]')")
    over = {"lora": {"rank": 4, "alpha": 8}, "lr": 1e-2, "micro_batch_tokens": 40}
    torch.manual_seed(0)
    _, ref_m, ref_w = _run(setup, "torch", **over)
    torch.manual_seed(0)
    _, ds_m, ds_w = _run(setup, "deepspeed", zero_stage=zero_stage, **over)
    for a, b in zip(ref_m, ds_m):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6, abs=1e-7)
    assert _max_diff(ref_w, ds_w) < 1e-6
    pcfg, tok, _ = setup
    v0 = build_model(pcfg.model, tok).state_dict()
    assert set(ds_w) == set(v0) and {k for k in v0 if not torch.equal(ds_w[k], v0[k])} == {
        k for k in v0 if k.endswith(tuple(f"{m}.weight" for m in LoraConfig().target_modules))}


def test_bf16_tracks_torch_bf16(setup):
    pcfg, tok, _ = setup
    _, ref_m, ref_w = _run(setup, "torch", precision="bf16")
    _, ds_m, ds_w = _run(setup, "deepspeed", precision="bf16", zero_stage=2)
    for a, b in zip(ref_m, ds_m):
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-3, abs=1e-4)
    v0 = build_model(pcfg.model, tok).state_dict()
    u_t = torch.cat([(ref_w[k] - v0[k]).flatten() for k in v0])
    u_d = torch.cat([(ds_w[k] - v0[k]).flatten() for k in v0])
    assert float(torch.nn.functional.cosine_similarity(u_t, u_d, dim=0)) > 0.99


@pytest.mark.parametrize("stage,lora", [(2, None), (3, None), (2, {"rank": 4, "alpha": 8})], ids=["2", "3", "2-lora"])
def test_checkpoint_roundtrip_and_weight_reload(setup, tmp_path, stage, lora):
    pcfg, tok, batches = setup
    if lora is not None:
        pytest.importorskip("peft", reason="peft is not installed (pip install 'astraflow[lora]')")
    a, _, _ = _run(setup, "deepspeed", zero_stage=stage, lora=lora)
    ckpt = Checkpointer(tmp_path / "ck")
    path = ckpt.save(a, CheckpointMeta(version=2, policy="solver", trained=[b.batch_id for b in batches]))
    assert (path / "model.safetensors").exists() and (path / "deepspeed").is_dir()
    cfg = TrainerConfig.model_validate({**pcfg.trainer.model_dump(), "backend": "deepspeed", "zero_stage": stage, "lora": lora})
    b = build_backend("deepspeed", build_model(pcfg.model.model_copy(update={"seed": 9}), tok), tok, cfg)
    ckpt.load(b, path)
    assert _max_diff(a.full_state(), b.full_state()) == 0.0
    ma, mb = a.step(batches[0]), b.step(batches[0])
    assert ma["loss"] == mb["loss"]
    assert _max_diff(a.full_state(), b.full_state()) < 1e-7  # the optimizer moments came back too

    # resuming from announced bf16 weights (a LoRA model's: its adapters): the fp32 masters must follow the loaded weights
    image = a.state_dict_bf16()
    b.load_weights(image)

    def trained() -> dict[str, torch.Tensor]:
        return {k: v.detach().float() for k, v in adapter_state(b.module).items()} if lora else b.full_state()

    assert _max_diff({k: v.float() for k, v in image.items()}, trained()) == 0.0
    b.step(batches[1])
    moved = _max_diff({k: v.float() for k, v in image.items()}, trained())
    assert 0 < moved < 1e-2  # one small step away from the loaded weights, not from the old masters

    # a restart with another learning rate: retune() reaches the optimizer DeepSpeed steps with
    assert b.retune() == {}
    b.cfg = cfg.model_copy(update={"lr": cfg.lr * 10})
    assert b.retune() == {"lr": (cfg.lr, cfg.lr * 10)}
    inner = getattr(b.opt, "optimizer", b.opt)
    assert {g["lr"] for g in b.opt.param_groups} == {g["lr"] for g in inner.param_groups} == {cfg.lr * 10}


@pytest.mark.parametrize("stage,routing", [(2, "own"), (3, "replayed")])
def test_moe_same_loss_and_weights_as_torch(setup, stage, routing):
    """A Qwen3-MoE policy (fused expert tensors, top-k routing) trains under ZeRO as under the torch backend; with
    routing replay too, the recorded routing being another model's (so replay changes what the layers take)."""
    _, tok, _ = setup
    moe = {**MODEL, "arch": "qwen3_moe", "num_experts": 4, "experts_per_token": 2, "moe_intermediate_size": 32}
    pcfg = parse_recipe({"name": "t", "model": moe}).policies["solver"]
    train, _ = load_split(parse_recipe({"name": "t"}).data)
    batches = sample_batches(build_model(pcfg.model, tok), tok, [p.prompt for p in train[:8]], n_batches=2, groups_per_batch=3,
                             group_size=4, logprob_noise=0.4, seed=5)
    if routing == "replayed":
        batches = routed_by(build_model(pcfg.model.model_copy(update={"seed": 9}), tok), batches)
    _, ref_m, ref_w = _run((pcfg, tok, batches), "torch", micro_batch_tokens=40, routing=routing)
    _, ds_m, ds_w = _run((pcfg, tok, batches), "deepspeed", zero_stage=stage, micro_batch_tokens=40, routing=routing)
    assert any(".experts." in k for k in ds_w)
    for a, b in zip(ref_m, ds_m):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6, abs=1e-7)
        assert (a.get("routing_mismatch", 0) > 0.1) == (routing == "replayed")
        assert b.get("routing_mismatch") == a.get("routing_mismatch")
    assert _max_diff(ref_w, ds_w) < 1e-6


@torch.no_grad()
def routed_by(model, batches: list[TrainingBatch]) -> list[TrainingBatch]:
    """The batches with the routing ``model`` gives each trajectory's positions (prompt + completion - 1)."""
    recorder = RoutingRecorder(model)
    out = []
    for b in batches:
        trajs = []
        for t in b.trajectories:
            ids = np.concatenate([t.prompt_tokens(), t.completion()])
            recorder.start()
            model(input_ids=torch.tensor(ids[None].astype("int64")), use_cache=False)
            (routes,) = recorder.rows([len(ids)], len(ids))
            routes = routes.head(len(ids) - 1)
            layout = RoutingLayout(layers=routes.ids.shape[1], top_k=routes.ids.shape[2], experts=routes.experts)
            trajs.append(Trajectory.model_validate({**t.model_dump(), "routing": routes.packed(), "routing_layout": layout}))
        out.append(TrainingBatch(b.manifest, trajs))
    return out


def test_every_rank_runs_as_many_micro_batches():
    """ZeRO-2/3 reduce gradients at every backward: a rank with fewer micro-batches pads with zero-weight stand-ins."""
    from types import SimpleNamespace

    from astraflow.train.deepspeed_backend import DeepSpeedBackend

    mbs = ["m0", "m1", "m2", "m3", "m4"]
    shares = [DeepSpeedBackend._share(SimpleNamespace(world_size=2, rank=r), mbs) for r in (0, 1)]  # type: ignore[arg-type]
    assert shares[0] == [("m0", 2.0), ("m2", 2.0), ("m4", 2.0)]
    assert shares[1] == [("m1", 2.0), ("m3", 2.0), ("m0", 0.0)]
    assert DeepSpeedBackend._share(SimpleNamespace(world_size=4, rank=3), mbs[:2]) == [("m0", 0.0)]  # type: ignore[arg-type]
