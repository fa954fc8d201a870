"""vLLM's `use_beam_search` over HTTP: the request's `n` is the beam width and its n best beams are the n
choices (`length_penalty` ranks them). A beam search is deterministic and ends as a whole, so fields that
ask for sampling, streaming, per-token logprobs, stop rules or constraints are refused with a 400 naming
them rather than ignored."""
from __future__ import annotations

from typing import Any

from engine.core.beam_search import BeamSearchParams
from engine.entrypoints.openai.errors import bad_request

# field -> the values that ask for nothing beyond a plain beam search
_NEUTRAL: dict[str, tuple] = {
    "stream": (False,), "temperature": (None, 0, 0.0), "top_p": (None, 1, 1.0), "top_k": (None, -1, 0),
    "min_p": (None, 0, 0.0), "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0), "seed": (None,), "stop": (None, [], ""), "stop_token_ids": (None, []),
    "min_tokens": (0,), "logit_bias": (None, {}), "logprobs": (None, False), "top_logprobs": (None,),
    "prompt_logprobs": (None,), "allowed_token_ids": (None,), "bad_words": (None, []),
    "response_format": (None,), "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,),
    "guided_grammar": (None,), "structured_outputs": (None,), "tools": (None, []),
}


def beam_search_params(req: Any, max_tokens: int) -> BeamSearchParams | None:
    """The request's beam search, or None when it samples; 400 for what a beam search cannot honour."""
    if not req.use_beam_search:
        if req.length_penalty not in (None, 1, 1.0):
            raise bad_request("length_penalty only ranks beams: send it with use_beam_search", "length_penalty")
        return None
    for field, neutral in _NEUTRAL.items():
        value = getattr(req, field, None)
        if field == "logprobs" and value is not False:
            neutral = (None,)  # completions' logprobs=0 still asks for the chosen token's logprob (0 == False)
        if value not in neutral and not (field == "response_format" and getattr(value, "type", None) == "text"):
            raise bad_request(f"use_beam_search does not combine with {field} (got {value!r:.60})", field)
    return BeamSearchParams(beam_width=req.n, max_tokens=max_tokens, length_penalty=req.length_penalty or 1.0,
                            ignore_eos=req.ignore_eos)
