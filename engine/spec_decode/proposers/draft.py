"""Draft-model proposer: a small model with the target's vocabulary proposes k tokens per sequence.

The draft has its own weights and its own KV tensor, addressed by the target's block ids (group 0, full
attention: the scheduler already allocated slots for the 1 + k verify positions, which cover every
position the draft writes). Each proposal first catches the draft up on the tokens it has not seen
(the whole prompt the first time, then the one or two tokens the last verify step added), then runs
k - 1 one-token steps. Greedy requests take the draft's argmax; sampled ones draw from the draft's
softmax(logits / temperature), whose rows are kept on the device as q for the rejection sampler.
A sequence's `num_draft_computed` says how much of its draft KV is valid (reset on preemption), updated
after each verify step to what the target kept. Before scheduling a sequence asks for k placeholders; the
drafts replace them once the scheduler has given it slots. Under tensor parallel the draft runs on rank 0
alone (`single_rank`: no collectives; engine/spec_decode/loading.py), and its tokens reach the other ranks in
the verify step's input ids.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.distributed.parallel_state import single_rank
from engine.kv.kv_cache_interface import model_kv_layout
from engine.spec_decode.proposers.base import Proposer
from engine.spec_decode.proposers.feeds import feed_metadata


@dataclass(slots=True)
class DraftRequest:
    """One sequence's proposal: what the draft has not seen yet, where it starts, how many drafts."""

    seq: object  # Sequence
    num_drafts: int


class DraftProposer(Proposer):
    name = "draft model"

    def __init__(self, runner) -> None:
        """`runner`: a ModelRunner holding the draft's weights (its KV cache allocated like the target's)."""
        self.runner = runner  # its layout has one full-attention group (engine/spec_decode/loading.check_draft)

    def propose_before_schedule(self, seq, max_drafts: int) -> list[int]:
        return [0] * max_drafts  # placeholders: the draft runs once the scheduler has given them slots

    def fill_drafts(self, scheduled: list, block_copies: list[tuple[int, int]],
                    generator: torch.Generator | None) -> torch.Tensor | None:
        self.runner.copy_blocks(list(block_copies))  # copy-on-write blocks: the draft's half of every step's copy
        items = [item for item in scheduled if item.num_draft_tokens]
        if not items:
            return None
        drafts, q = self.propose([DraftRequest(i.seq, i.num_draft_tokens) for i in items], generator)
        for item, tokens in zip(items, drafts):
            item.seq.spec_token_ids = tokens
        return q

    def after_step(self, verified: list) -> None:
        for item in verified:  # the draft's KV stays valid up to what the target kept
            item.seq.num_draft_computed = min(item.seq.draft_fed, item.seq.num_computed_tokens)

    def weights_bytes(self) -> int:
        return self.runner.weights_bytes()

    def kv_bytes_per_block(self, kv_dtype_bytes: int) -> int:
        return model_kv_layout(self.runner.config, self.runner.block_size, kv_dtype_bytes).bytes_per_block

    def allocate_kv_cache(self, num_blocks: int, kv_dtype: torch.dtype) -> None:
        self.runner.allocate_kv_cache(num_blocks, kv_dtype)

    def kv_cache_bytes(self) -> int:
        return self.runner.kv_cache_bytes()

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest],
                generator: torch.Generator | None) -> tuple[list[list[int]], torch.Tensor | None]:
        """Drafts per request and q: [sum(num_drafts), vocab] on the device, rows in request order, or None
        when every request is greedy (the rejection sampler then needs no q)."""
        with single_rank():
            return self._propose(requests, generator)

    def _propose(self, requests: list[DraftRequest],
                 generator: torch.Generator | None) -> tuple[list[list[int]], torch.Tensor | None]:
        drafts: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor | None]] = [[] for _ in requests]
        any_sampled = any(not r.seq.params.greedy for r in requests)
        # First forward: each sequence's unseen tokens, ending at its last token.
        feeds = []
        for r in requests:
            seq = r.seq
            start = min(seq.num_draft_computed, seq.num_tokens - 1)
            feeds.append((seq.token_ids[start:], start))
        active = list(range(len(requests)))
        for step in range(max((r.num_drafts for r in requests), default=0)):
            logits = self._forward([requests[i].seq for i in active], feeds)
            tokens, q = self._draw(logits, [requests[i].seq for i in active], generator, any_sampled)
            next_active, feeds = [], []
            for row, i in enumerate(active):
                drafts[i].append(tokens[row])
                probs[i].append(None if q is None else q[row])
                if len(drafts[i]) < requests[i].num_drafts:
                    next_active.append(i)
                    feeds.append(([tokens[row]], requests[i].seq.num_tokens + step))
            for i in active:  # positions the draft has KV for now (valid while the drafts are accepted)
                seq = requests[i].seq
                seq.draft_fed = seq.num_tokens + len(drafts[i]) - 1
            active = next_active
        q_all = torch.stack([p for ps in probs for p in ps]) if any_sampled and requests else None
        return drafts, q_all

    def _forward(self, seqs: list, feeds: list[tuple[list[int], int]]) -> torch.Tensor:
        """One draft forward over each sequence's fed tokens (at positions start..); logits at each last row."""
        runner, dev = self.runner, self.runner.device
        lens = np.array([len(t) for t, _ in feeds], dtype=np.int64)
        starts = np.array([s for _, s in feeds], dtype=np.int64)
        tables = [[b.block_id for b in seq.block_tables[0]] for seq in seqs]
        positions, meta = feed_metadata(tables, starts, lens, runner.block_size, dev)
        input_ids = np.fromiter((t for toks, _ in feeds for t in toks), np.int64, int(lens.sum()))
        query_start = np.cumsum(lens)
        hidden = runner.model(torch.from_numpy(input_ids).to(dev), torch.from_numpy(positions).to(dev), meta)
        last = torch.from_numpy(query_start - 1).to(dev)
        return runner.model.compute_logits(hidden[last]).float()

    @staticmethod
    def _draw(logits: torch.Tensor, seqs: list, generator: torch.Generator | None,
              any_sampled: bool) -> tuple[list[int], torch.Tensor | None]:
        chosen = logits.argmax(dim=-1)
        q = None
        if any_sampled:
            temps = torch.tensor([s.params.temperature if not s.params.greedy else 1.0 for s in seqs],
                                 device=logits.device)
            q = torch.softmax(logits / temps[:, None], dim=-1)
            noise = torch.empty_like(q)
            noise.exponential_(generator=generator)
            for i, seq in enumerate(seqs):
                if seq.generator is not None:
                    noise[i].exponential_(generator=seq.generator)
            drawn = (q / noise).argmax(dim=-1)
            sampled = torch.tensor([not s.params.greedy for s in seqs], device=logits.device)
            chosen = torch.where(sampled, drawn, chosen)
        return chosen.tolist(), q
