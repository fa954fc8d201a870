"""use_beam_search over HTTP (vLLM's): n is the beam width and the n best beams are the choices, the same
beams the offline `LLM.beam_search` finds (itself checked against HF's num_beams in
test_scheduler_features.py); fields a beam search cannot honour are a 400 naming them."""
from __future__ import annotations

import openai
import pytest

from engine import LLM
from server_harness import MODEL_NAME, start_server

PROMPT = [5, 17, 42, 99, 7, 3]


@pytest.fixture(scope="module")
def served(llama_dir):
    server = start_server(llama_dir)
    yield server, openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
    server.stop()


def test_completions_return_the_offline_beams(served, llama_dir):
    _, client = served
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, n=3,
                                  extra_body={"use_beam_search": True, "ignore_eos": True, "return_token_ids": True})
    [offline] = LLM(str(llama_dir), device="cpu").beam_search([PROMPT], beam_width=3, max_tokens=6, ignore_eos=True,
                                                              use_tqdm=False)
    assert [c.token_ids for c in r.choices] == [b.tokens[len(PROMPT):] for b in offline.sequences]
    assert [c.index for c in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 18


def test_chat_beam_search_gives_n_choices(served):
    _, client = served
    r = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=4, n=2, extra_body={"use_beam_search": True,
                                                                      "length_penalty": 0.5})
    assert len(r.choices) == 2 and all(c.message.content is not None for c in r.choices)


@pytest.mark.parametrize("field,value", [("stream", True), ("temperature", 0.7), ("top_p", 0.5), ("seed", 1),
                                         ("logprobs", 2), ("logprobs", 0), ("stop", ["x"]), ("logit_bias", {"5": 1.0})])
def test_what_a_beam_search_cannot_honour_is_refused(served, field, value):
    _, client = served
    with pytest.raises(openai.BadRequestError, match=field):
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, n=2,
                                  extra_body={"use_beam_search": True, field: value})


def test_length_penalty_without_beam_search_is_refused(served):
    _, client = served
    with pytest.raises(openai.BadRequestError, match="length_penalty"):
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, extra_body={"length_penalty": 0.5})
