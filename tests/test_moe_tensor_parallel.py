"""Tensor parallel 2 (two gloo processes) for the MoE checkpoints tests/test_moe_families.py does not split:
Mixtral (`block_sparse_moe` names, per-expert w1/w3/w2) and gpt-oss with its published MXFP4 experts, where each
rank holds whole 32-value blocks of its half of every expert's intermediate dim. Greedy token ids identical to
HF transformers (on the dequantized model for MXFP4); rank 0 alone counts the expert load, once per token.
"""
from __future__ import annotations

import pytest
import torch.distributed as dist

from engine import LLM, SamplingParams
from hf_reference import hf_greedy, make_prompts
from quant_packers import make_mxfp4_gpt_oss
from test_moe_mxfp4 import hf_dequantized_greedy

pytestmark = pytest.mark.timeout(300)
PICKS, MAX_TOKENS = [1, 4], [6, 5]  # 3 and 17 tokens: inside a block, and past a block and gpt-oss's 8-token window
TOP_K = 2  # tests/tiny_models.py MOE_ARCHS


def greedy_tp2(path, prompts) -> tuple[list[list[int]], dict, int]:
    """(token ids, cumulative expert load, tokens the model was fed) from a tensor_parallel_size=2 engine."""
    llm = LLM(str(path), device="cpu", tensor_parallel_size=2)
    try:
        params = [SamplingParams(temperature=0, max_tokens=n) for n in MAX_TOKENS]
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.engine.get_stats()
    finally:
        llm.engine.shutdown()
    assert not dist.is_initialized()
    return got, stats.expert_load, stats.prompt_tokens_total + stats.generation_tokens_total - len(prompts)


def test_mixtral_tensor_parallel_2_matches_hf(tiny_model_dir):
    path = tiny_model_dir("mixtral")
    prompts = [make_prompts(400)[i] for i in PICKS]
    got, load, num_fed = greedy_tp2(path, prompts)
    assert got == hf_greedy(path, prompts, MAX_TOKENS)
    assert [sum(row) for row in load["tokens"]] == [num_fed * TOP_K] * len(load["layers"])  # counted once


def test_mxfp4_gpt_oss_tensor_parallel_2_matches_hf_dequantized(tiny_model_dir, tmp_path):
    # intermediate 64: 32 per rank, one MXFP4 block of each down projection's inputs (16 would be refused)
    packed = make_mxfp4_gpt_oss(tiny_model_dir("gpt_oss", intermediate_size=64), tmp_path / "mxfp4")
    prompts = [make_prompts(400)[i] for i in PICKS]
    got, load, num_fed = greedy_tp2(packed, prompts)
    assert got == hf_dequantized_greedy(packed, prompts, MAX_TOKENS)
    assert [sum(row) for row in load["tokens"]] == [num_fed * TOP_K] * len(load["layers"])
