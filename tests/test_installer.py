"""installer/setup.sh picks the CUDA build of torch when an NVIDIA driver answers and the CPU build
otherwise (or with --cpu); checked in dry-run mode with a stand-in nvidia-smi on PATH."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SETUP = Path(__file__).parents[1] / "installer" / "setup.sh"
NVIDIA_SMI = """#!/bin/sh
echo "| NVIDIA-SMI 570.86.15    Driver Version: 570.86.15    CUDA Version: {cuda}     |"
"""


def dry_run(tmp_path, *args, cuda: str | None = None) -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if cuda:
        (bin_dir / "nvidia-smi").write_text(NVIDIA_SMI.format(cuda=cuda))
        (bin_dir / "nvidia-smi").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin", "PAGEDESK_SETUP_DRY_RUN": "1"}
    env.pop("TORCH_INDEX_URL", None)
    done = subprocess.run(["bash", str(SETUP), *args], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.parametrize("cuda,tag", [("12.8", "cu128"), ("13.0", "cu130"), ("12.6", "cu126")])
def test_driver_present_installs_the_cuda_build(tmp_path, cuda, tag):
    assert dry_run(tmp_path, cuda=cuda) == (f"would install the CUDA build of torch ({tag}): pip install "
                                            f"torch==2.13.0 --index-url https://download.pytorch.org/whl/{tag}")


def test_no_driver_or_cpu_flag_installs_the_cpu_build(tmp_path):
    assert dry_run(tmp_path) == ("would install the CPU build of torch (no NVIDIA driver with CUDA 12.6+ answered): "
                                 "pip install torch==2.13.0")
    assert dry_run(tmp_path, "--cpu", cuda="12.8") == "would install the CPU build of torch (--cpu): pip install " \
                                                      "torch==2.13.0"
