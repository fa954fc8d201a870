"""`pagedesk-bench prepare`: the model runner's own input preparation per decode step, without a model.

S sequences of B blocks each decode one token per step (a new block every block_size steps); the bench times
the runner's `prepare` (engine/worker/input_prep.py: what rank 0 does on the host before every forward), and
where the tree has a persistent input batch also the host side of getting the step's tables onto the device
(`step_tables`: the diff applied, the changed cells copied, the rows gathered). It prints the median and the best step (the best is the
fair figure on a loaded machine), the bytes of the pickled
`StepInputs` a tensor-parallel worker receives, and the sampler's metadata for the same rows (temperature and
top-p on all, penalties on every other one by default): built from the rows every step (`SamplingMetadata.build`, the only way in
older trees) or kept by the persistent `SamplingState`, which only counts each step's new tokens. It runs on older checkouts too (no input batch there), so the
same file measures before and after: `python -m engine.bench.prepare` from each tree.
"""
from __future__ import annotations

import argparse
import pickle
import statistics
import time
from types import SimpleNamespace

import torch

from engine.kv.block_pool import Block
from engine.kv.kv_cache_interface import FullAttentionSpec, KVCacheGroup, KVCacheLayout
from engine.sample.sampling_params import SamplingParams
from engine.core.scheduler import ScheduledSeq


def make_runner(block_size: int, max_model_len: int):
    """What the runner's `prepare` and `step_tables` run on, without weights or a cache: its InputPreparer, or in
    a tree from before it a ModelRunner with only what they read."""
    layout = KVCacheLayout((KVCacheGroup(FullAttentionSpec(block_size, 1, 1, 1), (0,)),), 1)
    try:
        from engine.worker.input_prep import InputPreparer
        return InputPreparer(layout, block_size, max_model_len, torch.device("cpu"))
    except ImportError:  # a tree from before the runner's split
        from engine.worker.model_runner import ModelRunner
    runner = ModelRunner.__new__(ModelRunner)
    runner.block_size, runner.device, runner.kv_layout = block_size, torch.device("cpu"), layout
    try:
        from engine.worker.input_batch import InputBatch
    except ImportError:  # a tree from before the input batch
        return runner
    runner.input_batch = InputBatch(1, -(-max_model_len // block_size), runner.device)
    return runner


class BenchSeq(SimpleNamespace):
    @property
    def block_table(self):
        return self.block_tables[0]


def make_seqs(num_seqs: int, num_blocks: int, block_size: int) -> list[BenchSeq]:
    request = SimpleNamespace(params=SamplingParams(), cache_salt=None, pooling=None)
    seqs, next_block = [], 1
    for i in range(num_seqs):
        tokens = (num_blocks - 1) * block_size + 1  # the last block has room for block_size - 1 more tokens
        table = [Block(next_block + j) for j in range(num_blocks)]
        next_block += num_blocks
        seqs.append(BenchSeq(seq_id=i, token_ids=[1] * tokens, num_tokens=tokens, num_prompt_tokens=1,
                                    num_computed_tokens=tokens - 1, block_tables=[table], table_edits={},
                                    request=request))
    return seqs


def decode_step(seqs, block_size: int, fresh: list[int]) -> None:
    """One token more per sequence; a sequence whose next slot opens a block gets one (as the KV manager)."""
    for seq in seqs:
        seq.token_ids.append(1)
        seq.num_tokens += 1
        seq.num_computed_tokens += 1
        if seq.num_computed_tokens % block_size == 0:
            fresh[0] += 1
            seq.block_tables[0].append(Block(fresh[0]))


VOCAB = 32_000


def sampling_rows(seqs, penalized_every: int) -> list:
    """One row per sequence, keyed by its id where the tree's SamplingRow has keys; every `penalized_every`-th
    with penalties (0: none)."""
    from engine.sample.metadata import SamplingRow
    rows = []
    for i, seq in enumerate(seqs):
        pen = penalized_every and i % penalized_every == penalized_every - 1
        params = SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.1 if pen else 1.0,
                                presence_penalty=0.2 if pen else 0.0)
        try:
            rows.append(SamplingRow(params, seq.token_ids, seq.num_prompt_tokens, None, [0], seq.seq_id))
        except TypeError:  # a tree from before the persistent sampling state
            rows.append(SamplingRow(params, seq.token_ids, seq.num_prompt_tokens, None, [0]))
    return rows


def sampling_metadata(rows, state):
    from engine.sample.state import SamplingMetadata
    if state is None:
        return SamplingMetadata.build(rows, VOCAB, torch.device("cpu"))
    return state.metadata(rows)


def measure(num_seqs: int, num_blocks: int, block_size: int, steps: int, penalized_every: int = 2):
    """(median, best) ms of prepare, the same with the tables on the device, the pickled bytes, and (median,
    best) ms of the sampling metadata, each persistent state's or rebuilt."""
    runner = make_runner(block_size, (num_blocks + steps // block_size + 2) * block_size)
    seqs = make_seqs(num_seqs, num_blocks, block_size)
    fresh = [10 ** 7]
    rows = sampling_rows(seqs, penalized_every)
    try:
        from engine.sample.state import SamplingState
        state = SamplingState(VOCAB, torch.device("cpu"), num_seqs)
    except ImportError:
        state = None
    prepare_ms, device_ms, sizes, rebuilt_ms, kept_ms = [], [], [], [], []
    for step in range(steps + 5):
        batch = [ScheduledSeq(s, 1) for s in seqs]
        t0 = time.perf_counter()
        inputs = runner.prepare(batch, [])
        t1 = time.perf_counter()
        if hasattr(runner, "step_tables"):
            runner.step_tables(inputs)
        else:
            torch.from_numpy(inputs.block_tables).to(runner.device)
        t2 = time.perf_counter()
        sampling_metadata(rows, None)
        t3 = time.perf_counter()
        if state is not None:
            sampling_metadata(rows, state)
        t4 = time.perf_counter()
        if step >= 5:  # warm-up first
            prepare_ms.append(1e3 * (t1 - t0))
            device_ms.append(1e3 * (t2 - t0))
            sizes.append(len(pickle.dumps(inputs)))
            rebuilt_ms.append(1e3 * (t3 - t2))
            kept_ms.append(1e3 * (t4 - t3))
        decode_step(seqs, block_size, fresh)
    return ((statistics.median(prepare_ms), min(prepare_ms)), (statistics.median(device_ms), min(device_ms)),
            int(statistics.median(sizes)), (statistics.median(rebuilt_ms), min(rebuilt_ms)),
            (statistics.median(kept_ms), min(kept_ms)) if state is not None else None)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pagedesk-bench prepare", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="64x2048,64x256,256x256,256x2048",
                        help="comma-separated SEQSxBLOCKS decode batches")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--penalized-every", type=int, default=2,
                        help="every N-th sequence has repetition and presence penalties (0: none)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the engine's host work is one thread; a loaded machine stalls torch's thread pool
    print("| sequences × blocks | prepare ms/step, median (best) | + tables on the device | pickled StepInputs "
          "| sampling metadata rebuilt | sampling metadata kept |")
    print("|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        seqs, blocks = (int(x) for x in shape.split("x"))
        prep, dev, size, rebuilt, kept = measure(seqs, blocks, args.block_size, args.steps,
                                                 args.penalized_every)
        kept_text = f"{kept[0]:.2f} ({kept[1]:.2f})" if kept is not None else "—"
        print(f"| {seqs} × {blocks} | {prep[0]:.2f} ({prep[1]:.2f}) | {dev[0]:.2f} ({dev[1]:.2f}) | "
              f"{size / 1024:.1f} KiB | {rebuilt[0]:.2f} ({rebuilt[1]:.2f}) | {kept_text} |", flush=True)


if __name__ == "__main__":
    main()
