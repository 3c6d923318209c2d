#!/usr/bin/env bash
# TRL in an environment of its own (it pins what it needs), with AstraFlow installed beside it for the workload,
# the checkpoint's model class, the verifier and the held-out scorer:
#   bash benchmarks/trl_env.sh [VENV]     (default .venv-trl at the repository's root)
# Then: python benchmarks/bench_trl.py (it runs benchmarks/trl_peer.py with VENV/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv-trl}
python3 -m venv "$venv"
"$venv/bin/pip" install -q --disable-pip-version-check "torch==2.13.0" -e ".[trl]"
"$venv/bin/python" -c "import trl, torch, transformers; print('trl', trl.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__, 'ready in $venv')"
