"""GPU benchmark of the quantized linear kernels (part of `python -m kernels.bench`).

For a Llama-3-8B MLP shape (K 4096 -> N 14336) and an attention output projection (K 4096 -> N 4096, too
narrow to fill a card without K slices) it times the W4A16 and W8A16 kernels (group 128) and weight-only
FP8 against a dense 16-bit `F.linear` of the same shape: decode batches of 1 to 64 rows through BOTH the
multi-row GEMV and the GEMM (the "kernel" column marks the one `choose_quant_kernel` picks, so the table
shows whether GEMV_MAX_ROWS sits at the crossover), with GB/s of the bytes each must read (packed weights,
scales, zero points, activations), and a 2048-row prefill (TFLOP/s). Each case is first checked against
the torch reference. `--smoke` runs tiny shapes on CPU under the Triton interpreter.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.bench_timing import l2_bytes, markdown_table, median_ms, rotations_for
from kernels.quant_torch import fp8_linear_torch, int_linear_torch, pack_int32

FULL = [dict(k=4096, n=14336, rows=(1, 2, 4, 8, 16, 32, 64), prefill=2048, group=128),
        dict(k=4096, n=4096, rows=(1, 4, 16, 32, 64), prefill=None, group=128)]
SMOKE = [dict(k=64, n=48, rows=(1, 3), prefill=20, group=32)]


def make_weights(kind: str, k: int, n: int, group: int, device) -> dict:
    if kind == "fp8":
        return dict(weight=(torch.randn(n, k, device=device) * 0.3).to(torch.float8_e4m3fn),
                    scales=torch.rand(n, device=device) + 0.5, zeros=None)
    bits = 4 if kind == "w4a16" else 8
    return dict(weight=pack_int32(torch.randint(0, 1 << bits, (k, n), device=device), bits, dim=0),
                scales=torch.rand(k // group, n, device=device) * 0.02,
                zeros=torch.randint(0, 1 << bits, (k // group, n), device=device).to(torch.int16), bits=bits)


def weight_bytes(w: dict) -> int:
    return sum(t.numel() * t.element_size() for t in (w["weight"], w["scales"], w["zeros"]) if t is not None)


def run_case(kind: str, w: dict, x: torch.Tensor, group: int, n: int, reference: bool = False,
             kernel=None) -> torch.Tensor:
    from kernels.triton_quant_linear import quant_linear_triton
    if kind == "fp8":
        if reference:
            return fp8_linear_torch(x.float(), w["weight"], w["scales"])
        return quant_linear_triton(x, w["weight"], w["scales"], None, None, 8, x.shape[-1], n, weight_fp8=True,
                                   kernel=kernel)
    if reference:
        return int_linear_torch(x.float(), w["weight"], w["scales"], w["zeros"], w["bits"], group)
    return quant_linear_triton(x, w["weight"], w["scales"], w["zeros"], None, w["bits"], group, n, kernel=kernel)


def kernels_for(rows: int, prefill: bool) -> list:
    """Both kernels for a decode batch (the GEMV holding all its rows in one tile), the GEMM for a prefill."""
    from kernels.triton_quant_linear import GEMM_BLOCK_M, QuantKernel, choose_quant_kernel
    import triton
    gemm = QuantKernel("gemm", GEMM_BLOCK_M, True)
    if prefill:
        return [choose_quant_kernel(rows)]
    block_m = triton.next_power_of_2(rows)
    gemv = choose_quant_kernel(rows) if rows <= 32 else QuantKernel("gemv", block_m, True)
    return [gemv, gemm]


def bench_quant_linear(device: torch.device, dtype: torch.dtype, smoke: bool, iters: int, copy_bw: float) -> str:
    from kernels.triton_quant_linear import choose_quant_kernel
    tables = []
    for shape in SMOKE if smoke else FULL:
        k, n, group = shape["k"], shape["n"], shape["group"]
        dense = torch.randn(n, k, device=device, dtype=dtype) * 0.02
        rows_out = []
        cases = [(r, False) for r in shape["rows"]] + ([(shape["prefill"], True)] if shape["prefill"] else [])
        for rows, prefill in cases:
            x = torch.randn(rows, k, device=device, dtype=dtype)
            act_bytes = rows * (k + n) * dtype.itemsize
            dense_ms = median_ms(lambda _: F.linear(x, dense), 1, device, iters)
            for kind in ("w4a16", "w8a16", "fp8"):
                w = make_weights(kind, k, n, group, device)
                moved = weight_bytes(w) + act_bytes
                copies = [w] + [make_weights(kind, k, n, group, device)
                                for _ in range(rotations_for(moved, l2_bytes(device)) - 1)]
                expected = run_case(kind, w, x, group, n, reference=True)
                for kernel in kernels_for(rows, prefill):
                    got = run_case(kind, w, x, group, n, kernel=kernel)
                    err = float((got.float() - expected).abs().max() / expected.abs().max().clamp(min=1e-6))
                    ms = median_ms(lambda i: run_case(kind, copies[i], x, group, n, kernel=kernel), len(copies),
                                   device, iters)
                    flops = 2.0 * rows * k * n
                    chosen = " (chosen)" if kernel == choose_quant_kernel(rows) else ""
                    rows_out.append([kind, str(rows), f"{kernel.name} m{kernel.block_m}{chosen}", f"{ms:.4f}",
                                     f"{dense_ms:.4f}", f"{dense_ms / ms:.2f}×", f"{moved / (ms * 1e-3) / 1e9:.0f}",
                                     f"{100 * moved / (ms * 1e-3) / copy_bw:.0f}%",
                                     f"{flops / (ms * 1e-3) / 1e12:.1f}",
                                     f"rel err {err:.1e}" if err < 2e-2 else f"MISMATCH rel err {err:.1e}"])
        title = (f"Quantized linear K {k} -> N {n}, group {group}, activations "
                 f"{str(dtype).removeprefix('torch.')}\n\n")
        tables.append(title + markdown_table(["weights", "rows", "kernel", "median ms",
                                              f"dense {dtype.itemsize * 8}-bit ms", "speed-up", "GB/s", "% of copy",
                                              "TFLOP/s", "vs torch"], rows_out))
    return "\n\n".join(tables)
