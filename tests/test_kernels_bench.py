"""The GPU benchmark and the ahead-of-time compile check, exercised on a CPU-only machine.

Each runs in a subprocess: the benchmark must say there is nothing to time without CUDA, its --smoke
mode must run end to end under the Triton interpreter, and every quick kernel variant must compile to
sm_86 machine code (with the FP8 paths free of FP8 instructions). The compile check needs Triton
un-interpreted, which a subprocess guarantees whatever this process imported.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_module(args: list[str], **env: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | env
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=environment, capture_output=True,
                          text=True, timeout=300)


def test_bench_without_cuda_has_nothing_to_time():
    result = run_module(["kernels.bench"], CUDA_VISIBLE_DEVICES="")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "no CUDA device: nothing to time"


def test_bench_smoke_run_prints_tables():
    result = run_module(["kernels.bench", "--smoke"], CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "| write_kv | 8 tokens -> float32 |" in result.stdout and "exact" in result.stdout
    assert "MISMATCH" not in result.stdout
    assert "| tiny (smoke) | 2 |" in result.stdout
    assert "| w4a16 | 1 |" in result.stdout and "| fp8 | 20 |" in result.stdout


def test_quick_kernel_variants_compile_for_sm86():
    result = run_module(["kernels.compile_check", "--quick", "--arch", "86"], TRITON_DEFAULT_FP_FUSION="1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count(": ok (") == 15, result.stdout  # incl. int4 KV, W4A16, MXFP4 and FP8 fused-MoE variants
    moe = [line for line in result.stdout.splitlines() if " moe " in line]
    assert len(moe) == 4 and all(line.endswith(" 0 B spilled") for line in moe), moe  # the default MoE tiles
