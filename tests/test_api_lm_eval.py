"""lm-eval's `local-completions` loglikelihood (echo + logprobs + max_tokens 0 against our server) gives the same
per-choice log-likelihoods as lm-eval's HF backend on the same tiny model, for a task read from a local file."""
from __future__ import annotations

import json
import math

import pytest

from server_harness import start_server

ROWS = [{"question": "The quick brown fox", "choices": [" jumps", " sleeps over", " runs"], "answer": 0},
        {"question": "numbers 0 1 2", "choices": [" 3", " 4 5", " cat"], "answer": 0},
        {"question": "PagedAttention splits", "choices": [" the KV cache", " nothing"], "answer": 0}]
TASK = """task: tinychoice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def _loglikelihoods(lm_eval, model: str, model_args: str, task_manager) -> list[float]:
    result = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["tinychoice"],
                                     task_manager=task_manager, log_samples=True)
    return [ll for sample in result["samples"]["tinychoice"] for ll, _ in sample["filtered_resps"]]


def test_local_completions_loglikelihood_equals_hf(tiny_model_dir, tmp_path, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval")
    pytest.importorskip("accelerate")
    from lm_eval.tasks import TaskManager
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    path = tiny_model_dir("qwen2")
    (tmp_path / "data.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS))
    (tmp_path / "tinychoice.yaml").write_text(TASK.format(data=tmp_path / "data.jsonl"))
    tasks = TaskManager(include_path=str(tmp_path))
    server = start_server(path)
    try:
        api = _loglikelihoods(lm_eval, "local-completions",
                              f"model=tiny,base_url={server.base_url}/completions,tokenizer={path},"
                              "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1", tasks)
    finally:
        server.stop()
    hf = _loglikelihoods(lm_eval, "hf", f"pretrained={path},dtype=float32,device=cpu", tasks)
    assert len(api) == len(hf) == sum(len(r["choices"]) for r in ROWS)
    assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(api, hf)), (api, hf)
