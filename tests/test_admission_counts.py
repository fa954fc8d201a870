"""Admission counts every sequence a request will run: the n outputs it forks into and a beam search's beams.

Issue 19 item 1: children joined `running` uncounted, so max_num_seqs=2 with 4 requests of n=8 ran 16
sequences and drew 16 sampler rows (the KV sizing profiled the sampler at max_num_seqs rows). Each step is
watched from the runner's side: the running list and the sampling rows never exceed the cap, and the seeded
outputs are the ones each request gives alone.
"""
from __future__ import annotations

import pytest

from engine import LLM
from engine.core.beam_search import BeamSearchParams
from engine.sample.sampling_params import SamplingParams

PROMPTS = [[1, 5, 9, 13, 2, 7], [3, 4, 8], [11, 12, 6, 10, 14], [2, 3]]


def watch_steps(llm: LLM) -> list[tuple[int, int]]:
    """(running sequences, sampler + beam rows) of every step the engine runs from now on."""
    engine, seen = llm.engine, []
    execute = engine.runner.execute

    def counting(batch, block_copies, sampling=None, *rest):
        rows = 0 if sampling is None else len(sampling.rows) + len(sampling.beam_index)
        seen.append((len(engine.scheduler.running), rows))
        return execute(batch, block_copies, sampling, *rest)

    engine.runner.execute = counting
    return seen


def seeded(n: int, seed: int) -> SamplingParams:
    return SamplingParams(n=n, temperature=1.0, seed=seed, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def capped(llama_dir):
    return LLM(str(llama_dir), device="cpu", max_num_seqs=6)


def test_forks_count_against_max_num_seqs(capped, llama_dir):
    seen = watch_steps(capped)
    params = [seeded(4, seed) for seed in range(len(PROMPTS))]
    together = capped.generate(PROMPTS, params, use_tqdm=False)
    print("running, rows per step:", seen)
    assert max(running for running, _ in seen) <= 6 and max(rows for _, rows in seen) <= 6
    assert max(running for running, _ in seen) == 4  # a second n=4 request waits for the first
    alone = [capped.generate([p], [q], use_tqdm=False)[0] for p, q in zip(PROMPTS, params)]
    for a, b in zip(together, alone):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
        assert len(a.outputs) == 4


def test_beams_count_against_max_num_seqs(capped):
    seen = watch_steps(capped)
    beams = BeamSearchParams(beam_width=4, max_tokens=5)
    together = capped.beam_search(PROMPTS[:3], beams)
    assert max(running for running, _ in seen) <= 6 and max(rows for _, rows in seen) <= 6
    alone = [capped.beam_search([p], beams)[0] for p in PROMPTS[:3]]
    assert [[s.tokens for s in o.sequences] for o in together] == [[s.tokens for s in o.sequences] for o in alone]


def test_a_request_wider_than_max_num_seqs_is_refused(capped):
    with pytest.raises(ValueError, match=r"n \(8\) is more than max_num_seqs \(6\)"):
        capped.engine.add_request("wide", [1, 2, 3], SamplingParams(n=8))
    with pytest.raises(ValueError, match=r"beam_width \(8\) is more than max_num_seqs \(6\)"):
        capped.engine.add_beam_request("wide", [1, 2, 3], BeamSearchParams(beam_width=8, max_tokens=4))
    assert not capped.engine.requests and not capped.engine.scheduler.waiting


def test_api_answers_400_for_n_over_max_num_seqs(llama_dir):
    import httpx
    from server_harness import MODEL_NAME, start_server
    server = start_server(llama_dir, max_num_seqs=4)
    try:
        for body in ({"n": 8}, {"n": 8, "use_beam_search": True}):
            reply = httpx.post(f"{server.base_url}/completions", timeout=30,
                               json={"model": MODEL_NAME, "prompt": "hello", "max_tokens": 3, **body})
            assert reply.status_code == 400, reply.text
            assert "more than max_num_seqs (4)" in reply.json()["error"]["message"]
        ok = httpx.post(f"{server.base_url}/completions", timeout=60,
                        json={"model": MODEL_NAME, "prompt": "hello", "max_tokens": 3, "n": 4})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 4
    finally:
        server.stop()
