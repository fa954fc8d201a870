"""`pagedesk-bench moe-tune`: time the fused-MoE kernel's tile configurations for one MoE shape and write the
fastest per batch size into the tile table the kernel reads (kernels/moe_tuning.py), keyed by device name.

For every batch size it builds random experts of the shape (float, or packed int4/int8/fp8/mxfp4 as the
checkpoint stores them), routes random tokens, and times the whole fused MoE (both grouped GEMMs and the
sort) with kernels.bench_timing.median_ms for each candidate; a candidate must first reproduce the default
tiles' output (a tile that miscompiles is never chosen) and compile within the card's resources. Up to 16
tokens only BLOCK_M 16 is tried, so decode steps keep reading each expert once. On a machine without a GPU
it runs under the Triton interpreter with a tiny search space: a smoke run of the same code, whose timings
mean nothing (the table's device is then "cpu", which no CUDA step reads).
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from pathlib import Path

DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
WEIGHTS = ("bf16", "fp16", "fp32", "int4", "int8", "fp8", "mxfp4")


def candidates(num_tokens: int, search: str, act_bytes: int, weight_bits: int, smem_bytes: int):
    """Tile configurations to time: `full` is the grid below filtered by shared memory (what the pipeline's
    stages hold: an activation tile and a weight tile each), `small` four configurations around the defaults
    (the interpreter's smoke run)."""
    from kernels.moe_tuning import DECODE_TOKENS, MoETiles
    if search == "small":
        ms = [16] if num_tokens <= DECODE_TOKENS else [16, 32]
        return [MoETiles(m, n, 32, 1, 4, 2) for m in ms for n in (16, 32)][:4]
    out = []
    block_ms = [16] if num_tokens <= DECODE_TOKENS else [16, 32, 64, 128]
    for m, n, k, group_m, warps, stages in itertools.product(block_ms, (32, 64, 128, 256), (32, 64, 128, 256),
                                                             (1, 8, 16), (4, 8), (2, 3, 4, 5)):
        if m * 2 > num_tokens * 8 and m > 16:
            continue  # M blocks far beyond the rows any expert gets: only padding
        if (m * k * act_bytes + k * n * weight_bits // 8) * stages > smem_bytes:
            continue
        out.append(MoETiles(m, n, k, group_m, warps, stages))
    return out


def make_experts(kind: str, experts: int, n: int, k: int, dtype, device, gen):
    """Random experts of one projection in the layout the kernel reads (kernels/moe_torch.py)."""
    import torch

    from kernels.moe_torch import PackedExperts
    from kernels.quant_torch import pack_int32
    if kind in ("bf16", "fp16", "fp32"):
        return (torch.randn(experts, n, k, generator=gen) * 0.05).to(device=device, dtype=dtype)
    if kind in ("int4", "int8"):
        bits, group = int(kind[3:]), 128 if k % 128 == 0 else k
        codes = torch.randint(0, 1 << bits, (experts, k, n), generator=gen, dtype=torch.int32)
        words = torch.stack([pack_int32(codes[e], bits, 0) for e in range(experts)])
        scales = (torch.rand(experts, k // group, n, generator=gen) * 0.01).to(torch.float16)
        zeros = torch.full((experts, k // group, n), 1 << (bits - 1), dtype=torch.uint8 if bits == 4 else torch.int16)
        return PackedExperts("int", words.to(device), scales.to(device), zeros.to(device), bits, group, dtype)
    if kind == "fp8":
        weight = (torch.randn(experts, n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        scales = torch.rand(experts, n, -(-k // 128), generator=gen) * 1e-4
        return PackedExperts("fp8", weight.to(device), scales.to(device), bits=8, group_size=128, dtype=dtype)
    if kind == "mxfp4":
        blocks = torch.randint(0, 256, (experts, n, k // 2), generator=gen, dtype=torch.int32).to(torch.uint8)
        scales = torch.randint(118, 124, (experts, n, k // 32), generator=gen, dtype=torch.int32).to(torch.uint8)
        return PackedExperts("mxfp4", blocks.to(device), scales.to(device), dtype=dtype)
    raise ValueError(f"--weights {kind!r} is not one of {', '.join(WEIGHTS)}")


def tune(experts: int, hidden: int, intermediate: int, top_k: int, kind: str, batches, search: str, device,
         iters: int, log=print) -> dict:
    """{batch: best MoETiles} for one shape, timing every candidate; prints one line per batch."""
    import torch

    from kernels.bench_timing import median_ms
    from kernels.moe_tuning import default_moe_tiles
    from kernels.triton_moe import fused_moe_triton
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(kind, torch.float16)
    if device.type != "cuda" and dtype == torch.bfloat16:
        dtype = torch.float16  # the interpreter's bf16 tl.dot is wrong: the smoke run checks outputs in fp16
    gen = torch.Generator().manual_seed(0)
    w13 = make_experts(kind, experts, 2 * intermediate, hidden, dtype, device, gen)
    w2 = make_experts(kind, experts, hidden, intermediate, dtype, device, gen)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        smem = getattr(props, "shared_memory_per_block_optin", 99 * 1024) or 99 * 1024
    else:
        smem = 99 * 1024
    weight_bits = {"int4": 4, "mxfp4": 4, "int8": 8, "fp8": 8}.get(kind, dtype.itemsize * 8)
    best = {}
    for tokens in batches:
        x = torch.randn(tokens, hidden, generator=gen).to(device=device, dtype=dtype)
        logits = torch.randn(tokens, experts, generator=gen)
        weights, ids = torch.softmax(logits, -1).topk(top_k)
        weights, ids = weights.to(device), ids.to(device)
        default = default_moe_tiles(tokens, top_k, experts, kind)
        reference = fused_moe_triton(x, w13, w2, weights, ids, tiles=default)
        tol = 2e-2 * max(1.0, reference.abs().max().item())
        timed = []
        for tiles in candidates(tokens, search, dtype.itemsize, weight_bits, smem):
            try:
                out = fused_moe_triton(x, w13, w2, weights, ids, tiles=tiles)
                if not torch.allclose(out.float(), reference.float(), atol=tol, rtol=2e-2):
                    log(f"  {tiles}: output differs from the default tiles' (skipped)")
                    continue
                ms = median_ms(lambda _: fused_moe_triton(x, w13, w2, weights, ids, tiles=tiles), 1, device, iters)
            except Exception as exc:  # out of shared memory or registers on this card: not a candidate
                log(f"  {tiles}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]} (skipped)")
                continue
            timed.append((ms, tiles))
        if not timed:
            log(f"{tokens:>5} tokens: no candidate ran; the default stays")
            continue
        ms, tiles = min(timed, key=lambda t: t[0])
        default_ms = next((m for m, t in timed if t == default), None)
        versus = f", default {default_ms:.3f} ms" if default_ms is not None else ""
        log(f"{tokens:>5} tokens: {tiles} {ms:.3f} ms of {len(timed)} candidates{versus}")
        best[tokens] = tiles
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pagedesk-bench moe-tune", description=__doc__.split("\n")[0])
    parser.add_argument("--experts", type=int, default=128, help="routed experts (Qwen3-30B-A3B: 128)")
    parser.add_argument("--hidden", type=int, default=2048, help="hidden size (Qwen3-30B-A3B: 2048)")
    parser.add_argument("--intermediate", type=int, default=768,
                        help="each expert's intermediate size on one card: moe_intermediate_size / TP")
    parser.add_argument("--top-k", type=int, default=8, help="experts per token (Qwen3-30B-A3B: 8)")
    parser.add_argument("--weights", default="bf16", choices=WEIGHTS,
                        help="activation dtype for float experts, else the packed format")
    parser.add_argument("--batch", type=int, nargs="+", default=list(DEFAULT_BATCHES), help="tokens per step")
    parser.add_argument("--search", choices=("full", "small"), default=None,
                        help="candidate set (default: full on a GPU, small under the interpreter)")
    parser.add_argument("--iters", type=int, default=None, help="timed calls per candidate (default 30; 2 on CPU)")
    parser.add_argument("--output", type=Path, default=None,
                        help="tile table to update (default $PAGEDESK_MOE_TILES or ~/.cache/pagedesk/moe_tiles.json)")
    args = parser.parse_args(argv)
    import torch
    on_gpu = torch.cuda.is_available()
    if not on_gpu and os.environ.get("TRITON_INTERPRET") != "1" and "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"  # must precede triton's import
    from kernels.moe_tuning import shape_key, table_path, write_entries
    from kernels.triton_moe import device_name
    device = torch.device("cuda" if on_gpu else "cpu")
    search = args.search or ("full" if on_gpu else "small")
    iters = args.iters or (30 if on_gpu else 2)
    name = device_name(device)
    key = shape_key(args.weights, args.experts, args.hidden, args.intermediate, args.top_k)
    print(f"tuning {key} on {name} ({search} search{'' if on_gpu else ', Triton interpreter: timings mean nothing'})",
          flush=True)
    start = time.perf_counter()
    best = tune(args.experts, args.hidden, args.intermediate, args.top_k, args.weights, args.batch, search, device,
                iters, log=lambda line: print(line, flush=True))
    path = args.output or table_path()
    write_entries(path, name, key, best)
    print(f"wrote {len(best)} entries for {name!r} / {key!r} to {path} in {time.perf_counter() - start:.0f} s")
