"""Model info from config.json and safetensors headers only; the hub cache listing degrades to []."""
import qt_helpers  # noqa: F401  (offscreen Qt, private data dir)

import json
import struct

import pytest

from app.hf_cache import cached_models
from app.model_info import count_parameters, read_model_info


def write_safetensors(path, tensors):
    header = {name: {"dtype": "BF16", "shape": shape, "data_offsets": [0, 0]} for name, shape in tensors.items()}
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)


def test_sharded_index_param_count_and_config(tmp_path):
    write_safetensors(tmp_path / "a.safetensors", {"w1": [4, 8], "b": [8]})
    write_safetensors(tmp_path / "b.safetensors", {"w2": [2, 3, 5]})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"w1": "a.safetensors", "b": "a.safetensors", "w2": "b.safetensors"}}))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"],
                                                      "max_position_embeddings": 32768, "torch_dtype": "bfloat16"}))
    info = read_model_info(tmp_path)
    assert info.num_parameters == 32 + 8 + 30 == count_parameters(tmp_path)
    assert (info.architecture, info.context_length, info.dtype) == ("Qwen2ForCausalLM", 32768, "bfloat16")
    assert info.describe() == "Qwen2ForCausalLM · 70 parameters · context 32,768 tokens · bfloat16"


def test_tiny_model_folder(tiny_model_dir):
    folder = tiny_model_dir("llama")
    info = read_model_info(folder)
    assert info.architecture == "LlamaForCausalLM"
    assert info.num_parameters and info.num_parameters > 1000
    assert info.context_length and info.dtype != "unknown"


def test_missing_config_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        read_model_info(tmp_path)


def test_empty_hub_cache(tmp_path):
    assert cached_models(tmp_path / "nothing-here") == []


def test_hub_cache_lists_model_snapshots(tmp_path):
    repo = tmp_path / "models--org--tiny"
    blob = repo / "blobs" / "abc123"
    blob.parent.mkdir(parents=True)
    blob.write_text('{"architectures": ["LlamaForCausalLM"]}')
    snapshot = repo / "snapshots" / "0123456789abcdef"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").symlink_to("../../blobs/abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123456789abcdef")
    found = cached_models(tmp_path)
    assert [m.repo_id for m in found] == ["org/tiny"]
    assert found[0].snapshot == snapshot and found[0].size_on_disk > 0
    assert read_model_info(found[0].snapshot).architecture == "LlamaForCausalLM"
