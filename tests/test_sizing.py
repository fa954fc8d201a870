"""KV-cache sizing against hand-computed cases, and the per-card (tensor-parallel, mixed cards) choice.

Model shapes are the real config.json values; every expected number is worked out in the comments.
Units: GiB = 2**30 bytes; a "24 GB" RTX 3090/4090 reports 24 GiB; bf16/fp16 = 2 bytes, fp8 = 1 byte.
"""
from __future__ import annotations

import pytest
import torch

from engine.config.flags import EngineConfig
from engine.worker.kv_cache_sizing import choose_num_blocks
from engine.config.model import ModelConfig
from engine.planning.capacity import MemoryProfile, other_programs_note, plan_from_profile
from engine.planning.graphs import estimate_piecewise_graph_bytes
from engine.planning.planner import plan_capacity
from engine.planning.units import GIB

CARD_24G = 24 * GIB

LLAMA_3_8B = ModelConfig.from_hf_config({
    "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
    "max_position_embeddings": 8192, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16"})
QWEN25_32B = ModelConfig.from_hf_config({
    "architectures": ["Qwen2ForCausalLM"], "hidden_size": 5120, "num_hidden_layers": 64,
    "num_attention_heads": 40, "num_key_value_heads": 8, "intermediate_size": 27648, "vocab_size": 152064,
    "max_position_embeddings": 32768, "rope_theta": 1000000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16"})


def test_llama3_8b_on_one_24gb_card():
    # head_dim = 4096/32 = 128; q = 32·128 = 4096 columns, k = v = 8·128 = 1024.
    # Per layer: qkv 4096·(4096 + 2·1024) = 25,165,824; o 4096·4096 = 16,777,216;
    #   gate+up+down 3·4096·14336 = 176,160,768 → 218,103,808; × 32 layers = 6,979,321,856.
    # Embedding + LM head (untied) 2·128256·4096 = 1,050,673,152; norms (2·32+1)·4096 = 266,240.
    # Params 8,030,261,248 (the "8B") × 2 bytes = 16,060,522,496 B, plus ONE shared float32 RoPE cos/sin table
    #   8192 positions · 128 · 4 B = 4,194,304 → 16,064,716,800 B = 14.96 GiB held after loading.
    # KV per token: 2 (K,V) · 32 layers · 8 heads · 128 · 2 B = 131,072 B = 128 KiB.
    # Activations at 8192 batched tokens: 8192 · (4·4096 + (32+16)·128 + 3·14336) · 2 B = 1,073,741,824,
    #   plus the sampler at 256 × 128256: 36 B per logit (SAMPLER_BYTES_PER_LOGIT, its measured peak) =
    #   1,182,007,296 → 2,255,749,120.
    # Usable int(24 GiB · 0.9) − 0 held by others = 23,192,823,398; KV budget 23,192,823,398 − 16,064,716,800
    #   − 2,255,749,120 = 4,872,357,478 → // (131,072 · 16) = 2323 blocks = 37,168 tokens = 4 × 8192 (and more).
    plan = plan_capacity(LLAMA_3_8B, [CARD_24G], 0.9, dtype="bfloat16")
    assert plan.weights_bytes == 16_064_716_800
    assert plan.kv_bytes_per_token == 131_072
    assert plan.activation_bytes == 2_255_749_120
    assert plan.usable_bytes == 23_192_823_398
    assert plan.kv_budget_bytes == 4_872_357_478
    assert (plan.num_blocks, plan.num_tokens, plan.num_full_seqs) == (2323, 37_168, 4)
    assert plan.fits
    assert plan.summary() == ("weights 14.96 GiB/card · KV 128.0 KiB/token · 37,168 tokens fit · "
                              "4 × 8,192-token sequences")


def test_planner_subtracts_what_the_desktop_holds_and_the_cuda_graphs():
    # Same Llama on a 3090 whose desktop holds 1.5 GiB: usable 23,192,823,398 − 1,610,612,736 = 21,582,210,662.
    # CUDA graphs: activations of a 256-token decode batch 256 · 65,536 · 2 = 33,554,432, plus 2 MiB for each of
    #   the 20 batch sizes (1, 2, 4, 8, 16 … 256) × 5 context lengths (512, 1024, 2048, 4096, 8192)
    #   = 209,715,200 → 243,269,632.
    # KV 21,582,210,662 − 16,064,716,800 − 2,255,749,120 − 243,269,632 = 3,018,475,110 → 1439 blocks.
    plan = plan_capacity(LLAMA_3_8B, [CARD_24G], 0.9, dtype="bfloat16", other_programs_bytes=[3 * GIB // 2],
                         cuda_graphs=True, cuda_graph_mode="full_decode_only")
    assert plan.usable_bytes == 21_582_210_662 and plan.other_programs_bytes == 3 * GIB // 2
    assert plan.overhead_bytes == 243_269_632
    assert plan.num_blocks == 1439


def test_planner_counts_the_piecewise_graphs_of_the_default_mode():
    # full_and_piecewise (the default) adds the pieces up to the 8192-token step budget:
    # estimate_piecewise_graph_bytes = one forward's activations at 8192 tokens (8192 · 65,536 · 2 B =
    # 1,073,741,824) + 64 KiB per piece × 32 token buckets (16 … 8192) × 33 pieces (32 layers + 1) = 69,206,016
    # → 1,142,947,840.
    decode_only = plan_capacity(LLAMA_3_8B, [CARD_24G], 0.9, dtype="bfloat16", cuda_graphs=True,
                                cuda_graph_mode="full_decode_only")
    both = plan_capacity(LLAMA_3_8B, [CARD_24G], 0.9, dtype="bfloat16", cuda_graphs=True)
    assert estimate_piecewise_graph_bytes(LLAMA_3_8B, 8192, 2) == 1_142_947_840
    assert both.overhead_bytes == decode_only.overhead_bytes + 1_142_947_840
    assert both.num_blocks < decode_only.num_blocks
    with pytest.raises(ValueError, match="cuda_graph_mode"):
        plan_capacity(LLAMA_3_8B, [CARD_24G], 0.9, cuda_graphs=True, cuda_graph_mode="piecewise")


# Qwen2.5-32B at TP=2, per card: head_dim 5120/40 = 128; q = 40·128 = 5120; 8 KV heads → 4 per card, so the
# k/v columns of all ranks together are 2 · 4·128 = 1024 (no replication).
# Per layer: qkv 5120·(5120 + 2·1024) = 36,700,160; o 5120·5120 = 26,214,400; MLP 3·5120·27648 = 424,673,280
#   → 487,587,840; × 64 layers = 31,205,621,760; / 2 ranks = 15,602,810,880 matrix params per card.
# QKV bias (Qwen2) 64·(5120 + 2048)/2 = 229,376; norms (2·64+1)·5120 = 660,480 (replicated);
# embedding + LM head: ceil(152064/2) = 76,032 rows · 5120 · 2 (untied) = 778,567,680.
# RoPE table 32768 · 128 · 4 B = 16,777,216.
# Activations at 8192 tokens: 8192 · (4·5120 + (40+16)·128/2 + 3·27648/2) · 2 B = 8192 · 65,536 · 2
#   = 1,073,741,824, plus the sampler 256 · 152064 · 36 B = 1,401,421,824 → 2,475,163,648.
# KV per token per card: 2 · 64 layers · 4 heads · 128 · 2 B = 131,072 B (fp16), 65,536 B (fp8).
QWEN_TP2_ACTIVATIONS = 2_475_163_648


@pytest.mark.parametrize("kv_cache_dtype,kv_per_token", [("auto", 131_072), ("fp8", 65_536)])
def test_qwen25_32b_fp16_does_not_fit_two_24gb_cards(kv_cache_dtype, kv_per_token):
    # Weights (15,602,810,880 + 229,376 + 660,480 + 778,567,680) · 2 B + 16,777,216 = 32,781,314,048 B
    # = 30.53 GiB per card, above the 21.60 GiB usable: no KV dtype saves it; the message must say so.
    plan = plan_capacity(QWEN25_32B, [CARD_24G, CARD_24G], 0.9, dtype="float16", kv_cache_dtype=kv_cache_dtype,
                         tensor_parallel_size=2)
    assert plan.weights_bytes == 32_781_314_048
    assert plan.activation_bytes == QWEN_TP2_ACTIVATIONS
    assert plan.kv_bytes_per_token == kv_per_token
    assert plan.kv_budget_bytes == 23_192_823_398 - 32_781_314_048 - QWEN_TP2_ACTIVATIONS
    assert not plan.fits and plan.num_blocks == 0
    message = plan.explain_misfit()
    assert "not even one 32,768-token sequence fits" in message
    assert "21.60 GiB usable per card (24.00 GiB × gpu_memory_utilization 0.90)" in message
    assert "weights 30.53 GiB" in message
    assert "activations 2.31 GiB" in message and f"{kv_per_token / 1024:.1f} KiB/token" in message
    assert "weights alone" in message and "--tensor-parallel-size" in message


@pytest.mark.parametrize("kv_cache_dtype,blocks,seqs", [("auto", 5291, 2), ("fp8", 10582, 5)])
def test_qwen25_32b_4bit_on_two_24gb_cards(kv_cache_dtype, blocks, seqs):
    # 4-bit matrices: 15,602,810,880 / 2 = 7,801,405,440 B + a 2-byte scale per 128 weights
    #   (15,602,810,880 / 128 = 121,896,960 scales = 243,793,920 B) = 8,045,199,360 B; bias, norms and the
    #   vocab-split embeddings stay 16-bit: (229,376 + 660,480 + 778,567,680) · 2 = 1,558,915,072 B; RoPE
    #   16,777,216 B. Weights 9,620,891,648 B per card. KV budget 23,192,823,398 − 9,620,891,648 − 2,475,163,648
    #   = 11,096,768,102 B. fp16 KV: // (131,072 · 16) = 5291 blocks = 84,656 tokens = 2 × 32,768 (and more);
    #   fp8 KV: // (65,536 · 16) = 10,582 blocks = 169,312 tokens = 5 × 32,768 (and more).
    plan = plan_capacity(QWEN25_32B, [CARD_24G, CARD_24G], 0.9, dtype="float16", kv_cache_dtype=kv_cache_dtype,
                         tensor_parallel_size=2, quantization="awq")
    assert plan.weights_bytes == 9_620_891_648
    assert plan.kv_budget_bytes == 11_096_768_102
    assert (plan.num_blocks, plan.num_tokens, plan.num_full_seqs) == (blocks, blocks * 16, seqs)


def test_qwen25_32b_4bit_on_one_card_needs_a_shorter_context():
    # TP=1: matrices 31,205,621,760 params → 15,602,810,880 B + 243,793,920 scales·2 B = 15,846,604,800 B;
    #   bias 64·7168 = 458,752, norms 660,480, embeddings 2·152064·5120 = 1,557,135,360 → ·2 B = 3,116,509,184 B;
    #   + RoPE 16,777,216 → weights 19,223,685,120 B (17.90 GiB).
    # Activations 8192 · (4·5120 + 56·128 + 3·27648) · 2 + 1,401,421,824 = 1,811,939,328 + 1,401,421,824
    #   = 3,213,361,152. KV budget 23,192,823,398 − 19,223,685,120 − 3,213,361,152 = 755,777,126;
    #   KV/token 2·64·8·128·2 = 262,144 B → // (262,144 · 16) = 180 blocks = 2,880 tokens: no 32,768-token
    #   sequence; a 2,880-token one fits once.
    plan = plan_capacity(QWEN25_32B, [CARD_24G], 0.9, dtype="float16", quantization="awq")
    assert plan.weights_bytes == 19_223_685_120
    assert plan.activation_bytes == 3_213_361_152
    assert (plan.num_blocks, plan.num_tokens) == (180, 2_880)
    assert not plan.fits
    assert "Lower --max-model-len to 2,880 or less" in plan.explain_misfit()
    assert plan_capacity(QWEN25_32B, [CARD_24G], 0.9, dtype="float16", quantization="awq",
                         max_model_len=2880).num_full_seqs == 1


# ---- measured plans: every rank profiles its own card, the pool takes the smallest -------------------------

def profile(card: str, free_gib: float, weights: int = 8 * GIB, activations: int = GIB, overhead: int = 0):
    return MemoryProfile(card, CARD_24G, int(free_gib * GIB), weights, activations, overhead)


def test_measured_plan_subtracts_what_other_programs_held():
    # 24 GiB · 0.9 = 21.6 GiB is the engine's share; the desktop held 1.5 GiB at start, which comes out of it:
    # usable int(24 GiB · 0.9) − 1.5 GiB = 23,192,823,398 − 1,610,612,736 = 21,582,210,662;
    # KV budget − 8 − 1 − 0.5 (NCCL) GiB = 21,582,210,662 − 10,200,547,328 = 11,381,663,334 → // 2 MiB = 5427 blocks.
    desktop = profile("cuda:0 (NVIDIA GeForce RTX 3090)", 22.5, overhead=GIB // 2)
    plan = plan_from_profile(desktop, 0.9, 131_072, 16, 32768, 2)
    assert plan.usable_bytes == 21_582_210_662 and plan.other_programs_bytes == 3 * GIB // 2
    assert plan.kv_budget_bytes == 11_381_663_334 and plan.num_blocks == 5427
    assert plan.kv_budget_bytes + 8 * GIB + GIB + GIB // 2 + 3 * GIB // 2 <= 0.9 * CARD_24G  # within the share
    assert other_programs_note(desktop, 0.9) == (
        "cuda:0 (NVIDIA GeForce RTX 3090): other programs (the desktop, other processes) held 1.50 GiB at start; "
        "it comes out of the engine's 21.60 GiB share (24.00 GiB × --gpu-memory-utilization 0.90), leaving "
        "20.10 GiB. Close them or raise --gpu-memory-utilization for a larger KV cache")
    assert other_programs_note(profile("cuda:1", 24.0), 0.9) is None


class FakeExecutor:
    """Stands in for the tensor-parallel executor on a CUDA machine: what each rank measured."""

    device = torch.device("cuda")

    def __init__(self, profiles):
        self.profiles = profiles

    def profile_memory(self, num_tokens, max_num_seqs, kv_dtype, num_speculative_tokens=0):
        return self.profiles


def test_mixed_cards_size_the_pool_by_the_card_with_less_room(caplog):
    cfg = QWEN25_32B.with_max_model_len(8192)
    config = EngineConfig(model="m", tensor_parallel_size=2, gpu_memory_utilization=0.9)
    # KV per token per card at TP=2 in fp16 = 131,072 B → 2 MiB per 16-token block.
    # 3090 with the desktop (4 GiB held): 21.6 − 4 − 8 − 1 = 8.6 GiB = 23,192,823,398 − 13 GiB = 9,234,179,686 B
    #   → 4403 blocks; the 4090 (0.4 GiB held): 21.6 − 0.4 − 9 = 12.2 GiB = 13,099,650,662 B → 6246 blocks.
    # Both ranks hold the same blocks: 4403.
    profiles = [profile("cuda:0 (NVIDIA GeForce RTX 4090)", 23.6), profile("cuda:1 (NVIDIA GeForce RTX 3090)", 20.0)]
    with caplog.at_level("INFO", logger="pagedesk.engine"):
        assert choose_num_blocks(config, cfg, FakeExecutor(profiles), torch.float16, 8192) == 4403
    assert "cuda:1 (NVIDIA GeForce RTX 3090): other programs (the desktop, other processes) held 4.00 GiB" \
        in caplog.text
    assert plan_from_profile(profiles[0], 0.9, 131_072, 16, 8192, 2).num_blocks == 6246


def test_start_fails_with_an_actionable_message_when_nothing_fits():
    cfg = QWEN25_32B.with_max_model_len(32768)
    config = EngineConfig(model="m", tensor_parallel_size=2, gpu_memory_utilization=0.9)
    # The 3090 whose desktop holds 1.5 GiB keeps 23,192,823,398 − (1.5 + 15 + 1) GiB = 4,402,341,478 B for KV
    # = 2099 blocks = 33,584 tokens: one 32,768-token sequence fits there...
    fits_once = [profile("cuda:0", 24.0, weights=15 * GIB), profile("cuda:1 (RTX 3090)", 22.5, weights=15 * GIB)]
    assert choose_num_blocks(config, cfg, FakeExecutor(fits_once), torch.float16, 8192) == 2099
    # ...and with 0.5 GiB more held by the desktop, 3,865,470,566 B = 1843 blocks = 29,488 tokens: not one.
    short = [profile("cuda:0", 24.0, weights=15 * GIB), profile("cuda:1 (RTX 3090)", 22.0, weights=15 * GIB)]
    with pytest.raises(ValueError) as err:
        choose_num_blocks(config, cfg, FakeExecutor(short), torch.float16, 8192)
    assert str(err.value) == (
        "not even one 32,768-token sequence fits on cuda:1 (RTX 3090): 19.60 GiB usable per card (24.00 GiB × "
        "gpu_memory_utilization 0.90 − 2.00 GiB other programs hold) − weights 15.00 GiB − activations "
        "1.00 GiB leaves 3.60 GiB for the KV cache; at 128.0 KiB/token that holds 29,488 tokens. Lower "
        "--max-model-len to 29,488 or less, raise --gpu-memory-utilization, use --kv-cache-dtype fp8, or raise "
        "--tensor-parallel-size")


def test_a_hybrid_models_graphs_count_their_padding_state_slot():
    # Qwen3.6-27B's decode graphs point padding rows at one state slot past the pool: 48 DeltaNet layers ×
    # (conv 10,240 channels × 3 taps × 2 B + recurrent 48 × 128 × 128 × 4 B) = 48 × 3,207,168 = 153,944,064 B.
    from engine.bench.hybrid import QWEN3_6_27B
    from engine.planning.graphs import estimate_cuda_graph_bytes, estimate_graph_bytes
    cfg = ModelConfig.from_hf_config(QWEN3_6_27B)
    graphs = estimate_cuda_graph_bytes(cfg, 4, 8192, 2, 1, "full_decode_only")
    assert graphs - estimate_graph_bytes(cfg, 4, 2, 1) == 153_944_064
    assert estimate_cuda_graph_bytes(cfg, 4, 8192, 2, 2, "full_decode_only") - estimate_graph_bytes(cfg, 4, 2, 2) \
        == 153_944_064 // 2  # TP=2: each rank's heads and channels


LLAMA_32_1B = ModelConfig.from_hf_config({  # Llama-3.2-1B: Llama 3's tokenizer, a draft for the 8B
    "architectures": ["LlamaForCausalLM"], "hidden_size": 2048, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 8192, "vocab_size": 128256,
    "max_position_embeddings": 131072, "rope_theta": 500000.0, "tie_word_embeddings": True,
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192}, "torch_dtype": "bfloat16"})


def test_a_draft_model_counts_its_weights_on_rank_0_and_its_kv_per_block():
    from engine.planning.speculation import draft_footprint
    from engine.planning.weights import weights_bytes_per_card
    from engine.planning.planner import plan_cpu

    draft = LLAMA_32_1B.with_max_model_len(8192)
    # Draft weights: per layer qkv 2048·(2048 + 2·512) + o 2048·2048 = 10,485,760, MLP 3·2048·8192 = 50,331,648
    #   → 60,817,408 × 16 = 973,078,528; tied embedding 128256·2048 = 262,668,288; norms 33·2048 = 67,584
    #   → 1,235,814,400 params × 2 B = 2,471,628,800, + RoPE 131072 positions · 64 · 4 B = 33,554,432
    #   → 2,505,183,232 B. Its KV per block: 16 tokens · 2 · 16 layers · 8 heads · 64 · 2 B = 524,288 (32 KiB/token).
    assert draft_footprint(draft, 2, 2, 16) == (2_505_183_232, 524_288)
    # One 24 GiB card: the 8B's budget 4,872,357,478 (test above) − the draft's weights = 2,367,174,246 → 1128
    #   blocks of the target's 2 MiB, shared with the draft's 0.5 MiB: 1128 · 4 // 5 = 902 blocks = 14,432 tokens.
    alone = plan_capacity(LLAMA_3_8B, [CARD_24G], 0.9)
    plan = plan_capacity(LLAMA_3_8B, [CARD_24G], 0.9, draft=draft)
    assert plan.weights_bytes == alone.weights_bytes + 2_505_183_232
    assert plan.kv_budget_bytes == 2_367_174_246
    assert (plan.num_blocks, plan.num_tokens, plan.num_full_seqs) == (902, 14_432, 1)
    assert "draft model 2.33 GiB + KV 32.0 KiB/token" in plan.summary()
    # TP=2: the target's KV is 1 MiB per block per card; the draft sits whole on cuda:0, which decides:
    #   its blocks (budget − draft weights) // 1 MiB, shared 2 : 1 with the draft's 0.5 MiB.
    tp = plan_capacity(LLAMA_3_8B, [CARD_24G] * 2, 0.9, tensor_parallel_size=2, draft=draft)
    tp_alone = plan_capacity(LLAMA_3_8B, [CARD_24G] * 2, 0.9, tensor_parallel_size=2)
    assert tp.card == "cuda:0" and tp.draft_weights_bytes == 2_505_183_232
    assert tp.num_blocks == (tp_alone.kv_budget_bytes - 2_505_183_232) // 2**20 * 2 // 3 == 6866
    # CPU, 4 GiB: 2048 target blocks, capped at 2 full sequences (1024 blocks), shared 4 : 1 → 819.
    cpu = plan_cpu(LLAMA_3_8B, 4, dtype="bfloat16", max_num_seqs=2, draft=draft)
    assert cpu.num_blocks == 819 and cpu.weights_bytes == weights_bytes_per_card(LLAMA_3_8B, 2) + 2_505_183_232


def test_speculation_counts_its_verify_graphs():
    # k = 3: verify graphs up to 64 rows of 4 tokens: activations of 256 tokens 256 · 65,536 · 2 B = 33,554,432,
    #   plus 2 MiB for each of 8 batch sizes (1, 2, 4, 8, 16, 32, 48, 64) × 5 context lengths = 83,886,080.
    plain = plan_capacity(LLAMA_3_8B, [CARD_24G], 0.9, cuda_graphs=True)
    spec = plan_capacity(LLAMA_3_8B, [CARD_24G], 0.9, cuda_graphs=True, num_speculative_tokens=3)
    assert spec.overhead_bytes - plain.overhead_bytes == 33_554_432 + 83_886_080


def test_a_misfit_with_a_draft_names_it():
    draft = LLAMA_32_1B.with_max_model_len(8192)
    plan = plan_capacity(LLAMA_3_8B, [21 * GIB], 0.9, draft=draft)  # one sequence fits alone, not with the draft
    assert plan_capacity(LLAMA_3_8B, [21 * GIB], 0.9).fits and not plan.fits
    assert "The draft model takes 2.33 GiB of weights and 32.0 KiB/token of KV" in plan.explain_misfit()


def test_logits_rows_of_a_step_count_the_verify_rows():
    """A step has a logits row per sampling sequence and 1 + k per sequence verifying k drafts, never more rows
    than tokens; the sampler is profiled and planned at no fewer rows than seats (their penalty buffers)."""
    from engine.planning.activations import max_logits_rows, sampler_rows
    assert max_logits_rows(256, 8192) == 256 and max_logits_rows(256, 8192, 3) == 1024
    assert max_logits_rows(256, 512, 3) == 512 and max_logits_rows(256, 128) == 128
    assert sampler_rows(256, 128) == sampler_rows(256, 8192) == 256  # k = 0: max_num_seqs, as the profile ran
    assert sampler_rows(4, 8192, 3) == 16 and sampler_rows(0, 8192) == 0  # 0: a graph's forward samples nothing


def test_the_cpu_engine_plans_a_hybrid_in_the_dtype_it_runs():
    """A hybrid model's conv states are in the model's dtype: the CPU engine run in bf16 plans its state pool at
    2 bytes per conv value, as the planner does for bf16 (it planned float32 whatever the engine ran in)."""
    from engine.bench.hybrid import QWEN3_6_27B
    from engine.planning.planner import plan_cpu
    cfg = ModelConfig.from_hf_config(QWEN3_6_27B).with_max_model_len(4096)
    runner = type("CpuRunner", (), {"device": torch.device("cpu"), "dtype": torch.bfloat16,
                                    "weights_bytes": lambda self: 0})()
    config = EngineConfig(model="m", kv_cache_memory=2.0, max_num_seqs=4)
    kwargs = dict(kv_cache_dtype="bfloat16", max_num_seqs=4, max_num_batched_tokens=2048)
    bf16, fp32 = (plan_cpu(cfg, 2.0, dtype=dtype, **kwargs) for dtype in ("bfloat16", "float32"))
    assert choose_num_blocks(config, cfg, runner, torch.bfloat16, 2048) == bf16.num_blocks > fp32.num_blocks
    assert bf16.state_bytes < fp32.state_bytes and bf16.num_blocks < bf16.max_blocks  # the budget decides
