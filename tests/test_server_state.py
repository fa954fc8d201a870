"""Engine-state encoding (docs/engine-state.md) and the AsyncEngine's thread protocol, with fakes.

Prints the size of a 50,000-block snapshot: run with -s to see it.
"""
from __future__ import annotations

import asyncio
import json
import threading

import numpy as np
import pytest

from engine.entrypoints.async_engine import AsyncEngine, EngineDeadError
from engine.config.flags import EngineConfig
from engine.core.outputs import BlockPoolSnapshot, CompletionOutput, EngineStats, RequestOutput, RequestState
from engine.sample.sampling_params import SamplingParams
from engine.entrypoints.openai.engine_state import RawState, build_state, unpack_blocks


def realistic_snapshot(num_blocks: int, num_requests: int, seed: int = 0) -> BlockPoolSnapshot:
    """A pool after churn: ~60% in use by requests in scattered runs, ~20% cached-free, shared prefixes."""
    rng = np.random.default_rng(seed)
    state = np.zeros(num_blocks, np.uint8)
    ref_count = np.zeros(num_blocks, np.int32)
    owner = np.full(num_blocks, -1, np.int32)
    order = rng.permutation(num_blocks)  # allocation order after churn is far from contiguous
    pos = 0
    for k in range(num_requests):
        run = int(rng.integers(1, 2 * 0.6 * num_blocks / num_requests))
        while run > 0 and pos < num_blocks:  # runs of consecutive ids, as fresh allocations tend to be
            start = int(order[pos])
            length = min(run, int(rng.integers(1, 16)), num_blocks - start)
            ids = np.arange(start, start + length)
            ids = ids[state[ids] == 0]
            state[ids], ref_count[ids], owner[ids] = 1, 1, k
            run -= max(len(ids), 1)
            pos += 1
    shared = rng.choice(np.flatnonzero(state == 1), size=int(0.05 * num_blocks), replace=False)
    ref_count[shared] = rng.integers(2, 9, size=len(shared))
    free = np.flatnonzero(state == 0)
    cached = rng.choice(free, size=min(len(free), int(0.2 * num_blocks)), replace=False)
    state[cached] = 2
    ids = [f"cmpl-{k:032x}" for k in range(num_requests)]
    counts = np.bincount(owner[owner >= 0], minlength=num_requests)
    rows = [RequestState(rid, "running", int(c), 100, 100 + 7, 7) for rid, c in zip(ids, counts)]
    return BlockPoolSnapshot(state, ref_count, owner, ids, rows + [RequestState("waiting-1", "waiting", 0, 30, 0, 0)])


def raw_state(snapshot: BlockPoolSnapshot) -> RawState:
    stats = EngineStats(num_running=len(snapshot.owner_ids), num_blocks=len(snapshot.state), block_size=16,
                        prefix_cache_queries=100, prefix_cache_hits=25)
    return RawState(snapshot, stats, {"weights_bytes": 10, "kv_cache_bytes": 20}, "cpu")


def test_state_round_trips_and_fits_50k_blocks():
    snapshot = realistic_snapshot(50_000, 256)
    state = build_state(raw_state(snapshot), "tiny", (1.5, 2.5))
    body = json.dumps(state, separators=(",", ":")).encode()
    decoded = json.loads(body)
    s, ref, owner = unpack_blocks(decoded["blocks"], decoded["num_blocks"])
    assert np.array_equal(s, snapshot.state)
    assert np.array_equal(ref, np.minimum(snapshot.ref_count, 255))
    assert np.array_equal(owner.astype(np.int64) - 1, snapshot.owner)
    rows = decoded["requests"]
    assert [r["id"] for r in rows[:256]] == snapshot.owner_ids and rows[-1]["status"] == "waiting"
    assert sum(r["num_blocks"] for r in rows) == int((snapshot.owner >= 0).sum())
    assert decoded["prefix_cache_hit_rate"] == 0.25 and decoded["memory"]["kv_cache_bytes"] == 20
    print(f"\n50,000-block snapshot: blocks field {len(state['blocks'])} B (raw {4 * 50_000} B), "
          f"whole JSON {len(body)} B with {len(rows)} requests")
    assert len(body) < 200_000


def test_empty_pool_compresses_to_almost_nothing():
    n = 50_000
    snapshot = BlockPoolSnapshot(np.zeros(n, np.uint8), np.zeros(n, np.int32), np.full(n, -1, np.int32), [])
    state = build_state(raw_state(snapshot), "tiny", (0.0, 0.0))
    assert len(state["blocks"]) < 1000


class FakeEngine:
    """Emits one token per step per request; `fail_on_step` makes step() raise."""

    dead_while_idle = False

    def __init__(self, config):
        self.config, self.requests, self.aborted, self.fail_on_step = config, {}, [], None
        self.steps = 0

    def add_request(self, request_id, prompt, params, arrival_time=None, cache_salt=None, priority=0, pooling=None):
        if not prompt:
            raise ValueError("prompt is empty")
        self.requests[request_id] = (prompt, params, [])

    def abort_request(self, request_id):
        self.aborted.append(request_id)
        self.requests.pop(request_id, None)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        self.steps += 1
        if self.fail_on_step is not None and self.steps >= self.fail_on_step:
            raise RuntimeError("boom")
        outs = []
        for rid, (prompt, params, tokens) in list(self.requests.items()):
            tokens.append(7)
            done = len(tokens) >= params.max_tokens
            outs.append(RequestOutput(rid, None, prompt, [CompletionOutput(
                0, "x" * len(tokens), list(tokens), None, None, "length" if done else None)], done))
            if done:
                del self.requests[rid]
        return outs

    def get_stats(self):
        return EngineStats(num_running=len(self.requests))

    def check_health(self):
        if self.dead_while_idle:
            raise RuntimeError("worker rank 1 died")

    def shutdown(self):
        pass


@pytest.fixture
def fake_engine():
    holder = {}

    def factory(config):
        holder["engine"] = FakeEngine(config)
        return holder["engine"]

    engine = AsyncEngine(EngineConfig(model="fake"), factory)
    engine.start()
    assert engine.wait_until_loaded(5)
    yield engine, holder["engine"]
    engine.shutdown()


def test_async_engine_streams_refuses_and_aborts(fake_engine):
    engine, fake = fake_engine

    async def run():
        stream = await engine.add_request("a", [1, 2], SamplingParams(max_tokens=3))
        outs = [o async for o in stream]
        counts = [len(o.outputs[0].token_ids) for o in outs]  # a reader that lags gets the newest output only
        assert counts == sorted(set(counts)) and counts[-1] == 3 and outs[-1].finished
        with pytest.raises(ValueError, match="empty"):
            await engine.add_request("b", [], SamplingParams())
        stream = await engine.add_request("c", [1], SamplingParams(max_tokens=10_000))
        await stream.__anext__()
        stream.close()
        for _ in range(100):
            if "c" in fake.aborted:
                break
            await asyncio.sleep(0.01)
        assert "c" in fake.aborted and not fake.requests

    asyncio.run(run())


def test_step_exception_marks_engine_dead(fake_engine):
    engine, fake = fake_engine

    async def run():
        fake.fail_on_step = fake.steps + 2
        stream = await engine.add_request("a", [1], SamplingParams(max_tokens=50))
        with pytest.raises(EngineDeadError, match="boom"):
            async for _ in stream:
                pass
        assert engine.status == "dead" and "boom" in engine.error
        with pytest.raises(EngineDeadError):
            await engine.add_request("b", [1], SamplingParams())

    asyncio.run(run())
    engine._thread.join(10)  # the thread ends right after failing the streams; wait for it, not for luck
    assert not engine._thread.is_alive()


def test_worker_death_while_idle_marks_engine_dead(fake_engine):
    engine, fake = fake_engine
    fake.dead_while_idle = True
    for _ in range(200):  # the idle engine thread checks health every IDLE_WAIT_S
        if engine.status == "dead":
            break
        threading.Event().wait(0.02)
    assert engine.status == "dead" and "worker rank 1 died" in engine.error


def test_load_failure_is_reported_not_raised():
    def factory(config):
        raise MemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    engine = AsyncEngine(EngineConfig(model="fake"), factory)
    engine.start()
    assert engine.wait_until_loaded(5)
    assert engine.status == "dead" and isinstance(engine.load_error, MemoryError)
