"""The serving engine: paged KV cache, continuous batching, sampling, offline `LLM` API. No Qt anywhere.

Names are exported lazily so that torch-free modules (engine.config, engine.planning) can be imported by the GUI
without pulling in torch. The map of the package: docs/architecture.md.
"""
from __future__ import annotations

import os

# CUDA numbers cards fastest first by default, NVML (nvidia-smi, the doctor's card rows, the app's GPU panel)
# by PCI bus: on a 3090 + 4090 desktop "cuda:0" would be NVML's GPU 1. Read once, when CUDA starts (later
# than any import of this package), and inherited by tensor-parallel workers; a value the user set stays.
os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")

from engine.platform.threads import set_process_env  # noqa: E402 - the thread budget's environment, before torch

set_process_env()

_EXPORTS = {
    "LLM": "engine.entrypoints.llm", "LLMEngine": "engine.entrypoints.llm_engine",
    "SamplingParams": "engine.sample.sampling_params", "EngineConfig": "engine.config.flags",
    "RequestOutput": "engine.core.outputs", "CompletionOutput": "engine.core.outputs",
    "BeamSearchParams": "engine.core.beam_search",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
