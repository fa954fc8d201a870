"""LLM: the offline API (`LLM(model=...).generate(prompts, SamplingParams(...))`), shaped like vLLM's.

Runs the engine loop in the calling thread until every submitted request is done, with a tqdm bar over
prompts; `chat` applies the model's chat template first. `embed` (an engine started with `task="embed"`, or
an embedding checkpoint) returns one pooled vector per prompt. Images go in as vLLM takes them:
`{"prompt": text with one placeholder per image, "multi_modal_data": {"image": PIL image or list}}`, and image
parts in `chat` messages (`image_url` with a data:, file:// or http(s) URL, or `image_pil` / `image` with a PIL
image); an input the engine cannot use (an unknown key, another modality, images for a text-only model) is an
error, never dropped.
"""
from __future__ import annotations

import itertools
from typing import Any, Sequence

from tqdm.auto import tqdm

from engine.core.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence, length_normalized
from engine.config.flags import EngineConfig
from engine.entrypoints.llm_engine import LLMEngine
from engine.core.outputs import PoolingRequestOutput, RequestOutput
from engine.multimodal.chat_parts import split_image_parts
from engine.multimodal.media import MediaLimits, load_image
from engine.sample.pooling import PoolingParams
from engine.sample.sampling_params import SamplingParams

Prompt = str | list[int] | dict[str, Any]
PROMPT_KEYS = ("prompt", "prompt_token_ids", "multi_modal_data")


class LLM:
    def __init__(self, model: str, tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.9,
                 max_model_len: int | None = None, device: str = "auto", **kwargs: Any) -> None:
        config = EngineConfig.from_kwargs(model=model, tensor_parallel_size=tensor_parallel_size,
                                          gpu_memory_utilization=gpu_memory_utilization,
                                          max_model_len=max_model_len, device=device, **kwargs)
        self.engine = LLMEngine(config)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def sleep(self, level: int = 1) -> dict[str, int]:
        """Free the device between bursts of work (vLLM's levels): 1 keeps the weights in host RAM, 2 drops them;
        the KV cache goes either way. Returns the device bytes freed, by kind."""
        return self.engine.sleep(level)

    def wake_up(self) -> None:
        self.engine.wake_up()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        prompts = _as_list(prompts)
        params = sampling_params or SamplingParams()
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids = []
        for prompt, p in zip(prompts, params):
            request_id = str(next(self._ids))
            prompt, mm = self._prompt(prompt)
            if p.structured_outputs is not None:  # offline: a bad spec is a ValueError here, as before any step
                self.engine.grammars.compile(p.structured_outputs, timeout=None)
            self.engine.add_request(request_id, prompt, p, mm=mm)
            ids.append(request_id)
        return self._run(ids, use_tqdm)

    def _prompt(self, prompt: Prompt, add_special_tokens: bool = True):
        """(the prompt the engine takes, its processed images or None) of one vLLM-shaped prompt."""
        if not isinstance(prompt, dict):
            return prompt, None
        unknown = sorted(set(prompt) - set(PROMPT_KEYS))
        if unknown:
            raise ValueError(f"prompt dict has key(s) {unknown} this engine does not use; it takes {list(PROMPT_KEYS)}")
        data = prompt.get("multi_modal_data")
        if not data:
            return prompt.get("prompt_token_ids") or prompt["prompt"], None
        other = sorted(set(data) - {"image"})
        if other:
            raise ValueError(f"multi_modal_data has {other}: this engine takes images only")
        if "prompt" not in prompt:
            raise ValueError("multi_modal_data needs a text 'prompt' holding one image placeholder per image")
        images = data["image"] if isinstance(data["image"], (list, tuple)) else [data["image"]]
        mm = self.engine.process_images(prompt["prompt"], list(images), add_special_tokens)
        return mm.prompt_token_ids, mm

    def embed(self, prompts: Prompt | Sequence[Prompt], pooling_params: PoolingParams | None = None,
              use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """One embedding per prompt (`out.outputs.embedding`), in order."""
        ids = []
        for prompt in _as_list(prompts):
            request_id = str(next(self._ids))
            if isinstance(prompt, dict):
                prompt = prompt.get("prompt_token_ids") or prompt["prompt"]
            self.engine.add_request(request_id, prompt, None, pooling=pooling_params or PoolingParams())
            ids.append(request_id)
        return self._run(ids, use_tqdm)

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams | None = None, *,
                    beam_width: int | None = None, max_tokens: int | None = None, length_penalty: float = 1.0,
                    ignore_eos: bool = False, use_tqdm: bool = True) -> list[BeamSearchOutput]:
        """Beam search per prompt; `params` or the keyword arguments (vLLM's names) set the search."""
        if params is None:
            if beam_width is None or max_tokens is None:
                raise ValueError("beam_search needs beam_width and max_tokens (or a BeamSearchParams)")
            params = BeamSearchParams(beam_width, max_tokens, length_penalty, ignore_eos)
        ids = []
        for prompt in _as_list(prompts):
            request_id = str(next(self._ids))
            self.engine.add_beam_request(request_id, prompt, params)
            ids.append(request_id)
        outputs = []
        for out in self._run(ids, use_tqdm):
            beams = [BeamSearchSequence(out.prompt_token_ids + c.token_ids, c.text, c.cumulative_logprob,
                                        length_normalized(c.cumulative_logprob, len(c.token_ids),
                                                          params.length_penalty))
                     for c in out.outputs]
            outputs.append(BeamSearchOutput(out.request_id, out.prompt, beams))
        return outputs

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True, **template_kwargs: Any) -> list[RequestOutput]:
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        tokenizer, config = self.engine.tokenizer, self.engine.config
        limits = MediaLimits.from_config(config)
        prompts = []
        for conversation in conversations:
            conversation, refs = split_image_parts(conversation)
            text = tokenizer.apply_chat_template(conversation, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt, **template_kwargs)
            if not refs:
                prompts.append(tokenizer.encode(text, add_special_tokens=False))
                continue
            images = [ref if not isinstance(ref, str) else load_image(ref, limits, f"image {i}")
                      for i, ref in enumerate(refs)]
            prompts.append({"prompt": text, "multi_modal_data": {"image": images}})
        if not any(isinstance(p, dict) for p in prompts):
            return self.generate(prompts, sampling_params, use_tqdm)
        params = sampling_params or SamplingParams()
        ids = []
        for prompt in prompts:
            request_id = str(next(self._ids))
            prompt, mm = self._prompt(prompt, add_special_tokens=False)
            self.engine.add_request(request_id, prompt, params, mm=mm)
            ids.append(request_id)
        return self._run(ids, use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while len(done) < len(request_ids):
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            raise
        finally:
            bar.close()
        return [done[i] for i in request_ids]


def _as_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if prompts and isinstance(prompts[0], int):
        return [list(prompts)]
    return list(prompts)

