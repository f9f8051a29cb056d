#!/usr/bin/env bash
# The one prepared device check (issue 20): tests/gpu/run.sh [--dry-run] [--out FILE] [--only CHECK ...]
# On a CUDA machine it runs every check in tests/gpu/check.py (under 8 minutes on one GPU) and
# writes one JSON of figures (default benchmarks/results/gpu_check.json). --dry-run: the same
# code on the CPU with tiny sizes and Triton interpreted (the test suite runs it).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
if [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ]; then PY=.venv/bin/python; fi
for a in "$@"; do
  if [ "$a" = "--dry-run" ]; then export TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES=""; fi
done
export HF_HUB_OFFLINE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec timeout 480 "$PY" tests/gpu/check.py "$@"
