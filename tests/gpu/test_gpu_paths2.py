"""The sampling side of a CUDA step on the real card (second audit; tests/test_fake_cuda_sampling.py checks
placement, these check numbers): prompt logprobs computed on the card match the CPU engine's, the
allowed-token bitmask (packed int32, unpacked with shifts on the card, bit 31 as the sign bit) confines every
draw, and a logit bias reaches the card's logits; cuda:i is NVML's (nvidia-smi's) card i."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine import LLM, SamplingParams
from hf_reference import make_prompts

pytestmark = pytest.mark.gpu


def test_prompt_logprobs_on_the_card_match_the_cpu(tiny_model_dir, make_llm):
    path = tiny_model_dir("qwen2")
    prompts = make_prompts(400)[:3]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    gpu = make_llm(path, dtype="float32", num_gpu_blocks_override=256).generate(prompts, params, use_tqdm=False)
    cpu = LLM(str(path), device="cpu").generate(prompts, params, use_tqdm=False)
    for g, c in zip(gpu, cpu):
        assert g.prompt_logprobs[0] is None and len(g.prompt_logprobs) == len(g.prompt_token_ids)
        for token, on_card, on_cpu in zip(g.prompt_token_ids[1:], g.prompt_logprobs[1:], c.prompt_logprobs[1:]):
            assert abs(on_card[token].logprob - on_cpu[token].logprob) < 1e-3, (token, on_card, on_cpu)
        assert len(g.outputs[0].logprobs) == 4 and all(len(step) >= 2 for step in g.outputs[0].logprobs)


def test_allowed_token_ids_confine_every_draw_on_the_card(tiny_model_dir, make_llm):
    llm = make_llm(tiny_model_dir("llama"), dtype="bfloat16", num_gpu_blocks_override=256)
    vocab = llm.engine.model_config.vocab_size
    allowed = sorted({3, 31, 32, 63, vocab - 1})  # word edges; token 31 is bit 31, int32's sign bit
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=16, ignore_eos=True, allowed_token_ids=allowed)
              for seed in range(4)]
    outs = llm.generate(make_prompts(400)[:4], params, use_tqdm=False)
    drawn = [t for o in outs for t in o.outputs[0].token_ids]
    assert len(drawn) == 64 and set(drawn) <= set(allowed) and len(set(drawn)) > 1, drawn


def test_logit_bias_reaches_the_cards_logits(tiny_model_dir, make_llm):
    llm = make_llm(tiny_model_dir("llama"), dtype="bfloat16", num_gpu_blocks_override=256)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logit_bias={7: 100.0})
    out = llm.generate(make_prompts(400)[:2], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [[7] * 4, [7] * 4]


@pytest.mark.skipif("CUDA_VISIBLE_DEVICES" in os.environ,
                    reason="CUDA_VISIBLE_DEVICES renumbers CUDA's cards, not NVML's")
def test_cuda_index_i_is_nvml_card_i():
    # engine/__init__.py sets CUDA_DEVICE_ORDER=PCI_BUS_ID; CUDA reads it when it starts, so this checks the
    # pytest process only if nothing touched CUDA before engine was imported: ask a fresh interpreter.
    script = ("import engine, pynvml, torch\n"
              "pynvml.nvmlInit()\n"
              "for i in range(torch.cuda.device_count()):\n"
              "    nvml = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))\n"
              "    nvml = nvml.decode() if isinstance(nvml, bytes) else nvml\n"
              "    cuda = str(torch.cuda.get_device_properties(i).uuid)\n"
              "    print(i, nvml, cuda)\n"
              "    assert nvml.lower().removeprefix('gpu-') == cuda.lower(), i\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_ORDER"})
    assert done.returncode == 0, done.stdout + done.stderr
