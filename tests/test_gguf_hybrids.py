"""GGUFs that llama.cpp's own converter writes and transformers cannot load: Qwen3.5 (qwen35), Qwen3.5-MoE
(qwen35moe), Qwen3-Next (qwen3next) and Mistral-Small-3.x's text model (mistral3).

The oracle is our engine on the HF folder the file was converted from (HF-parity tested elsewhere): the converter
(tests/llama_cpp_convert.py, skipped with the install line when it is not unpacked) is the independent part, with
its DeltaNet edits (A_log stored as -exp, the qkvz/ba splits, the conv squeezed, (1 + w) norms, qwen35's tiled
value heads) for the engine to undo. F32 files must give the folder's greedy ids; a Q8_0 file must give the ids
of its own dequantized copy (written here with gguf-py), so the quantized path is checked exactly, blocks kept.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from llama_cpp_convert import INSTALL, convert, find_converter
from tiny_models import make_tiny_model

from engine import LLM, SamplingParams
from engine.config.gguf_file import read_gguf_header

pytestmark = pytest.mark.timeout(300)

PROMPTS = [[5, 17, 33, 90, 101, 7, 250], [300, 2, 44, 9, 61]]
MAX_TOKENS = 8
# tiny model -> (llama.cpp's architecture, overrides); Qwen3-Next's GGUF has no dense-MLP layers
CASES = {"qwen3_5": ("qwen35", {}), "qwen3_5_moe": ("qwen35moe", {}),
         "qwen3_next": ("qwen3next", {"mlp_only_layers": []}), "mistral3-vl": ("mistral3", {})}
NO_MTP = ("--no-mtp",)  # the hybrids' converter counts on an MTP head, which the tiny models do not have


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[tuple[str, str], tuple[Path, Path]]:
    """(tiny model, outtype) -> (its HF folder, the GGUF llama.cpp's converter wrote from it)."""
    converter = find_converter()
    if converter is None:
        pytest.skip(f"llama.cpp's converter is not unpacked: {INSTALL}")
    work = tmp_path_factory.mktemp("hybrids")
    files, jobs = {}, []
    for arch, outtype in [(arch, "f32") for arch in CASES] + [("qwen3_5", "q8_0")]:
        folder = work / f"tiny-{arch}"
        if not folder.exists():
            make_tiny_model(work, arch, **CASES[arch][1])
        files[arch, outtype] = folder, work / f"{arch}-{outtype}.gguf"
        jobs.append((folder, files[arch, outtype][1], outtype, NO_MTP if arch.startswith("qwen") else ()))
    convert(converter, jobs)
    return files


def greedy(path: Path, **kwargs) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(path), device="cpu", max_model_len=128, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], [params] * len(PROMPTS), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.mark.parametrize("arch", list(CASES))
def test_converted_file_serves_as_its_folder(converted, arch):
    folder, path = converted[arch, "f32"]
    assert read_gguf_header(path).architecture == CASES[arch][0]
    ours, _ = greedy(path)
    assert ours == greedy(folder)[0]
    assert len({tuple(o) for o in ours}) > 1 and any(len(set(o)) > 2 for o in ours)  # not a degenerate model


@pytest.mark.parametrize("arch", ["qwen3_5", "mistral3-vl"])
def test_tokenizer_and_template_from_the_converted_file(converted, arch):
    from transformers import AutoTokenizer

    from engine.core.tokenizer import load_tokenizer
    folder, path = converted[arch, "f32"]
    ours, theirs = load_tokenizer(path), AutoTokenizer.from_pretrained(folder)
    for text in ("The quick brown fox.", "Les élèves étudient l'été. 🚀 <|im_start|>user\nhi<|im_end|>"):
        assert ours.encode(text) == theirs.encode(text)
    chat = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)


def test_q8_0_file_serves_as_its_dequantized_copy(converted, tmp_path):
    """qwen35 at Q8_0: the DeltaNet projections keep their blocks (out_proj's tiled columns answered by the layer's
    output order, the v-head rows put back as bytes) and give exactly the ids of the same values in F32."""
    _, path = converted["qwen3_5", "q8_0"]
    ours, llm = greedy(path)
    mixer = llm.engine.runner.model.model.layers[0].linear_attn
    assert mixer.out_proj.weight.dtype == torch.uint8 and mixer.in_proj_qkv.weight.dtype == torch.uint8
    assert mixer.out_order is not None
    assert ours == greedy(dequantized_copy(path, tmp_path / "dequantized.gguf"))[0]


def test_mtp_layers_of_a_converted_file_are_not_the_target(converted, tmp_path):
    """llama.cpp's converter keeps a Qwen3.5 checkpoint's MTP head by default, as one more block (block_count + 1,
    nextn_predict_layers 1, blk.N.nextn.*): the engine serves the N target layers and leaves that block out."""
    _, path = converted["qwen3_5", "f32"]
    extra = {f"blk.4.{name}.weight": np.random.default_rng(0).standard_normal(shape).astype(np.float32)
             for name, shape in (("nextn.eh_proj", (64, 128)), ("nextn.enorm", (64,)), ("attn_norm", (64,)))}
    with_mtp = dequantized_copy(path, tmp_path / "mtp.gguf", tensors=extra, fields={
        "qwen35.block_count": 5, "qwen35.attention.recurrent_layers": [True, False, True, False, False],
        "qwen35.nextn_predict_layers": 1})
    assert greedy(with_mtp)[0] == greedy(path)[0]


def test_tiled_out_proj_under_tensor_parallel(monkeypatch):
    """Two ranks: out_proj's blocks can span two tiled value heads, so no rank's columns would be whole heads of its
    own; that matrix is dequantized and its columns put back grouped, and the layer reorders nothing."""
    import engine.layers.gated_deltanet as gdn
    import engine.models.qwen3_next as qwen3_next
    from engine.config.model import LinearAttentionConfig
    from engine.quantization.gguf.weight import GgufWeight
    from gguf_blocks import quantize
    for module in (gdn, qwen3_next):
        monkeypatch.setattr(module, "get_tp_size", lambda: 2)
    monkeypatch.setattr(gdn, "get_tp_rank", lambda: 0)
    la = LinearAttentionConfig((0,), 2, 4, 32, 32, 4, out_proj_tiled=True)
    assert gdn.GatedDeltaNet(64, la, 1e-6, "model.layers.0.linear_attn").out_order is None
    weight = torch.randn(64, 128)
    blocks = GgufWeight(torch.from_numpy(quantize(weight.numpy(), "Q8_0")), 8, 128)
    cfg = SimpleNamespace(linear_attention=la)  # all the edit reads of the ModelConfig
    [(_, loaded)] = qwen3_next.undo_converter_edits("model.layers.0.linear_attn.out_proj.weight", blocks, cfg)
    tiled = blocks.dequantize()
    # grouped column (key head g, its value head j, e) came from tiled column (j, g, e)
    assert torch.equal(loaded[:, 1 * 32:2 * 32], tiled[:, 2 * 32:3 * 32])  # g 0, j 1 <- j 1, g 0
    assert torch.equal(loaded[:, 2 * 32:3 * 32], tiled[:, 1 * 32:2 * 32])  # g 1, j 0 <- j 0, g 1


def dequantized_copy(path: Path, out: Path, fields: dict | None = None, tensors: dict | None = None) -> Path:
    """The GGUF at `path` with every tensor dequantized to F32 by gguf-py, metadata as it is but for `fields`
    (key -> value of the same type; a new key an unsigned int), and `tensors` (name -> float32 array) added."""
    import gguf
    reader = gguf.GGUFReader(path)
    writer = gguf.GGUFWriter(str(out), reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, (fields or {}).get(key, field.contents()), field.types[0], sub_type=sub)
    for key, value in (fields or {}).items():
        if key not in reader.fields:
            writer.add_uint32(key, value)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32))
    for name, data in (tensors or {}).items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
