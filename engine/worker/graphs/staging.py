"""Graph staging: a decode (verify) graph step's token and sequence fields written, padding included, into pinned
host mirrors of the graphs' static buffers, then copied with one non-blocking copy per field.

Without it each field was a tensor made from numpy (pageable memory: a staged copy), a copy of the real rows and a
fill of the padding rows on the device; now a step of n sequences padded to a captured batch issues five copies, and
the views each (n, batch) pair reads are made once (issue 39: every op is a launch on the host's critical path).
Two sets of mirrors alternate on a card, each rewritten only after the copies last issued from it have run
(`CopyFence`), so under async scheduling step N+1's inputs never overwrite a copy still queued for step N, as the
step buffers of the eager path do (engine/worker/step_buffers.py). It fills only these five fields: the block
tables (already on the device), other KV groups' and hybrid state fields stay with the graphs.
"""
from __future__ import annotations

import numpy as np
import torch

from engine.platform.host_copies import CopyFence, host_buffer, pins_host_buffers

# The static buffers' fields staged here, with their host dtypes and what a padding row holds (query_start_loc:
# computed, each padding row starting where the real tokens end).
FIELDS = (("input_ids", np.int64), ("positions", np.int64), ("slot_mapping", np.int64), ("seq_lens", np.int32),
          ("query_start_loc", np.int32))


class GraphStaging:
    def __init__(self, buffers, query_len: int, device: torch.device) -> None:
        """`buffers`: the graphs' StaticBuffers (engine/worker/graphs/decode.py), sized for their largest batch."""
        self.buffers, self.query_len = buffers, query_len
        pin = pins_host_buffers(device)
        self.sets = [([host_buffer(tuple(getattr(buffers, name).shape), dtype, pin) for name, dtype in FIELDS],
                      CopyFence(pin), {}) for _ in range(2 if device.type == "cuda" else 1)]
        self.turn = 0
        self.row_starts = np.arange(buffers.query_start_loc.shape[0], dtype=np.int32) * query_len

    def fill(self, inputs, n: int, batch: int) -> None:
        """Copy the step's n real rows and batch - n padding rows into the static buffers (asynchronously)."""
        hosts, fence, views = self.sets[self.turn]
        self.turn = (self.turn + 1) % len(self.sets)
        step = views.get((n, batch))
        if step is None:
            step = views[n, batch] = self._views(hosts, batch)
        q = self.query_len
        real = n * q
        (ids, _, _), (positions, _, _), (slots, _, _), (seq_lens, _, _), (starts, _, _) = step
        fence.wait()  # these mirrors' last copies must have run before they are rewritten
        ids[:real], ids[real:] = inputs.input_ids, 0
        positions[:real], positions[real:] = inputs.positions, 0
        slots[:real], slots[real:] = inputs.slot_mapping, -1  # padding rows write no KV
        seq_lens[:n], seq_lens[n:] = inputs.seq_lens, q
        # Padding rows hold no tokens: each starts where the real tokens end, so no kernel reads or writes for
        # them (no KV, no linear-attention state: hybrid padding rows never race on their shared padding slot).
        np.minimum(self.row_starts[:batch + 1], real, out=starts)
        for _, host, static in step:
            static.copy_(host, non_blocking=True)
        fence.record()

    def _views(self, hosts, batch: int) -> list[tuple[np.ndarray, torch.Tensor, torch.Tensor]]:
        """Per field: (host numpy, host tensor, static buffer) views over a step padded to `batch` sequences."""
        sizes = (batch * self.query_len,) * 3 + (batch, batch + 1)
        return [(host_np[:size], host[:size], getattr(self.buffers, name)[:size])
                for (host, host_np), (name, _), size in zip(hosts, FIELDS, sizes)]
