"""A GGUF file's tokenizer and chat template, as the engine loads them, are transformers' GGUF tokenizer's.

The tiny model's byte-level BPE (vocabulary, merges, token types, special ids, chat template) is written into the
file's metadata (tests/gguf_files.py); the engine's tokenizer (engine/core/tokenizer.py) must give the same ids as
transformers' `AutoTokenizer.from_pretrained(..., gguf_file=...)` on varied text — leading and repeated spaces,
newlines, accents, CJK, emoji, special tokens inside text — and as the HF tokenizer the file was written from;
its chat template renders what transformers renders; the ids the engine stops at are the file's.
"""
from __future__ import annotations

import pytest
from gguf_files import make_tiny_gguf
from transformers import AutoTokenizer

from engine.config.model import ModelConfig
from engine.core.tokenizer import load_tokenizer

TEXTS = ["Hello world", "  two leading spaces", "tabs\tand\nnewlines\n\n", "Ça coûte l'été à Paris.",
         "日本語のテキスト", "Emoji: 🚀🔥 👍🏽", "<|im_start|>user\nhi<|im_end|>", "numbers 1234567 3.14159",
         "", " ", "def f(x):\n    return x  # done"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Ça va? 🚀"},
            {"role": "assistant", "content": "Oui."}, {"role": "user", "content": "  and then"}]


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    return make_tiny_gguf(tmp_path_factory.mktemp("gguf"), "qwen2", "Q8_0")


def test_ids_match_transformers_gguf_tokenizer_and_the_source(gguf_path):
    ours = load_tokenizer(gguf_path)
    reference = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    source = AutoTokenizer.from_pretrained(gguf_path.parent / "tiny-qwen2")
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == reference.encode(text, add_special_tokens=False) == source.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == text
    assert ours.convert_tokens_to_ids("<|im_end|>") == source.convert_tokens_to_ids("<|im_end|>")
    assert len(ours.encode("<|im_start|>", add_special_tokens=False)) == 1


def test_chat_template_from_the_file_renders_what_transformers_renders(gguf_path):
    ours = load_tokenizer(gguf_path)
    reference = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    source = AutoTokenizer.from_pretrained(gguf_path.parent / "tiny-qwen2")
    assert ours.chat_template == source.chat_template
    rendered = ours.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert rendered == reference.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert rendered == source.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)


def test_stop_ids_and_bos_come_from_the_file(gguf_path):
    cfg = ModelConfig.from_folder(gguf_path)
    tok = load_tokenizer(gguf_path)
    assert cfg.eos_token_ids == [tok.eos_token_id] and cfg.bos_token_id == tok.bos_token_id


def test_chat_through_the_engine_uses_the_files_template(gguf_path):
    from engine import LLM, SamplingParams
    llm = LLM(str(gguf_path), device="cpu", max_model_len=128)
    out = llm.chat(MESSAGES[:2], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    expected = load_tokenizer(gguf_path).apply_chat_template(MESSAGES[:2], add_generation_prompt=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert out.prompt_token_ids == list(expected) and len(out.outputs[0].token_ids) == 3


def test_tokenizer_flag_names_an_hf_folder_instead(gguf_path, tmp_path):
    """`--tokenizer FOLDER` (as vLLM allows): the folder's tokenizer and chat template, not the file's."""
    from tiny_models import make_tiny_model

    from engine import LLM, SamplingParams
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    folder = make_tiny_model(tmp_path, "qwen2", chat_template=template)
    llm = LLM(str(gguf_path), device="cpu", max_model_len=128, tokenizer=str(folder))
    out = llm.chat(MESSAGES[:2], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)[0]
    expected = AutoTokenizer.from_pretrained(folder).encode("[system] Be brief.\n[user] Ça va? 🚀\n",
                                                            add_special_tokens=False)
    assert out.prompt_token_ids == expected and llm.get_tokenizer().chat_template == template
