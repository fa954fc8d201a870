"""Speculative decoding: drafts proposed cheaply (n-gram prompt lookup, a small draft model, or the MTP head a
Qwen3.5/3.6 or Qwen3-Next checkpoint carries), verified by the target in one forward over 1 + k query tokens,
and accepted by the exact rejection rule, so the output distribution is the target's. Config parsing here is
torch-free; the rest runs in the engine.
"""
