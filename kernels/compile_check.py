"""Compile the Triton kernels for a GPU architecture on a machine without a GPU, and check the machine code.

``python -m kernels.compile_check [--arch 86 90] [--tuned moe_tiles.json]`` runs Triton's whole pipeline (TTIR,
TTGIR, LLVM, PTX, cubin with the bundled ptxas) for the kernel variants the backend launches, each with the
warps and pipelining stages its launch passes, so code that only the interpreter accepts is caught before it
meets a GPU. The quantized-linear GEMV/GEMM variants are compiled too, and the fused-MoE tiles of a tuned table
(`pagedesk-bench moe-tune`'s, kernels/moe_tuning.py: `--tuned`, or the default table when a full run finds
one). Each compiled kernel's shared memory (`metadata.shared`) must fit the architecture's opt-in limit per
block (99 KiB on sm_86/sm_89: a variant above it would fail to launch on a 3090/4090). It also reads the PTX:
FP8 caches and FP8 weights must compile to integer bit manipulation with no FP8 conversion instructions (sm_86
has none), and the FP8 KV write must use IEEE division (``div.rn.f32``) to round exactly like torch. Must run
with TRITON_INTERPRET unset. The Triton it runs is the floor pyproject.toml states (what is tested).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

TRITON_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.uint8: "u8",
                torch.int16: "i16", torch.int32: "i32", torch.int64: "i64"}


@dataclass(frozen=True, slots=True)
class Variant:
    name: str
    kernel: object  # a triton JITFunction
    pointers: dict[str, str]  # pointer argument -> "*fp16", "*u8", ...
    constexprs: dict[str, object]
    fp8: bool = False
    needs_div_rn: bool = False
    num_warps: int = 4
    num_stages: int = 3  # the launch's num_stages (Triton's default 3 where the launch passes none)


# Shared memory a block may opt into, per compute capability (CUDA programming guide, compute capabilities).
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 87: 163 * 1024, 89: 99 * 1024, 90: 227 * 1024, 120: 99 * 1024}


def _ptr(dtype: torch.dtype) -> str:
    return "*" + TRITON_TYPES[torch.uint8 if dtype.itemsize == 1 else dtype]


def write_variant(dtype: torch.dtype, cache_dtype: torch.dtype) -> Variant:
    from kernels.triton_write_kv import write_kv_constexprs, write_kv_kernel
    fp8 = cache_dtype.itemsize == 1
    pointers = dict(key_ptr=_ptr(dtype), value_ptr=_ptr(dtype), k_cache_ptr=_ptr(cache_dtype),
                    v_cache_ptr=_ptr(cache_dtype), slot_mapping_ptr="*i64", k_scale_ptr="*fp32", v_scale_ptr="*fp32")
    return Variant(f"write_kv {dtype} -> {cache_dtype}", write_kv_kernel, pointers,
                   write_kv_constexprs(cache_dtype, 8, 128, 16), fp8=fp8, needs_div_rn=fp8)


def attention_variant(dtype, cache_dtype, group: int, head_dim: int, tiles: tuple, window: bool = False,
                      large_pool: bool = False, soft_cap: bool = False, sinks: bool = False) -> Variant:
    from kernels.triton_attention import AttentionTiles, attention_constexprs
    from kernels.triton_paged_attention import paged_attention_kernel
    tiles = AttentionTiles(*tiles)
    pointers = dict(out_ptr=_ptr(dtype), part_max_ptr="*fp32", part_sum_ptr="*fp32", part_acc_ptr="*fp32",
                    query_ptr=_ptr(dtype), k_cache_ptr=_ptr(cache_dtype), v_cache_ptr=_ptr(cache_dtype),
                    block_tables_ptr="*i32", seq_lens_ptr="*i32", query_start_loc_ptr="*i32",
                    k_scale_ptr="*fp32", v_scale_ptr="*fp32", sinks_ptr="*fp32", key_limits_ptr="*i32")
    constexprs = attention_constexprs(dtype, cache_dtype, 8 * group, 8, head_dim, 16, tiles, window, large_pool,
                                      soft_cap, sinks)
    name = f"attention {dtype}/{cache_dtype} group {group} d{head_dim} {tiles}{' window' if window else ''}"
    name += " int64 offsets" if large_pool else ""
    name += (" soft-cap" if soft_cap else "") + (" sinks" if sinks else "")
    return Variant(name, paged_attention_kernel, pointers, constexprs, fp8=cache_dtype.itemsize == 1,
                   num_warps=tiles.num_warps)


def reduce_variant(dtype: torch.dtype, head_dim: int, num_splits: int) -> Variant:
    from kernels.triton_attention import reduce_constexprs
    from kernels.triton_paged_attention import reduce_splits_kernel
    pointers = dict(out_ptr=_ptr(dtype), part_max_ptr="*fp32", part_sum_ptr="*fp32", part_acc_ptr="*fp32",
                    v_scale_ptr="*fp32")
    return Variant(f"reduce {num_splits} splits d{head_dim}", reduce_splits_kernel, pointers,
                   reduce_constexprs(head_dim, num_splits))


def quant_linear_variant(dtype: torch.dtype, bits: int, group: int, act_order: bool, rows: int,
                         weight_fp8: bool = False) -> Variant:
    """The W4A16/W8A16 (or weight-only FP8) kernel and tiles quant_linear_triton launches for `rows` rows."""
    from kernels.triton_quant_linear import (GEMM_BLOCK_K, GEMM_BLOCK_N, GEMV_BLOCK_K, GEMV_BLOCK_N,
                                             choose_quant_kernel, quant_gemm_kernel, quant_gemv_kernel)
    choice = choose_quant_kernel(rows)
    gemm = choice.name == "gemm"
    # what the loader keeps: float16 scales (AWQ/GPTQ), a byte per 4-bit zero point (int16 for 8-bit)
    pointers = dict(x_ptr=_ptr(dtype), w_ptr="*u8" if weight_fp8 else "*i32",
                    scales_ptr="*fp32" if weight_fp8 else "*fp16",
                    zeros_ptr="*fp32" if weight_fp8 else ("*u8" if bits <= 4 else "*i16"), g_idx_ptr="*i32",
                    partial_ptr="*fp32", out_ptr=_ptr(dtype))
    constexprs = dict(BITS=bits, GROUP=group, HAS_G_IDX=act_order, WEIGHT_FP8=weight_fp8,
                      IEEE_FP32=dtype == torch.float32, BLOCK_M=choice.block_m)
    if gemm:
        constexprs |= dict(BLOCK_N=GEMM_BLOCK_N, BLOCK_K=GEMM_BLOCK_K)
    else:
        constexprs |= dict(USE_DOT=choice.use_dot, BLOCK_N=GEMV_BLOCK_N, BLOCK_K=GEMV_BLOCK_K)
    kind = (f"fp8{f' block {group}' if group > 1 else ''}" if weight_fp8
            else f"w{bits} g{group}{' act-order' if act_order else ''}")
    tile = "" if gemm else f" {choice.block_m} rows{' dot' if choice.use_dot else ''}"
    return Variant(f"quant {choice.name}{tile} {dtype} {kind}", quant_gemm_kernel if gemm else quant_gemv_kernel,
                   pointers, constexprs, fp8=weight_fp8)


def moe_variant(dtype: torch.dtype, tokens: int, top_k: int, experts: int, down: bool, bias: bool = False,
                weights: str = "float", bits: int = 4, group: int = 128, act_order: bool = False,
                tiles=None) -> Variant:
    """The fused-MoE grouped GEMM with the tiles default_moe_tiles picks for that batch (or `tiles`, a tuned
    table's) (down: the projection whose epilogue multiplies by the router weights); `weights` float, int
    (W4A16/W8A16 codes with `bits` and `group`, GPTQ act order's g_idx with `act_order`), fp8 (e4m3 with block
    scales of `group` columns; -1 per channel) or mxfp4, the packed ones dequantized in the kernel."""
    from kernels.triton_moe import (FLOAT_WEIGHTS, FP8_WEIGHTS, INT_WEIGHTS, MXFP4_WEIGHTS, default_moe_tiles,
                                    fused_moe_kernel)
    t = tiles or default_moe_tiles(tokens, top_k, experts, "fp8" if weights == "fp8" else "")
    b_ptr, scales, zeros = {"float": (_ptr(dtype), "*fp32", "*fp32"),
                            "int": ("*i32", "*fp16", "*u8" if bits <= 4 else "*i16"),
                            "fp8": ("*u8", "*fp32", "*fp32"),
                            "mxfp4": ("*u8", "*u8", "*u8")}[weights]
    pointers = dict(a_ptr=_ptr(dtype), b_ptr=b_ptr, c_ptr=_ptr(dtype), bias_ptr=_ptr(dtype),
                    topk_weights_ptr="*fp32", sorted_token_ids_ptr="*i32", expert_ids_ptr="*i32",
                    num_tokens_post_padded_ptr="*i32", b_scales_ptr=scales, b_zeros_ptr=zeros,
                    b_g_idx_ptr="*i32" if act_order else scales)
    fmt = {"float": (FLOAT_WEIGHTS, 16, 1), "int": (INT_WEIGHTS, bits, group),
           "fp8": (FP8_WEIGHTS, 8, 128 if group == -1 else group), "mxfp4": (MXFP4_WEIGHTS, 4, 32)}
    code, bits, group_arg = fmt[weights]
    constexprs = dict(TOP_K=1 if down else top_k, MUL_ROUTED_WEIGHT=down, HAS_BIAS=bias,
                      IEEE_FP32=dtype == torch.float32, WEIGHT_FORMAT=code, BITS=bits, GROUP=group_arg,
                      HAS_G_IDX=act_order, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
                      GROUP_M=t.group_m)
    kind = {"float": "", "int": f" w{bits} g{group}{' act-order' if act_order else ''}",
            "fp8": f" fp8 {'per-channel' if group == -1 else f'block {group}'}", "mxfp4": " mxfp4"}[weights]
    name = f"moe {'down' if down else 'gate_up'} {dtype}{kind} {tokens} tokens top-{top_k}/{experts} {t}"
    return Variant(name + (" bias" if bias else ""), fused_moe_kernel, pointers, constexprs,
                   fp8=weights == "fp8", num_warps=t.num_warps, num_stages=t.num_stages)


def tuned_moe_variants(path) -> list[Variant]:
    """Every entry of a tuned MoE tile table (any card, any shape), both projections, as its launches compile
    them: the shape key's weights and top-k (int4/int8 as GPTQ g128, fp8 with 128 x 128 blocks)."""
    from kernels.moe_tuning import MoETiles, read_table
    variants = []
    for device, shapes in read_table(Path(path)).items():
        for key, entries in shapes.items():
            weights, experts, _, _, top_k = key.split()
            kind = {"int4": dict(weights="int", bits=4), "int8": dict(weights="int", bits=8),
                    "fp8": dict(weights="fp8"), "mxfp4": dict(weights="mxfp4")}.get(weights, {})
            dtype = torch.float16 if weights == "fp16" else torch.bfloat16
            for tokens, fields in entries.items():
                tiles = MoETiles(*(int(f) for f in fields))
                for down in (False, True):
                    v = moe_variant(dtype, int(tokens), int(top_k[1:]), int(experts[1:]), down, tiles=tiles, **kind)
                    variants.append(dataclasses.replace(v, name=f"tuned [{device}] {key} {tokens}: {v.name}"))
    return variants


def moe_variants() -> list[Variant]:
    """Decode, small and large prefill tiles, for Qwen3-30B-A3B's routing (top-8 of 128) in bf16, W4A16
    (AWQ/GPTQ g128, act order too, GPTQ 8-bit) and FP8 (Qwen3-30B-A3B-FP8's 128 x 128 blocks; per-channel),
    and gpt-oss's (top-4 of 32, biases) in bf16 and MXFP4."""
    f16, bf16 = torch.float16, torch.bfloat16
    return [moe_variant(bf16, 1, 8, 128, False), moe_variant(bf16, 16, 8, 128, True),
            moe_variant(f16, 256, 8, 128, False), moe_variant(bf16, 4096, 8, 128, True),
            moe_variant(bf16, 8, 4, 32, True, bias=True), moe_variant(bf16, 2048, 2, 8, False),
            moe_variant(f16, 1, 8, 128, False, weights="int"), moe_variant(bf16, 16, 8, 128, True, weights="int"),
            moe_variant(bf16, 4096, 8, 128, False, weights="int"),
            moe_variant(bf16, 16, 8, 128, False, weights="int", bits=8),
            moe_variant(bf16, 1, 8, 128, False, weights="int", act_order=True),
            moe_variant(bf16, 16, 8, 128, True, weights="int", act_order=True),
            moe_variant(bf16, 4096, 8, 128, False, weights="int", act_order=True),
            moe_variant(bf16, 1, 8, 128, False, weights="fp8"), moe_variant(bf16, 16, 8, 128, True, weights="fp8"),
            moe_variant(f16, 256, 8, 128, False, weights="fp8"),
            moe_variant(bf16, 4096, 8, 128, True, weights="fp8"),
            moe_variant(bf16, 16, 8, 128, False, weights="fp8", group=-1),
            moe_variant(bf16, 1, 4, 32, False, bias=True, weights="mxfp4"),
            moe_variant(bf16, 16, 4, 32, True, bias=True, weights="mxfp4"),
            moe_variant(bf16, 2048, 4, 32, False, bias=True, weights="mxfp4")]


def gated_delta_variants() -> list[Variant]:
    """The Gated DeltaNet kernels at Qwen3.6-27B's shapes (16 key / 48 value heads of 128, conv width 4), bf16."""
    from kernels.triton_causal_conv1d import BLOCK_C, BLOCK_T, causal_conv1d_kernel, conv_state_update_kernel
    from kernels.triton_gated_delta import (CHUNK, DECODE_BLOCK_V, PREPARE_BLOCK_V, STATE_BLOCK_V, STATE_WARPS,
                                            chunk_prepare_kernel, chunk_state_kernel, fused_recurrent_kernel)
    bf16 = "*bf16"
    heads = dict(HEAD_GROUP=3, DK=128, DV=128, BLOCK_K=128, L2NORM=True)
    seq = dict(start_ptr="*i32", slot_ptr="*i32", init_ptr="*i8")
    return [
        Variant("gated_delta fused_recurrent bf16 d128 group 3", fused_recurrent_kernel,
                dict(q_ptr=bf16, k_ptr=bf16, v_ptr=bf16, g_ptr="*fp32", beta_ptr=bf16, o_ptr=bf16,
                     state_ptr="*fp32", keep_ptr="*i8", **seq), dict(BLOCK_V=DECODE_BLOCK_V, **heads)),
        Variant("gated_delta chunk_prepare bf16 d128 group 3", chunk_prepare_kernel,
                dict(k_ptr=bf16, v_ptr=bf16, g_ptr="*fp32", beta_ptr=bf16, u_ptr="*fp32", w_ptr="*fp32",
                     c_ptr="*fp32", chunk_seq_ptr="*i32", chunk_first_ptr="*i32", start_ptr="*i32"),
                dict(HV=48, BT=CHUNK, BLOCK_V=PREPARE_BLOCK_V, DOT="tf32", **heads)),
        Variant("gated_delta chunk_state bf16 d128 group 3", chunk_state_kernel,
                dict(q_ptr=bf16, k_ptr=bf16, u_ptr="*fp32", w_ptr="*fp32", c_ptr="*fp32", o_ptr=bf16,
                     state_ptr="*fp32", long_seq_ptr="*i32", keep_ptr="*i8", **seq),
                dict(HV=48, BT=CHUNK, BLOCK_V=STATE_BLOCK_V, DOT="tf32", **heads), num_warps=STATE_WARPS),
        Variant("gated_delta causal_conv1d bf16 width 4", causal_conv1d_kernel,
                dict(x_ptr=bf16, w_ptr=bf16, bias_ptr=bf16, state_ptr=bf16, y_ptr=bf16, token_seq_ptr="*i32", **seq),
                dict(WIDTH=4, HAS_BIAS=False, SILU=True, BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C)),
        Variant("gated_delta conv_state_update bf16 width 4", conv_state_update_kernel,
                dict(x_ptr=bf16, state_ptr=bf16, keep_ptr="*i8", **seq), dict(WIDTH=4, BLOCK_K=4, BLOCK_C=BLOCK_C)),
    ]


DECODE, DECODE_SPLIT, PREFILL = (16, 1, 32, 1, 8, 3), (16, 1, 32, 16, 8, 3), (64, 16, 32, 1, 8, 2)


def variants() -> list[Variant]:
    """What choose_tiles picks for common shapes (AttentionTiles fields as tuples), in every cache dtype."""
    f16, bf16, f32, e4m3, e5m2 = torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2
    return [
        write_variant(f16, f16), write_variant(f16, e4m3), write_variant(bf16, e5m2),
        attention_variant(f16, f16, 4, 128, DECODE),  # Llama-3-8B
        attention_variant(f16, f16, 4, 128, DECODE_SPLIT),
        attention_variant(f16, f16, 4, 128, PREFILL, window=True),
        attention_variant(f16, f16, 4, 128, (64, 16, 32, 1, 8, 1)),  # sm_8x prefill
        attention_variant(f16, e4m3, 4, 128, DECODE_SPLIT),
        attention_variant(f16, e4m3, 4, 128, DECODE, large_pool=True),
        attention_variant(bf16, e5m2, 4, 128, PREFILL),
        attention_variant(f32, f32, 2, 64, (64, 32, 32, 1, 8, 1)),
        attention_variant(f16, f16, 7, 64, DECODE),  # Qwen2.5-0.5B
        attention_variant(f16, f16, 7, 64, (64, 9, 32, 2, 8, 2)),
        attention_variant(f16, f16, 2, 80, (64, 32, 32, 1, 8, 2)),  # non-power-of-two head_dim
        attention_variant(bf16, bf16, 2, 256, (32, 16, 16, 1, 8, 2)),
        attention_variant(bf16, bf16, 2, 256, (32, 16, 16, 1, 8, 2), window=True, soft_cap=True),  # Gemma 2
        attention_variant(f16, e4m3, 2, 256, (16, 1, 16, 4, 8, 3), soft_cap=True),
        attention_variant(bf16, bf16, 8, 64, (16, 1, 32, 8, 8, 3), window=True, sinks=True),  # gpt-oss
        attention_variant(bf16, bf16, 8, 64, (64, 8, 32, 1, 8, 2), sinks=True),
        reduce_variant(f16, 128, 16),
        *[quant_linear_variant(f16, 4, 128, False, rows) for rows in (1, 2, 4, 8, 16, 32, 64)],
        quant_linear_variant(bf16, 4, 128, True, 64), quant_linear_variant(bf16, 4, 128, True, 16),
        quant_linear_variant(bf16, 8, 4096, False, 1), quant_linear_variant(bf16, 8, 4096, False, 32),
        quant_linear_variant(f16, 8, 1, False, 64, weight_fp8=True),
        quant_linear_variant(bf16, 8, 1, False, 1, weight_fp8=True),
        quant_linear_variant(bf16, 8, 1, False, 16, weight_fp8=True),
        *[quant_linear_variant(bf16, 8, 128, False, rows, weight_fp8=True) for rows in (1, 16, 64)],  # Qwen3-FP8
        *moe_variants(),
        *gated_delta_variants(),
    ]


def quick_variants() -> list[Variant]:
    """The FP8 paths plus one mixed-batch and one reduce variant: what CI compiles on every run."""
    f16, e4m3 = torch.float16, torch.float8_e4m3fn
    return [write_variant(f16, e4m3), attention_variant(f16, e4m3, 4, 128, DECODE_SPLIT),
            attention_variant(f16, f16, 7, 64, (64, 9, 32, 1, 8, 1), window=True), reduce_variant(f16, 128, 8),
            attention_variant(f16, f16, 2, 64, DECODE_SPLIT, window=True, soft_cap=True, sinks=True),
            quant_linear_variant(f16, 4, 128, False, 1), quant_linear_variant(f16, 4, 128, False, 16),
            quant_linear_variant(f16, 4, 128, False, 64), quant_linear_variant(f16, 8, 1, False, 64, weight_fp8=True),
            moe_variant(torch.bfloat16, 16, 8, 128, True),
            moe_variant(torch.bfloat16, 16, 8, 128, False, weights="int"),
            moe_variant(torch.bfloat16, 16, 4, 32, True, bias=True, weights="mxfp4"),
            moe_variant(torch.bfloat16, 16, 8, 128, False, weights="fp8")]


def compile_variant(variant: Variant, arch: int):
    """The compiled kernel (its `.asm` and `.metadata`) of a variant for an architecture."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    signature = {}
    for name in variant.kernel.arg_names:
        if name in variant.constexprs:
            signature[name] = "constexpr"
        else:
            signature[name] = variant.pointers.get(name, "fp32" if name in ("softmax_scale", "soft_cap", "scale") else "i32")
    constexprs = {(variant.kernel.arg_names.index(k),): v for k, v in variant.constexprs.items()}
    source = ASTSource(variant.kernel, signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": variant.num_warps, "num_stages": variant.num_stages})


def check_shared(shared: int, arch: int) -> list[str]:
    limit = SHARED_LIMIT.get(arch)
    if limit is None or shared <= limit:
        return []
    return [f"needs {shared / 1024:.1f} KiB of shared memory, above sm_{arch}'s {limit // 1024} KiB per block"]


def register_usage(ptx: str, arch: int) -> str:
    """Registers and spill bytes per thread from Triton's bundled ptxas (the only perf signal without a GPU)."""
    import triton
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    ptxas = next((p for p in (bin_dir / "ptxas-blackwell", bin_dir / "ptxas") if p.exists()), None)
    if ptxas is None:
        return "ptxas not found"
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "kernel.ptx"
        source.write_text(ptx)
        arch_name = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        report = subprocess.run([str(ptxas), f"-arch={arch_name}", "-v", str(source), "-o", os.devnull],
                                capture_output=True, text=True).stderr
    registers = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores", report)
    if not (registers and spills):
        return "ptxas gave no usage report"
    return f"{registers.group(1)} registers, {spills.group(1)} B spilled"


def check_ptx(variant: Variant, ptx: str) -> list[str]:
    problems = []
    if variant.fp8 and any(word in ptx for word in ("e4m3", "e5m2")):
        problems.append("uses an FP8 conversion instruction")
    if variant.needs_div_rn and "div.rn.f32" not in ptx:
        problems.append("FP8 write does not use IEEE division div.rn.f32")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernels.compile_check", description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[86], help="compute capabilities, e.g. 86 90")
    parser.add_argument("--quick", action="store_true", help="only the few variants CI compiles")
    parser.add_argument("--match", default="", help="only variants whose name contains this text, e.g. moe")
    parser.add_argument("--tuned", default=None, help="a tuned MoE tile table (moe_tiles.json) whose every entry "
                        "compiles too; a full run also takes the default table when there is one")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("TRITON_INTERPRET=1 is set: kernels would be interpreted, not compiled; unset it")
        return 2
    from kernels.moe_tuning import table_path
    chosen = quick_variants() if args.quick else variants()
    tuned = args.tuned or (None if args.quick or not table_path().exists() else table_path())
    if tuned:
        chosen += tuned_moe_variants(tuned)
    failures = 0
    for arch in args.arch:
        for variant in chosen:
            if args.match not in variant.name:
                continue
            start = time.perf_counter()
            usage = ""
            try:
                compiled = compile_variant(variant, arch)
                ptx, shared = compiled.asm["ptx"], compiled.metadata.shared
                problems = check_ptx(variant, ptx) + check_shared(shared, arch)
                usage = f"{shared / 1024:.1f} KiB shared, {register_usage(ptx, arch)}"
            except Exception as exc:  # report every variant, then fail
                problems = [f"{type(exc).__name__}: {exc}"]
            failures += bool(problems)
            status = "ok" if not problems else "FAILED " + "; ".join(problems)
            print(f"sm_{arch} {variant.name}: {status} ({time.perf_counter() - start:.1f}s) {usage}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
