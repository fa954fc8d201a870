"""No Triton compilation while serving after warm-up: the JIT cache keys of every launch, computed on CPU.

Triton compiles one variant per cache key: the constexprs plus, for each int argument it specialises, whether
the value is 1 or divisible by 16 (and pointer alignment). A subprocess runs the engine's Triton backend under
the interpreter, records every launch's arguments, and computes the key the compiled JIT would use for sm_86
(Triton's own binder, `create_function_from_signature`, with a CUDA backend object; no GPU needed). After the
engine's warm-up (engine/worker/warm_up.py) a run with varied batch sizes, prompt lengths and contexts must meet no
new key; the same keys computed as if nothing were marked `do_not_specialize` must grow, which shows the
workload varies what the marks cover. The quantized linears (CUDA-only in the engine) are driven directly at
the token counts of the warm-up shapes, then at every row count. To keep the interpreter fast the model is
one layer with max_model_len 256, and KV splits start at 64 keys instead of 256, so short contexts split. Separately, each kernel's int arguments are
classified here as varying per step or fixed per model, so a new argument must be decided on.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction, compute_cache_key, create_function_from_signature
    from triton.compiler.compiler import make_backend
    from triton.backends.compiler import GPUTarget

    backend = make_backend(GPUTarget("cuda", 86, 32))
    binders, launches = {}, []
    original_run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        if self.fn not in binders:
            marked, unmarked = JITFunction(self.fn, **self.kwargs), JITFunction(self.fn)
            binders[self.fn] = [create_function_from_signature(f.signature, f.params, backend)
                                for f in (marked, unmarked)]
        keys = [compute_cache_key({}, *bind(*args, **kwargs)[1:]) for bind in binders[self.fn]]
        launches.append((self.fn.__name__, *keys))
        return original_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run

    from engine import LLM, SamplingParams
    from engine.worker.warm_up import kernel_shapes, triton_tiles_for, warm_up_kernels
    from kernels.quant_torch import pack_int32
    from kernels.triton_quant_linear import quant_linear_triton

    import kernels.triton_attention
    kernels.triton_attention.MIN_TILES_PER_SPLIT = 2  # short contexts split (as long ones do on a card): cheap
    path, max_seqs = sys.argv[1], 3
    llm = LLM(path, device="cpu", attention_backend="triton", max_num_seqs=max_seqs, max_num_batched_tokens=24,
              max_model_len=256)
    runner = llm.engine.runner
    model_len = runner.config.max_model_len
    warm_up_kernels(runner.model, max_seqs, model_len, runner.block_size, runner.device)
    shapes = kernel_shapes(max_seqs, model_len, runner.block_size, triton_tiles_for(runner.model, runner.device),
                           every_size=True)
    k, n, group = 72, 40, 32
    gen = torch.Generator().manual_seed(0)
    qweight = pack_int32(torch.randint(0, 16, (k, n), generator=gen), 4, dim=0)
    scales, zeros = torch.rand(3, n, generator=gen), torch.randint(0, 16, (3, n), generator=gen).to(torch.int16)
    quant = lambda rows: quant_linear_triton(torch.randn(rows, k, generator=gen), qweight, scales, zeros, None,
                                             4, group, n)
    for rows in sorted({s * q for s, q, _ in shapes}):
        quant(rows)
    warm = len(launches)

    lengths, outputs = (3, 17, 40, 9, 130), (12, 7, 5, 3, 16)
    prompts = [[10 + (i * 7 + j) % 90 for j in range(m)] for i, m in enumerate(lengths)]
    llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=t, ignore_eos=True) for t in outputs],
                 use_tqdm=False)
    for rows in range(1, 70, 3):
        quant(rows)

    before, after = launches[:warm], launches[warm:]
    report = {"warm_keys": len({l[1] for l in before}), "run_launches": len(after),
              "kernels_run": sorted({l[0] for l in after})}
    for i, name in ((1, "new_keys"), (2, "new_keys_if_unmarked")):
        seen = {l[i] for l in before}
        report[name] = sorted({l[0] + " " + l[i] for l in after if l[i] not in seen})
    print(json.dumps(report))
""")


@pytest.mark.timeout(900)
def test_no_new_kernel_variant_after_warm_up(tiny_model_dir):
    path = tiny_model_dir("qwen2", num_hidden_layers=1)
    env = dict(os.environ, TRITON_INTERPRET="1", TRITON_DEFAULT_FP_FUSION="1")
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(path)], env=env, capture_output=True, text=True,
                          timeout=900, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    print({k: v if not isinstance(v, list) else len(v) for k, v in report.items()})
    assert report["kernels_run"] == ["paged_attention_kernel", "quant_gemm_kernel", "quant_gemv_kernel",
                                     "reduce_splits_kernel", "write_kv_kernel"]
    assert report["new_keys"] == [], "\n".join(report["new_keys"])
    assert report["new_keys_if_unmarked"], "the run did not vary any argument that do_not_specialize covers"


# Every int argument of every kernel: varying from step to step (must be marked do_not_specialize) or fixed
# per model (shapes and strides of weights, caches and views, which warm-up meets once).
VARYING = {
    "paged_attention_kernel": {"num_seqs", "sliding_window", "stride_bt_seq"},
    "reduce_splits_kernel": set(),
    "write_kv_kernel": set(),
    "quant_gemv_kernel": {"M", "k_per_split"},
    "quant_gemm_kernel": {"M"},
}
FIXED = {
    "paged_attention_kernel": {"num_heads", "soft_cap", "stride_q_tok", "stride_q_head", "stride_o_tok", "stride_o_head",
                               "stride_kc_block", "stride_kc_tok", "stride_kc_head", "stride_vc_block",
                               "stride_vc_tok", "stride_vc_head",
                               # an integer cache's scales: allocated once beside the pages
                               "stride_ks_block", "stride_ks_tok", "stride_ks_head", "stride_vs_block",
                               "stride_vs_tok", "stride_vs_head"},
    "reduce_splits_kernel": {"num_heads", "stride_o_tok", "stride_o_head"},
    "write_kv_kernel": {"stride_key_tok", "stride_key_head", "stride_value_tok", "stride_value_head",
                        "stride_kc_block", "stride_kc_tok", "stride_kc_head", "stride_vc_block", "stride_vc_tok",
                        "stride_vc_head", "num_kv_heads", "stride_ks_block", "stride_ks_tok", "stride_ks_head",
                        "stride_vs_block", "stride_vs_tok", "stride_vs_head"},
    "quant_gemv_kernel": {"N", "K", "stride_xm", "stride_wk", "stride_wn", "stride_sg", "stride_zg"},
    "quant_gemm_kernel": {"N", "K", "stride_xm", "stride_om", "stride_wk", "stride_wn", "stride_sg", "stride_zg"},
}


def test_every_varying_int_argument_is_marked_do_not_specialize():
    import inspect
    from kernels import triton_paged_attention, triton_quant_linear, triton_write_kv
    modules = (triton_paged_attention, triton_quant_linear, triton_write_kv)
    kernels = {name: getattr(m, name) for m in modules for name in VARYING if hasattr(m, name)}
    assert set(kernels) == set(VARYING)
    for name, kernel in kernels.items():
        # A JITFunction keeps the marks as an attribute, an InterpretedFunction (TRITON_INTERPRET=1) in kwargs.
        marks = getattr(kernel, "do_not_specialize", None) or getattr(kernel, "kwargs", {}).get("do_not_specialize")
        marks = set(marks or ())
        params = inspect.signature(kernel.fn).parameters.values()
        ints = {p.name for p in params if "constexpr" not in str(p.annotation) and not p.name.endswith("_ptr")
                and p.name != "softmax_scale"}
        assert ints == VARYING[name] | FIXED[name], f"{name}: classify {sorted(ints ^ (VARYING[name] | FIXED[name]))}"
        assert VARYING[name] <= marks, f"{name}: mark {sorted(VARYING[name] - marks)} do_not_specialize"
