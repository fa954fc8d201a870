"""What the engine hands back: RequestOutput / CompletionOutput (vLLM's shapes) and engine statistics.

Outputs are cumulative: each step's RequestOutput carries the whole text and token ids so far; streaming
callers take the part past what they already sent. Torch-free plain data.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int  # 1 = most likely
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # None unless logprobs were asked (vLLM v1)
    logprobs: list[dict[int, Logprob]] | None  # per generated token: chosen token + top-k
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # per prompt token; the first is None
    error: str | None = None  # the request failed inside the engine (finished, blocks freed); others went on


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class PoolingRequestOutput:
    """An embedding request's one output (vLLM's shape): finished once its prompt was computed and pooled."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    error: str | None = None


@dataclass
class EngineStats:
    """Counters and gauges for /metrics and the GUI; totals are since start."""

    num_running: int = 0
    num_waiting: int = 0
    num_blocks: int = 0
    block_size: int = 0
    num_used_blocks: int = 0
    num_cached_free_blocks: int = 0
    kv_cache_usage: float = 0.0  # used blocks / total, 0..1
    prefix_cache_queries: int = 0  # tokens looked up
    prefix_cache_hits: int = 0  # tokens found
    num_preemptions: int = 0
    prompt_tokens_total: int = 0  # prompt tokens computed (cache hits excluded)
    generation_tokens_total: int = 0
    num_steps: int = 0
    spec_decode: dict | None = None  # SpecDecodeStats.as_dict() (engine/spec_decode/metrics.py) when speculating
    # MoE models: routed token assignments since start (top-k counted each), {"num_experts": E, "layers": [decoder
    # layer indices], "tokens": [[int] * E per layer]} (engine/layers/fused_moe/expert_load.py); None when dense.
    expert_load: dict | None = None
    # The prefix cache's CPU-RAM tier since start (TierStats.as_dict, engine/kv/offload/connector.py); None without.
    kv_offload: dict | None = None
    sleep_level: int = 0  # sleep mode: 0 awake, 1 weights in host RAM, 2 weights dropped (KV cache dropped either way)
    extra: dict = field(default_factory=dict)


@dataclass(slots=True)
class RequestState:
    """One request as the GUI shows it; counts are summed over the request's sequences."""

    request_id: str
    status: str  # running | waiting
    num_blocks: int
    num_prompt_tokens: int
    num_computed_tokens: int
    num_generated_tokens: int


@dataclass
class BlockPoolSnapshot:
    """Every physical block: state (0 free, 1 used, 2 cached and free), ref count, owner index.

    `owner[i]` indexes `owner_ids` (the request owning block i, the first one when shared), -1 for none.
    Arrays are numpy (uint8 state, int32 ref_count, int32 owner). With several KV cache groups, `group[i]`
    is the group whose tables hold block i (-1 for none) and `group_names` names them.
    """

    state: object
    ref_count: object
    owner: object
    owner_ids: list[str]
    requests: list[RequestState] = field(default_factory=list)  # holders of blocks first, then waiting
    group: object = None  # int8 per block, None with one KV cache group
    group_names: list[str] = field(default_factory=list)  # e.g. ["full attention · 10 layers", "window 1024 · 13 layers"]
    state_slots: dict | None = None  # hybrid models: engine/block_snapshot.state_slot_picture
    image_blocks: list[int] = field(default_factory=list)  # ids of blocks holding image placeholder tokens
