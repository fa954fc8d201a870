"""Request and Sequence: a request holds a prompt and SamplingParams; each of its n outputs is a Sequence.

A Sequence owns a block table per KV cache group (logical block i -> physical Block) and knows how many of its tokens
already have K/V in the cache (`num_computed_tokens`); everything past that is what the scheduler still
has to run. Sequences of one request share the prompt's blocks through ref counts.
"""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import torch

from engine.kv.block_pool import Block
from engine.core.detokenizer import IncrementalDetokenizer
from engine.core.outputs import Logprob, RequestMetrics
from engine.multimodal.inputs import MultiModalInputs
from engine.sample.pooling import RequestPooling
from engine.sample.metadata import make_generator
from engine.sample.sampling_params import SamplingParams

_seq_counter = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request: "Request", index: int, token_ids: list[int],
                 generator: torch.Generator | None) -> None:
        self.seq_id = next(_seq_counter)
        self.request = request
        self.index = index
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = request.num_prompt_tokens
        self.num_computed_tokens = 0
        # Tokens sampled on the device whose ids the host does not know yet (async scheduling: the next step was
        # scheduled before this one's results came back); they follow token_ids, and a decode feeds them on
        # the device. Always 0 without async scheduling.
        self.num_pending = 0
        self.block_tables: list[list[Block]] = [[]]  # per KV cache group; the manager makes one per group
        self.block_hashes: list[bytes] = []  # hash of each full block of token_ids, chained
        self.num_cached_blocks = 0  # leading blocks of block_table already registered in the prefix cache
        self.state_slot: int | None = None  # hybrid models: its slot of the linear-attention state pool
        self.kv_load_batch = 0  # the CPU-RAM tier's copy batch its prefix hit waits for (0: none)
        # Per group, the first table entry rewritten in place since the input batch last read the tables
        # (engine/worker/input_batch.py); appends need no mark.
        self.table_edits: dict[int, int] = {}
        self.status = SequenceStatus.WAITING
        self.generator = generator
        self.sampling_row = None  # its SamplingRow (engine/sample/metadata.py), made at its first sampling step
        # Only where logprobs were asked, as vLLM v1 reports it: the sampler then skips the others' logprobs.
        self.cumulative_logprob: float | None = 0.0 if request.params.logprobs is not None else None
        self.logprobs: list[dict[int, Logprob]] | None = [] if request.params.logprobs is not None else None
        self.detokenizer = IncrementalDetokenizer(request.tokenizer, request.params, self.num_prompt_tokens)
        self.grammar = None  # GrammarState of a structured-output request
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.spec_token_ids: list[int] = []  # speculative drafts for the next step (engine/spec_decode)
        self.num_draft_computed = 0  # leading tokens whose draft-model KV is valid
        self.draft_fed = 0  # positions the draft model last wrote KV for

    def __repr__(self) -> str:
        return (f"Sequence({self.request.request_id}#{self.index}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})")

    @property
    def block_table(self) -> list[Block]:
        """The first KV cache group's table (the only one of a model without sliding windows)."""
        return self.block_tables[0]

    def mark_table_edit(self, group: int, index: int) -> None:
        """Entry `index` of `group`'s table (or a later one) was replaced or the table shrank: the input
        batch rewrites that group's row from there."""
        self.table_edits[group] = min(index, self.table_edits.get(group, index))

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int, logprob: float | None, top: dict[int, Logprob] | None) -> None:
        self.token_ids.append(token_id)
        if self.cumulative_logprob is not None:
            self.cumulative_logprob += logprob
        if self.logprobs is not None and top is not None:
            self.logprobs.append(top)


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    tokenizer: object
    arrival_time: float
    seqs: list[Sequence] = field(default_factory=list)
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    aborted: bool = False
    beam: object | None = None  # BeamGroup for beam-search requests
    prompt_logprobs: list | None = None  # [None, {token id: Logprob}, ...] when params.prompt_logprobs is set
    cache_salt: str | None = None  # only requests with the same salt share prefix-cache blocks
    priority: int = 0  # --scheduling-policy priority: lower first
    paused: bool = False  # its caller has not read its outputs: its running sequences are not scheduled
    pooling: RequestPooling | None = None  # an embedding request: pooled, never sampled (engine/sample/pooling.py)
    mm: MultiModalInputs | None = None  # its images: spans, hashes, tensors, mRoPE positions (engine/multimodal)
    max_num_tokens: int = 0  # prompt + max_tokens, at most max_model_len: where a sequence ends as "length"
    # Async scheduling: its next step may be scheduled before this step's tokens reach the host (nothing about
    # it needs them there first: no grammar, penalties, bad words, min_tokens, prompt logprobs or beams).
    may_run_ahead: bool = False

    def __post_init__(self) -> None:
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        if self.beam is not None:
            return self.beam.done or self.aborted
        return len(self.seqs) == self.params.n and all(s.is_finished for s in self.seqs)

    def make_generator(self, index: int, device: torch.device) -> torch.Generator | None:
        """Seeded requests get their own generator per output, on the device that samples, so the batch
        around them never matters."""
        if self.params.seed is None or self.params.greedy:
            return None
        return make_generator((self.params.seed * 1_000_003 + index) % 2**63, device)
