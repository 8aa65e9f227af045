#!/usr/bin/env bash
# Makes .venv with hsstore (editable) and its dev tools. `make demo` and `make test` run this
# on first use; run it again after changing dependencies. Keep it one linear list of steps.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# The compiled decoder links libzstd and the digests build on xxHash's header (setup.py); the headers come
# from the system's packages. Without them hsstore still builds, on its portable path.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! dpkg -s libzstd-dev libxxhash-dev >/dev/null 2>&1; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libzstd-dev libxxhash-dev >/dev/null
fi
[ -d .venv ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
# torch first, pinned, so nothing later pulls a multi-GB CUDA build (2.13.0 resolves to the CPU
# wheel on the machines CI runs on). On a GPU machine name the build you need in TORCH_SPEC.
python -m pip install --quiet "${TORCH_SPEC:-torch==2.13.0}"
python -m pip install --quiet -e '.[dev]'
# The peers whose own readers the interop tests use; --no-deps because they pin other torch and
# transformers versions and pull vLLM/SGLang-era stacks; their data modules' needs are in [dev].
python -m pip install --quiet --no-deps "speculators==0.9.0" "hs-connectors==0.9.0" "specforge==0.2.0"
# The sglang wheel's sources are read (never imported) by the SGLang contract tests; no deps.
ls .cache/wheels/sglang-0.5.23-*.whl >/dev/null 2>&1 || python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 --platform manylinux_2_34_x86_64 "sglang==0.5.23" -d .cache/wheels
# Azurite, the Azure Blob server the az:// tests run against (tools/azurite.py), from npm into
# .cache/azurite; reinstalled only when the pinned version changes.
AZURITE_VERSION=3.37.0
[ "$(cat .cache/azurite/.version 2>/dev/null)" = "$AZURITE_VERSION" ] || {
  npm install --silent --no-audit --no-fund --prefix .cache/azurite "azurite@$AZURITE_VERSION"
  echo "$AZURITE_VERSION" > .cache/azurite/.version
}
echo "installed: $(python -c 'import hsstore, torch; from hsstore.codec.codecs import fast_decode; print("hsstore", hsstore.__version__, "torch", torch.__version__, "fast decode" if fast_decode() else "portable decode (no libzstd-dev/libxxhash-dev at build)")')"
