"""Building the one proposer a speculative method needs, keyed by method (`METHODS`): `check_proposer` before
anything loads (ValueErrors name the speculative_config field), `load_proposer` once the target is loaded. The
engine sizes every proposer's KV the same way (engine/worker/kv_cache_sizing.choose_num_blocks: the proposer's
page at every block id shares the budget, engine/planning/kv.blocks_with_draft, which the planner shares).

A draft model: its folder resolved and checked against the target, its weights on the target's device, its KV
one tensor over the target's block ids. Under tensor parallel the draft lives on rank 0 only, whole (not
sharded): it is built and run inside `engine.distributed.parallel_state.single_rank`, so its layers take every
head and make no collective; its proposals then reach the other ranks as the verify step's input ids, exactly
like n-gram drafts. A small draft gains little from sharding, and this keeps the workers unaware of it
(draft_tensor_parallel_size is 1).

An MTP head: the class the target's family declares (engine/models/registry.py, `mtp_head`), its tensors in
the target checkpoint checked before anything loads, then loaded beside the target, its KV pages sharing the
block ids. Under tensor parallel it too runs whole on rank 0 (single_rank), reading rank 0's copy of the
target's last hidden states (replicated after the final norm); since the target's embedding and LM head are
vocab-sharded there, the head loads its own full copies of them (2 × vocab × hidden × dtype bytes on rank 0,
once if tied), which rank 0's memory profile measures and the planner counts (engine/planning/speculation
.mtp_footprint). The workers never see the head: its drafts reach them as the verify step's input ids.
Sharding the head like the target instead would save that memory but put the head's forwards into the worker
protocol."""
from __future__ import annotations

import logging

import torch

from engine.distributed.parallel_state import single_rank
from engine.kv.kv_cache_interface import FULL_ATTENTION, SLIDING_WINDOW, model_kv_layout
from engine.models.registry import mtp_head_class
from engine.worker.loader import iterate_weights, resolve_model_path, tensor_names
from engine.config.model import ModelConfig
from engine.config.speculative import SpeculativeConfig, check_draft_vocab, check_mtp_head
from engine.spec_decode.proposers.base import Proposer
from engine.spec_decode.proposers.draft import DraftProposer
from engine.spec_decode.proposers.mtp import MTPProposer
from engine.spec_decode.proposers.ngram import NgramProposer

logger = logging.getLogger("pagedesk.engine")


def check_proposer(spec: SpeculativeConfig | None, config, target_config: ModelConfig, model_path,
                   target_tokenizer) -> object:
    """The method's check, before anything loads: what `load_proposer` then builds from (None without
    speculation)."""
    if spec is None:
        return None
    check, _ = METHODS[spec.method]
    return check(spec, config, target_config, model_path, target_tokenizer)


def load_proposer(spec: SpeculativeConfig | None, checked, runner, model_path, backend: str) -> Proposer | None:
    """The method's proposer, from `check_proposer`'s answer, over the loaded target's `runner` (a
    TensorParallelExecutor drives rank 0's ModelRunner: the proposer works beside that one); None without
    speculation."""
    if spec is None:
        return None
    _, load = METHODS[spec.method]
    return load(checked, getattr(runner, "runner", runner), model_path, backend)


def check_ngram(spec: SpeculativeConfig, config, target_config: ModelConfig, model_path, target_tokenizer):
    """Nothing beyond the parsed config, which is what the proposer is built from."""
    return spec


def load_ngram(spec: SpeculativeConfig, runner, model_path, backend: str) -> NgramProposer:
    return NgramProposer(spec.k, spec.prompt_lookup_max, spec.prompt_lookup_min)


def check_draft(spec: SpeculativeConfig, config, target_config: ModelConfig, model_path, target_tokenizer):
    """The draft's (folder, ModelConfig), checked against the target before anything loads. ValueErrors name
    speculative_config.model."""
    from engine.core.tokenizer import load_tokenizer

    try:
        path = resolve_model_path(spec.model, None)
        draft_config = ModelConfig.from_folder(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"speculative_config.model {spec.model!r} cannot be loaded: "
                         f"{(str(exc).splitlines() or [''])[0]}") from None
    if draft_config.max_position_embeddings < target_config.max_model_len:
        raise ValueError(f"speculative_config.model: the draft's context ({draft_config.max_position_embeddings} "
                         f"tokens) is shorter than max_model_len ({target_config.max_model_len}); lower "
                         "--max-model-len")
    draft_config.with_max_model_len(target_config.max_model_len)
    try:
        draft_tokenizer = load_tokenizer(path)
    except (OSError, ValueError, TypeError):  # a folder of weights only: the vocabulary size still has to match
        draft_tokenizer = None
    check_draft_vocab(target_config.vocab_size, draft_config.vocab_size, target_tokenizer, draft_tokenizer)
    target_layout = model_kv_layout(target_config, config.block_size)
    if target_layout.groups[0].spec.kind != FULL_ATTENTION:
        raise ValueError("speculative_config.model: the target has no full-attention layers, whose block table "
                         "a draft model would share")
    if len(model_kv_layout(draft_config, config.block_size).groups) != 1:
        raise ValueError("speculative_config.model: the draft model has sliding-window layers; a draft must use "
                         "full attention in every layer")
    return path, draft_config


def load_draft(checked, runner, model_path, backend: str) -> DraftProposer:
    """The draft model's proposer, its weights loaded on the target's device, from `check_draft`'s answer."""
    from engine.worker.model_runner import ModelRunner  # the draft is built the way the target is

    path, draft_config = checked
    with single_rank():  # whole on rank 0, also under tensor parallel
        draft = ModelRunner(draft_config, path, runner.device, runner.dtype, runner.block_size, backend)
    logger.info("draft model %s: %s, %.0f MiB of weights", path, draft_config.architecture,
                draft.weights_bytes() / 2**20)
    return DraftProposer(draft)


def check_mtp(spec: SpeculativeConfig, config, target_config: ModelConfig, model_path,
              target_tokenizer=None) -> int:
    """The number of MTP layers the target checkpoint carries, checked before anything loads by the rule the
    app's settings form runs too (engine/config/speculative.check_mtp_head: a family that declares an MTP head in
    the registry, the head's tensors present, as many layers as the config states). ValueErrors name the field."""
    return check_mtp_head(target_config.architecture, target_config.hf_text_config, tensor_names(model_path),
                          f"the checkpoint {model_path}")


def load_mtp(num_layers: int, runner, model_path, backend: str) -> MTPProposer:
    """The MTPProposer over the target's ModelRunner (rank 0's under tensor parallel), with the head its family
    declares loaded from the checkpoint."""
    from engine.distributed.parallel_state import get_tp_size
    from engine.models.qwen3_next_mtp import FullVocab

    cfg = runner.config
    head_class = mtp_head_class(cfg.architecture)
    sharded = get_tp_size() > 1  # the target's embedding and LM head are vocab shards: the head needs its own
    torch.set_default_dtype(runner.dtype)
    try:
        with single_rank(), torch.device(runner.device):  # whole on rank 0, also under tensor parallel
            vocab = FullVocab(cfg) if sharded else None
            head = head_class(cfg, backend, runner.model, num_layers, vocab)
    finally:
        torch.set_default_dtype(torch.float32)
    # Loaded as it was built, as one rank: the layers' weight loaders ask the group's size and rank when they
    # load, and under tensor parallel would copy rank 0's shard of a stacked matrix into the whole parameter
    # (a gate/up projection's second half never written: uninitialized memory in every draft).
    with single_rank():
        head.load_weights(iterate_weights(model_path, device="cpu", prefix=head_class.checkpoint_prefix))
        if vocab is not None:
            load_full_vocab(vocab, model_path, runner.model.weights_mapper)
    head.eval()
    proposer = MTPProposer(runner, head)
    if vocab is None:
        logger.info("MTP head: %d layer(s), %.0f MiB of weights", num_layers, proposer.weights_bytes() / 2**20)
    else:
        logger.info("MTP head: %d layer(s), %.0f MiB of weights on rank 0, of which %.0f MiB are its own full "
                    "copies of the embedding and LM head (the target's are sharded over %d ranks)", num_layers,
                    proposer.weights_bytes() / 2**20, vocab.weights_bytes() / 2**20, get_tp_size())
    return proposer


def load_full_vocab(vocab, model_path, mapper) -> None:
    """Fill a FullVocab from the target checkpoint's embedding / LM head tensors (only those are read)."""
    names = vocab.checkpoint_names(tensor_names(model_path), mapper)
    vocab.load_weights(((name, tensor) for wanted in names
                        for name, tensor in iterate_weights(model_path, device="cpu", prefix=wanted)
                        if name == wanted), mapper)  # a prefix read of exactly that name
    vocab.eval()


def check_rollback(layout) -> None:
    """Rejected drafts are rolled back by not counting their KV slots (attention layers) and, for a hybrid
    model's state group, by verify rows that leave the state slot alone and a replay of the accepted tokens
    (engine/spec_decode/state_rollback.py). Any other layer kind cannot roll back and is refused."""
    kinds = {g.spec.kind for g in layout.groups} - {FULL_ATTENTION, SLIDING_WINDOW}
    if kinds:
        raise ValueError(f"speculative_config: this model has {sorted(kinds)} KV cache layers, which cannot roll "
                         "back rejected drafts; speculative decoding is not supported for it")


# method -> (its check before anything loads, its load from the check's answer once the target is loaded). A new
# method is a proposer class (engine/spec_decode/proposers/base.Proposer), its name in engine/config/speculative
# .METHODS and one line here.
METHODS = {
    "ngram": (check_ngram, load_ngram),
    "draft_model": (check_draft, load_draft),
    "mtp": (check_mtp, load_mtp),
}
