#!/usr/bin/env bash
# Builds (once) the environment of the SGLang test lane and prints its path: python 3.11,
# torch 2.14.1 (sglang 0.5.23's pin; the registry's build is a CUDA one and runs on CPU),
# sglang 0.5.23 --no-deps, and the pinned list in scripts/sglang_env.txt. hsstore itself is not
# installed: the lane puts the checkout on PYTHONPATH, so one environment serves any checkout.
# A rerun with the environment built returns at once; an edit of the pins brings it up to date.
# Where: HSSTORE_SGLANG_ENV, else ${XDG_CACHE_HOME:-~/.cache}/hsstore/sglang-0.5.23.
set -euo pipefail
cd "$(dirname "$0")/.."
ENV_DIR=${HSSTORE_SGLANG_ENV:-${XDG_CACHE_HOME:-$HOME/.cache}/hsstore/sglang-0.5.23}
TORCH="torch==2.14.1 torchvision==0.29.1"
SGLANG="sglang==0.5.23"
STAMP="$TORCH $SGLANG $(sha256sum scripts/sglang_env.txt | cut -c1-16)"
MARK="$ENV_DIR/.hsstore-lane"

if [ -f "$MARK" ] && [ "$(cat "$MARK")" = "$STAMP" ]; then
    echo "$ENV_DIR"
    exit 0
fi
mkdir -p "$(dirname "$ENV_DIR")"
exec 9>"$ENV_DIR.lock"
flock 9  # a second build waits for the first, then finds it done
if [ ! -f "$MARK" ] || [ "$(cat "$MARK")" != "$STAMP" ]; then
    echo "building the SGLang lane's environment in $ENV_DIR (about 6 minutes, 6.5 GB)" >&2
    rm -f "$MARK"
    [ -x "$ENV_DIR/bin/python" ] || "${PYTHON311:-python3.11}" -m venv "$ENV_DIR"
    pip="$ENV_DIR/bin/python -m pip --quiet"
    {
        # shellcheck disable=SC2086  # the specs are meant to split
        $pip install $TORCH
        $pip install -r scripts/sglang_env.txt
        # --no-deps: most of sglang's requirements are CUDA kernels the CPU path never imports
        wheel=$(ls .cache/wheels/sglang-0.5.23-*.whl 2>/dev/null | head -n1 || true)
        $pip install --no-deps "${wheel:-$SGLANG}"
    } 1>&2
    "$ENV_DIR/bin/python" -c "import sglang, torch, transformers; assert sglang.__version__ == '0.5.23', sglang.__version__; assert torch.__version__.startswith('2.14.1'), torch.__version__" >&2
    echo "$STAMP" >"$MARK"
fi
echo "$ENV_DIR"
