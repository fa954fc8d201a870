"""CUDA-only paths that certainly failed on a card, each replayed on fake CUDA tensors (see tests/test_fake_cuda.py
for how the `fake_cuda` fixture makes `device="cuda"` tensors on a CPU-only machine).

- A bare "cuda" device (the default --device auto on one card): tensors made on it report cuda:0, but a
  generator made on it keeps no index, so the sampler refused the engine's own generator during KV sizing.
- A GPTQ act-order checkpoint: the g_idx shared by q/k/v (and gate/up) was compared with torch.equal between
  the CUDA parameter and the host checkpoint tensor, which torch refuses.
- The doctor's checks of a second card: Triton launches on the *current* card, not on the card its tensors
  live on, so the check of cuda:1 must make cuda:1 current.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from engine.config.model import ModelConfig
from test_fake_cuda import CUDA, VOCAB, fake_cuda  # noqa: F401 - the fixture

pytestmark = pytest.mark.fake_cuda


class BareCudaGenerator:
    """torch.Generator on a card as torch makes it: the device is kept as given (CUDAGeneratorImpl(-1) for a
    bare "cuda"), whereas a tensor made on a bare "cuda" lands on cuda:0 and says so."""

    def __init__(self, device) -> None:
        self.device = torch.device(device)

    def manual_seed(self, seed: int) -> "BareCudaGenerator":
        return self


def on_one_card(monkeypatch, resolve, *args):
    """`resolve(*args)` as on a machine with one card (cuda:0 current)."""
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_available", lambda: True)
        m.setattr(torch.cuda, "current_device", lambda: 0)
        return resolve(*args)


@pytest.mark.parametrize("flag", ["auto", "cuda"])
def test_the_device_flag_gives_generators_on_the_logits_card(fake_cuda, monkeypatch, flag):
    from engine.platform.devices import resolve_device
    from engine.worker.profiling import profile_sampler
    from engine.sample.sampler import sample_on_device
    from engine.sample.metadata import SamplingRow, make_generator
    from engine.sample.state import SamplingMetadata
    from engine.sample.sampling_params import SamplingParams
    from engine.core.sequence import Request
    monkeypatch.setattr(torch, "Generator", BareCudaGenerator)
    device = on_one_card(monkeypatch, resolve_device, flag)
    profile_sampler(4, VOCAB, device)  # the KV sizing's sampler step, with the engine's generator on `device`
    request = Request("r", None, [1, 2], SamplingParams(temperature=1.0, seed=5), None, 0.0)
    rows = [SamplingRow(request.params, [1, 2], 2, request.make_generator(0, device), [0])]
    out = sample_on_device(torch.randn(1, VOCAB, device=device), SamplingMetadata.build(rows, VOCAB, device),
                           make_generator(0, device))
    assert device == CUDA and out.token_ids.device == CUDA


def test_a_bare_cuda_device_gets_the_current_cards_index(monkeypatch):
    from engine.platform.devices import indexed_device
    assert on_one_card(monkeypatch, indexed_device, torch.device("cuda")) == CUDA
    assert indexed_device(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert indexed_device(torch.device("cpu")) == torch.device("cpu")


@pytest.fixture(scope="module")
def act_order_weights(tiny_model_dir, tmp_path_factory):
    """A GPTQ 4-bit act-order folder (g_idx per input row) and its tensors, read before fake mode starts."""
    from engine.worker.loader import iterate_weights
    from quant_packers import make_quantized
    src = tiny_model_dir("llama", hidden_size=128, intermediate_size=256)
    path = make_quantized(src, tmp_path_factory.mktemp("gptq") / "q", "gptq", 4, 64, False, True)
    return path, list(iterate_weights(path, device="cpu"))


def aten_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """torch.equal's device rule (ATen's cpu_equal/cuda_equal); fake tensors carry no values to compare."""
    if a.device != b.device:
        raise RuntimeError(f"Cannot compare two tensors on different devices. Got: {a.device} and {b.device}")
    return True


def test_act_order_checkpoint_loads_into_cuda_parameters(act_order_weights, fake_cuda, monkeypatch):
    from engine.models.llama import LlamaForCausalLM
    path, weights = act_order_weights
    monkeypatch.setattr(torch, "equal", aten_equal)
    with torch.device(CUDA):
        model = LlamaForCausalLM(ModelConfig.from_folder(path))
    model.load_weights(iter(weights))
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.g_idx.device == layer.mlp.gate_up_proj.g_idx.device == CUDA
    assert layer.self_attn.qkv_proj.g_idx.loaded_shards == {"q", "k", "v"}  # every stacked g_idx was compared


@pytest.fixture
def current_card(monkeypatch):
    """torch.cuda's current device, tracked (a CPU-only build has none): cuda:0 until someone switches."""
    card = {"index": 0}

    @contextlib.contextmanager
    def device(d):
        previous, card["index"] = card["index"], torch.device(d).index
        try:
            yield
        finally:
            card["index"] = previous

    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: card["index"])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    return card


class CurrentCardKernel:
    """Replaces a Triton kernel: like Triton, `kernel[grid](...)` runs on the current card, which must be the
    card of every tensor argument."""

    def __init__(self, name: str, card: dict) -> None:
        self.name, self.card = name, card

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            current = torch.device("cuda", self.card["index"])
            devices = {a.device for a in args if isinstance(a, torch.Tensor)}
            assert devices == {current}, f"{self.name} runs on {current} with tensors on {devices}"
        return launch


def test_the_doctor_runs_a_cards_kernels_with_that_card_current(fake_cuda, current_card, monkeypatch):
    import kernels.triton_attention as ta
    import kernels.triton_write_kv as tw
    from engine.doctor.kernel_checks import decode_tokens_per_s
    monkeypatch.setattr(ta, "_device_facts", lambda device: (8, 8))
    monkeypatch.setattr(ta, "paged_attention_kernel", CurrentCardKernel("paged_attention", current_card))
    monkeypatch.setattr(ta, "reduce_splits_kernel", CurrentCardKernel("reduce_splits", current_card))
    monkeypatch.setattr(tw, "write_kv_kernel", CurrentCardKernel("write_kv", current_card))
    assert decode_tokens_per_s("cuda:1", torch.float16, "triton", batch=2, context=8, steps=1, block_size=4) > 0
    assert current_card["index"] == 0  # switched back afterwards
