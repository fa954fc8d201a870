"""`pagedesk-bench images-plan`: what taking images costs the context on 24 GB cards — the capacity planner's
verdicts for Qwen3.6-27B AWQ and Gemma-3-27B-it (bf16 and AWQ) served with their vision tower against the same
checkpoints served as text, on one and two cards.

With images the plan counts the tower's and projector's weights on every card, the tower's peak at the largest
image its published processor makes beyond the forward's own, and the encoder cache at its fullest (twice the
step's encoder budget of text-width embeddings; engine/planning/vision.py, the rule the engine's KV sizing applies
too); as text none of it (a folder without its image processor is served so). Each model at its own table's
settings: Qwen3.6-27B as `pagedesk-bench hybrid` plans it (AWQ, FP8 KV, 262,144 tokens, 4 seats, CUDA graphs),
Gemma-3-27B as `pagedesk-bench families` does (16-bit KV, 8192-token steps, 256 seats), at 32,768 tokens and its
own 131,072; both at --gpu-memory-utilization 0.9 and the default --max-image-pixels (an 8K frame, above every
processor's largest here). Qwen's rows at its processor's own largest image (16.7 MP, 16,384 embeddings) and resized
to a 12-MP phone photo's pixels by --mm-processor-kwargs '{"max_pixels": 12192768}', each at 8,192- and
pagedesk-serve's 2,048-token steps; each row names the flag its largest image comes from. Torch-free.
"""
from __future__ import annotations

import argparse
import dataclasses

from engine.bench.families import GEMMA3_27B_IT
from engine.bench.hybrid import AWQ_G128 as QWEN_AWQ, CONTEXT as QWEN_CONTEXT, QWEN3_6_27B
from engine.config.flags import DEFAULT_MAX_IMAGE_PIXELS, SERVING_MAX_NUM_BATCHED_TOKENS

PHONE_PHOTO_PIXELS = 4032 * 3024  # a 12-MP phone photo, Qwen's resize target in its second rows

GEMMA_AWQ = {"bits": 4, "group_size": 128, "modules_to_not_convert": ["vision_tower", "multi_modal_projector"],
             "quant_method": "awq", "version": "gemm", "zero_point": True}
QWEN = ("Qwen3.6-27B AWQ", {**QWEN3_6_27B, "quantization_config": QWEN_AWQ},
        dict(kv_cache_dtype="fp8", max_model_len=QWEN_CONTEXT, max_num_seqs=4, cuda_graphs=True))
# (name, published config, planner keyword arguments); processor_kwargs None: the processor's own largest image
CASES = [
    *((QWEN[0], QWEN[1], dict(QWEN[2], max_num_batched_tokens=step, processor_kwargs=kwargs))
      for step in (8192, SERVING_MAX_NUM_BATCHED_TOKENS) for kwargs in (None, {"max_pixels": PHONE_PHOTO_PIXELS})),
    ("Gemma-3-27B-it (bf16)", GEMMA3_27B_IT, dict(max_model_len=32_768)),
    ("Gemma-3-27B-it (bf16)", GEMMA3_27B_IT, dict(max_model_len=131_072)),
    ("Gemma-3-27B-it (AWQ)", {**GEMMA3_27B_IT, "quantization_config": GEMMA_AWQ}, dict(max_model_len=32_768)),
    ("Gemma-3-27B-it (AWQ)", {**GEMMA3_27B_IT, "quantization_config": GEMMA_AWQ}, dict(max_model_len=131_072)),
]


def plan_pair(hf: dict, tp: int, **kwargs):
    """(as text, with images): the plans of one checkpoint on `tp` 24 GiB cards."""
    from engine.config.model import ModelConfig
    from engine.planning.planner import plan_capacity
    from engine.planning.units import GIB
    cfg = ModelConfig.from_hf_config(hf)
    cfg.max_position_embeddings = max(cfg.max_position_embeddings, kwargs.get("max_model_len") or 0)
    plans = [plan_capacity(c, [24 * GIB] * tp, 0.9, dtype="bfloat16", tensor_parallel_size=tp, **kwargs)
             for c in (dataclasses.replace(cfg, vision=None), cfg)]
    return tuple(plans)


def verdict(plan) -> str:
    if plan.fits:
        return f"fits {plan.num_full_seqs} × {plan.max_model_len:,}"
    return "does not fit" if plan.num_tokens == 0 else f"not one {plan.max_model_len:,}-token sequence"


def image_flag(processor_kwargs: dict | None) -> str:
    """Which setting a row's largest image comes from."""
    if not processor_kwargs:
        return "processor's own"
    return "--mm-processor-kwargs " + ", ".join(
        f"{key} {value / 1e6:.1f} MP" if key.endswith("pixels") else f"{key} {value}"
        for key, value in processor_kwargs.items())


def rows() -> list[str]:
    from engine.config.model import ModelConfig
    from engine.planning.units import MIB
    from engine.planning.vision import largest_image_embeds
    out = []
    for name, hf, kwargs in CASES:
        resize = kwargs.get("processor_kwargs")
        largest = largest_image_embeds(ModelConfig.from_hf_config(hf).vision, DEFAULT_MAX_IMAGE_PIXELS,
                                       processor_kwargs=resize)
        image = f"{largest:,} ({image_flag(resize)})"
        for tp in (1, 2):
            text, images = plan_pair(hf, tp, **kwargs)
            tower = (images.weights_bytes - text.weights_bytes) / MIB
            peak = (images.activation_bytes - text.activation_bytes) / MIB
            step = kwargs.get("max_num_batched_tokens", 8192)
            out.append(f"| {name} | {tp} × 24 GiB | {images.max_model_len:,} | {step:,} | {image} | "
                       f"{tower:,.0f} MiB | {peak:,.0f} MiB | "
                       f"{images.encoder_cache_bytes / MIB:,.0f} MiB | {text.num_tokens:,} ({verdict(text)}) | "
                       f"{images.num_tokens:,} ({verdict(images)}) | {images.num_tokens - text.num_tokens:+,} |")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pagedesk-bench images-plan", description=__doc__.split("\n")[0])
    parser.parse_args(argv)
    print("| model | cards (0.9) | max_model_len | step tokens | largest image (embeddings) | tower weights/card | "
          "tower peak over the forward | encoder cache/card | KV tokens as text | KV tokens with images | "
          "images cost |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows():
        print(row)


if __name__ == "__main__":
    main()
