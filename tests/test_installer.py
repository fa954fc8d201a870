"""installer/setup.sh picks the CUDA build of torch when an NVIDIA driver answers and the CPU build
otherwise (or with --cpu), each from PyTorch's own index with PyPI as an extra one; drivers older than every
wheel's CUDA release use the same major's oldest wheel (minor-version compatibility) or stop and name the
driver to install. Checked in dry-run mode with a stand-in nvidia-smi on PATH."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SETUP = Path(__file__).parents[1] / "installer" / "setup.sh"
NVIDIA_SMI = """#!/bin/sh
echo "| NVIDIA-SMI 570.86.15    Driver Version: 570.86.15    CUDA Version: {cuda}     |"
"""


EXTRA = "--extra-index-url https://pypi.org/simple"
WHEELS = Path(__file__).parents[1] / "installer" / "torch-wheels.txt"


def run_setup(tmp_path, *args, cuda: str | None = None) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if cuda:
        (bin_dir / "nvidia-smi").write_text(NVIDIA_SMI.format(cuda=cuda))
        (bin_dir / "nvidia-smi").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin", "PAGEDESK_SETUP_DRY_RUN": "1"}
    env.pop("TORCH_INDEX_URL", None)
    return subprocess.run(["bash", str(SETUP), *args], env=env, capture_output=True, text=True, timeout=30)


def dry_run(tmp_path, *args, cuda: str | None = None) -> str:
    done = run_setup(tmp_path, *args, cuda=cuda)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.parametrize("cuda,tag", [("12.8", "cu128"), ("13.0", "cu130"), ("12.6", "cu126")])
def test_driver_present_installs_the_cuda_build(tmp_path, cuda, tag):
    assert dry_run(tmp_path, cuda=cuda) == (f"would install the CUDA build of torch ({tag}): pip install "
                                            f"torch==2.13.0 --index-url https://download.pytorch.org/whl/{tag} {EXTRA}")


def test_no_driver_or_cpu_flag_installs_the_cpu_build_from_the_cpu_index(tmp_path):
    cpu = f"pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu {EXTRA}"
    assert dry_run(tmp_path) == f"would install the CPU build of torch (no NVIDIA driver answered): {cpu}"
    assert dry_run(tmp_path, "--cpu", cuda="12.8") == f"would install the CPU build of torch (--cpu): {cpu}"


@pytest.mark.parametrize("cuda", ["12.2", "12.4", "12.5"])
def test_driver_older_than_every_wheel_uses_its_major_through_minor_version_compatibility(tmp_path, cuda):
    """The 535/550 drivers of many 3090 desktops report CUDA 12.2-12.4: they used to fall into the CPU build."""
    out = dry_run(tmp_path, cuda=cuda).splitlines()
    assert out[0] == (f"note: the driver supports CUDA {cuda}, older than cu126; cu126 runs on it through CUDA "
                      "minor-version compatibility; update the driver to >= 560.28.03 for CUDA 12.6 itself")
    assert out[1] == ("would install the CUDA build of torch (cu126): pip install torch==2.13.0 --index-url "
                      f"https://download.pytorch.org/whl/cu126 {EXTRA}")


def test_driver_of_an_older_major_stops_and_names_the_driver(tmp_path):
    done = run_setup(tmp_path, cuda="11.8")
    assert done.returncode == 3 and not done.stdout
    assert done.stderr.strip() == (
        "error: the NVIDIA driver supports CUDA 11.8, but torch 2.13.0 is built only for CUDA cu130 cu129 cu128 "
        "cu126: update the NVIDIA driver to >= 525.60.13 (CUDA 12.0 or newer; >= 560.28.03 runs cu126 natively), "
        "or install the CPU build with installer/setup.sh --cpu")


def test_wheel_table_is_the_one_place(tmp_path):
    """The pinned version and tags come from installer/torch-wheels.txt, and every tag has its driver row."""
    rows = [line.split() for line in WHEELS.read_text().splitlines() if line and not line.startswith("#")]
    torch_rows = [r for r in rows if r[0] == "torch"]
    drivers = {r[1] for r in rows if r[0] == "driver"}
    assert len(torch_rows) == 1 and "2.13.0" not in SETUP.read_text()
    for tag in torch_rows[0][2:]:
        assert f"{tag[2:-1]}.{tag[-1]}" in drivers, tag
    assert "12.0" in drivers  # the floor of minor-version compatibility for the 12.x wheels


README = Path(__file__).parents[1] / "README.md"
CI = Path(__file__).parents[1] / ".ci" / "run"


def readme_block(title: str) -> str:
    """The bash block under the README's `## title` heading."""
    section = README.read_text().split(f"## {title}\n", 1)[1]
    return section.split("```bash\n", 1)[1].split("```", 1)[0].strip()


def test_the_users_set_up_leaves_the_test_tools_out(tmp_path):
    """Issue 38, item 12: the app's set-up installs the app; --dev (the test command's) adds the test tools."""
    assert "test tools" not in dry_run(tmp_path) and ".[dev]" not in dry_run(tmp_path)
    dev = dry_run(tmp_path, "--dev").splitlines()
    assert dev[-1] == "would install the test tools: pip install -e .[dev], and Xvfb for the real-window test"
    script = SETUP.read_text()
    assert 'pip install -q -e "$PACKAGE"' in script and 'PACKAGE=".[dev]"' in script


def test_the_readme_has_two_commands_and_ci_runs_the_test_one():
    run, test = readme_block("Set up and run"), readme_block("Test")
    assert run == "bash installer/setup.sh && .venv/bin/pagedesk" and "\n" not in test
    assert test.startswith("bash installer/setup.sh --dev && ") and test.endswith("-m pytest -q --durations=25")
    assert test in CI.read_text().splitlines()  # CI installs from nothing with exactly the README's command
