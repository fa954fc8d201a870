"""A request's images on the engine's side: whether the model takes them (a tower the engine runs and an image
processor that loads), the checkpoint's processor (engine/multimodal/processor.py, built on first use), the encoder
budget and cache the scheduler spends, and the checks that refuse an image no step could ever run.

vLLM's encoder budget and cache, counted in embeddings: a step encodes up to the token budget and at least the
largest image the processor makes; the cache holds twice that (the image a prompt is consuming and the next: the
rule is engine/planning/vision.py's, which the KV sizing and the planner set aside by). The engine's start builds
this before the KV cache is sized, and its profile encodes `largest_image`. For
a model whose image tokens attend to each other both ways (Gemma) a chunk never ends inside an image, so a step
must hold the largest one whole or its prompt would wait forever.
"""
from __future__ import annotations

import logging
from pathlib import Path

from engine.config.flags import EngineConfig
from engine.config.mm_processor import hf_processor_kwargs
from engine.config.model import ModelConfig
from engine.multimodal.encoder_cache import EncoderCacheManager
from engine.multimodal.inputs import MultiModalInputs, ProfileImage
from engine.planning.vision import encoder_budget, encoder_cache_capacity

logger = logging.getLogger("pagedesk.engine")


class ImageInputs:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, model_path: str | Path, tokenizer,
                 max_num_batched_tokens: int) -> None:
        self.config, self.model_config, self.model_path, self.tokenizer = config, model_config, model_path, tokenizer
        self.max_num_batched_tokens = max_num_batched_tokens
        self._processor = None
        self.encoder_cache: EncoderCacheManager | None = None  # None: the engine takes no images
        self.max_embeds: int | None = None  # the most embeddings one image becomes (None: no images)
        self.whole = False  # an image's tokens must be computed in one step (they attend both ways)
        vision = model_config.vision
        self.refused = None if vision is not None else \
            f"{model_config.architecture} takes text only: images cannot be sent to it"
        if config.image_limit() == 0:  # ModelConfig.with_image_limit drops the tower at the start
            self.refused = (f"{model_config.architecture} is served as text here: --limit-mm-per-prompt allows no "
                            "images")
        if vision is None or self.refused:
            return
        hf_processor_kwargs(vision, config.processor_kwargs())  # an unknown key is refused at the start, by name
        try:
            largest = self.processor.max_embeds_per_image()
        except (OSError, ValueError) as exc:  # a folder without preprocessor_config.json, say
            self.refused = (f"{model_config.architecture} at {model_path} cannot take images: its image processor "
                            f"does not load ({exc})")
            logger.warning("%s; serving it as text", self.refused)
            return
        self.max_embeds = largest
        self.encoder_cache = EncoderCacheManager(encoder_budget(max_num_batched_tokens, largest),
                                                 encoder_cache_capacity(max_num_batched_tokens, largest))
        self.whole = vision.bidirectional
        if self.whole and max_num_batched_tokens < largest:
            raise ValueError(f"{model_config.architecture}: an image is {largest} tokens whose attention runs both "
                             f"ways, so one step must hold it whole; a step holds {max_num_batched_tokens} tokens: "
                             f"raise --max-num-batched-tokens to >= {largest}")

    @property
    def processor(self):
        """The checkpoint's image processing; a ValueError for a model that takes no images."""
        if self.refused:
            raise ValueError(self.refused)
        if self._processor is None:
            self._processor = self.new_processor(self.tokenizer)
        return self._processor

    def new_processor(self, tokenizer):
        """Another processor of this engine's images over `tokenizer` (the server's own copy, so its worker
        threads never share the engine's tokenizer): the same folder, vision config, --max-image-pixels and
        --mm-processor-kwargs."""
        from engine.multimodal.processor import MultiModalProcessor
        return MultiModalProcessor(self.model_path, self.model_config.vision, tokenizer, self.config.max_image_pixels,
                                   self.config.processor_kwargs())

    def largest_image(self) -> ProfileImage | None:
        """The largest image the processor accepts, as its size (the startup profile encodes it on every rank),
        or None for an engine that takes no images."""
        if self.encoder_cache is None:
            return None
        return self.processor.largest_image()

    def process(self, prompt: str, images: list, add_special_tokens: bool = True) -> MultiModalInputs:
        """A text prompt with one placeholder per image -> the engine's multimodal inputs (checked here, so a bad
        image is the caller's error before anything is queued)."""
        self.check_count(len(images))
        return self.processor.process(prompt, images, add_special_tokens)

    def check_count(self, count: int) -> None:
        limit = self.config.image_limit()
        if limit is not None and count > limit:
            raise ValueError(f"the prompt has {count} images, more than --limit-mm-per-prompt allows ({limit})")

    def check(self, mm: MultiModalInputs) -> None:
        """Images the scheduler could never run: one larger than a step's encoder budget, one whose tokens a chunk
        must take whole (Gemma) but no step can hold, all of a prompt's at once without chunked prefill."""
        if self.encoder_cache is None:
            raise ValueError(self.refused)
        self.check_count(len(mm.items))
        budget, encoder_budget = self.max_num_batched_tokens, self.encoder_cache.budget
        for index, item in enumerate(mm.items):
            if item.num_embeds > encoder_budget:
                raise ValueError(f"image {index} becomes {item.num_embeds} embeddings, more than the engine encodes "
                                 f"in one step ({encoder_budget}, --max-num-batched-tokens); send a smaller image")
            if self.whole and item.length > budget:
                raise ValueError(f"image {index} is {item.length} tokens, more than one step holds ({budget}, "
                                 "--max-num-batched-tokens), and this model attends within an image both ways")
        if not self.config.enable_chunked_prefill and sum(i.num_embeds for i in mm.items) > encoder_budget:
            raise ValueError("the prompt's images together are more embeddings than one step encodes and chunked "
                             "prefill is off; send fewer or smaller images")
