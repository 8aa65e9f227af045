#!/usr/bin/env bash
# Runs the tests that pin what extraction stores under every transformers release hsstore
# declares, one small cached overlay per release on top of .venv. An overlay holds only the
# packages whose version differs from .venv's (transformers, and the tokenizers/huggingface_hub
# that release needs), installed --no-deps with --target; a rerun finds it and installs nothing.
#   TRANSFORMERS_VERSIONS="5.19.0 newest" scripts/test_transformers_versions.sh   # a subset
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${VENV_PYTHON:-.venv/bin/python}  # the environment the overlays go on top of
# 4.45.0: the lowest pyproject allows; 5.8.1: SpecForge 0.2's pin; 5.19.0: sglang 0.5.23's and
# speculators 0.9's; newest: the registry's latest release that installs from it (a release
# whose own requirements the registry lacks is named and passed over), looked up on every run.
VERSIONS=${TRANSFORMERS_VERSIONS:-"4.45.0 5.8.1 5.19.0 newest"}
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/hsstore
TESTS=(tests/test_extract_golden.py tests/test_extract_selection.py tests/test_extract_prompts.py)
PYTAG=$("$PY" -c 'import sys; print(f"py{sys.version_info[0]}{sys.version_info[1]}")')
# Everything .venv has, pinned, except what a transformers release brings its own version of.
FLOATING='^(transformers|tokenizers|huggingface[-_]hub|hf[-_]xet)=='
# Optional imports of transformers that a newer release brings into .venv and an older one
# breaks on (5.8.1 builds its hub-kernel table at import, which kernels 0.19 refuses): hidden
# in an overlay whose release does not require them.
HIDDEN_UNLESS_REQUIRED="kernels"
# The overlay's layout; a change of what an overlay holds bumps it, so cached ones are rebuilt.
OVERLAY_FORMAT=2

releases() { # the registry's transformers releases, newest first
    "$PY" -m pip index versions transformers 2>/dev/null |
        sed -n 's/^Available versions: //p' | tr ',' '\n' | tr -d ' '
}

constraints_of_venv() { # $1 file: everything .venv has, pinned, but what a release brings
    "$PY" -m pip freeze --exclude-editable | grep -viE "$FLOATING" | grep '==' >"$1"
}

installable() { # $1 version: whether the registry has everything that release needs here
    local tmp ok=0
    tmp=$(mktemp -d)
    constraints_of_venv "$tmp/constraints.txt"
    "$PY" -m pip install --quiet --dry-run --ignore-installed -c "$tmp/constraints.txt" \
        "transformers==$1" >/dev/null 2>&1 || ok=1
    rm -rf "$tmp"
    return $ok
}

newest() { # the newest release that installs, trying the five newest
    local v
    for v in $(releases | head -n 5); do
        if [ -f "$CACHE/transformers-$v-$PYTAG/OVERLAY" ] || installable "$v"; then
            echo "$v"
            return 0
        fi
        echo "transformers $v: the package index lacks what it requires here; passed over" >&2
    done
    return 1
}

build_overlay() { # $1 version, $2 overlay dir
    local tmp constraints report
    tmp=$(mktemp -d)
    constraints=$tmp/constraints.txt
    report=$tmp/report.json
    constraints_of_venv "$constraints"
    "$PY" -m pip install --quiet --dry-run --ignore-installed --report "$report" \
        -c "$constraints" "transformers==$1"
    # what the resolution needs that .venv lacks at that exact version
    mapfile -t pins < <("$PY" - "$report" $HIDDEN_UNLESS_REQUIRED <<'EOF'
import json, sys
from importlib.metadata import PackageNotFoundError, version
installed = json.load(open(sys.argv[1]))["install"]
for item in installed:
    name, want = item["metadata"]["name"], item["metadata"]["version"]
    try:
        have = version(name)
    except PackageNotFoundError:
        have = None
    if have != want:
        print(f"{name}=={want}")
required = {item["metadata"]["name"].lower() for item in installed}
for name in sys.argv[2:]:
    try:
        version(name)
    except PackageNotFoundError:
        continue
    if name not in required:
        print(f"hide:{name}")
EOF
    )
    rm -rf "$2.partial"
    mkdir -p "$2.partial"
    local wanted=() pin
    for pin in "${pins[@]}"; do
        if [[ $pin == hide:* ]]; then # a module that fails to import, as if not installed
            mkdir -p "$2.partial/${pin#hide:}"
            echo "raise ImportError('not in the environment of this transformers release')" \
                >"$2.partial/${pin#hide:}/__init__.py"
        else
            wanted+=("$pin")
        fi
    done
    if [ ${#wanted[@]} -gt 0 ]; then
        "$PY" -m pip install --quiet --no-deps --target "$2.partial" "${wanted[@]}"
    fi
    printf '%s\n' "${pins[@]}" >"$2.partial/OVERLAY"
    rm -rf "$2" "$tmp"
    mv "$2.partial" "$2"
}

status=0
for want in $VERSIONS; do
    if [ "$want" = newest ]; then
        want=$(newest) || true
        [ -n "$want" ] || { echo "cannot find an installable transformers release" >&2; exit 1; }
    fi
    overlay=$CACHE/transformers-$want-$PYTAG-o$OVERLAY_FORMAT
    if [ ! -f "$overlay/OVERLAY" ]; then
        start=$SECONDS
        build_overlay "$want" "$overlay"
        echo "transformers $want: overlay built in $((SECONDS - start)) s ($(tr '\n' ' ' <"$overlay/OVERLAY"))"
    fi
    start=$SECONDS
    # the plugin refuses to start unless the tests import the release this overlay holds
    if PYTHONPATH="$overlay${PYTHONPATH:+:$PYTHONPATH}" HSSTORE_TRANSFORMERS_VERSION=$want \
        "$PY" -m pytest -q -p no:cacheprovider -p tests.transformers_pin "${TESTS[@]}"; then
        echo "transformers $want: passed in $((SECONDS - start)) s"
    else
        echo "transformers $want: FAILED" >&2
        status=1
    fi
done
exit $status
