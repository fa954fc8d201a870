"""The engine's pooling path offline (`LLM.embed`) against transformers on the same weights: mean pooling
without normalisation (tensor parallel 2) and CLS pooling, both across prefill chunks (a running sum restarted at position 0),
`--task embed` on a generation checkpoint (its LM head dropped, its final hidden state pooled), and the
pooler configuration read from sentence-transformers files (unsupported modes refused, not approximated)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from engine.entrypoints.llm import LLM
from engine.config.pooler import read_pooler_config, resolve_task
from engine.sample.pooling import PoolingParams
from tiny_embedders import hf_embeddings, make_tiny_embedder

PROMPTS = [list(range(5, 45)), list(range(7, 12)), list(range(9, 30))]
ENGINE = dict(device="cpu", max_model_len=128, num_gpu_blocks_override=64, max_num_batched_tokens=16)


@pytest.mark.parametrize("pooling,tp", [("MEAN", 2), ("CLS", 1)])
def test_pooling_across_chunks_equals_hf(tmp_path, tiny_model_dir, pooling, tp):
    """Under tensor parallel (mean) the worker drops its LM head too and rank 0 pools the full hidden state."""
    path = make_tiny_embedder(tmp_path, pooling, normalize=pooling == "CLS", matryoshka=False,
                              base=tiny_model_dir("qwen3"))
    llm = LLM(str(path), tensor_parallel_size=tp, **ENGINE)
    try:
        outs = llm.embed(PROMPTS + PROMPTS[:1], use_tqdm=False)  # the repeat may not reuse cached blocks
        with pytest.raises(ValueError, match="does not support truncated embeddings"):
            llm.embed(PROMPTS[1], PoolingParams(dimensions=8), use_tqdm=False)
    finally:
        llm.engine.shutdown()
    ref = hf_embeddings(path, PROMPTS + PROMPTS[:1], pooling, normalize=pooling == "CLS")
    for out, expected in zip(outs, ref):
        np.testing.assert_allclose(out.outputs.embedding, expected, atol=1e-5)
    assert outs[-1].num_cached_tokens == 0


def test_task_embed_on_a_generation_checkpoint(tiny_model_dir):
    path = tiny_model_dir("qwen3")  # model.* tensors and an untied lm_head
    assert resolve_task("auto", path) == "generate"
    llm = LLM(str(path), task="embed", **ENGINE)
    try:
        assert not hasattr(llm.engine.runner.model, "lm_head")
        outs = llm.embed(PROMPTS[:2], PoolingParams(normalize=False), use_tqdm=False)
        with pytest.raises(ValueError, match="use /v1/embeddings"):
            llm.generate("hello", use_tqdm=False)
    finally:
        llm.engine.shutdown()
    ref = hf_embeddings(path, PROMPTS[:2], "LAST", normalize=False)
    for out, expected in zip(outs, ref):
        np.testing.assert_allclose(out.outputs.embedding, expected, atol=1e-5)


def _st_folder(tmp_path, modules, pooling_config, hf=None):
    (tmp_path / "config.json").write_text(json.dumps(hf or {"architectures": ["Qwen3ForCausalLM"]}))
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir(exist_ok=True)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config))
    return tmp_path


ST = "sentence_transformers.models."
POOL = {"idx": 1, "name": "1", "path": "1_Pooling", "type": ST + "Pooling"}


def test_pooler_config_from_sentence_transformers(tmp_path):
    folder = _st_folder(tmp_path, [{"type": ST + "Transformer"}, POOL], {"pooling_mode_mean_tokens": True})
    config = read_pooler_config(folder, {"matryoshka_dimensions": [16, 32]})
    assert (config.pooling_type, config.normalize, config.matryoshka_dimensions) == ("MEAN", False, (16, 32))
    assert resolve_task("auto", folder) == "embed"
    with pytest.raises(ValueError, match=r"dimensions must be one of \[16, 32\]"):
        config.check_dimensions(20, 64)
    _st_folder(tmp_path, [{"type": ST + "Transformer"}, POOL], {"pooling_mode_max_tokens": True})
    with pytest.raises(ValueError, match="unsupported.*pooling_mode_max_tokens"):
        read_pooler_config(folder, {})
    _st_folder(tmp_path, [{"type": ST + "Transformer"}, POOL, {"type": ST + "Dense"}], {})
    with pytest.raises(ValueError, match=r"modules \['Dense'\] are not supported"):
        read_pooler_config(folder, {})
    assert resolve_task("auto", folder) == "embed"  # served as an embedder, which then names the problem
