"""`pagedesk-bench images`: what an image costs a request — time to first token with one image against the same
text alone, the encoder's share of that first step, and a second request with the same image (a prefix hit: its
blocks and, while cached, its encoding are reused) against the first.

The model is `--model PATH` (a vision-language folder with its image processor), or a random-weight Qwen3.5-VL
written on the fly (text: the benchmarks' 512-wide, 8-layer shape; tower: 4 layers of 256, 16-pixel patches merged
2 x 2), so nothing is downloaded. Prints a markdown table for BENCHMARKS.md. Needs torch, transformers, pillow.
"""
from __future__ import annotations

import argparse
import itertools
import tempfile
import time
from pathlib import Path

IMAGE_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


_FRESH = itertools.count(1)  # perturbations of the bench image, one per request

def make_random_qwen_vl(path: Path, seed: int = 0) -> Path:
    """A random-weight Qwen3.5-VL folder with a word-level tokenizer that knows the image tokens."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2VLImageProcessorPil

    # Byte-level BPE over single bytes (no merges): the tokenizer class transformers 5 builds for qwen3_5 folders
    # reads vocab and merges and brings its own byte-level pre-tokenizer, so a word-level vocabulary would vanish.
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<s>": 0, "</s>": 1, "<pad>": 2, "<unk>": 3} | {c: 4 + i for i, c in enumerate(sorted(alphabet))}
    words = len(vocab)
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                        unk_token="<unk>")
    tokenizer.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})  # ids right after the bytes
    ids = dict(zip(("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"),
                   tokenizer.convert_tokens_to_ids(IMAGE_TOKENS)))
    text = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                intermediate_size=1536, vocab_size=words + 8, max_position_embeddings=4096,
                layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2,
                linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
                rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                                 "mrope_section": [4, 2, 2], "mrope_interleaved": True},
                bos_token_id=0, eos_token_id=1, pad_token_id=2)
    vision = dict(depth=4, hidden_size=256, intermediate_size=1024, num_heads=4, patch_size=16,
                  out_hidden_size=512, num_position_embeddings=2304, spatial_merge_size=2, temporal_patch_size=2)
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model("qwen3_5", text_config=text, vision_config=vision,
                                               tie_word_embeddings=False, **ids)
    model = transformers.AutoModelForImageTextToText.from_config(config).eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2,
                             size={"shortest_edge": 32 * 32, "longest_edge": 1024 * 1024}).save_pretrained(path)
    return path


def measure(llm, prompt: str, image, repeats: int) -> dict:
    """Best-of-`repeats` seconds to the first token of fresh requests (prefix cache reset before each), the
    encoder's seconds in them, then one more request right after the last (its prefix hit)."""
    from engine import SamplingParams

    model = llm.engine.runner.model
    spent = [0.0]
    encode = getattr(model, "encode_image", None)

    def timed_encode(data):
        start = time.perf_counter()
        out = encode(data)
        spent[0] += time.perf_counter() - start
        return out

    if encode is not None:
        model.encode_image = timed_encode
    params = SamplingParams(temperature=0, max_tokens=1)
    best, encoder = float("inf"), 0.0
    for _ in range(repeats):
        llm.engine.kv.pool.reset_prefix_cache()  # a cold request each time
        if image is not None:  # a content hash never sent before, so the encoder's cache holds no embeddings for it
            k = next(_FRESH)
            image = image.copy()
            image.putpixel((0, 0), (k % 256, k // 256 % 256, 7))
        request = prompt if image is None else {"prompt": prompt, "multi_modal_data": {"image": image}}
        spent[0] = 0.0
        start = time.perf_counter()
        out = llm.generate([request], params, use_tqdm=False)[0]
        seconds = time.perf_counter() - start
        if seconds < best:
            best, encoder = seconds, spent[0]
    start = time.perf_counter()
    again = llm.generate([request], params, use_tqdm=False)[0]
    hit = time.perf_counter() - start
    if encode is not None:
        del model.encode_image
    return dict(ttft=best, encoder=encoder, tokens=len(out.prompt_token_ids), hit=hit,
                cached=again.num_cached_tokens)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pagedesk-bench images", description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="a vision-language folder (default: a random Qwen3.5-VL written on the fly)")
    parser.add_argument("--image-size", type=int, default=448, help="the square image's side in pixels")
    parser.add_argument("--words", type=int, default=16, help="text words in the prompt (a token per byte)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    import numpy as np
    from PIL import Image

    from engine import LLM

    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or str(make_random_qwen_vl(Path(tmp) / "random-qwen3_5-vl"))
        llm = LLM(path, device=args.device, max_num_batched_tokens=4096)
        text = " ".join("lorem ipsum dolor sit amet".split()[i % 5] for i in range(args.words))
        rng = np.random.default_rng(0)
        image = Image.fromarray(rng.integers(0, 256, (args.image_size, args.image_size, 3), dtype=np.uint8))
        placeholder = llm.engine.mm_processor.placeholder if args.model else PLACEHOLDER
        measure(llm, placeholder + " " + text, image, 1)  # warm-up: first-call costs stay out of the table
        rows = [("text alone", measure(llm, text, None, args.repeats)),
                (f"one {args.image_size}x{args.image_size} image + text",
                 measure(llm, placeholder + " " + text, image, args.repeats))]
    print(f"| request | prompt tokens | TTFT (best of {args.repeats}) | encoder | encoder share | "
          "same request again (prefix hit) | tokens from cache |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in rows:
        share = f"{r['encoder'] / r['ttft']:.0%}" if r["encoder"] else "-"
        print(f"| {name} | {r['tokens']} | {r['ttft'] * 1e3:.1f} ms | {r['encoder'] * 1e3:.1f} ms | {share} | "
              f"{r['hit'] * 1e3:.1f} ms | {r['cached']} |")


if __name__ == "__main__":
    main()
