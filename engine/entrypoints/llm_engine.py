"""LLMEngine: the engine as every entry point uses it — `LLMEngine(EngineConfig(...))` starts the executor
(engine/executor/startup.py: model loaded, KV cache sized and allocated, graphs captured, proposer built) and runs
the engine core over it (engine/core/engine_core.py: add_request, step, abort, stats). vLLM's split: the core
never imports the worker side; this is where the two meet. Not thread-safe: one caller (the offline LLM, or the
async engine's thread)."""
from __future__ import annotations

from engine.config.flags import EngineConfig
from engine.core.engine_core import EngineCore
from engine.executor.startup import start_engine
from engine.platform.threads import apply_thread_budget


class LLMEngine(EngineCore):
    def __init__(self, config: EngineConfig) -> None:
        apply_thread_budget()  # on the thread that will step the engine (numba's thread count is per thread)
        super().__init__(config, start_engine(config))
