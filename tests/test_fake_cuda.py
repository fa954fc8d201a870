"""The CUDA path on a CPU-only machine: sampler, beam search, model forward with Triton dispatch, KV write and
block copies run on `device="cuda"` fake tensors (torch's FakeTensorMode), which raise the moment a CPU and a
CUDA tensor meet, exactly where a real card would fail.

A CPU-only torch build cannot do three things fake tensors need, so the `fake_cuda` fixture supplies them
for the test's duration only: Python indexing, `~`, `.copy_` and `.to("cuda")` (their C++ entry points insist on
a CUDA device guard) run as if on the CPU and come back CUDA-placed; `.tolist()` of a fake host tensor returns
zeros of its shape (fake tensors carry no data) and device -> host copies are counted; a generator's draw
goes ahead without the generator (refs reject generators) after the check torch makes on a card: the
generator must sit on the tensor's device.
Triton kernels are replaced by recorders at launch, which check every tensor argument's device.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch._subclasses.fake_tensor as fake_tensor
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._pytree import tree_flatten

from engine.core.beam_search import BeamGroup, BeamSearchParams
from engine.config.model import ModelConfig
from engine.worker.model_runner import ModelRunner
from engine.worker.step_inputs import StepInputs
from engine.sample.sampler import beam_top_logprobs, sample_on_device
from engine.sample.metadata import SamplingBatch, SamplingRow
from engine.sample.state import SamplingMetadata
from engine.sample.sampling_params import SamplingParams

pytestmark = pytest.mark.fake_cuda

CUDA = torch.device("cuda", 0)
VOCAB = 64


class FakeCuda:
    """What the fixture yields: device -> host copies made, Triton kernels launched."""

    def __init__(self) -> None:
        self.host_copies = 0
        self.launches: list[str] = []


def _as_if_on_cpu(op):
    def run(*args, **kwargs):
        flat, _ = tree_flatten(args)
        on_cuda = [t for t in flat if isinstance(t, FakeTensor) and t.fake_device.type == "cuda"]
        devices = [t.fake_device for t in on_cuda]
        for t in on_cuda:
            t.fake_device = torch.device("cpu")
        try:
            out = op(*args, **kwargs)
        finally:
            for t, d in zip(on_cuda, devices):
                t.fake_device = d
        if isinstance(out, FakeTensor) and any(args[0] is t for t in on_cuda):
            out.fake_device = args[0].fake_device
        return out
    return run


@pytest.fixture
def fake_cuda(monkeypatch):
    state = FakeCuda()
    to, cpu, exponential = torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.exponential_

    def fake_to(self, *args, **kwargs):
        device = kwargs.get("device", next((a for a in args if isinstance(a, (str, torch.device))), None))
        if isinstance(self, FakeTensor) and device is not None and torch.device(device).type == "cuda":
            dtype = kwargs.get("dtype", next((a for a in args if isinstance(a, torch.dtype)), self.dtype))
            return torch.ops.aten._to_copy.default(self, device=torch.device(device), dtype=dtype)
        return to(self, *args, **kwargs)

    def fake_cpu(self):
        state.host_copies += self.device.type == "cuda"
        return cpu(self)

    def fake_tolist(self):
        state.host_copies += self.device.type == "cuda"  # allowed on a card too: an implicit copy and sync
        return np.zeros(self.shape, dtype=np.int64).tolist()

    def fake_exponential(self, generator=None):
        if generator is not None and generator.device != self.device:  # what torch checks on a real card
            raise RuntimeError(f"Expected a '{self.device.type}' device type for generator")
        return exponential(self)

    # On FakeTensor, not torch.Tensor: setting a dunder on a type rewrites its C slots, and deleting it again
    # leaves torch.Tensor a sequence type (sq_item), so torch.tensor([0-d tensors]) fails in later tests.
    for name in ("__getitem__", "__setitem__", "__invert__", "copy_"):
        monkeypatch.setattr(FakeTensor, name, _as_if_on_cpu(getattr(torch.Tensor, name)))
    monkeypatch.setattr(torch.Tensor, "to", fake_to)
    monkeypatch.setattr(torch.Tensor, "cpu", fake_cpu)
    monkeypatch.setattr(FakeTensor, "tolist", fake_tolist, raising=False)
    monkeypatch.setattr(torch.Tensor, "exponential_", fake_exponential)
    monkeypatch.setattr(fake_tensor, "CONSTANT_NUMEL_LIMIT", 0)  # no real compute on 1-element "constants"
    with FakeTensorMode(allow_non_fake_inputs=True):
        yield state


def cuda_generator():
    """Stands in for torch.Generator(device="cuda"), which a CPU-only build cannot construct."""
    return SimpleNamespace(device=CUDA)


def rows_for(params: list[SamplingParams], generators=None) -> list[SamplingRow]:
    generators = generators or [None] * len(params)
    return [SamplingRow(p, [1, 2, 3, 4, 4, 5], 3, g, [0]) for p, g in zip(params, generators)]


CASES = {
    "greedy": [SamplingParams(temperature=0)],
    "temperature_seeded": [SamplingParams(temperature=0.7, seed=1), SamplingParams(temperature=1.0)],
    "top_k_top_p": [SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=0.9, top_p=0.8)],
    "min_p": [SamplingParams(temperature=1.0, min_p=0.1), SamplingParams(temperature=0)],
    "penalties": [SamplingParams(temperature=0, repetition_penalty=1.3, presence_penalty=0.5,
                                 frequency_penalty=0.2), SamplingParams(temperature=1.0)],
    "logit_bias_min_tokens": [SamplingParams(temperature=0, logit_bias={7: 5.0}, min_tokens=4,
                                             stop_token_ids=[9])],
    "logprobs": [SamplingParams(temperature=1.0, logprobs=3), SamplingParams(temperature=0, logprobs=0)],
}


@pytest.mark.parametrize("case", list(CASES))
def test_sampler_stays_on_the_logits_device(fake_cuda, case):
    params = CASES[case]
    generators = [cuda_generator() if p.seed is not None else None for p in params]
    logits = torch.randn(len(params), VOCAB, device=CUDA)
    meta = SamplingMetadata.build(rows_for(params, generators), VOCAB, CUDA)
    out = sample_on_device(logits, meta, cuda_generator())
    assert out.token_ids.device == CUDA and out.token_ids.shape == (len(params),)
    assert out.logprobs.device == CUDA
    if any(p.logprobs is not None for p in params):
        assert out.top_ids.device == out.top_logprobs.device == out.ranks.device == CUDA
    assert fake_cuda.host_copies == 0
    host = out.to_host()
    assert len(host.token_ids) == len(params) and fake_cuda.host_copies == 1  # one copy of the small results


def test_bitmask_hook_runs_on_the_device(fake_cuda):
    meta = SamplingMetadata.build(rows_for([SamplingParams(temperature=0)]), VOCAB, CUDA)
    meta.bitmask = torch.full((1, VOCAB // 32), -1, dtype=torch.int32, device=CUDA)
    assert sample_on_device(torch.randn(1, VOCAB, device=CUDA), meta, cuda_generator()).token_ids.device == CUDA


def test_a_host_generator_for_cuda_logits_is_refused(fake_cuda):
    meta = SamplingMetadata.build(rows_for([SamplingParams(temperature=1.0, seed=3)], [torch.Generator()]),
                                  VOCAB, CUDA)
    with pytest.raises(AssertionError, match="cannot draw noise for logits on cuda"):
        sample_on_device(torch.randn(1, VOCAB, device=CUDA), meta, cuda_generator())


def test_seeded_generators_are_made_on_the_sampling_device(monkeypatch):
    import engine.sample.metadata as sm
    from engine.core.sequence import Request
    made, generator = [], torch.Generator
    monkeypatch.setattr(sm.torch, "Generator", lambda device: made.append(device) or generator())
    request = Request("r", None, [1, 2], SamplingParams(temperature=1.0, seed=5), None, 0.0)
    request.make_generator(1, CUDA)
    assert made == [CUDA]


def test_beam_rows_top_logprobs_on_device(fake_cuda):
    values, ids = beam_top_logprobs(torch.randn(3, VOCAB, device=CUDA), 8)
    assert values.device == ids.device == CUDA and values.shape == ids.shape == (3, 8)


def test_beam_advance_on_top_2k_matches_the_full_vocabulary():
    """BeamGroup works on each beam's top 2k (host lists): the same continuations as over the whole vocabulary."""
    torch.manual_seed(0)
    group = BeamGroup(BeamSearchParams(beam_width=3, max_tokens=8), eos_ids=[0], num_prompt_tokens=2)
    group.scores = [-0.5, -1.0, -1.5]
    logprobs = torch.log_softmax(torch.randn(3, VOCAB), dim=-1)
    full = (logprobs + torch.tensor(group.scores)[:, None]).flatten().topk(6)
    values, ids = beam_top_logprobs(logprobs, 6)
    for i in range(3):
        group.pending[i] = (values[i].tolist(), ids[i].tolist())
    survivors = group.advance([[1, 2]] * 3)
    want = [(i // VOCAB, i % VOCAB) for i in full.indices.tolist() if i % VOCAB != 0][:3]
    assert [(c.parent, c.token) for c in survivors] == want


class Recorder:
    """Replaces a Triton kernel: `kernel[grid](*args)` checks that every tensor argument is on CUDA."""

    def __init__(self, name: str, state: FakeCuda) -> None:
        self.name, self.state = name, state

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            devices = {str(a.device) for a in args if isinstance(a, torch.Tensor)}
            assert devices == {"cuda:0"}, f"{self.name} launched with tensors on {devices}"
            self.state.launches.append(self.name)
        return launch


@pytest.fixture(scope="module")
def tiny_weights(llama_dir):
    """The tiny model's real tensors, read before fake mode starts (safetensors cannot load into it)."""
    from engine.worker.loader import iterate_weights
    return llama_dir, list(iterate_weights(llama_dir, device="cpu"))


def fake_runner(monkeypatch, state: FakeCuda, tiny_weights, kv_dtype: torch.dtype) -> ModelRunner:
    import engine.worker.model_runner
    import kernels.triton_attention as ta
    import kernels.triton_write_kv as tw
    model_dir, weights = tiny_weights
    monkeypatch.setattr(engine.worker.model_runner, "iterate_weights", lambda path, device: iter(weights))
    monkeypatch.setattr(ta, "_device_facts", lambda device: (8, 8))  # a pretend 8-SM Ampere
    monkeypatch.setattr(ta, "paged_attention_kernel", Recorder("paged_attention", state))
    monkeypatch.setattr(ta, "reduce_splits_kernel", Recorder("reduce_splits", state))
    monkeypatch.setattr(tw, "write_kv_kernel", Recorder("write_kv", state))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (20 * 2**30, 24 * 2**30))
    runner = ModelRunner(ModelConfig.from_folder(model_dir), model_dir, CUDA, torch.float16, 4, "triton")
    runner.allocate_kv_cache(8, kv_dtype)
    assert {p.device for p in runner.model.parameters()} == {CUDA} and runner.kv_cache.device == CUDA
    return runner


def step_inputs() -> StepInputs:
    """Two sequences: a 3-token prompt and a 2-token one, each sampling its last position."""
    return StepInputs(
        input_ids=np.array([1, 2, 3, 4, 5]), positions=np.array([0, 1, 2, 0, 1]),
        slot_mapping=np.array([0, 1, 2, 4, 5]), block_tables=np.array([[0], [1]], dtype=np.int32),
        seq_lens=np.array([3, 2], dtype=np.int32), query_start_loc=np.array([0, 3, 5], dtype=np.int32),
        logits_rows=[2, 4], max_query_len=3, max_seq_len=3, block_copies=[(1, 2)])


def test_model_forward_triton_dispatch_and_sampling_on_cuda(tiny_weights, fake_cuda, monkeypatch):
    runner = fake_runner(monkeypatch, fake_cuda, tiny_weights, torch.float16)
    params = [SamplingParams(temperature=0.8, seed=2, logprobs=2), SamplingParams(temperature=0)]
    batch = SamplingBatch(rows_for(params, [cuda_generator(), None]), logits_index=[0, 0], beam_index=[1],
                          beam_topk=4, generator=cuda_generator())
    out = runner.run(step_inputs(), batch)
    layers = len(runner.model.attention_layers())
    assert fake_cuda.launches.count("write_kv") == layers and fake_cuda.launches.count("paged_attention") == layers
    assert len(out.sampled.token_ids) == 2 and len(out.beam_ids) == 1 and len(out.beam_ids[0]) == 4
    assert runner.run(step_inputs()) is None  # a tensor-parallel worker: logits for the all-gather, no sampling


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.float8_e4m3fn])
def test_block_copies_on_cuda(tiny_weights, fake_cuda, monkeypatch, kv_dtype):
    runner = fake_runner(monkeypatch, fake_cuda, tiny_weights, kv_dtype)
    runner.copy_blocks([(0, 3), (1, 4)])
    assert runner.kv_cache.device == CUDA and runner.kv_cache.dtype == kv_dtype

