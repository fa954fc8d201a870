"""OutputProcessor: the output side of a step: new tokens appended, stop rules applied, RequestOutputs built.

After the model runner's step it records what was scheduled (prompt tokens, first-scheduled time, prefix
hits), registers the n outputs a request forks into, advances beam searches, and passes every new token
through `append_token`, the one place a token joins a sequence (detokenized and stop-checked there). It
never touches the scheduler or the KV cache: what the scheduler must do about the step (sequences that now
share a parent's blocks, sequences that finished) goes back as a `StepOutcome` for
`Scheduler.update_from_output`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.core.outputs import (CompletionOutput, EmbeddingOutput, EngineStats, Logprob, PoolingRequestOutput,
                            RequestOutput)
from engine.sample.pooling import record_pooled
from engine.sample.prompt_logprobs import PromptLogprobsOutput, prompt_positions
from engine.core.detokenizer import decoder_of
from engine.core.request_faults import RequestFaults
from engine.sample.sampler import SamplerOutput
from engine.sample.metadata import SamplingBatch
from engine.core.scheduler import ScheduledSeq
from engine.core.sequence import Request, Sequence, SequenceStatus


@dataclass
class StepPlan:
    """One step's sampling: the runner's batch, the sequence behind each of its rows, forks to make."""

    batch: SamplingBatch
    targets: list[Sequence] = field(default_factory=list)  # batch.rows[i] appends to targets[i]
    forks: list[tuple[Sequence, list[Sequence]]] = field(default_factory=list)  # parent, its new siblings
    beams: list[Sequence] = field(default_factory=list)  # batch.beam_index[i] belongs to beams[i]
    spec_items: list[ScheduledSeq] = field(default_factory=list)  # result.spec's sequence i is spec_items[i]


@dataclass
class StepOutcome:
    """What a step changed that the scheduler must act on, and the requests with news for their callers."""

    finished: list[Sequence] = field(default_factory=list)
    forks: list[tuple[Sequence, list[Sequence]]] = field(default_factory=list)  # children share the parent's blocks
    touched: dict[str, Request] = field(default_factory=dict)


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: list[int], max_model_len: int, stats: EngineStats,
                 faults: RequestFaults | None = None, pooling: bool = False) -> None:
        self.tokenizer, self.eos_token_ids, self.max_model_len, self.stats = tokenizer, eos_token_ids, \
            max_model_len, stats
        self.faults = faults or RequestFaults()  # a request whose output fails here ends alone
        self.pooling = pooling  # an embedding engine: requests end once their prompt is pooled
        self.decode = decoder_of(tokenizer)

    def record_scheduled(self, scheduled: list[ScheduledSeq], now: float) -> None:
        """Statistics of the chunks a step runs, taken as it is launched (before the scheduler counts them)."""
        for item in scheduled:
            seq = item.seq  # a decode past its prompt, scheduled before, changes none of them: no call for it
            if seq.num_computed_tokens < seq.num_prompt_tokens or seq.request.metrics.first_scheduled_time is None:
                self._record_scheduled(item, now)

    def process(self, outcome: StepOutcome, scheduled: list[ScheduledSeq], plan: StepPlan, result,
                now: float) -> None:
        """Everything a finished forward means for the requests; `result` is the runner's ModelRunnerOutput. A
        target that finished before its token came back (async scheduling: its stop was found one step late,
        or it was aborted) takes no token."""
        if result is not None and result.prompt_logprobs is not None:
            self._record_prompt_logprobs(scheduled, result.prompt_logprobs)
        if self.pooling:
            for seq in record_pooled(scheduled, result.pooled if result is not None else None):
                self.finish(seq, "stop")
                outcome.finished.append(seq)
                outcome.touched[seq.request.request_id] = seq.request
        for parent, children in plan.forks:
            parent.request.seqs += children
            outcome.forks.append((parent, children))
        if plan.beams:
            self._advance_beams(plan.beams, result, outcome)
        if plan.spec_items:
            self._append_verified(outcome, plan.spec_items, result.spec, now)
        if not plan.targets:
            return
        sampled: SamplerOutput = result.sampled
        logprobs = sampled.logprobs or [None] * len(plan.targets)  # None: no target asked for any
        discarded = 0
        for i, seq in enumerate(plan.targets):
            if seq.is_finished:
                discarded += 1
                continue
            if self.faults.failed and seq.request in self.faults:  # no call per token while none failed
                continue
            with self.faults.guard(seq.request, "processing its new token"):
                top = None if seq.logprobs is None else self._top_logprobs(seq, i, sampled)
                self.append_token(seq, sampled.token_ids[i], logprobs[i], top)
            self._after_tokens(outcome, seq, now)
        self.stats.generation_tokens_total += len(plan.targets) - discarded

    def _append_verified(self, outcome: StepOutcome, items: list[ScheduledSeq], spec, now: float) -> None:
        """A verify step's tokens (accepted drafts, then the target's own): appended in order until a stop
        rule ends the sequence inside the run; what follows the stop never joins it. `num_accepted` of the
        item is what the scheduler counts as computed."""
        for i, item in enumerate(items):
            seq = item.seq
            if seq.request in self.faults:
                continue
            appended = 0
            with self.faults.guard(seq.request, "processing its new tokens"):
                for j, token in enumerate(spec.token_ids[i]):
                    top = None
                    if seq.logprobs is not None:
                        top = self._top_entry(seq, token, spec.logprobs[i][j], spec.ranks[i][j],
                                              spec.top_ids[i][j], spec.top_logprobs[i][j])
                    self.append_token(seq, token, spec.logprobs[i][j], top)
                    appended += 1
                    if seq.is_finished:
                        break
            item.num_accepted = max(0, appended - 1)
            if self._after_tokens(outcome, seq, now):
                self.stats.generation_tokens_total += appended

    def _after_tokens(self, outcome: StepOutcome, seq, now: float) -> bool:
        """A sequence took this step's tokens: its timing, the request touched, finished if it is; False (and
        nothing recorded) when processing them failed the request."""
        if self.faults.failed and seq.request in self.faults:
            return False
        metrics = seq.request.metrics
        metrics.first_token_time = metrics.first_token_time or now
        metrics.last_token_time = now
        outcome.touched[seq.request.request_id] = seq.request
        if seq.is_finished:
            outcome.finished.append(seq)
        return True

    def _record_prompt_logprobs(self, scheduled: list[ScheduledSeq], result: PromptLogprobsOutput) -> None:
        """Each scored row's entry joins its request's prompt_logprobs (index = prompt position of the token);
        a chunk recomputed after preemption finds its entries already there and adds nothing."""
        row, decode = 0, self._token_text
        for item in scheduled:
            seq = item.seq
            for position in prompt_positions(seq, seq.num_computed_tokens, item.num_new_tokens):
                entries, token = seq.request.prompt_logprobs, seq.token_ids[position + 1]
                if len(entries) == position + 1:
                    entry = {token: Logprob(result.logprobs[row], result.ranks[row], decode(token))}
                    for rank, (tid, lp) in enumerate(zip(result.top_ids[row], result.top_logprobs[row]), start=1):
                        entry.setdefault(tid, Logprob(lp, rank, decode(tid)))
                    entries.append(entry)
                row += 1

    def _record_scheduled(self, item: ScheduledSeq, now: float) -> None:
        """Statistics of a scheduled chunk (read before the scheduler counts it as computed)."""
        seq, start = item.seq, item.seq.num_computed_tokens
        self.stats.prompt_tokens_total += max(0, min(start + item.num_new_tokens, seq.num_prompt_tokens) - start)
        request = seq.request
        if request.metrics.first_scheduled_time is None:
            request.metrics.first_scheduled_time = now
            request.num_cached_tokens = start

    def append_token(self, seq: Sequence, token: int, logprob: float | None,
                     top: dict[int, Logprob] | None) -> None:
        """Every generated token joins its sequence here, sampled or a beam's; sampled ones are then
        detokenized and checked against the stop rules (beams are decoded once, at the end)."""
        seq.append_token(token, logprob, top)
        if seq.grammar is not None:
            seq.grammar.accept(token)
        if seq.request.beam is None:
            self._check_stop(seq, token, seq.detokenizer.add_token(token))

    def _top_logprobs(self, seq: Sequence, i: int, result: SamplerOutput) -> dict[int, Logprob]:
        """Row i's top log-probs entry (a sequence that asked for logprobs; `process` calls it only then)."""
        return self._top_entry(seq, result.token_ids[i], result.logprobs[i], result.ranks[i], result.top_ids[i],
                               result.top_logprobs[i])

    def _token_text(self, token: int) -> str:
        return self.decode([token], skip_special_tokens=False)

    def _top_entry(self, seq: Sequence, token: int, logprob: float, rank: int, top_ids: list[int],
                   top_logprobs: list[float]) -> dict[int, Logprob]:
        decode, k = self._token_text, seq.params.logprobs
        top = {token: Logprob(logprob, rank, decode(token))}
        for r, (tid, lp) in enumerate(zip(top_ids[:k], top_logprobs[:k]), start=1):
            top.setdefault(tid, Logprob(lp, r, decode(tid)))
        return top

    def _advance_beams(self, beams: list[Sequence], result, outcome: StepOutcome) -> None:
        """Record each beam's top next-token log-probs; once a request has all of them, its next beams fork
        off the surviving parents and the old beams end."""
        groups: dict[str, Request] = {}
        for seq, logprobs, ids in zip(beams, result.beam_logprobs, result.beam_ids):
            seq.request.beam.pending[seq.index] = (logprobs, ids)
            groups[seq.request.request_id] = seq.request
        for request in groups.values():
            with self.faults.guard(request, "advancing its beam search"):
                self._advance_beam_group(request, outcome)

    def _advance_beam_group(self, request: Request, outcome: StepOutcome) -> None:
        """One request's next beams; the outcome changes only once all of them are made (a fault midway
        leaves nothing half-forked)."""
        group = request.beam
        if not group.ready():
            return
        old, children, forks = request.seqs, [], []
        for index, cand in enumerate(group.advance([s.token_ids for s in old])):
            parent = old[cand.parent]
            child = Sequence(request, index, parent.token_ids, None)
            self.append_token(child, cand.token, 0.0, None)
            forks.append((parent, [child]))
            children.append(child)
        request.seqs = children
        for seq in old:
            seq.status = SequenceStatus.FINISHED
        outcome.forks += forks
        outcome.finished += old
        self.stats.generation_tokens_total += len(request.seqs)
        if group.done:
            request.metrics.finished_time = time.time()
            outcome.touched[request.request_id] = request

    def _check_stop(self, seq: Sequence, token: int, new_text: str) -> None:
        p = seq.params
        n_out = seq.num_output_tokens
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                return self.finish(seq, "stop", token)
            if token in p.stop_token_ids:
                return self.finish(seq, "stop", token)
            if new_text and p.stop_strings:  # no call per token for a request without stop strings
                stop = seq.detokenizer.find_stop(len(new_text))
                if stop is not None:
                    return self.finish(seq, "stop", stop)
        if seq.grammar is not None and (seq.grammar.terminated or seq.grammar.rejected):
            return self.finish(seq, "stop", token)  # the grammar is complete: nothing more may follow
        if (p.max_tokens is not None and n_out >= p.max_tokens) or seq.num_tokens >= self.max_model_len:
            self.finish(seq, "length")

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        seq.status, seq.finish_reason, seq.stop_reason = SequenceStatus.FINISHED, reason, stop_reason
        if reason == "length" or isinstance(stop_reason, int):
            seq.detokenizer.flush()
        if seq.request.finished:
            seq.request.metrics.finished_time = time.time()

    # ---- outputs -----------------------------------------------------------------------------------

    def make_output(self, request: Request) -> RequestOutput | PoolingRequestOutput:
        if request.pooling is not None:
            return PoolingRequestOutput(request.request_id, request.prompt, request.prompt_token_ids,
                                        EmbeddingOutput(request.pooling.embedding), request.finished,
                                        request.metrics, request.num_cached_tokens)
        if request.beam is not None:
            return self._make_beam_output(request)
        outputs = []
        seqs = request.seqs if len(request.seqs) == 1 else sorted(request.seqs, key=lambda s: s.index)
        for seq in seqs:
            done = seq.is_finished
            outputs.append(CompletionOutput(
                index=seq.index, text=seq.detokenizer.visible_text(done), token_ids=seq.output_token_ids,
                cumulative_logprob=seq.cumulative_logprob, logprobs=seq.logprobs,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason))
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, outputs,
                             request.finished, request.metrics, request.num_cached_tokens, request.prompt_logprobs)

    def _make_beam_output(self, request: Request) -> RequestOutput:
        n, max_tokens = request.num_prompt_tokens, request.params.max_tokens
        outputs = []
        for i, (_, tokens, cum) in enumerate(request.beam.finished):
            text = self.tokenizer.decode(tokens[n:], skip_special_tokens=True)
            reason = "length" if len(tokens) - n >= max_tokens else "stop"
            outputs.append(CompletionOutput(i, text, tokens[n:], cum, None, reason))
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, outputs, True,
                             request.metrics, request.num_cached_tokens)
