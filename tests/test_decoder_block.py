"""The shared decoder block (engine/layers/decoder.py, attention_block.py): what the families' forwards may not do
on a card, and Gemma's scaled embedding rounded as HF rounds it.

A host number turned into a device tensor inside forward (`torch.tensor(scale, device=x.device)`) is a pageable
host -> device copy, which CUDA graph capture refuses: on the CPU it shows as ATen's `lift_fresh` (a tensor made
from host data), so a forward that records none makes none. The embedding scale is made once instead, as HF makes
it: a float32 number rounded to the weights' dtype.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.config.model import ModelConfig
from engine.layers.embedding import VocabParallelEmbedding
from engine.models.registry import model_class
from engine.worker.loader import iterate_weights


class HostTensors(TorchDispatchMode):
    """Counts the ops that make a tensor from host data."""

    def __init__(self) -> None:
        super().__init__()
        self.made = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default):
            self.made.append(func)
        return func(*args, **(kwargs or {}))


def test_the_probe_sees_a_host_number_made_a_tensor():
    x = torch.ones(3)
    with HostTensors() as probe:
        _ = x * torch.tensor(2.0, dtype=x.dtype, device=x.device)
    assert probe.made


@pytest.mark.parametrize("arch", ["llama", "smollm3", "gemma2", "gemma3", "gemma4", "gemma4-vl"])
def test_forward_makes_no_tensor_from_host_data(tiny_model_dir, arch):
    """Without metadata attention is skipped: what runs is the code between the eager points, which CUDA graphs
    (whole-forward decode graphs, piecewise pieces) capture."""
    path = tiny_model_dir(arch)
    cfg = ModelConfig.from_folder(path)
    model = model_class(cfg.architecture)(cfg)
    model.load_weights(iterate_weights(path))
    input_ids, positions = torch.tensor([5, 6, 7]), torch.arange(3)
    with torch.inference_mode(), HostTensors() as probe:
        model.compute_logits(model(input_ids, positions, None))
    assert probe.made == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_scaled_embedding_rounds_its_scale_as_hf(dtype):
    """Built as the engine builds models (default dtype = the model's) against HF's Gemma 3 embedding built in
    float32 and converted: the same scale and bit-identical embeddings, at Gemma 2/3/4 widths."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding
    for hidden in (640, 1152, 1536, 2304, 2560, 3584, 3840, 4608, 5376):
        torch.manual_seed(hidden)
        theirs = Gemma3TextScaledWordEmbedding(50, hidden, 0, embed_scale=hidden ** 0.5).to(dtype)
        torch.set_default_dtype(dtype)
        try:
            ours = VocabParallelEmbedding(50, hidden, scale=hidden ** 0.5)
        finally:
            torch.set_default_dtype(torch.float32)
        ours.weight.data.copy_(theirs.weight.data)
        assert ours.embed_scale.dtype == dtype
        assert ours.embed_scale.item() == theirs.embed_scale.to(dtype).item()
        ids = torch.arange(50)
        assert torch.equal(ours(ids), theirs(ids))
