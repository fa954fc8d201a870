"""The graph backend: how the decode graphs and the piecewise pieces capture and replay, behind nine small calls.

`start` (once per set: the memory pool), `graph` (a context that captures a whole forward into one graph: the decode
and verify graphs), `capturing` / `begin` / `end` / `abort` (pieces begun and ended in the middle of a forward, on
one side stream: the piecewise graphs), `finish` (after the set), `replay`, `keep` (a non-owning view of a tensor
that crosses pieces) and `watch_bucket` (what a piece may not read). `CudaGraphBackend` is torch.cuda.CUDAGraph on a
card, every graph of a set in one pool. The CPU tests pass their own backend with the same calls
(tests/graph_tape.py: it records each graph's aten ops, replays them on the same tensors, and refuses at capture
what a card would refuse), so the capture code the engine runs on a card is the code the tests run on CPU. Never
used without a card in production: with no backend the graphs run their padded buffers eagerly.
"""
from __future__ import annotations

import contextlib

import torch

from engine.layers.attention import AttentionMetadata


class CudaGraphBackend:
    """torch.cuda.CUDAGraph graphs, all of one set in one memory pool."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = None
        self.stream = None  # the pieces' side stream, made by their first `capturing`

    def start(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()

    def watch_bucket(self, meta: AttentionMetadata) -> None:
        """A CUDA graph cannot watch what its pieces read; a backend that can (the CPU tape in tests) refuses a
        piece that reads `meta`'s batch layout."""

    @contextlib.contextmanager
    def graph(self):
        """Capture the body (a whole forward) into one graph, yielded; torch.cuda.graph's own capture stream."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            yield graph

    def capturing(self):
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self.stream)

    def begin(self):
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool)
        return graph

    def end(self, graph) -> None:
        graph.capture_end()

    def abort(self, graph) -> None:
        try:
            graph.capture_end()  # ends the stream's capture state; the graph is dropped
        except Exception:  # noqa: BLE001 - the capture already broke; only its state must be cleared
            pass

    def finish(self) -> None:
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        torch.cuda.synchronize(self.device)

    @staticmethod
    def replay(graph) -> None:
        graph.replay()

    @staticmethod
    def keep(t: torch.Tensor) -> torch.Tensor:
        """A view of `t` that does not own its memory. Holding the tensors that cross pieces (an attention's q,
        k, v and output, the bucket's result) strongly would keep every layer's and every bucket's in the
        pool for good, about one forward's activations per layer; held this way the pool reuses them the way
        the capture did, which replays correctly because the pieces of a bucket always replay in capture
        order and rewrite each tensor before reading it (the private pool serves only captures, so nothing
        else is ever given that memory). The approach of torch's cudagraph trees and vLLM's weak refs."""
        storage = torch._C._construct_storage_from_data_pointer(
            t.untyped_storage().data_ptr(), t.device, t.untyped_storage().nbytes())
        return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, t.storage_offset(), t.size(), t.stride())
