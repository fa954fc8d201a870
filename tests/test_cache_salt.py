"""cache_salt (vLLM's): a salt seeds the block-hash chain, so a prompt's cached blocks are shared only by
requests with the same salt (and unsalted requests only with unsalted ones). Seen through the API's
usage.prompt_tokens_details.cached_tokens."""
from __future__ import annotations

import openai
import pytest

from engine.kv.block_pool import hash_block
from server_harness import MODEL_NAME, start_server

PROMPT = " ".join(f"w{i}" for i in range(30))  # several full 16-token blocks, under the 256-token context


def test_the_salt_changes_every_block_hash_of_the_chain():
    tokens = list(range(16))
    plain, salted = hash_block(None, tokens), hash_block(None, tokens, "a")
    assert plain != salted != hash_block(None, tokens, "b") and salted == hash_block(None, tokens, "a")
    assert hash_block(plain, tokens) != hash_block(salted, tokens)  # children differ through their parents


@pytest.fixture(scope="module")
def client(llama_dir):
    server = start_server(llama_dir)
    yield openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
    server.stop()


def cached(client, salt: str | None) -> int:
    extra = {"cache_salt": salt} if salt is not None else {}
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=1, extra_body=extra)
    return r.usage.prompt_tokens_details.cached_tokens


def test_only_requests_with_the_same_salt_share_cached_prefixes(client):
    assert cached(client, None) == 0
    assert cached(client, None) > 0  # unsalted requests share
    assert cached(client, "alice") == 0  # a salted request does not see the unsalted blocks
    assert cached(client, "alice") > 0
    assert cached(client, "bob") == 0
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        cached(client, "")
