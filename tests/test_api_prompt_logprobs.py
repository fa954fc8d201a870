"""Prompt logprobs equal HF transformers' on the same weights (1e-4) with chunked prefill, after a prefix-cache
fill (such a request takes no cached blocks) and through the API: echo + logprobs (first null), max_tokens 0
scoring, vLLM's prompt_logprobs."""
from __future__ import annotations

import math

import httpx
import pytest
import torch

from engine.sample import prompt_logprobs
from engine.entrypoints.llm import LLM
from engine.sample.sampling_params import SamplingParams
from server_harness import MODEL_NAME, start_server
from tiny_models import hf_model

PROMPTS = ["The quick brown fox jumps over the lazy dog. PagedAttention splits the KV cache into blocks.",
           "Qwen, Llama and Mistral are model families. numbers 0 1 2 3"]


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """Per prompt: token ids and HF's log-softmax rows (row i scores token i + 1)."""
    path = tiny_model_dir("qwen2")
    model, out = hf_model(path), {}
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(path)
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        with torch.no_grad():
            out[prompt] = (ids, torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1))
    return path, out


def _check(entries, ids, rows, k):
    assert entries[0] is None and len(entries) == len(ids)
    for i in range(1, len(ids)):
        entry, row = entries[i], rows[i - 1]
        assert math.isclose(entry[ids[i]].logprob, row[ids[i]].item(), abs_tol=1e-4)
        assert entry[ids[i]].rank == int((row > row[ids[i]]).sum()) + 1
        top = row.topk(k).indices.tolist()
        assert [t for t, lp in sorted(entry.items(), key=lambda e: e[1].rank) if lp.rank <= k] == top


def test_engine_prompt_logprobs_match_hf_with_chunks_and_cache(reference, monkeypatch):
    path, ref = reference
    monkeypatch.setattr(prompt_logprobs, "ROWS_PER_SLICE", 5)  # several slices per 16-token chunk
    llm = LLM(str(path), device="cpu", max_model_len=256, num_gpu_blocks_override=64, seed=0,
              max_num_batched_tokens=16)  # prompts of ~20-40 tokens prefill in several chunks
    llm.generate(PROMPTS, SamplingParams(max_tokens=1), use_tqdm=False)  # fills the prefix cache
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=2, prompt_logprobs=3), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids, rows = ref[prompt]
        assert out.prompt_token_ids == ids and out.num_cached_tokens == 0
        _check(out.prompt_logprobs, ids, rows, 3)


@pytest.fixture(scope="module")
def server(reference):
    srv = start_server(reference[0], max_num_batched_tokens=16)
    yield srv
    srv.stop()


def test_echo_logprobs_and_scoring(server, reference):
    _, ref = reference
    body = {"model": MODEL_NAME, "prompt": PROMPTS, "echo": True, "logprobs": 1, "max_tokens": 0}
    r = httpx.post(server.base_url + "/completions", json=body, timeout=60).json()
    assert r["usage"]["completion_tokens"] == 0
    for prompt, choice in zip(PROMPTS, r["choices"]):
        ids, rows = ref[prompt]
        lp = choice["logprobs"]
        assert choice["text"] == prompt and choice["finish_reason"] == "length"
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert len(lp["token_logprobs"]) == len(ids)
        for i in range(1, len(ids)):
            assert math.isclose(lp["token_logprobs"][i], rows[i - 1][ids[i]].item(), abs_tol=1e-4)
    # echo + logprobs with generation: the prompt's entries, then the generated tokens'
    body.update(prompt=PROMPTS[0], max_tokens=3, temperature=0, ignore_eos=True)
    choice = httpx.post(server.base_url + "/completions", json=body, timeout=60).json()["choices"][0]
    ids = ref[PROMPTS[0]][0]
    assert len(choice["logprobs"]["tokens"]) == len(ids) + 3 and choice["text"].startswith(PROMPTS[0])
    assert choice["logprobs"]["text_offset"][len(ids)] == len(PROMPTS[0])


def test_vllm_prompt_logprobs_field(server, reference):
    _, ref = reference
    body = {"model": MODEL_NAME, "prompt": PROMPTS[1], "max_tokens": 1, "prompt_logprobs": 2}
    choice = httpx.post(server.base_url + "/completions", json=body, timeout=60).json()["choices"][0]
    ids, rows = ref[PROMPTS[1]]
    entries = choice["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    for i in range(1, len(ids)):
        assert math.isclose(entries[i][str(ids[i])]["logprob"], rows[i - 1][ids[i]].item(), abs_tol=1e-4)


def test_chat_prompt_logprobs(server):
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "prompt_logprobs": 0}
    r = httpx.post(server.base_url + "/chat/completions", json=body, timeout=60).json()
    entries = r["prompt_logprobs"]
    assert entries[0] is None and len(entries) == r["usage"]["prompt_tokens"]
    assert all(len(e) == 1 and next(iter(e.values()))["logprob"] <= 0 for e in entries[1:])
    r = httpx.post(server.base_url + "/chat/completions", json={**body, "stream": True}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_openai_sdk_echo_logprobs(server, reference):
    import openai
    _, ref = reference
    client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], echo=True, logprobs=2, max_tokens=0)
    lp = r.choices[0].logprobs
    ids, rows = ref[PROMPTS[1]]
    assert r.choices[0].text == PROMPTS[1] and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(math.isclose(a, rows[i][ids[i + 1]].item(), abs_tol=1e-4) for i, a in enumerate(lp.token_logprobs[1:]))
    assert all(top for top in lp.top_logprobs[1:])  # keyed by text: undecodable byte tokens may share a key
