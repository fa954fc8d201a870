"""Step buffers: the eager and piecewise paths' per-step input tensors (input ids, positions, slot mappings,
sequence lengths, query start offsets) written in place into persistent buffers, not made anew each step, and
the step's attention metadata around them.

Each field has a host buffer (pinned on a card) and a device buffer: on the CPU they are one tensor, and the views
of each step shape are made once, so a decode step makes no tensor at all (issue 39: a torch op costs a batch-1
step more than its numpy write); on a card the host buffer is copied non-blocking into the device buffer, and two
sets of buffers alternate, each rewritten only after the copies last issued from it have run (`CopyFence`), so
under async scheduling a copy still queued for step N is never overwritten by step N+1's inputs. A field longer
than its buffer grows it. What only some steps carry (a hybrid model's state slots, image key limits) is copied as
it is. It decides nothing about which path a step takes (engine/worker/graphs/dispatch.py).
"""
from __future__ import annotations

import numpy as np
import torch

from engine.layers.attention import AttentionMetadata
from engine.platform.host_copies import CopyFence, host_buffer, pins_host_buffers, to_device
from engine.worker.step_inputs import StepInputs
from kernels.gated_delta_chunks import ChunkTable, chunk_arrays

FIRST_CAPACITY = 256  # elements per field at first; a longer step doubles it
MAX_VIEWS = 64  # step shapes whose views a set keeps (decode batch sizes repeat; prompt chunks rarely do)
# The fields, in `StepBuffers.load`'s order: a sliding-window model's other groups' slot mappings come last.
FIELD_DTYPES = (np.int64, np.int64, np.int64, np.int32, np.int32, np.int64)


class _BufferSet:
    """One flat host buffer (pinned on a card) and device buffer per field, the fence behind the copies last
    issued from them, and per step shape the views such a step reads: a [rows, n] field (mRoPE's positions,
    other groups' slot mappings) is its buffer's first rows * n elements, contiguous, so one copy moves it."""

    __slots__ = ("device", "pin", "buffers", "views", "fence")

    def __init__(self, device: torch.device, pin: bool) -> None:
        self.device, self.pin = device, pin
        self.buffers: list[tuple[torch.Tensor, np.ndarray, torch.Tensor] | None] = [None] * len(FIELD_DTYPES)
        self.views: dict[tuple, list[tuple]] = {}
        self.fence = CopyFence(pin)

    def make_views(self, key: tuple, arrays: tuple[np.ndarray, ...]) -> list[tuple]:
        """(host numpy, host tensor, device tensor, device tensor shaped as the array) per array, the buffers grown
        first where an array does not fit."""
        for i, values in enumerate(arrays):
            if self.buffers[i] is None or values.size > len(self.buffers[i][0]):
                self._allocate(i, values.size)
        if len(self.views) >= MAX_VIEWS:
            self.views.clear()
        views = []
        for (host, host_np, device), values in zip(self.buffers, arrays):
            size = values.size
            host_part = host[:size]
            device_part = host_part if device is host else device[:size]
            views.append((host_np[:size].reshape(values.shape), host_part, device_part,
                          device_part.view(values.shape)))
        self.views[key] = views
        return views

    def _allocate(self, field: int, size: int) -> None:
        capacity = max(FIRST_CAPACITY, 1 << (size - 1).bit_length())
        host, host_np = host_buffer((capacity,), FIELD_DTYPES[field], self.pin)
        device = host if self.device.type == "cpu" else torch.empty(capacity, dtype=host.dtype, device=self.device)
        self.buffers[field] = (host, host_np, device)
        self.views.clear()  # views of the old buffers


class StepBuffers:
    """A runner's persistent step inputs: `load` turns a step's `StepInputs` into its device tensors."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        pin = pins_host_buffers(device)
        # Two sets on a card (a queued copy may still read pinned memory), one on the CPU (nothing is queued).
        self.sets = [_BufferSet(device, pin) for _ in range(2 if device.type == "cuda" else 1)]
        self.turn = 0
        # The block tables the last step read, with their first group's plane and the others': the input batch
        # hands back the same tensor while no table changed, so decode after decode selects no plane.
        self.tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None

    def load(self, inputs: StepInputs, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The step's input ids, positions and attention metadata on the device (`tables`: its block tables
        there), every host -> device copy issued, none waited for."""
        if self.tables is None or self.tables[0] is not tables:
            self.tables = (tables, tables[0], tables[1:] if len(tables) > 1 else None)
        _, first_group, other_groups = self.tables
        groups = inputs.group_slot_mappings
        arrays = (inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.seq_lens, inputs.query_start_loc)
        if groups is not None:
            arrays += (groups,)
        key = (len(inputs.input_ids), len(inputs.seq_lens), inputs.positions.ndim, 0 if groups is None else len(groups))
        buffers = self.sets[self.turn]
        self.turn = (self.turn + 1) % len(self.sets)
        views = buffers.views.get(key) or buffers.make_views(key, arrays)
        buffers.fence.wait()  # the copies these host buffers last fed must have run before they are rewritten
        for (host_np, host, device, _), values in zip(views, arrays):
            host_np[...] = values
            if device is not host:
                device.copy_(host, non_blocking=True)
        buffers.fence.record()
        meta = AttentionMetadata(
            slot_mapping=views[2][3], block_tables=first_group, seq_lens=views[3][3], query_start_loc=views[4][3],
            max_query_len=inputs.max_query_len, max_seq_len=inputs.max_seq_len)
        if groups is not None:
            meta.group_block_tables, meta.group_slot_mappings = other_groups, views[5][3]
        if inputs.key_limits is not None or inputs.state_indices is not None or inputs.state_read_only is not None:
            occasional_metadata(meta, inputs, self.device)
        return views[0][3], views[1][3], meta


def occasional_metadata(meta: AttentionMetadata, inputs: StepInputs, dev: torch.device) -> None:
    """The metadata only some steps carry, copied as it is: image key limits, a hybrid model's state slots (and
    its prefill rows' chunk table), speculative verify rows' read-only states."""
    if inputs.key_limits is not None:
        meta.key_limits = to_device(torch.from_numpy(inputs.key_limits), dev)
    if inputs.state_indices is not None:
        meta.state_indices = to_device(torch.from_numpy(inputs.state_indices), dev)
        meta.has_initial_state = to_device(torch.from_numpy(inputs.has_initial_state), dev)
        if inputs.max_query_len > 1:  # prefill rows: the DeltaNet layers' chunk table, once for all of them
            meta.deltanet_chunks = ChunkTable(*(to_device(torch.from_numpy(a), dev)
                                                for a in chunk_arrays(inputs.query_start_loc)))
    if inputs.state_read_only is not None:
        meta.state_read_only = to_device(torch.from_numpy(inputs.state_read_only), dev)
        meta.verify_token_rows = to_device(torch.from_numpy(inputs.verify_token_rows), dev)
