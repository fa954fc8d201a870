"""End to end: a quantized checkpoint served by the engine gives HF transformers' greedy tokens.

The oracle is HF transformers running a plain float checkpoint holding the weights the packed one encodes
(tests/quant_packers.py reads them back independently of the engine), on Llama, Qwen2, Phi-3 and Gemma 3 VL
shapes, with one rank and with two (gloo). Few prompts and tokens: each two-rank engine spawns a worker process.
"""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from hf_reference import hf_greedy, make_prompts
from quant_packers import dequantized_folder, make_quantized

pytestmark = pytest.mark.timeout(180)

PROMPT_IDS = [1, 4, 6]  # 3, 17 and 120 tokens
MAX_TOKENS = [10, 6, 8]

CASES = [  # (arch, format, bits, group, symmetric, act order, tensor parallel size)
    ("llama", "awq", 4, 32, False, False, 1),
    ("llama", "gptq", 4, 64, False, True, 2),
    ("qwen2", "gptq", 8, -1, True, False, 1),
    ("qwen2", "ct", 4, 32, False, False, 2),
    ("qwen2", "fp8", 8, -1, True, False, 1),
    ("phi3", "awq", 4, 32, False, False, 1),  # fused qkv_proj/gate_up_proj packed whole
    ("gemma3-vl", "gptq", 4, 32, False, True, 1),  # the text model under language_model, vision tower in float
]


@pytest.mark.parametrize("case", CASES, ids=[f"{a}-{f}-w{b}-g{g}-tp{tp}" for a, f, b, g, _, _, tp in CASES])
def test_greedy_tokens_match_hf_on_dequantized_weights(tiny_model_dir, tmp_path, case):
    arch, fmt, bits, group, sym, act_order, tp = case
    packed = make_quantized(tiny_model_dir(arch), tmp_path / "packed", fmt, bits, group, sym, act_order)
    prompts = [make_prompts(400)[i] for i in PROMPT_IDS]
    expected = hf_greedy(dequantized_folder(packed, tmp_path / "float"), prompts, MAX_TOKENS)
    llm = LLM(str(packed), device="cpu", tensor_parallel_size=tp)
    try:
        assert llm.engine.model_config.quantization.method == {"ct": "compressed-tensors",
                                                              "ct-fp8": "compressed-tensors"}.get(fmt, fmt)
        params = [SamplingParams(temperature=0, max_tokens=n) for n in MAX_TOKENS]
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.engine.shutdown()
    assert got == expected
