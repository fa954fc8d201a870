"""The GPU machine's bare environment: what installer/gpu-check.sh runs must import without the desktop stack.

The first-GPU-run machine has Python, torch, triton, transformers, safetensors, tokenizers, numpy, tqdm,
jinja2, pytest, httpx, nvidia-ml-py and prometheus-client, and nothing else. Each check here runs in a
subprocess whose `sitecustomize` refuses every import of the packages that machine lacks (the web stack,
Qt, numba, xgrammar, ...), so a module-level import of one of them anywhere on the path fails here as it
would there. The blocker travels to spawned children (tensor-parallel workers) through PYTHONPATH.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ABSENT = ("fastapi", "uvicorn", "starlette", "pydantic", "pydantic_core", "PySide6", "shiboken6", "pyqtgraph",
          "numba", "llvmlite", "xgrammar", "markdown", "platformdirs", "accelerate", "openai", "hypothesis",
          "pytestqt", "pytest_timeout", "schemathesis", "instructor", "langchain_openai", "lm_eval")
# Modules that need an absent package by design and that nothing on the GPU path imports: the HTTP server
# (the GPU suite drives LLM directly) and the numba CPU kernels (kernels/__init__.py and kernels/cpu_linear.py
# fall back).
SERVER_OR_CPU_ONLY = {"engine.entrypoints.openai", "kernels.attention_cpu", "kernels.bench_cpu_attention",
                      "kernels.cpu_rows_gemm", "kernels.numba_pool"}

BLOCKER = f"""
import sys
ABSENT = {ABSENT!r}
class NotInstalled:
    # Wraps each finder so that an absent package is simply not found: `import x` raises ModuleNotFoundError
    # and importlib.util.find_spec(x) returns None, as transformers' availability probes expect.
    def __init__(self, finder):
        self.finder = finder
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ABSENT or not hasattr(self.finder, "find_spec"):
            return None
        return self.finder.find_spec(name, path, target)
    def __getattr__(self, attr):
        return getattr(self.finder, attr)
sys.meta_path[:] = [NotInstalled(f) for f in sys.meta_path]
"""


@pytest.fixture(scope="module")
def bare_env(tmp_path_factory):
    site = tmp_path_factory.mktemp("gpu_machine_site")
    (site / "sitecustomize.py").write_text(BLOCKER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]),
           "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return env


def run_bare(env, *args, timeout=300) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"{args} failed in the bare environment:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def test_the_blocker_blocks(bare_env):
    done = subprocess.run([sys.executable, "-c", "import pydantic"], cwd=ROOT, env=bare_env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode != 0 and "No module named 'pydantic'" in done.stderr


def test_every_engine_and_kernels_module_imports_without_the_desktop_stack(bare_env):
    walk = textwrap.dedent("""
        import importlib, json, pkgutil
        import engine, kernels
        failed = {}
        for pkg in (engine, kernels):
            for mod in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
                if mod.name.rsplit(".", 1)[-1] == "__main__":
                    continue
                try:
                    importlib.import_module(mod.name)
                except ImportError as e:
                    failed[mod.name] = str(e)
        print(json.dumps(failed))
    """)
    failed = json.loads(run_bare(bare_env, "-c", walk).stdout.strip().splitlines()[-1])
    # engine.entrypoints.openai imports its app lazily, so each web-stack module of the server and the router fails alone
    web_stack = {name for name in failed if name.startswith(("engine.entrypoints.openai.", "engine.entrypoints.router."))}
    assert "engine.entrypoints.openai.app" in failed and set(failed) - web_stack <= SERVER_OR_CPU_ONLY, failed


def test_the_doctor_runs_without_the_desktop_stack(bare_env):
    report = json.loads(run_bare(bare_env, "-m", "engine.doctor", "--json").stdout)
    assert any(row["check"] == "torch" for row in report["rows"])


def test_the_gpu_suite_collects_without_the_desktop_stack(bare_env):
    done = run_bare(bare_env, "-m", "pytest", "tests/gpu", "-m", "gpu", "--collect-only", "-q", "-p",
                    "no:cacheprovider")
    assert "error" not in done.stdout.lower(), done.stdout[-3000:]
    assert "tests/gpu/test_gpu_sampling.py::" in done.stdout


def test_an_engine_samples_and_beam_searches_without_the_desktop_stack(bare_env, llama_dir):
    # What the GPU suite asks of an engine, on the CPU: seeded sampling with logprobs and prompt logprobs
    # (sampler, prompt_logprobs, output processor, detokenizer), and beam search; lazy imports included.
    script = textwrap.dedent(f"""
        from engine import LLM, SamplingParams
        from engine.core.beam_search import BeamSearchParams
        llm = LLM({str(llama_dir)!r}, device="cpu")
        params = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=7, max_tokens=4, logprobs=2,
                                prompt_logprobs=1, ignore_eos=True)
        out = llm.generate(["hello world"], params, use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 4, out
        beams = llm.beam_search(["hello world"], BeamSearchParams(beam_width=2, max_tokens=3))
        assert beams[0].sequences, beams
        print("ok")
    """)
    assert run_bare(bare_env, "-c", script).stdout.strip().endswith("ok")

