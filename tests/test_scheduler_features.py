"""Chunked prefill, prefix caching, preemption, parallel sampling and beam search: each leaves greedy output
identical to HF, and every block comes back when the work is done."""
from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from engine import LLM, BeamSearchParams, SamplingParams
from hf_reference import MAX_TOKENS, engine_greedy, hf_greedy
from tiny_models import hf_model


def assert_pool_empty(llm: LLM) -> None:
    pool = llm.engine.kv.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_count == 0 for b in pool.blocks)
    assert not llm.engine.scheduler.running and not llm.engine.scheduler.waiting


@pytest.mark.parametrize("budget", [8, 32, 256])
def test_chunked_prefill_budgets_match_hf(reference, budget):
    path, prompts, expected = reference("qwen2")
    assert engine_greedy(path, prompts, MAX_TOKENS, max_num_batched_tokens=budget) == expected


def test_without_chunked_prefill_prompts_run_whole(reference):
    path, prompts, expected = reference("qwen2")
    llm = LLM(str(path), device="cpu", enable_chunked_prefill=False, max_num_batched_tokens=512, max_model_len=512)
    params = [SamplingParams(temperature=0, max_tokens=n) for n in MAX_TOKENS]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    with pytest.raises(ValueError, match="chunked prefill off"):
        LLM(str(path), device="cpu", enable_chunked_prefill=False, max_num_batched_tokens=64)


def test_decodes_continue_while_a_long_prompt_is_chunked(reference):
    path, prompts, _ = reference("llama")
    llm = LLM(str(path), device="cpu", max_num_batched_tokens=32)
    engine = llm.engine
    engine.add_request("short", prompts[2], SamplingParams(temperature=0, max_tokens=20))
    engine.step()  # prefill the short prompt
    engine.add_request("long", [7] * 300, SamplingParams(temperature=0, max_tokens=1))
    decoded_during_long_prefill = 0
    while engine.requests.get("long") and engine.requests["long"].seqs[0].num_computed_tokens < 300:
        outs = {o.request_id: o for o in engine.step()}
        decoded_during_long_prefill += "short" in outs
    assert decoded_during_long_prefill >= 8  # the 300-token prompt took ~10 steps, the short one never stalled


def prefix_prompts(block_size: int = 16) -> list[list[int]]:
    rng = random.Random(1)
    system = [rng.randrange(5, 400) for _ in range(40)]
    exact = [rng.randrange(5, 400) for _ in range(2 * block_size)]
    return [system + [rng.randrange(5, 400) for _ in range(n)] for n in (3, 17, 30)] + [
        exact, exact + [9], [rng.randrange(5, 400) for _ in range(25)], system + [11, 12, 13]]


def test_prefix_caching_matches_hf_and_hits(tiny_model_dir):
    path = tiny_model_dir("qwen3")
    prompts = prefix_prompts()
    max_tokens = [12] * len(prompts)
    expected = hf_greedy(path, prompts, max_tokens)
    llm = LLM(str(path), device="cpu")
    params = [SamplingParams(temperature=0, max_tokens=12)] * len(prompts)
    for prompt, want in zip(prompts, expected):  # one at a time so earlier prompts are cached for later ones
        assert llm.generate([prompt], params[:1], use_tqdm=False)[0].outputs[0].token_ids == want
    hits_before = llm.engine.kv.prefix_hits
    assert hits_before >= 32 + 32  # the system prompt (2 full blocks) and the exact-multiple prompt
    again = llm.generate([prompts[0]], params[:1], use_tqdm=False)[0]  # fully cached prompt
    assert again.outputs[0].token_ids == expected[0]
    assert again.num_cached_tokens == 32  # all full blocks; the last token is always recomputed
    all_at_once = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert all_at_once == expected
    off = LLM(str(path), device="cpu", enable_prefix_caching=False)
    assert [o.outputs[0].token_ids for o in off.generate(prompts, params, use_tqdm=False)] == expected
    assert off.engine.kv.prefix_hits == 0
    assert_pool_empty(llm)


def test_preemption_with_tiny_pool_matches_hf(reference):
    path, prompts, expected = reference("llama")
    llm = LLM(str(path), device="cpu", num_gpu_blocks_override=22, max_num_seqs=8)
    params = [SamplingParams(temperature=0, max_tokens=n) for n in MAX_TOKENS]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert_pool_empty(llm)


def test_request_that_can_never_fit_ends_clearly(llama_dir):
    llm = LLM(str(llama_dir), device="cpu", num_gpu_blocks_override=4, max_model_len=512)
    with pytest.raises(ValueError, match="KV cache holds 64"):
        llm.generate([[5] * 100], SamplingParams(max_tokens=4), use_tqdm=False)
    out = llm.generate([[5] * 60], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 5
    # 64 slots hold the prompt and 4 outputs; the 5th output was sampled but needs no slot of its own
    assert_pool_empty(llm)


def test_parallel_sampling_shares_prompt_blocks(llama_dir):
    llm = LLM(str(llama_dir), device="cpu")
    engine = llm.engine
    engine.add_request("n4", [5] * 40, SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=3))
    engine.step()  # prompt computed once, four sequences forked off it
    seqs = engine.requests["n4"].seqs
    assert len(seqs) == 4
    assert len({b.block_id for b in seqs[0].block_table[:2]} | {b.block_id for s in seqs for b in s.block_table[:2]}) == 2
    used_shared = engine.kv.pool.num_blocks - engine.kv.pool.num_free_blocks
    assert used_shared == 3  # 40 tokens = 2 full blocks + 1 partial, all shared by the 4 sequences
    engine.step()  # each writes its 2nd token into the shared partial block: copy on write for 3 of them
    assert engine.kv.pool.num_blocks - engine.kv.pool.num_free_blocks == 3 + 3
    while engine.has_unfinished_requests():
        engine.step()
    assert_pool_empty(llm)


@pytest.fixture(scope="module")
def eos_model(tiny_model_dir, tmp_path_factory):
    """A copy of the Llama model whose EOS is a token it likes, so beams really finish early."""
    path = tmp_path_factory.mktemp("eos") / "tiny-llama-eos"
    shutil.copytree(tiny_model_dir("llama"), path)
    gen = json.loads((path / "generation_config.json").read_text())
    gen["eos_token_id"] = [1, 300, 220]
    (path / "generation_config.json").write_text(json.dumps(gen))
    return path


@pytest.mark.parametrize("beam_width", [2, 4])
def test_beam_search_matches_hf(tiny_model_dir, eos_model, beam_width):
    for path in (tiny_model_dir("llama"), eos_model):
        hf = hf_model(path)
        llm = LLM(str(path), device="cpu")
        for prompt in ([5, 6, 7, 8, 9], list(range(20, 60)), [100]):
            want = hf.generate(torch.tensor([prompt]), num_beams=beam_width, do_sample=False, length_penalty=1.0,
                               early_stopping=True, max_new_tokens=12,
                               attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):].tolist()
            pad = hf.generation_config.pad_token_id
            while want and want[-1] == pad:
                want.pop()
            got = llm.beam_search([prompt], BeamSearchParams(beam_width, 12), use_tqdm=False)[0].sequences[0]
            assert got.tokens[len(prompt):] == want
        assert_pool_empty(llm)


def test_mixed_workload_with_every_feature_leaks_nothing(llama_dir):
    llm = LLM(str(llama_dir), device="cpu", num_gpu_blocks_override=30, max_num_batched_tokens=24, max_num_seqs=6)
    rng = random.Random(5)
    shared = [rng.randrange(5, 400) for _ in range(33)]
    prompts = [shared + [rng.randrange(5, 400) for _ in range(rng.randrange(1, 40))] for _ in range(10)]
    params = [SamplingParams(n=rng.choice([1, 2, 3]), temperature=rng.choice([0, 0.8]), seed=i,
                             max_tokens=rng.randrange(4, 30), stop=["zz"] if i % 3 == 0 else None)
              for i in range(10)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.finished and len(o.outputs) == p.n for o, p in zip(outs, params))
    llm.beam_search(prompts[:2], BeamSearchParams(3, 6), use_tqdm=False)
    assert_pool_empty(llm)
