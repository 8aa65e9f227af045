#!/usr/bin/env bash
# The GPU checks, as one script for a CUDA machine (run from the repository root after
# `pip install -e '.[dev]'`; the SGLang part also needs `pip install -e '.[sglang]'`, the vLLM
# part `pip install -e '.[vllm]'`: each engine is checked where it is installed, as SGLang and
# vLLM pin different torch builds and usually live in environments of their own).
# Writes each check's JSON report to OUT (default: gpu_checks_out/) and exits non-zero when
# a check fails (the vLLM check is skipped, not failed, where vllm is not installed). The vLLM
# check runs a Llama and a Qwen3 and expects the DeepseekV3-style one refused. The SGLang check runs three small random models (Llama, Qwen3 and a
# DeepseekV3-style MLA + MoE one); a few minutes on one H100/H200.
set -uo pipefail
out=${1:-gpu_checks_out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
rc=0
python tools/gpu_check_loader.py | tee "$out/loader.json" || rc=1
if python -c "import sglang" 2>/dev/null; then
    python -m tools.gpu_check_sglang --out "$out/sglang_work" | tee "$out/sglang.json" || rc=1
else
    echo "sglang is not installed: SGLang check skipped" | tee "$out/sglang.json"
    rc=1
fi
if python -c "import vllm" 2>/dev/null; then
    python tools/gpu_check_vllm.py --out "$out/vllm_work" | tee "$out/vllm.json" || rc=1
else
    echo "vllm is not installed: vLLM check skipped" | tee "$out/vllm.json"
fi
exit $rc
