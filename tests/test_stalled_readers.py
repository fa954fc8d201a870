"""Readers that stop reading: their requests are paused (not scheduled, blocks kept) until they read, and
aborted with their blocks freed after --stream-idle-timeout; bystanders run to the end meanwhile.

Streams here are RequestStreams that are never iterated (what a route blocked on a full socket looks like
to the engine). Asserts counts and states: tokens generated, paused flags, free blocks, never wall time.
"""
from __future__ import annotations

import asyncio

from engine.entrypoints.async_engine import MAX_UNREAD_OUTPUTS, AsyncEngine, StreamIdleTimeout
from engine.sample.sampling_params import SamplingParams
from server_harness import tiny_config

STALLED = 6
MAX_TOKENS = 40


def _engine(llama_dir, **overrides) -> AsyncEngine:
    engine = AsyncEngine(tiny_config(llama_dir, num_gpu_blocks_override=64, **overrides))
    engine.start()
    assert engine.wait_until_loaded(120)
    return engine


async def _call(engine: AsyncEngine, fn):
    return await engine.call(fn)


def _generated(llm_engine, request_id: str) -> int:
    request = llm_engine.requests.get(request_id)
    return -1 if request is None else sum(s.num_output_tokens for s in request.seqs)


def test_stalled_readers_are_not_scheduled_until_they_read(llama_dir):
    engine = _engine(llama_dir, stream_idle_timeout=0)

    async def run():
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        stalled = [await engine.add_request(f"stalled-{i}", [5 + i, 6, 7], params) for i in range(STALLED)]
        bystander = await engine.add_request("bystander", [9, 10, 11], params)
        async for out in bystander:  # a reader that reads: it runs to the end while the others sit unread
            final = out
        assert len(final.outputs[0].token_ids) == MAX_TOKENS
        counts = await _call(engine, lambda e: [_generated(e, s.request_id) for s in stalled])
        assert all(0 < n <= MAX_UNREAD_OUTPUTS + 1 for n in counts), counts  # they stopped generating
        assert all(s.paused for s in stalled)
        again = await _call(engine, lambda e: [_generated(e, s.request_id) for s in stalled])
        assert again == counts  # and stay stopped (more steps ran in between: the call is queued after them)
        blocks_held = await _call(engine, lambda e: e.kv.pool.num_blocks - e.kv.pool.num_free_blocks)
        assert blocks_held > 0
        reader = stalled[0]  # one of them reads again: it resumes and finishes
        async for out in reader:
            final = out
        assert len(final.outputs[0].token_ids) == MAX_TOKENS and not reader.paused
        for s in stalled[1:]:
            s.close()
        free = await _call(engine, lambda e: (e.kv.pool.num_free_blocks, e.kv.pool.num_blocks, len(e.requests)))
        assert free == (free[1], free[1], 0)

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()


def test_a_reader_idle_past_the_timeout_is_aborted_and_its_blocks_freed(llama_dir):
    engine = _engine(llama_dir, stream_idle_timeout=0.2)

    async def run():
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        stalled = await engine.add_request("stalled", [5, 6, 7], params)
        while engine._streams:  # the engine thread ends it; the test waits on that state, not on a clock
            await asyncio.sleep(0.05)
        try:
            async for _ in stalled:
                pass
        except StreamIdleTimeout as exc:
            assert "--stream-idle-timeout" in str(exc)
        else:
            raise AssertionError("the idle stream was not ended")
        state = await _call(engine, lambda e: (e.kv.pool.num_free_blocks == e.kv.pool.num_blocks, len(e.requests)))
        assert state == (True, 0)
        ok = await engine.add_request("next", [5, 6], SamplingParams(temperature=0, max_tokens=3))
        async for out in ok:
            final = out
        assert len(final.outputs[0].token_ids) == 3

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()


def test_paused_requests_give_their_seats_and_blocks_to_readers(tiny_model_dir):
    """Two paused requests hold both seats (max_num_seqs 2) and most blocks: a third is admitted by preempting
    them to the back of the queue; resumed, they finish with the same greedy tokens as never paused."""
    from engine import LLM
    llm = LLM(str(tiny_model_dir("llama")), device="cpu", max_model_len=128, num_gpu_blocks_override=10,
              max_num_seqs=2)
    engine = llm.engine
    prompts = [[5, 6, 7] * 10, [8, 9, 10] * 10, [11, 12]]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    for i in (0, 1):
        engine.add_request(f"p{i}", prompts[i], params)
    for _ in range(3):
        engine.step()
    engine.pause_request("p0", True)
    engine.pause_request("p1", True)
    engine.add_request("reader", prompts[2], params)
    done = {}
    for _ in range(200):
        done.update({o.request_id: o for o in engine.step() if o.finished})
        if "reader" in done:
            break
    assert "reader" in done and not {"p0", "p1"} & set(done)
    assert engine.scheduler.num_preemptions >= 1
    engine.pause_request("p0", False)
    engine.pause_request("p1", False)
    for _ in range(300):
        done.update({o.request_id: o for o in engine.step() if o.finished})
        if not engine.has_unfinished_requests():
            break
    assert [done[r].outputs[0].token_ids for r in ("p0", "p1", "reader")] == expected
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks
