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


def test_plan_capacity_reads_a_gguf(tmp_path):
    path = make_tiny_gguf(tmp_path, "qwen3", "Q4_K", big=True)
    cfg = ModelConfig.from_folder(path)
    plan = plan_capacity(cfg, [24 * GIB], 0.9, dtype="bfloat16")
    assert plan.weights_bytes == pytest.approx(weights_bytes_per_card(cfg, 2) + 512 * cfg.head_dim * 4, rel=0.2)
    assert cfg.quantization.describe().startswith("gguf Q4_K")
