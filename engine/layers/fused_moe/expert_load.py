"""Expert load: routed token assignments per (MoE layer, expert), counted on the device with no host sync.

`ExpertLoad` holds one int64 tensor `counts` [num_moe_layers, num_experts] on the model's device; every
SparseMoeBlock bound to it adds its top-k ids with a scatter-add (each of a token's k choices counts once).
Only the first `num_valid` token rows of a forward count: the runner sets that number before each step's
forward and 0 after it (device fills, no copy), so the padding rows of a replayed CUDA graph and forwards
that are no step (profiling, warm-up, graph capture) add nothing, and the same ops sit inside a graph
without freezing the step's size. The row weights (1 valid, 0 padding) are made by the first MoE layer
of a forward and reused by the others (a pre-hook on the model drops them as a forward begins, so each
captured graph makes its own): one scatter kernel per layer. The counts reach the host only when statistics
are read (`totals`, one small copy), never inside a step. Under tensor parallel every rank routes alike:
only rank 0 binds one. Blocks outside the decoder stack (an MTP head) are not counted.

Under speculative decoding a verify step routes its draft tokens before anyone knows which are kept. With
`reserve_drafts`, every layer also keeps the routing of the step's draft rows (a static index buffer
`draft_rows`, set by `begin_step`, zero outside a step: the same ops in a graph), and once the rejection sampler
has spoken, `drop_rejected` takes the rejected drafts' choices back out in one scatter: the counts are those of
the tokens the sequences keep, as without speculation.
"""
from __future__ import annotations

import re

import torch
from torch import nn

LAYER_PREFIX = re.compile(r"^model\.(?:language_model\.)?layers\.(\d+)\.")


def decoder_layer_index(prefix: str) -> int | None:
    """The decoder layer of a module prefix ("model.layers.3.mlp" -> 3), None outside the decoder stack."""
    m = LAYER_PREFIX.match(prefix + ".")
    return None if m is None else int(m[1])


class ExpertLoad:
    def __init__(self, blocks: list[nn.Module], device: torch.device) -> None:
        """Bind every block (SparseMoeBlock, in model order) to a row of one counts tensor on `device`."""
        experts = {b.spec.num_experts for b in blocks}
        if len(experts) != 1:
            raise ValueError(f"expert load: MoE layers with different numbers of experts ({sorted(experts)}) "
                             "cannot share one [layers, experts] table")
        self.num_experts = experts.pop()
        self.layers = [b.layer_index for b in blocks]
        self.counts = torch.zeros(len(blocks), self.num_experts, dtype=torch.int64, device=device)
        self.num_valid = torch.zeros((), dtype=torch.int64, device=device)  # rows of the step: 0 until a step
        self.weights: torch.Tensor | None = None  # this forward's [T * k] int64 row weights
        self.top_k = blocks[0].spec.top_k
        # With speculation (reserve_drafts): the step's draft token rows (0 past them and outside a step) and
        # every layer's choices at those rows, [layers, max drafts, top_k].
        self.draft_rows: torch.Tensor | None = None
        self.draft_ids: torch.Tensor | None = None
        for row, block in enumerate(blocks):
            block.expert_load, block.expert_load_row = self, row

    @classmethod
    def bind(cls, model: nn.Module, device: torch.device) -> "ExpertLoad | None":
        """An ExpertLoad over the model's decoder MoE blocks (SparseMoeBlock: the modules with an `expert_load`
        slot), or None for a model without any."""
        blocks = [m for m in model.modules()
                  if hasattr(m, "expert_load") and getattr(m, "layer_index", None) is not None]
        if not blocks:
            return None
        load = cls(blocks, device)
        model.register_forward_pre_hook(load.new_forward)
        return load

    def new_forward(self, *_) -> None:
        """A forward begins (a model pre-hook): its first MoE layer makes the row weights afresh."""
        self.weights = None

    def reserve_drafts(self, max_drafts: int) -> None:
        """Room for `max_drafts` draft rows a step (max_num_seqs × k), before any graph is captured."""
        device = self.counts.device
        self.draft_rows = torch.zeros(max_drafts, dtype=torch.int64, device=device)
        self.draft_ids = torch.zeros(self.counts.shape[0], max_drafts, self.top_k, dtype=torch.int64, device=device)

    def begin_step(self, num_tokens: int, draft_rows: torch.Tensor | None = None) -> None:
        """Count the first `num_tokens` rows of the forwards that follow (the step's real tokens); `draft_rows`:
        the token rows of the step's draft tokens, on the device (a verify step; needs reserve_drafts)."""
        self.num_valid.fill_(num_tokens)
        if draft_rows is not None:
            self.draft_rows[:len(draft_rows)].copy_(draft_rows, non_blocking=True)

    def end_step(self) -> None:
        self.num_valid.fill_(0)
        if self.draft_rows is not None:
            self.draft_rows.zero_()  # forwards that are no step index row 0, which every forward has

    def drop_rejected(self, rejected: torch.Tensor) -> None:
        """Take the rejected drafts' choices back out: `rejected` [drafts] int64 (1 rejected, 0 kept), in
        `draft_rows` order, on the device; device ops only."""
        n, layers = len(rejected), self.counts.shape[0]
        weights = -rejected[:, None].expand(n, self.top_k).reshape(1, -1).expand(layers, -1)
        self.counts.scatter_add_(1, self.draft_ids[:, :n].reshape(layers, -1), weights)

    def record(self, row: int, topk_ids: torch.Tensor) -> None:
        """counts[row, e] += the valid tokens routed to e, for topk_ids [T, k]; device ops only."""
        t, k = topk_ids.shape
        if self.weights is None or self.weights.shape[0] != t * k:
            valid = (torch.arange(t, device=topk_ids.device) < self.num_valid).to(torch.int64)
            # expand, not repeat_interleave: that one may size its output on the host
            self.weights = valid[:, None].expand(t, k).reshape(-1)
        self.counts[row].scatter_add_(0, topk_ids.reshape(-1), self.weights)
        if self.draft_rows is not None:  # the draft rows' choices, in case the rejection sampler drops some
            self.draft_ids[row].copy_(topk_ids.index_select(0, self.draft_rows))

    def totals(self) -> dict:
        """Cumulative counts on the host: {"num_experts", "layers", "tokens": [[int] * E per layer]}."""
        return {"num_experts": self.num_experts, "layers": list(self.layers), "tokens": self.counts.tolist()}
