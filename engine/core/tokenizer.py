"""Load the model's tokenizer (fast tokenizer, chat template) through transformers; no model object.

A GGUF file carries its tokenizer in its metadata (vocabulary, merges or scores, token types, special ids, the
chat template): transformers builds the same fast tokenizer from it that its own GGUF loader uses, so ids and
the rendered template are transformers' (tests/test_gguf_tokenizer.py). `--tokenizer` may name an HF folder
instead, as vLLM allows. Where AutoTokenizer fails on the file's config (transformers 5.x on gpt-oss's YaRN
keys), the generic fast tokenizer is built from the same metadata; if that fails too, the error names the flag.
"""
from __future__ import annotations

from pathlib import Path

from engine.config.gguf_file import is_gguf, split_parts


def load_tokenizer(path: str | Path, trust_remote_code: bool = False):
    from transformers import AutoTokenizer
    if is_gguf(path):
        first = split_parts(Path(path))[0]  # the metadata is in the first part of a split set
        try:
            return AutoTokenizer.from_pretrained(str(first.parent), gguf_file=first.name)
        except (TypeError, ValueError, KeyError, NotImplementedError) as e:  # it parses the file's config first
            return _fast_tokenizer_only(first, e)
    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)


def _fast_tokenizer_only(first: Path, error: Exception):
    """The file's tokenizer without the config AutoTokenizer reads to pick a class: transformers' generic fast
    tokenizer from the same GGUF vocabulary, merges, special ids and chat template."""
    from transformers import PreTrainedTokenizerFast
    try:
        return PreTrainedTokenizerFast.from_pretrained(str(first.parent), gguf_file=first.name)
    except Exception as e:  # noqa: BLE001 - whatever its converter raises, the user's way out is the same
        raise ValueError(f"transformers could not build the tokenizer of {first.name} ({type(error).__name__}: "
                         f"{error}; then {type(e).__name__}: {e}); pass --tokenizer with the model's Hugging Face "
                         "folder or repo id") from e
