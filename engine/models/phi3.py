"""The Phi-3 family (Phi-3, Phi-3.5, Phi-4, Phi-4-mini): the Llama decoder with fused checkpoint tensors.

The checkpoint stores `qkv_proj` and `gate_up_proj` already stacked, so nothing is packed on the way in: each
fused tensor reaches its layer with shard id None and the layer splits it into its q/k/v (gate/up) shards
(engine/layers/linear.py), every shard counted. LongRoPE and Phi-4-mini's partial rotary come from the RoPE
factory; the sliding window of Phi-3-mini applies to every layer, as in HF.
"""
from __future__ import annotations

from engine.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    packed_modules_mapping: dict = {}  # qkv_proj and gate_up_proj arrive fused
