"""ServedModel: what the HTTP layer knows about the loaded model (name, tokenizer copy, limits).

Built once the engine has loaded. The tokenizer is a private copy, so the event loop and its
threadpool can tokenize while the engine thread detokenizes with its own instance.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any


@dataclass
class ServedModel:
    name: str
    root: str
    tokenizer: Any
    max_model_len: int
    vocab_size: int
    supports_tools: bool
    created: int
    quantization: str | None = None  # QuantConfig.describe() of the loaded checkpoint

    @classmethod
    def from_engine(cls, name: str, llm_engine: Any) -> "ServedModel":
        tokenizer = copy.deepcopy(llm_engine.tokenizer)
        template = tokenizer.chat_template or ""
        return cls(name=name, root=str(llm_engine.config.model), tokenizer=tokenizer,
                   max_model_len=int(llm_engine.model_config.max_model_len),
                   vocab_size=int(llm_engine.model_config.vocab_size),
                   supports_tools="tools" in str(template), created=int(time.time()),
                   quantization=quantization_name(llm_engine.model_config))


def quantization_name(model_config: Any) -> str | None:
    quant = getattr(model_config, "quantization", None)
    return quant.describe() if quant is not None else None
