#!/usr/bin/env bash
# Set-up from nothing: a virtual environment in .venv with PagedDesk and its test tools.
# torch is installed first and pinned: the CUDA build when an NVIDIA driver answers (`nvidia-smi`), the CPU
# build otherwise, so a new 3090 owner gets a GPU engine and a CPU-only machine no multi-GB download.
# Usage: installer/setup.sh [--cpu]      --cpu forces the CPU build of torch.
# TORCH_INDEX_URL overrides the wheel index of the CUDA build (default: the newest CUDA the driver supports).
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION=2.13.0
FORCE_CPU=0
for arg in "$@"; do
    case "$arg" in
        --cpu) FORCE_CPU=1 ;;
        *) echo "unknown option $arg (usage: installer/setup.sh [--cpu])" >&2; exit 2 ;;
    esac
done

# The newest CUDA wheel tag the driver can run, from nvidia-smi's "CUDA Version: 12.8" line.
cuda_wheel_tag() {
    local version major minor tag
    version=$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9]*\)\.\([0-9]*\).*/\1 \2/p' | head -n1)
    [ -n "$version" ] || return 1
    read -r major minor <<<"$version"
    for tag in 130 129 128 126; do
        if (( major * 10 + minor >= tag )); then echo "cu$tag"; return 0; fi
    done
    return 1
}

if [ "$FORCE_CPU" = 0 ] && TAG=$(cuda_wheel_tag); then
    TORCH_BUILD="CUDA build of torch ($TAG)"
    TORCH_ARGS=("torch==$TORCH_VERSION" --index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/$TAG}")
else
    TORCH_BUILD="CPU build of torch ($([ "$FORCE_CPU" = 1 ] && echo "--cpu" || echo "no NVIDIA driver with CUDA 12.6+ answered"))"
    TORCH_ARGS=("torch==$TORCH_VERSION")
fi
if [ -n "${PAGEDESK_SETUP_DRY_RUN:-}" ]; then  # tests: say what would be installed, touch nothing
    echo "would install the $TORCH_BUILD: pip install ${TORCH_ARGS[*]}"; exit 0
fi

python3 -m venv .venv
source .venv/bin/activate
python -m pip install -q --upgrade pip
if python -c "import torch" 2>/dev/null; then
    echo "torch already in .venv: $(python -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)')"
else
    echo "Installing the $TORCH_BUILD"
    python -m pip install -q "${TORCH_ARGS[@]}"
fi
python -m pip install -q -e ".[dev]"
python -c 'import torch; print("torch", torch.__version__, "- CUDA available:", torch.cuda.is_available())'
echo "PagedDesk installed in $(pwd)/.venv"
