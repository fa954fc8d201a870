"""LLMEngine: requests in, one scheduled forward per `step()`, cumulative RequestOutputs out.

It owns the tokenizer, the scheduler with its KV-cache manager, and the model runner; it validates
requests on the way in, samples and appends tokens, applies every stop rule, forks the n sequences of a
request off its prompt once the prompt is computed, frees blocks the moment a sequence finishes, and
reports statistics and a block-pool snapshot for /metrics and the GUI. Not thread-safe: one caller.
"""
from __future__ import annotations

import logging
import time

import torch

from engine.beam_search import BeamGroup, BeamSearchParams
from engine.config import EngineConfig
from engine.executor import create_executor
from engine.kv_cache_manager import KVCacheManager
from engine.kv_cache_sizing import choose_num_blocks
from engine.loader import resolve_model_path
from engine.model_config import ModelConfig
from engine.model_runner import resolve_device, resolve_dtype, resolve_kv_cache_dtype
from engine.outputs import BlockPoolSnapshot, CompletionOutput, EngineStats, Logprob, RequestOutput
from engine.sampler import SamplerOutput, SamplingRow, sample
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, ScheduledSeq
from engine.sequence import Request, Sequence, SequenceStatus
from engine.tokenizer import load_tokenizer

logger = logging.getLogger("pagedesk.engine")


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        config.validate()
        self.config = config
        self.model_path = resolve_model_path(config.model, config.revision)
        self.model_config = ModelConfig.from_folder(self.model_path, config.quantization) \
            .with_max_model_len(config.max_model_len)
        self.tokenizer = load_tokenizer(config.tokenizer or self.model_path, config.trust_remote_code)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.model_config.torch_dtype, self.device)
        backend = config.attention_backend
        if backend == "auto":
            backend = "triton" if self.device.type == "cuda" else "torch"
        torch.manual_seed(config.seed)
        # A ModelRunner, or rank 0 of a tensor-parallel group that drives its worker processes.
        self.runner = create_executor(self.model_config, self.model_path, self.device, self.dtype,
                                      config.block_size, backend, config.tensor_parallel_size)
        try:
            max_len = self.model_config.max_model_len
            self.max_num_batched_tokens = config.resolve_max_num_batched_tokens(max_len)
            kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype)
            if self.device.type == "cuda" and not config.enforce_eager:
                self.runner.plan_decode_graphs(config.max_num_seqs)  # their memory is counted in the sizing
            num_blocks = choose_num_blocks(config, self.model_config, self.runner, kv_dtype,
                                           self.max_num_batched_tokens)
            self.runner.allocate_kv_cache(num_blocks, kv_dtype)
            self.runner.capture_decode_graphs()
        except BaseException:
            self.runner.shutdown()  # no worker outlives a failed start
            raise
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, self.max_num_batched_tokens,
                                   config.enable_chunked_prefill)
        self.generator = torch.Generator().manual_seed(config.seed)
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats(num_blocks=num_blocks, block_size=config.block_size)
        logger.info("engine ready: %s on %s (%s), %d KV blocks of %d tokens", self.model_config.architecture,
                    self.device, self.dtype, num_blocks, config.block_size)

    # ---- requests in -------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_text, prompt_ids = self._tokenize(prompt)
        self._validate(prompt_ids, params)
        request = Request(request_id, prompt_text, prompt_ids, params, self.tokenizer,
                          arrival_time or time.time())
        seq = Sequence(request, 0, prompt_ids, request.make_generator(0))
        request.seqs.append(seq)
        self.requests[request_id] = request
        self.scheduler.add(seq)

    def add_beam_request(self, request_id: str, prompt: str | list[int], params: BeamSearchParams) -> None:
        """A beam-search request: its beams decode in lock step and fork off each other's blocks."""
        sampling = SamplingParams(temperature=0, max_tokens=params.max_tokens, ignore_eos=params.ignore_eos)
        self.add_request(request_id, prompt, sampling)
        request = self.requests[request_id]
        request.beam = BeamGroup(params, self.model_config.eos_token_ids, request.num_prompt_tokens)

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return prompt, self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt]
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        return None, ids

    def _validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        max_len = self.model_config.max_model_len
        if not prompt_ids:
            raise ValueError("prompt is empty (it encodes to zero tokens)")
        if len(prompt_ids) > max_len:
            raise ValueError(f"prompt is {len(prompt_ids)} tokens, longer than max_model_len ({max_len})")
        if params.max_tokens is not None and len(prompt_ids) + params.max_tokens > max_len:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) is more "
                             f"than max_model_len ({max_len}); lower max_tokens or shorten the prompt")
        pool_tokens = self.kv.pool.num_blocks * self.kv.block_size
        if len(prompt_ids) > pool_tokens:
            raise ValueError(f"prompt is {len(prompt_ids)} tokens but the whole KV cache holds {pool_tokens}")
        params.validate_token_ids(self.model_config.vocab_size)

    def abort_request(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        request.aborted = True
        self.scheduler.abort([s for s in request.seqs if not s.is_finished])

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- one step ----------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        now = time.time()
        touched: dict[str, Request] = {}
        finished: list[Sequence] = []
        for seq in out.too_long:
            self._finish(seq, "length")
            finished.append(seq)
            touched[seq.request.request_id] = seq.request
        if out.scheduled:
            logits = self.runner.execute(out.scheduled, out.block_copies)
            sampling = [s for s in out.scheduled if s.samples]
            for item in out.scheduled:
                item.seq.num_computed_tokens += item.num_new_tokens
                self.stats.prompt_tokens_total += self._prompt_part(item)
                request = item.seq.request
                if request.metrics.first_scheduled_time is None:
                    request.metrics.first_scheduled_time = now
                    request.num_cached_tokens = item.seq.num_computed_tokens - item.num_new_tokens
            if sampling:
                finished += self._sample_and_append(sampling, logits, touched)
            self.stats.num_steps += 1
        self.scheduler.finish([s for s in finished if s.block_table])
        return [self._make_output(r) for r in touched.values()]

    def _prompt_part(self, item: ScheduledSeq) -> int:
        seq = item.seq
        start = seq.num_computed_tokens - item.num_new_tokens
        return max(0, min(seq.num_computed_tokens, seq.num_prompt_tokens) - start)

    def _sample_and_append(self, sampling: list[ScheduledSeq], logits: torch.Tensor,
                           touched: dict[str, Request]) -> list[Sequence]:
        seqs: list[Sequence] = []
        logit_rows: list[int] = []
        beams = [row for row, item in enumerate(sampling) if item.seq.request.beam is not None]
        if beams:
            self._advance_beams([sampling[r].seq for r in beams], logits[beams], touched)
            keep = [r for r in range(len(sampling)) if sampling[r].seq.request.beam is None]
            sampling, logits = [sampling[r] for r in keep], logits[keep]
        for row, item in enumerate(sampling):
            request = item.seq.request
            # Once its prompt is computed, a request with n > 1 forks its other sequences off the first;
            # they all draw their first token from the same logits.
            targets = self._fork_outputs(item.seq) if len(request.seqs) < request.params.n else [item.seq]
            seqs += targets
            logit_rows += [row] * len(targets)
        if not seqs:
            return []
        if len(logit_rows) != len(sampling):
            logits = logits[logit_rows]
        eos = self.model_config.eos_token_ids
        rows = [SamplingRow(s.params, s.token_ids[:s.num_prompt_tokens], s.output_token_ids, s.generator, eos)
                for s in seqs]
        result = sample(logits, rows, self.generator)
        now = time.time()
        for i, seq in enumerate(seqs):
            self._append(seq, i, result)
            metrics = seq.request.metrics
            metrics.first_token_time = metrics.first_token_time or now
            metrics.last_token_time = now
            touched[seq.request.request_id] = seq.request
        self.stats.generation_tokens_total += len(seqs)
        return [s for s in seqs if s.is_finished]

    def _advance_beams(self, beams: list[Sequence], logits: torch.Tensor, touched: dict[str, Request]) -> None:
        """Record each beam's next-token log-probs; once a request has all of them, fork the next beams."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        groups: dict[str, Request] = {}
        for seq, row in zip(beams, logprobs):
            seq.request.beam.pending[seq.index] = row
            groups[seq.request.request_id] = seq.request
        for request in groups.values():
            group = request.beam
            if not group.ready():
                continue
            old = request.seqs
            survivors = group.advance([s.token_ids for s in old])
            children = []
            for index, cand in enumerate(survivors):
                child = Sequence(request, index, old[cand.parent].token_ids, None)
                self.kv.fork(old[cand.parent], child)
                child.append_token(cand.token, 0.0, None)
                child.status = SequenceStatus.RUNNING
                children.append(child)
            for seq in old:
                seq.status = SequenceStatus.FINISHED
            self.scheduler.finish(old)  # drops the parents' references; children hold theirs
            self.scheduler.running += children
            request.seqs = children
            self.stats.generation_tokens_total += len(children)
            if group.done:
                request.metrics.finished_time = time.time()
                touched[request.request_id] = request

    def _fork_outputs(self, parent: Sequence) -> list[Sequence]:
        request = parent.request
        children = [parent]
        for index in range(1, request.params.n):
            child = Sequence(request, index, parent.token_ids, request.make_generator(index))
            self.kv.fork(parent, child)
            child.status = SequenceStatus.RUNNING
            self.scheduler.running.append(child)
            request.seqs.append(child)
            children.append(child)
        return children

    def _append(self, seq: Sequence, i: int, result: SamplerOutput) -> None:
        token = result.token_ids[i]
        top = None
        if seq.logprobs is not None:
            decode, k = self.tokenizer.decode, seq.params.logprobs
            top = {token: Logprob(result.logprobs[i], result.ranks[i], decode([token]))}
            for rank, (tid, lp) in enumerate(zip(result.top_ids[i][:k], result.top_logprobs[i][:k]), start=1):
                top.setdefault(tid, Logprob(lp, rank, decode([tid])))
        seq.append_token(token, result.logprobs[i], top)
        self._check_stop(seq, token, seq.detokenizer.add_token(token))

    def _check_stop(self, seq: Sequence, token: int, new_text: str) -> None:
        p = seq.params
        n_out = seq.num_output_tokens
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token in self.model_config.eos_token_ids:
                return self._finish(seq, "stop", token)
            if token in p.stop_token_ids:
                return self._finish(seq, "stop", token)
            stop = seq.detokenizer.find_stop(len(new_text))
            if stop is not None:
                return self._finish(seq, "stop", stop)
        if (p.max_tokens is not None and n_out >= p.max_tokens) or seq.num_tokens >= self.model_config.max_model_len:
            self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        seq.status, seq.finish_reason, seq.stop_reason = SequenceStatus.FINISHED, reason, stop_reason
        if reason == "length" or isinstance(stop_reason, int):
            seq.detokenizer.flush()
        if seq.request.finished:
            seq.request.metrics.finished_time = time.time()

    # ---- outputs -----------------------------------------------------------------------------------

    def _make_output(self, request: Request) -> RequestOutput:
        if request.beam is not None:
            return self._make_beam_output(request)
        finished = request.finished
        outputs = []
        for seq in sorted(request.seqs, key=lambda s: s.index):
            done = seq.is_finished
            outputs.append(CompletionOutput(
                index=seq.index, text=seq.detokenizer.visible_text(done), token_ids=seq.output_token_ids,
                cumulative_logprob=seq.cumulative_logprob, logprobs=seq.logprobs,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason))
        if finished:
            self.requests.pop(request.request_id, None)
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, outputs, finished,
                             request.metrics, request.num_cached_tokens)

    def _make_beam_output(self, request: Request) -> RequestOutput:
        n, max_tokens = request.num_prompt_tokens, request.params.max_tokens
        outputs = []
        for i, (_, tokens, cum) in enumerate(request.beam.finished):
            text = self.tokenizer.decode(tokens[n:], skip_special_tokens=True)
            reason = "length" if len(tokens) - n >= max_tokens else "stop"
            outputs.append(CompletionOutput(i, text, tokens[n:], cum, None, reason))
        self.requests.pop(request.request_id, None)
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, outputs, True,
                             request.metrics, request.num_cached_tokens)

    def get_stats(self) -> EngineStats:
        s = self.stats
        pool = self.kv.pool
        s.num_running, s.num_waiting = len(self.scheduler.running), len(self.scheduler.waiting)
        s.num_used_blocks = pool.num_blocks - pool.num_free_blocks
        s.num_cached_free_blocks = pool.num_cached_free
        s.kv_cache_usage = pool.usage()
        s.prefix_cache_queries, s.prefix_cache_hits = self.kv.prefix_queries, self.kv.prefix_hits
        s.num_preemptions = self.scheduler.num_preemptions
        return s

    def block_pool_snapshot(self) -> BlockPoolSnapshot:
        from engine.block_snapshot import snapshot_blocks
        return snapshot_blocks(self.kv.pool, self.scheduler.running, list(self.scheduler.waiting))

    def memory_usage(self) -> dict[str, int]:
        return {"weights_bytes": self.runner.weights_bytes(), "kv_cache_bytes": self.runner.kv_cache_bytes()}

    def check_health(self) -> None:
        """Raise if the engine can no longer run a step (a tensor-parallel worker died while idle)."""
        self.runner.check_health()

    def shutdown(self) -> None:
        """Drop every request and end the tensor-parallel workers, if any. Idempotent."""
        self.requests.clear()
        self.runner.shutdown()
