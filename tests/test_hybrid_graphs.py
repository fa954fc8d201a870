"""CUDA graphs for hybrid models on CPU (issue 22): the decode graphs' padded static buffers, run eagerly,
update the linear-attention state pool in place through a static slot-index buffer, padding rows going to the
padding slot past the pool; the state of every real slot is what the unpadded eager step leaves, slots outside
the batch are untouched, and greedy ids equal HF's. The piecewise pieces (tape stand-in, Gated DeltaNet layers
eager between them on the step's real rows) give HF's ids over prompt, mixed, decode and speculative verify steps. On fake CUDA
tensors (tests/test_fake_cuda.py) a padded decode step keeps every buffer on the card, launches only the
DeltaNet decode kernels and copies nothing to the host: nothing a captured graph could not replay."""
from __future__ import annotations


import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.layers.attention import AttentionMetadata
from engine.layers.gated_deltanet import GatedDeltaNet
from engine.worker.graphs.piecewise import PiecewiseGraphs, token_buckets
from graph_tape import TapeGraphBackend
from engine.config.model import ModelConfig
from engine.worker.model_runner import ModelRunner
from engine.worker.step_inputs import StepInputs
from hf_reference import HYBRID_MAX_TOKENS as MAX_TOKENS, hf_greedy, make_prompts
from test_fake_cuda import CUDA, Recorder, _as_if_on_cpu, fake_cuda  # noqa: F401 (fixture)

pytestmark = pytest.mark.timeout(300)
BUDGET = 32  # piecewise: prompts arrive in 32-token chunks beside running decodes


def greedy(llm: LLM, prompts) -> list[list[int]]:
    params = [SamplingParams(temperature=0, max_tokens=m) for m in MAX_TOKENS[:len(prompts)]]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def eager_forward(runner, inputs, tables) -> torch.Tensor:
    """The step as the runner runs it without graphs: exactly the real rows, the step's own metadata."""
    meta = AttentionMetadata(torch.from_numpy(inputs.slot_mapping), tables[0], torch.from_numpy(inputs.seq_lens),
                             torch.from_numpy(inputs.query_start_loc), inputs.max_query_len, inputs.max_seq_len)
    meta.state_indices = torch.from_numpy(inputs.state_indices)
    meta.has_initial_state = torch.from_numpy(inputs.has_initial_state)
    return runner.model(torch.from_numpy(inputs.input_ids), torch.from_numpy(inputs.positions), meta)


def test_decode_graphs_update_states_in_place_and_padding_touches_no_real_slot(hybrid_reference):
    path, prompts, expected = hybrid_reference("qwen3_5")
    llm = LLM(str(path), device="cpu", max_num_seqs=6)
    runner = llm.engine.runner
    runner.plan_decode_graphs(max_batch=6, capture=False)  # ladder 1, 2, 4, 6: 3 sequences pad to 4
    runner.allocate_state_cache(llm.engine.kv.state.pool.num_slots)  # the pool again, now with its padding slot
    graphs = runner.graphs
    pad = graphs.state_padding_slot
    assert pad == llm.engine.kv.state.pool.num_slots and runner.state_cache[0][0].shape[0] == pad + 1
    assert graphs.buffers.state_indices.dtype == torch.int32 and (graphs.buffers.state_indices == pad).all()
    padded, run = [], graphs.run

    def checked(inputs, tables):
        n = len(inputs.seq_lens)
        before = [(c.clone(), s.clone()) for c, s in runner.state_cache]
        want = eager_forward(runner, inputs, tables)
        eager_states = [(c.clone(), s.clone()) for c, s in runner.state_cache]
        for (c, s), (c0, s0) in zip(runner.state_cache, before):  # back to the step's start
            c.copy_(c0)
            s.copy_(s0)
        got = run(inputs, tables)
        batch = next(b for b in graphs.ladder if b >= n)
        assert (graphs.buffers.state_indices[:n].numpy() == inputs.state_indices).all()
        assert (graphs.buffers.state_indices[n:batch] == pad).all()
        assert not graphs.buffers.has_initial_state[n:batch].any()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        real = set(inputs.state_indices.tolist())
        untouched = [i for i in range(pad) if i not in real]
        for (c, s), (ce, se), (c0, s0) in zip(runner.state_cache, eager_states, before):
            rows = sorted(real)
            torch.testing.assert_close(c[rows], ce[rows], rtol=1e-5, atol=1e-5)  # real slots: the eager update
            torch.testing.assert_close(s[rows], se[rows], rtol=1e-5, atol=1e-5)
            assert torch.equal(c[untouched], c0[untouched]) and torch.equal(s[untouched], s0[untouched])
        if batch > n:
            padded.append(n)
            # Padding rows hold no tokens (issue 32): they leave even their shared padding slot alone, where they
            # used to all write it at once.
            assert all(torch.equal(c[pad], c0[pad]) and torch.equal(s[pad], s0[pad])
                       for (c, s), (c0, s0) in zip(runner.state_cache, before))
        return got
    graphs.run = checked
    assert greedy(llm, prompts) == expected
    assert padded and 3 in padded  # four prompts finish at different steps: 3 sequences padded to 4


@pytest.mark.parametrize("arch", ["qwen3_next"])
def test_piecewise_replay_of_a_hybrid_matches_hf(hybrid_reference, arch):
    """Qwen3-Next: grouped projections, MoE with a torch expert loop (an eager point too), DeltaNet layers; with
    n-gram speculation, so speculative verify rows (read-only state, replayed later) go through the pieces."""
    path, prompts, expected = hybrid_reference(arch)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    llm = LLM(str(path), device="cpu", max_num_batched_tokens=BUDGET, max_num_seqs=4, enable_prefix_caching=False,
              speculative_config=spec)
    runner = llm.engine.runner
    backend = TapeGraphBackend()
    graphs = PiecewiseGraphs(runner.model, BUDGET, runner.device, backend, strict=True,
                             num_kv_groups=len(runner.kv_layout.groups))
    graphs.capture()
    assert sorted(graphs.captured) == token_buckets(BUDGET)
    deltanets = [m for m in graphs.points if isinstance(m, GatedDeltaNet)]
    assert len(deltanets) == len(runner.model.state_layers()) == 2
    kinds, run = {}, graphs.run

    def counting(inputs, meta):
        q = np.diff(inputs.query_start_loc)
        kind = "decode" if q.max() == 1 else ("mixed" if (q == 1).any() else "prompt")
        if inputs.state_read_only is not None and inputs.state_read_only.any():
            kind = "verify"
        kinds[kind] = kinds.get(kind, 0) + 1
        return run(inputs, meta)
    graphs.run = counting
    runner.piecewise = graphs
    assert greedy(llm, prompts) == expected
    print(f"{arch}: steps through the pieces by kind {kinds}, {backend.replays} pieces replayed")
    assert kinds.get("verify", 0) > 0 and kinds.get("prompt", 0) + kinds.get("mixed", 0) > 0
    assert llm.engine.spec.stats.num_accepted_tokens > 0 and graphs.replayed_tokens > 0


@pytest.fixture(scope="module")
def hybrid_weights(tiny_model_dir):
    from engine.worker.loader import iterate_weights
    path = tiny_model_dir("qwen3_5")
    return path, list(iterate_weights(path, device="cpu"))


@pytest.mark.fake_cuda
def test_a_padded_hybrid_decode_step_on_cuda_is_graph_safe(hybrid_weights, fake_cuda, monkeypatch):  # noqa: F811
    import engine.worker.model_runner
    import kernels.triton_attention as ta
    import kernels.triton_causal_conv1d as tc
    import kernels.triton_gated_delta as tg
    import kernels.triton_write_kv as tw
    path, weights = hybrid_weights
    monkeypatch.setattr(engine.worker.model_runner, "iterate_weights", lambda p, device: iter(weights))
    monkeypatch.setattr(ta, "_device_facts", lambda device: (8, 8))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (20 * 2**30, 24 * 2**30))
    # More entry points that insist on a CUDA device guard in a CPU-only build (the fixture patches the common ones)
    monkeypatch.setattr(torch.Tensor, "contiguous", _as_if_on_cpu(torch.Tensor.contiguous))
    for module, name in ((ta, "paged_attention_kernel"), (ta, "reduce_splits_kernel"), (tw, "write_kv_kernel"),
                         (tg, "fused_recurrent_kernel"), (tg, "chunk_prepare_kernel"), (tg, "chunk_state_kernel"),
                         (tc, "causal_conv1d_kernel"), (tc, "conv_state_update_kernel")):
        monkeypatch.setattr(module, name, Recorder(name, fake_cuda))
    runner = ModelRunner(ModelConfig.from_folder(path), path, CUDA, torch.float16, 4, "triton")
    runner.plan_decode_graphs(max_batch=4, capture=False)
    runner.allocate_kv_cache(8, torch.float16, num_state_slots=5)
    buf = runner.graphs.buffers
    assert runner.graphs.state_padding_slot == 5 and runner.state_cache[0][1].shape[0] == 6
    assert {buf.state_indices.device, buf.has_initial_state.device, runner.state_cache[0][1].device} == {CUDA}
    assert runner.state_cache[0][1].dtype == torch.float32  # mamba_ssm_dtype, whatever the weights
    inputs = StepInputs(  # three decodes (slots 4, 0, 2) padded to a batch of 4
        input_ids=np.array([7, 8, 9]), positions=np.array([3, 5, 2]), slot_mapping=np.array([3, 9, 18]),
        block_tables=np.array([[0, 0], [1, 2], [4, 0]], dtype=np.int32), seq_lens=np.array([4, 6, 3], np.int32),
        query_start_loc=np.array([0, 1, 2, 3], dtype=np.int32), logits_rows=[0, 1, 2], max_query_len=1,
        max_seq_len=6, block_copies=[], state_indices=np.array([4, 0, 2], np.int32),
        has_initial_state=np.ones(3, bool))
    assert runner.graphs.can_run(inputs)
    used, run = [], runner.graphs.run
    runner.graphs.run = lambda i, t: used.append(len(i.seq_lens)) or run(i, t)
    assert runner.run(inputs) is None  # no sampling asked: nothing comes back to the host
    layers = len(runner.model.state_layers())
    assert used == [3] and fake_cuda.host_copies == 0
    for name, count in (("fused_recurrent_kernel", layers), ("causal_conv1d_kernel", layers),
                        ("conv_state_update_kernel", layers), ("chunk_prepare_kernel", 0), ("chunk_state_kernel", 0)):
        assert fake_cuda.launches.count(name) == count, name


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_a_quantized_hybrid_with_float_deltanet_projections_matches_hf(tiny_model_dir, tmp_path, fmt):
    """As the published Qwen3.5/3.6 4-bit checkpoints do: attention and MLP linears packed, the Gated DeltaNet
    projections left float and named by a bare "linear_attn" in the ignore list; greedy ids equal HF on the
    dequantized float model."""
    from quant_packers import dequantized_folder, make_quantized
    src = tiny_model_dir("qwen3_5")
    packed = make_quantized(src, tmp_path / "packed", fmt, 4, 32, ignore=("linear_attn",))
    prompts = [make_prompts(400)[i] for i in (1, 4)]
    expected = hf_greedy(dequantized_folder(packed, tmp_path / "float"), prompts, [8, 8])
    llm = LLM(str(packed), device="cpu")
    layers = llm.engine.runner.model.model.layers
    deltanet = layers[0].linear_attn
    assert isinstance(deltanet, GatedDeltaNet)
    for proj in (deltanet.in_proj_qkv, deltanet.in_proj_z, deltanet.in_proj_b, deltanet.in_proj_a, deltanet.out_proj):
        assert type(proj.method).__name__ == "UnquantizedLinearMethod"
    assert type(layers[0].mlp.gate_up_proj.method).__name__ != "UnquantizedLinearMethod"
    assert type(layers[1].self_attn.qkv_proj.method).__name__ != "UnquantizedLinearMethod"
    got = [o.outputs[0].token_ids for o in
           llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=8)] * 2, use_tqdm=False)]
    assert got == expected
