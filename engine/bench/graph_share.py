"""How much of a serving run CUDA graphs could cover: the real scheduler on the bench workload, no model.

`python -m engine.bench.graph_share` drives `Scheduler` over `sharegpt_like` requests (each step's sampled
token is a dummy; a sequence ends at its drawn output length) under the serving defaults on CUDA (256
sequences, a 2048-token budget, chunked prefill, no prefill cap) and a KV pool of a 24 GB card serving an 8B
model in bf16, for a burst (every request at once, as `pagedesk-bench throughput`) and for steady arrivals.
It counts steps that are pure decode (graphed today), steps that mix prompt chunks with decodes (eager
today), and the decode tokens inside the mixed steps, which a split into a graphed decode launch plus an
eager prefill launch would move onto graphs. It prints a table for docs/gpu.md; nothing here needs a GPU.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from engine.bench.workload import BenchRequest, sharegpt_like
from engine.kv.kv_cache_manager import KVCacheManager
from engine.sample.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.core.sequence import Request, Sequence, SequenceStatus

NUM_BLOCKS = 3584  # ~7 GiB of KV at 128 KiB per token (Llama-3-8B, bf16) in 16-token blocks: a 24 GB card


@dataclass
class StepCounts:
    decode_steps: int = 0  # only one-token decodes: what the decode graphs replay
    mixed_steps: int = 0  # prompt chunks and decodes together
    prefill_steps: int = 0  # prompt chunks only
    decode_tokens_pure: int = 0  # one-token queries (a prompt's last single-token chunk included)
    decode_tokens_mixed: int = 0  # decodes of mixed steps: graphable if the step is split
    prefill_tokens: int = 0

    @property
    def steps(self) -> int:
        return self.decode_steps + self.mixed_steps + self.prefill_steps


def simulate(requests: list[BenchRequest], arrival_every: int, max_num_seqs: int = 256,
             max_num_batched_tokens: int = 2048, num_blocks: int = NUM_BLOCKS) -> StepCounts:
    """Run the scheduler to completion; request i arrives at step i * arrival_every (0: all at once)."""
    sched = Scheduler(KVCacheManager(num_blocks, 16, True), max_num_seqs, max_num_batched_tokens, True, None)
    targets: dict[int, int] = {}
    pending = list(enumerate(requests))
    counts, step, live = StepCounts(), 0, 0
    while pending or live:
        while pending and pending[0][0] * arrival_every <= step:
            i, r = pending.pop(0)
            request = Request(f"r{i}", None, r.prompt_token_ids, SamplingParams(temperature=0), None, float(step))
            seq = Sequence(request, 0, r.prompt_token_ids, None)
            targets[seq.seq_id] = r.output_len
            sched.add(seq)
            live += 1
        out = sched.schedule()
        step += 1
        if not out.scheduled:
            continue
        decodes = sum(1 for s in out.scheduled if not s.is_prefill)
        prefill = sum(s.num_new_tokens for s in out.scheduled if s.is_prefill)
        counts.prefill_tokens += prefill
        if prefill == 0:
            counts.decode_steps += 1
            counts.decode_tokens_pure += decodes
        elif decodes:
            counts.mixed_steps += 1
            counts.decode_tokens_mixed += decodes
        else:
            counts.prefill_steps += 1
        finished = []
        for item in out.scheduled:
            if item.samples:
                item.seq.append_token(0, 0.0, None)
                if item.seq.num_output_tokens >= targets[item.seq.seq_id]:
                    item.seq.status = SequenceStatus.FINISHED
                    finished.append(item.seq)
        sched.update_from_output(out, [], finished)
        live -= len(finished)
    return counts


def table(num_prompts: int, seed: int) -> str:
    requests = sharegpt_like(num_prompts, 32000, 2048, seed)
    lines = ["| arrivals | steps | pure decode | mixed | prefill only | decode tokens in mixed steps | "
             "decode tokens graphed today |", "|---|---|---|---|---|---|---|"]
    for every, label in ((0, "all at once"), (1, "1 per step"), (2, "1 per 2 steps"), (8, "1 per 8 steps")):
        c = simulate(requests, every)
        decode_tokens = c.decode_tokens_pure + c.decode_tokens_mixed
        lines.append(f"| {label} | {c.steps} | {c.decode_steps} ({100 * c.decode_steps / c.steps:.0f}%) | "
                     f"{c.mixed_steps} ({100 * c.mixed_steps / c.steps:.0f}%) | {c.prefill_steps} | "
                     f"{c.decode_tokens_mixed} of {decode_tokens} "
                     f"({100 * c.decode_tokens_mixed / max(1, decode_tokens):.0f}%) | "
                     f"{100 * c.decode_tokens_pure / max(1, decode_tokens):.0f}% |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m engine.bench.graph_share", description=__doc__.split("\n")[0])
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(f"{args.num_prompts} ShareGPT-like requests (prompt mean 160, output mean 300 tokens), max_num_seqs 256, "
          f"2048-token budget, {NUM_BLOCKS} blocks of 16\n")
    print(table(args.num_prompts, args.seed))


if __name__ == "__main__":
    main()
