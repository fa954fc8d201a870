"""Device sampling: the tail of a step, from the forward's hidden states to the small results the host gets back.

`DeviceSampler.prepare` makes the sampler's device tensors for a step before its forward (asynchronous copies,
from rank 0's persistent `SamplingState`); `finish` computes logits only at the rows that need them, samples them
on the device (engine/sample/sampler.py), takes beam rows' top log-probs, verifies speculative drafts
(engine/sample/rejection_sampler.py), scores prompt tokens (prompt_logprobs) and pools embedding requests, and
returns a `ModelRunnerOutput`: never a `[batch, vocab]` tensor to the host. Under tensor parallel every rank
computes the logits (the LM head's all-gather pairs up) and its share of the prompt logprobs; only rank 0, which
has a sampling batch, samples. `sample` is the same path over given logits (the KV sizing's profiling step).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.platform.host_copies import to_device
from engine.sample.metadata import SamplingBatch
from engine.sample.pooling import pool_hidden
from engine.sample.prompt_logprobs import compute_prompt_logprobs
from engine.sample.rejection_sampler import prepare_verify, verify_drafts
from engine.sample.sampler import beam_top_logprobs, sample_on_device
from engine.sample.state import FIRST_ROWS, SamplingMetadata, SamplingState
from engine.worker.step_inputs import ModelRunnerOutput, StepInputs


@dataclass(slots=True)
class PreparedSampling:
    """A SamplingBatch's device tensors, made before the forward."""

    batch: SamplingBatch
    meta: SamplingMetadata | None = None
    rows_index: torch.Tensor | None = None  # logits row of each sampling row; None: row i reads logits row i
    beam_index: torch.Tensor | None = None
    spec: tuple | None = None  # speculative verify rows' (SamplingMetadata, logits index)


def prepare_sampling(sampling: SamplingBatch, vocab_size: int, dev: torch.device,
                     state: SamplingState | None = None) -> PreparedSampling:
    """The sampler's device tensors for a step, made before its forward (asynchronous copies), from `state`
    (rank 0's persistent one; None: a throwaway one for these rows alone)."""
    prepared = PreparedSampling(sampling)
    if sampling.rows:
        state = state or SamplingState(vocab_size, dev, len(sampling.rows))
        prepared.meta = state.metadata(sampling.rows, sampling.bitmask)
        index = sampling.logits_index
        if any(i != row for row, i in enumerate(index)):  # else the logits' first rows are read in place, no gather
            prepared.rows_index = to_device(torch.tensor(index, dtype=torch.long), dev)
    if sampling.beam_index:
        prepared.beam_index = to_device(torch.tensor(sampling.beam_index, dtype=torch.long), dev)
    if sampling.spec is not None:
        prepared.spec = prepare_verify(sampling.spec, vocab_size, dev)
    return prepared


def sample(logits: torch.Tensor, sampling: SamplingBatch) -> ModelRunnerOutput:
    """Draw the batch's tokens and take beam rows' top log-probs, all on the logits' device."""
    return sample_prepared(logits, prepare_sampling(sampling, logits.shape[1], logits.device))


def sample_prepared(logits: torch.Tensor, prepared: PreparedSampling, defer: bool = False) -> ModelRunnerOutput:
    """The step's draws; with `defer` their copy to the host is started, not waited for (`ModelRunnerOutput.result`)."""
    out, sampling = ModelRunnerOutput(), prepared.batch
    if prepared.meta is not None:
        rows = logits if prepared.rows_index is None else logits[prepared.rows_index]
        if rows.shape[0] != len(sampling.rows):  # logits past the sampling rows (a verify step's, a beam's)
            rows = rows.narrow(0, 0, len(sampling.rows))
        tokens = sample_on_device(rows, prepared.meta, sampling.generator, sampling.chosen_logprobs)
        if defer:
            out.pending = tokens.start_host_copy()
        else:
            out.sampled = tokens.to_host()
    if prepared.spec is not None:
        out.spec = verify_drafts(logits, sampling.spec, sampling.generator, prepared.spec)
    if prepared.beam_index is not None:
        values, ids = beam_top_logprobs(logits[prepared.beam_index], sampling.beam_topk)
        # One copy; token ids < 2**53 stay exact in float64.
        out.beam_logprobs, ids = torch.stack([values.double(), ids.double()]).cpu().tolist()
        out.beam_ids = [[int(t) for t in row] for row in ids]
    return out


class DeviceSampler:
    """One runner's sampling side: `prepare` before the forward, `finish` after it."""

    def __init__(self, model, vocab_size: int, device: torch.device) -> None:
        self.model, self.vocab_size, self.device = model, vocab_size, device
        # Rank 0's per-row sampling parameters and penalty counts, made at its first sampling step (a
        # tensor-parallel worker never samples, so never holds one).
        self.sampling_state: SamplingState | None = None
        self.max_rows = 0  # max_num_seqs once the engine reserved its rows

    def prepare(self, inputs: StepInputs, sampling: SamplingBatch | None) -> PreparedSampling | None:
        """Before the forward: the sampler's tensors of a step that samples, None otherwise."""
        if sampling is None or not inputs.logits_rows:
            return None
        if self.sampling_state is None:
            # Rows and penalty slots for max_num_seqs: what the memory profile's sampler step held.
            self.sampling_state = SamplingState(self.vocab_size, self.device, self.max_rows or FIRST_ROWS)
        return prepare_sampling(sampling, self.vocab_size, self.device, self.sampling_state)

    def finish(self, hidden: torch.Tensor, inputs: StepInputs, logits_index: torch.Tensor | slice | None,
               prepared: PreparedSampling | None, sampling: SamplingBatch | None,
               defer: bool = False) -> ModelRunnerOutput | None:
        """The step's results from its hidden states; None on a tensor-parallel worker (no `sampling`). With
        `defer`, the sampled tokens' host copy is only started (async scheduling)."""
        rank0 = sampling is not None
        prompt_logprobs = None
        if inputs.prompt_logits_rows:
            prompt_logprobs = compute_prompt_logprobs(hidden, inputs.prompt_logits_rows, inputs.prompt_targets,
                                                      inputs.prompt_logprobs_k, self.model.compute_logits,
                                                      reduce=rank0)
        pooled = pool_hidden(hidden, inputs.pool_owners, inputs.pool_spans) if inputs.pool_spans and rank0 else None
        if logits_index is None:
            return ModelRunnerOutput(prompt_logprobs=prompt_logprobs, pooled=pooled) if rank0 else None
        if not (isinstance(logits_index, slice) and logits_index == slice(0, hidden.shape[0])):
            hidden = hidden[logits_index]  # else every row samples: no slice op (a batch-1 decode's)
        logits = self.model.compute_logits(hidden)
        if not rank0:
            return None
        out = sample_prepared(logits, prepared, defer)
        out.prompt_logprobs, out.pooled = prompt_logprobs, pooled
        return out
