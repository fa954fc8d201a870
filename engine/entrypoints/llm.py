"""LLM: the offline API (`LLM(model=...).generate(prompts, SamplingParams(...))`), shaped like vLLM's.

Runs the engine loop in the calling thread until every submitted request is done, with a tqdm bar over
prompts; `chat` applies the model's chat template first. `embed` (an engine started with `task="embed"`, or
an embedding checkpoint) returns one pooled vector per prompt.
"""
from __future__ import annotations

import itertools
from typing import Any, Sequence

from tqdm.auto import tqdm

from engine.core.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence, length_normalized
from engine.config.flags import EngineConfig
from engine.entrypoints.llm_engine import LLMEngine
from engine.core.outputs import PoolingRequestOutput, RequestOutput
from engine.sample.pooling import PoolingParams
from engine.sample.sampling_params import SamplingParams

Prompt = str | list[int] | dict[str, Any]


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
            if isinstance(prompt, dict):
                prompt = prompt.get("prompt_token_ids") or prompt["prompt"]
            if p.structured_outputs is not None:  # offline: a bad spec is a ValueError here, as before any step
                self.engine.grammars.compile(p.structured_outputs, timeout=None)
            self.engine.add_request(request_id, prompt, p)
            ids.append(request_id)
        return self._run(ids, use_tqdm)

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
        tokenizer = self.engine.tokenizer
        prompts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                 **template_kwargs) for c in conversations]
        prompt_ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        return self.generate(prompt_ids, sampling_params, use_tqdm)

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
