"""ServedModel: what the HTTP layer knows about the loaded model (name, tokenizer copy, limits).

Built once the engine has loaded. The tokenizer is a private copy, so the event loop and its
threadpool can tokenize while the engine thread detokenizes with its own instance. `text_tokenizer`
is a second copy that reads special-token text as plain text (split_special_tokens), for message
content; a copy of its own because switching that mode on a shared tokenizer races between threads.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any

from engine.reasoning import detect_reasoning_parser
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
    text_tokenizer: Any = None
    special_token_texts: tuple[str, ...] = field(default_factory=tuple)
    quantization: str | None = None  # QuantConfig.describe() of the loaded checkpoint
    grammars: Any = None  # the engine's GrammarCompiler (thread-safe; shares its cache with the engine)
    tool_parser: str | None = None  # --tool-call-parser, or detected from the chat template
    reasoning_parser: str | None = None
    pooler: Any = None  # PoolerConfig of an embedding engine (--task embed); None: a generation engine
    system_anywhere: bool | None = None  # the template shows a system message after the first turn (prompts.py)
    # A vision-language engine's image side (engine/multimodal): the processor (its own tokenizer copy, so the
    # tokenizer pool's threads never share the engine's), where images may come from, and how many a prompt takes.
    mm_processor: Any = None
    media_limits: Any = None
    image_limit: int | None = None

    @property
    def supports_images(self) -> bool:
        return self.mm_processor is not None

    @classmethod
    def from_engine(cls, name: str, llm_engine: Any) -> "ServedModel":
        tokenizer = copy.deepcopy(llm_engine.tokenizer)
        template = tokenizer.chat_template or ""
        return cls(name=name, root=str(llm_engine.config.model), tokenizer=tokenizer,
                   max_model_len=int(llm_engine.model_config.max_model_len),
                   vocab_size=int(llm_engine.model_config.vocab_size),
                   supports_tools="tools" in str(template), created=int(time.time()),
                   quantization=quantization_name(llm_engine.model_config),
                   text_tokenizer=plain_text_tokenizer(tokenizer), special_token_texts=special_texts(tokenizer),
                   grammars=llm_engine.grammars,
                   tool_parser=llm_engine.config.tool_call_parser or detect_tool_parser(template),
                   reasoning_parser=llm_engine.config.reasoning_parser or detect_reasoning_parser(template),
                   pooler=llm_engine.model_config.pooler, **image_side(llm_engine, tokenizer))


def image_side(llm_engine: Any, tokenizer: Any) -> dict[str, Any]:
    """The ServedModel fields of an engine that takes images (none for a text-only one)."""
    config = llm_engine.config
    if not getattr(llm_engine, "takes_images", False) or llm_engine.model_config.pooler is not None:
        return {}
    from engine.multimodal.media import MediaLimits
    return {"mm_processor": llm_engine.images.new_processor(tokenizer),
            "media_limits": MediaLimits.from_config(config), "image_limit": config.image_limit()}


def quantization_name(model_config: Any) -> str | None:
    quant = getattr(model_config, "quantization", None)
    return quant.describe() if quant is not None else None


def plain_text_tokenizer(tokenizer: Any) -> Any:
    copied = copy.deepcopy(tokenizer)
    copied.split_special_tokens = True
    backend = getattr(copied, "_tokenizer", None)
    if backend is not None and hasattr(backend, "encode_special_tokens"):
        backend.encode_special_tokens = True
    return copied


def special_texts(tokenizer: Any) -> tuple[str, ...]:
    """Texts the tokenizer would read as special tokens (added tokens marked special, and the named ones)."""
    texts = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(added, "special", False):
            texts.add(str(added))
    return tuple(sorted(t for t in texts if t))
