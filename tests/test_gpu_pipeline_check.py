"""The prepared GPU check (examples/gpu_pipeline_check.py, run by examples/gpu_check.sh on a lent
GPU machine) as a CPU smoke test: the whole loop runs (hf engine, single_turn workflow and verifier,
GRPO batch, torch trainer, weights through an embedded nats-server into the engine) and the engine
ends every version with the trainer's bf16 weights."""

from __future__ import annotations

import argparse
import importlib.util
import subprocess

import pytest

pytestmark = pytest.mark.timeout(240)


def load_check(repo_root):
    spec = importlib.util.spec_from_file_location("gpu_pipeline_check", repo_root / "examples" / "gpu_pipeline_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe"])
async def test_the_gpu_check_runs_on_cpu(repo_root, arch):
    check = load_check(repo_root)
    args = argparse.Namespace(device="cpu", arch=arch, tiny=True, steps=2, tasks=2, group_size=4, max_new_tokens=4,
                              micro_batch_tokens=4096, lr=1e-3, sft_steps=2, sft_lr=1e-3)
    out = await check.check(args)
    assert out["digests_ok"] is True
    assert out["device"] == "cpu" and out["arch"] == arch and out["trainer_precision"] == "fp32"
    assert out["gen_tokens_per_s"] > 0 and out["train_tokens_per_s"] > 0 and out["apply_s"] > 0
    assert 0 < out["delta_bytes"] < out["keyframe_bytes"]
    assert 0 < out["install_s"] < out["apply_s"] and out["apply_over_step"] > 0  # the install is the apply's last stage
    assert out["image_pinned"] is False and out["install_whole_pageable_s"] > 0  # pinned memory needs an accelerator
    assert "install_whole_pinned_s" not in out


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU")
async def test_cuda_without_a_gpu_is_refused_with_the_reason(repo_root):
    check = load_check(repo_root)
    args = argparse.Namespace(device="cuda", arch="qwen2", tiny=True)
    with pytest.raises(SystemExit, match="torch sees no GPU"):
        await check.check(args)


def test_the_wheel_script_parses_and_explains_its_use(repo_root):
    script = repo_root / "examples" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    usage = subprocess.run(["bash", str(script)], capture_output=True, text=True)
    assert usage.returncode == 2 and "build [PYTHON_VERSION] | run" in usage.stderr
