"""Load the model's tokenizer (fast tokenizer, chat template) through transformers; no model object."""
from __future__ import annotations

from pathlib import Path


def load_tokenizer(path: str | Path, trust_remote_code: bool = False):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
