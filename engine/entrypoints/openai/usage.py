"""Usage of a finished API request: token counts, with the prompt tokens served from the prefix cache."""
from __future__ import annotations

from engine.core.outputs import RequestOutput
from engine.entrypoints.openai.responses import PromptTokensDetails, Usage


def usage_of(finals: list[RequestOutput], count_completion: bool = True) -> Usage:
    """`count_completion=False` for prompt scoring, whose one sampled token is not returned."""
    prompt = sum(len(f.prompt_token_ids) for f in finals)
    completion = sum(len(o.token_ids) for f in finals for o in f.outputs) if count_completion else 0
    cached = sum(f.num_cached_tokens or 0 for f in finals)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))
