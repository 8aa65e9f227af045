#!/usr/bin/env bash
# The SGLang lane of `make test`: the real sglang 0.5.23 engine on CPU, in its own cached
# environment (scripts/sglang_env.sh), over tests/sglang_engine/. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
ENV_DIR=$(bash scripts/sglang_env.sh)
# tests/sglang_wheel.py reads the wheel's sources; scripts/install.sh downloads it
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# The checkout's compiled modules are built for .venv's python; build them for this one where
# that python is another release.
"$ENV_DIR/bin/python" -c "import hsstore.codec._split_decoder, hsstore.spec._xxh3_many, hsstore.storage._pread_many" 2>/dev/null ||
    "$ENV_DIR/bin/python" setup.py --quiet build_ext --inplace
exec "$ENV_DIR/bin/python" -m pytest tests/sglang_engine -p no:cacheprovider -o timeout=600 "$@"
