"""MultiModalProcessor: a text prompt and its images -> the prompt's token ids with each image's placeholders
expanded, plus one MultiModalItem per image (its span, content hash and the tensors its tower reads).

Pixels are the checkpoint's own image processor's business (transformers' `AutoImageProcessor`: the fast,
torchvision one where torchvision is installed, else the PIL one — the same resizing, patching and normalisation
HF's processors run), never re-implemented here. What this module does is what HF's processor classes do around
it, per family and with HF's own numbers: replace each image's placeholder in the text with the image's run of
tokens (Qwen: grid patches over spatial_merge_size² `<|image_pad|>`; Gemma 3: `\\n\\n<start_of_image>` + a fixed
count + `<end_of_image>\\n\\n`; Gemma 4: begin + the image's soft-token count + end; Pixtral: a row of `[IMG]` per
patch row, each row ending in `[IMG_BREAK]`, the last in `[IMG_END]`), then tokenize, then find each image's span.
It does not build HF's processor classes themselves: in transformers 5 the Qwen3-VL/Qwen3.5 one needs a video
processor, which needs torchvision, for an image. Qwen's mRoPE positions are computed here too
(engine/multimodal/mrope.py). Runs on the caller's thread (the server's worker threads, the offline LLM), never
on the engine's step loop.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from engine.config.mm_processor import hf_processor_kwargs
from engine.config.vision import VisionConfig
from engine.multimodal.hashing import hash_image
from engine.multimodal.inputs import MultiModalInputs, MultiModalItem, ProfileImage
from engine.multimodal.media import check_image_size
from engine.multimodal.mrope import mrope_positions
from engine.planning.vision import largest_image_embeds, largest_image_within


class MultiModalProcessor:
    def __init__(self, model_path: str | Path, vision: VisionConfig, tokenizer, max_pixels: int | None = None,
                 processor_kwargs: dict[str, Any] | None = None) -> None:
        from transformers import AutoImageProcessor

        self.vision, self.tokenizer, self.max_pixels, self.model_path = vision, tokenizer, max_pixels, model_path
        # --mm-processor-kwargs as HF's processor takes them (checked: an unknown key is refused by name)
        self.hf_kwargs = hf_processor_kwargs(vision, processor_kwargs or {})
        self.image_processor = AutoImageProcessor.from_pretrained(str(model_path), **self.hf_kwargs)
        extra = _processor_config(Path(model_path))
        token = tokenizer.convert_ids_to_tokens
        kind = vision.kind
        if kind == "qwen3_5":
            self.placeholder = token(vision.image_token_id)
        elif kind == "gemma3":
            self.placeholder = token(vision.start_token_id)  # the template writes <start_of_image> per image
            self.tokens_per_image = int(extra.get("image_seq_length", vision.tokens_per_image))
        elif kind == "gemma4":
            self.placeholder = token(vision.image_token_id)
        else:  # pixtral: patch_size and spatial_merge_size as the processor has them
            self.placeholder = token(vision.image_token_id)
            self.pixtral_patch = int(extra.get("patch_size", vision.patch_size)) * int(
                extra.get("spatial_merge_size", vision.spatial_merge_size))
            self.break_token, self.end_token = extra.get("image_break_token", "[IMG_BREAK]"), extra.get(
                "image_end_token", "[IMG_END]")
            self.break_id, self.end_id = tokenizer.convert_tokens_to_ids([self.break_token, self.end_token])
        self.image_token = token(vision.image_token_id)

    def max_embeds_per_image(self) -> int:
        """The most embeddings one accepted image becomes: the processor's own resizing's largest (after
        --mm-processor-kwargs), within
        --max-image-pixels (engine/planning/vision.py's rule, the planner's; the encoder's budget per step must
        hold one)."""
        return largest_image_embeds(self.vision, self.max_pixels, self._processor_max_embeds())

    def _processor_max_embeds(self) -> int:
        """The most embeddings the processor's own resizing lets one image become."""
        kind, ip = self.vision.kind, self.image_processor
        if kind == "qwen3_5":
            unit = int(ip.patch_size) * int(ip.merge_size)
            return int(ip.size["longest_edge"]) // (unit * unit)
        if kind == "gemma3":
            return self.tokens_per_image
        if kind == "gemma4":
            return int(getattr(ip, "max_soft_tokens", 0) or 280)
        side = int(ip.size.get("longest_edge", 1024)) // self.pixtral_patch
        return side * side

    def largest_image(self) -> ProfileImage:
        """A blank image that becomes the most embeddings an accepted one can: the square the processor takes
        before it shrinks one, or where --max-image-pixels binds first the shape within it that rounds up the
        most (engine/planning/vision.py's rule). The startup profile encodes it (its tower's peak is the largest
        an accepted image reaches), as its size (each rank makes its tensors: profile_pixels)."""
        kind, ip = self.vision.kind, self.image_processor
        if self.max_pixels is not None and kind in ("qwen3_5", "pixtral"):
            embeds, height, width = largest_image_within(self.vision, self.max_pixels)
            if embeds < self._processor_max_embeds():
                return ProfileImage(str(self.model_path), width, height, self.hf_kwargs)
        if kind == "qwen3_5":  # longest_edge is a pixel count here
            pixels = int(ip.size["longest_edge"])
        elif kind == "gemma3":  # every image becomes the tower's fixed square
            pixels = int(ip.size["height"]) * int(ip.size["width"])
        elif kind == "gemma4":  # each soft token pools a k x k cell of patches
            cell = int(ip.patch_size) * int(ip.pooling_kernel_size)
            pixels = self.max_embeds_per_image() * cell * cell
        else:
            pixels = int(ip.size.get("longest_edge", 1024)) ** 2
        if self.max_pixels is not None:
            pixels = min(pixels, self.max_pixels)
        side = math.isqrt(pixels)
        return ProfileImage(str(self.model_path), side, side, self.hf_kwargs)

    def pixels(self, image) -> dict[str, Any]:
        """The processor's tensors for one image (what the family's `encode_image` reads)."""
        return image_tensors(self.image_processor, image)

    def process(self, prompt: str, images: list, add_special_tokens: bool = True) -> MultiModalInputs:
        """`prompt` holds one placeholder per image, in order (the chat template writes them for image parts)."""
        found = prompt.count(self.placeholder)
        if found != len(images):
            raise ValueError(f"the prompt has {found} image placeholder(s) ({self.placeholder}) for {len(images)} "
                             f"image(s); write one per image, or send the images as chat content parts")
        datas, runs, pieces, rest = [], [], [], prompt
        for index, image in enumerate(images):
            check_image_size(image, self.max_pixels, f"image {index}")
            data = self.pixels(image)
            run = self._expansion(data)
            head, _, rest = rest.partition(self.placeholder)
            pieces += [head, run]
            datas.append(data)
        text = "".join(pieces) + rest
        ids = list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
        items = [MultiModalItem(hash_image(image), offset, length, length if mask is None else int(mask.sum()),
                                data, mask)
                 for image, data, (offset, length, mask) in zip(images, datas, self._spans(ids, len(images)))]
        out = MultiModalInputs(ids, items)
        if self.vision.mrope_section is not None:
            grids = [tuple(int(x) for x in item.data["image_grid_thw"][0]) for item in items]
            out.mrope_positions, out.mrope_delta = mrope_positions(len(ids), items, grids,
                                                                   self.vision.spatial_merge_size)
        return out

    def _expansion(self, data: dict[str, Any]) -> str:
        """The text one image's placeholder becomes (HF's processors' `replace_image_token`)."""
        kind, image = self.vision.kind, self.image_token
        if kind == "qwen3_5":
            return image * (int(data["image_grid_thw"][0].prod()) // self.vision.spatial_merge_size ** 2)
        if kind == "gemma3":
            end = self.tokenizer.convert_ids_to_tokens(self.vision.end_token_id)
            return f"\n\n{self.placeholder}{image * self.tokens_per_image}{end}\n\n"
        if kind == "gemma4":
            token = self.tokenizer.convert_ids_to_tokens
            return (f"{token(self.vision.start_token_id)}{image * int(data['num_soft_tokens_per_image'][0])}"
                    f"{token(self.vision.end_token_id)}")
        height, width = (int(x) for x in data["image_sizes"][0])
        row = image * (width // self.pixtral_patch) + self.break_token
        return (row * (height // self.pixtral_patch))[:-len(self.break_token)] + self.end_token

    def _spans(self, ids: list[int], num_images: int) -> list[tuple[int, int, np.ndarray | None]]:
        """Each image's (offset, length, is_embed mask or None), in prompt order."""
        arr = np.asarray(ids)
        if self.vision.kind == "pixtral":  # a span runs from its first [IMG] to its [IMG_END]
            member = np.isin(arr, [self.vision.image_token_id, self.break_id, self.end_id])
            stops, starts, previous = np.flatnonzero(arr == self.end_id) + 1, [], 0
            for stop in stops:
                start = int(stop) - 1
                while start > previous and member[start - 1]:
                    start -= 1
                starts.append(start)
                previous = int(stop)
        else:
            member = (arr == self.vision.image_token_id).astype(np.int8)
            edges = np.flatnonzero(np.diff(np.concatenate([[0], member, [0]])))
            starts, stops = edges[::2], edges[1::2]
        if len(starts) != num_images:
            raise ValueError(f"the prompt's image placeholders became {len(starts)} runs for {num_images} image(s): "
                             "is an image token written in the text itself?")
        spans = []
        for start, stop in zip(starts, stops):
            mask = arr[start:stop] == self.vision.image_token_id if self.vision.kind == "pixtral" else None
            spans.append((int(start), int(stop - start), mask))
        return spans


def image_tensors(image_processor, image) -> dict[str, Any]:
    """The checkpoint's image processor's tensors for one PIL image."""
    return dict(image_processor(images=[image.convert("RGB")], return_tensors="pt"))


def profile_pixels(image: ProfileImage) -> dict[str, Any]:
    """The tensors of the startup profile's blank image, made where they are used (each tensor-parallel rank)."""
    from PIL import Image
    from transformers import AutoImageProcessor
    return image_tensors(AutoImageProcessor.from_pretrained(image.model_path, **image.processor_kwargs),
                         Image.new("RGB", (image.width, image.height)))


def _processor_config(path: Path) -> dict[str, Any]:
    """processor_config.json's processor kwargs (Gemma 3's image_seq_length, Pixtral's patch sizes), or {}."""
    file = path / "processor_config.json"
    if not file.exists():
        return {}
    data = json.loads(file.read_text())
    return data.get("processor", data) if isinstance(data, dict) else {}
