#!/usr/bin/env bash
# The first-GPU-run check: set up .venv (with the CUDA build of torch) unless PYTHON names an interpreter
# that already has it, print `pagedesk-doctor`'s table, then run the GPU test suite (tests/gpu, ≤ 8 min on
# one card). Extra arguments go to pytest, e.g. installer/gpu-check.sh -k parity
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
    [ -x .venv/bin/python ] || bash installer/setup.sh
    PY=.venv/bin/python
fi
"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' || {
    echo "torch in $PY cannot see a CUDA device: check nvidia-smi, or reinstall with installer/setup.sh" >&2; exit 1; }
"$PY" -m engine.doctor || true  # the table is context for the tests; its verdict does not stop them
exec "$PY" -m pytest tests/gpu -m gpu -v -rs -p no:cacheprovider "$@"
