"""Gemma 2 (Gemma2ForCausalLM) against HF transformers on the same tiny checkpoint: greedy token ids identical
plain, with chunked prefill whose chunk boundaries fall inside the 20-token window, under prefix caching and
forced preemption, and with tensor parallel 2; logprobs carry the final-logit soft cap.

The tiny config (tests/tiny_models.py) alternates sliding-window and global layers and has weights large
enough that the attention scores (up to ~13) are bent by the cap of 2: a guard test checks that HF's own
output changes without the caps, so passing means the engine applies them.
"""
from __future__ import annotations

import logging

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config.model import ModelConfig
from hf_reference import MAX_TOKENS, engine_greedy, hf_greedy
from tiny_models import hf_model


def test_config_reads_gemma2_switches(tiny_model_dir):
    cfg = ModelConfig.from_folder(tiny_model_dir("gemma2"))
    assert cfg.layer_types == ["sliding_attention", "full_attention"] and cfg.sliding_windows == [20, None]
    assert cfg.tie_word_embeddings and cfg.hidden_act == "gelu_pytorch_tanh"
    text = cfg.hf_text_config
    assert (text["query_pre_attn_scalar"], text["attn_logit_softcapping"], text["final_logit_softcapping"]) == \
        (24, 2.0, 5.0)


def test_published_config_without_layer_types_alternates_from_the_first_layer():
    """google/gemma-2-* config.json files predate `layer_types`: HF makes even layers sliding."""
    hf = dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", hidden_size=3584, num_hidden_layers=4,
              num_attention_heads=16, num_key_value_heads=8, intermediate_size=14336, vocab_size=256000,
              sliding_window=4096)
    cfg = ModelConfig.from_hf_config(hf)
    assert cfg.sliding_windows == [4096, None, 4096, None] and cfg.head_dim == 256
    assert cfg.hf_text_config["query_pre_attn_scalar"] == 256


def test_the_soft_caps_change_hf_output(tiny_model_dir):
    """Guard: without this, a model ignoring the caps could still match HF."""
    model = hf_model(tiny_model_dir("gemma2"))
    ids = torch.randint(5, 300, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        capped = model(ids).logits
        for layer in model.model.layers:
            layer.self_attn.attn_logit_softcapping = None
        uncapped = model(ids).logits
    assert float((capped - uncapped).abs().max()) > 0.1


def test_greedy_matches_hf(reference):
    path, prompts, expected = reference("gemma2")
    assert engine_greedy(path, prompts, MAX_TOKENS) == expected


def test_greedy_matches_hf_with_chunked_prefill_inside_the_window(reference):
    """A 7-token budget: prefill chunks end at positions that are not block or window multiples."""
    path, prompts, expected = reference("gemma2")
    assert engine_greedy(path, prompts, MAX_TOKENS, max_num_batched_tokens=7, max_num_seqs=3) == expected


def test_greedy_matches_hf_under_prefix_caching_and_preemption(tiny_model_dir):
    path = tiny_model_dir("gemma2")
    shared = [(i * 7) % 300 + 5 for i in range(45)]  # longer than the window: hits cover windowed blocks
    prompts = [shared + [(i * 13 + j) % 300 + 5 for j in range(3 + 5 * i)] for i in range(5)]
    max_tokens = [30] * len(prompts)
    expected = hf_greedy(path, prompts, max_tokens)
    # A block id is one page of each KV cache group (here one layer each), so the longest sequence (98 tokens)
    # needs 13 full + 4 window blocks at its last step: 20 ids hold it and still force preemptions.
    llm = LLM(str(path), device="cpu", num_gpu_blocks_override=20, block_size=8, max_num_seqs=5,
              max_num_batched_tokens=24)
    params = [SamplingParams(temperature=0, max_tokens=n) for n in max_tokens]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.kv.prefix_hits > 0
    assert got == expected


def test_a_sequence_the_pool_cannot_hold_stops_as_length_and_says_why(tiny_model_dir, caplog):
    path = tiny_model_dir("gemma2")
    prompt = [(i * 7) % 300 + 5 for i in range(68)]
    expected = hf_greedy(path, [prompt], [30])[0]
    llm = LLM(str(path), device="cpu", num_gpu_blocks_override=16, block_size=8, max_num_batched_tokens=24)
    with caplog.at_level(logging.WARNING, logger="pagedesk.engine"):
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0].outputs[0]
    # The 30th token's step needs 13 full + 4 window blocks of a 16-block pool: 29 tokens, HF's first 29.
    assert out.finish_reason == "length" and out.token_ids == expected[:29]
    assert "stops at 97 tokens with finish_reason 'length': 97 tokens need 17 KV blocks of 8 tokens " \
           "(13 full + 4 window-20), more than the pool's 16" in caplog.text


def test_greedy_matches_hf_with_tensor_parallel_2(reference):
    path, prompts, expected = reference("gemma2")
    assert engine_greedy(path, prompts[:4], MAX_TOKENS[:4], tensor_parallel_size=2, max_model_len=512) == \
        expected[:4]


def test_logprobs_are_of_the_soft_capped_logits(tiny_model_dir):
    path = tiny_model_dir("gemma2")
    prompt = [(i * 11) % 300 + 5 for i in range(30)]
    with torch.no_grad():
        logits = hf_model(path)(torch.tensor([prompt])).logits[0, -1]  # HF applies final_logit_softcapping
    assert float(logits.abs().max()) <= 5.0
    expected = torch.log_softmax(logits.double(), -1)
    llm = LLM(str(path), device="cpu")
    step = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=5),
                        use_tqdm=False)[0].outputs[0].logprobs[0]
    for token, logprob in step.items():
        assert logprob.logprob == pytest.approx(float(expected[token]), abs=1e-4)
