"""CUDA-only paths fixed by reading, checked on the real card: the engine's generators sit on the logits' card
when the flag says a bare "cuda", a GPTQ act-order checkpoint loads and decodes on the card, the CUDA graphs'
memory is measured from the pool they hold, and the doctor checks a second card with that card current."""
from __future__ import annotations

import pytest
import torch

from gpu_reference import greedy_tokens, hf_agreement
from hf_reference import MAX_TOKENS, make_prompts

pytestmark = pytest.mark.gpu


def test_bare_cuda_flag_gives_generators_on_the_logits_card():
    from engine.platform.devices import resolve_device
    from engine.worker.profiling import profile_sampler
    from engine.sample.metadata import make_generator
    device = resolve_device("cuda")
    logits = torch.randn(4, 64, device=device)
    assert make_generator(0, device).device == logits.device
    profile_sampler(4, 64, device)  # the KV sizing's sampler step: refused the engine's generator before


def test_act_order_gptq_decodes_on_the_card_like_hf(tiny_model_dir, make_llm, tmp_path):
    from quant_packers import dequantized_folder, make_quantized
    packed = make_quantized(tiny_model_dir("llama"), tmp_path / "packed", "gptq", 4, 32, False, True)
    prompts = make_prompts(400)
    llm = make_llm(packed, dtype="float32", num_gpu_blocks_override=256)
    assert llm.engine.model_config.quantization.act_order
    outputs = greedy_tokens(llm, prompts, MAX_TOKENS)
    agreement, first = hf_agreement(dequantized_folder(packed, tmp_path / "float"), prompts, outputs, torch.float32)
    assert agreement >= 0.99, f"{agreement:.2%}; first divergence: {first}"


def test_graph_memory_is_the_pool_the_graphs_hold(tiny_model_dir, make_llm):
    graphs = make_llm(tiny_model_dir("llama"), dtype="bfloat16", num_gpu_blocks_override=256).engine.runner.graphs
    assert graphs is not None and graphs.graphs, "no graph was captured"
    outputs = sum(o.numel() * o.element_size() for o in graphs.outputs.values())
    # The pool holds every capture's intermediates (at least one 2 MiB segment), not only the outputs.
    assert graphs.pool_bytes >= 2**20 and graphs.pool_bytes > 2 * outputs, (graphs.pool_bytes, outputs)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_doctor_checks_the_second_card_from_the_first():
    from engine.doctor.kernel_checks import attention_parity, decode_tokens_per_s
    torch.cuda.set_device(0)
    dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    assert attention_parity("cuda:1", dtype, dtype) is None
    assert decode_tokens_per_s("cuda:1", dtype, "triton", steps=2) > 0
    assert torch.cuda.current_device() == 0
