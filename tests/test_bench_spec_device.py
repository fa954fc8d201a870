"""`pagedesk-bench spec --device` (issue 32): the speculative bench runs its engines on a card for the GPU figures,
with the wall clock (the CPU clock does not see the card's work)."""
from __future__ import annotations

import json

import pytest

from engine.bench import spec


def test_a_card_run_takes_the_wall_clock_and_the_device(monkeypatch, tmp_path, capsys):
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"vocab_size": 64}))
    monkeypatch.setattr(spec, "make_random_llama", lambda path: target)
    monkeypatch.setattr(spec, "make_layer_skip_draft", lambda t, out, layers: target)
    calls = []

    def fake_run(path, prompts, output_len, speculative, max_len, clock, tp, device):
        calls.append((speculative, clock, device))
        return {"tok_s": 1.0, "ids": [[0]]}
    monkeypatch.setattr(spec, "run", fake_run)
    spec.main(["--device", "cuda:1", "--methods", "off,ngram", "--batches", "1", "--prompt-len", "8",
               "--output-len", "4"])
    assert calls and all(clock is spec.CLOCKS["wall"] and device == "cuda:1" for _, clock, device in calls)
    assert "device cuda:1, wall clock" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        spec.main(["--device", "cuda", "--clock", "cpu"])
    assert "needs --clock wall" in capsys.readouterr().err
