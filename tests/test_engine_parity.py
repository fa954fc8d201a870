"""Greedy token ids identical to HF transformers `generate` on each supported architecture."""
from __future__ import annotations

import pytest

from hf_reference import MAX_TOKENS, engine_greedy
from tiny_models import ARCHS


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_matches_hf(reference, arch):
    path, prompts, expected = reference(arch)
    assert engine_greedy(path, prompts, MAX_TOKENS) == expected


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_greedy_matches_hf_with_tiny_pool(reference, arch):
    """A pool of 24 blocks holds ~2 long requests at a time: the rest wait (or are preempted) for blocks."""
    path, prompts, expected = reference(arch)
    assert engine_greedy(path, prompts, MAX_TOKENS, num_gpu_blocks_override=24, max_num_seqs=4) == expected


def test_sharded_checkpoint_loads_identically(tiny_model_dir, reference):
    path, prompts, expected = reference("llama")
    sharded = tiny_model_dir("llama", shards=3)
    assert any(p.name.endswith(".index.json") for p in sharded.iterdir())
    assert engine_greedy(sharded, prompts[:3], MAX_TOKENS[:3]) == expected[:3]
