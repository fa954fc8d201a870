"""ServedModel: what the HTTP layer knows about the loaded model (name, tokenizer copy, limits).

Built once the engine has loaded. The tokenizer is a private copy, so the event loop and its
threadpool can tokenize while the engine thread detokenizes with its own instance.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any

from engine.tool_parsers import detect_tool_parser


@dataclass
class ServedModel:
    name: str
    root: str
    tokenizer: Any
    max_model_len: int
    vocab_size: int
    supports_tools: bool
    created: int
    grammars: Any = None  # the engine's GrammarCompiler (thread-safe; shares its cache with the engine)
    tool_parser: str | None = None  # --tool-call-parser, or detected from the chat template
    reasoning_parser: str | None = None

    @classmethod
    def from_engine(cls, name: str, llm_engine: Any) -> "ServedModel":
        tokenizer = copy.deepcopy(llm_engine.tokenizer)
        template = tokenizer.chat_template or ""
        return cls(name=name, root=str(llm_engine.config.model), tokenizer=tokenizer,
                   max_model_len=int(llm_engine.model_config.max_model_len),
                   vocab_size=int(llm_engine.model_config.vocab_size),
                   supports_tools="tools" in str(template), created=int(time.time()),
                   grammars=llm_engine.grammars,
                   tool_parser=llm_engine.config.tool_call_parser or detect_tool_parser(template),
                   reasoning_parser=llm_engine.config.reasoning_parser)
