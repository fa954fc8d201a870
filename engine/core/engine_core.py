"""EngineCore: requests in, one scheduled forward per `step()`, cumulative RequestOutputs out.

It owns the scheduler with its KV-cache manager and the output processor, and drives the executor it is given
(a model runner, or rank 0 of a tensor-parallel group; started by engine/entrypoints/llm_engine.py, so this
side of the step never imports the worker, the models or the kernels); it validates requests on the way in, plans each step's sampling (the n outputs of a request
fork off its prompt once the prompt is computed: their rows share its logits), hands the runner's sampled
tokens to the output processor (append, stop rules, RequestOutputs) and what that changed to
`Scheduler.update_from_output`, and reports statistics and a block-pool snapshot for /metrics and the
GUI. With async scheduling (--async-scheduling, vLLM's) a step is launched and the next one scheduled before its
results are read: `step()` launches step N+1, then processes step N, whose tokens fed N+1 on the device; a step
whose successor needs its tokens on the host first runs to the end before anything else is scheduled. Each
step's phases go to the step timer (engine/core/step_timer.py). With the prefix cache's CPU-RAM tier it owns the
tier's connector (engine/kv/offload/), tells it which copy batches the runner has finished before each schedule,
and hands each step's copies to the runner (with the forward, or alone when the step runs none; the tier keeps
async scheduling off). Sleep mode (`sleep`, `wake_up`, vLLM's levels) preempts every sequence, stores what the
tier can keep and has the runner free the device; requests that arrive meanwhile wait until it wakes.
A request's images are checked and processed by engine/core/image_inputs.py, which also sizes the encoder cache
the scheduler spends.
Not thread-safe: one caller.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any

import torch

from engine.core.beam_search import BeamGroup, BeamSearchParams
from engine.core.image_inputs import ImageInputs
from engine.config.flags import EngineConfig
from engine.kv.kv_cache_manager import KVCacheManager
from engine.kv.offload.connector import OffloadConnector
from engine.config.pooler import task_mismatch
from engine.sample.pooling import PoolingParams, RequestPooling
from engine.core.output_processor import OutputProcessor, StepOutcome, StepPlan
from engine.core.outputs import BlockPoolSnapshot, EngineStats, RequestOutput
from engine.sample.metadata import SamplingBatch, SamplingRow, make_generator
from engine.sample.state import SamplingMetadata
from engine.sample.sampling_params import SamplingParams
from engine.core.request_faults import RequestFaults
from engine.core.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from engine.core.sequence import Request, Sequence
from engine.core.started import StartedEngine
from engine.core.step_timer import StepTimer
from engine.multimodal.inputs import MultiModalInputs
from engine.spec_decode.speculator import SpecBatch, Speculator
from engine.structured_output.bitmask import grammar_bitmask
from engine.structured_output.compiler import GrammarCompiler
from engine.structured_output.params import StructuredOutputsParams
from engine.structured_output.state import GrammarState

logger = logging.getLogger("pagedesk.engine")
COMPILE_POLL_S = 0.005  # an engine with only compiling requests checks on them this often
TIER_WAIT_S = 0.05  # a step that ran nothing waits this long at most for copies from the CPU-RAM tier


class EngineCore:
    def __init__(self, config: EngineConfig, started: StartedEngine) -> None:
        """`started`: the executor with the model loaded and the KV cache allocated on every rank, and what was
        read on the way (engine/entrypoints/llm_engine.py starts it; tests may hand in their own)."""
        self.config = config
        self.model_path, self.model_config, self.tokenizer = started.model_path, started.model_config, started.tokenizer
        self.device, self.dtype = started.device, started.dtype
        self.runner = started.runner  # a ModelRunner, or rank 0 of a tensor-parallel group driving its workers
        self.spec_config = started.spec_config
        self.max_num_batched_tokens = started.max_num_batched_tokens
        self.kv_layout = started.kv_layout  # the runner's cache uses the same
        num_blocks, snapshots = started.num_blocks, started.num_state_snapshots
        if snapshots:
            logger.info("prefix caching for %s keeps %d linear-attention state snapshots at block boundaries of "
                        "prompts; a hit restores one (docs/kv-cache-groups.md)", self.model_config.architecture,
                        snapshots)
        tier = started.host_tier
        offload = None if tier is None else OffloadConnector(tier.num_blocks, tier.bytes_per_block,
                                                             tier.num_state_slots, tier.state_slot_bytes)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                 [group.spec for group in self.kv_layout.groups], started.num_state_slots, snapshots,
                                 offload)
        self.images = started.images if started.images is not None else ImageInputs(
            config, self.model_config, self.model_path, self.tokenizer, self.max_num_batched_tokens)
        self.encoder_cache = self.images.encoder_cache
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, self.max_num_batched_tokens,
                                   config.enable_chunked_prefill,
                                   config.resolve_max_batch_prefill_tokens(self.device.type),
                                   config.scheduling_policy, self.encoder_cache, whole_images=self.images.whole)
        self.takes_images = self.encoder_cache is not None
        self.generator = make_generator(config.seed, self.runner.device)  # unseeded draws, on the sampling device
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, self.model_config.eos_token_ids)
        # In the pool, now: json_object is the common spec, and it must not queue behind an attacker's schemas.
        self.grammars.submit(StructuredOutputsParams(json_object=True))
        self.requests: dict[str, Request] = {}
        self.compiling: list[tuple[Sequence, Future]] = []  # requests whose grammar is still compiling
        self.stats = EngineStats(num_blocks=num_blocks, block_size=config.block_size)
        self.sleep_level = 0  # sleep mode: 0 awake, else the level it sleeps at
        self.held_outputs: list[RequestOutput] = []  # the in-flight step's, finished when the engine fell asleep
        self.timer = StepTimer()  # each step's phases; a runner that can lap "prepare" itself is handed it
        if hasattr(self.runner, "step_timer"):
            self.runner.step_timer = self.timer
        self.faults = RequestFaults()  # requests that failed inside this step: they end, the step goes on
        self.output = OutputProcessor(self.tokenizer, self.model_config.eos_token_ids,
                                      self.model_config.max_model_len, self.stats, self.faults,
                                      pooling=self.model_config.pooler is not None)
        self.spec = None
        if self.spec_config is not None:
            self.spec = Speculator(self.spec_config, self.model_config.max_model_len,
                                   self.model_config.eos_token_ids, self.model_config.vocab_size, started.proposer)
            logger.info("speculative decoding: %s", self.spec_config.describe())
        self.async_scheduling = self._resolve_async_scheduling(config)
        self.inflight: LaunchedStep | None = None  # async scheduling: the step on the device, results unread
        logger.info("engine ready: %s on %s (%s), %d KV blocks of %d tokens", self.model_config.architecture,
                    self.device, self.dtype, num_blocks, config.block_size)

    def _resolve_async_scheduling(self, config: EngineConfig) -> bool:
        """--async-scheduling, where the engine can: a runner that launches steps (not yet tensor parallel: its
        workers would need the sampled ids), no speculative decoding (drafts need the host's tokens), no
        embedding engine (nothing is sampled)."""
        if not config.async_scheduling:
            return False
        missing = [why for why, off in (("the runner cannot launch a step (tensor parallel)",
                                         not hasattr(self.runner, "launch")),
                                        ("speculative decoding", self.spec is not None),
                                        ("the CPU-RAM tier (its copies are fenced step by step)",
                                         self.kv.offload is not None),
                                        ("an embedding engine", self.model_config.pooler is not None)) if off]
        if missing:
            logger.info("async scheduling is off: %s", ", ".join(missing))
            return False
        logger.info("async scheduling: step N+1 is scheduled and prepared while step N runs")
        return True

    # ---- requests in -------------------------------------------------------------------------------

    @property
    def mm_processor(self):
        """The checkpoint's image processing (engine/core/image_inputs.py); a ValueError for a text-only model."""
        return self.images.processor

    @property
    def images_refused(self) -> str | None:
        return self.images.refused

    def process_images(self, prompt: str, images: list, add_special_tokens: bool = True) -> MultiModalInputs:
        return self.images.process(prompt, images, add_special_tokens)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None,
                    arrival_time: float | None = None, cache_salt: str | None = None, priority: int = 0,
                    pooling: PoolingParams | None = None, mm: MultiModalInputs | None = None) -> None:
        """A generation request, or with `pooling` an embedding request (prompt only, `params` unused); `mm`: its
        images, processed (`process_images`), whose expanded token ids are the prompt."""
        if mm is not None:
            if pooling is not None:
                raise ValueError("embedding requests take text only")
            self.images.check(mm)
            prompt = mm.prompt_token_ids
            mm = mm if mm.items else None
        mismatch = task_mismatch(self.model_config.pooler, pooling is not None)
        if mismatch:
            raise ValueError(mismatch)
        if pooling is not None:
            self.model_config.pooler.check_dimensions(pooling.dimensions, self.model_config.hidden_size)
            params = SamplingParams(temperature=0.0, max_tokens=None)  # never sampled: the prompt is pooled
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if priority and self.config.scheduling_policy != "priority":
            raise ValueError(f"priority must be 0 unless the engine runs with --scheduling-policy priority, "
                             f"got {priority}")
        self._check_width("n", params.n)
        prompt_text, prompt_ids = self._tokenize(prompt)
        self._validate(prompt_ids, params)
        if params.bad_words:
            params.resolve_bad_words(self.tokenizer)
            outside = [t for ids in params.bad_words_token_ids for t in ids if t >= self.model_config.vocab_size]
            if outside:
                raise ValueError(f"bad_words encode to token ids {outside[:5]} outside the model's vocabulary "
                                 f"[0, {self.model_config.vocab_size})")
        request = Request(request_id, prompt_text, prompt_ids, params, self.tokenizer,
                          arrival_time or time.time(), cache_salt=cache_salt, priority=priority, mm=mm)
        max_len = self.model_config.max_model_len
        request.max_num_tokens = max_len if params.max_tokens is None else \
            min(max_len, len(prompt_ids) + params.max_tokens)
        request.may_run_ahead = pooling is None and not needs_host_tokens(params)
        if pooling is not None:
            request.pooling = RequestPooling(pooling, self.model_config.pooler)
        seq = Sequence(request, 0, prompt_ids, request.make_generator(0, self.runner.device))
        compiling = None
        if params.structured_outputs is not None:
            compiling = self.grammars.submit(params.structured_outputs)  # never compiled on this thread
            if compiling.done():
                seq.grammar, compiling = GrammarState(compiling.result()), None
        request.seqs.append(seq)
        self.requests[request_id] = request
        if compiling is None:
            self.scheduler.add(seq)
        else:
            self.compiling.append((seq, compiling))  # scheduled once its grammar is ready

    def add_beam_request(self, request_id: str, prompt: str | list[int], params: BeamSearchParams,
                         arrival_time: float | None = None, cache_salt: str | None = None, priority: int = 0,
                         mm: MultiModalInputs | None = None) -> None:
        """A beam-search request: its beams decode in lock step and fork off each other's blocks."""
        self._check_width("beam_width", params.beam_width)
        sampling = SamplingParams(temperature=0, max_tokens=params.max_tokens, ignore_eos=params.ignore_eos)
        self.add_request(request_id, prompt, sampling, arrival_time, cache_salt, priority, mm=mm)
        request = self.requests[request_id]
        request.beam = BeamGroup(params, self.model_config.eos_token_ids, request.num_prompt_tokens)
        request.may_run_ahead = False  # its beams fork every step

    def _check_width(self, name: str, width: int) -> None:
        """Every sequence of a request counts against max_num_seqs (the scheduler admits it whole), so a
        wider request could never run."""
        if width > self.config.max_num_seqs:
            raise ValueError(f"{name} ({width}) is more than max_num_seqs ({self.config.max_num_seqs}): every "
                             f"output of a request runs as its own sequence; lower {name} or raise --max-num-seqs")

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            text, ids = prompt, list(self.tokenizer.encode(prompt))
        else:
            text, ids = None, [int(t) for t in prompt]
        # Text too: a tokenizer with more tokens than the model's embedding would index past it (on CUDA a
        # device-side assert, which ends the whole engine).
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        return text, ids

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
        try:  # the request's sampling tensors, once on the host: a value no tensor holds is refused here
            SamplingMetadata.build([SamplingRow(params, prompt_ids, len(prompt_ids), None,
                                                self.model_config.eos_token_ids)],
                                   self.model_config.vocab_size, torch.device("cpu"))
        except (ValueError, TypeError, OverflowError, RuntimeError) as exc:
            raise ValueError(f"sampling parameters cannot be prepared: {exc}") from None

    def abort_request(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        request.aborted = True
        self.scheduler.abort([s for s in request.seqs if not s.is_finished])
        if self.kv.offload is not None:
            self._tier_between_steps(True)  # an engine left idle stores what the abort freed now

    def pause_request(self, request_id: str, paused: bool) -> None:
        """A paused request keeps its blocks but its running sequences are not scheduled (a stalled reader)."""
        request = self.requests.get(request_id)
        if request is not None:
            request.paused = paused

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- one step ----------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule and launch a step; with async scheduling, while it runs, process the one launched before it
        (its outputs are what this call returns), so the host's work for step N+1 overlaps step N on the device."""
        timer = self.timer
        timer.start()
        self._admit_compiled()
        if self.sleep_level:  # requests wait until the engine wakes (vLLM's behaviour)
            outputs, self.held_outputs = self.held_outputs, []
            return outputs
        if self.kv.offload is not None:
            self.kv.offload.complete(self.runner.kv_transfers_done())
        if self.spec is not None:
            self.spec.propose_before_schedule(self.scheduler.running)
        out = self.scheduler.schedule()
        if self.spec is not None and out.scheduled:
            self.spec.fill_drafts(out.scheduled, out.block_copies, self.generator)
        timer.lap("schedule")
        outcome = StepOutcome()
        for seq in out.too_long:
            self.output.finish(seq, "length")
            outcome.finished.append(seq)
            outcome.touched[seq.request.request_id] = seq.request
        launched = self._launch(out) if out.scheduled else None
        ahead = launched is not None and self._runs_ahead(launched)
        if ahead:
            self.scheduler.launched(out)  # the next step is scheduled before its results: count them now
        previous, self.inflight = self.inflight, launched if ahead else None
        if previous is not None:
            outcome.touched.update(self._finish(previous).touched)
        if launched is not None and not ahead:
            outcome.touched.update(self._finish(launched).touched)
        elif launched is None:
            if out.kv_transfers is not None:  # the tier's copies of a step that runs no forward
                self.runner.transfer_kv(out.kv_transfers)
            self.scheduler.update_from_output(out, [], outcome.finished)
        if self.kv.offload is not None:
            self._tier_between_steps(launched is not None)
        timer.lap("process")
        outputs = self._outputs(outcome)
        timer.lap("outputs")
        timer.end()
        return outputs

    def _launch(self, out: SchedulerOutput) -> "LaunchedStep":
        """Plan the step's sampling and hand it to the runner: run to the end, or with async scheduling queued
        on the device (the runner's `launch`), its results read by `_finish`."""
        now = time.time()
        plan = self._plan_sampling([s for s in out.scheduled if s.samples])
        self.timer.lap("plan")
        self.output.record_scheduled(out.scheduled, now)
        extra = {"encoder": out.encoder} if out.encoder else {}  # tests' stand-in runners predate images
        if self.async_scheduling:  # never with the tier (_resolve_async_scheduling)
            result = self.runner.launch(out.scheduled, out.block_copies, plan.batch, out.state_copies, **extra)
        else:
            result = self.runner.execute(out.scheduled, out.block_copies, plan.batch, out.state_copies,
                                         out.kv_transfers, **extra)
        self.timer.lap("forward")
        self.stats.num_steps += 1
        return LaunchedStep(out, plan, now, result)

    def _runs_ahead(self, step: "LaunchedStep") -> bool:
        """Whether the next step may be scheduled before this one's tokens reach the host: async scheduling, and
        nothing in it that needs them there first (forks, beams, drafts, a request with may_run_ahead False)."""
        plan = step.plan
        return (self.async_scheduling and not plan.forks and not plan.beams and not plan.spec_items
                and all(item.seq.request.may_run_ahead for item in step.out.scheduled))

    def _finish(self, step: "LaunchedStep") -> StepOutcome:
        """A launched step's results (waiting for them if they are still on the device), through the output
        processor and the scheduler."""
        result = step.result.result() if self.async_scheduling and step.result is not None else step.result
        self.timer.lap("forward")
        outcome = StepOutcome()
        if step.out.counted:  # the tokens on their way are here
            for seq in step.plan.targets:
                seq.num_pending -= 1
        self.output.process(outcome, step.out.scheduled, step.plan, result, step.now)
        self.scheduler.update_from_output(step.out, outcome.forks, outcome.finished)
        if self.spec is not None:
            self.spec.after_step(step.plan.spec_items, result)
        return outcome

    def _outputs(self, outcome: StepOutcome) -> list[RequestOutput]:
        """The step's outputs: one per request it touched, and one per request that failed in it."""
        outputs = []
        for request in outcome.touched.values():
            with self.faults.guard(request, "building its output"):
                if not self.faults.failed or request not in self.faults:
                    outputs.append(self.output.make_output(request))
        for output in outputs:
            if output.finished:
                self.requests.pop(output.request_id, None)
        return outputs + self._end_failed()

    # ---- sleep mode ----------------------------------------------------------------------------------------------

    def sleep(self, level: int = 1) -> dict[str, int]:
        """Free the device (vLLM's levels: 1 keeps the weights in host RAM, 2 drops them and reloads them on wake;
        both drop the KV cache). Every sequence is preempted (recomputed after wake, its prefix from the CPU-RAM tier
        when there is one: what it holds survives, and the freed blocks are stored to it first). Returns the device
        bytes freed on rank 0, by kind; a sleeping engine sleeps on."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (weights to CPU RAM) or 2 (weights dropped), got {level}")
        if self.sleep_level:
            return {"kv_cache_bytes": 0, "weights_bytes": 0}
        if self.inflight is not None:  # async scheduling: the step on the device ends first; its outputs wait
            self.held_outputs = self._outputs(self._finish(self.inflight))
            self.inflight = None
        offload = self.kv.offload
        if offload is not None:  # copies in flight run first: their sequences then hold computed blocks
            self.runner.wait_kv_transfers(offload.next_batch - 1, None)
            offload.complete(self.runner.kv_transfers_done())
        self.scheduler.release_all()
        self.kv.drop_device_cache()
        if offload is not None:
            stores = offload.take(forward=False)
            if stores is not None:
                self.runner.transfer_kv(stores)  # the runner waits for them before it drops the pool
        freed = self.runner.sleep(level)
        self.sleep_level = level
        logger.info("sleeping at level %d: %.2f GiB of KV cache and %.2f GiB of weights freed on the device", level,
                    freed["kv_cache_bytes"] / 2**30, freed["weights_bytes"] / 2**30)
        if self.spec is not None and self.spec.proposer.weights_bytes():  # a draft model sleeps awake (for now)
            logger.info("the speculative draft's %.2f GiB of weights and its KV pages stay on the device",
                        self.spec.proposer.weights_bytes() / 2**30)
        return freed

    def wake_up(self) -> None:
        """Back to serving: weights on the device (reloaded after level 2), an empty KV cache; waiting requests
        run from the next step."""
        if not self.sleep_level:
            return
        self.runner.wake_up()
        self.sleep_level = 0
        logger.info("awake")

    @property
    def is_sleeping(self) -> bool:
        return bool(self.sleep_level)

    @property
    def loading_kv(self) -> bool:
        """Sequences wait for copies from the CPU-RAM tier (a step that ran nothing is then not idle)."""
        return bool(self.scheduler.loading)

    def _tier_between_steps(self, ran: bool) -> None:
        """With nothing left to run, the stores of what just finished go now (the engine may idle a long time); a
        step that ran nothing because everyone waits for tier copies waits for the oldest, rather than spin."""
        offload = self.kv.offload
        if not self.scheduler.has_work():
            idle = offload.take(forward=False)
            if idle is not None:
                self.runner.transfer_kv(idle)
        elif not ran and self.scheduler.loading:
            oldest = min(seq.kv_load_batch for seq in self.scheduler.loading)
            if oldest > offload.completed and self.runner.wait_kv_transfers(oldest, TIER_WAIT_S):
                offload.complete(self.runner.kv_transfers_done())

    def _admit_compiled(self) -> None:
        """Requests whose grammar finished compiling join the scheduler (a failed compile fails the request).
        With nothing else to run, wait a moment for one, rather than spin."""
        if not self.compiling:
            return
        if not self.scheduler.has_work():
            wait([f for _, f in self.compiling], timeout=COMPILE_POLL_S, return_when=FIRST_COMPLETED)
        still = []
        for seq, future in self.compiling:
            if seq.request.aborted:
                continue
            if not future.done():
                still.append((seq, future))
                continue
            with self.faults.guard(seq.request, "compiling its grammar"):
                seq.grammar = GrammarState(future.result())
                self.scheduler.add(seq)
        self.compiling = still

    def _end_failed(self) -> list[RequestOutput]:
        """Abort the requests that failed this step (their blocks go back) and say why in a final output."""
        outputs = []
        for request, message in self.faults.take():
            self.abort_request(request.request_id)
            outputs.append(RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, [], True,
                                         request.metrics, request.num_cached_tokens, error=message))
        return outputs

    def _plan_sampling(self, sampling: list[ScheduledSeq]) -> StepPlan:
        """What the runner must draw this step: a row per sequence that samples (a request with n > 1
        forks its other outputs off the first once its prompt is computed: they all draw their first token
        from the same logits row), and the top log-probs of every beam row."""
        # cumulative_logprob is kept only where logprobs were asked (Sequence): no other row needs its logprob
        plan = StepPlan(SamplingBatch(generator=self.generator, chosen_logprobs=False))
        spec = SpecBatch() if self.spec is not None and any(item.num_draft_tokens for item in sampling) else None
        row = 0  # logits row: one per sampling sequence, 1 + k for one verifying drafts
        for item in sampling:
            with self.faults.guard(item.seq.request, "preparing its sampling rows"):
                if item.num_draft_tokens:
                    self.spec.plan_rows(spec, item.seq, row, item.seq.params.allowed_token_ids)
                    plan.spec_items.append(item)
                else:
                    self._plan_row(plan, row, item.seq)
            row += 1 + item.num_draft_tokens
        if spec is not None and spec.rows:
            self.spec.finish_batch(spec)
            plan.batch.spec = spec
        try:
            plan.batch.bitmask = self._bitmask(plan.targets)
        except Exception:  # noqa: BLE001 - one request's grammar: find it, fail it, mask the others
            for target in plan.targets:
                with self.faults.guard(target.request, "filling its grammar bitmask"):
                    self._bitmask([target])
            _drop_failed(plan, self.faults)
            plan.batch.bitmask = self._bitmask(plan.targets)
        return plan

    def _plan_row(self, plan: StepPlan, row: int, seq: Sequence) -> None:
        """One scheduled sequence's part of the plan, added only once all of it is made."""
        request, batch = seq.request, plan.batch
        if request.beam is not None:
            beam_topk = max(batch.beam_topk, 2 * request.beam.params.beam_width)
            plan.beams.append(seq)
            batch.beam_index.append(row)
            batch.beam_topk = beam_topk
            return
        targets, forks = [seq], []
        if len(request.seqs) < request.params.n:
            children = [Sequence(request, index, seq.token_ids, request.make_generator(index, self.runner.device))
                        for index in range(1, request.params.n)]
            for child in children:
                child.grammar = seq.grammar.fork() if seq.grammar is not None else None
            forks.append((seq, children))
            targets += children
        rows = [t.sampling_row or self._sampling_row(t) for t in targets]
        plan.forks += forks
        plan.targets += targets
        batch.rows += rows
        batch.logits_index += [row] * len(rows)

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        """A sequence's sampling row, made once: it reads the sequence's own token list, so it stays current."""
        seq.sampling_row = SamplingRow(seq.params, seq.token_ids, seq.num_prompt_tokens, seq.generator,
                                       self.model_config.eos_token_ids, seq.seq_id)
        return seq.sampling_row

    def _bitmask(self, targets: list[Sequence]):
        return grammar_bitmask([t.grammar for t in targets], self.model_config.vocab_size,
                               [t.params.allowed_token_ids for t in targets])

    def get_stats(self) -> EngineStats:
        s = self.stats
        pool = self.kv.pool
        s.num_running, s.num_waiting = len(self.scheduler.running), len(self.scheduler.waiting) + len(self.compiling)
        s.num_used_blocks = pool.num_blocks - pool.num_free_blocks
        s.num_cached_free_blocks = pool.num_cached_free
        s.kv_cache_usage = pool.usage()
        s.prefix_cache_queries, s.prefix_cache_hits = self.kv.prefix_queries, self.kv.prefix_hits
        s.num_preemptions = self.scheduler.num_preemptions
        s.sleep_level = self.sleep_level
        if self.spec is not None:  # a copy made on the engine thread: readers on other threads see one instant
            s.spec_decode = self.spec.stats.as_dict()
        s.expert_load = self.runner.expert_load_totals()  # a fresh dict too; between steps, so no stall
        if self.kv.offload is not None:
            s.kv_offload = self.kv.offload.snapshot_stats().as_dict()
            s.kv_offload["loads_in_flight"] = len(self.scheduler.loading)
        return s

    def block_pool_snapshot(self) -> BlockPoolSnapshot:
        from engine.core.block_snapshot import StateSlots, snapshot_blocks
        state = None
        if self.kv.state is not None:
            state = StateSlots(self.kv.state.pool.num_slots, tuple(self.kv.snapshots.values()),
                               self.kv.num_snapshot_slots, self.kv_layout.state_bytes_per_seq)
        return snapshot_blocks(self.kv.pool, self.scheduler.running, list(self.scheduler.waiting),
                               self.kv_layout.group_names(), state, self.kv.block_size)

    def memory_usage(self) -> dict[str, int]:
        """The target's weights and caches, with a speculative proposer's (a draft model's, an MTP head's) beside."""
        weights, kv = self.runner.weights_bytes(), self.runner.kv_cache_bytes()
        if self.spec is not None:
            proposer = self.spec.proposer
            weights, kv = weights + proposer.weights_bytes(), kv + proposer.kv_cache_bytes()
        return {"weights_bytes": weights, "kv_cache_bytes": kv}

    def check_health(self) -> None:
        """Raise if the engine can no longer run a step (a tensor-parallel worker died while idle)."""
        self.runner.check_health()

    def shutdown(self) -> None:
        """Drop every request and end the tensor-parallel workers, if any. Idempotent."""
        self.requests.clear()
        self.inflight = None  # its results are never read
        self.grammars.shutdown()
        self.runner.shutdown()


@dataclass(slots=True)
class LaunchedStep:
    """A step handed to the runner: what was scheduled and planned, and its result (with async scheduling, the
    runner's handle whose `result()` waits for the device)."""

    out: SchedulerOutput
    plan: StepPlan
    now: float
    result: Any


def needs_host_tokens(params: SamplingParams) -> bool:
    """Whether a request's next step must wait for this step's tokens on the host: its grammar accepts them, its
    penalties, bad words or min_tokens are counted from them, or its prompt log-probs are read by position."""
    return (params.structured_outputs is not None or params.repetition_penalty != 1.0
            or bool(params.presence_penalty) or bool(params.frequency_penalty) or bool(params.bad_words)
            or params.min_tokens > 0 or params.prompt_logprobs is not None)


def _drop_failed(plan: StepPlan, faults: RequestFaults) -> None:
    """Take the failed requests' rows and forks out of a step's plan (their logits rows are then unused)."""
    keep = [i for i, t in enumerate(plan.targets) if t.request not in faults]
    batch = plan.batch
    plan.targets = [plan.targets[i] for i in keep]
    batch.rows = [batch.rows[i] for i in keep]
    batch.logits_index = [batch.logits_index[i] for i in keep]
    plan.forks = [(parent, children) for parent, children in plan.forks if parent.request not in faults]
