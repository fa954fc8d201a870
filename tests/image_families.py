"""The image test families as rows: for each vision-language family its tiny checkpoint, prompt template, cases
(images of several sizes, one and two per prompt), HF oracle, and the engine settings its shared tests use (a step
budget that cuts its images or ends before them, a pool small enough to preempt, block sizes for the prefix test).

tests/test_images_families.py runs the tests every family shares over these rows; tests/test_images_<family>.py
keep what only that family has. `conftest.image_family(name)` builds a row's checkpoint, engine, processed cases and
HF's greedy ids once per session, so the shared module and the family's own share one of each.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable

from tiny_vl_models import (hf_greedy_mm, make_tiny_gemma3_vl, make_tiny_gemma4_vl, make_tiny_mistral3_vl,
                            make_tiny_vl_model)

MAX_TOKENS = 10
_REQUEST_IDS = itertools.count()


@dataclass
class ImageFamily:
    name: str
    make: Callable  # (tmp dir) -> checkpoint folder
    prompt: Callable[[str, int], str]  # (text, number of images) -> the prompt with a placeholder per image
    cases: list  # (text, image sizes (w, h), seeds)
    hf_greedy: Callable  # (HF model, MultiModalInputs, max tokens) -> ids
    check_items: Callable  # (engine, processed cases): the family's placeholder shapes
    chunk_budget: int  # max_num_batched_tokens that cuts its images (or, both-ways families, ends chunks before)
    tp_budget: int  # max_num_batched_tokens of the tensor-parallel run
    preempt: dict  # LLM kwargs of a pool that must preempt
    preempt_extra: int = 0  # cases repeated to make the preemption run crowded enough
    prefix: dict = field(default_factory=dict)  # LLM kwargs of the prefix-cache test's fresh engine
    min_cached: int = 16  # tokens a repeat of the same image must take from the cache at least
    image_decides: bool = False  # another image gives another answer to the same text (checked where it does)


@dataclass
class FamilyRun:
    """A row built: its folder, an engine with default settings, the processed cases and HF's ids for them."""

    family: ImageFamily
    path: object
    llm: object
    cases: list
    expected: list


def qwen_prompt(text: str, images: int) -> str:
    return f"<|im_start|>user\n{'<|vision_start|><|image_pad|><|vision_end|>' * images}{text}<|im_end|>\n" \
           "<|im_start|>assistant\n"


def gemma3_prompt(text: str, images: int) -> str:
    return f"<start_of_turn>user\n{'<start_of_image>' * images}{text}<end_of_turn>\n<start_of_turn>model\n"


def gemma4_prompt(text: str, images: int) -> str:
    return f"<start_of_turn>user\n{'<|image|>' * images}{text}<end_of_turn>\n<start_of_turn>model\n"


def mistral3_prompt(text: str, images: int) -> str:
    return f"[INST]{'[IMG]' * images}{text}[/INST]"


QWEN_CASES = [("Describe this.", [(56, 84)], [0]), ("Compare the two pictures.", [(448, 448), (84, 56)], [1, 2]),
              ("What is odd here?", [(50, 70)], [3])]  # 50 x 70: not a multiple of the 14-pixel patch
GEMMA_CASES = [("Describe this.", [(56, 84)], [0]), ("Compare the two pictures.", [(100, 40), (30, 30)], [1, 2]),
               ("What is odd here?", [(50, 70)], [3])]
GEMMA4_CASES = GEMMA_CASES[:2] + [("What is odd here?", [(200, 12)], [3])]  # a strip: 2 x 34 soft tokens


def qwen_items(llm, cases) -> None:
    assert all(inputs.items for inputs in cases)
    assert [len(c.items) for c in cases] == [1, 2, 1]


def gemma3_items(llm, cases) -> None:
    assert llm.engine.takes_images and llm.engine.scheduler.whole_images
    assert [[i.length for i in c.items] for c in cases] == [[4], [4, 4], [4]]


def gemma4_items(llm, cases) -> None:
    assert llm.engine.takes_images and llm.engine.scheduler.whole_images
    lengths = [[item.length for item in case.items] for case in cases]
    assert lengths == [[int(item.data["num_soft_tokens_per_image"][0]) for item in case.items] for case in cases]


def mistral3_items(llm, cases) -> None:
    assert llm.engine.takes_images and not llm.engine.scheduler.whole_images
    # 84 x 56 pixels: 3 rows of 2 embeddings, each row closed by a break or the end token
    assert [(i.length, i.num_embeds) for i in cases[0].items] == [(9, 6)]


def _qwen(name: str) -> ImageFamily:
    return ImageFamily(name, lambda tmp: make_tiny_vl_model(tmp, name), qwen_prompt, QWEN_CASES, hf_greedy_mm,
                       qwen_items, chunk_budget=7, tp_budget=16,
                       preempt=dict(max_num_batched_tokens=16, num_gpu_blocks_override=8, max_num_seqs=3),
                       image_decides=True)


FAMILIES = {
    "qwen3_5-vl": _qwen("qwen3_5-vl"),
    "qwen3_5_moe-vl": _qwen("qwen3_5_moe-vl"),
    "qwen3_vl": _qwen("qwen3_vl"),
    "qwen3_vl_moe": _qwen("qwen3_vl_moe"),
    "gemma3-vl": ImageFamily(
        "gemma3-vl", make_tiny_gemma3_vl, gemma3_prompt, GEMMA_CASES, hf_greedy_mm, gemma3_items, chunk_budget=10,
        tp_budget=10, preempt=dict(max_num_batched_tokens=16, num_gpu_blocks_override=14, max_num_seqs=3,
                                   block_size=8), prefix=dict(block_size=8)),
    "gemma4-vl": ImageFamily(  # 8-token blocks: three image prompts at once do not fit, the scheduler preempts
        "gemma4-vl", make_tiny_gemma4_vl, gemma4_prompt, GEMMA4_CASES, hf_greedy_mm, gemma4_items,
        chunk_budget=72, tp_budget=72, preempt=dict(max_num_batched_tokens=72, num_gpu_blocks_override=30,
                                                    max_num_seqs=3, block_size=8),
        preempt_extra=1, prefix=dict(block_size=8), min_cached=64),
    "mistral3-vl": ImageFamily(
        "mistral3-vl", make_tiny_mistral3_vl, mistral3_prompt, GEMMA_CASES, hf_greedy_mm, mistral3_items,
        chunk_budget=4, tp_budget=8, preempt=dict(max_num_batched_tokens=16, num_gpu_blocks_override=6,
                                                  max_num_seqs=3, block_size=8), prefix=dict(block_size=8)),
}


def build(family: ImageFamily, tmp_dir) -> FamilyRun:
    from engine import LLM
    from tiny_models import hf_model
    from tiny_vl_models import random_image
    path = family.make(tmp_dir)
    llm = LLM(str(path), device="cpu", max_num_seqs=4)
    cases = [llm.engine.process_images(family.prompt(text, len(sizes)),
                                       [random_image(w, h, s) for (w, h), s in zip(sizes, seeds)])
             for text, sizes, seeds in family.cases]
    hf = hf_model(path)
    return FamilyRun(family, path, llm, cases, [family.hf_greedy(hf, inputs, MAX_TOKENS) for inputs in cases])


def run(llm, cases, n: int = 1) -> list[list[list[int]]]:
    """Greedy ids of every case, all queued at once: per case, one list of ids per sequence (n of them)."""
    from engine import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, n=n)
    ids = []
    for inputs in cases:
        request_id = f"image-{next(_REQUEST_IDS)}"
        llm.engine.add_request(request_id, inputs.prompt_token_ids, params, mm=inputs)
        ids.append(request_id)
    return [[c.token_ids for c in out.outputs] for out in llm._run(ids, use_tqdm=False)]


def first_ids(llm, cases) -> list[list[int]]:
    return [outs[0] for outs in run(llm, cases)]


def mask_logprobs(llm, hf, inputs, first: int, hf_logits: Callable) -> tuple[float, float, float]:
    """Token `first`'s logprob after `inputs`' prompt: ours, HF's with the image token types (an image's tokens
    both ways) and HF's with none (causal): the Gemma families' check that the image mask decides.
    `hf_logits(ids, token_types)` runs HF with the family's own keyword arguments."""
    import torch

    from engine import SamplingParams
    ids = torch.tensor([inputs.prompt_token_ids])

    def hf_logprob(token_types: torch.Tensor) -> float:
        with torch.no_grad():
            logits = hf_logits(ids, token_types)[0, -1]
        return logits.float().log_softmax(-1)[first].item()

    request_id = f"mask-{next(_REQUEST_IDS)}"
    llm.engine.add_request(request_id, inputs.prompt_token_ids,
                           SamplingParams(temperature=0, max_tokens=1, logprobs=0), mm=inputs)
    ours = llm._run([request_id], use_tqdm=False)[0].outputs[0].logprobs[0][first].logprob
    return ours, hf_logprob((ids == hf.config.image_token_id).long()), hf_logprob(torch.zeros_like(ids))
