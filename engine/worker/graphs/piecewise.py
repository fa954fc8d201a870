"""Piecewise CUDA graphs for steps the decode graphs cannot take (prompt chunks, mixed prefill + decode).

The forward is captured per padded token count (`token_buckets`, up to --max-num-batched-tokens) as a run of graph
pieces split at every *eager point*: each attention layer (its kernels pick tiles per step from the real batch
layout, which a graph would freeze), each Gated DeltaNet layer of a hybrid model (its state update goes through the
step's slot indices, and its prefill kernels take a chunk table built on the host; it runs on the step's real rows
only) and each MoE layer that is not graph-safe (the torch expert loop, off a card, asks the host how many tokens
each expert got; on a card every weight format, packed ones included, runs the Triton kernel, which routes on the
device and is captured inside the pieces). While capturing, an eager point's `forward` is swapped for
`_Capture.boundary`: it allocates the point's output inside the current piece (so it lives in the pieces' shared
memory pool, reused like any activation), ends that piece, runs the point once eagerly, and begins the next piece.
Replay fills the static token buffers (input ids, positions, slots; padding rows get slot -1: no KV write), then
replays piece 0, runs eager point 0 on the tensors piece 0 left at fixed addresses with this step's real attention
metadata, copies its result into the captured output, replays piece 1, and so on. Pure-decode steps keep the
whole-forward decode graphs (engine/worker/graphs/decode.py: one launch instead of one per piece). The graph calls
go through the graph backend (engine/worker/graphs/backend.py): `CudaGraphBackend` on a card; the CPU tests pass a
stand-in (tests/graph_tape.py) that records each piece's aten ops and replays them on the same tensors, with CUDA
graphs' semantics, and finds what a piece cannot contain (a host sync, a host copy, a read of the attention metadata
outside attention) at capture time. A capture that fails raises in strict mode (tests) and otherwise logs one line
and leaves those steps eager.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from engine.distributed.parallel_state import all_reduce
from engine.layers.attention import AttentionMetadata, PagedAttention
from engine.layers.gated_deltanet import GatedDeltaNet
from engine.worker.graphs.backend import CudaGraphBackend

__all__ = ["PiecewiseGraphs", "token_buckets", "CudaGraphBackend", "eager_points", "MIN_BUCKET"]
logger = logging.getLogger("pagedesk.engine")
MIN_BUCKET = 16
STEPS_PER_OCTAVE = 4  # buckets 1.25x apart at most: padding wastes at most 25 % of a step's non-attention work


def token_buckets(max_tokens: int, min_bucket: int = MIN_BUCKET) -> list[int]:
    """Padded token counts to capture: every `min_bucket` up to 4 x `min_bucket`, then STEPS_PER_OCTAVE steps
    per doubling, then max_tokens itself (a step of any size up to the budget finds a bucket)."""
    if max_tokens < 1:
        raise ValueError(f"piecewise CUDA graphs: max_tokens must be >= 1, got {max_tokens}")
    buckets, size = [], min_bucket
    while size < max_tokens:
        buckets.append(size)
        size += min_bucket if size < 4 * min_bucket else (1 << (size.bit_length() - 1)) // STEPS_PER_OCTAVE
    return buckets + [max_tokens]


def eager_points(model) -> list[torch.nn.Module]:
    """The modules that run eagerly between pieces, in model order: every attention layer, every Gated
    DeltaNet layer, and every MoE layer that says it is not graph-safe (`FusedMoE.graph_safe`: the torch
    expert loop off a card syncs with the host; on a card every weight format runs the Triton kernel)."""
    from engine.layers.fused_moe.layer import FusedMoE
    points = []
    for module in model.modules():
        if isinstance(module, (PagedAttention, GatedDeltaNet)):
            points.append(module)
        elif isinstance(module, FusedMoE) and not module.graph_safe:
            points.append(module)
    return points


def _output_like(module: torch.nn.Module, args: tuple) -> torch.Tensor:
    """An empty tensor shaped as the eager point's result: attention returns q's shape, MoE x's."""
    return torch.empty_like(args[0])


# ---- capture and replay ---------------------------------------------------------------------------------------

@dataclass
class _Eager:
    """One eager point of a captured bucket: what to call, on which captured tensors, writing where."""

    module: torch.nn.Module
    forward: Callable
    args: tuple
    kwargs: dict
    out: torch.Tensor


@dataclass
class _Bucket:
    num_tokens: int
    pieces: list = field(default_factory=list)  # graphs: pieces[i] runs before eager[i]
    eager: list[_Eager] = field(default_factory=list)
    output: torch.Tensor | None = None


class _Capture:
    """One bucket's capture: eager points end the current piece, run once, and begin the next."""

    def __init__(self, backend, bucket: _Bucket) -> None:
        self.backend, self.bucket = backend, bucket
        self.graph = None

    def boundary(self, module: torch.nn.Module, forward: Callable, *args, **kwargs) -> torch.Tensor:
        out = _output_like(module, args)  # allocated inside the piece: pool memory, freed when the model drops it
        self.backend.end(self.graph)
        self.bucket.pieces.append(self.graph)
        self.graph = None
        out.copy_(forward(*args, **kwargs))
        keep = self.backend.keep
        self.bucket.eager.append(_Eager(module, forward, tuple(keep(a) if isinstance(a, torch.Tensor) else a
                                                               for a in args),
                                        {k: keep(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()},
                                        keep(out)))
        self.graph = self.backend.begin()
        return out


class PiecewiseGraphs:
    def __init__(self, model, max_tokens: int, device: torch.device, backend=None, strict: bool = False,
                 num_kv_groups: int = 1, min_bucket: int = MIN_BUCKET) -> None:
        self.model, self.device, self.strict = model, device, strict
        self.buckets = token_buckets(max_tokens, min_bucket)
        self.max_tokens = self.buckets[-1]
        if backend is None:
            backend = CudaGraphBackend(device) if device.type == "cuda" else None
        self.backend = backend
        self.enabled = backend is not None
        self.points = eager_points(model)
        self.captured: dict[int, _Bucket] = {}
        self.pool_bytes = 0
        self.replayed_tokens = 0  # real (unpadded) tokens of the steps run through the pieces
        t = self.max_tokens
        with torch.device(device):
            self.input_ids = torch.zeros(t, dtype=torch.long)
            self.positions = torch.zeros(t, dtype=torch.long)
            self.slot_mapping = torch.full((t,), -1, dtype=torch.long)
            self.group_slot_mappings = (torch.full((num_kv_groups - 1, t), -1, dtype=torch.long)
                                        if num_kv_groups > 1 else None)

    @property
    def num_pieces(self) -> int:
        return len(self.points) + 1

    def bucket_for(self, num_tokens: int) -> int | None:
        return next((b for b in self.buckets if b >= num_tokens), None)

    def can_run(self, inputs) -> bool:
        bucket = self.bucket_for(len(inputs.input_ids))
        return bucket is not None and bucket in self.captured

    # ---- capture ----

    def _capture_meta(self, n: int) -> AttentionMetadata:
        """Metadata the eager points see while capturing: n one-token sequences in block 0, no KV writes."""
        with torch.device(self.device):
            meta = AttentionMetadata(self.slot_mapping[:n], torch.zeros(n, 1, dtype=torch.int32),
                                     torch.ones(n, dtype=torch.int32), torch.arange(n + 1, dtype=torch.int32), 1, 1)
        if self.group_slot_mappings is not None:
            meta.group_slot_mappings = self.group_slot_mappings[:, :n]
            meta.group_block_tables = torch.zeros(len(self.group_slot_mappings), n, 1, dtype=torch.int32,
                                                  device=self.device)
        return meta

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (the smaller ones reuse its pool). A failure raises in strict
        mode and otherwise leaves these steps eager with one log line; every tensor-parallel rank agrees."""
        if not self.enabled:
            return
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.empty_cache()
            before = torch.cuda.memory_reserved(self.device)
        self.slot_mapping.fill_(-1)
        self.backend.start()
        try:
            for n in reversed(self.buckets):
                self._capture_bucket(n)
        except Exception as e:  # noqa: BLE001 - a capture error means "run these steps eagerly"
            self.captured.clear()
            self.enabled = False
            if cuda:
                torch.cuda.synchronize(self.device)
            if self.strict:
                raise
            logger.warning("piecewise CUDA graph capture failed (%s: %s); prompt and mixed steps run eagerly "
                           "(slower, same results)", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            return
        self.backend.finish()
        if cuda:
            torch.cuda.empty_cache()
            self.pool_bytes = torch.cuda.memory_reserved(self.device) - before
        logger.info("captured piecewise CUDA graphs: %d token buckets (%d-%d) x %d pieces, %.0f MiB",
                    len(self.buckets), self.buckets[0], self.buckets[-1], self.num_pieces, self.pool_bytes / 2**20)

    def _capture_bucket(self, n: int) -> None:
        meta = self._capture_meta(n)
        self.backend.watch_bucket(meta)
        ids, pos = self.input_ids[:n], self.positions[:n]
        self.model(ids, pos, meta)  # warm-up outside any capture (kernels compile, lazy buffers appear)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        bucket, error = _Bucket(n), None
        capture = _Capture(self.backend, bucket)
        saved = {id(m): m.__dict__.get("forward") for m in self.points}
        for module in self.points:  # an instance attribute shadows the class's forward for this capture only
            module.forward = _bound_boundary(capture, module, type(module).forward.__get__(module))
        try:
            with self.backend.capturing():
                capture.graph = self.backend.begin()
                try:
                    bucket.output = self.backend.keep(self.model(ids, pos, meta))
                    self.backend.end(capture.graph)
                    bucket.pieces.append(capture.graph)
                    capture.graph = None
                finally:
                    if capture.graph is not None:
                        self.backend.abort(capture.graph)
        except Exception as e:  # noqa: BLE001 - decided together with the other ranks just below
            error = e
        finally:
            for module in self.points:
                if saved[id(module)] is None:
                    del module.forward
                else:
                    module.forward = saved[id(module)]
        failed = all_reduce(torch.tensor([error is not None], dtype=torch.int32, device=self.device))
        if error is not None:
            raise error
        if int(failed.item()):
            raise RuntimeError("another tensor-parallel rank could not capture this piecewise graph")
        self.captured[n] = bucket

    # ---- replay ----

    def run(self, inputs, meta: AttentionMetadata, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden]`` of any step up to the budget: the pieces replayed in order,
        the eager points run between them with `meta` (the step's own; its slots are padded here); `input_ids`:
        the ids already on the device (async scheduling), else copied from `inputs`."""
        n = len(inputs.input_ids)
        bucket = self.captured[self.bucket_for(n)]
        t = bucket.num_tokens
        self._fill(inputs, n, t, input_ids)
        meta.slot_mapping = self.slot_mapping[:t]
        if self.group_slot_mappings is not None and meta.group_slot_mappings is not None:
            meta.group_slot_mappings = self.group_slot_mappings[:, :t]
        for i, piece in enumerate(bucket.pieces):
            self.backend.replay(piece)
            if i < len(bucket.eager):
                point = bucket.eager[i]
                args = tuple(meta if isinstance(a, AttentionMetadata) else a for a in point.args)
                if t > n and isinstance(point.module, GatedDeltaNet):  # its kernels take exactly the real rows
                    args = tuple(a[:n] if isinstance(a, torch.Tensor) else a for a in args)
                    point.out[:n].copy_(point.forward(*args, **point.kwargs))
                else:
                    point.out.copy_(point.forward(*args, **point.kwargs))
                if t > n:
                    point.out[n:].zero_()  # padding rows: kept finite whatever the kernel left there
        self.replayed_tokens += n
        return bucket.output[:n]

    def _fill(self, inputs, n: int, t: int, input_ids: torch.Tensor | None = None) -> None:
        self.input_ids[:n].copy_(torch.as_tensor(inputs.input_ids) if input_ids is None else input_ids,
                                 non_blocking=True)
        self.positions[:n].copy_(torch.as_tensor(inputs.positions), non_blocking=True)
        self.slot_mapping[:n].copy_(torch.as_tensor(inputs.slot_mapping), non_blocking=True)
        if t > n:  # padding rows: token 0 at position 0, no KV write, output discarded
            self.input_ids[n:t] = 0
            self.positions[n:t] = 0
            self.slot_mapping[n:t] = -1
        if self.group_slot_mappings is not None and inputs.group_slot_mappings is not None:
            self.group_slot_mappings[:, :n].copy_(torch.as_tensor(inputs.group_slot_mappings), non_blocking=True)
            self.group_slot_mappings[:, n:t] = -1


def _bound_boundary(capture: _Capture, module: torch.nn.Module, forward: Callable) -> Callable:
    def boundary(*args: Any, **kwargs: Any) -> torch.Tensor:
        return capture.boundary(module, forward, *args, **kwargs)
    return boundary
