"""SamplingParams: how one request is decoded, with vLLM's field names, validated on construction.

Every check raises ValueError naming the field, the value and the allowed range, so the server can turn
it into a 400 and the offline API into a clear exception. Torch-free.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.structured_output.params import StructuredOutputsParams

MAX_N = 16
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 512
MAX_BAD_WORDS = 64
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # entries; each is a scattered add on the logits every step
MAX_ALLOWED_TOKEN_IDS = 1 << 18  # more than any vocabulary we serve
INT64_LIMIT = 2**63  # every integer the engine puts in a tensor is below this


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0): off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-k logprobs per generated token (the chosen token is always included)
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # constrain the output to a grammar
    prompt_logprobs: int | None = None  # top-k logprobs of each prompt token (the first has none)
    allowed_token_ids: list[int] | None = None  # sample only among these (a bitmask, like a grammar's)
    bad_words: list[str] | None = None  # never generate these words (vLLM's bad_words)
    stop_strings: list[str] = field(init=False, default_factory=list)
    # The bad words as token sequences, each as written and with a leading space (how BPE tokenizers spell a
    # word inside a sentence): filled by the engine from its tokenizer (`resolve_bad_words`).
    bad_words_token_ids: list[list[int]] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.stop_strings = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        self._validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def _validate(self) -> None:
        _check(1 <= self.n <= MAX_N, "n", self.n, f"between 1 and {MAX_N}")
        _check(0 <= self.temperature < math.inf, "temperature", self.temperature, "finite and >= 0")
        _check(0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        # Above the vocabulary size top_k keeps every token (the sampler clamps it), as in vLLM.
        _check(-1 <= self.top_k < INT64_LIMIT, "top_k", self.top_k, "-1 (off) or between 1 and 2**63 - 1")
        _check(0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1]")
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty", self.presence_penalty, "in [-2, 2]")
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        _check(0 < self.repetition_penalty <= 2, "repetition_penalty", self.repetition_penalty, "in (0, 2]")
        _check(self.max_tokens is None or 1 <= self.max_tokens < INT64_LIMIT, "max_tokens", self.max_tokens,
               "between 1 and 2**63 - 1")
        _check(0 <= self.min_tokens < INT64_LIMIT, "min_tokens", self.min_tokens, "between 0 and 2**63 - 1")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
               f"<= max_tokens ({self.max_tokens})")
        _check(self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs", self.logprobs,
               f"between 0 and {MAX_LOGPROBS}")
        _check(self.structured_outputs is None or self.min_tokens == 0, "min_tokens", self.min_tokens,
               "0 with structured outputs (the grammar decides where the output ends)")
        _check(self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS, "prompt_logprobs",
               self.prompt_logprobs, f"between 0 and {MAX_LOGPROBS}")
        _check(self.seed is None or 0 <= self.seed < 2**63, "seed", self.seed, "in [0, 2**63)")
        _check(len(self.stop_strings) <= MAX_STOP_STRINGS, "stop", f"{len(self.stop_strings)} strings",
               f"at most {MAX_STOP_STRINGS} strings")
        for s in self.stop_strings:
            _check(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_CHARS, "stop", repr(s)[:40],
                   f"non-empty strings of at most {MAX_STOP_STRING_CHARS} characters")
        _check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids", f"{len(self.stop_token_ids)} ids",
               f"at most {MAX_STOP_TOKEN_IDS} ids")
        bias = self.logit_bias or {}
        _check(len(bias) <= MAX_LOGIT_BIAS, "logit_bias", f"{len(bias)} entries", f"at most {MAX_LOGIT_BIAS} entries")
        bad_bias = [v for v in bias.values() if not -100 <= v <= 100]
        _check(not bad_bias, "logit_bias", bad_bias[:3], "values in [-100, 100]")
        allowed = self.allowed_token_ids or []
        _check(len(allowed) <= MAX_ALLOWED_TOKEN_IDS, "allowed_token_ids", f"{len(allowed)} ids",
               f"at most {MAX_ALLOWED_TOKEN_IDS} ids")
        words = self.bad_words or []
        _check(len(words) <= MAX_BAD_WORDS, "bad_words", f"{len(words)} words", f"at most {MAX_BAD_WORDS} words")
        for w in words:
            _check(isinstance(w, str) and 0 < len(w.strip()) and len(w) <= MAX_STOP_STRING_CHARS, "bad_words",
                   repr(w)[:40], f"non-blank strings of at most {MAX_STOP_STRING_CHARS} characters")

    def resolve_bad_words(self, tokenizer) -> None:
        """Each bad word's token sequences: as written, and with one leading space, without duplicates."""
        seen: list[list[int]] = []
        for word in self.bad_words or []:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = list(tokenizer.encode(text, add_special_tokens=False))
                if ids and ids not in seen:
                    seen.append(ids)
        self.bad_words_token_ids = seen

    def validate_token_ids(self, vocab_size: int) -> None:
        """Token ids named by the request must exist in the model's vocabulary."""
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", list(self.logit_bias or {})),
                          ("allowed_token_ids", self.allowed_token_ids or [])):
            bad = [i for i in ids if not 0 <= int(i) < vocab_size]
            _check(not bad, name, bad[:5], f"token ids in [0, {vocab_size})")


def _check(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value}")
