"""GPU benchmark of the GGUF dequantize-GEMV / GEMM kernels: decode GB/s per block format against HBM bandwidth.

`python -m kernels.bench_gguf` times kernels/triton_gguf.py for every quantized format the engine reads (Q8_0,
Q4_0, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4) on a Llama-3-8B MLP shape (K 4096 -> N 14336): decode batches of 1
to 32 rows through both the GEMV and the GEMM (the one `choose_quant_kernel` picks marked "chosen"), with GB/s of
the bytes each must read (the blocks and the activations) and that as a share of a device-to-device copy (the
card's practical HBM bandwidth), then a 2048-row prefill through the GEMM (TFLOP/s), beside a dense 16-bit
`F.linear`. Each case is first checked against the torch reference (kernels/gguf_torch.py). The weights are
random codes under fixed fp16 scales (speed does not depend on the values). `--smoke` runs tiny shapes on CPU
under the Triton interpreter so the script itself is tested without a GPU.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from kernels.bench_timing import copy_bandwidth, l2_bytes, markdown_table, median_ms, rotations_for
from kernels.gguf_torch import BLOCK_FORMATS, gguf_linear_torch

TYPES = ("Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4")
# byte offsets of each format's fp16 scales inside a block (random bytes there could be inf or NaN)
SCALE_OFFSETS = {"Q8_0": (0,), "Q4_0": (0,), "IQ4_NL": (0,), "IQ4_XS": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2),
                 "Q6_K": (208,), "MXFP4": ()}  # MXFP4's E8M0 byte: set apart below
FULL = dict(k=4096, n=14336, rows=(1, 2, 4, 8, 16, 32), prefill=2048)
SMOKE = dict(k=256, n=32, rows=(2,), prefill=33)  # prefill past GEMV_MAX_ROWS: the GEMM


def random_blocks(name: str, n: int, k: int, device: torch.device) -> tuple[int, torch.Tensor]:
    """(ggml type, bytes [n, k / QK * type_size]) of random codes under small fp16 scales."""
    fmt = next(f for f in BLOCK_FORMATS.values() if f.name == name)
    blocks = torch.randint(0, 256, (n, k // fmt.block_size, fmt.type_size), dtype=torch.uint8, device=device)
    scale = torch.tensor([1e-3], dtype=torch.float16).view(torch.uint8).to(device)
    for offset in SCALE_OFFSETS[name]:
        blocks[..., offset:offset + 2] = scale
    if name == "MXFP4":
        blocks[..., 0] = 117  # 2^-10 (halved): values of the same size as the others
    return fmt.ggml_type, blocks.view(n, -1)


def bench_gguf_linear(device: torch.device, dtype: torch.dtype, smoke: bool, iters: int, copy_bw: float) -> str:
    from kernels.triton_gguf import gguf_linear_triton
    from kernels.triton_quant_linear import GEMM_BLOCK_M, QuantKernel, choose_quant_kernel
    shape = SMOKE if smoke else FULL
    k, n = shape["k"], shape["n"]
    dense = torch.randn(n, k, device=device, dtype=dtype) * 0.02
    rows_out = []
    for rows, prefill in [(r, False) for r in shape["rows"]] + [(shape["prefill"], True)]:
        x = torch.randn(rows, k, device=device, dtype=dtype)
        dense_ms = median_ms(lambda _: F.linear(x, dense), 1, device, iters)
        kernels = [choose_quant_kernel(rows)] if prefill else \
            list(dict.fromkeys([choose_quant_kernel(rows), QuantKernel("gemm", GEMM_BLOCK_M, True)]))
        for name in TYPES:
            type_id, w = random_blocks(name, n, k, device)
            moved = w.numel() + rows * (k + n) * dtype.itemsize
            copies = [w] + [random_blocks(name, n, k, device)[1]
                            for _ in range(rotations_for(moved, l2_bytes(device)) - 1)]
            expected = gguf_linear_torch(x.float(), w, type_id)
            for kernel in kernels:
                got = gguf_linear_triton(x, w, type_id, kernel=kernel)
                err = float((got.float() - expected).abs().max() / expected.abs().max().clamp(min=1e-6))
                ms = median_ms(lambda i: gguf_linear_triton(x, copies[i], type_id, kernel=kernel), len(copies),
                               device, iters)
                chosen = " (chosen)" if kernel == choose_quant_kernel(rows) else ""
                rows_out.append([name, str(rows), f"{kernel.name} m{kernel.block_m}{chosen}", f"{ms:.4f}",
                                 f"{dense_ms:.4f}", f"{dense_ms / ms:.2f}×", f"{moved / (ms * 1e-3) / 1e9:.0f}",
                                 f"{100 * moved / (ms * 1e-3) / copy_bw:.0f}%",
                                 f"{2.0 * rows * k * n / (ms * 1e-3) / 1e12:.1f}",
                                 f"rel err {err:.1e}" if err < 2e-2 else f"MISMATCH rel err {err:.1e}"])
    title = f"GGUF linear K {k} -> N {n}, activations {str(dtype).removeprefix('torch.')}\n\n"
    return title + markdown_table(["type", "rows", "kernel", "median ms", f"dense {dtype.itemsize * 8}-bit ms",
                                   "speed-up", "GB/s", "% of copy", "TFLOP/s", "vs torch"], rows_out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernels.bench_gguf", description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    parser.add_argument("--iters", type=int, default=50, help="timed calls per case (median reported)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, runs on CPU with TRITON_INTERPRET=1")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not args.smoke:
        print("no CUDA device: nothing to time")
        return 0
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype) if device.type == "cuda" else torch.float32
    copy_bw = copy_bandwidth(device, (1 << 20) if args.smoke else 1 << 30)
    print(f"device-to-device copy {copy_bw / 1e9:.0f} GB/s (read + write)\n")
    table = bench_gguf_linear(device, dtype, args.smoke, 2 if args.smoke else args.iters, copy_bw)
    print(table)
    return 1 if "MISMATCH" in table else 0


if __name__ == "__main__":
    raise SystemExit(main())
