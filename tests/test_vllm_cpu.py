"""The vllm engine against a real vLLM (its CPU build), in-process and as a launched server: tokens carry the version
that produced them, the behaviour logprobs are the policy's (recomputed with transformers), and a new version is
applied in place (the server paused, reloaded, resumed); versions announced on a weight plane are fetched by vLLM's
worker itself and installed layer by layer, a delta of one part of a fused layer included; with partial rollouts, a
version is installed between two decoding steps of generations in flight.

vLLM pins its own torch and transformers, so it lives in an environment of its own, built by
``examples/vllm_cpu_env.sh`` (``.venv-vllm``; or point ``ASTRAFLOW_VLLM_PYTHON`` at another one's Python). Without
that environment these tests are skipped; ``.ci/run`` builds it when it can. LoRA versions go through vLLM's own LoRA
support (``max_lora_rank``).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYTHON = Path(os.environ.get("ASTRAFLOW_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "partial"), [("inprocess", True), ("server", False), ("server", True)])
def test_vllm_generates_the_policys_tokens_and_applies_versions_in_place(mode: str, partial: bool, tmp_path: Path):
    """``partial``: ``rollout.partial_rollouts``, and after versions 2-4 one more installed while generations run."""
    if not PYTHON.exists():
        pytest.skip(f"no vLLM environment at {PYTHON} (bash examples/vllm_cpu_env.sh builds one)")
    proc = subprocess.run([str(PYTHON), str(ROOT / "examples" / "engine_check.py"), "--engine", "vllm", "--mode", mode, "--plane",
                           *(["--partial"] if partial else [])], cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # vLLM logs to stdout too, some of it at exit: the report is the line the check printed
    out = json.loads(next(line for line in reversed(proc.stdout.splitlines()) if line.startswith('{"engine"')))
    assert out["v0_versions"] == [0] and out["v1_versions"] == [1], out
    assert out["v0_max_logprob_diff"] < 0.05 and out["v1_max_logprob_diff"] < 0.05, out  # the sampled distribution's
    assert out["v0_tokens"] == [16, 16], out
    plane = out["plane"]  # versions 2-4: a keyframe, a delta of gate_proj alone (fused with up_proj), a delta of all
    attempts = plane["partial"]["attempts"] if partial else 0  # versions published while generations ran
    assert plane["worker_fetches"] and plane["sync_stats"]["keyframes"] == 1 and plane["sync_stats"]["deltas"] == 2 + attempts, plane
    for v in (2, 3, 4):
        assert plane[f"v{v}_versions"] == [v] and plane[f"v{v}_max_logprob_diff"] < 0.05, plane
    assert plane["v3_diff_from_previous"] > 0.1 and plane["v4_diff_from_previous"] > 0.1, plane  # the check tells versions apart
    if partial:  # completions that switched: the old version up to a token, the new one after, each with its weights' logprobs
        switch = plane["partial"]
        assert switch["old_tokens"] and all(k > 0 for k in switch["old_tokens"]) and all(switch["new_tokens"]), switch
        assert switch["max_logprob_diff"] < 0.05 and switch["new_tokens_diff_from_old_weights"] > 0.1, switch
    if mode == "server":  # each version applied between /pause and /resume (with partial rollouts, mode=keep)
        assert out["paused_updates"] == 2 and plane["paused_updates"] == 5 + attempts, out
        assert out["left_paused_resumed"], out  # a node attaching to a server another left paused resumes it
    assert out["ok"], out


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["inprocess", "server"])
def test_vllm_serves_lora_versions_through_its_lora_support(mode: str, tmp_path: Path):
    """``max_lora_rank``: each version is a PEFT adapter directory vLLM loads (a LoRARequest in-process, the runtime
    LoRA API on a server); tokens carry its version, their logprobs are those of the merged weights W0 + s B A and not of
    the base, and adapters over another base are refused."""
    if not PYTHON.exists():
        pytest.skip(f"no vLLM environment at {PYTHON} (bash examples/vllm_cpu_env.sh builds one)")
    proc = subprocess.run([str(PYTHON), str(ROOT / "examples" / "engine_check.py"), "--engine", "vllm", "--mode", mode, "--lora"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(next(line for line in reversed(proc.stdout.splitlines()) if line.startswith('{"engine"')))
    assert out["refused_other_base"] and out["v0_versions"] == [0] and out["v1_versions"] == [1], out
    for v in (0, 1):
        assert out[f"v{v}_max_logprob_diff"] < 0.05 < out[f"v{v}_max_diff_from_base"], out
    assert out["ok"], out
