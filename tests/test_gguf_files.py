"""GGUF files as files: the header reader, split sets, damaged files, refused types, config from metadata, mmap.

The header is read with struct over an mmap (engine/config/gguf_file.py) and must agree with gguf-py's reader;
a split set loads from any of its parts and serves what the single file serves; a missing part, a renamed part,
a truncated file, a tensor type the engine does not read and an architecture it does not serve are each a
ValueError naming what is wrong, raised while the config is read, before any worker or weight exists. Llama 3's
RoPE scaling comes back from the `rope_freqs` tensor llama.cpp writes instead of the config (and the engine then
matches transformers on the original folder); Gemma's 27B attention scale follows llama.cpp's rule. Weights are
views of the file's mapping, not copies.
"""
from __future__ import annotations

import shutil
import struct

import gguf
import numpy as np
import pytest
import torch
from gguf_files import make_tiny_gguf
from tiny_models import ARCHS

from engine import LLM, SamplingParams
from engine.config.gguf_file import read_gguf_header, string_array
from engine.config.model import ModelConfig
from hf_reference import hf_greedy, make_prompts

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return make_tiny_gguf(tmp_path_factory.mktemp("gguf"), "qwen2", "Q8_0")


def test_header_agrees_with_gguf_py(qwen2):
    header = read_gguf_header(qwen2)
    reference = gguf.GGUFReader(qwen2)
    assert header.architecture == "qwen2" and header.arch_value("block_count") == 2
    assert list(header.tensors) == [t.name for t in reference.tensors]
    for t in reference.tensors:
        ours = header.tensors[t.name]
        assert (ours.offset, ours.nbytes, ours.type.name) == (t.data_offset, t.n_bytes, t.tensor_type.name)
        assert ours.shape == tuple(reversed(t.shape.tolist()))
    tokens = reference.fields["tokenizer.ggml.tokens"]
    assert string_array(header.metadata["tokenizer.ggml.tokens"]) == [str(bytes(tokens.parts[i]), "utf-8")
                                                                     for i in tokens.data]
    assert header.metadata["tokenizer.chat_template"].startswith("{% for m in messages %}")


def test_a_split_set_loads_from_any_part(tmp_path, qwen2):
    first = make_tiny_gguf(tmp_path, "qwen2", "Q8_0", split_max_tensors=8)
    parts = sorted(tmp_path.glob("tiny-qwen2-Q8_0-*.gguf"))
    assert first == parts[0] and len(parts) == 4 and first.name.endswith("-00001-of-00004.gguf")
    header = read_gguf_header(parts[2])
    assert header.files == tuple(parts) and len(header.tensors) == len(read_gguf_header(qwen2).tensors)
    prompts = make_prompts(400)[:2]
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)] * 2
    split_ids = [o.outputs[0].token_ids for o in LLM(str(parts[1]), device="cpu", max_model_len=128)
                 .generate(prompts, params, use_tqdm=False)]
    whole_ids = [o.outputs[0].token_ids for o in LLM(str(qwen2), device="cpu", max_model_len=128)
                 .generate(prompts, params, use_tqdm=False)]
    assert split_ids == whole_ids

    parts[3].unlink()
    with pytest.raises(ValueError, match=r"part of a split GGUF of 4 files, but tiny-qwen2-Q8_0-00004-of-00004.gguf is "
                                         r"missing"):
        LLM(str(first), device="cpu")
    lone = tmp_path / "renamed.gguf"
    shutil.copy(parts[1], lone)
    with pytest.raises(ValueError, match=r"renamed.gguf is part 2 of a split GGUF of 4 files"):
        read_gguf_header(lone)


def test_a_truncated_file_is_refused_before_anything_loads(tmp_path, qwen2):
    cut = tmp_path / "cut.gguf"
    data = qwen2.read_bytes()
    cut.write_bytes(data[:-1000])
    with pytest.raises(ValueError, match=r"cut.gguf is truncated: tensor '.*' ends at byte \d+, the file has \d+ "
                                         r"bytes; download it again"):
        LLM(str(cut), device="cpu")
    cut.write_bytes(data[:5000])
    with pytest.raises(ValueError, match=r"cut.gguf ends inside its GGUF header"):
        ModelConfig.from_folder(cut)
    cut.write_bytes(b"GGML" + data[4:100])
    with pytest.raises(ValueError, match=r"is not a GGUF file"):
        read_gguf_header(cut)


def _with_tensor_type(tmp_path, qtype: gguf.GGMLQuantizationType, patched_id: int | None = None):
    """A small GGUF with one Q2_K (or other) tensor; `patched_id` rewrites its type id in the header afterwards."""
    path = tmp_path / "typed.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    w.add_tensor("token_embd.weight", np.zeros((4, 256 // block * size), dtype=np.uint8), raw_dtype=qtype)
    w.write_header_to_file(path=path)
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if patched_id is not None:
        raw = bytearray(path.read_bytes())
        at = raw.index(b"token_embd.weight") + len(b"token_embd.weight") + 4 + 2 * 8  # name, n_dims, two dims
        raw[at:at + 4] = struct.pack("<I", patched_id)
        path.write_bytes(bytes(raw))
    return path


def test_a_type_the_engine_does_not_read_is_refused_by_name(tmp_path):
    path = _with_tensor_type(tmp_path, gguf.GGMLQuantizationType.Q2_K)
    with pytest.raises(ValueError, match=r"GGUF tensor 'token_embd.weight' is stored as Q2_K, which this engine does "
                                         r"not read; supported: F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, IQ4_XS, "
                                         r"IQ4_NL"):
        LLM(str(path), device="cpu")
    assert read_gguf_header(path, check_types=False).tensors["token_embd.weight"].type.name == "Q2_K"
    path = _with_tensor_type(tmp_path, gguf.GGMLQuantizationType.Q8_0, patched_id=99)
    with pytest.raises(ValueError, match=r"GGUF tensor type 99 is unknown \(to this engine and to gguf-py\); "
                                         r"supported: F32"):
        read_gguf_header(path)


def test_an_architecture_not_served_is_named(tmp_path):
    path = tmp_path / "falcon.gguf"
    w = gguf.GGUFWriter(str(path), "falcon")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file(path=path)
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"GGUF architecture 'falcon' is not supported; supported: gemma2, gemma3, "
                                         r"gpt-oss, llama, mistral3, phi3, qwen2, qwen3, qwen35, qwen35moe, "
                                         r"qwen3moe, qwen3next"):
        ModelConfig.from_folder(path)


def test_llama3_rope_scaling_comes_back_from_rope_freqs(tmp_path):
    """The tiny Llama's llama3 RoPE (factor 8, original context 64) round-trips through rope_freqs, and the engine
    on the F32 file gives transformers' ids on the original folder."""
    scaling = ARCHS["llama"][2]["rope_scaling"]
    path = make_tiny_gguf(tmp_path, "llama", "F32", rope_scaling=scaling, initializer_range=0.2)
    assert "rope_freqs.weight" in read_gguf_header(path).tensors
    cfg = ModelConfig.from_folder(path)
    assert cfg.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 64}
    prompts, max_tokens = make_prompts(400)[:3], [8, 8, 8]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    ours = [o.outputs[0].token_ids for o in LLM(str(path), device="cpu").generate(prompts, params, use_tqdm=False)]
    assert ours == hf_greedy(path.parent / "tiny-llama", prompts, max_tokens)


def test_gemma_27b_attention_scale_follows_llama_cpp(tmp_path):
    path = tmp_path / "g27.gguf"
    w = gguf.GGUFWriter(str(path), "gemma3")
    for add, value in ((w.add_block_count, 62), (w.add_embedding_length, 5376), (w.add_head_count, 32),
                       (w.add_head_count_kv, 16), (w.add_key_length, 128), (w.add_value_length, 128),
                       (w.add_feed_forward_length, 21504), (w.add_context_length, 131072)):
        add(value)
    w.add_tensor("token_embd.weight", np.zeros((2, 5376), dtype=np.float32))
    w.write_header_to_file(path=path)
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    cfg = ModelConfig.from_folder(path)
    assert cfg.hf_text_config["query_pre_attn_scalar"] == 168 and cfg.head_dim == 128


def test_weights_are_views_of_the_files_mapping(qwen2):
    """The loader maps the file and hands out views of it: no tensor is read into memory of its own."""
    from engine.config.model import ModelConfig as _  # noqa: F401  (the loader's model only needs a config)
    from engine.models.registry import model_class
    from engine.quantization.gguf.weight import GgufWeight
    from engine.worker import gguf_loader

    cfg = ModelConfig.from_folder(qwen2)
    model = model_class(cfg.architecture)(cfg)
    maps = []
    real_memmap = np.memmap

    def recording_memmap(*args, **kwargs):
        m = real_memmap(*args, **kwargs)
        maps.append(m)
        return m

    gguf_loader.np.memmap = recording_memmap
    try:
        pairs = list(gguf_loader.iterate_gguf_weights(qwen2, model))
    finally:
        gguf_loader.np.memmap = real_memmap
    (mapping,) = maps
    start = mapping.ctypes.data
    end = start + mapping.size
    assert mapping.mode == "c"
    for name, tensor in pairs:
        t = tensor.data if isinstance(tensor, GgufWeight) else tensor
        assert start <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= end, name
    assert any(isinstance(t, GgufWeight) for _, t in pairs) and any(isinstance(t, torch.Tensor) for _, t in pairs)


def test_served_names_and_the_routers_library(tmp_path, qwen2):
    """A GGUF is served under its file name (a split set's without the part suffix), and `--models-dir` lists the
    GGUF files in it beside model folders."""
    from engine.config.model_discovery import default_model_name, servable_models
    from engine.entrypoints.router.placement import config_folder
    assert default_model_name(str(qwen2)) == "tiny-qwen2-Q8_0"
    first = make_tiny_gguf(tmp_path, "qwen2", "Q8_0", split_max_tensors=10, file_name="big.gguf")
    assert default_model_name(str(first)) == "big"
    library = servable_models(tmp_path, cache_dir=tmp_path / "no-cache")
    assert library["big"] == first and library["tiny-qwen2"] == tmp_path / "tiny-qwen2"
    assert config_folder(str(first), None, "model big") == first
    assert ModelConfig.from_folder(config_folder(str(first), None, "model big")).architecture == "Qwen2ForCausalLM"
