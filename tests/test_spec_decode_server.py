"""Speculative decoding behind the server: a stream carries each verify step's tokens as one delta, usage
counts exactly the tokens emitted, logprobs come per token, and /metrics and the engine state carry vLLM's
spec_decode counters (a copy of the target as draft: every draft accepted, K + 1 tokens per step)."""
from __future__ import annotations

import math
import time

import httpx
import openai
import pytest

from server_harness import MODEL_NAME, start_server

K = 2
pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def server(llama_dir):
    srv = start_server(llama_dir, speculative_config={"model": str(llama_dir), "num_speculative_tokens": K})
    yield srv
    srv.stop()


def _metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(f"pagedesk:{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_stream_deltas_usage_metrics_and_state(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
    kw = dict(model=MODEL_NAME, prompt="The quick brown fox", max_tokens=12, temperature=0, logprobs=1,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text_chunks = [c for c in chunks if c.choices and c.choices[0].text]
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    usage = chunks[-1].usage
    assert usage.completion_tokens == whole.usage.completion_tokens == 12
    assert sum(len(c.choices[0].logprobs.tokens) for c in text_chunks) == 12
    # The prefill step emits one token, then every verify step K + 1 at once: never more deltas than steps.
    assert len(text_chunks) <= 1 + math.ceil(11 / (K + 1))
    final = server.async_engine.engine.spec.stats.num_drafts  # both requests are done: the engine is idle
    assert final > 0
    deadline = time.monotonic() + 60
    while True:  # the server samples engine stats every few hundred ms: wait for the one after these requests
        text = httpx.get(server.url + "/metrics").text
        drafts = _metric(text, "spec_decode_num_drafts_total")
        if drafts == final or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    drafted, accepted = _metric(text, "spec_decode_num_draft_tokens_total"), \
        _metric(text, "spec_decode_num_accepted_tokens_total")
    assert drafts == final and drafted == accepted > 0
    assert 'pagedesk:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="1"}' in text
    state = httpx.get(server.base_url + "/engine/state").json()
    assert state["spec_decode"]["method"] == "draft_model" and state["spec_decode"]["num_drafts"] >= drafts
