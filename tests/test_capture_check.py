"""The CPU capture check (issue 32): what a card's stream capture refuses, refused on CPU.

Every family's model (tests/tiny_models.py) is built on fake CUDA tensors (tests/test_fake_cuda.py: torch's
FakeTensorMode with `device="cuda"`, Triton kernels replaced by recorders that check their tensors' devices) and
goes through the engine's own graph planning and capture (engine/worker/graphs/: decode graphs, speculative verify
graphs of 1 + k tokens a row, piecewise pieces up to the token budget) with the tape stand-in backend
(tests/graph_tape.py) in strict mode: a tensor made from host data, a host <-> device copy, `.item()`,
`.tolist()`, `nonzero` or a data-dependent shape inside a captured region fails the capture, naming the op, where
on CPU it used to pass and on a card it fell back to eager with one warning. Both attention backends: Triton
(decode, verify and piecewise graphs), torch (piecewise only: its kernels read the batch layout on the host, so
the engine plans no whole-forward graph with it). The speculative methods differ only in their proposer, which
runs eagerly; what each one makes the target run in a graph is a verify step of 1 + k tokens a row (captured
here for every family) or, for hybrid models, verify rows through the pieces (tests/test_hybrid_graphs.py).
"""
from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch

from engine.config.model import ModelConfig
from engine.worker.model_runner import ModelRunner
from graph_tape import PieceCaptureError, TapeGraphBackend
from test_fake_cuda import CUDA, Recorder, _as_if_on_cpu, fake_cuda  # noqa: F401 (fixture)
from tiny_models import ARCHS, HYBRID_ARCHS, HYBRID_VL_ARCHS, MOE_ARCHS

pytestmark = [pytest.mark.fake_cuda, pytest.mark.timeout(900)]

TRITON_KERNELS = [
    ("kernels.triton_attention", "paged_attention_kernel"), ("kernels.triton_attention", "reduce_splits_kernel"),
    ("kernels.triton_write_kv", "write_kv_kernel"), ("kernels.triton_moe", "fused_moe_kernel"),
    ("kernels.triton_gated_delta", "fused_recurrent_kernel"), ("kernels.triton_gated_delta", "chunk_prepare_kernel"),
    ("kernels.triton_gated_delta", "chunk_state_kernel"), ("kernels.triton_causal_conv1d", "causal_conv1d_kernel"),
    ("kernels.triton_causal_conv1d", "conv_state_update_kernel"),
    ("kernels.triton_quant_linear", "quant_gemv_kernel"), ("kernels.triton_quant_linear", "quant_gemm_kernel")]
FAMILIES = [*ARCHS, *MOE_ARCHS, *HYBRID_ARCHS, *HYBRID_VL_ARCHS]
BUDGET, MAX_BATCH, K = 32, 2, 2


@pytest.fixture(scope="module")
def family_weights(tiny_model_dir):
    """family_weights(arch) -> (folder, its tensors read on the host), once per module; made and read outside
    fake mode (safetensors cannot load into it), even when a test asks from inside."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from engine.worker.loader import iterate_weights
    cache = {}

    def get(arch):
        if arch not in cache:
            with unset_fake_temporarily():
                path = tiny_model_dir(arch)
                cache[arch] = path, list(iterate_weights(path, device="cpu"))
        return cache[arch]
    return get


def no_other_rank(flag: torch.Tensor) -> SimpleNamespace:
    """One rank's all-reduce of its capture-failure flag, read on the host as 0 (a fake tensor has no value)."""
    return SimpleNamespace(item=lambda: 0)


def on_fake_card(monkeypatch, state, weights) -> None:
    """Triton kernels as recorders, a pretend 8-SM Ampere with 24 GiB, the checkpoint from `weights`."""
    import engine.worker.model_runner
    from engine.worker.graphs import decode, piecewise
    import kernels.triton_attention as ta
    import kernels.triton_moe as tm
    for module, name in TRITON_KERNELS:
        monkeypatch.setattr(importlib.import_module(module), name, Recorder(name, state))
    monkeypatch.setattr(ta, "_device_facts", lambda device: (8, 8))
    monkeypatch.setattr(tm, "device_name", lambda device: "fake")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (20 * 2**30, 24 * 2**30))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.Tensor, "contiguous", _as_if_on_cpu(torch.Tensor.contiguous))
    monkeypatch.setattr(engine.worker.model_runner, "iterate_weights", lambda path, device: iter(weights))
    for graphs in (decode, piecewise):  # one rank: the ranks' agreement on each capture answers "no failure" on
        monkeypatch.setattr(graphs, "all_reduce", no_other_rank)  # the host (a fake tensor has no value to read)


def captured_runner(path, backend: str = "triton", verify_query_len: int = 1 + K,
                    piecewise_tokens: int = BUDGET) -> ModelRunner:
    """A runner on the fake card whose every planned graph set is captured through the strict tape."""
    config = ModelConfig.from_folder(path).with_max_model_len(64)
    runner = ModelRunner(config, path, CUDA, torch.float16, 16, backend)
    runner.dispatch.backend, runner.dispatch.strict = TapeGraphBackend(refuse_host_data=True), True
    runner.plan_decode_graphs(MAX_BATCH, True, piecewise_tokens, verify_query_len)
    runner.allocate_kv_cache(16, torch.float16, num_state_slots=MAX_BATCH if runner.kv_layout.state else 0)
    runner.capture_decode_graphs()  # strict: the first refused op raises PieceCaptureError
    return runner


@pytest.mark.parametrize("arch", FAMILIES)
def test_every_family_captures_on_a_fake_card(family_weights, fake_cuda, monkeypatch, arch):  # noqa: F811
    path, weights = family_weights(arch)
    on_fake_card(monkeypatch, fake_cuda, weights)
    runner = captured_runner(path)
    tapes = runner.dispatch.backend.tapes
    hybrid = runner.kv_layout.state is not None
    assert runner.graphs.graphs and all(key in runner.graphs.graphs for key in [(1, 64), (2, 64)])
    if hybrid:  # verify rows keep a state per draft: they go through the pieces (tests/test_hybrid_graphs.py)
        assert runner.verify_graphs is None
    else:
        assert sorted(runner.verify_graphs.graphs) == [(1, 64), (2, 64)]
        rows = {k: o.shape[0] for k, o in runner.verify_graphs.outputs.items()}
        assert rows == {(1, 64): 1 + K, (2, 64): 2 * (1 + K)}
    assert sorted(runner.piecewise.captured) == [16, 32]
    print(f"{arch}: {len(tapes)} graphs and pieces captured; kernels per decode graph "
          f"{[t.num_kernels for t in tapes[:2]]}, pieces of the largest bucket "
          f"{runner.piecewise.num_pieces}")


def host_reading(kernel):
    """A stand-in for a torch-backend kernel on the fake card: it reads the batch layout on the host, as the real
    ones do (`tolist` of query_start_loc), and returns an output of the right shape."""
    def run(*args, **kwargs):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        next(t for t in tensors if t.dtype in (torch.int32, torch.int64)).tolist()
        return None if kernel == "write" else torch.empty_like(tensors[0] if kernel == "attention" else
                                                               tensors[2 if kernel == "rule" else 0])
    return run


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "qwen3_5"])
def test_the_torch_attention_backend_captures_only_the_pieces(family_weights, fake_cuda, monkeypatch,  # noqa: F811
                                                              arch):
    """With the torch kernels (which read the batch layout on the host) no whole-forward graph is planned on a
    card; the pieces run attention (and DeltaNet layers) eagerly between them, so they capture."""
    import engine.layers.attention as attention
    import engine.layers.gated_deltanet as deltanet
    path, weights = family_weights(arch)
    on_fake_card(monkeypatch, fake_cuda, weights)
    monkeypatch.setattr(attention, "get_attention_backend",
                        lambda name: (host_reading("write"), host_reading("attention")))
    monkeypatch.setattr(deltanet, "gated_delta_kernels", lambda name: (host_reading("conv"), host_reading("rule")))
    runner = captured_runner(path, backend="torch")
    assert fake_cuda.host_copies > 0  # the stand-ins did read the host, outside every piece
    assert runner.graphs is None and runner.verify_graphs is None
    assert sorted(runner.piecewise.captured) == [16, 32]


@pytest.mark.parametrize("what,forward", [
    ("aten::lift_fresh", lambda x: x * torch.tensor(2.0, dtype=x.dtype, device=x.device)),
    ("aten::_to_copy", lambda x: x + torch.ones(x.shape, dtype=x.dtype).to(x.device)),
    ("copy_ of a host tensor", lambda x: x.clone().copy_(torch.zeros(x.shape, dtype=x.dtype))),
    ("Tensor.tolist()", lambda x: x * len(x.tolist())),
    ("aten::_local_scalar_dense", lambda x: x * x.sum().item()),
    ("aten::nonzero", lambda x: x[: torch.ops.aten.nonzero.default(x).shape[0]]),
    ("aten::index", lambda x: x[x > 0]),
    ("aten::repeat_interleave", lambda x: torch.repeat_interleave(torch.arange(2, device=x.device))),
])
def test_the_tape_refuses_what_a_capture_refuses(fake_cuda, what, forward):  # noqa: F811
    backend = TapeGraphBackend(refuse_host_data=True)
    x = torch.ones(4, 8, device=CUDA)
    with pytest.raises(PieceCaptureError, match=what.replace("(", r"\(").replace(")", r"\)")):
        with backend.graph():
            forward(x)
    with backend.graph() as tape:  # device-side work of the same shapes is fine
        (x * 2.0 + torch.full((), 1.0, device=CUDA)).softmax(-1)
    assert tape.num_kernels >= 4 and tape.fresh_bytes >= 3 * x.numel() * 4


@pytest.fixture(scope="module")
def awq_moe(tiny_model_dir, tmp_path_factory):
    """An AWQ 4-bit Qwen3-MoE folder (experts packed) and its tensors, read before fake mode starts."""
    from engine.worker.loader import iterate_weights
    from quant_packers import make_quantized
    path = make_quantized(tiny_model_dir("qwen3_moe"), tmp_path_factory.mktemp("awq") / "q", "awq", bits=4, group=32)
    return path, list(iterate_weights(path, device="cpu"))


def test_quantized_moe_layers_stay_inside_the_pieces_on_a_card(awq_moe, fake_cuda, monkeypatch):  # noqa: F811
    """Issue 32 item 3: on a card every packed expert format runs the Triton grouped GEMMs, which route on the
    device, so a quantized MoE layer is captured inside a piece like a float one: pieces = attention layers + 1
    (it used to be an eager point, splitting every layer's piece in two for nothing)."""
    path, weights = awq_moe
    on_fake_card(monkeypatch, fake_cuda, weights)
    runner = captured_runner(path)
    experts = [m for m in runner.model.modules() if type(m).__name__ == "FusedMoE"]
    assert experts and all(m.quant is not None and m.graph_safe for m in experts)
    assert runner.piecewise.num_pieces == len(runner.model.attention_layers()) + 1
    assert fake_cuda.launches.count("fused_moe_kernel") > 0 and "quant_gemv_kernel" in fake_cuda.launches


SPEC_METHODS = {  # method -> (family, speculative_config without the model folder)
    "ngram": ("llama", {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                        "prompt_lookup_min": 1}),
    "draft": ("llama", {"num_speculative_tokens": 2}),  # the target itself as its draft: drafts get accepted
    "mtp": ("qwen3_5", {"method": "mtp", "num_speculative_tokens": 2}),
}


@pytest.mark.parametrize("method", list(SPEC_METHODS))
def test_every_speculative_method_verifies_through_captured_pieces(tiny_model_dir, tmp_path, method):
    """Real CPU tensors: the target's verify steps (and prompt and mixed steps) of each speculative method replay
    the piecewise pieces, captured by the strict tape (host data refused too), and give the eager engine's
    greedy ids."""
    import shutil

    from engine import LLM, SamplingParams
    from engine.bench.mtp_heads import add_mtp_head
    from engine.worker.graphs.piecewise import PiecewiseGraphs
    from hf_reference import make_prompts
    arch, spec = SPEC_METHODS[method]
    path = tiny_model_dir(arch)
    if method == "mtp":
        path = shutil.copytree(path, tmp_path / "with-mtp")
        add_mtp_head(path, reference_layer=tmp_path / "mtp_layer_reference.pt")
    if method == "draft":
        spec = dict(spec, model=str(path))
    prompts = [make_prompts(400)[i] for i in (1, 3, 4)]
    params = [SamplingParams(temperature=0, max_tokens=m) for m in (6, 8, 6)]
    want = [o.outputs[0].token_ids for o in LLM(str(path), device="cpu").generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(path), device="cpu", max_num_batched_tokens=BUDGET, max_num_seqs=4, enable_prefix_caching=False,
              speculative_config=spec)
    runner = llm.engine.runner
    runner.piecewise = PiecewiseGraphs(runner.model, BUDGET, runner.device, TapeGraphBackend(refuse_host_data=True),
                                       strict=True, num_kv_groups=len(runner.kv_layout.groups))
    runner.piecewise.capture()
    verify_steps, run = [], runner.piecewise.run

    def counting(inputs, meta):
        verify_steps.append(inputs.max_query_len > 1 and len(inputs.input_ids) > len(inputs.seq_lens))
        return run(inputs, meta)
    runner.piecewise.run = counting
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    assert any(verify_steps) and llm.engine.spec.stats.num_drafts > 0


def test_what_one_decode_graph_holds_per_layer(tiny_model_dir, fake_cuda, monkeypatch):  # noqa: F811
    """Issue 32 item 4 as far as a CPU can see it: the kernels each captured decode graph launches (the card
    keeps a node, with its parameters, per kernel) and the bytes its ops allocate, for 2 and 16 layers (an 8B
    model has 32); tests/gpu/test_gpu_graph_memory.py measures the bytes per graph on a card."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from engine.worker.loader import iterate_weights
    rows = {}
    for layers in (2, 16):
        with unset_fake_temporarily():
            path = tiny_model_dir("llama", num_hidden_layers=layers)
            weights = list(iterate_weights(path, device="cpu"))
        with monkeypatch.context() as m:
            on_fake_card(m, fake_cuda, weights)
            runner = captured_runner(path, verify_query_len=0, piecewise_tokens=0)
        tapes = runner.dispatch.backend.tapes[:len(runner.graphs.graphs)]  # decode graphs come first
        rows[layers] = ([t.num_kernels for t in tapes], [t.fresh_bytes for t in tapes], runner.graphs.capture_seconds)
        print(f"{layers} layers: {len(tapes)} decode graphs, kernels per graph {rows[layers][0]}, bytes made per "
              f"graph {rows[layers][1]}, tape capture {1000 * rows[layers][2] / len(tapes):.0f} ms per graph")
    per_layer = (rows[16][0][0] - rows[2][0][0]) / 14
    print(f"{per_layer:.0f} kernels per layer: about {32 * per_layer + rows[2][0][0] - 2 * per_layer:.0f} per decode "
          "graph of a 32-layer model")
    assert per_layer >= 8 and rows[16][0][0] == rows[16][0][-1]  # the same kernels whatever the batch
