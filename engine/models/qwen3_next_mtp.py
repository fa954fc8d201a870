"""The multi-token-prediction head carried by Qwen3-Next and Qwen3.5/3.6 checkpoints (`mtp.*`), for method "mtp".

Its structure as vLLM reads these checkpoints (vllm/model_executor/models/qwen3_next_mtp.py and qwen3_5_mtp.py,
read for the names and the data flow, not copied): the next token is embedded with the target's `embed_tokens`,
that embedding and the target's last hidden state (the model's output after its final norm, which is what the
target returns) each go through their own (1 + w) RMSNorm (`mtp.pre_fc_norm_embedding`,
`mtp.pre_fc_norm_hidden`), are concatenated [embedding | hidden] and projected back to hidden_size by
`mtp.fc` (no bias), run through one decoder layer of the target's kind with full attention (`mtp.layers.0.*`:
gated attention with q/k norms and partial rotary, the MLP that layer index 0 of the target has — dense, or
routed experts with a gated shared expert) and `mtp.norm`; the target's `lm_head` gives the logits. The
head's output (after `mtp.norm`) is also what the next MTP step takes as its hidden state when more than one
token is drafted (vLLM's method "mtp": the same layer applied again, `spec_step_idx % mtp_num_hidden_layers`).
With one rank the embedding and the LM head are the target's own modules, held by reference and never loaded
twice. Under tensor parallel the target's are vocab-sharded, so the head, which runs whole on rank 0, gets its
own unsharded copies (`FullVocab`, read from the target's checkpoint names): 2 × vocab × hidden × dtype bytes
on rank 0 (one copy with tied embeddings). The layer's KV cache is its own tensor, bound like a draft model's
(engine/spec_decode/proposers/mtp.py).
"""
from __future__ import annotations

import dataclasses
from typing import Iterable

import torch
from torch import nn

from engine.layers.attention import AttentionMetadata, PagedAttention
from engine.layers.attention_block import SelfAttention
from engine.layers.decoder import DecoderLayer
from engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from engine.layers.linear import ColumnParallelLinear
from engine.layers.norm import GemmaRMSNorm
from engine.layers.rotary import rotary_embeddings
from engine.config.model import ModelConfig
from engine.models.qwen3_next import MTP_PREFIX, SHARED_EXPERT_INFIXES, Qwen3NextForCausalLM, hybrid_mlp
from engine.models.weights import PACKED_QKV_GATE_UP, WeightsMapper, load_weights

MTP_MAPPER = WeightsMapper(renamed_prefixes=((MTP_PREFIX, ""),), renamed_infixes=SHARED_EXPERT_INFIXES)
QUANTIZED_LEAVES = (".qweight", ".qzeros", ".scales", ".weight_packed", ".weight_scale", ".g_idx")


class FullVocab(nn.Module):
    """Unsharded copies of the target's embedding and LM head for the head on rank 0 under tensor parallel
    (build and load it inside engine.distributed.parallel_state.single_rank, so the vocab-parallel layers take
    every row and make no collective). Named like the target's own (model.embed_tokens, lm_head), so the target's
    weights mapper reads the checkpoint's names for it; an LM head tied to the embedding is one tensor, as in the
    target."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.tied = cfg.tie_word_embeddings

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.logits(hidden)

    def checkpoint_names(self, names: Iterable[str], mapper: WeightsMapper) -> list[str]:
        """The checkpoint's tensors that fill this module (read through the target's `mapper`)."""
        wanted = {"model.embed_tokens.weight"} | (set() if self.tied else {"lm_head.weight"})
        found = [n for n in names if mapper.map(n) in wanted]
        quantized = [n for n in names if (mapper.map(n) or "").startswith(("lm_head.", "model.embed_tokens."))
                     and mapper.map(n) not in ("lm_head.weight", "model.embed_tokens.weight")]  # a tied copy: skipped
        if quantized:
            raise ValueError(f"speculative_config.method \"mtp\" under tensor_parallel_size > 1: the checkpoint's "
                             f"embedding or LM head is stored as {quantized[0]!r}; the head's own full copy needs "
                             "them as float tensors")
        return found

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], mapper: WeightsMapper) -> None:
        load_weights(self, weights, packed_modules_mapping={}, mapper=mapper, tied_lm_head=self.tied)

    def weights_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())  # a tied tensor once


class Qwen3NextMTP(nn.Module):
    checkpoint_prefix = MTP_PREFIX  # its tensors in the target's checkpoint (families declaring it: the registry)

    def __init__(self, cfg: ModelConfig, backend: str, target: nn.Module, num_layers: int = 1,
                 vocab: FullVocab | None = None) -> None:
        """`target`: the loaded Qwen3NextForCausalLM (or a Qwen3.5 one) whose embedding and LM head are shared;
        `vocab`: full copies of them to use instead (tensor parallel: the target's are shards)."""
        super().__init__()
        h = cfg.hidden_size
        # Each MTP layer is full attention, with layer index i's MLP (vLLM builds it under the prefix
        # mtp.layers.i and reads its layer index from that). The head is kept in the checkpoint's float dtype:
        # the quantized checkpoints we load leave mtp.* unquantized (a quantized head is refused at load).
        layer_types = list(cfg.layer_types)
        layer_types[:num_layers] = ["full_attention"] * num_layers
        head_cfg = dataclasses.replace(cfg, quantization=None, layer_types=layer_types)
        self.fc = ColumnParallelLinear(2 * h, h, False, None, "mtp", ("fc",))
        self.pre_fc_norm_embedding = GemmaRMSNorm(h, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = GemmaRMSNorm(h, cfg.rms_norm_eps)
        rope = rotary_embeddings(head_cfg)["full_attention"]
        switches = Qwen3NextForCausalLM.decoder_switches(head_cfg)  # the target's layer kind (Qwen3.5's too)
        self.layers = nn.ModuleList(
            DecoderLayer(head_cfg, switches, SelfAttention(head_cfg, i, switches.attention, rope, backend,
                                                           PACKED_QKV_GATE_UP),
                         hybrid_mlp(head_cfg, i, PACKED_QKV_GATE_UP))
            for i in range(num_layers))
        self.norm = GemmaRMSNorm(h, cfg.rms_norm_eps)
        self.config = cfg
        # The target's modules (or rank 0's full copies), outside this module's parameters (loaded on their own).
        # Kept in a tuple, not as a submodule: the head's own load and parameters are the mtp.* tensors only.
        self._vocab = (vocab,)
        source = vocab if vocab is not None else target
        self._shared = (source.model.embed_tokens, source.compute_logits)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                meta: AttentionMetadata | None, step: int = 0) -> torch.Tensor:
        """`hidden`: the previous hidden state for each row (the target's, or this head's own at step > 0);
        `input_ids`: the token that follows it. Returns the head's hidden states after `mtp.norm`."""
        embed = self._shared[0](input_ids)
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embed), self.pre_fc_norm_hidden(hidden)], dim=-1))
        x, residual = self.layers[step % len(self.layers)](positions, x, None, meta)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._shared[1](hidden)

    @property
    def vocab(self) -> FullVocab | None:
        return self._vocab[0]

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The checkpoint's mtp.* tensors (every one accounted for, as for a whole model)."""
        def checked(pairs):
            for name, tensor in pairs:
                if name.endswith(QUANTIZED_LEAVES):
                    raise ValueError(f"speculative_config.method \"mtp\": the checkpoint's MTP head is quantized "
                                     f"({name}); only a float MTP head is supported")
                yield name, tensor
        load_weights(self, checked(weights), packed_modules_mapping=PACKED_QKV_GATE_UP, mapper=MTP_MAPPER)
