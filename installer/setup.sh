#!/usr/bin/env bash
# Set-up from nothing: a virtual environment in .venv with PagedDesk and its test tools.
# torch is installed first and pinned, so no multi-GB CUDA build is pulled on a CPU-only machine;
# on a CUDA machine, install the CUDA build of torch into .venv before running this.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
source .venv/bin/activate
python -m pip install -q --upgrade pip
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[dev]"
echo "PagedDesk installed in $(pwd)/.venv"
