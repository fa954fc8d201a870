"""pagedesk-serve gets the online step budget (the prompt-token cap that bounds inter-token latency is in
test_prefill_cap.py), offline LLM keeps 8192, and an explicit --max-num-batched-tokens always wins."""
from __future__ import annotations

from engine.entrypoints import serve
from engine.config.flags import EngineConfig


def test_serving_budget_is_2048_and_offline_keeps_8192():
    served = serve.parse_config(["--model", "m"])
    assert served.serving
    assert served.resolve_max_num_batched_tokens(2048) == 2048
    offline = EngineConfig(model="m")
    assert not offline.serving and offline.resolve_max_num_batched_tokens(2048) == 8192
    explicit = serve.parse_config(["--model", "m", "--max-num-batched-tokens", "1000"])
    assert explicit.resolve_max_num_batched_tokens(2048) == 1000
    no_chunking = serve.parse_config(["--model", "m", "--no-enable-chunked-prefill"])
    assert no_chunking.resolve_max_num_batched_tokens(16384) == 16384  # whole prompts must fit a step
