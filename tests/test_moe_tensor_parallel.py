"""gpt-oss with its published MXFP4 experts under tensor parallel 2 (two gloo processes): each rank holds whole
32-value blocks of its half of every expert's intermediate dim. Greedy token ids identical to HF transformers
running the dequantized model, and rank 0 alone counts the expert load, once per token. (The float MoE
families, Mixtral included, are split in tests/test_moe_families.py.)
"""
from __future__ import annotations

import pytest
import torch.distributed as dist

from engine import LLM, SamplingParams
from hf_reference import make_prompts
from quant_packers import make_mxfp4_gpt_oss
from test_moe_mxfp4 import hf_dequantized_greedy

pytestmark = pytest.mark.timeout(300)
PICKS, MAX_TOKENS = [1, 4], [6, 5]  # 3 and 17 tokens: inside a block, and past a block and the 8-token window
TOP_K = 2  # tests/tiny_models.py MOE_ARCHS["gpt_oss"]


def test_mxfp4_gpt_oss_tensor_parallel_2_matches_hf_dequantized(tiny_model_dir, tmp_path):
    # intermediate 64: 32 per rank, one MXFP4 block of each down projection's inputs (16 would be refused)
    packed = make_mxfp4_gpt_oss(tiny_model_dir("gpt_oss", intermediate_size=64), tmp_path / "mxfp4")
    prompts = [make_prompts(400)[i] for i in PICKS]
    llm = LLM(str(packed), device="cpu", tensor_parallel_size=2)
    try:
        params = [SamplingParams(temperature=0, max_tokens=n) for n in MAX_TOKENS]
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.engine.get_stats()
    finally:
        llm.engine.shutdown()
    assert not dist.is_initialized()
    assert got == hf_dequantized_greedy(packed, prompts, MAX_TOKENS)
    num_fed = stats.prompt_tokens_total + stats.generation_tokens_total - len(prompts)
    load = stats.expert_load
    assert [sum(row) for row in load["tokens"]] == [num_fed * TOP_K] * len(load["layers"])  # counted once
