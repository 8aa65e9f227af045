#!/usr/bin/env bash
# The vLLM lane of `make test`: the real vllm 0.32.0 engine on CPU, in its own cached
# environment (scripts/vllm_env.sh), over tests/vllm_engine/. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
ENV_DIR=$(bash scripts/vllm_env.sh)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# The lane's models are built in code: nothing to fetch, and no usage reports.
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
# The checkout's compiled modules are built for .venv's python; build them for this one where
# that python is another release.
"$ENV_DIR/bin/python" -c "import hsstore.codec._split_decoder, hsstore.spec._xxh3_many, hsstore.storage._pread_many" 2>/dev/null ||
    "$ENV_DIR/bin/python" setup.py --quiet build_ext --inplace
exec "$ENV_DIR/bin/python" -m pytest tests/vllm_engine -p no:cacheprovider -o timeout=600 "$@"
