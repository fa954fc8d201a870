"""Incremental, UTF-8-safe detokenization and stop-string matching for one output sequence.

Each new token decodes a short window of ids ending at it (prefix/read offsets, as TGI and vLLM do):
text is emitted only once the window no longer ends in an incomplete UTF-8 sequence, so a character
split across tokens never leaves U+FFFD behind. When stop strings are set, text that could still grow
into a stop string is held back from `visible_text` until it is decided.
"""
from __future__ import annotations

from typing import Callable

from engine.sample.sampling_params import SamplingParams

REPLACEMENT = "\ufffd"
INITIAL_WINDOW = 5


def decoder_of(tokenizer) -> Callable[..., str]:
    """`tokenizer.decode`, straight through the Rust tokenizer when that is all transformers would do with it (a
    fast tokenizer that cleans no spaces up): a fifth of the cost, and it is paid twice per generated token."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "decode") or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return getattr(tokenizer, "decode", None)  # None: a test's sequence without a tokenizer (never decoded)
    return backend.decode


class IncrementalDetokenizer:
    def __init__(self, tokenizer, params: SamplingParams, num_prompt_tokens: int) -> None:
        self.tokenizer = tokenizer
        self.decode = decoder_of(tokenizer)
        self.params = params
        self.output_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""
        self.hold_back = max((len(s) for s in params.stop_strings), default=1) - 1

    def _decode(self, ids: list[int]) -> str:
        return self.decode(ids, skip_special_tokens=self.params.skip_special_tokens)

    def add_token(self, token_id: int) -> str:
        """Append one generated token; return the text it completed (possibly empty)."""
        self.output_ids.append(token_id)
        prefix = self._decode(self.output_ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.output_ids[self.prefix_offset:])
        if full.endswith(REPLACEMENT) or len(full) <= len(prefix):
            return ""
        new = full[len(prefix):]
        self.text += new
        self.prefix_offset = max(self.read_offset, len(self.output_ids) - INITIAL_WINDOW)
        self.read_offset = len(self.output_ids)
        return new

    def flush(self) -> None:
        """At the end, emit whatever is left even if it is not valid UTF-8 (the model really made it)."""
        if self.read_offset < len(self.output_ids):
            prefix = self._decode(self.output_ids[self.prefix_offset:self.read_offset])
            full = self._decode(self.output_ids[self.prefix_offset:])
            self.text += full[len(prefix):]
            self.read_offset = len(self.output_ids)

    def find_stop(self, new_text_len: int) -> str | None:
        """If a stop string now appears, cut the text there and return it."""
        if not new_text_len or not self.params.stop_strings:
            return None
        window_start = max(0, len(self.text) - new_text_len - self.hold_back)
        best: tuple[int, str] | None = None
        for stop in self.params.stop_strings:
            at = self.text.find(stop, window_start)
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        self.text = self.text[:at + len(stop)] if self.params.include_stop_str_in_output else self.text[:at]
        return stop

    def visible_text(self, finished: bool) -> str:
        if finished or not self.hold_back:
            return self.text
        return self.text[:max(0, len(self.text) - self.hold_back)]
