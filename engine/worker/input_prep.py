"""Input preparation: a scheduled batch turned into flat host arrays, and those arrays into a step's device tensors.

`InputPreparer.prepare` (rank 0; a step of one-token decodes alone takes the short `prepare_decodes`) lays the batch
out as plain numpy over its tokens (input_ids, positions, slot_mapping, seq_lens, query_start_loc, logits rows,
prompt-logprobs rows, pooled spans, a hybrid model's state slots and verify rows) and brings the persistent input
batch's block tables up to date (engine/worker/input_batch.py), keeping the diff, so the same small `StepInputs` can
go to tensor-parallel workers (engine/worker/step_inputs.py). On every rank `step_tables` applies that diff to its own
mirror and gathers the step's tables on the device, and `logits_index` copies the rows to sample (the rest goes
through the persistent step buffers, engine/worker/step_buffers.py), all before the forward. A vision-language step
also carries its encoder work and, per prompt chunk that reaches an image's placeholders, which embeddings go to
which token rows (`image_rows`); with Qwen's mRoPE the positions are the model's (engine/multimodal/mrope.py),
[3, T] where a chunk holds image placeholders, else one row. It runs no model and decides nothing about graphs.
"""
from __future__ import annotations

from itertools import chain

import numpy as np
import torch

from engine.core.scheduler import ScheduledSeq
from engine.kv.kv_cache_interface import KVCacheLayout, cdiv
from engine.multimodal.encoder_cache import EncoderWork
from engine.multimodal.mrope import positions_for
from engine.platform.host_copies import to_device
from engine.sample.pooling import pooling_spans
from engine.sample.prompt_logprobs import prompt_positions
from engine.spec_decode.state_rollback import VerifyStates
from engine.worker.input_batch import InputBatch
from engine.worker.step_inputs import PENDING_TOKEN, StepInputs, logits_rows, query_tokens


class InputPreparer:
    def __init__(self, layout: KVCacheLayout, block_size: int, max_model_len: int, device: torch.device,
                 pooling: bool = False, mrope: bool = False, bidirectional_images: bool = False) -> None:
        """`pooling`: an embedding engine (its requests' token spans are pooled, engine/sample/pooling.py);
        `mrope`: the model reads Qwen's three position streams; `bidirectional_images`: an image's tokens see
        each other both ways (Gemma: the step carries key limits)."""
        self.layout, self.block_size, self.device, self.pooling = layout, block_size, device, pooling
        self.mrope, self.bidirectional_images = mrope, bidirectional_images
        # Rank 0 updates it from the scheduled batch; a tensor-parallel worker's follows rank 0's diffs.
        self.input_batch = InputBatch(len(layout.groups), cdiv(max_model_len, block_size), device)
        self.verify_states = VerifyStates()  # speculative verify rows of a hybrid model (rank 0 plans them)
        self.last_sample_rows: dict[int, int] = {}  # seq_id -> its row among the last launched step's samples
        # Whether a step of one-token decodes can take `prepare_decodes`: nothing pooled, no state slots, one
        # position stream (a decode then carries no prompt rows, image rows or key limits).
        self.plain = layout.state is None and not pooling and not mrope

    def prepare(self, batch: list[ScheduledSeq], block_copies: list[tuple[int, int]] = (),
                state_copies: list[tuple[int, int]] = (), encoder: EncoderWork | None = None) -> StepInputs:
        """Flat, device-free inputs for the whole batch, with the row of each sampling sequence's last token; a
        decode whose input token is still on the device (async scheduling) gets its row among the last launched
        step's samples (`last_sample_rows`, which the runner keeps), and the device fills it in. A step of
        one-token decodes alone (the common step) takes `prepare_decodes`, every other `prepare_any`."""
        if self.plain and not encoder and all(item.num_new_tokens == 1 and not item.is_prefill for item in batch):
            return self.prepare_decodes(batch, block_copies)
        return self.prepare_any(batch, block_copies, state_copies, encoder)

    def prepare_decodes(self, batch: list[ScheduledSeq], block_copies: list[tuple[int, int]] = ()) -> StepInputs:
        """`prepare_any`'s inputs for one-token decodes (no drafts, no prompt chunk), from each sequence's position
        alone: token row i is sequence i, its position its computed tokens, and every row samples. A handful of
        numpy calls whatever the batch (issue 39: batch-1 host time)."""
        n, bs, table = len(batch), self.block_size, self.input_batch
        rows, diff = table.update(batch)
        positions = table.num_computed[rows]  # `update` wrote each row's computed tokens
        block_index, offset = np.divmod(positions, bs)
        # int32 block ids times the block size stay int32 (ids < 2**31 / block_size); the int64 offset widens them
        slots = table.host_np[:, rows, block_index] * bs + offset  # [groups, n]
        ids = [PENDING_TOKEN if item.num_pending else item.seq.token_ids[-1] for item in batch]
        input_ids = np.array(ids, np.int64)
        seq_lens = (positions + 1).astype(np.int32)
        inputs = StepInputs(
            input_ids=input_ids, positions=positions, slot_mapping=slots[0], seq_lens=seq_lens,
            query_start_loc=np.arange(n + 1, dtype=np.int32), logits_rows=list(range(n)), max_query_len=1,
            max_seq_len=int(seq_lens.max()), block_copies=list(block_copies),
            group_slot_mappings=slots[1:] if len(slots) > 1 else None, rows=rows,
            table_width=int(table.num_blocks[:, rows].max()), table_diff=diff)
        if PENDING_TOKEN in ids:
            pending = (input_ids == PENDING_TOKEN).nonzero()[0]
            sources = self.last_sample_rows
            inputs.pending_rows = pending
            inputs.pending_sources = np.fromiter((sources[batch[i].seq.seq_id] for i in pending.tolist()), np.int64,
                                                 len(pending))
        return inputs

    def prepare_any(self, batch: list[ScheduledSeq], block_copies: list[tuple[int, int]] = (),
                    state_copies: list[tuple[int, int]] = (), encoder: EncoderWork | None = None) -> StepInputs:
        """Any batch: prompt chunks, decodes with drafts, images, pooled and hybrid steps. The input batch takes
        only what changed in the block tables; positions, slots and offsets are numpy over the batch, the slots
        read from the input batch's host tables."""
        bs = self.block_size
        num_new = np.fromiter((item.num_new_tokens for item in batch), np.int64, len(batch))
        computed = np.fromiter((item.seq.num_computed_tokens for item in batch), np.int64, len(batch))
        samples = np.fromiter((item.samples for item in batch), bool, len(batch))
        rows, diff = self.input_batch.update(batch)
        width = int(self.input_batch.num_blocks[:, rows].max())
        query_start = np.zeros(len(batch) + 1, dtype=np.int64)
        np.cumsum(num_new, out=query_start[1:])
        num_tokens = int(query_start[-1])
        owner = np.repeat(np.arange(len(batch)), num_new)  # which sequence each token row belongs to
        positions = np.arange(num_tokens) - np.repeat(query_start[:-1] - computed, num_new)
        block_index, offset = positions // bs, positions % bs
        host, token_rows = self.input_batch.host_np, rows[owner]
        slots = host[0, token_rows, block_index].astype(np.int64) * bs + offset
        group_slots = None
        if len(self.layout.groups) > 1:  # every group's table has the same length: same shapes
            group_slots = host[1:, token_rows, block_index].astype(np.int64) * bs + offset
        input_ids = np.fromiter(chain.from_iterable(map(query_tokens, batch)), np.int64, num_tokens)
        seq_lens = (computed + num_new).astype(np.int32)
        prompt_rows, prompt_targets, prompt_k = prompt_logits_rows(batch, computed, query_start)
        pool_owners, pool_spans = pooling_spans(batch, computed, query_start) if self.pooling else ([], [])
        state_indices = has_initial_state = replay = read_only = verify_rows = None
        if self.layout.state is not None:
            state_indices = np.fromiter((item.seq.state_slot for item in batch), np.int32, len(batch))
            has_initial_state = computed > 0
            self.input_batch.state_slots[rows] = state_indices  # the input batch's per-row state slot
            replay = self.verify_states.take_replay()  # the last verify step's, now that acceptance is known
            read_only, verify_rows = self.verify_states.plan(batch, query_start)
        slices, image_token_rows = image_rows(batch, computed, query_start)
        limits = image_key_limits(batch, computed, query_start, positions) if self.bidirectional_images else None
        if self.mrope:
            positions = mrope_step_positions(batch, computed, query_start, positions)
        pending = [i for i, item in enumerate(batch) if item.num_pending]
        inputs = StepInputs(
            key_limits=limits,
            mm_free=list(encoder.free) if encoder else [], mm_slices=slices, mm_rows=image_token_rows,
            mm_encode=[(item.mm_hash, item.data) for item in encoder.encode] if encoder else [],
            input_ids=input_ids, positions=positions, slot_mapping=slots, seq_lens=seq_lens,
            query_start_loc=query_start.astype(np.int32), logits_rows=logits_rows(batch, query_start, samples),
            max_query_len=int(num_new.max()), max_seq_len=int(seq_lens.max()), block_copies=list(block_copies),
            prompt_logits_rows=prompt_rows, prompt_targets=prompt_targets, prompt_logprobs_k=prompt_k,
            group_slot_mappings=group_slots, rows=rows, table_width=width, table_diff=diff,
            state_indices=state_indices, has_initial_state=has_initial_state, state_copies=list(state_copies),
            state_replay=replay, state_read_only=read_only, verify_token_rows=verify_rows,
            pool_owners=pool_owners, pool_spans=pool_spans)
        if pending:
            inputs.pending_rows = query_start[1:][pending] - 1  # a decode's one token: the one the last step sampled
            sources = self.last_sample_rows
            inputs.pending_sources = np.fromiter((sources[batch[i].seq.seq_id] for i in pending), np.int64,
                                                 len(pending))
        return inputs

    def step_tables(self, inputs: StepInputs) -> torch.Tensor:
        """This step's `[num_groups, num_seqs, width]` block tables on the device. With an input batch: its
        diff applied (a worker; rank 0 applied it in `prepare`), the changed cells copied asynchronously and
        the step's rows gathered on the device."""
        if inputs.block_tables is not None:
            tables = inputs.block_tables[None]
            if inputs.group_block_tables is not None:
                tables = np.concatenate([tables, inputs.group_block_tables])
            return to_device(torch.from_numpy(np.ascontiguousarray(tables)), self.device)
        self.input_batch.apply(inputs.table_diff)
        self.input_batch.commit()
        return self.input_batch.step_tables(inputs.rows, inputs.table_width)


def image_rows(batch: list[ScheduledSeq], computed: np.ndarray,
               query_start: np.ndarray) -> tuple[list[tuple[str, int, int]], np.ndarray | None]:
    """Where this step's image placeholders take their embeddings: per (sequence, image) run, (content hash,
    first embedding, last + 1), and the token rows of all runs in order; ([], None) without any."""
    slices, rows = [], []
    for i, item in enumerate(batch):
        mm = getattr(item.seq.request, "mm", None)
        if mm is None or not item.is_prefill:
            continue
        start = int(computed[i])
        stop = start + item.num_new_tokens
        for image in mm.items:
            lo, hi, positions = image.embed_range(start, stop)
            if hi > lo:
                slices.append((image.mm_hash, lo, hi))
                rows.append(positions - start + int(query_start[i]))
    return slices, (np.concatenate(rows) if rows else None)


def image_key_limits(batch: list[ScheduledSeq], computed: np.ndarray, query_start: np.ndarray,
                     positions: np.ndarray) -> np.ndarray | None:
    """Per token row, the position its keys may reach, exclusive (kernels/image_mask.py): its own + 1, or the end
    of the image it lies in; None when no row of the step lies in an image (the plain causal call). The scheduler
    never ends a chunk inside such an image, so every key an image token sees is in the cache by then."""
    limits, inside = positions.astype(np.int32) + 1, False
    for i, item in enumerate(batch):
        mm = getattr(item.seq.request, "mm", None)
        if mm is None or not item.is_prefill:
            continue
        start, lo = int(computed[i]), int(query_start[i])
        for image in mm.items:
            a, b = max(start, image.offset), min(start + item.num_new_tokens, image.end)
            if a < b:
                limits[lo + a - start:lo + b - start] = image.end
                inside = True
    return limits if inside else None


def mrope_step_positions(batch: list[ScheduledSeq], computed: np.ndarray, query_start: np.ndarray,
                         positions: np.ndarray) -> np.ndarray:
    """The model's positions under mRoPE: each sequence's tokens at its prompt's three streams, or index + delta
    past the prompt; one row when the three agree for every token (text and decodes), else [3, T]."""
    rows = np.repeat(positions[None], 3, axis=0)
    shifted = False
    for i, item in enumerate(batch):
        mm = getattr(item.seq.request, "mm", None)
        if mm is None or mm.mrope_positions is None:
            continue
        start, lo = int(computed[i]), int(query_start[i])
        rows[:, lo:int(query_start[i + 1])] = positions_for(mm.mrope_positions, mm.mrope_delta, start,
                                                             start + int(query_start[i + 1]) - lo)
        shifted = True
    if not shifted:
        return positions
    return rows[0].copy() if (rows == rows[:1]).all() else rows


def prompt_logits_rows(batch: list[ScheduledSeq], computed: np.ndarray,
                       query_start: np.ndarray) -> tuple[list[int], list[int], int]:
    """Token rows whose logits score the next prompt token (requests with prompt_logprobs), their targets,
    and the widest top-k asked."""
    rows, targets, k = [], [], 0
    for i, item in enumerate(batch):
        scored = prompt_positions(item.seq, int(computed[i]), item.num_new_tokens)
        if scored:
            first_row = int(query_start[i]) - int(computed[i])
            rows += [first_row + p for p in scored]
            targets += item.seq.token_ids[scored.start + 1:scored.stop + 1]
            k = max(k, item.seq.request.params.prompt_logprobs)
    return rows, targets, k


def logits_index(inputs: StepInputs, dev: torch.device) -> torch.Tensor | slice | None:
    """The token rows whose logits the step needs, on the device; None when no sequence samples; a slice of the
    first rows when those are all of them (a decode step: the hidden states are read in place, not gathered)."""
    rows = inputs.logits_rows
    if not rows:
        return None
    if rows[-1] == len(rows) - 1:  # rows ascend, so these are 0 .. n-1
        return slice(0, len(rows))
    return to_device(torch.tensor(rows, dtype=torch.long), dev)
