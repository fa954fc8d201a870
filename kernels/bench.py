"""GPU benchmark of the Triton kernels: `python -m kernels.bench` prints markdown tables for BENCHMARKS.md.

For each kernel case it first checks the Triton result against the torch reference, then times it
(median of CUDA-event timings after warm-up, inputs rotated across enough copies to exceed the L2
cache) and reports achieved bandwidth against the bytes the kernel must move and against a measured
device-to-device copy bandwidth. Then a batch-1 decode step of real model shapes (Qwen2.5-0.5B,
Llama-3-8B: q/k/v/o/gate/up/down matmuls with random fp16 weights, our KV write and decode attention per
layer, plus lm_head) against the floor of weight+KV bytes over copy bandwidth, eager and as a CUDA graph.
Last, the quantized linear kernels (kernels/bench_quant.py) against dense 16-bit matmuls.
Without a CUDA device it prints "no CUDA device: nothing to time" and exits 0; ``--smoke`` instead
runs tiny cases on CPU (with TRITON_INTERPRET=1) so the script itself can be tested without a GPU.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch

from kernels.attention_torch import is_fp8, paged_attention_torch, write_kv_cache_torch
from kernels.bench_models import MODEL_SHAPES, TINY_MODEL, bench_model_decode
from kernels.bench_quant import bench_quant_linear
from kernels.bench_timing import copy_bandwidth, l2_bytes, markdown_table, median_ms, rotations_for
from kernels.paged_batch import PagedBatch, make_paged_batch

@dataclass(frozen=True, slots=True)
class AttentionCase:
    name: str
    query_lens: list[int]
    seq_lens: list[int]
    num_kv_heads: int = 8
    group: int = 4
    head_dim: int = 128
    cache_dtype: torch.dtype | None = None  # None: same as the compute dtype


@dataclass(frozen=True, slots=True)
class Result:
    kernel: str
    case: str
    ms: float
    bytes_moved: float
    flops: float
    error: str  # "exact", "max err 1.2e-03" or "MISMATCH ..."


def full_cases() -> list[AttentionCase]:
    return [
        AttentionCase("decode b1 ctx4096", [1], [4096]),
        AttentionCase("decode b16 ctx2048", [1] * 16, [2048] * 16),
        AttentionCase("decode b64 ctx1024", [1] * 64, [1024] * 64),
        AttentionCase("decode b16 ctx2048 fp8e4m3", [1] * 16, [2048] * 16, cache_dtype=torch.float8_e4m3fn),
        AttentionCase("decode b16 ctx2048 fp8e5m2", [1] * 16, [2048] * 16, cache_dtype=torch.float8_e5m2),
        AttentionCase("decode b32 ctx1000 gqa7 d64", [1] * 32, [1000] * 32, num_kv_heads=2, group=7, head_dim=64),
        AttentionCase("prefill 2048", [2048], [2048]),
        AttentionCase("prefill chunk 512 after 3584", [512], [4096]),
        AttentionCase("mixed 512-chunk + 32 decodes", [512] + [1] * 32, [2048] + [2048] * 32),
    ]


def smoke_cases() -> list[AttentionCase]:
    return [AttentionCase("decode b2", [1, 1], [20, 33], 2, 2, 64),
            AttentionCase("mixed", [5, 1], [21, 9], 2, 2, 64, torch.float8_e4m3fn)]


# ---------------------------------------------------------------- kernel cases

def bench_write_kv(backend, device, dtype, num_tokens: int, cache_dtype: torch.dtype, iters: int) -> Result:
    write_triton, _ = backend
    heads, dim = 8, 128
    per_call = num_tokens * heads * dim * 2 * (dtype.itemsize + cache_dtype.itemsize)
    copies = []
    for _ in range(rotations_for(per_call, l2_bytes(device))):
        key, value = (torch.randn(num_tokens, heads, dim, device=device, dtype=dtype) for _ in range(2))
        num_blocks = num_tokens // 16 + 1
        caches = [torch.zeros(num_blocks, 16, heads, dim * cache_dtype.itemsize, device=device, dtype=torch.uint8)
                  .view(cache_dtype) for _ in range(2)]
        slots = torch.randperm(num_blocks * 16, device=device)[:num_tokens]
        copies.append((key, value, *caches, slots))
    scale = 0.25 if is_fp8(cache_dtype) else None
    key, value, k_cache, v_cache, slots = copies[0]
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_cache_torch(key, value, k_ref, v_ref, slots, scale, scale)
    write_triton(key, value, k_cache, v_cache, slots, scale, scale)
    same = torch.equal(k_cache.view(torch.uint8), k_ref.view(torch.uint8)) and torch.equal(
        v_cache.view(torch.uint8), v_ref.view(torch.uint8))
    ms = median_ms(lambda i: write_triton(*copies[i], scale, scale), len(copies), device, iters)
    name = f"{num_tokens} tokens -> {str(cache_dtype).removeprefix('torch.')}"
    return Result("write_kv", name, ms, per_call, 0.0, "exact" if same else "MISMATCH (bytes differ)")


def attention_bytes_and_flops(case: AttentionCase, dtype: torch.dtype) -> tuple[float, float]:
    """Bytes: every cached K/V token read once, queries read, outputs written. Flops: QK^T and PV over
    the keys each new token sees (causal), 2 flops per multiply-add."""
    cache_item = (case.cache_dtype or dtype).itemsize
    num_heads = case.num_kv_heads * case.group
    kv = sum(case.seq_lens) * case.num_kv_heads * case.head_dim * 2 * cache_item
    qo = sum(case.query_lens) * num_heads * case.head_dim * 2 * dtype.itemsize
    visible = sum(q * (s - q) + q * (q + 1) // 2 for q, s in zip(case.query_lens, case.seq_lens))
    return kv + qo, 4.0 * visible * num_heads * case.head_dim


def bench_attention(backend, device, dtype, case: AttentionCase, iters: int) -> Result:
    write_triton, attention_triton = backend
    bytes_moved, flops = attention_bytes_and_flops(case, dtype)
    batches = [_written_batch(case, dtype, device, write_triton)
               for _ in range(rotations_for(bytes_moved, l2_bytes(device)))]
    scale = case.head_dim ** -0.5

    def run(i: int, attention=attention_triton) -> torch.Tensor:
        b = batches[i]
        return attention(b.query, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.query_start_loc, scale,
                         None, b.k_scale, b.v_scale)

    error = _compare(run(0), run(0, paged_attention_torch), dtype)
    ms = median_ms(run, len(batches), device, iters)
    return Result("paged_attention", case.name, ms, bytes_moved, flops, error)


def _written_batch(case: AttentionCase, dtype, device, write) -> PagedBatch:
    batch = make_paged_batch(case.query_lens, case.seq_lens, case.num_kv_heads, case.group, case.head_dim,
                             dtype=dtype, cache_dtype=case.cache_dtype, device=device)
    write(batch.new_key, batch.new_value, batch.k_cache, batch.v_cache, batch.slot_mapping,
          batch.k_scale, batch.v_scale)
    batch.dense_keys.clear()  # the oracle lists are not needed here; free their memory
    batch.dense_values.clear()
    return batch


def _compare(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> str:
    err = float((got.float() - expected.float()).abs().max())
    limit = 1e-3 if dtype == torch.float32 else 2e-2
    return f"max err {err:.1e}" if err <= limit else f"MISMATCH max err {err:.1e} > {limit:.0e}"


# ---------------------------------------------------------------- report

def kernel_rows(results: list[Result], copy_bw: float) -> list[list[str]]:
    rows = []
    for r in results:
        bw = r.bytes_moved / (r.ms * 1e-3)
        tflops = f"{r.flops / (r.ms * 1e-3) / 1e12:.1f}" if r.flops else "-"
        rows.append([r.kernel, r.case, f"{r.ms:.4f}", f"{r.bytes_moved / 1e6:.1f}", f"{bw / 1e9:.0f}",
                     f"{100 * bw / copy_bw:.0f}%", tflops, r.error])
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m kernels.bench", description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    parser.add_argument("--iters", type=int, default=50, help="timed calls per case (median reported)")
    parser.add_argument("--context", type=int, default=1024, help="cached tokens in the model decode step")
    parser.add_argument("--models", nargs="*", default=list(MODEL_SHAPES), choices=list(MODEL_SHAPES))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, runs on CPU with TRITON_INTERPRET=1")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available() and not args.smoke:
        print("no CUDA device: nothing to time")
        return 0
    from kernels import get_attention_backend  # Triton is imported only once there is something to run
    backend = get_attention_backend("triton")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype) if device.type == "cuda" else torch.float32
    iters = 2 if args.smoke else args.iters
    copy_bw = copy_bandwidth(device, (1 << 20) if args.smoke else min(1 << 30, _free_bytes(device) // 8))
    print(f"## {_device_name(device)}: device-to-device copy {copy_bw / 1e9:.0f} GB/s (read + write)\n")
    results = [bench_write_kv(backend, device, dtype, n, c, iters)
               for n, c in ([(8, dtype)] if args.smoke else
                            [(256, dtype), (4096, dtype), (4096, torch.float8_e4m3fn)])]
    results += [bench_attention(backend, device, dtype, case, iters)
                for case in (smoke_cases() if args.smoke else full_cases())]
    print(markdown_table(["kernel", "case", "median ms", "MB moved", "GB/s", "% of copy", "TFLOP/s", "vs torch"],
                         kernel_rows(results, copy_bw)))
    print()
    shapes = [TINY_MODEL] if args.smoke else [MODEL_SHAPES[m] for m in args.models]
    print(bench_model_decode(backend, shapes, device, dtype, 32 if args.smoke else args.context, copy_bw, iters))
    print()
    quant = bench_quant_linear(device, dtype, args.smoke, iters, copy_bw)
    print(quant)
    return 1 if any(r.error.startswith("MISMATCH") for r in results) or "MISMATCH" in quant else 0


def _free_bytes(device: torch.device) -> int:
    return torch.cuda.mem_get_info(device)[0]


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (smoke run, Triton interpreter)"


if __name__ == "__main__":
    sys.exit(main())
