"""kernels/compile_check.py compiles what the launches compile (issue 32): each variant with its launch's
num_stages (a 4-stage MoE pipeline holds more shared memory than the default 3 it used to be compiled with),
every entry of a tuned MoE tile table, and a kernel whose shared memory passes sm_86's 99 KiB opt-in limit per
block fails the check (on a 3090/4090 it would fail to launch). Subprocesses: the check needs Triton compiled,
whatever this process imported."""
from __future__ import annotations

import json

from test_kernels_bench import run_module


def test_a_tuned_table_entry_above_the_shared_memory_limit_fails(tmp_path):
    table = tmp_path / "moe_tiles.json"
    table.write_text(json.dumps({"version": 1, "devices": {"NVIDIA GeForce RTX 3090": {"bf16 E8 H256 I128 k2": {
        "16": [16, 64, 128, 1, 4, 4],  # the default decode tiles: fit
        "64": [128, 256, 256, 8, 8, 3],  # 128 x 256 and 256 x 256 bf16 tiles, pipelined: far above 99 KiB
    }}}}))
    result = run_module(["kernels.compile_check", "--arch", "86", "--tuned", str(table), "--match", "tuned"],
                        TRITON_DEFAULT_FP_FUSION="1")
    lines = [line for line in result.stdout.splitlines() if line.startswith("sm_86 tuned")]
    assert result.returncode == 1 and len(lines) == 4, result.stdout + result.stderr
    fits = [line for line in lines if " 16: " in line]
    too_big = [line for line in lines if " 64: " in line]
    assert all(": ok (" in line and "KiB shared" in line for line in fits), fits
    assert all("FAILED" in line and "above sm_86's 99 KiB per block" in line for line in too_big), too_big


def test_variants_compile_with_their_launchs_stages():
    import torch

    from kernels.compile_check import moe_variant, variants
    from kernels.moe_tuning import MoETiles
    decode = moe_variant(torch.bfloat16, 16, 8, 128, True)
    assert decode.num_stages == 4 == MoETiles(16, 64, 128, 1, 4, 4).num_stages  # the default decode tiles' 4
    assert moe_variant(torch.bfloat16, 4096, 8, 128, True).num_stages == 3
    assert {v.num_stages for v in variants() if v.name.startswith("moe")} == {3, 4}
