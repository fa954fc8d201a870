"""Zero Triton compilations while serving after the engine's warm-up, counted in the JIT caches on the card.

A GPTQ 4-bit engine (so the quantized GEMV/GEMM run too) with the Triton backend starts (graphs captured,
then engine/worker/warm_up.py), then serves prompts of varied lengths at varied batch sizes, eager steps included
(`enforce_eager` engine too); every kernel's compiled-variant cache must not grow. CPU counterpart:
tests/test_triton_recompiles.py (the same keys computed from interpreted launches)."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def compiled_variants() -> dict[str, int]:
    from kernels import triton_paged_attention, triton_quant_linear, triton_write_kv
    kernels = [triton_paged_attention.paged_attention_kernel, triton_paged_attention.reduce_splits_kernel,
               triton_write_kv.write_kv_kernel, triton_quant_linear.quant_gemv_kernel,
               triton_quant_linear.quant_gemm_kernel]
    return {k.fn.__name__: sum(len(cache[0]) for cache in k.device_caches.values()) for k in kernels}


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_no_compilation_after_warm_up(tiny_model_dir, make_llm, tmp_path, eager):
    from engine import SamplingParams
    from quant_packers import make_quantized
    packed = make_quantized(tiny_model_dir("llama"), tmp_path / "packed", "gptq", 4, 32, False, True)
    llm = make_llm(packed, dtype="float16", attention_backend="triton", num_gpu_blocks_override=512,
                   max_num_batched_tokens=64, enforce_eager=eager)
    before = compiled_variants()
    lengths = (3, 17, 40, 9, 130, 250, 5, 61, 2, 33, 77, 11)
    prompts = [[10 + (i * 7 + j) % 90 for j in range(n)] for i, n in enumerate(lengths)]
    params = [SamplingParams(temperature=0, max_tokens=8 + 5 * i, ignore_eos=True) for i in range(len(prompts))]
    llm.generate(prompts, params, use_tqdm=False)
    after = compiled_variants()
    print(before, after)
    assert after == before, {k: after[k] - before[k] for k in after if after[k] != before[k]}
