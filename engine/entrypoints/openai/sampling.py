"""Build SamplingParams from an API request; SamplingParams checks the ranges and a ValueError becomes a 400.

Unset fields keep SamplingParams' defaults (vLLM's); `seed` falls back to none (fresh randomness per
request), as in vLLM, and so does `seed: -1` (OpenAI clients send it to mean "random").
"""
from __future__ import annotations

from engine.sample.sampling_params import SamplingParams
from engine.entrypoints.openai.errors import bad_request
from engine.entrypoints.openai.protocol import SamplingFields
from engine.structured_output.params import StructuredOutputsParams

_OPTIONAL = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
             "repetition_penalty")


def _logit_bias(raw: dict[str, float] | None) -> dict[int, float] | None:
    if not raw:
        return None
    bias = {}
    for key, value in raw.items():
        try:
            bias[int(key)] = float(value)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key[:20]!r}", "logit_bias") from None
        if not -100 <= value <= 100:
            raise bad_request(f"logit_bias values must be in [-100, 100], got {value}", "logit_bias")
    return bias


def sampling_params(req: SamplingFields, max_tokens: int, logprobs: int | None, vocab_size: int,
                    structured_outputs: StructuredOutputsParams | None = None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """SamplingParams for one prompt of `req`; raises ValueError (→ 400) for out-of-range values."""
    kwargs = {name: getattr(req, name) for name in _OPTIONAL if getattr(req, name) is not None}
    params = SamplingParams(
        n=req.n, seed=None if req.seed == -1 else req.seed, max_tokens=max_tokens, min_tokens=req.min_tokens, stop=req.stop,
        stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
        include_stop_str_in_output=req.include_stop_str_in_output, logprobs=logprobs,
        logit_bias=_logit_bias(req.logit_bias), skip_special_tokens=req.skip_special_tokens,
        structured_outputs=structured_outputs, prompt_logprobs=prompt_logprobs,
        allowed_token_ids=req.allowed_token_ids, bad_words=req.bad_words or None, **kwargs)
    params.validate_token_ids(vocab_size)
    return params
