"""Batch-1 decode step of real model shapes against its memory floor, for kernels/bench.py.

One step = for every layer the q/k/v/o/gate/up/down matmuls (cuBLAS, random weights scaled to keep
values finite), our KV write of the new token and our decode attention over ``context`` cached tokens;
then lm_head. Norms, RoPE, activations and embeddings are left out (elementwise, negligible bytes).
Distinct layer copies are cycled so weights stream from DRAM as in a real model. The floor is
(weight bytes + KV bytes read) / measured copy bandwidth. Timed eager and replayed as a CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.bench_timing import l2_bytes, markdown_table, median_ms, rotations_for


@dataclass(frozen=True, slots=True)
class ModelShape:
    name: str
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    num_layers: int
    vocab: int

    def layer_weight_elements(self) -> int:
        q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return self.hidden * (2 * q_out + 2 * kv_out) + 3 * self.hidden * self.intermediate


MODEL_SHAPES = {
    "qwen2.5-0.5b": ModelShape("Qwen2.5-0.5B", 896, 14, 2, 64, 4864, 24, 151936),
    "llama-3-8b": ModelShape("Llama-3-8B", 4096, 32, 8, 128, 14336, 32, 128256),
}
TINY_MODEL = ModelShape("tiny (smoke)", 64, 4, 2, 16, 128, 2, 256)


@dataclass(slots=True)
class Layer:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor


@dataclass(slots=True)
class DecodeMeta:
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor


def _weight(out_features: int, in_features: int, device, dtype) -> torch.Tensor:
    return (torch.randn(out_features, in_features, device=device) * in_features ** -0.5).to(dtype)


def make_layer(shape: ModelShape, context: int, device, dtype, block_size: int = 16) -> Layer:
    num_blocks = context // block_size + 1
    cache = (num_blocks, block_size, shape.num_kv_heads, shape.head_dim)
    q_out, kv_out = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    return Layer(q=_weight(q_out, shape.hidden, device, dtype), k=_weight(kv_out, shape.hidden, device, dtype),
                 v=_weight(kv_out, shape.hidden, device, dtype), o=_weight(shape.hidden, q_out, device, dtype),
                 gate=_weight(shape.intermediate, shape.hidden, device, dtype),
                 up=_weight(shape.intermediate, shape.hidden, device, dtype),
                 down=_weight(shape.hidden, shape.intermediate, device, dtype),
                 k_cache=torch.randn(cache, device=device).to(dtype),
                 v_cache=torch.randn(cache, device=device).to(dtype))


def make_meta(context: int, device, block_size: int = 16) -> DecodeMeta:
    """One sequence with `context` cached tokens decoding token number context + 1."""
    num_blocks = context // block_size + 1
    block_table = torch.randperm(num_blocks, device=device)
    slot = block_table[context // block_size] * block_size + context % block_size
    return DecodeMeta(slot_mapping=slot.reshape(1),
                      block_tables=block_table.to(torch.int32)[None, :],
                      seq_lens=torch.tensor([context + 1], dtype=torch.int32, device=device),
                      query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=device))


def decode_step(backend, shape: ModelShape, layers: list[Layer], lm_head: torch.Tensor, x: torch.Tensor,
                meta: DecodeMeta) -> torch.Tensor:
    write_kv, attention = backend
    scale = shape.head_dim ** -0.5
    h = x
    for i in range(shape.num_layers):
        w = layers[i % len(layers)]
        q = F.linear(h, w.q).view(1, shape.num_heads, shape.head_dim)
        k = F.linear(h, w.k).view(1, shape.num_kv_heads, shape.head_dim)
        v = F.linear(h, w.v).view(1, shape.num_kv_heads, shape.head_dim)
        write_kv(k, v, w.k_cache, w.v_cache, meta.slot_mapping)
        a = attention(q, w.k_cache, w.v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale)
        h = F.linear(a.view(1, -1), w.o)
        h = F.linear(F.linear(h, w.gate) * F.linear(h, w.up), w.down)
    return F.linear(h, lm_head)


def floor_bytes(shape: ModelShape, context: int, dtype: torch.dtype) -> tuple[float, float]:
    """(weight bytes incl. lm_head, KV bytes read by attention) of one decode step."""
    weights = (shape.num_layers * shape.layer_weight_elements() + shape.vocab * shape.hidden) * dtype.itemsize
    kv = shape.num_layers * (context + 1) * shape.num_kv_heads * shape.head_dim * 2 * dtype.itemsize
    return weights, kv


def time_graph(step, device, iters: int) -> str:
    if device.type != "cuda":
        return "-"
    try:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(3):
                step()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        return f"{median_ms(lambda _: graph.replay(), 1, device, iters):.3f}"
    except Exception as exc:  # a benchmark row, not a crash: say why the graph is missing
        return f"n/a ({type(exc).__name__}: {str(exc)[:60]})"


def bench_one_model(backend, shape: ModelShape, device, dtype, context: int, copy_bw: float, iters: int) -> list[str]:
    layer_bytes = shape.layer_weight_elements() * dtype.itemsize
    copies = min(shape.num_layers, rotations_for(layer_bytes, l2_bytes(device)))
    layers = [make_layer(shape, context, device, dtype) for _ in range(copies)]
    lm_head = _weight(shape.vocab, shape.hidden, device, dtype)
    x = torch.randn(1, shape.hidden, device=device).to(dtype)
    meta = make_meta(context, device)

    def step():
        return decode_step(backend, shape, layers, lm_head, x, meta)

    eager = median_ms(lambda _: step(), 1, device, iters, keep_gpu_busy=False)
    graph = time_graph(step, device, iters)
    weights, kv = floor_bytes(shape, context, dtype)
    floor_ms = (weights + kv) / copy_bw * 1e3
    best = min(eager, float(graph)) if graph.replace(".", "", 1).isdigit() else eager
    return [shape.name, str(shape.num_layers), f"{weights / 1e6:.0f}", f"{kv / 1e6:.1f}", f"{floor_ms:.3f}",
            f"{eager:.3f}", graph, f"{100 * floor_ms / best:.0f}%"]


def bench_model_decode(backend, shapes: list[ModelShape], device, dtype, context: int, copy_bw: float,
                       iters: int) -> str:
    rows = []
    for shape in shapes:
        rows.append(bench_one_model(backend, shape, device, dtype, context, copy_bw, iters))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    header = ["batch-1 decode", "layers", "weights MB", f"KV MB (ctx {context})", "floor ms", "eager ms",
              "graph ms", "floor / best"]
    return markdown_table(header, rows)
