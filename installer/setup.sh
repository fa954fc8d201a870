#!/usr/bin/env bash
# Set-up from nothing: a virtual environment in .venv with PagedDesk and its test tools.
# torch is installed first and pinned: the CUDA build when an NVIDIA driver answers (`nvidia-smi`), the CPU
# build otherwise, so a new 3090 owner gets a GPU engine and a CPU-only machine no multi-GB download.
# Usage: installer/setup.sh [--cpu] [--dev]   --cpu forces the CPU build of torch; --dev see below.
# TORCH_INDEX_URL overrides the wheel index of the CUDA build (default: the newest CUDA the driver supports).
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION=2.13.0
FORCE_CPU=0
for arg in "$@"; do
    case "$arg" in
        --cpu) FORCE_CPU=1 ;;
        --dev) ;;
        *) echo "unknown option $arg (usage: installer/setup.sh [--cpu] [--dev])" >&2; exit 2 ;;
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

# --dev: Xvfb and the X libraries Qt's xcb platform plugin loads, for the real-window test
# (tests/test_app_xvfb.py, skipped without them). Debian/Ubuntu only; needs root or sudo.
if [[ " $* " == *" --dev "* ]]; then
    XVFB_PACKAGES="xvfb xauth libxcb-cursor0 libxcb-icccm4 libxcb-image0 libxcb-keysyms1 libxcb-randr0
        libxcb-render-util0 libxcb-shape0 libxcb-xinerama0 libxcb-xkb1 libxkbcommon-x11-0 libegl1 libgl1
        libfontconfig1 libdbus-1-3"
    SUDO=""; [[ $(id -u) -ne 0 ]] && command -v sudo >/dev/null && SUDO="sudo -n"
    if command -v apt-get >/dev/null && { [[ $(id -u) -eq 0 ]] || [[ -n $SUDO ]]; }; then
        $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq \
            --no-install-recommends $XVFB_PACKAGES >/dev/null \
            && echo "Xvfb installed: the real-window test will run" \
            || echo "Xvfb could not be installed: the real-window test will be skipped"
    else
        echo "--dev: no apt-get with root/sudo here; install Xvfb yourself or the real-window test is skipped"
    fi
fi
