"""Doctor measurements that run on a card: peer copies, Triton paged attention against the torch reference
(bf16 and FP8 KV), and the decode speed of a tiny model made on the fly.

Each function takes its device and backend as arguments, so the CPU tests run the same code with the
torch backend; only the GPU decides what the numbers are.
"""
from __future__ import annotations

import contextlib
import time

import torch

from engine.layers.attention import AttentionMetadata
from engine.config.model import ModelConfig

PARITY_LIMIT = 2e-2  # bf16/fp16 outputs of two correct kernels differ by rounding only
# A tiny Llama: 4 layers, GQA 8/2, head_dim 64; big enough to launch every kernel of a decode step.
TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "hidden_size": 512, "num_hidden_layers": 4,
              "num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 1024, "vocab_size": 4096,
              "max_position_embeddings": 2048, "rope_theta": 10000.0, "torch_dtype": "bfloat16"}


def copy_bandwidth(src: str, dst: str, nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """GB/s of device-to-device copies src -> dst (after one warm-up copy)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=src)
    b = torch.empty(nbytes, dtype=torch.uint8, device=dst)
    b.copy_(a)
    _sync(src, dst)
    start = time.perf_counter()
    for _ in range(repeats):
        b.copy_(a)
    _sync(src, dst)
    return nbytes * repeats / (time.perf_counter() - start) / 1e9


def _sync(*devices: str) -> None:
    for d in devices:
        if torch.device(d).type == "cuda":
            torch.cuda.synchronize(d)


def on_card(device: str | torch.device):
    """Make `device` the current card while a check runs on it: Triton launches its kernels on the current
    device, not on the device of their tensors (torch ops do the latter), so a check of cuda:1 from a process
    whose current card is cuda:0 would run cuda:0 kernels on cuda:1 pointers (an illegal address)."""
    device = torch.device(device)
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def attention_parity(device: str, dtype: torch.dtype, cache_dtype: torch.dtype, backend: str = "triton") -> str | None:
    """Write K/V and attend over a mixed batch (prefill chunks and decodes, GQA) with `backend` and with the
    torch reference on the same inputs; None when both agree, else what differs."""
    with on_card(device):
        return _attention_parity(device, dtype, cache_dtype, backend)


def _attention_parity(device: str, dtype: torch.dtype, cache_dtype: torch.dtype, backend: str) -> str | None:
    from kernels import get_attention_backend
    from kernels.paged_batch import make_paged_batch
    batch = make_paged_batch([17, 1, 1, 5], [17, 41, 300, 25], num_kv_heads=2, group=4, head_dim=128,
                             dtype=dtype, cache_dtype=cache_dtype, device=device)
    outputs, caches = [], []
    for name in ("torch", backend):
        write, attend = get_attention_backend(name)
        k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
        write(batch.new_key, batch.new_value, k_cache, v_cache, batch.slot_mapping, batch.k_scale, batch.v_scale)
        outputs.append(attend(batch.query, k_cache, v_cache, batch.block_tables, batch.seq_lens,
                              batch.query_start_loc, 128 ** -0.5, None, batch.k_scale, batch.v_scale))
        caches.append(torch.cat([k_cache.view(torch.uint8), v_cache.view(torch.uint8)]))
    if not torch.equal(caches[0], caches[1]):
        return "the K/V cache write stores different bytes than the torch reference"
    err = float((outputs[0].float() - outputs[1].float()).abs().max())
    return None if err <= PARITY_LIMIT else f"max difference {err:.2e} from the torch reference (> {PARITY_LIMIT})"


def decode_tokens_per_s(device: str, dtype: torch.dtype, backend: str, batch: int = 16, context: int = 256,
                        steps: int = 16, block_size: int = 16) -> float:
    """Greedy-shaped decode steps of a random-weight tiny Llama over a paged KV cache: tokens per second."""
    with on_card(device):
        return _decode_tokens_per_s(device, dtype, backend, batch, context, steps, block_size)


@torch.inference_mode()
def _decode_tokens_per_s(device: str, dtype: torch.dtype, backend: str, batch: int, context: int, steps: int,
                         block_size: int) -> float:
    from engine.models.registry import model_class
    cfg = ModelConfig.from_hf_config(TINY_LLAMA).with_max_model_len(context + steps)
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_class(cfg.architecture)(cfg, backend).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    for p in model.parameters():
        p.normal_(0.0, 0.02)
    blocks_per_seq = -(-(context + steps) // block_size)
    attn = model.attention_layers()
    cache = torch.zeros(len(attn), 2, batch * blocks_per_seq, block_size, attn[0].num_kv_heads, attn[0].head_dim,
                        dtype=dtype, device=device)
    for i, layer in enumerate(attn):
        layer.bind_cache(cache[i, 0], cache[i, 1])
    tables = torch.arange(batch * blocks_per_seq, dtype=torch.int32, device=device).view(batch, blocks_per_seq)
    ids = torch.zeros(batch, dtype=torch.long, device=device)
    start = None
    for step in range(steps + 1):  # step 0 compiles and warms up, untimed
        if step == 1:
            _sync(device)
            start = time.perf_counter()
        pos = torch.full((batch,), context + step - 1, dtype=torch.long, device=device)
        slots = tables[torch.arange(batch, device=device), pos // block_size].long() * block_size + pos % block_size
        meta = AttentionMetadata(slots, tables, (pos + 1).int(), torch.arange(batch + 1, dtype=torch.int32,
                                 device=device), 1, context + step)
        hidden = model(ids, pos, meta)
        ids = model.compute_logits(hidden).argmax(dim=-1)
    _sync(device)
    return batch * steps / (time.perf_counter() - start)
