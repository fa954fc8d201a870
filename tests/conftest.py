"""Shared fixtures: tiny random-weight model folders made once per test session."""
from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# One intra-op thread, here and in every engine, server and worker the tests start (they inherit it): the tiny
# models' ops are too small to split, and a second OpenMP thread spinning after each of them takes the core
# that the other process of a test (a tensor-parallel rank, a server, the router's engines) needs.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The engine's thread budget for this process too, before numba loads: numba refuses a NUMBA_NUM_THREADS that
# changes once its pool runs, so a test that ran a kernel before the first engine import broke later compiles.
import engine  # noqa: E402,F401  (importing the package sets the budget's environment; torch is not loaded)
# The test command's PYTEST_ADDOPTS ("-n 2 --dist loadfile") was read before this file: a pytest that a test starts
# in a subprocess (the GPU machine's bare collection, an interpreted Triton module) must not inherit it.
os.environ.pop("PYTEST_ADDOPTS", None)

import torch  # noqa: E402

# Triton picks compiled or interpreted when it is first imported (tests/interpreted.py). Without a CUDA device
# nothing can run it compiled, so the whole session interprets: the Triton test modules then run in this
# process, test by test, instead of each module again in a fresh one (a second torch, triton and pytest start-up).
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from tiny_models import make_tiny_model  # noqa: E402


@pytest.fixture(autouse=True)
def qt_garbage_on_the_gui_thread(request):
    """A Qt test runs with the cyclic garbage collector paused and collects on this (the GUI) thread at its end.

    Otherwise a collection can start in whichever thread allocates next (a fake server's handler, a relay thread)
    and destroy a Qt object there: its timers cannot be unregistered from that thread, fire later for the freed
    object, and the process segfaults (seen under two xdist workers in QTimerInfoList::activateTimers)."""
    if "qtbot" not in request.fixturenames:
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: tiny_model_dir("qwen2") -> path of a cached random-weight model folder."""
    made: dict[tuple, Path] = {}

    def make(arch: str = "llama", **overrides) -> Path:
        key = (arch, tuple(sorted(overrides.items())))
        if key not in made:
            made[key] = make_tiny_model(tmp_path_factory.mktemp(arch), arch, **overrides)
        return made[key]

    return make


@pytest.fixture(scope="session")
def llama_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="session")
def reference(tiny_model_dir):
    """reference(arch) -> (model path, prompts, HF greedy continuations), computed once per session."""
    from hf_reference import MAX_TOKENS, hf_greedy, make_prompts
    cache = {}

    def get(arch):
        if arch not in cache:
            path = tiny_model_dir(arch)
            prompts = make_prompts(400)
            cache[arch] = (path, prompts, hf_greedy(path, prompts, MAX_TOKENS))
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def hybrid_reference(tiny_model_dir):
    """hybrid_reference(arch) -> (path, four prompts, HF greedy continuations of HYBRID_MAX_TOKENS), once per
    session for the hybrid family and graph tests."""
    from hf_reference import HYBRID_MAX_TOKENS, HYBRID_PICKS, hf_greedy, make_prompts
    cache = {}

    def get(arch):
        if arch not in cache:
            path = tiny_model_dir(arch)
            prompts = [make_prompts(400)[i] for i in HYBRID_PICKS]
            cache[arch] = (path, prompts, hf_greedy(path, prompts, HYBRID_MAX_TOKENS))
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def agent_api_server(tiny_model_dir):
    """One server for the Responses and Anthropic Messages tests (they share it to start one engine, not two): a
    tiny qwen2 with a hermes-style tool template, 1024 tokens of context, the qwen3 reasoning parser, an API key.
    Its tests depend on no state another test left (prefix-cache hits are counted on both sides)."""
    from server_harness import AGENT_API_KEY, start_server
    from tiny_models import TOOL_CHAT_TEMPLATE

    path = tiny_model_dir("qwen2", chat_template=TOOL_CHAT_TEMPLATE, max_position_embeddings=1024)
    srv = start_server(path, api_key=AGENT_API_KEY, max_model_len=1024, reasoning_parser="qwen3")
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def scripted_api_server(tmp_path_factory):
    """A server whose model answers every turn "Hello from PagedDesk." and stops (tiny_models.make_scripted_model),
    with the hermes-style tool template, 32k tokens of context for an agent CLI's prompt, an access log for
    `access_records`, and no API key: the agent CLI tests."""
    from server_harness import start_server
    from tiny_models import SCRIPTED_REPLY, make_scripted_model

    path = make_scripted_model(tmp_path_factory.mktemp("scripted"), SCRIPTED_REPLY, max_position_embeddings=32768)
    srv = start_server(path, max_model_len=32768, num_gpu_blocks_override=2560, access_log=True)
    yield srv
    srv.stop()



@pytest.fixture(scope="session")
def image_family(tmp_path_factory):
    """image_family(name) -> tests/image_families.FamilyRun (checkpoint, engine, processed cases, HF's ids), built
    once per session: the shared image tests and the family's own module use the same one."""
    from image_families import FAMILIES, build
    built = {}

    def get(name):
        if name not in built:
            built[name] = build(FAMILIES[name], tmp_path_factory.mktemp(name))
        return built[name]

    return get
