"""POST /v1/embeddings through the real openai SDK against a real uvicorn server on a tiny Qwen3-Embedding-shaped
checkpoint (bare decoder tensors, sentence-transformers last-token pooling + Normalize, is_matryoshka): single,
batch (text and token ids), base64 (the SDK's default) and dimensions, each equal to transformers' last hidden
state pooled and normalised; prompts longer than the step budget pool across prefill chunks; a repeated input
hits the prefix cache and gives the same vector; a generation model answers 400 naming --task embed."""
from __future__ import annotations

import numpy as np
import openai
import pytest

from server_harness import AGENT_API_KEY, MODEL_NAME, start_server
from tiny_embedders import hf_embeddings, make_tiny_embedder

TEXTS = ["The quick brown fox jumps over the lazy dog. " * 2, "Paris", "numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000"]
ATOL = 1e-5


@pytest.fixture(scope="module")
def embedder(tmp_path_factory, tiny_model_dir):
    return make_tiny_embedder(tmp_path_factory.mktemp("embedder"), "LAST", base=tiny_model_dir("qwen3"))


@pytest.fixture(scope="module")
def server(embedder):
    # A 16-token step budget: the longer inputs run as several prefill chunks before they are pooled.
    srv = start_server(embedder, max_num_batched_tokens=16)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def token_ids(server):
    tokenizer = server.async_engine.engine.tokenizer
    return [list(tokenizer.encode(t)) for t in TEXTS]


@pytest.fixture(scope="module")
def reference(embedder, token_ids):
    return hf_embeddings(embedder, token_ids)


def test_single_input_equals_hf(client, reference, token_ids):
    r = client.embeddings.create(model=MODEL_NAME, input=TEXTS[0], encoding_format="float")
    assert r.object == "list" and r.model == MODEL_NAME and len(r.data) == 1
    assert r.data[0].object == "embedding" and r.data[0].index == 0
    assert len(token_ids[0]) > 16  # pooled across chunks
    np.testing.assert_allclose(r.data[0].embedding, reference[0], atol=ATOL)
    assert abs(np.linalg.norm(r.data[0].embedding) - 1) < 1e-5
    assert r.usage.prompt_tokens == r.usage.total_tokens == len(token_ids[0])


def test_batch_of_texts_and_token_ids(client, reference, token_ids):
    r = client.embeddings.create(model=MODEL_NAME, input=TEXTS, encoding_format="float")
    assert [d.index for d in r.data] == [0, 1, 2]
    for d, ref in zip(r.data, reference):
        np.testing.assert_allclose(d.embedding, ref, atol=ATOL)
    assert r.usage.prompt_tokens == sum(map(len, token_ids))
    by_ids = client.embeddings.create(model=MODEL_NAME, input=token_ids[1:], encoding_format="float")
    for d, ref in zip(by_ids.data, reference[1:]):
        np.testing.assert_allclose(d.embedding, ref, atol=ATOL)
    one = client.embeddings.create(model=MODEL_NAME, input=token_ids[2], encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, reference[2], atol=ATOL)


def test_base64_is_little_endian_float32(client, server, reference):
    r = client.embeddings.create(model=MODEL_NAME, input=TEXTS[1])  # the SDK asks base64 and decodes it
    np.testing.assert_allclose(r.data[0].embedding, reference[1], atol=ATOL)
    import httpx
    raw = httpx.post(server.base_url + "/embeddings", json={"input": TEXTS[1], "encoding_format": "base64"}).json()
    import base64
    vector = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(vector, reference[1], atol=ATOL)


def test_dimensions_truncate_then_renormalise(client, embedder, token_ids):
    r = client.embeddings.create(model=MODEL_NAME, input=TEXTS[2], dimensions=16, encoding_format="float")
    [ref] = hf_embeddings(embedder, [token_ids[2]], dimensions=16)
    assert len(r.data[0].embedding) == 16
    np.testing.assert_allclose(r.data[0].embedding, ref, atol=ATOL)
    with pytest.raises(openai.BadRequestError, match="dimensions must be between 1 and 64") as err:
        client.embeddings.create(model=MODEL_NAME, input="x", dimensions=65)
    assert err.value.body["param"] == "dimensions"


def test_repeated_input_hits_the_prefix_cache(client, server, reference):
    kv = server.async_engine.engine.kv
    first = client.embeddings.create(model=MODEL_NAME, input=TEXTS[0] + " again", encoding_format="float")
    hits = kv.prefix_hits
    second = client.embeddings.create(model=MODEL_NAME, input=TEXTS[0] + " again", encoding_format="float")
    print("prefix-cache hit tokens on the repeat:", kv.prefix_hits - hits)
    assert kv.prefix_hits - hits >= 16  # the engine is idle between the two requests: nothing else counts
    np.testing.assert_allclose(second.data[0].embedding, first.data[0].embedding, atol=1e-6)


def test_bad_inputs_are_400s(client, server):
    with pytest.raises(openai.BadRequestError, match="input"):
        client.embeddings.create(model=MODEL_NAME, input="")
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.embeddings.create(model=MODEL_NAME, input=[[1, 2, 10**6]])
    with pytest.raises(openai.BadRequestError, match="use /v1/embeddings"):
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}])


def test_generation_model_answers_400(agent_api_server):
    client = openai.OpenAI(base_url=agent_api_server.base_url, api_key=AGENT_API_KEY, max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError, match="--task embed") as err:
        client.embeddings.create(model=MODEL_NAME, input="hello")
    assert err.value.body["param"] == "model"
