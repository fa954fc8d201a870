"""100 concurrent streaming clients, a third of them hanging up mid-stream: the rest finish, every block
is freed, and a fresh request right after is served. A client that times out on a non-streaming request
gets its work aborted: the engine is held mid-request by a gate, so the request is still running when the
client leaves, however fast the machine. No test here asserts wall time."""
from __future__ import annotations

import asyncio
import threading
import time

import httpx
import openai
import pytest

from server_harness import MODEL_NAME, start_server
from engine.entrypoints.llm_engine import LLMEngine
from engine.entrypoints.openai.engine_state import unpack_blocks

NUM_CLIENTS = 100


class StepGate:
    """Holds the engine thread before each step while closed; `entered` is set once a step waits on it."""

    def __init__(self):
        self.open, self.entered = threading.Event(), threading.Event()
        self.open.set()

    def factory(self, config):
        engine = LLMEngine(config)
        step = engine.step

        def gated_step():
            if not self.open.is_set():
                self.entered.set()
                assert self.open.wait(60), "the test never reopened the step gate"
            return step()

        engine.step = gated_step
        return engine


@pytest.fixture(scope="module")
def gate():
    return StepGate()


@pytest.fixture(scope="module")
def server(llama_dir, gate):
    srv = start_server(llama_dir, engine_factory=gate.factory, num_gpu_blocks_override=256, max_num_seqs=64)
    yield srv
    gate.open.set()
    srv.stop()


async def _client(client: openai.AsyncOpenAI, i: int) -> tuple[str, int]:
    hang_up = i % 3 == 0
    stream = await client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": f"request number {i}: tell a story"}],
        max_tokens=200 if hang_up else 8, temperature=0.8, seed=i, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    received = 0
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            received += 1
        if hang_up and received >= 2:
            await stream.close()  # drops the connection mid-stream
            return "hung_up", received
        if not chunk.choices and chunk.usage:
            return "completed", chunk.usage.completion_tokens
    return "truncated", received


def _pool_state(server) -> dict:
    return httpx.get(server.base_url + "/engine/state", timeout=10).json()


def test_concurrent_streams_with_disconnects_free_every_block(server):
    async def run():
        limits = httpx.Limits(max_connections=NUM_CLIENTS + 10)
        async with httpx.AsyncClient(limits=limits, timeout=120) as http:
            client = openai.AsyncOpenAI(base_url=server.base_url, api_key="x", http_client=http, max_retries=0)
            return await asyncio.gather(*(_client(client, i) for i in range(NUM_CLIENTS)))

    started = time.monotonic()
    results = asyncio.run(run())
    elapsed = time.monotonic() - started
    kinds = [k for k, _ in results]
    assert kinds.count("hung_up") == len(range(0, NUM_CLIENTS, 3))
    assert kinds.count("completed") == NUM_CLIENTS - kinds.count("hung_up"), results
    assert all(n == 8 for k, n in results if k == "completed")

    deadline = time.monotonic() + 10
    while True:
        state = _pool_state(server)
        s, ref, owner = unpack_blocks(state["blocks"], state["num_blocks"])
        if not (s == 1).any() or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not (s == 1).any() and not ref.any() and not owner.any(), "blocks still held after every client left"
    assert state["requests"] == [] and state["kv_cache_usage"] == 0.0 and state["num_running"] == 0
    # aborted requests stopped early: far fewer tokens than 200 per hung-up client were generated
    assert state["generation_tokens_total"] < 0.5 * 34 * 200

    fresh = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0).completions.create(
        model=MODEL_NAME, prompt="fresh", max_tokens=4, temperature=0)
    assert fresh.usage.completion_tokens >= 1
    print(f"\n{NUM_CLIENTS} streaming clients in {elapsed:.1f} s")


def _streams_closed(server) -> bool:
    streams = list(server.async_engine._streams.values())
    return bool(streams) and all(s.closed for s in streams)


def test_non_streaming_client_timeout_aborts_request(server, gate):
    before = _pool_state(server)["generation_tokens_total"]
    gate.open.clear()  # the request is accepted, then the engine holds before its first step
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.base_url + "/completions",
                       json={"prompt": "long", "max_tokens": 240, "ignore_eos": True}, timeout=0.5)
        assert gate.entered.wait(30), "the request never reached the engine"
        deadline = time.monotonic() + 30
        while not _streams_closed(server):  # the server noticed the client left and aborted the request
            assert time.monotonic() < deadline, "the server never noticed the client went away"
            time.sleep(0.05)
    finally:
        gate.open.set()
    deadline = time.monotonic() + 10
    while _pool_state(server)["requests"] and time.monotonic() < deadline:
        time.sleep(0.05)
    state = _pool_state(server)
    assert state["requests"] == [] and state["kv_cache_usage"] == 0.0
    assert state["generation_tokens_total"] - before <= 1  # at most the step that was held at the gate
