"""A CPU stand-in for CUDA graphs, for the piecewise graphs' tests (engine/worker/graphs/piecewise.py).

`TapeGraphBackend` is a graph backend whose "graph" is the list of aten ops a piece ran: replay runs them again
on the very same tensors and writes each op's result into the tensor it produced at capture, which gives CUDA
graphs' semantics (fixed addresses, Python values frozen at capture). It also finds at capture time what a
piece cannot contain: a host sync, or a read of the bucket's attention metadata outside attention
(`PieceCaptureError`). Production never uses it: on a card the pieces are real CUDA graphs.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from engine.layers.attention import AttentionMetadata

# Ops a captured piece cannot contain: each copies a value to the host (or sizes a tensor by data).
# bincount is one on CUDA (it sizes its output by the largest value, read on the host) though not on CPU.
HOST_SYNC_OPS = frozenset({"aten::_local_scalar_dense", "aten::nonzero", "aten::item", "aten::unique_consecutive",
                           "aten::_unique2", "aten::masked_select", "aten::equal", "aten::is_nonzero",
                           "aten::bincount", "aten::histc"})


class PieceCaptureError(RuntimeError):
    """Something in a piece cannot be captured (a host sync, metadata read outside attention)."""


class _Tape(TorchDispatchMode):
    """Records the aten ops of one piece; refuses host syncs and reads of the attention metadata."""

    def __init__(self, forbidden_storages: set[int]) -> None:
        super().__init__()
        self.ops: list[tuple] = []
        self.forbidden = forbidden_storages

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name in HOST_SYNC_OPS:
            raise PieceCaptureError(f"{name} in a graph piece: it needs the value on the host (a host sync), "
                                    "which a CUDA graph cannot replay")
        inputs = {_storage(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        if inputs & self.forbidden:
            raise PieceCaptureError(f"{name} in a graph piece reads the attention metadata (block tables, "
                                    "sequence lengths): only the eager attention may, since a piece keeps "
                                    "the shapes and values of its capture")
        out = func(*args, **kwargs)
        # Whether the result aliases an input is decided on the tensors, not the schema: aten::to and reshape
        # may return a view or a new tensor, and the schema marks both as possible views.
        fresh = not any(_storage(t) in inputs for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        self.ops.append((func, args, kwargs, out, fresh))
        return out


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr() if t.device.type != "meta" else id(t)


def _mutates(func) -> bool:
    return any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)


class TapeGraphBackend:
    """CPU stand-in for CUDA graphs: a 'graph' is the list of aten ops a piece ran; replay runs them again on
    the very same tensors and writes each op's result into the tensor it produced at capture."""

    def __init__(self) -> None:
        self.forbidden: set[int] = set()
        self.replays = 0  # pieces replayed (tests count them)

    def start(self) -> None:
        pass

    def watch_bucket(self, meta: AttentionMetadata) -> None:
        """No piece of this bucket may read its batch layout: only the eager attention may."""
        self.forbidden = {_storage(t) for t in (meta.block_tables, meta.seq_lens, meta.query_start_loc)}

    def capturing(self):
        return torch.inference_mode()

    def begin(self):
        tape = _Tape(self.forbidden)
        tape.__enter__()
        return tape

    def end(self, tape) -> None:
        tape.__exit__(None, None, None)

    abort = end

    def finish(self) -> None:
        pass

    @staticmethod
    def keep(t: torch.Tensor) -> torch.Tensor:
        return t  # the tape holds every tensor of its ops anyway; CPU memory is not the question here

    def replay(self, tape) -> None:
        self.replays += 1
        for func, args, kwargs, out, fresh in tape.ops:
            if _mutates(func):  # in-place and out= ops: their effect is the point
                func(*args, **kwargs)
            elif fresh:  # a new tensor at capture: recompute, write it where later ops read it
                result = func(*args, **kwargs)
                for dst, src in zip(tree_flatten(out)[0], tree_flatten(result)[0]):
                    if isinstance(dst, torch.Tensor):
                        dst.copy_(src)
            # else a view of an input: it already shows the input's new values
