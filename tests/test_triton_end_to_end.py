"""The engine through the Triton backend (interpreted on CPU): greedy output identical to HF, and an FP8 run.

Runs in a subprocess because TRITON_INTERPRET must be set before triton is first imported.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import gc, json, sys
    from engine import LLM, SamplingParams
    path, prompts, kv_dtypes = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3:]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = {}
    for kv_dtype in kv_dtypes:
        llm = LLM(path, device="cpu", attention_backend="triton", kv_cache_dtype=kv_dtype, max_num_batched_tokens=16)
        outputs[kv_dtype] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
        gc.collect()
    print(json.dumps(outputs))
""")


def run_triton_engine(path, prompts, *kv_dtypes: str) -> dict[str, list[list[int]]]:
    """{kv dtype: greedy tokens} from the Triton backend, one engine after the other in one interpreted process."""
    env = dict(os.environ, TRITON_INTERPRET="1", TRITON_DEFAULT_FP_FUSION="1")
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(path), json.dumps(prompts), *kv_dtypes], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(900)
def test_triton_backend_matches_hf_and_torch_backend(tiny_model_dir):
    from engine import LLM, SamplingParams
    from hf_reference import hf_greedy

    path = tiny_model_dir("qwen2")
    prompts = [[11, 12, 13], list(range(30, 50))]  # the second crosses a block; chunks of 16 mix prefill+decode
    expected = hf_greedy(path, prompts, [6, 6])
    triton = run_triton_engine(path, prompts, "auto", "fp8")
    assert triton["auto"] == expected
    torch_fp8 = LLM(str(path), device="cpu", kv_cache_dtype="fp8").generate(
        prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert triton["fp8"] == [o.outputs[0].token_ids for o in torch_fp8]
