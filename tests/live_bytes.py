"""LiveBytes: a memory meter for CPU tests, playing torch.cuda's max_memory_allocated for tensors made under it.

A TorchDispatchMode that sees every aten op's outputs: a new storage counts from the op that makes it
until the last tensor on it is garbage (a weakref finalizer per tensor object); in-place results and views
of tensors made before the meter was on are not counted. Temporaries a kernel makes inside itself are
invisible, as they are to a test that compares two steps built from the same ops.
"""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._refs: dict[int, list[int]] = {}  # storage data_ptr -> [tensor objects on it, its bytes]

    def _drop(self, key: int) -> None:
        entry = self._refs[key]
        entry[0] -= 1
        if not entry[0]:
            self.live -= self._refs.pop(key)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in self._refs:
                self._refs[key][0] += 1
            elif key in inputs or not storage.nbytes():
                continue  # in place on, or a view of, something made before the meter
            else:
                self._refs[key] = [1, storage.nbytes()]
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._drop, key)
        return out
