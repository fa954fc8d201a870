"""Seeded sampling and beam search with CUDA logits: same seed, same tokens whatever else is in the batch;
beam search on the GPU finds the beams the CPU engine finds."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from hf_reference import make_prompts

pytestmark = pytest.mark.gpu


def test_seeded_sampling_is_reproducible_in_any_batch(tiny_model_dir, make_llm):
    llm = make_llm(tiny_model_dir("llama"), dtype="bfloat16", num_gpu_blocks_override=256)
    prompts = make_prompts(400)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=24, seed=1234, ignore_eos=True)
    alone = llm.generate([prompts[2]], [seeded], use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True) for _ in prompts]
    batch = llm.generate(prompts[:2] + [prompts[2]] + prompts[3:], others[:2] + [seeded] + others[3:],
                         use_tqdm=False)
    assert batch[2].outputs[0].token_ids == alone and len(alone) == 24
    other_seed = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=24, seed=99, ignore_eos=True)
    assert llm.generate([prompts[2]], [other_seed], use_tqdm=False)[0].outputs[0].token_ids != alone


def test_beam_search_on_gpu_matches_cpu(tiny_model_dir, make_llm):
    path = tiny_model_dir("qwen2")
    prompts = make_prompts(400)[1:4]
    gpu = make_llm(path, dtype="float32", num_gpu_blocks_override=256).beam_search(prompts, beam_width=4,
                                                                                   max_tokens=12)
    cpu = LLM(str(path), device="cpu").beam_search(prompts, beam_width=4, max_tokens=12)
    assert [[b.tokens for b in o.sequences] for o in gpu] == [[b.tokens for b in o.sequences] for o in cpu]
