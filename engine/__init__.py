"""The serving engine: paged KV cache, continuous batching, sampling, offline `LLM` API. No Qt anywhere.

Names are exported lazily so that torch-free modules (engine.config, engine.sizing) can be imported by
the GUI without pulling in torch.
"""
from __future__ import annotations

_EXPORTS = {
    "LLM": "engine.llm", "LLMEngine": "engine.llm_engine", "SamplingParams": "engine.sampling_params",
    "EngineConfig": "engine.config", "RequestOutput": "engine.outputs", "CompletionOutput": "engine.outputs",
    "BeamSearchParams": "engine.beam_search",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
