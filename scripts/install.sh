#!/usr/bin/env bash
# One command for a fresh machine: a virtual environment with hsstore and its dev tools.
# torch is pinned to the 2.13.0 CPU wheel first, so nothing later pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -d .venv ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
python -m pip install --quiet "torch==2.13.0"
python -m pip install --quiet -e '.[dev]'
# The peers whose own readers the interop tests use; --no-deps because they pin other torch and
# transformers versions and pull vLLM/SGLang-era stacks; their data modules' needs are in [dev].
python -m pip install --quiet --no-deps "speculators==0.9.0" "hs-connectors==0.9.0" "specforge==0.2.0"
echo "installed: $(python -c 'import hsstore, torch; print("hsstore", hsstore.__version__, "torch", torch.__version__)')"
echo "activate with: . .venv/bin/activate"
