"""vLLM's return_tokens_as_token_ids: every logprob token (chosen, alternatives, prompt logprobs; chat and
completions, streamed or not) is spelled "token_id:N" with N the id the reply's token_ids carry."""
from __future__ import annotations

import openai
import pytest

from server_harness import MODEL_NAME, start_server


@pytest.fixture(scope="module")
def client(llama_dir):
    server = start_server(llama_dir)
    yield openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
    server.stop()


def ids_of(names) -> list[int]:
    assert all(n.startswith("token_id:") for n in names), names
    return [int(n.split(":", 1)[1]) for n in names]


def test_completions_name_tokens_by_id(client):
    extra = {"return_tokens_as_token_ids": True, "return_token_ids": True, "prompt_logprobs": 1}
    choice = client.completions.create(model=MODEL_NAME, prompt="hello there", max_tokens=6, logprobs=2,
                                       temperature=0, extra_body=extra).choices[0]
    assert ids_of(choice.logprobs.tokens) == choice.token_ids
    assert all(ids_of(list(top)) for top in choice.logprobs.top_logprobs)
    prompt = [entry for entry in choice.prompt_logprobs if entry is not None]
    assert all(v["decoded_token"] == f"token_id:{k}" for entry in prompt for k, v in entry.items())
    plain = client.completions.create(model=MODEL_NAME, prompt="hello there", max_tokens=6, logprobs=2,
                                      temperature=0).choices[0]
    assert not any(t.startswith("token_id:") for t in plain.logprobs.tokens)


def test_streamed_chat_names_tokens_by_id(client):
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0, stream=True,
        logprobs=True, top_logprobs=1, extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True})
    names, ids = [], []
    for chunk in stream:
        for c in chunk.choices:
            if c.logprobs and c.logprobs.content:
                names += [t.token for t in c.logprobs.content]
                assert all(top.token.startswith("token_id:") for t in c.logprobs.content for top in t.top_logprobs)
            ids += getattr(c, "token_ids", None) or []
    assert len(names) == 6 and ids_of(names) == ids
