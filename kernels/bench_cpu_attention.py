"""CPU decode attention, one layer: torch oracle (gather + padded SDPA) vs the numba kernel, and with
`--inductor` a torch.compile'd padded-gather formulation; prints a markdown table (`python -m
kernels.bench_cpu_attention`). Figures go to BENCHMARKS.md; nothing here is asserted in tests.
"""
from __future__ import annotations

import argparse
import time

import torch

from kernels.attention_cpu import paged_attention_cpu
from kernels.attention_torch import paged_attention_torch, write_kv_cache_torch
from kernels.paged_batch import make_paged_batch


def padded_gather_decode(q, k_cache, v_cache, block_tables, seq_lens, scale: float):
    """Decode attention as dense tensor ops (what inductor can compile): gather every table entry, mask."""
    bs = k_cache.shape[1]
    pos = torch.arange(block_tables.shape[1] * bs)
    slots = block_tables.long().repeat_interleave(bs, dim=1) * bs + (pos % bs)[None]
    k, v = k_cache.flatten(0, 1)[slots], v_cache.flatten(0, 1)[slots]  # [B, L, Hkv, D]
    batch, heads, dim = q.shape
    scores = torch.einsum("bkgd,blkd->bkgl", q.view(batch, k.shape[2], -1, dim), k) * scale
    scores = scores.masked_fill((pos[None] >= seq_lens[:, None].long())[:, None, None, :], float("-inf"))
    return torch.einsum("bkgl,blkd->bkgd", scores.softmax(-1), v).reshape(batch, heads, dim)


def median_ms(fn, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kernels.bench_cpu_attention", description=__doc__)
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--inductor", action="store_true", help="also time torch.compile (minutes to compile)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    lens = torch.randint(100, 900, (args.num_seqs,)).tolist()
    b = make_paged_batch([1] * args.num_seqs, lens, num_kv_heads=4, group=2, head_dim=64)
    b.k_cache.nan_to_num_(0.0)  # the dense formulation reads unowned slots; keep them finite
    b.v_cache.nan_to_num_(0.0)
    write_kv_cache_torch(b.new_key, b.new_value, b.k_cache, b.v_cache, b.slot_mapping)
    call = (b.query, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.query_start_loc, 0.125)
    rows = [("torch oracle (gather + padded SDPA)", median_ms(lambda: paged_attention_torch(*call), args.iters), ""),
            ("numba, blocks read in place", median_ms(lambda: paged_attention_cpu(*call), args.iters), "")]
    if args.inductor:
        tables = b.block_tables.clamp(max=b.k_cache.shape[0] - 1)
        compiled = torch.compile(padded_gather_decode, dynamic=True)
        start = time.perf_counter()
        compiled(b.query, b.k_cache, b.v_cache, tables, b.seq_lens, 0.125)
        compile_s = time.perf_counter() - start
        rows.append(("torch.compile (inductor), padded gather",
                     median_ms(lambda: compiled(b.query, b.k_cache, b.v_cache, tables, b.seq_lens, 0.125), args.iters),
                     f"compile {compile_s:.0f} s"))
    print(f"\n{args.num_seqs} decodes, contexts 100-900, 8 heads / 4 KV heads, head_dim 64, one layer, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| attention | median ms | note |\n|---|---:|---|")
    for name, ms, note in rows:
        print(f"| {name} | {ms:.1f} | {note} |")


if __name__ == "__main__":
    main()
