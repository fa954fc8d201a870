"""A Llama-style decoder's CPU decode step in one native call (kernels/cpu_decoder.py, kernels/decoder_layers.c,
engine/layers/fused_decode.py) against the layer modules it replaces: the same hidden states and the same KV
caches bit for bit, which models and steps it takes, and the engine's greedy ids (HF's) with it."""
from __future__ import annotations

import pytest
import torch

from engine.config.model import ModelConfig
from engine.kv.kv_cache_interface import build_layout, layer_specs
from engine.layers.attention import AttentionMetadata
from engine.layers.fused_decode import FusedDecode
from engine.models.registry import model_class
from engine.worker.loader import iterate_weights
from kernels import cpu_decoder, cpu_host_ops, cpu_linear, native_kernels
from kernels.native_kernels import library

BLOCK = 4


@pytest.fixture(autouse=True)
def native():
    """The engine's default CPU backends (`--cpu-linear rows`): an engine of another test file in this process may
    have left others (the runner sets them per process)."""
    cpu_linear.set_backend("rows")
    cpu_host_ops.set_enabled(True)
    native_kernels.set_attention(True)
    if library() is None or not cpu_host_ops.available():
        pytest.skip("no native build of the CPU kernels here: install a C compiler (apt install gcc)")


@pytest.fixture
def counted(monkeypatch):
    """The fused calls made while the test runs."""
    calls = []
    run = cpu_decoder.DecoderLayers.__call__
    monkeypatch.setattr(cpu_decoder.DecoderLayers, "__call__", lambda self, *a: calls.append(1) or run(self, *a))
    return calls


def _model(path):
    cfg = ModelConfig.from_folder(path)
    model = model_class(cfg.architecture)(cfg)
    model.load_weights(iterate_weights(path))
    return cfg, model


def _bind(model, cfg, blocks: int, seed: int) -> torch.Tensor:
    """Random KV caches (as if earlier steps had filled them), one [2, blocks, BLOCK, kv heads, head dim] per layer
    as views of one pool, and each layer's KV cache group as the engine groups them (windowed layers apart)."""
    gen = torch.Generator().manual_seed(seed)
    layers = model.attention_layers()
    groups = build_layout(layer_specs(cfg.sliding_windows, BLOCK, layers[0].num_kv_heads, layers[0].head_dim,
                                      4)).layer_groups
    pool = torch.randn(len(layers), 2, blocks, BLOCK, layers[0].num_kv_heads, layers[0].head_dim, generator=gen)
    for i, layer in enumerate(layers):
        layer.bind_cache(pool[i, 0], pool[i, 1])
        layer.kv_group = groups[i]
    return pool


def _tables(seq_lens: list[int], blocks: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Block tables with every sequence's blocks drawn at random from the pool, and the slots of its last token."""
    width = max(-(-n // BLOCK) for n in seq_lens)
    order = torch.randperm(blocks, generator=gen).tolist()
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)  # padded with block 0, as the engine pads
    for i, n in enumerate(seq_lens):
        tables[i, :-(-n // BLOCK)] = torch.tensor([order.pop() for _ in range(-(-n // BLOCK))])
    slots = torch.tensor([int(tables[i, (n - 1) // BLOCK]) * BLOCK + (n - 1) % BLOCK for i, n in enumerate(seq_lens)])
    return tables, slots


def _decode_step(seq_lens: list[int], blocks: int, seed: int, groups: int = 1) -> tuple[torch.Tensor,
                                                                                          AttentionMetadata]:
    """Positions and metadata of one decode per sequence, with block tables and slots per KV cache group."""
    gen = torch.Generator().manual_seed(seed)
    tables, slots = zip(*(_tables(seq_lens, blocks, gen) for _ in range(groups)))
    meta = AttentionMetadata(slots[0], tables[0], torch.tensor(seq_lens, dtype=torch.int32),
                             torch.arange(len(seq_lens) + 1, dtype=torch.int32), 1, max(seq_lens))
    if groups > 1:
        meta.group_block_tables, meta.group_slot_mappings = torch.stack(tables[1:]), torch.stack(slots[1:])
    return torch.tensor([n - 1 for n in seq_lens]), meta


def _groups(model) -> int:
    return 1 + max(layer.kv_group for layer in model.attention_layers())


def _forward(model, ids, positions, meta, fused: bool):
    """The decoder's hidden states; `fused` False: through the layer modules (the fused call kept for later)."""
    decoder = model.model
    kept = decoder.fused
    if not fused:
        decoder.fused = False
    try:
        with torch.inference_mode():
            return decoder(ids, positions, meta)
    finally:
        if not fused:
            decoder.fused = kept


# Widths that are no multiple of the kernels' 8-float vectors: every loop's scalar tail (hidden 60, 5 heads of 12
# over one KV head, intermediate 70).
ODD = dict(hidden_size=60, num_attention_heads=5, num_key_value_heads=1, head_dim=12, intermediate_size=70)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "phi3", "qwen3", "llama-odd", "smollm3", "gemma2",
                                  "gemma3"])
@pytest.mark.parametrize("seq_lens", [[9], [1, 5, 17, 33, 60], [70] * 3 + [2] * 30])
def test_one_call_equals_the_layer_modules_bit_for_bit(tiny_model_dir, counted, arch, seq_lens):
    """Batch 1, a mixed batch (contexts shorter and longer than Mistral's 48-token window, a one-token one) and 33
    rows (past the thread thresholds of the GEMMs and the attention): the hidden states and every layer's caches.
    Qwen3's and Gemma 3's per-head q/k norms are torch's on the module path (strided views): equal to float32
    rounding there. Gemma 2 and 3: sandwich norms, GELU-tanh, KV cache groups (windowed and global layers), Gemma
    2's soft cap, Gemma 3's two RoPE tables; SmolLM3's NoPE layer and biases."""
    cfg, model = _model(tiny_model_dir("llama", **ODD) if arch == "llama-odd" else tiny_model_dir(arch))
    blocks = sum(-(-n // BLOCK) for n in seq_lens) + 5
    ids = torch.randint(5, cfg.vocab_size, (len(seq_lens),), generator=torch.Generator().manual_seed(3))
    pool = _bind(model, cfg, blocks, seed=2)
    groups = _groups(model)
    assert (groups > 1) == arch.startswith("gemma")
    positions, meta = _decode_step(seq_lens, blocks, seed=1, groups=groups)
    before = pool.clone()
    want = _forward(model, ids, positions, meta, fused=False)
    want_pool, pool[:] = pool.clone(), before
    got = _forward(model, ids, positions, _decode_step(seq_lens, blocks, seed=1, groups=groups)[1], fused=True)
    fused_steps = len(counted)
    assert fused_steps == (1 if len(seq_lens) <= cpu_linear.NATIVE_MAX_ROWS else 0)
    if arch in ("qwen3", "gemma3"):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pool, want_pool, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(got, want)
        assert torch.equal(pool, want_pool)  # the new keys and values at their slots, nothing else touched
    assert not torch.equal(pool, before)


def test_models_it_does_not_take_keep_their_modules(tiny_model_dir):
    """A hybrid's DeltaNet, experts (Qwen3-MoE), Gemma 4's layers."""
    for arch in ("qwen3_5", "qwen3_moe", "gemma4"):
        cfg, model = _model(tiny_model_dir(arch))
        if not hasattr(model.model, "fused_layers"):
            continue
        assert model.model.fused_layers(torch.zeros(1, cfg.hidden_size), torch.zeros(1, dtype=torch.long),
                                        None) is None
        assert model.model.fused is False, arch


def test_steps_it_does_not_take_run_the_modules(tiny_model_dir, counted):
    """A prefill chunk, a padding slot, `--cpu-linear torch`: the modules, and the same result as before."""
    cfg, model = _model(tiny_model_dir("llama"))
    seq_lens, blocks = [6, 11], 12
    ids = torch.tensor([7, 8])
    _bind(model, cfg, blocks, seed=4)
    positions, meta = _decode_step(seq_lens, blocks, seed=5)
    _forward(model, ids, positions, meta, fused=True)
    assert len(counted) == 1 and isinstance(model.model.fused, FusedDecode)
    padded = _decode_step(seq_lens, blocks, seed=5)[1]
    padded.slot_mapping[1] = -1  # a padding row (CUDA graphs' batches)
    _forward(model, ids, positions, padded, fused=True)
    prefill = AttentionMetadata(torch.arange(2), meta.block_tables[:1], torch.tensor([2], dtype=torch.int32),
                                torch.tensor([0, 2], dtype=torch.int32), 2, 2)
    _forward(model, ids, torch.arange(2), prefill, fused=True)
    cpu_linear.set_backend("torch")
    try:
        _forward(model, ids, positions, _decode_step(seq_lens, blocks, seed=5)[1], fused=True)
    finally:
        cpu_linear.set_backend("rows")
    assert len(counted) == 1


def test_caches_it_does_not_read_are_asked_about_once(tiny_model_dir, counted, monkeypatch):
    """An FP8 KV cache: the model keeps its modules, and the one call is not made again every step."""
    cfg, model = _model(tiny_model_dir("llama"))
    layers = model.attention_layers()
    pool = torch.zeros(len(layers), 2, 8, BLOCK, layers[0].num_kv_heads, layers[0].head_dim, dtype=torch.float8_e4m3fn)
    for i, layer in enumerate(layers):
        layer.bind_cache(pool[i, 0], pool[i, 1])
    made = []
    make = FusedDecode._make
    monkeypatch.setattr(FusedDecode, "_make", lambda self: made.append(1) or make(self))
    for _ in range(3):
        positions, meta = _decode_step([5, 9], 8, seed=9)
        _forward(model, torch.tensor([7, 8]), positions, meta, fused=True)
    assert made == [1] and model.model.fused.kernel is None and not counted


def test_a_rebound_cache_makes_the_call_anew(tiny_model_dir, counted):
    """Sleep mode and a re-sized pool bind new caches: the call reads those, not the freed ones."""
    cfg, model = _model(tiny_model_dir("llama"))
    seq_lens, blocks = [5], 4
    ids = torch.tensor([9])
    positions, meta = _decode_step(seq_lens, blocks, seed=6)
    _bind(model, cfg, blocks, seed=7)
    _forward(model, ids, positions, meta, fused=True)
    first = model.model.fused.kernel
    pool = _bind(model, cfg, blocks, seed=8)
    before = pool.clone()
    want = _forward(model, ids, positions, _decode_step(seq_lens, blocks, seed=6)[1], fused=False)
    pool[:] = before
    got = _forward(model, ids, positions, _decode_step(seq_lens, blocks, seed=6)[1], fused=True)
    assert model.model.fused.kernel is not first and len(counted) == 2
    assert torch.equal(got, want)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3", "smollm3", "gemma2", "gemma3"])
def test_engine_greedy_equals_hf_through_the_one_call(reference, counted, arch):
    from hf_reference import MAX_TOKENS, engine_greedy

    path, prompts, expected = reference(arch)
    assert engine_greedy(path, prompts, MAX_TOKENS, max_model_len=512) == expected
    assert len(counted) > 50  # the decode steps went through it


def test_quantized_weights_take_the_call_through_their_float_copies(tmp_path, counted, monkeypatch):
    """A GGUF model of blocks the native GEMM does not decode (IQ4_NL, taken off its list here) keeps its modules; with
    `--cpu-dequant-cache` covering every layer its float copies go through the one call, with the same greedy ids."""
    from gguf_files import make_tiny_gguf

    from kernels import gguf_cpu
    monkeypatch.setattr(gguf_cpu, "NATIVE_TYPES", gguf_cpu.NATIVE_TYPES - {20})

    from engine import LLM, SamplingParams
    from hf_reference import make_prompts

    path = make_tiny_gguf(tmp_path, "llama", "IQ4_NL", initializer_range=0.2)
    prompts, params = make_prompts(400)[:2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    runs = []
    for gib in (0.0, 1.0):
        llm = LLM(str(path), device="cpu", max_model_len=256, cpu_dequant_cache=gib)
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, [params] * 2, use_tqdm=False)])
        assert (len(counted) > 0) == (gib > 0)
    assert runs[0] == runs[1]


@pytest.mark.parametrize("quant", ["Q4_K", "F16"])
def test_gguf_blocks_take_the_call_with_the_modules_ids(tmp_path, counted, quant):
    """A Q4_K_M-like GGUF (Q4_K matrices, a Q6_K attn_v: the QKV linear is two runs of two types): its blocks go
    through the one call (kernels/gguf_gemm.c per run), and the greedy ids equal the layer modules'. An F16 GGUF's
    matrices are floats in the model's dtype: the one call reads them as any float32 weight."""
    from gguf_files import make_tiny_gguf

    from engine import LLM, SamplingParams
    from hf_reference import make_prompts

    path = make_tiny_gguf(tmp_path, "llama", quant, big=True, initializer_range=0.2, types={"attn_v": "Q6_K"})
    prompts, params = make_prompts(400)[:3], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(str(path), device="cpu", max_model_len=256)
    fused = [o.outputs[0].token_ids for o in llm.generate(prompts, [params] * 3, use_tqdm=False)]
    runs = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj.method.runs
    if quant == "F16":  # the Q6_K v beside float q and k: a mix it refuses (the modules ran); then plain floats
        assert [run.type_id for run in runs] == [-1, 14] and not counted
        path = make_tiny_gguf(tmp_path / "plain", "llama", quant, big=True, initializer_range=0.2)
        llm = LLM(str(path), device="cpu", max_model_len=256)
        fused = [o.outputs[0].token_ids for o in llm.generate(prompts, [params] * 3, use_tqdm=False)]
    assert len(counted) > 0
    if quant == "Q4_K":
        assert [run.type_id for run in runs] == [12, 14]
    llm.engine.runner.model.model.fused = False
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, [params] * 3, use_tqdm=False)] == fused
