"""The planner counts a GGUF model's weights as the engine holds them: the file's quantized bytes as stored,
float tensors in the engine's dtype; the GUI's verdicts and the router's placement read the same numbers."""
from __future__ import annotations

import pytest
from gguf_files import make_tiny_gguf

from engine import LLM
from engine.config.model import ModelConfig
from engine.planning.planner import plan_capacity
from engine.planning.units import GIB
from engine.planning.weights import weights_bytes_per_card

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("arch, quant", [("qwen3_moe", "Q4_K"), ("gemma3", "Q8_0")])
def test_planned_weights_are_what_the_engine_holds(tmp_path, arch, quant):
    path = make_tiny_gguf(tmp_path, arch, quant, big=quant.endswith("_K"))
    cfg = ModelConfig.from_folder(path)
    llm = LLM(str(path), device="cpu", max_model_len=128)
    assert weights_bytes_per_card(cfg, dtype_bytes=4) == llm.engine.runner.weights_bytes()
    assert weights_bytes_per_card(cfg, dtype_bytes=4, tp=2) == -(-llm.engine.runner.weights_bytes() // 2)


def test_planned_gpt_oss_weights_are_what_the_engine_holds(tmp_path):
    """MXFP4 experts at their block size (an E8M0 byte per 32 codes), sinks and biases in the engine's dtype."""
    path = make_tiny_gguf(tmp_path, "gpt_oss", "Q8_0", types={"_exps": "MXFP4"})
    cfg = ModelConfig.from_folder(path)
    llm = LLM(str(path), device="cpu", max_model_len=128)
    assert weights_bytes_per_card(cfg, dtype_bytes=4) == llm.engine.runner.weights_bytes()


def test_plan_capacity_reads_a_gguf(tmp_path):
    path = make_tiny_gguf(tmp_path, "qwen3", "Q4_K", big=True)
    cfg = ModelConfig.from_folder(path)
    plan = plan_capacity(cfg, [24 * GIB], 0.9, dtype="bfloat16")
    assert plan.weights_bytes == pytest.approx(weights_bytes_per_card(cfg, 2) + 512 * cfg.head_dim * 4, rel=0.2)
    assert cfg.quantization.describe().startswith("gguf Q4_K")


def test_the_benchmark_files_and_recipes(tmp_path):
    """`pagedesk-bench gguf`: its random-code Llama GGUF reads back with the shapes and types written, and its
    planned files (Qwen3.6-27B Q4_K_M, gpt-oss-20b) count every tensor once at its type's block size."""
    from engine.bench.gguf import BLOCKS, gpt_oss_20b_gguf, qwen36_27b_q4_k_m, write_gguf_llama
    from engine.config.gguf_file import read_gguf_header
    shape = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=300, max_position_embeddings=128)
    header = read_gguf_header(write_gguf_llama(tmp_path / "b.gguf", "Q4_K", shape))
    assert header.tensors["blk.1.ffn_down.weight"].shape == (256, 512)
    matrices = 2 * 300 * 256 + 2 * (2 * 256 * 256 + 2 * 128 * 256 + 3 * 512 * 256)
    assert header.bytes_by_type() == {"Q4_K": matrices // 256 * 144, "F32": 5 * 256 * 4}
    qwen = qwen36_27b_q4_k_m()["quantization_config"]
    params = sum(n * BLOCKS[t][0] // BLOCKS[t][1] for t, n in qwen.items() if t != "quant_method")
    assert 26.5e9 < params < 28.5e9 and qwen["Q6_K"] > qwen["Q5_K"]
    oss = gpt_oss_20b_gguf()["quantization_config"]
    assert 20.5e9 < sum(n * BLOCKS[t][0] // BLOCKS[t][1] for t, n in oss.items() if t != "quant_method") < 21.5e9
