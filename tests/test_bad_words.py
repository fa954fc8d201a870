"""bad_words (vLLM's): each word's token sequences as written and with a leading space; a one-token word is
never drawn, a longer one's last token is masked whenever the output ends with its other tokens. Greedy
output with one-token bad words equals HF `generate(bad_words_ids=...)`; over HTTP the field works through
the openai SDK."""
from __future__ import annotations

import openai
import pytest
import torch
from transformers import AutoTokenizer

from engine import LLM, SamplingParams
from engine.sample.metadata import SamplingRow
from engine.sample.state import SamplingMetadata
from hf_reference import MAX_TOKENS
from server_harness import MODEL_NAME, start_server
from tiny_models import hf_model


class WordTokenizer:
    """Splits on spaces; a leading space makes a different token, as BPE tokenizers do."""

    VOCAB = {"red": [1], " red": [2], "big dog": [3, 4], " big dog": [5, 4]}

    def encode(self, text, add_special_tokens=False):
        return self.VOCAB[text]


def masked_ids(params: SamplingParams, prompt: list[int], output: list[int]) -> set[int]:
    row = SamplingRow(params, prompt + output, len(prompt), None, [0])
    meta = SamplingMetadata.build([row], 16, torch.device("cpu"))
    return set() if meta.masked is None else set(meta.masked[1].tolist())


def test_words_become_both_spellings_and_mask_only_when_the_output_ends_with_their_head():
    params = SamplingParams(bad_words=["red", " big dog"])
    params.resolve_bad_words(WordTokenizer())
    assert params.bad_words_token_ids == [[1], [2], [3, 4], [5, 4]]
    assert masked_ids(params, [7], []) == {1, 2}  # one-token words: always
    assert masked_ids(params, [7], [9, 3]) == {1, 2, 4}  # the output ends with "big": "dog" may not follow
    assert masked_ids(params, [7, 3], []) == {1, 2}  # the prompt's last token does not count (as vLLM)
    assert masked_ids(params, [7], [3, 9]) == {1, 2}


@pytest.mark.parametrize("words", [[], [""], ["   "], ["x"] * 65])
def test_bad_input_is_refused(words):
    if not words:
        assert SamplingParams(bad_words=[]).bad_words == []
        return
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=words)


def single_token_words(tokenizer, candidates) -> list[str]:
    """Words from these token ids whose spellings (as written, with a leading space) are one token each."""
    words = []
    for t in candidates:
        word = tokenizer.decode([t]).strip()
        if word and all(len(tokenizer.encode(s, add_special_tokens=False)) == 1 for s in (word, " " + word)):
            words.append(word)
    return words


def test_greedy_with_one_token_bad_words_matches_hf(reference):
    path, prompts, expected = reference("llama")
    tokenizer = AutoTokenizer.from_pretrained(path)
    frequent = sorted({t for out in expected for t in out}, key=lambda t: -sum(o.count(t) for o in expected))
    words = single_token_words(tokenizer, frequent)[:3]
    assert words, "no generated token spells a one-token word"
    params = SamplingParams(temperature=0, bad_words=words)
    params.resolve_bad_words(tokenizer)
    model = hf_model(path)
    llm = LLM(str(path), device="cpu")
    ours = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=n, bad_words=words) for n in MAX_TOKENS],
                        use_tqdm=False)
    banned = {ids[0] for ids in params.bad_words_token_ids}
    for prompt, n, out, plain in zip(prompts, MAX_TOKENS, ours, expected):
        with torch.no_grad():
            hf = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                                bad_words_ids=params.bad_words_token_ids,
                                attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == hf and not banned & set(hf)
    assert any(banned & set(plain) for plain in expected)  # the words did change something


def test_a_two_token_word_never_appears_and_the_output_is_unchanged_before_it(reference):
    path, prompts, expected = reference("llama")
    tokenizer = AutoTokenizer.from_pretrained(path)
    out = next(o for o in expected if len(o) > 8)
    index = expected.index(out)
    for k in range(1, len(out)):
        word = tokenizer.decode(out[k - 1:k + 1])
        params = SamplingParams(temperature=0, max_tokens=len(out), bad_words=[word])
        params.resolve_bad_words(tokenizer)
        if out[k - 1:k + 1] in params.bad_words_token_ids:
            break
    else:
        pytest.fail("no bigram of the output round-trips through the tokenizer")
    [result] = LLM(str(path), device="cpu").generate([prompts[index]], [params], use_tqdm=False)
    got = result.outputs[0].token_ids
    assert got[:k] == out[:k] and got[k] != out[k]  # the same text up to the banned token, then not it
    assert all(got[j:j + 2] not in params.bad_words_token_ids for j in range(len(got) - 1))


def test_bad_words_over_http(llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    server = start_server(llama_dir)
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
        ask = dict(model=MODEL_NAME, prompt="hello there", max_tokens=24, temperature=0)
        plain = client.completions.create(**ask, extra_body={"return_token_ids": True}).choices[0]
        words = single_token_words(tokenizer, plain.token_ids)
        assert words, "no generated token spells a one-token word"
        banned_ids = {tokenizer.encode(s, add_special_tokens=False)[0] for s in (words[0], " " + words[0])}
        banned = client.completions.create(**ask, extra_body={"return_token_ids": True,
                                                              "bad_words": [words[0]]}).choices[0]
        assert banned.token_ids != plain.token_ids and not banned_ids & set(banned.token_ids)
        with pytest.raises(openai.BadRequestError, match="bad_words"):
            client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2, extra_body={"bad_words": [" "]})
    finally:
        server.stop()


def test_ids_the_tokenizer_makes_beyond_the_models_vocabulary_are_refused(tiny_model_dir):
    """A tokenizer larger than the model's embedding (text prompts, bad words) is a clear error, not an index
    past the embedding (a device-side assert on CUDA)."""
    path = tiny_model_dir("llama", vocab_size=280)
    tokenizer = AutoTokenizer.from_pretrained(path)
    text = next(w for w in ("hello world", "the weather", "once upon a time")
                if max(tokenizer.encode(w, add_special_tokens=False)) >= 280)
    llm = LLM(str(path), device="cpu")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([text], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="bad_words encode to token ids"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=2, bad_words=[text]), use_tqdm=False)
    assert llm.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
