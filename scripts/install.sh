#!/usr/bin/env bash
# Makes .venv with hsstore (editable) and its dev tools. `make demo` and `make test` run this
# on first use; run it again after changing dependencies. Keep it one linear list of steps.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -d .venv ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
# torch first, pinned to its CPU build, so nothing later pulls a multi-GB CUDA build (its small
# dependencies come from PyPI with the next step). On a GPU machine pick the build you need,
# e.g. TORCH_SPEC=torch==2.13.0 TORCH_INDEX=https://pypi.org/simple
if [ "$(uname -s)" = Linux ]; then TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0+cpu}; fi
python -m pip install --quiet --no-deps "${TORCH_SPEC:-torch==2.13.0}" \
    --extra-index-url "${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
python -m pip install --quiet -e '.[dev]'
# The peers whose own readers the interop tests use; --no-deps because they pin other torch and
# transformers versions and pull vLLM/SGLang-era stacks; their data modules' needs are in [dev].
python -m pip install --quiet --no-deps "speculators==0.9.0" "hs-connectors==0.9.0" "specforge==0.2.0"
echo "installed: $(python -c 'import hsstore, torch; print("hsstore", hsstore.__version__, "torch", torch.__version__)')"
