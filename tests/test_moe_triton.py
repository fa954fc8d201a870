"""The Triton fused-MoE kernel against the torch reference loop, run on CPU by the Triton interpreter.

TRITON_INTERPRET=1 is set before triton's first import (see tests/interpreted.py); tiny shapes, fp32 and fp16
(the interpreter's bf16 tl.dot is wrong). Covered: top-k 1, 2 and 8; experts that get no tokens; one token;
token counts that are not a multiple of BLOCK_M; K (hidden or intermediate) not a multiple of BLOCK_K; expert
biases with gpt-oss's clamped SwiGLU; and the decode property that up to 16 tokens give each expert one M block.
Packed experts too: W4A16/W8A16 int (GPTQ act order's per-expert g_idx included), FP8 e4m3 with block-wise
(Qwen3-*-FP8) or per-channel scales, and MXFP4.
"""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from interpreted import fresh_process_tests  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from kernels.moe_torch import PackedExperts, fused_moe_torch  # noqa: E402
from kernels.quant_torch import dequantize_mxfp4, pack_int32  # noqa: E402
from kernels.triton_moe import (MoETiles, default_moe_tiles, fused_moe_kernel, fused_moe_triton,  # noqa: E402
                                grouped_gemm, moe_align_block_size)

IN_INTERPRETER = isinstance(tl.standard.sum, InterpretedFunction) and isinstance(fused_moe_kernel,
                                                                                  InterpretedFunction)
test_whole_module_in_a_fresh_process, _interpreted_only = fresh_process_tests(__file__, IN_INTERPRETER)
SMALL = MoETiles(16, 16, 16, 2, 1, 1)


def routing(tokens: int, experts: int, top_k: int, gen, skip: tuple[int, ...] = ()):
    """Distinct experts per token (as a router's top-k gives), never one of `skip`."""
    allowed = torch.tensor([e for e in range(experts) if e not in skip])
    ids = torch.stack([allowed[torch.randperm(len(allowed), generator=gen)[:top_k]] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    return weights / weights.sum(-1, keepdim=True), ids


CASES = [  # (tokens, experts, top_k, hidden, intermediate, bias, activation, skipped experts)
    (5, 4, 2, 24, 20, False, "silu", ()),
    (1, 4, 1, 24, 20, False, "silu", ()),  # one token
    (19, 8, 2, 40, 24, False, "silu", (1, 6)),  # experts without tokens; 38 rows, not a multiple of 16
    (6, 8, 8, 24, 16, False, "silu", ()),  # top-8: every expert
    (7, 4, 2, 24, 20, True, "swigluoai", ()),  # gpt-oss: biases and the clamp
]


@pytest.mark.parametrize("case", CASES, ids=[f"t{c[0]}-e{c[1]}-k{c[2]}-h{c[3]}-i{c[4]}-{c[6]}{'-bias' if c[5] else ''}"
                                             for c in CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_fused_moe_matches_reference(case, dtype):
    tokens, experts, top_k, hidden, inter, bias, activation, skip = case
    gen = torch.Generator().manual_seed(tokens * 31 + experts)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.3
    w2 = torch.randn(experts, hidden, inter, generator=gen) * 0.3
    b13 = torch.randn(experts, 2 * inter, generator=gen) if bias else None
    b2 = torch.randn(experts, hidden, generator=gen) if bias else None
    weights, ids = routing(tokens, experts, top_k, gen, skip)
    if activation == "swigluoai":
        w13 = w13 * 6  # pre-activations past +-7, so the clamp matters
    expected = fused_moe_torch(x, w13, w2, weights, ids, activation, b13, b2)
    cast = (lambda t: None if t is None else t.to(dtype))
    got = fused_moe_triton(x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids, activation, cast(b13), cast(b2),
                           tiles=SMALL)
    assert got.dtype == dtype and got.shape == (tokens, hidden)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected, atol=tol * max(1.0, expected.abs().max().item()), rtol=tol)


def test_default_tiles_and_larger_blocks():
    """The default table's decode tiles (BLOCK_K 128 > hidden) and a 32-row block, on the same reference."""
    gen = torch.Generator().manual_seed(0)
    x, w13, w2 = torch.randn(3, 40, generator=gen), torch.randn(4, 48, 40, generator=gen), torch.randn(4, 40, 24, generator=gen)
    weights, ids = routing(3, 4, 2, gen)
    expected = fused_moe_torch(x, w13, w2, weights, ids)
    for tiles in (None, MoETiles(32, 32, 32, 1, 4, 2)):
        torch.testing.assert_close(fused_moe_triton(x, w13, w2, weights, ids, tiles=tiles), expected, atol=1e-4,
                                   rtol=1e-4)


@pytest.mark.parametrize("tokens", [1, 2, 16])
def test_decode_reads_each_expert_once(tokens):
    """Up to 16 tokens: each expert with tokens owns exactly one M block of the sorted order (so one pass over
    its weights per N block), and experts without tokens own none."""
    gen = torch.Generator().manual_seed(tokens)
    weights, ids = routing(tokens, 8, 2, gen)
    tiles = default_moe_tiles(tokens, 2, 8)
    sorted_ids, expert_ids, num_post = moe_align_block_size(ids, tiles.block_m, 8)
    used = expert_ids[: num_post.item() // tiles.block_m].tolist()
    assert sorted(used) == sorted(set(ids.flatten().tolist()))  # one block per routed expert, none for others


def test_align_block_size_layout():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])
    sorted_ids, expert_ids, num_post = moe_align_block_size(ids, 4, 4)
    n = ids.numel()
    assert num_post.tolist() == [12]
    assert sorted_ids[:12].tolist() == [1, 4, n, n, 3, n, n, n, 0, 2, 5, n]
    assert expert_ids[:3].tolist() == [0, 1, 2] and (expert_ids[3:] == 4).all()
    assert sorted_ids.numel() == n + 4 * 3 and (sorted_ids[12:] == n).all()


def int_experts(experts: int, n: int, k: int, bits: int, group: int, gen, act_order: bool = False) -> PackedExperts:
    """Random W4A16/W8A16 experts in the packed layout: codes along K in int32 words, [E, G, N] scales/zeros;
    under act order each expert's rows are dealt to groups in its own random order (g_idx [E, K])."""
    codes = torch.randint(0, 1 << bits, (experts, k, n), generator=gen, dtype=torch.int32)
    zeros = torch.randint(0, 1 << bits, (experts, k // group, n), generator=gen, dtype=torch.int32).to(torch.int16)
    scales = torch.rand(experts, k // group, n, generator=gen) * 0.02 + 0.005
    words = torch.stack([pack_int32(codes[e], bits, dim=0) for e in range(experts)])
    g_idx = None
    if act_order:
        g_idx = torch.stack([(torch.argsort(torch.randperm(k, generator=gen)) // group) for _ in range(experts)])
        g_idx = g_idx.to(torch.int32)
    return PackedExperts("int", words, scales, zeros, bits, group, g_idx=g_idx)


def fp8_experts(experts: int, n: int, k: int, group: int, gen) -> PackedExperts:
    """Random FP8 e4m3 experts (no NaN bytes) with float32 scales per output row and block of `group` input
    columns (-1: per channel, one column)."""
    weight = (torch.randn(experts, n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    blocks = 1 if group == -1 else -(-k // group)
    scales = torch.rand(experts, n, blocks, generator=gen) * 2e-4 + 5e-5
    return PackedExperts("fp8", weight, scales, bits=8, group_size=k if group == -1 else group)


def mxfp4_experts(experts: int, n: int, k: int, gen) -> PackedExperts:
    """Random MXFP4 experts: every byte (both nibbles, incl. -0 and the subnormal 0.5) and scales 2**-6..2**1."""
    blocks = torch.randint(0, 256, (experts, n, k // 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(121, 129, (experts, n, k // 32), generator=gen, dtype=torch.int32).to(torch.uint8)
    return PackedExperts("mxfp4", blocks, scales)


WIDE = MoETiles(16, 64, 64, 1, 4, 1)  # fewer program instances: the interpreter's cost is per instance
F32, F16 = torch.float32, torch.float16
QUANT_CASES = [  # (format, bits, group, tokens, experts, top_k, hidden, intermediate, skipped experts, tiles, dtype)
    ("int", 4, 32, 5, 4, 2, 64, 32, (), WIDE, F32),  # group 32
    ("int", 4, 32, 5, 4, 2, 64, 32, (), MoETiles(16, 32, 32, 1, 4, 1), F16),  # K 64 in two BLOCK_K steps
    ("int", 4, 8, 1, 4, 1, 40, 24, (), SMALL, F16),  # one token; K = 40 and 24 not multiples of BLOCK_K 16
    ("int", 4, 128, 3, 4, 2, 128, 128, (2,), WIDE, F16),  # group 128; an expert with no tokens
    ("int", 8, 16, 19, 8, 2, 32, 16, (1, 6), WIDE, F16),  # W8A16; 38 rows, not a multiple of BLOCK_M
    ("mxfp4", 4, 32, 7, 4, 2, 64, 32, (), WIDE, F32),
    ("mxfp4", 4, 32, 6, 4, 3, 32, 64, (3,), WIDE, F16),  # top-3: every token in the same 3 experts; BLOCK_K 64
    ("act", 4, 16, 5, 4, 2, 64, 32, (1,), WIDE, F16),  # GPTQ act order: per-expert g_idx, 4 and 2 groups
    ("act", 8, 32, 3, 4, 2, 64, 32, (), WIDE, F32),
    ("fp8", 8, 32, 5, 4, 2, 64, 32, (), WIDE, F32),  # 32-column blocks inside a 64-wide K tile: per-row gather
    ("fp8", 8, 128, 3, 4, 2, 128, 64, (2,), WIDE, F16),  # Qwen3-FP8's 128 blocks: one scale row per K tile
    ("fp8", 8, 48, 2, 4, 1, 64, 24, (), MoETiles(16, 32, 32, 1, 4, 1), F16),  # 48-blocks across 32-wide K tiles
    ("fp8", 8, -1, 1, 4, 1, 40, 24, (), SMALL, F32),  # per-channel scales; one token
]


@pytest.mark.parametrize("case", QUANT_CASES, ids=[f"{c[0]}{c[1]}-g{c[2]}-t{c[3]}-e{c[4]}-k{c[5]}-h{c[6]}-i{c[7]}-"
                                                   f"{'fp32' if c[10] == F32 else 'fp16'}" for c in QUANT_CASES])
def test_quantized_experts_dequantized_in_the_kernel_match_reference(case):
    """Packed experts in, dequantized tile by tile in the kernel, against the torch loop that dequantizes each
    routed expert whole (kernels/quant_torch.py); gpt-oss's biases and clamp with MXFP4 as gpt-oss runs it."""
    fmt, bits, group, tokens, experts, top_k, hidden, inter, skip, tiles, dtype = case
    gen = torch.Generator().manual_seed(tokens * 7 + hidden)
    if fmt in ("int", "act"):
        w13, w2 = (int_experts(experts, 2 * inter, hidden, bits, group, gen, fmt == "act"),
                   int_experts(experts, hidden, inter, bits, group, gen, fmt == "act"))
        activation, b13, b2 = "silu", None, None
    elif fmt == "fp8":
        w13, w2 = fp8_experts(experts, 2 * inter, hidden, group, gen), fp8_experts(experts, hidden, inter, group, gen)
        activation, b13, b2 = "silu", None, None
    else:
        w13, w2 = mxfp4_experts(experts, 2 * inter, hidden, gen), mxfp4_experts(experts, hidden, inter, gen)
        activation = "swigluoai"
        b13, b2 = torch.randn(experts, 2 * inter, generator=gen), torch.randn(experts, hidden, generator=gen)
    x = torch.randn(tokens, hidden, generator=gen)
    weights, ids = routing(tokens, experts, top_k, gen, skip)
    expected = fused_moe_torch(x, w13, w2, weights, ids, activation, b13, b2)
    cast = (lambda t: None if t is None else t.to(dtype))
    got = fused_moe_triton(x.to(dtype), w13, w2, weights, ids, activation, cast(b13), cast(b2), tiles=tiles)
    assert got.dtype == dtype and got.shape == (tokens, hidden)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected, atol=tol * max(1.0, expected.abs().max().item()), rtol=tol)


def test_mxfp4_decode_covers_every_code_and_scale():
    """One expert, identity-like activations: the kernel's E2M1 x E8M0 decode equals the table, byte for byte."""
    blocks = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(16, 16)  # every byte once: [N=16, K=32]
    scales = torch.arange(120, 136, dtype=torch.int32).to(torch.uint8).view(16, 1)
    w = PackedExperts("mxfp4", blocks[None], scales[None])
    eye = torch.eye(32)
    ids, weights = torch.zeros(32, 1, dtype=torch.int64), torch.ones(32, 1)
    sorted_ids, expert_ids, num_post = moe_align_block_size(ids, 16, 1)
    out = torch.empty(32, 16)
    grouped_gemm(eye, w, out, None, None, (sorted_ids, expert_ids, num_post), 1, SMALL)
    assert torch.equal(out.t(), dequantize_mxfp4(blocks, scales))  # row j of x = e_j picks column j of W^T
    # 0x21: low nibble 1 (0.5), high 2 (1.0); 0xF9: low 9 (-0.5), high F (-6.0); scale 2**1
    table = dequantize_mxfp4(torch.tensor([[0x21, 0xF9] * 8], dtype=torch.uint8),
                             torch.tensor([[128]], dtype=torch.uint8))
    assert table[0, :4].tolist() == [1.0, 2.0, -1.0, -12.0]


def test_fp8_decode_covers_every_byte():
    """The kernel's e4m3 decode (bits moved into an fp16) equals torch's float8_e4m3fn for every byte but the
    two NaNs (which no weight holds; zero here), subnormals and both signs of zero included."""
    codes = torch.arange(256, dtype=torch.int32)
    codes[(codes & 0x7F) == 0x7F] = 0
    weight = codes.to(torch.uint8).view(torch.float8_e4m3fn).view(16, 16)  # [N=16, K=16]
    w = PackedExperts("fp8", weight[None], torch.ones(1, 16, 1), bits=8, group_size=16)
    ids = torch.zeros(16, 1, dtype=torch.int64)
    out = torch.empty(16, 16)
    grouped_gemm(torch.eye(16), w, out, None, None, moe_align_block_size(ids, 16, 1), 1, SMALL)
    assert torch.equal(out.t(), weight.float())


def test_the_kernel_runs_with_the_tuned_tiles_else_the_default(tmp_path, monkeypatch):
    """fused_moe_triton looks its tiles up by device and shape ("cpu" here) when none are given: the tuned
    entry when the table has one, the default table otherwise; same output either way."""
    import kernels.triton_moe as triton_moe
    from kernels.moe_tuning import ENV_PATH, loaded_table, shape_key, write_entries
    used = []
    real = triton_moe.grouped_gemm
    monkeypatch.setattr(triton_moe, "grouped_gemm", lambda *a: used.append(a[-1]) or real(*a))
    gen = torch.Generator().manual_seed(3)
    x, w13, w2 = torch.randn(2, 32, generator=gen), torch.randn(2, 32, 32, generator=gen), torch.randn(2, 32, 16,
                                                                                                        generator=gen)
    weights, ids = routing(2, 2, 1, gen)
    expected = fused_moe_torch(x, w13, w2, weights, ids)
    path = tmp_path / "tiles.json"
    monkeypatch.setenv(ENV_PATH, str(path))
    loaded_table.cache_clear()
    tuned = MoETiles(16, 16, 32, 1, 4, 1)
    write_entries(path, "cpu", shape_key("fp32", 2, 32, 16, 1), {2: tuned})
    torch.testing.assert_close(fused_moe_triton(x, w13, w2, weights, ids), expected, atol=1e-4, rtol=1e-4)
    path.write_text('{"version": 1, "devices": {}}')  # untuned
    loaded_table.cache_clear()
    torch.testing.assert_close(fused_moe_triton(x, w13, w2, weights, ids), expected, atol=1e-4, rtol=1e-4)
    loaded_table.cache_clear()
    assert used == [tuned, tuned, default_moe_tiles(2, 1, 2), default_moe_tiles(2, 1, 2)]


def test_moe_tune_smoke_run_writes_the_table(tmp_path, capsys):
    """`pagedesk-bench moe-tune` on CPU: the interpreter, the small search, one batch; every candidate checked
    against the default tiles' output, the fastest written under device "cpu" (timings not asserted)."""
    from engine.bench import main
    from kernels.moe_tuning import read_table
    path = tmp_path / "tiles.json"
    main(["moe-tune", "--experts", "2", "--hidden", "32", "--intermediate", "16", "--top-k", "1", "--weights",
          "fp8", "--batch", "2", "--iters", "1", "--output", str(path)])
    printed = capsys.readouterr().out
    print(printed)
    entry = read_table(path)["cpu"]["fp8 E2 H32 I16 k1"]
    assert set(entry) == {"2"} and entry["2"][0] == 16  # 2 tokens: a decode tile
    assert "of 2 candidates" in printed and "wrote 1 entries" in printed
