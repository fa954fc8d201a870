"""The CPU decode forward's torch ops (issue 39): what is the same for every layer is done once per forward (the RoPE
gather, the attention kernel's host arrays, the KV write's slot check), no cast is a no-op, and the ops that replaced
longer chains compute the same numbers bit for bit."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.bench.forward_ops import count_forward_ops
from engine.layers.rotary import RotaryEmbedding
from kernels.attention_torch import write_kv_cache_torch

ONCE_PER_FORWARD = ("embedding", "index", "neg", "ge", "all", "is_nonzero")  # RoPE gather, slot check


@pytest.fixture(scope="module")
def decode_ops(llama_dir):
    """Torch ops of one batch-1 decode forward of the tiny (2-layer) Llama."""
    engine = LLM(str(llama_dir), device="cpu").engine
    engine.add_request("r", [5, 6, 7, 8, 9], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine.step()  # the prompt
    ops = count_forward_ops(engine, 2)
    ropes = [m for m in engine.runner.model.modules() if isinstance(m, RotaryEmbedding)]
    assert ropes and all(rope.step is None for rope in ropes)  # the forward's cos/sin are dropped after it
    return ops


def test_per_forward_work_is_done_once_not_per_layer(decode_ops):
    for name in ONCE_PER_FORWARD:
        assert decode_ops[name] == 1, name
    assert decode_ops["roll"] == 4  # q and k of each layer: the rotation's only per-layer op besides mul/add


def test_no_cast_is_a_no_op(decode_ops):
    """Every `to` left is one of a numpy conversion's (detach, to, resolve_conj, resolve_neg) for the numba
    kernels; no float32 tensor is cast to float32 in the forward."""
    assert decode_ops["to"] == decode_ops["detach"]


def test_rotation_is_the_rotate_half_formula_bit_for_bit():
    torch.manual_seed(0)
    rope = RotaryEmbedding(64, 128, rotary_dim=48)  # partial rotary: 16 dims pass through
    positions = torch.tensor([0, 3, 17, 127])
    q, k = torch.randn(4, 4, 64), torch.randn(4, 2, 64)
    cos, sin = rope.cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)

    def rotate_half(x):
        x1, x2 = x[..., :24], x[..., 24:48]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., 48:]], dim=-1)

    got_q, got_k = rope(positions, q, k)
    assert torch.equal(got_q, rotate_half(q)) and torch.equal(got_k, rotate_half(k))
    rope.begin_step(positions)  # the forward's gather: read by its own positions tensor only
    assert rope.cos_sin_at(positions)[0] is rope.step[1]
    assert rope.cos_sin_at(positions.clone())[0] is not rope.step[1]
    rope.end_step()


def test_a_checked_kv_write_stores_what_the_checking_one_does():
    torch.manual_seed(1)
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    slots = torch.tensor([5, 0, 9])
    caches = [torch.zeros(2, 8, 2, 8) for _ in range(4)]
    write_kv_cache_torch(key, value, caches[0], caches[1], slots.int())
    write_kv_cache_torch(key, value, caches[2], caches[3], slots, checked=True)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
