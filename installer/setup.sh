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
