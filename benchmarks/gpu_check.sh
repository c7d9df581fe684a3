#!/usr/bin/env bash
# The prepared GPU check on a machine with one CUDA GPU, run from the source tree (no install,
# no network): device tests, GRPO throughput and MFU on Qwen2.5-0.5B/1.5B shapes, and the
# weight sync's peak device memory. Prints one table and writes OUT/gpu_check.json.
#
#   benchmarks/gpu_check.sh [OUT] [benchmarks/gpu_check.py options]     (or: make gpu-check)
#
# PYTHON selects the interpreter (default python3). The whole check is capped at 8 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu-check}"
[ "$#" -gt 0 ] && shift
PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" exec timeout --signal=INT --kill-after=20 480 \
    "${PYTHON:-python3}" benchmarks/gpu_check.py --out "$out" "$@"
