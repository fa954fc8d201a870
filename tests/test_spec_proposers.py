"""The proposer protocol (engine/spec_decode/proposers/base.py): the Speculator drives any proposer through the
same hooks and never asks which method it is (nor imports one); KV sizing shares the pool with any proposer's
page; a family declares its MTP head in the registry, which the engine's check and the planner both ask, so a
second family with that head is one registry field."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from engine.config.flags import EngineConfig
from engine.config.model import ModelConfig
from engine.config.speculative import parse_speculative_config
from engine.models import registry
from engine.planning.speculation import mtp_footprint
from engine.planning.kv import blocks_with_draft
from engine.sample.sampling_params import SamplingParams
from engine.spec_decode.proposers.base import Proposer
from engine.spec_decode.proposers.ngram import NgramProposer
from engine.spec_decode.speculator import SpecBatch, Speculator

VOCAB = 16


class Recording(Proposer):
    """Drafts 5, 6, 7... before scheduling; after it, each drafted sequence's drafts become 9s with a q row each."""

    name = "recording"

    def __init__(self) -> None:
        self.calls = []

    def propose_before_schedule(self, seq, max_drafts):
        self.calls.append(("propose", seq.seq_id, max_drafts))
        return list(range(5, 5 + max_drafts))

    def fill_drafts(self, scheduled, block_copies, generator):
        self.calls.append(("fill", [item.seq.seq_id for item in scheduled], list(block_copies)))
        rows = 0
        for item in scheduled:
            if item.num_draft_tokens:
                item.seq.spec_token_ids = [9] * item.num_draft_tokens
                rows += item.num_draft_tokens
        return torch.arange(rows, dtype=torch.float32)[:, None].expand(rows, VOCAB)  # row r holds r

    def after_step(self, verified):
        self.calls.append(("after", [item.seq.seq_id for item in verified]))


def seq(seq_id, num_tokens, num_computed, max_tokens=None):
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    request = SimpleNamespace(request_id=f"r{seq_id}", beam=None, params=params, paused=False)
    return SimpleNamespace(seq_id=seq_id, token_ids=list(range(1, num_tokens + 1)), num_tokens=num_tokens,
                           num_computed_tokens=num_computed, num_output_tokens=2, num_prompt_tokens=num_tokens - 2,
                           params=params, request=request, generator=None, grammar=None, spec_token_ids=[])


def test_the_speculator_drives_any_proposer_through_the_same_hooks():
    proposer = Recording()
    spec = Speculator(parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3}), 100, [0], VOCAB,
                      proposer)
    decoding, capped, prefilling, idle = seq(1, 10, 9), seq(2, 10, 9, max_tokens=4), seq(3, 10, 4), seq(4, 10, 9)
    spec.propose_before_schedule([decoding, capped, prefilling])
    # Only sequences that decode next are asked, each capped so max_tokens is never passed (4 - 2 - 1 = 1).
    assert proposer.calls == [("propose", 1, 3), ("propose", 2, 1)]
    assert (decoding.spec_token_ids, capped.spec_token_ids, prefilling.spec_token_ids) == ([5, 6, 7], [5], [])
    scheduled = [SimpleNamespace(seq=decoding, num_draft_tokens=2, num_new_tokens=3),  # the scheduler trimmed one
                 SimpleNamespace(seq=idle, num_draft_tokens=0, num_new_tokens=1),
                 SimpleNamespace(seq=capped, num_draft_tokens=1, num_new_tokens=2)]
    spec.fill_drafts(scheduled, [(3, 4)], None)
    assert proposer.calls[-1] == ("fill", [1, 4, 2], [(3, 4)])
    # The verify rows, with the q rows each sequence's drafts were drawn from (capped's planned first here).
    batch = SpecBatch()
    spec.plan_rows(batch, capped, 0, None)
    spec.plan_rows(batch, decoding, 2, None)
    spec.finish_batch(batch)
    assert batch.draft_token_ids == [[9], [9, 9]] and batch.logits_index == [0, 1, 2, 3, 4]
    assert batch.draft_probs[:, 0].tolist() == [2.0, 0.0, 1.0]
    result = SimpleNamespace(spec=SimpleNamespace(num_accepted=[1, 0]))
    spec.after_step([scheduled[0], scheduled[2]], result)
    assert proposer.calls[-1] == ("after", [1, 2])
    assert (spec.stats.num_drafts, spec.stats.num_draft_tokens, spec.stats.num_accepted_tokens) == (2, 3, 1)
    spec.after_step(scheduled, None)  # a step without verify rows: the proposer still hears of it
    assert proposer.calls[-1] == ("after", [])


def test_the_speculator_imports_no_proposer():
    """The engine core may import the speculator without the worker or the models that drafts need (the model
    registry, plain data that the speculative config reads, aside)."""
    code = ("import sys, engine.spec_decode.speculator; print(sorted(m for m in sys.modules if m.startswith(("
            "'engine.spec_decode.proposers.', 'engine.worker', 'engine.models', 'engine.layers'))"
            " and m not in ('engine.models', 'engine.models.registry')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['engine.spec_decode.proposers.base']"


def test_ngram_holds_nothing():
    ngram = NgramProposer(3, 3, 1)
    assert ngram.propose_before_schedule(SimpleNamespace(token_ids=[4, 1, 4]), 1) == [1]
    assert ngram.fill_drafts([], [], None) is None
    assert (ngram.weights_bytes(), ngram.kv_bytes_per_block(2), ngram.kv_cache_bytes()) == (0, 0, 0)


class Paged(Recording):
    """A proposer with a model: weights, and a KV page at every block id."""

    def weights_bytes(self):
        return 5000

    def kv_bytes_per_block(self, kv_dtype_bytes):
        return 3000 * kv_dtype_bytes


def test_the_pool_is_shared_with_any_proposers_kv_page(llama_dir):
    from engine.kv.kv_cache_interface import model_kv_layout
    from engine.worker.kv_cache_sizing import choose_num_blocks

    cfg = ModelConfig.from_folder(llama_dir)
    config = EngineConfig(model=str(llama_dir), kv_cache_memory=0.01, max_num_seqs=4)
    runner = SimpleNamespace(device=torch.device("cpu"), weights_bytes=lambda: 10_000)
    alone = choose_num_blocks(config, cfg, runner, torch.float32, 256)
    assert choose_num_blocks(config, cfg, runner, torch.float32, 256, NgramProposer(3, 3, 1)) == alone
    target = model_kv_layout(cfg, config.block_size, 4).bytes_per_block
    shared = choose_num_blocks(config, cfg, runner, torch.float32, 256, Paged())
    assert shared == blocks_with_draft(alone, target, 12_000) < alone


MTP_FAMILIES = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration",
                "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")


def test_a_family_declares_its_mtp_head(tiny_model_dir, monkeypatch):
    assert {name for name, arch in registry.ARCHITECTURES.items() if arch.mtp_head} == set(MTP_FAMILIES)
    from engine.models.qwen3_next_mtp import Qwen3NextMTP
    assert registry.mtp_head_class("Qwen3_5ForCausalLM") is Qwen3NextMTP
    llama = ModelConfig.from_folder(tiny_model_dir("llama"))
    for ask in (lambda: registry.mtp_head("LlamaForCausalLM"), lambda: mtp_footprint(llama, 2, 2, 16)):
        with pytest.raises(ValueError, match='speculative_config.method "mtp": LlamaForCausalLM has no multi-token'):
            ask()
    # A second family with the same head: one registry field, and the engine's check and the planner agree.
    cfg = ModelConfig.from_folder(tiny_model_dir("qwen3_5"))
    monkeypatch.setitem(registry.ARCHITECTURES, "NewHybridForCausalLM",
                        dataclasses.replace(registry.ARCHITECTURES["Qwen3_5ForCausalLM"]))
    renamed = dataclasses.replace(cfg, architecture="NewHybridForCausalLM")
    assert registry.mtp_head_class("NewHybridForCausalLM") is Qwen3NextMTP
    assert mtp_footprint(renamed, 2, 2, 16) == mtp_footprint(cfg, 2, 2, 16)
    monkeypatch.setitem(registry.ARCHITECTURES, "NewHybridForCausalLM",
                        dataclasses.replace(registry.ARCHITECTURES["Qwen3_5ForCausalLM"], mtp_head=None))
    with pytest.raises(ValueError, match="NewHybridForCausalLM has no multi-token"):
        mtp_footprint(renamed, 2, 2, 16)


def test_the_planner_says_when_a_model_has_no_mtp_head(llama_dir):
    import json

    from app.capacity import capacity_line

    config = json.loads((llama_dir / "config.json").read_text())
    line = capacity_line(config, {"speculative_config": {"method": "mtp", "num_speculative_tokens": 2}}, [])
    assert "LlamaForCausalLM has no multi-token-prediction head" in line
