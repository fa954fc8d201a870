"""SamplingState: each sampling sequence's parameters and penalty counts kept across steps, updated by what changed;
and the `SamplingMetadata` it makes each step: the step's sampling rows as tensors on the logits' device.

`SamplingMetadata` holds temperatures, filters, penalty buffers and flat bias/mask indices; it is made by the
model runner's persistent `SamplingState` from what changed since the last step, or by `SamplingMetadata.build`
from the rows alone. The sampler never loops over the vocabulary in Python and never mixes host and device
tensors; on a card every copy is asynchronous from pinned memory, so the model runner builds it before the
forward and the host never waits for the card.

Rank 0's model runner owns one (`ModelRunner.sampling_state`). A sampling row (`SamplingRow.key`, the
sequence's id) owns a row of a `[rows, 7]` float32 parameter table (temperature, effective top-k / top-p,
min-p, the three penalties), written on the host when the row joins and copied to the device with
`non_blocking=True`; a step then gathers its parameters on the device. A penalized row also owns a penalty
slot: a `[slots, vocab]` bool "in the prompt" mask and an int32 output-token count, both on the device,
filled from the whole sequence when it joins and afterwards incremented with only the tokens it gained
since the last step (one scatter-add of the step's new (slot, token) pairs). The grammar bitmask of a step is
staged through a preallocated pinned buffer into a preallocated device buffer. Every per-step index crosses
in one packed copy, so `metadata` makes a step's `SamplingMetadata` without waiting for the card, before the
forward; a step of the last step's rows in the same order, none joined or rewritten (decode after decode), keeps
those index and parameter tensors and makes only the token masks that follow the drawn tokens again.

Rows and slots: a key keeps its row while it samples step after step; a key absent from a step (finished,
preempted, a speculative verify step, waiting for its next chunk) leaves and its row and slot go on free
lists (heaps: the lowest first), holes kept, never moved: a step's rows are gathered by index, so no row ever
has to be copied elsewhere. A row without a key (tests, profiling, `SamplingMetadata.build`) joins for one
step only. Pinned host buffers are only rewritten after the copies issued from them have run (`CopyFence`).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, replace
from itertools import chain

import numpy as np
import torch

from engine.platform.host_copies import CopyFence, host_buffer, pins_host_buffers, to_device
from engine.sample.metadata import SamplingRow

FIRST_ROWS = 16
# Columns of the parameter table.
TEMPERATURE, TOP_K, TOP_P, MIN_P, REPETITION, PRESENCE, FREQUENCY = range(7)
NUM_FLAGS = 5  # per-row booleans beside it (SamplingState.flags)


@dataclass
class SamplingMetadata:
    """One step's sampling parameters as device tensors. Work is done only on the rows that ask for it:
    `sampled_rows` (not greedy), `filter_rows` (of those, the ones with top-k/top-p/min-p; an index into
    the sampled rows) and `penalty_rows`; each parameter tensor is laid out over its subset. None: no row asks."""

    num_rows: int
    sampled_rows: torch.Tensor | None  # long [S]: rows that draw (None: all greedy)
    temperature: torch.Tensor | None  # [S]
    generators: list[torch.Generator | None]  # [S]: a seeded row's own; None: the engine's
    filter_rows: torch.Tensor | None  # long [F], positions within the sampled rows
    top_k: torch.Tensor | None  # long [F], vocab size where off
    top_p: torch.Tensor | None  # [F], 2.0 where off: the mass above a token never reaches it
    min_p: torch.Tensor | None  # [F], 0.0 where off
    penalty_rows: torch.Tensor | None  # long [P]
    repetition_penalty: torch.Tensor | None  # [P]
    presence_penalty: torch.Tensor | None  # [P]
    frequency_penalty: torch.Tensor | None  # [P]
    # The sampling state's persistent penalty buffers (engine/sample/state.py), read at the rows' slots
    # only when the penalties are applied (no [P, vocab] gather alive during the forward).
    penalty_slots: torch.Tensor | None  # long [P]
    in_prompt: torch.Tensor | None  # bool [slots, vocab]: the token is in the slot's prompt
    output_counts: torch.Tensor | None  # int32 [slots, vocab]: times the token is in the slot's output
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (rows, token ids, values) of logit_bias
    masked: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) set to -inf (min_tokens)
    max_num_logprobs: int | None  # top-k width for logprobs; None: no row asks
    # Structured outputs: packed allowed-token bits [num_rows, ceil(vocab / 32)] int32 (bit j of word w
    # allows token 32 w + j; all ones for rows without a grammar), applied right after logit bias/min_tokens.
    bitmask: torch.Tensor | None = None
    # The widest top-k among the filter rows (a host int; vocab when one has none): a top-k that narrow stands in
    # for the full sort of the vocabulary.
    filter_width: int | None = None

    @classmethod
    def greedy(cls, num_rows: int, max_num_logprobs: int | None = None) -> "SamplingMetadata":
        """Rows that all take the argmax, unedited: no parameter tensor, no index."""
        return cls(num_rows, sampled_rows=None, temperature=None, generators=[], filter_rows=None, top_k=None,
                   top_p=None, min_p=None, penalty_rows=None, repetition_penalty=None, presence_penalty=None,
                   frequency_penalty=None, penalty_slots=None, in_prompt=None, output_counts=None, bias=None,
                   masked=None, max_num_logprobs=max_num_logprobs)

    @classmethod
    def build(cls, rows: list[SamplingRow], vocab_size: int, device: torch.device) -> "SamplingMetadata":
        """From the rows alone, nothing kept: a throwaway SamplingState (the same code as a step's)."""
        return SamplingState(vocab_size, device, len(rows)).metadata(rows)


@dataclass(slots=True)
class IndexedRows:
    """A step's rows as the sampling state indexed them, kept for the next step if it has the same rows."""

    state_rows: np.ndarray  # each row's state row, in logits order
    meta: SamplingMetadata  # without token masks or bitmask
    masking: list[int]  # rows that may mask tokens this step (min_tokens, bad words)
    sampled: list[int]  # rows that draw, in meta.generators' order


def bias_tensors(rows: list[SamplingRow], device: torch.device, which: list[int] | None = None):
    """(rows, token ids, values) of the rows' logit biases; `which`: the only rows that may have one."""
    which = range(len(rows)) if which is None else which
    entries = [(i, t, v) for i in which for t, v in (rows[i].params.logit_bias or {}).items()]
    if not entries:
        return None
    i, t, v = zip(*entries)
    return (to_device(torch.tensor(i), device), to_device(torch.tensor(t), device),
            to_device(torch.tensor(v, dtype=torch.float32), device))


def masked_tensors(rows: list[SamplingRow], device: torch.device, which: list[int] | None = None):
    """Token ids a row may not draw this step: EOS and stop ids before min_tokens, and the last token of each
    bad word whose other tokens the output ends with (a one-token bad word always); `which`: the only rows that
    may mask."""
    entries = []
    for i in range(len(rows)) if which is None else which:
        r = rows[i]
        p = r.params
        if r.num_output_tokens < p.min_tokens:
            entries += [(i, t) for t in ([] if p.ignore_eos else r.eos_ids) + p.stop_token_ids]
        for word in p.bad_words_token_ids:
            head = len(word) - 1
            if head == 0 or (r.num_output_tokens >= head and r.token_ids[len(r.token_ids) - head:] == word[:-1]):
                entries.append((i, word[-1]))
    if not entries:
        return None
    i, t = zip(*entries)
    return to_device(torch.tensor(i), device), to_device(torch.tensor(t), device)


def max_logprobs(rows: list[SamplingRow]) -> int | None:
    """The widest top log-probs a row asks for; None when none asks."""
    return max((r.params.logprobs for r in rows if r.params.logprobs is not None), default=None)


def penalized(p) -> bool:
    return p.repetition_penalty != 1.0 or bool(p.presence_penalty) or bool(p.frequency_penalty)


def filtered(p) -> bool:
    return p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0


class _Pairs:
    """(slot, token id) pairs gathered per slot as token lists, flattened once into two int64 arrays."""

    __slots__ = ("slots", "lengths", "ids", "size")

    def __init__(self) -> None:
        self.slots, self.lengths, self.ids, self.size = [], [], [], 0

    def add(self, slot: int, ids: list[int]) -> None:
        if ids:
            self.slots.append(slot)
            self.lengths.append(len(ids))
            self.ids.append(ids)
            self.size += len(ids)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        if not self.size:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        ids = self.ids[0] if len(self.ids) == 1 else list(chain.from_iterable(self.ids))
        return np.repeat(np.asarray(self.slots, np.int64), self.lengths), np.asarray(ids, np.int64)


class SamplingState:
    def __init__(self, vocab_size: int, device: torch.device, num_rows: int = FIRST_ROWS) -> None:
        self.vocab_size, self.device = vocab_size, device
        self.pin = pins_host_buffers(device)
        self.fence = CopyFence(self.pin)  # the parameter table's last copy
        self.bitmask_fence = CopyFence(self.pin)  # the bitmask staging buffer's
        # Penalty slots are allocated this many at once (the runner's: max_num_seqs): no growth, no copies.
        self.max_rows = num_rows
        self.rows: dict[int, int] = {}  # key -> row
        self.free_rows: list[int] = []
        self.num_rows = 0
        self.param_refs: list = []  # per row: the SamplingParams written (a new object: rewrite)
        # Per row: draws (not greedy), filters, is penalized, has a logit bias, may mask tokens (min_tokens, bad
        # words): written when its parameters are, so a step walks only the rows that bias or mask.
        self.flags = np.zeros((0, NUM_FLAGS), dtype=bool)
        self.pen_slots = np.zeros(0, dtype=np.int64)  # per row: its penalty slot, -1: none
        self.token_refs: list = []  # per row: the token list counted, and how many of its tokens
        self.num_counted = np.zeros(0, dtype=np.int64)
        self.params_host = torch.zeros(0)
        self.params_np = np.zeros((0, 7), dtype=np.float32)
        self.params = torch.zeros(0)
        self.dirty_rows: list[int] = []
        self.free_slots: list[int] = []
        self.num_slots = 0
        self.in_prompt: torch.Tensor | None = None  # [slots, vocab] bool
        self.output_counts: torch.Tensor | None = None  # [slots, vocab] int32
        self.bitmask_host: torch.Tensor | None = None  # [rows, words] int32 staging (pinned on CUDA)
        self.bitmask: torch.Tensor | None = None  # [rows, words] int32 on the device
        self._transient = 0  # keys for rows without one: negative, never reused
        # What the last `metadata` wrote (tests, the bench): rows joined, (slot, token) count increments.
        self.num_joined = 0
        self.num_count_writes = 0
        self.num_rewritten = 0  # rows whose parameters the last `update` wrote (a new SamplingParams)
        self.last_step: IndexedRows | None = None  # the last `metadata`'s rows, reused by a step of the same rows
        self._grow(max(num_rows, 1))

    # ---- rows and slots ---------------------------------------------------------------------------------

    def _grow(self, num_rows: int) -> None:
        old = self.num_rows
        host, host_np = host_buffer((num_rows, 7), np.float32, self.pin)
        host_np[:old] = self.params_np[:old]
        params = torch.zeros((num_rows, 7), dtype=torch.float32, device=self.device)
        if old:
            params[:old].copy_(self.params[:old])
        self.params_host, self.params_np, self.params = host, host_np, params
        self.param_refs += [None] * (num_rows - old)
        self.flags = np.concatenate([self.flags, np.zeros((num_rows - old, NUM_FLAGS), bool)])
        self.token_refs += [None] * (num_rows - old)
        self.pen_slots = np.concatenate([self.pen_slots, np.full(num_rows - old, -1, np.int64)])
        self.num_counted = np.concatenate([self.num_counted, np.zeros(num_rows - old, np.int64)])
        for row in range(old, num_rows):
            heapq.heappush(self.free_rows, row)
        self.num_rows = num_rows

    def _take_slot(self) -> int:
        if not self.free_slots:
            old = self.num_slots
            new = self.max_rows if self.max_rows > old else max(2 * old, 4)
            in_prompt = torch.zeros((new, self.vocab_size), dtype=torch.bool, device=self.device)
            counts = torch.zeros((new, self.vocab_size), dtype=torch.int32, device=self.device)
            if old:
                in_prompt[:old].copy_(self.in_prompt)
                counts[:old].copy_(self.output_counts)
            self.in_prompt, self.output_counts, self.num_slots = in_prompt, counts, new
            for slot in range(old, new):
                heapq.heappush(self.free_slots, slot)
        return heapq.heappop(self.free_slots)

    def _leave(self, key: int) -> None:
        row = self.rows.pop(key)
        if self.pen_slots[row] >= 0:
            heapq.heappush(self.free_slots, int(self.pen_slots[row]))
            self.pen_slots[row] = -1
        self.param_refs[row] = self.token_refs[row] = None
        heapq.heappush(self.free_rows, row)

    def _write_params(self, row: int, p) -> None:
        v = self.vocab_size
        self.params_np[row] = (p.temperature, min(p.top_k, v) if p.top_k > 0 else v,
                               p.top_p if p.top_p < 1.0 else 2.0,  # 2.0: the mass above a token never reaches it
                               p.min_p, p.repetition_penalty, p.presence_penalty, p.frequency_penalty)
        self.flags[row] = (not p.greedy, filtered(p), penalized(p), bool(p.logit_bias),
                           p.min_tokens > 0 or bool(p.bad_words_token_ids))
        self.param_refs[row] = p
        self.dirty_rows.append(row)

    # ---- one step ---------------------------------------------------------------------------------------

    def update(self, rows) -> tuple[np.ndarray, list[int], "_Pairs", "_Pairs"]:
        """Follow this step's sampling rows: leave, join, rewrite what changed. Returns each row's state row,
        the penalty slots to clear, and the (slot, token ids) to mark in the prompt mask and to count."""
        keys = [r.key for r in rows]
        present = set(keys)
        if None in present:  # rows without a key: each its own, for this step only
            for i, key in enumerate(keys):
                if key is None:
                    self._transient -= 1
                    keys[i] = self._transient
            present = set(keys)
        for key in [k for k in self.rows if k not in present]:
            self._leave(key)
        self.fence.wait()  # the parameter table is written below: its last copy must have run
        state_rows = np.empty(len(rows), dtype=np.int64)
        cleared, marks, counts = [], _Pairs(), _Pairs()
        self.num_joined = self.num_rewritten = 0
        for i, (key, r) in enumerate(zip(keys, rows)):
            row = self.rows.get(key)
            if row is None:
                if not self.free_rows:
                    self._grow(2 * self.num_rows)
                row = self.rows[key] = heapq.heappop(self.free_rows)
                self.num_joined += 1
            state_rows[i] = row
            if r.params is not self.param_refs[row]:
                self._write_params(row, r.params)
                self.num_rewritten += 1
            slot = int(self.pen_slots[row])
            if not self.flags[row, 2]:
                if slot >= 0:
                    heapq.heappush(self.free_slots, slot)
                    self.pen_slots[row] = -1
                continue
            tokens, counted = r.token_ids, int(self.num_counted[row])
            if slot >= 0 and self.token_refs[row] is tokens and len(tokens) >= counted:
                counts.add(slot, tokens[counted:])  # only the tokens gained since the last step
            else:  # joined, or its token list was replaced: rebuilt from the whole sequence
                if slot < 0:
                    slot = self.pen_slots[row] = self._take_slot()
                cleared.append(slot)
                marks.add(slot, tokens[:r.num_prompt_tokens])
                counts.add(slot, tokens[r.num_prompt_tokens:])
                self.token_refs[row] = tokens
            self.num_counted[row] = len(tokens)
        self.num_count_writes = counts.size
        return state_rows, cleared, marks, counts

    def commit(self, cleared: list[int], marks: "_Pairs", counts: "_Pairs") -> None:
        """The joined rows' parameters and the penalty buffers' changes onto the device, without a host wait."""
        if self.dirty_rows:
            lo, hi = min(self.dirty_rows), max(self.dirty_rows) + 1  # one contiguous copy: rows join lowest first
            self.params[lo:hi].copy_(self.params_host[lo:hi], non_blocking=True)
            self.dirty_rows.clear()
            self.fence.record()
        if not (cleared or marks.size or counts.size):
            return
        packed = np.concatenate([np.asarray(cleared, np.int64), *marks.arrays(), *counts.arrays()])
        dev = to_device(torch.from_numpy(packed), self.device)
        z, m, k = len(cleared), marks.size, counts.size
        if z:
            slots = dev.narrow(0, 0, z)
            self.in_prompt.index_fill_(0, slots, False)
            self.output_counts.index_fill_(0, slots, 0)
        if m:
            self.in_prompt.index_put_((dev.narrow(0, z, m), dev.narrow(0, z + m, m)),
                                      torch.ones((), dtype=torch.bool, device=self.device))
        if k:
            self.output_counts.index_put_((dev.narrow(0, z + 2 * m, k), dev.narrow(0, z + 2 * m + k, k)),
                                          torch.ones((), dtype=torch.int32, device=self.device), accumulate=True)

    def stage_bitmask(self, bitmask: torch.Tensor) -> torch.Tensor:
        """A step's host bitmask `[rows, words]` through the pinned staging buffer into the device buffer."""
        n, words = bitmask.shape
        if self.bitmask is None or self.bitmask.shape[0] < n or self.bitmask.shape[1] != words:
            self.bitmask_fence.wait()
            rows = max(n, self.num_rows, self.max_rows)
            self.bitmask_host = host_buffer((rows, words), np.int32, self.pin)[0]
            self.bitmask = torch.empty((rows, words), dtype=torch.int32, device=self.device)
        if self.device.type != "cuda":  # the device buffer is host memory: no staging
            self.bitmask[:n].copy_(bitmask)
            return self.bitmask[:n]
        self.bitmask_fence.wait()
        self.bitmask_host[:n].copy_(bitmask)
        self.bitmask[:n].copy_(self.bitmask_host[:n], non_blocking=True)
        self.bitmask_fence.record()
        return self.bitmask.narrow(0, 0, n)

    def metadata(self, rows, bitmask: torch.Tensor | None = None):
        """This step's SamplingMetadata for `rows` (SamplingRow, in logits order), on the device. A step of the last
        step's rows in the same order, none joined or rewritten (the common decode step), keeps the last step's
        index and parameter tensors: only the token masks, which follow the tokens drawn so far, are made again."""
        state_rows, cleared, marks, counts = self.update(rows)
        self.commit(cleared, marks, counts)
        last = self.last_step
        # bytes compared, not np.array_equal: a tenth of its cost on the few rows of a decode step (both int64)
        if last is None or self.num_joined or self.num_rewritten or last.state_rows.tobytes() != state_rows.tobytes() \
                or any(rows[i].generator is not g for i, g in zip(last.sampled, last.meta.generators)):
            last = self.last_step = self._indexed(rows, state_rows)
        meta = last.meta
        if last.masking or bitmask is not None:
            meta = replace(meta, masked=masked_tensors(rows, self.device, last.masking) if last.masking else None)
            if bitmask is not None:
                meta.bitmask = self.stage_bitmask(bitmask)
        return meta

    def _indexed(self, rows, state_rows: np.ndarray) -> "IndexedRows":
        """The rows' index and parameter tensors (no token masks, no bitmask), and which rows mask tokens."""
        flags = self.flags[state_rows]
        if not flags.any():  # every row greedy, unfiltered, unpenalized, unbiased: no index to build
            return IndexedRows(state_rows, SamplingMetadata.greedy(len(rows), max_logprobs(rows)), [], [])
        sampled = np.flatnonzero(flags[:, 0])
        filt = np.flatnonzero(flags[sampled, 1])
        pen = np.flatnonzero(flags[:, 2])
        parts = [state_rows[sampled], filt, state_rows[sampled[filt]], sampled, pen, state_rows[pen],
                 self.pen_slots[state_rows[pen]]]
        index = to_device(torch.from_numpy(np.concatenate(parts)), self.device) \
            if len(sampled) or len(pen) else None
        views, at = [], 0
        for part in parts:
            views.append(index.narrow(0, at, len(part)) if len(part) else None)
            at += len(part)
        sampled_state, filt_idx, filt_state, sampled_idx, pen_idx, pen_state, pen_slot = views
        sampled, filt, pen = sampled.tolist(), len(filt), len(pen)
        s_params = self.params.index_select(0, sampled_state) if sampled else None
        f_params = self.params.index_select(0, filt_state) if filt else None
        p_params = self.params.index_select(0, pen_state) if pen else None
        meta = SamplingMetadata(
            num_rows=len(rows), sampled_rows=sampled_idx,
            temperature=s_params[:, TEMPERATURE] if sampled else None,
            generators=[rows[i].generator for i in sampled], filter_rows=filt_idx,
            top_k=f_params[:, TOP_K].long() if filt else None, top_p=f_params[:, TOP_P] if filt else None,
            min_p=f_params[:, MIN_P] if filt else None, penalty_rows=pen_idx,
            repetition_penalty=p_params[:, REPETITION] if pen else None,
            presence_penalty=p_params[:, PRESENCE] if pen else None,
            frequency_penalty=p_params[:, FREQUENCY] if pen else None,
            penalty_slots=pen_slot, in_prompt=self.in_prompt if pen else None,
            output_counts=self.output_counts if pen else None,
            bias=bias_tensors(rows, self.device, np.flatnonzero(flags[:, 3]).tolist()), masked=None,
            max_num_logprobs=max_logprobs(rows),
            filter_width=int(self.params_np[parts[2], TOP_K].max()) if filt else None)
        return IndexedRows(state_rows, meta, np.flatnonzero(flags[:, 4]).tolist(), sampled)
