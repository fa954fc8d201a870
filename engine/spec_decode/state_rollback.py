"""Rolling back a hybrid model's linear-attention state past rejected drafts: verify rows leave the state slot
alone, and the next step replays only the accepted tokens into it.

A Gated DeltaNet layer (engine/layers/gated_deltanet.py) folds every token it sees into its sequence's conv
state and recurrent state, so a verify step's 1 + k query tokens (the last token, then k drafts) would carry
the slot past drafts the rejection sampler may throw away. Instead of one saved state per position (a
recurrent slot is ~147 MiB per sequence at Qwen3.6-27B, times 1 + k), the step keeps the few inputs that
define the state update:
1. The verify step. Each verify row is flagged `read_only_state`: the kernels read the slot (outputs at all
   1 + k positions are exact) but write nothing back. Each DeltaNet layer copies the verify tokens' pre-conv
   projection row [C] and their log-decay g and beta [Hv] into its verify scratch (`reserve_verify_rows`:
   max_num_seqs * (1 + k) rows per layer, allocated before the KV pool is sized, so sizing counts them);
   verify sequence v of the step owns scratch rows from `first_row`, in token order.
2. Acceptance. The rejection sampler decides `num_accepted` = a per sequence (the output processor stores
   it on the ScheduledSeq); the scheduler advances num_computed_tokens by 1 + a.
3. The replay, first thing of the next forward (before any state copy, so a fork or a prefix-cache snapshot
   copied afterwards reads the rolled-forward state): for each verify sequence still running on the same
   slot, the first 1 + a scratch rows go through the same conv + gated-delta kernels as a varlen batch that
   continues from the slot (outputs discarded). The slot then holds the state after exactly the accepted
   tokens, i.e. after num_computed_tokens tokens, which is all any reader ever sees. On the GPU the replay
   batch is at most 1 + k tokens a row and takes the recurrent kernel with no host sync.

`VerifyStates` (one per ModelRunner, rank 0's plans for every rank) does the bookkeeping: `plan` is called
from `ModelRunner.prepare` for the step being prepared, and its `StateReplay` of the previous verify step
travels in StepInputs, so tensor-parallel workers replay exactly what rank 0 does. Sequences that finished,
were preempted or lost their slot are skipped (their slot may already serve someone else). Prefix-cache
snapshots are only taken from prompt chunks, never from verify rows, and are copied after the replay: they
hold accepted tokens' state only.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.core.sequence import SequenceStatus


@dataclass(slots=True)
class StateReplay:
    """The accepted tokens of the last verify step, as a varlen batch over the layers' verify scratch."""

    rows: np.ndarray  # [num_tokens] int64: scratch rows, sequence after sequence, in token order
    query_start_loc: np.ndarray  # [num_seqs + 1] int32 over `rows`
    state_indices: np.ndarray  # [num_seqs] int32: each sequence's state slot
    max_query_len: int  # 1 + the most drafts any of them accepted


@dataclass(slots=True)
class _Verified:
    item: object  # the ScheduledSeq (its num_accepted is set after sampling)
    slot: int
    first_row: int  # of the verify scratch
    num_tokens: int  # 1 + drafts


class VerifyStates:
    def __init__(self) -> None:
        self.max_rows = 0  # the layers' verify scratch rows (0: not reserved)
        self._pending: list[_Verified] = []

    def take_replay(self) -> StateReplay | None:
        """The previous verify step's accepted tokens to replay before the next forward (None if nothing)."""
        pending, self._pending = self._pending, []
        rows, lengths, slots = [], [], []
        for v in pending:
            seq = v.item.seq
            if seq.status is not SequenceStatus.RUNNING or seq.state_slot != v.slot:
                continue  # ended or preempted since: its slot is not its own any more
            n = 1 + min(v.item.num_accepted, v.num_tokens - 1)
            rows.append(np.arange(v.first_row, v.first_row + n, dtype=np.int64))
            lengths.append(n)
            slots.append(v.slot)
        if not rows:
            return None
        query_start = np.zeros(len(lengths) + 1, dtype=np.int32)
        np.cumsum(lengths, out=query_start[1:])
        return StateReplay(np.concatenate(rows), query_start, np.asarray(slots, dtype=np.int32), max(lengths))

    def plan(self, batch: list, query_start: np.ndarray) -> tuple[np.ndarray | None, np.ndarray | None]:
        """(read_only_state [num_seqs] bool, verify token rows [n] int64) of a step, or (None, None) when it
        has no verify row; remembers them for the next `take_replay`."""
        verify = [i for i, item in enumerate(batch) if item.num_draft_tokens]
        if not verify:
            return None, None
        read_only = np.zeros(len(batch), dtype=bool)
        token_rows, first = [], 0
        for i in verify:
            item = batch[i]
            n = int(query_start[i + 1] - query_start[i])
            read_only[i] = True
            token_rows.append(np.arange(query_start[i], query_start[i + 1], dtype=np.int64))
            self._pending.append(_Verified(item, item.seq.state_slot, first, n))
            first += n
        if first > self.max_rows:
            self._pending = []
            raise RuntimeError(f"a verify step of {first} tokens exceeds the {self.max_rows} rows of the "
                               "linear-attention verify scratch (reserve_verify_tokens: max_num_seqs * (1 + k))")
        return read_only, np.concatenate(token_rows)
