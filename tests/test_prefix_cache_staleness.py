"""Prefix caching never serves a block whose K/V was not computed, even when the sequence that filled it is
preempted in the very step that scheduled the fill (issue 10 §3)."""
from __future__ import annotations

from engine import LLM, SamplingParams
from engine.kv.kv_cache_manager import KVCacheManager
from engine.sample.sampling_params import SamplingParams as Params
from engine.core.scheduler import Scheduler
from engine.core.sequence import Request, Sequence, SequenceStatus
from hf_reference import hf_greedy


def running_seq(kv: KVCacheManager, tokens: list[int], num_computed: int) -> Sequence:
    """A running sequence whose first `num_computed` tokens already have K/V in the cache."""
    request = Request(f"r{tokens[0]}", None, tokens, Params(temperature=0), None, 0.0)
    seq = Sequence(request, 0, tokens, None)
    assert kv.allocate_slots(seq, num_computed)
    seq.num_computed_tokens = num_computed
    seq.status = SequenceStatus.RUNNING
    return seq


def test_block_filled_by_a_decode_preempted_in_the_same_step_is_not_cached():
    kv = KVCacheManager(num_blocks=5, block_size=4, enable_caching=True)
    scheduler = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, enable_chunked_prefill=True)
    other = running_seq(kv, [50, 51, 52, 53, 54, 55], 5)  # decodes inside its second block
    prompt = list(range(100, 140))
    chunking = running_seq(kv, prompt, 4)  # 36 prompt tokens left: needs 9 more blocks
    filler = running_seq(kv, [1, 2, 3, 4, 5, 6, 7, 8], 7)  # its decode fills its second block
    assert kv.pool.num_free_blocks == 0
    scheduler.running = [other, chunking, filler]
    computed_block, stale = filler.block_table

    out = scheduler.schedule()

    # The decodes went first; the chunk found no room, preempted the filler (scheduled earlier in this step,
    # so its block was never written), then itself.
    assert [s.seq for s in out.scheduled] == [other]
    assert filler.status is SequenceStatus.WAITING and chunking.status is SequenceStatus.WAITING
    twin = Sequence(Request("twin", None, [1, 2, 3, 4, 5, 6, 7, 8, 9], Params(), None, 0.0), 0,
                    [1, 2, 3, 4, 5, 6, 7, 8, 9], None)
    hits = kv.get_computed_blocks(twin)
    assert hits.blocks == ([computed_block],)  # the filler's first block was computed in an earlier step: still a hit
    assert stale.block_hash is None and kv.pool.lookup(twin.block_hashes[1]) is None


def test_greedy_parity_under_prefix_caching_preemption_and_chunked_prefill(tiny_model_dir):
    """Shared prefixes, a pool far too small and a small token budget: preemptions happen mid-step, prefix hits
    follow them, and every output still equals HF's."""
    path = tiny_model_dir("llama")
    shared = [(i * 7) % 300 + 5 for i in range(30)]
    prompts = [shared + [(i * 13 + j) % 300 + 5 for j in range(3 + 5 * i)] for i in range(6)]
    max_tokens = [24] * len(prompts)
    expected = hf_greedy(path, prompts, max_tokens)
    llm = LLM(str(path), device="cpu", num_gpu_blocks_override=14, block_size=8, max_num_seqs=6,
              max_num_batched_tokens=24)
    params = [SamplingParams(temperature=0, max_tokens=n) for n in max_tokens]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.kv.prefix_hits > 0
    assert got == expected
