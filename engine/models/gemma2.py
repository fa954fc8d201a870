"""The Gemma 2 family (Gemma2ForCausalLM): Gemma 3's decoder (engine/models/gemma3.py) with Gemma 2's switches.

Gemma 3 grew out of Gemma 2, so one implementation serves both: scaled embeddings, (1 + w) RMSNorms, four norms
per layer, GELU-tanh, attention scaled by ``query_pre_attn_scalar ** -0.5``. What Gemma 2 has that Gemma 3
does not — attention logits soft-capped (``cap * tanh(s / cap)``, in every attention backend: kernels/) and
the final logits soft-capped the same way — are read from the config by that code; what it lacks — q/k norms
(`qk_norm` stays unset in its registry defaults) and a separate local RoPE base (one table serves all
layers) — falls out of the config too. Layers alternate sliding-window (even) and global (odd) attention:
`layer_types`, or the registry's `sliding_window_pattern` default for config.json files without it.
"""
from __future__ import annotations

from engine.models.gemma3 import Gemma3ForCausalLM


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    pass
