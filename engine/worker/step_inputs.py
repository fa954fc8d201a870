"""What one engine step hands the model runner and gets back: StepInputs (flat, device-free, picklable: what
rank 0 publishes to tensor-parallel workers through the step ring) and ModelRunnerOutput (host-side and small),
with the two helpers that turn a scheduled sequence into its query tokens and logits rows.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.worker.input_batch import BatchDiff
from engine.sample.pooling import PooledOutput
from engine.sample.prompt_logprobs import PromptLogprobsOutput
from engine.sample.sampler import PendingSamples, SamplerOutput
from engine.core.scheduler import ScheduledSeq
from engine.sample.rejection_sampler import SpecSampleOutput
from engine.spec_decode.state_rollback import StateReplay


@dataclass(slots=True)
class StepInputs:
    """One step's flat model inputs, device-free and picklable (what rank 0 sends each worker).

    The block tables travel as a diff of the persistent input batch (engine/worker/input_batch.py): `table_diff`
    brings each rank's copy up to date and `rows` picks this step's sequences from it. Callers that hold a
    whole table instead (tests, tools) pass `block_tables` and leave the rest None."""

    input_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64 (mRoPE: [3, num_tokens] in a step with an image's placeholders)
    slot_mapping: np.ndarray  # [num_tokens] int64
    seq_lens: np.ndarray  # [num_seqs] int32
    query_start_loc: np.ndarray  # [num_seqs + 1] int32
    logits_rows: list[int]  # token row of each sampling sequence's last position
    max_query_len: int
    max_seq_len: int
    block_copies: list[tuple[int, int]]  # copy-on-write (src, dst) block ids, applied before the forward
    prompt_logits_rows: list[int] = field(default_factory=list)  # token rows whose next prompt token is scored
    prompt_targets: list[int] = field(default_factory=list)  # that next prompt token, per row
    prompt_logprobs_k: int = 0  # top-k width asked by the step's prompt-logprobs requests
    group_slot_mappings: np.ndarray | None = None  # [num_groups - 1, num_tokens] int64 (sliding-window models)
    rows: np.ndarray | None = None  # [num_seqs] int64: each sequence's row of the input batch
    table_width: int = 0  # block-table columns this step reads (the longest table)
    table_diff: BatchDiff | None = None
    # Whole tables, without an input batch: [num_seqs, max_blocks] and [num_groups - 1, num_seqs, max_blocks].
    block_tables: np.ndarray | None = None
    group_block_tables: np.ndarray | None = None

    @property
    def width(self) -> int:
        return self.block_tables.shape[1] if self.block_tables is not None else self.table_width
    # Hybrid models (linear-attention layers): each sequence's state slot, whether it continues a state (some
    # tokens already computed: a later prompt chunk, a decode, a prefix hit), and state copies applied first.
    state_indices: np.ndarray | None = None  # [num_seqs] int32
    has_initial_state: np.ndarray | None = None  # [num_seqs] bool
    state_copies: list[tuple[int, int]] = field(default_factory=list)  # (src slot, dst slot), in order
    # Speculative verify rows of a hybrid model (engine/spec_decode/state_rollback.py): the previous verify
    # step's accepted tokens, replayed into their slots first; this step's read-only rows and their tokens.
    state_replay: StateReplay | None = None
    state_read_only: np.ndarray | None = None  # [num_seqs] bool
    verify_token_rows: np.ndarray | None = None  # [num_verify_tokens] int64
    # Embedding requests (engine/sample/pooling.py): batch index and token rows [a, b) of each pooled sequence.
    pool_owners: list[int] = field(default_factory=list)
    pool_spans: list[tuple[int, int]] = field(default_factory=list)
    # Images (engine/worker/encoder_runner.py): encoder entries to drop, images to encode (content hash, the
    # processor's tensors), and where the step's placeholder rows take their embeddings from: per run of rows,
    # (content hash, first embedding, last + 1), the runs' rows concatenated in `mm_rows`.
    mm_free: list[str] = field(default_factory=list)
    mm_encode: list[tuple[str, dict]] = field(default_factory=list)
    mm_slices: list[tuple[str, int, int]] = field(default_factory=list)
    mm_rows: np.ndarray | None = None  # [num_placeholder_rows] int64
    # Gemma's bidirectional image attention (kernels/image_mask.py): per token row, the position its keys may
    # reach, exclusive; None when no row lies in an image.
    key_limits: np.ndarray | None = None  # [num_tokens] int32
    # Async scheduling: token rows whose id the last step sampled and the host does not know yet (input_ids holds
    # PENDING_TOKEN there), and each one's row among that step's sampled tokens, read on the device.
    pending_rows: np.ndarray | None = None  # [num_pending] int64
    pending_sources: np.ndarray | None = None  # [num_pending] int64


@dataclass(slots=True)
class ModelRunnerOutput:
    """What a step hands back to the engine: host-side and small, never `[batch, vocab]` logits."""

    sampled: SamplerOutput | None = None  # one entry per SamplingBatch row
    beam_logprobs: list[list[float]] | None = None  # per beam row: its top next-token log-probs, best first
    beam_ids: list[list[int]] | None = None  # and their token ids
    prompt_logprobs: PromptLogprobsOutput | None = None  # over StepInputs.prompt_logits_rows, in order
    spec: SpecSampleOutput | None = None  # speculative verify rows: per sequence, the tokens it emits
    pooled: PooledOutput | None = None  # embedding requests' pooled hidden states (engine/sample/pooling.py)
    pending: PendingSamples | None = None  # async scheduling: `sampled` still on its way to the host

    def result(self) -> "ModelRunnerOutput":
        """This output with its sampled tokens on the host (a launched step: waits for the device's copy)."""
        if self.pending is not None:
            self.sampled, self.pending = self.pending.wait(), None
        return self


PENDING_TOKEN = -1  # an input id the device fills in (async scheduling); never a real token, so never silent


def query_tokens(item: ScheduledSeq) -> list[int]:
    """The token ids a scheduled sequence feeds this step: its next chunk, or its last token and drafts; a token
    still on its way from the device (async scheduling) is PENDING_TOKEN."""
    seq, start = item.seq, item.seq.num_computed_tokens
    if item.num_draft_tokens:
        return seq.token_ids[start:] + seq.spec_token_ids
    if item.num_pending:
        return seq.token_ids[start:start + item.num_new_tokens - 1] + [PENDING_TOKEN]
    return seq.token_ids[start:start + item.num_new_tokens]


def logits_rows(batch: list[ScheduledSeq], query_start: np.ndarray, samples: np.ndarray) -> list[int]:
    """Token rows whose logits the step needs: each sampling sequence's last, and with drafts all 1 + k."""
    ends = query_start[1:]
    if not any(item.num_draft_tokens for item in batch):
        return (ends[samples] - 1).tolist()
    rows = []
    for i, item in enumerate(batch):
        if samples[i]:
            rows += range(int(ends[i]) - 1 - item.num_draft_tokens, int(ends[i]))
    return rows
