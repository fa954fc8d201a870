"""InputBatch: the running sequences' block tables kept in preallocated buffers, updated by what changed.

Each sequence scheduled in a step owns a row (slot) of a `[num_groups, max_rows, max_blocks]` int32 table, one
plane per KV cache group, on the host (pinned on CUDA, so the copy to the device is truly asynchronous) and
mirrored on the device (a `CopyFence` keeps a host write from overtaking a queued copy; on the CPU the host
tables are the device's). A step only writes what changed since the last step: a joining sequence's whole
tables, a growing sequence's appended block ids, and entries its KV manager edited in place (a copy-on-write
block, window blocks turned NULL_BLOCK, a freed table), which the managers mark on the sequence with
`Sequence.mark_table_edit`. Those writes are the step's `BatchDiff`: rank 0 applies it while preparing and
ships only it to tensor-parallel workers, which apply it to their own mirror (`apply`). The dirty cells are
copied host -> device with `non_blocking=True` before the forward (`commit`), and a step's `[num_seqs, width]`
tables are gathered on the device from the rows its sequences own.

Rows: a sequence keeps its row while it is scheduled step after step; a sequence absent from a step (finished,
preempted, paused, waiting its turn for a chunk) leaves and its row is freed. Holes are kept, not condensed:
a joining sequence takes the lowest free row, so rows stay dense in practice, and since the step's order is
the scheduler's (a gather picks the rows), no row ever has to move.

Per-row fields beyond the tables are extension points: `num_computed` (the position of the row's first new
token this step), `query_lens` (new tokens this step: any count, a decode's 1 + k speculative tokens
included) and `state_slots` (a hybrid model's recurrent-state slot per row; -1: none) are written every
step from the scheduled batch.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.platform.host_copies import CopyFence, host_buffer, pins_host_buffers, to_device

FIRST_ROWS = 16  # rows allocated before the first step; doubled whenever a step needs more


@dataclass(slots=True)
class TableWrite:
    """Entries [start, start + len(block_ids)) of `row`'s table in `group` now hold these block ids; entries
    past them are zero (a table only shrinks when it is rewritten from its start)."""

    row: int
    group: int
    start: int
    block_ids: np.ndarray  # int32
    truncate: bool = False  # zero the row from start + len(block_ids) on (a rewrite)


@dataclass(slots=True)
class BatchDiff:
    """One step's changes to the persistent tables: what a tensor-parallel worker needs to follow rank 0."""

    step: int  # rank 0's step counter: a mirror applies each diff once, in order
    num_rows: int  # rows allocated (a mirror grows to match)
    writes: list[TableWrite] = field(default_factory=list)
    freed_rows: list[int] = field(default_factory=list)

    @property
    def num_written(self) -> int:
        return sum(len(w.block_ids) for w in self.writes)


class InputBatch:
    def __init__(self, num_groups: int, max_blocks: int, device: torch.device) -> None:
        self.num_groups, self.max_blocks, self.device = num_groups, max_blocks, device
        self.pin = pins_host_buffers(device)
        self.step = 0  # diffs made (rank 0) or applied (a mirror)
        self.rows: dict[int, int] = {}  # seq_id -> row
        self.free_rows: list[int] = []  # heap: the lowest hole first
        self.num_rows = 0
        # Per row: the table list objects last seen (a new list means a fork or a fresh table: rewrite) and
        # how many entries of each group are known to be written.
        self.table_refs: list[list | None] = []
        self.num_blocks = np.zeros((num_groups, 0), dtype=np.int64)
        self.num_computed = np.zeros(0, dtype=np.int64)
        self.query_lens = np.zeros(0, dtype=np.int64)
        self.state_slots = np.zeros(0, dtype=np.int64)
        self.host: torch.Tensor = torch.zeros(0)
        self.host_np = np.zeros((num_groups, 0, max_blocks), dtype=np.int32)
        self.device_tables: torch.Tensor = torch.zeros(0)
        self.dirty: list[tuple[int, int, int, int]] = []  # (group, row, start, stop) not yet on the device
        self.fence = CopyFence(self.pin)  # the host tables' last copy to the device
        # The last gather (rows' bytes, width, tables): a step whose rows, width and device tables are those of
        # the last one (a decode between two new blocks) reuses it, no op at all; a commit or a grow drops it.
        self.last_gather: tuple[bytes, int, torch.Tensor] | None = None
        self._grow(FIRST_ROWS)

    # ---- rows -----------------------------------------------------------------------------------------

    def _grow(self, num_rows: int) -> None:
        """Reallocate every buffer for `num_rows` rows, keeping what the old ones held."""
        old = self.num_rows
        host, host_np = host_buffer((self.num_groups, num_rows, self.max_blocks), np.int32, self.pin)
        host_np[:, :old] = self.host_np[:, :old]
        self.host, self.host_np = host, host_np
        if self.device.type == "cpu":  # the host tables are the device's: a commit has nothing to copy
            device_tables = host
        else:
            device_tables = torch.zeros((self.num_groups, num_rows, self.max_blocks), dtype=torch.int32,
                                        device=self.device)
            if old:
                device_tables[:, :old].copy_(self.device_tables[:, :old])
        self.device_tables, self.last_gather = device_tables, None
        self.table_refs += [None] * (num_rows - old)
        self.num_blocks = np.concatenate([self.num_blocks, np.zeros((self.num_groups, num_rows - old), np.int64)], 1)
        for name in ("num_computed", "query_lens"):
            setattr(self, name, np.concatenate([getattr(self, name), np.zeros(num_rows - old, np.int64)]))
        self.state_slots = np.concatenate([self.state_slots, np.full(num_rows - old, -1, np.int64)])
        for row in range(old, num_rows):
            heapq.heappush(self.free_rows, row)
        self.num_rows = num_rows

    def reserve(self, num_rows: int) -> None:
        """Allocate `num_rows` rows now (max_num_seqs, before the KV cache is sized around what is left)."""
        if num_rows > self.num_rows:
            self._grow(num_rows)

    def _take_row(self) -> int:
        if not self.free_rows:
            self._grow(self.num_rows * 2)
        return heapq.heappop(self.free_rows)

    def _free_row(self, row: int) -> None:
        """A left sequence's row is zeroed (so a gathered table never shows a stale id) and reused lowest first."""
        end = int(self.num_blocks[:, row].max())
        if end:
            self.host_np[:, row, :end] = 0
            self.dirty.append((-1, row, 0, end))
        self.table_refs[row] = None
        self.num_blocks[:, row] = 0
        self.state_slots[row] = -1
        heapq.heappush(self.free_rows, row)

    # ---- rank 0: follow the scheduled batch -------------------------------------------------------------

    def update(self, batch) -> tuple[np.ndarray, BatchDiff]:
        """Rows of this step's sequences (in batch order) and the diff that brought the tables up to date.
        `batch`: ScheduledSeq items (engine/core/scheduler.py)."""
        self.step += 1
        self.fence.wait()  # the host tables are written below: the last commit's copies must have read them
        present = {item.seq.seq_id for item in batch}
        freed = [row for seq_id, row in self.rows.items() if seq_id not in present]
        if freed:
            self.rows = {s: r for s, r in self.rows.items() if s in present}
            for row in freed:
                self._free_row(row)
        diff = BatchDiff(self.step, 0, freed_rows=freed)
        rows = np.empty(len(batch), dtype=np.int64)
        for i, item in enumerate(batch):
            seq = item.seq
            row = self.rows.get(seq.seq_id)
            if row is None:
                row = self.rows[seq.seq_id] = self._take_row()
            rows[i] = row
            self._follow(row, seq, diff)
            self.num_computed[row] = seq.num_computed_tokens
            self.query_lens[row] = item.num_new_tokens
        diff.num_rows = self.num_rows
        return rows, diff

    def _follow(self, row: int, seq, diff: BatchDiff) -> None:
        """Write the entries of `seq`'s tables that differ from what `row` holds."""
        tables, refs, edits = seq.block_tables, self.table_refs[row], seq.table_edits
        if refs is not None and len(refs) == len(tables) and not edits and \
                all(a is b for a, b in zip(refs, tables)):
            for g, table in enumerate(tables):  # the common case: an unchanged or growing table
                known = self.num_blocks[g, row]
                if len(table) > known:
                    self._write(diff, row, g, int(known), table[known:], False)
            return
        same = refs is not None and len(refs) == len(tables)
        for g, table in enumerate(tables):
            known = int(self.num_blocks[g, row])
            start = min(known, edits.get(g, known)) if same and refs[g] is table else 0
            if start < len(table) or len(table) < known:
                self._write(diff, row, g, start, table[start:], True)
        self.table_refs[row] = list(tables)
        edits.clear()

    def _write(self, diff: BatchDiff, row: int, group: int, start: int, blocks, truncate: bool) -> None:
        ids = np.fromiter((b.block_id for b in blocks), np.int32, len(blocks))
        write = TableWrite(row, group, start, ids, truncate)
        self._apply_write(write)
        diff.writes.append(write)

    def _apply_write(self, w: TableWrite) -> None:
        stop = w.start + len(w.block_ids)
        if stop > self.max_blocks:
            raise ValueError(f"a block table of {stop} entries does not fit the input batch's {self.max_blocks} "
                             f"columns (max_model_len / block_size)")
        self.host_np[w.group, w.row, w.start:stop] = w.block_ids
        end = stop
        if w.truncate:
            end = max(stop, int(self.num_blocks[w.group, w.row]))
            self.host_np[w.group, w.row, stop:end] = 0
            self.num_blocks[w.group, w.row] = stop
        else:
            self.num_blocks[w.group, w.row] = max(stop, int(self.num_blocks[w.group, w.row]))
        if end > w.start:
            self.dirty.append((w.group, w.row, w.start, end))

    # ---- a tensor-parallel worker: follow rank 0's diffs ------------------------------------------------

    def apply(self, diff: BatchDiff) -> None:
        """Bring a mirror up to rank 0's tables; a diff already applied here (rank 0's own) is skipped."""
        if diff.step <= self.step:
            return
        if diff.step != self.step + 1:
            raise RuntimeError(f"input batch diff {diff.step} arrived after diff {self.step}: one was lost")
        self.step = diff.step
        self.fence.wait()
        if diff.num_rows > self.num_rows:
            self._grow(diff.num_rows)
        for row in diff.freed_rows:
            self._free_row(row)
        for w in diff.writes:
            self._apply_write(w)

    # ---- both: to the device ----------------------------------------------------------------------------

    def commit(self) -> None:
        """Copy the cells written since the last commit to the device, asynchronously (pinned on CUDA): issued
        before the forward, on the same stream, so the forward reads them and the host never waits."""
        if not self.dirty:
            return
        self.last_gather = None
        # Every copy's source is contiguous (a row segment, or whole rows of one plane): a strided source would
        # be staged through pageable memory and the copy would no longer be asynchronous.
        if self.device_tables is self.host:  # the CPU's: nothing to copy
            pass
        elif len(self.dirty) > 64:  # many small copies cost more than one copy of the rows in use
            used = max(r for _, r, _, _ in self.dirty) + 1
            for g in range(self.num_groups):
                self.device_tables[g, :used].copy_(self.host[g, :used], non_blocking=True)
        else:
            for g, row, start, stop in self.dirty:
                for plane in (range(self.num_groups) if g < 0 else (g,)):
                    self.device_tables[plane, row, start:stop].copy_(self.host[plane, row, start:stop],
                                                                     non_blocking=True)
        self.dirty.clear()
        self.fence.record()

    def gather(self, rows: torch.Tensor, width: int) -> torch.Tensor:
        """This step's `[num_groups, num_seqs, width]` tables, gathered on the device from `rows`."""
        return self.device_tables[:, :, :width].index_select(1, rows)

    def step_tables(self, rows: np.ndarray, width: int) -> torch.Tensor:
        """`gather` from host rows, or the last step's tables when nothing they hold changed since (the gather is
        a copy that nobody writes, so sharing it between steps is safe on a card's stream and on the host)."""
        key = rows.tobytes()
        last = self.last_gather
        if last is not None and last[0] == key and last[1] == width:
            return last[2]
        tables = self.gather(to_device(torch.from_numpy(rows), self.device), width)
        self.last_gather = (key, width, tables)
        return tables

    def host_tables(self, rows: np.ndarray, width: int) -> np.ndarray:
        """The same tables from the host buffer (slot mapping, tests)."""
        return self.host_np[:, rows, :width]
