"""MTP proposer: the target checkpoint's multi-token-prediction head (the class its family declares in
engine/models/registry.py, e.g. engine/models/qwen3_next_mtp.py) drafts k tokens per sequence from the target's
own last hidden states.

The head's KV at position p holds (the target's hidden state at p, the token at p + 1) — vLLM's layout: the
target's positions, the input ids shifted left by one. So after every target step the head catches up on
the positions the step computed and kept (a prompt chunk, a decode, the accepted part of a verify run),
reading their hidden states from the model runner (`ModelRunner.keep_hidden`) before the next forward
overwrites them; every position's next token is known by then (the next prompt token, or the token just
sampled). The catch-up's last row of a sequence that decodes next gives its first draft and the head's
hidden state there (`pending`): before scheduling the sequence asks for that draft and k - 1 placeholders. The
other k - 1 drafts are made after scheduling, when the verify step's slots exist: the head is applied again on
its own hidden state and the draft before (vLLM's method "mtp").
Drafts are the head's argmax for every request: for sampled requests the rejection sampler then treats q
as one-hot at the draft (accept with p(d)), which keeps the output distribution exact.

The KV lives in its own tensor addressed by the target's block ids (group 0, full attention) and gets the
same copy-on-write copies. Positions it has no hidden state for — a prefix-cache hit's cached blocks, beam
search sequences, the last prompt position under a child forked by n > 1 — keep whatever the head wrote
there before: only the drafts' quality depends on them, never the output. Under tensor parallel the head
runs whole on rank 0 (`single_rank`), on rank 0's hidden states (replicated after the target's final norm), with
its own full embedding and LM head (engine/spec_decode/loading.load_mtp); the workers see only its drafts, in
the verify step's input ids.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.distributed.parallel_state import single_rank
from engine.kv.block_pool import kv_pages
from engine.platform.host_copies import to_device
from engine.spec_decode.proposers.base import Proposer
from engine.spec_decode.proposers.feeds import feed_metadata


@dataclass(slots=True)
class PendingDraft:
    """A sequence's first draft, made by the catch-up after the step that computed its last position."""

    seq: object  # Sequence
    num_tokens: int  # the sequence's length then: the draft is for this state only
    token: int
    hidden: torch.Tensor  # [hidden_size]: the head's output at the sequence's last computed position


class MTPProposer(Proposer):
    name = "MTP head"

    def __init__(self, target_runner, head) -> None:
        """`target_runner`: the target's ModelRunner (its hidden states are kept for the catch-up); `head`: the
        loaded MTP head (e.g. Qwen3NextMTP), on the same device."""
        self.runner, self.head = target_runner, head
        self.device, self.block_size = target_runner.device, target_runner.block_size
        target_runner.keep_hidden = True
        self.kv_cache: torch.Tensor | None = None
        self.pending: dict[int, PendingDraft] = {}  # seq_id -> its first draft
        self._step_starts: list[tuple[object, int, int]] = []  # this step's (seq, num_computed before, first row)

    def propose_before_schedule(self, seq, max_drafts: int) -> list[int]:
        first = self.draft_for(seq)  # made by the last step's catch-up; the rest follow after scheduling
        return [] if first is None else [first] + [0] * (max_drafts - 1)

    def fill_drafts(self, scheduled: list, block_copies: list[tuple[int, int]],
                    generator: torch.Generator | None) -> torch.Tensor | None:
        """Drafts are the head's argmax for every request (q one-hot: None). Notes where each scheduled sequence
        starts in the step's hidden states, for the catch-up after it."""
        self.copy_blocks(list(block_copies))  # every step: a child's copied block carries the head's KV too
        self._step_starts, row = [], 0
        for item in scheduled:
            self._step_starts.append((item.seq, item.seq.num_computed_tokens, row))
            row += item.num_new_tokens
        items = [item for item in scheduled if item.num_draft_tokens]
        if items:
            for item, tokens in zip(items, self.propose([(i.seq, i.num_draft_tokens) for i in items])):
                item.seq.spec_token_ids = tokens
        return None

    def after_step(self, verified: list) -> None:
        steps, self._step_starts = self._step_starts, []
        self.catch_up(steps)

    def kv_bytes_per_block(self, kv_dtype_bytes: int) -> int:
        attn = self.head.attention_layers()
        return sum(2 * self.block_size * a.num_kv_heads * a.head_dim * kv_dtype_bytes for a in attn)

    def allocate_kv_cache(self, num_blocks: int, kv_dtype: torch.dtype) -> None:
        """The head's pages at the target's block ids (page 0: the reserved null block's)."""
        attn = self.head.attention_layers()
        shape = (len(attn), 2, kv_pages(num_blocks), self.block_size, attn[0].num_kv_heads, attn[0].head_dim)
        self.kv_cache = torch.zeros(shape, dtype=kv_dtype, device=self.device)
        for i, layer in enumerate(attn):
            layer.bind_cache(self.kv_cache[i, 0], self.kv_cache[i, 1])

    def weights_bytes(self) -> int:
        """The head's mtp.* tensors, plus its own full embedding and LM head under tensor parallel (with one
        rank it shares the target's, which are not counted here)."""
        own = sum(p.numel() * p.element_size() for p in self.head.parameters())
        return own + (0 if self.head.vocab is None else self.head.vocab.weights_bytes())

    def kv_cache_bytes(self) -> int:
        return 0 if self.kv_cache is None else self.kv_cache.numel() * self.kv_cache.element_size()

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """The head's half of the step's copy-on-write block copies (before anything writes the new blocks)."""
        if copies and self.kv_cache is not None:
            pairs = to_device(torch.tensor(copies, dtype=torch.long), self.device)
            cache = self.kv_cache.view(torch.uint8) if self.kv_cache.element_size() == 1 else self.kv_cache
            cache[:, :, pairs[:, 1]] = cache[:, :, pairs[:, 0]]

    def draft_for(self, seq) -> int | None:
        """The sequence's first draft, if the catch-up made one for its current length."""
        pending = self.pending.get(seq.seq_id)
        if pending is None or pending.seq is not seq or pending.num_tokens != seq.num_tokens:
            return None
        return pending.token

    def catch_up(self, steps: list[tuple[object, int, int]]) -> None:
        """After a target step: `steps` holds, per sequence of the step in batch order, (sequence, its
        num_computed_tokens before the step, its first row in the step's hidden states). Feeds the head every
        position the step computed and kept, and makes the first draft of each sequence that decodes next."""
        with single_rank(), torch.inference_mode():  # the head is whole on rank 0: no collectives
            self._catch_up(steps)

    def _catch_up(self, steps: list[tuple[object, int, int]]) -> None:
        hidden = self.runner.last_hidden
        self.runner.last_hidden = None  # the next forward's; nothing else holds the step's hidden states
        feeds = []
        for seq, start, row in steps:
            if seq.is_finished or seq.request.beam is not None:
                continue
            end = seq.num_computed_tokens  # positions start..end-1 were computed and kept
            if end <= start:
                continue
            feeds.append((seq, start, end - start, row))
        if hidden is None or not feeds:
            self._prune()
            return
        starts = np.array([f[1] for f in feeds], dtype=np.int64)
        lens = np.array([f[2] for f in feeds], dtype=np.int64)
        rows = np.concatenate([np.arange(row, row + n) for _, _, n, row in feeds])
        # The token after each position: the next prompt token, an accepted draft, or the token just sampled.
        ids = np.fromiter((t for seq, start, n, _ in feeds for t in seq.token_ids[start + 1:start + 1 + n]),
                          np.int64, int(lens.sum()))
        positions, meta = feed_metadata([[b.block_id for b in f[0].block_tables[0]] for f in feeds], starts, lens,
                                        self.block_size, self.device)
        rows_t = to_device(torch.from_numpy(rows), self.device)
        out = self.head(to_device(torch.from_numpy(ids), self.device),
                        to_device(torch.from_numpy(positions), self.device), hidden[rows_t], meta)
        decoding = [i for i, (seq, start, n, _) in enumerate(feeds) if start + n == seq.num_tokens - 1]
        if decoding:
            last = np.cumsum(lens)[decoding] - 1
            last_h = out[to_device(torch.from_numpy(last), self.device)]
            tokens = self.head.compute_logits(last_h).argmax(dim=-1).tolist()
            for j, i in enumerate(decoding):
                seq = feeds[i][0]
                self.pending[seq.seq_id] = PendingDraft(seq, seq.num_tokens, tokens[j], last_h[j])
        self._prune()

    def _prune(self) -> None:
        self.pending = {sid: p for sid, p in self.pending.items()
                        if not p.seq.is_finished and p.num_tokens == p.seq.num_tokens}

    def propose(self, requests: list[tuple[object, int]]) -> list[list[int]]:
        """After scheduling: each (sequence, drafts it got slots for) -> its drafts, the first from `pending`
        and the rest from the head applied again, one position further each time."""
        with single_rank(), torch.inference_mode():
            return self._propose(requests)

    def _propose(self, requests: list[tuple[object, int]]) -> list[list[int]]:
        drafts = [[self.pending[seq.seq_id].token] for seq, _ in requests]
        active = [i for i, (_, n) in enumerate(requests) if n > 1]
        if not active:
            return drafts
        hidden = torch.stack([self.pending[requests[i][0].seq_id].hidden for i in active])
        step = 1
        while active:
            seqs = [requests[i][0] for i in active]
            # Draft `step` sits at position num_computed + step - 1 (the last token is at num_computed).
            starts = np.array([s.num_computed_tokens + step - 1 for s in seqs], dtype=np.int64)
            lens = np.ones(len(seqs), dtype=np.int64)
            positions, meta = feed_metadata([[b.block_id for b in s.block_tables[0]] for s in seqs], starts, lens,
                                            self.block_size, self.device)
            ids = torch.tensor([drafts[i][-1] for i in active], dtype=torch.long)
            out = self.head(to_device(ids, self.device), to_device(torch.from_numpy(positions), self.device),
                            hidden, meta, step)
            tokens = self.head.compute_logits(out).argmax(dim=-1).tolist()
            keep = []
            for row, i in enumerate(active):
                drafts[i].append(tokens[row])
                if len(drafts[i]) < requests[i][1]:
                    keep.append(row)
            active = [active[r] for r in keep]
            hidden = out[to_device(torch.tensor(keep, dtype=torch.long), self.device)] if keep else out[:0]
            step += 1
        return drafts
