"""Load the model's tokenizer (fast tokenizer, chat template) through transformers; no model object.

A GGUF file carries its tokenizer in its metadata (vocabulary, merges or scores, token types, special ids, the
chat template): transformers builds the same fast tokenizer from it that its own GGUF loader uses, so ids and
the rendered template are transformers' (tests/test_gguf_tokenizer.py). `--tokenizer` may name an HF folder
instead, as vLLM allows; where transformers' reader fails on a file's metadata (gpt-oss's YaRN keys in
transformers 5.x), the error says so and names that flag.
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
        except (TypeError, ValueError, KeyError, NotImplementedError) as e:  # its GGUF reader parses the config too
            raise ValueError(f"transformers could not build the tokenizer of {first.name} ({type(e).__name__}: {e}); "
                             "pass --tokenizer with the model's Hugging Face folder or repo id") from e
    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
