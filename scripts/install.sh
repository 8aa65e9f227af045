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
# The sglang wheel's sources are read (never imported) by the SGLang contract tests; no deps.
ls .cache/wheels/sglang-0.5.23-*.whl >/dev/null 2>&1 || python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 --platform manylinux_2_34_x86_64 "sglang==0.5.23" -d .cache/wheels
echo "installed: $(python -c 'import hsstore, torch; print("hsstore", hsstore.__version__, "torch", torch.__version__)')"
echo "activate with: . .venv/bin/activate"
