"""The Phi-3 family (Phi-3, Phi-3.5, Phi-4, Phi-4-mini): the Llama decoder with fused checkpoint tensors.

The checkpoint stores `qkv_proj` and `gate_up_proj` already stacked, so nothing is packed on the way in: each
fused tensor reaches its layer with shard id None and the layer splits it into its q/k/v (gate/up) shards
(engine/layers/linear.py), every shard counted. LongRoPE and Phi-4-mini's partial rotary come from the RoPE
factory; the sliding window of Phi-3-mini applies to every layer, as in HF. llama.cpp's `phi3` GGUF keeps the
same fusion (attn_qkv, ffn_up holding gate and up) and writes LongRoPE's factors as two tensors, which
engine/config/gguf_config.py reads into the config.
"""
from __future__ import annotations

from engine.models.llama import LlamaForCausalLM
from engine.models.weights import GgufNames

PHI3_GGUF_NAMES = GgufNames(
    {"attn_norm": "input_layernorm", "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
     "ffn_norm": "post_attention_layernorm", "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj"},
    skipped=("rope_factors_long.weight", "rope_factors_short.weight"))


class Phi3ForCausalLM(LlamaForCausalLM):
    packed_modules_mapping: dict = {}  # qkv_proj and gate_up_proj arrive fused
    gguf_names = {"phi3": PHI3_GGUF_NAMES}
