"""Mixture-of-experts families end to end: greedy token ids identical to HF transformers on tiny random models.

Qwen3-MoE (qk-norm, renormalised top-2 of 8), Mixtral (`block_sparse_moe` names) and GLM-4.5-style
(sigmoid routing with a correction bias and two groups, a shared expert, a dense first layer, partial rotary,
QKV bias) and gpt-oss (sinks, alternating 8-token window, YaRN, biased router and experts, clamped SwiGLU,
stacked interleaved expert tensors), each served plainly, a second time from the prefix cache, with prefill chunked into 16-token
pieces, and with a tiny pool that forces preemption; tensor parallel 2 splits every expert's intermediate dim.
Four prompts (3, 16, 17 and 120 tokens: inside a block, at and past a boundary, several blocks) keep it quick.
"""
from __future__ import annotations

import functools

import pytest
import torch.distributed as dist

from engine import LLM, SamplingParams
from hf_reference import hf_greedy, make_prompts
from tiny_models import MOE_ARCHS

pytestmark = pytest.mark.timeout(300)
PICKS, MAX_TOKENS = [1, 3, 4, 6], [10, 12, 6, 8]


@pytest.fixture(scope="module")
def moe_reference(tiny_model_dir):
    @functools.cache
    def get(arch):
        path = tiny_model_dir(arch)
        prompts = [make_prompts(400)[i] for i in PICKS]
        return path, prompts, hf_greedy(path, prompts, MAX_TOKENS)
    return get


def greedy(llm: LLM, prompts):
    params = [SamplingParams(temperature=0, max_tokens=n) for n in MAX_TOKENS]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("arch", list(MOE_ARCHS))
def test_moe_family_matches_hf_in_every_mode(moe_reference, arch):
    path, prompts, expected = moe_reference(arch)
    llm = LLM(str(path), device="cpu")
    assert greedy(llm, prompts) == expected
    assert greedy(llm, prompts) == expected  # again, from the prefix cache
    assert llm.engine.kv.prefix_hits > 0
    chunked = LLM(str(path), device="cpu", max_num_batched_tokens=16, enable_prefix_caching=False)
    assert greedy(chunked, prompts) == expected
    # chunks of 32 let gpt-oss's window group free behind its window: a block id is a page of every group
    tiny_pool = LLM(str(path), device="cpu", num_gpu_blocks_override=12, max_num_seqs=4, max_num_batched_tokens=32)
    assert greedy(tiny_pool, prompts) == expected
    assert tiny_pool.engine.scheduler.num_preemptions > 0


def test_moe_model_holds_what_the_planner_counts(tiny_model_dir):
    from engine.config.model import ModelConfig
    for arch in ("qwen3_moe", "glm4_moe"):
        cfg = ModelConfig.from_folder(tiny_model_dir(arch))
        llm = LLM(str(tiny_model_dir(arch)), device="cpu")
        held = sum(p.numel() for p in llm.engine.runner.model.parameters())
        assert held == cfg.num_params, arch  # every expert is in memory, and the arithmetic counts exactly that
        assert cfg.num_active_params < cfg.num_params


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "glm4_moe", "gpt_oss"])
def test_moe_tensor_parallel_2_matches_hf(moe_reference, arch):
    """Each rank holds half of every expert's (and the shared expert's) intermediate dim; one all-reduce per
    MoE block sums the halves."""
    path, prompts, expected = moe_reference(arch)
    llm = LLM(str(path), device="cpu", tensor_parallel_size=2)
    try:
        assert greedy(llm, prompts) == expected
    finally:
        llm.engine.shutdown()
    assert not dist.is_initialized()


def test_model_info_shows_total_and_active_parameters(tiny_model_dir):
    """The GUI's model info line: "… · 203.78K total, 105.47K active parameters · …" for a tiny MoE."""
    from app.model_info import format_count, read_model_info
    from engine.config.model import ModelConfig
    path = tiny_model_dir("qwen3_moe")
    info = read_model_info(path)
    cfg = ModelConfig.from_folder(path)
    assert info.num_parameters == cfg.num_params
    assert f"{format_count(cfg.num_params)} total, {format_count(cfg.num_active_params)} active parameters" \
        in info.describe()
    assert read_model_info(tiny_model_dir("llama")).active_parameters is None
