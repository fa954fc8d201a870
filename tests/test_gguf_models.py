"""GGUF files through the engine: greedy ids identical to transformers loading the same file, per family and type.

Each case writes a tiny random model as a GGUF (tests/gguf_files.py, as llama.cpp's converter would: Llama's q/k
permuted, Gemma's norms as 1 + w, MoE experts stacked, matrices in the type under test), serves it from the file
alone (config, tokenizer and weights from the GGUF's metadata and tensors) and compares greedy continuations with
transformers' `from_pretrained(..., gguf_file=...)`, which dequantizes the same file (the config for transformers
comes from the HF folder: its legacy GGUF reader has no head_dim for Qwen3). Q4_K needs rows of whole 256-wide
super-blocks: those models are 256 wide. Weights ten times HF's init, so the continuations are not one token
repeated. Also here: the layers keep the file's blocks (no dequantized copy), TP=2 splits them, and a split
that would cut a block is refused by name.
"""
from __future__ import annotations

import pytest
import torch
from gguf_files import hf_gguf_model, make_tiny_gguf

from engine import LLM, SamplingParams
from engine.core.tokenizer import load_tokenizer
from hf_reference import make_prompts

pytestmark = pytest.mark.timeout(600)

ARCHS = ["llama", "qwen2", "qwen3", "qwen3_moe", "gemma3"]
QUANTS = ["F16", "Q8_0", "Q4_K"]
MAX_TOKENS = 8


def tiny(tmp_path, arch: str, quant: str, **overrides):
    if arch == "gemma3":
        overrides.setdefault("tie_word_embeddings", False)  # tied, its tiny head echoes the last token
    if arch == "phi3" and quant.endswith("_K"):  # 64-wide heads: 24 rotated frequencies, a LongRoPE factor each
        overrides.setdefault("rope_parameters", {
            "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 512,
            "partial_rotary_factor": 0.75, "short_factor": [1.0 + i / 8 for i in range(24)],
            "long_factor": [1.0 + i for i in range(24)]})
    return make_tiny_gguf(tmp_path, arch, quant, big=quant.endswith("_K"), initializer_range=0.2, **overrides)


def hf_continuations(path, arch: str, prompts) -> list[list[int]]:
    model = hf_gguf_model(path, path.parent / f"tiny-{arch}")
    outs = []
    for prompt in prompts:
        with torch.no_grad():
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long), eos_token_id=None)
        outs.append(ids[0, len(prompt):].tolist())
    return outs


def engine_continuations(path, prompts, **kwargs) -> list[list[int]]:
    llm = LLM(str(path), device="cpu", max_model_len=256, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, [params] * len(prompts), use_tqdm=False)]


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_ids_match_transformers_on_the_same_file(tmp_path, arch, quant):
    path = tiny(tmp_path, arch, quant)
    prompts = make_prompts(400)[:3]
    ours = engine_continuations(path, prompts)
    assert ours == hf_continuations(path, arch, prompts)
    assert len({tuple(o) for o in ours}) > 1 and any(len(set(o)) > 2 for o in ours)  # not a degenerate model


@pytest.mark.parametrize("quant", QUANTS)
def test_phi3_fused_tensors_and_longrope_from_the_file(tmp_path, quant):
    """llama.cpp's phi3 GGUF: fused attn_qkv and ffn_up (gate and up) split into their shards in their blocks,
    LongRoPE's factors read from the rope_factors tensors, the partial rotary from rope.dimension_count."""
    path = tiny(tmp_path, "phi3", quant)
    prompts = make_prompts(400)[:3]
    ours = engine_continuations(path, prompts)
    assert ours == hf_continuations(path, "phi3", prompts)
    assert len({tuple(o) for o in ours}) > 1


def test_gemma2_soft_caps_and_windows_from_the_file(tmp_path):
    """llama.cpp's gemma2 GGUF: both soft caps and the sliding window read from the metadata, every other layer
    local as in HF; norms stored as 1 + w."""
    path = tiny(tmp_path, "gemma2", "Q8_0")
    prompts = make_prompts(400)[:3]
    ours = engine_continuations(path, prompts)
    assert ours == hf_continuations(path, "gemma2", prompts)
    assert len({tuple(o) for o in ours}) > 1


def test_weights_stay_in_their_blocks(tmp_path):
    """A Q4_K file's layers hold its bytes: the linear weights, the embedding and the experts are uint8 blocks,
    and the model's bytes in blocks are the file's quantized tensors (its F32 norms and router the model keeps in
    its dtype)."""
    from engine.config.gguf_file import read_gguf_header
    path = tiny(tmp_path, "qwen3_moe", "Q4_K")
    llm = LLM(str(path), device="cpu", max_model_len=256)
    model = llm.engine.runner.model
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.dtype == torch.uint8 and layer.self_attn.qkv_proj.weight.dim() == 1
    assert layer.mlp.experts.w13_weight.dtype == torch.uint8
    assert model.model.embed_tokens.weight.dtype == torch.uint8 and model.lm_head.weight.dtype == torch.uint8
    header = read_gguf_header(path)
    file_bytes = sum(t.nbytes for t in header.tensors.values() if t.type.name not in ("F32", "F16", "BF16"))
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.dtype == torch.uint8)
    assert model_bytes == file_bytes


def test_mixed_types_in_one_stacked_layer(tmp_path):
    """A Q4_K_M-style file keeps attn_v and ffn_down in Q6_K beside Q4_K q/k: the stacked qkv_proj holds two runs
    (the layer's bytes back to back), and the continuations still match transformers."""
    path = tiny(tmp_path, "llama", "Q4_K", types={".attn_v.": "Q6_K", ".ffn_down.": "Q6_K"})
    prompts = make_prompts(400)[:3]
    llm = LLM(str(path), device="cpu", max_model_len=256)
    qkv = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert [r.type_id for r in qkv.method.runs] == [12, 14]
    assert qkv.method.describe() == "384 rows Q4_K + 128 rows Q6_K"
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, [params] * 3, use_tqdm=False)]
    assert ours == hf_continuations(path, "llama", prompts)


def test_tensor_parallel_splits_along_the_blocks(tmp_path):
    """TP=2 over gloo: each rank keeps its rows (column-parallel) and its whole blocks of input columns
    (row-parallel o_proj and down_proj: 512 / 2 = 256, one Q4_K super-block); the same ids as one rank."""
    path = tiny(tmp_path, "qwen3", "Q4_K", num_attention_heads=8)
    prompts = make_prompts(400)[:2]
    assert engine_continuations(path, prompts, tensor_parallel_size=2) == engine_continuations(path, prompts)


def test_a_split_that_cuts_a_block_is_refused(tmp_path):
    """down_proj's 256 input features over two ranks are 128 each: half a Q4_K super-block, refused by name."""
    path = tiny(tmp_path, "qwen3", "Q4_K", num_attention_heads=8, intermediate_size=256)
    with pytest.raises(Exception, match=r"mlp.down_proj: a tensor-parallel split at input columns \[0, 128\) cuts "
                                        r"Q4_K blocks of 256 weights"):
        LLM(str(path), device="cpu", max_model_len=256, tensor_parallel_size=2)


def test_mistral_converts_as_llama_with_its_own_head_dim(tmp_path):
    """llama.cpp writes Mistral (and Mistral 3's text model) as `llama`: q/k permuted, and a head_dim that is not
    hidden / heads (Mistral Small's 128 of 5120 / 32) read from attention.key_length; no sliding window."""
    from transformers import AutoModelForCausalLM
    path = tiny(tmp_path, "mistral", "F32", sliding_window=None, head_dim=32)
    prompts = make_prompts(400)[:3]
    ours = engine_continuations(path, prompts, dtype="float32")
    # transformers reads no GGUF of a Mistral config: the reference is the folder the file was written from
    model = AutoModelForCausalLM.from_pretrained(path.parent / "tiny-mistral", dtype=torch.float32).eval()
    for prompt, got in zip(prompts, ours):
        with torch.no_grad():
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long), eos_token_id=None)
        assert got == ids[0, len(prompt):].tolist()
    assert len({tuple(o) for o in ours}) > 1


def test_gpt_oss_mxfp4_experts_sinks_and_yarn(tmp_path):
    """llama.cpp's gpt-oss GGUF: MXFP4 experts (gate and up apart) kept in their blocks, sinks, biases, YaRN and
    the alternating window from the file. transformers' GGUF reader fails on this architecture's metadata, so the
    reference is transformers on the source folder with its experts replaced by what gguf-py dequantizes from
    the file (the rest is F32, exact)."""
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = make_tiny_gguf(tmp_path, "gpt_oss", "F32", types={"_exps": "MXFP4"}, initializer_range=0.2)
    prompts = make_prompts(400)[:3]
    # AutoTokenizer's GGUF config reader fails on gpt-oss's rope.scaling keys: the generic fast tokenizer of the file
    source = AutoTokenizer.from_pretrained(path.parent / "tiny-gpt_oss")
    assert [load_tokenizer(path).encode(t) for t in ("Hello  world", "Ça 🚀")] == \
        [source.encode(t) for t in ("Hello  world", "Ça 🚀")]
    ours = engine_continuations(path, prompts, dtype="float32")
    model = AutoModelForCausalLM.from_pretrained(path.parent / "tiny-gpt_oss", dtype=torch.float32).eval()
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}

    def exps(layer: int, proj: str) -> torch.Tensor:
        t = tensors[f"blk.{layer}.ffn_{proj}_exps.weight"]
        return torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())  # [E, out, in]

    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            gate_up = layer.mlp.experts.gate_up_proj  # [E, H, 2I], gate and up interleaved
            gate_up[:, :, 0::2] = exps(i, "gate").transpose(1, 2)
            gate_up[:, :, 1::2] = exps(i, "up").transpose(1, 2)
            layer.mlp.experts.down_proj.copy_(exps(i, "down").transpose(1, 2))
        for prompt, got in zip(prompts, ours):
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long), eos_token_id=None)
            assert got == ids[0, len(prompt):].tolist()
    assert len({tuple(o) for o in ours}) > 1


def test_gpt_oss_mxfp4_experts_split_along_their_blocks(tmp_path):
    """TP=2 over gloo: each rank keeps half of every expert's gate/up rows and whole MXFP4 blocks of down_proj's
    64 input features (32 each), its heads' sinks; the same ids as one rank."""
    path = make_tiny_gguf(tmp_path, "gpt_oss", "Q8_0", types={"_exps": "MXFP4"}, initializer_range=0.2,
                          intermediate_size=64)
    prompts = make_prompts(400)[:2]
    assert engine_continuations(path, prompts, tensor_parallel_size=2) == engine_continuations(path, prompts)


def test_cpu_dequant_cache_keeps_float_copies_within_its_budget(tmp_path):
    """--cpu-dequant-cache: layers dequantized once at start, in the model's order while the budget lasts, and
    the same ids as dequantizing per call; the blocks stay (the copies are beside them). Default: no copies."""
    from engine.layers.embedding import ParallelLMHead
    from engine.layers.linear import LinearBase
    path = tiny(tmp_path, "llama", "Q8_0")
    prompts = make_prompts(400)[:2]

    def copies(llm) -> list[bool]:
        layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, (LinearBase, ParallelLMHead))]
        assert all(m.weight.dtype == torch.uint8 for m in layers)
        return [m.dequantized is not None for m in layers]

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    runs = {}
    for gib in (0.0, 64 * 64 * 4 * 5 / 2**30, 1.0):  # none, the first few layers (80 KiB), all
        llm = LLM(str(path), device="cpu", max_model_len=256, cpu_dequant_cache=gib)
        runs[gib] = copies(llm), [o.outputs[0].token_ids for o in llm.generate(prompts, [params] * 2, use_tqdm=False)]
    (none, base), (some, ids_some), (every, ids_all) = runs.values()
    assert not any(none) and all(every) and 0 < sum(some) < len(some)
    assert base == ids_some == ids_all

    class NoDequantize:  # with every layer copied, no layer may decode its blocks (row-parallel ones skipped it)
        def apply(self, *args):
            raise AssertionError("a cached layer dequantized per call")

    for layer in llm.engine.runner.model.modules():
        if isinstance(layer, LinearBase):
            layer.method = NoDequantize()
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, [params] * 2, use_tqdm=False)] == ids_all
