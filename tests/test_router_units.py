"""The router's pure parts: flags and the TOML file into model specs, placement over tiny budgets (LRU eviction,
the 503 sentence), the replica choice, the merged metrics, the engine's absolute KV budget on a shared card, and
a cut relay's stream."""
from __future__ import annotations

import pytest

from engine.entrypoints import serve
from engine.config.flags import EngineConfig
from engine.config.model import ModelConfig
from engine.entrypoints.router.balancer import BALANCE_TOKENS, ReplicaLoad, choose_replica, prefix_chain, prompt_text
from engine.entrypoints.router.metrics_merge import merge_metrics
from engine.entrypoints.router.placement import HOST, Card, Holder, NoRoom, place, replica_need
from engine.entrypoints.router.specs import ModelSpec, build_specs, split_model_arg, wants_router
from engine.planning.capacity import MemoryProfile
from engine.planning.units import GIB, MIB

pytestmark = pytest.mark.timeout(60)


def args_of(*argv: str) -> tuple[list[str], dict]:
    models, rest = serve.split_model_flags(list(argv))
    return models, vars(serve.build_parser().parse_args(rest))


def test_model_flags_and_toml_become_specs(tmp_path, llama_dir):
    toml = tmp_path / "models.toml"
    toml.write_text(f'max-num-seqs = 8\n[models.chat]\nmax-model-len = 128\nmodel-ttl = 60\n'
                    f'[models.code]\nmodel = "{llama_dir}"\ndata_parallel_size = 2\nkv-cache-memory = 1\n')
    models, args = args_of("--model", f"chat={llama_dir}", "--models-config", str(toml), "--device", "cpu",
                           "--block-size", "32")
    assert wants_router(models, args)
    config = build_specs(models, args)
    chat, code = config.models["chat"], config.models["code"]
    assert chat.path == str(llama_dir) and chat.model_ttl == 60.0 and chat.data_parallel_size == 1
    assert chat.engine_flags == {"device": "cpu", "block_size": 32, "max_num_seqs": 8, "max_model_len": 128}
    assert code.data_parallel_size == 2 and code.engine_flags["kv_cache_memory"] == 1.0
    assert code.engine_config().max_num_seqs == 8


def test_spec_errors_name_the_flag(tmp_path, llama_dir):
    toml = tmp_path / "bad.toml"
    toml.write_text("[models.x]\nmax-model-lenn = 3\n")
    with pytest.raises(ValueError, match="unknown flag 'max_model_lenn'"):
        build_specs(*args_of("--model", f"x={llama_dir}", "--models-config", str(toml)))
    toml.write_text("[models.x]\nmax-model-len = 'long'\n")
    with pytest.raises(ValueError, match="--max-model-len must be int"):
        build_specs(*args_of("--model", f"x={llama_dir}", "--models-config", str(toml)))
    with pytest.raises(ValueError, match="given twice"):
        build_specs(*args_of("--model", f"x={llama_dir}", "--model", f"x={llama_dir}"))
    assert serve.main(["--model", f"x={llama_dir}", "--model", "y=/nowhere", "--device", "cpu"]) == 2


def test_plain_model_keeps_one_engine_and_name_eq_path_names_it(llama_dir):
    assert split_model_arg(str(llama_dir)) == (None, str(llama_dir))
    assert split_model_arg("Qwen/Qwen2.5-0.5B") == (None, "Qwen/Qwen2.5-0.5B")
    assert split_model_arg("chat=/m/a") == ("chat", "/m/a")
    models, args = args_of("--model", f"chat={llama_dir}")
    assert not wants_router(models, args)
    args["model"] = models[0]
    config = serve.engine_config(args)
    assert config.model == str(llama_dir) and config.served_model_name == "chat"
    assert wants_router(*args_of("--model", str(llama_dir), "--data-parallel-size", "2"))


def test_models_dir_serves_every_folder_by_name(tmp_path, llama_dir, tiny_model_dir):
    root = tmp_path / "models"
    root.mkdir()
    (root / "llama").symlink_to(llama_dir)
    (root / "qwen").symlink_to(tiny_model_dir("qwen2"))
    (root / "not-a-model").mkdir()
    (root / "unsupported").mkdir()
    (root / "unsupported" / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    config = build_specs(*args_of("--models-dir", str(root)))
    assert sorted(config.models) == ["llama", "qwen", "unsupported"] and config.models["qwen"].discovered
    from engine.entrypoints.router.main import check_models
    check_models(config)  # a folder it cannot serve is left out, not fatal
    assert sorted(config.models) == ["llama", "qwen"]


def spec(llama_dir, name="m", **flags) -> ModelSpec:
    dp = flags.pop("dp", 1)
    return ModelSpec(name, str(llama_dir), {"device": "cpu", "num_gpu_blocks_override": 64, **flags}, dp)


def test_placement_evicts_least_recently_used_idle_model(llama_dir):
    need = replica_need(spec(llama_dir), Card(HOST, "CPU", 0), None).total_bytes
    cards = [Card(HOST, "CPU", int(need * 2.5))]
    holders = [Holder("old", {HOST: need}, idle=True, last_used=1.0),
               Holder("new", {HOST: need}, idle=True, last_used=2.0)]
    placements, evict = place(spec(llama_dir), cards, holders, None)
    assert evict == ["old"] and placements[0].cards == (HOST,)
    placements, evict = place(spec(llama_dir), cards, holders[:1], None)
    assert evict == []
    _, evict = place(spec(llama_dir), cards, holders[:1], max_loaded_models=1)
    assert evict == ["old"]


def test_placement_503_sentence_names_the_missing_memory(llama_dir):
    need = replica_need(spec(llama_dir), Card(HOST, "CPU", 0), None).total_bytes
    cards = [Card(HOST, "CPU", int(need * 1.5))]
    busy = [Holder("busy", {HOST: need}, idle=False)]
    with pytest.raises(NoRoom) as exc:
        place(spec(llama_dir), cards, busy, None)
    text = str(exc.value)
    assert "cannot load m" in text and "GiB is missing" in text and "busy, so not unloaded: busy" in text
    with pytest.raises(NoRoom, match="--max-loaded-models 1"):
        place(spec(llama_dir), [Card(HOST, "CPU", need * 10)], busy, 1)


def test_placement_on_cards_keeps_replicas_apart_with_absolute_budgets(llama_dir):
    s = ModelSpec("m", str(llama_dir), {"max_model_len": 256, "enforce_eager": True}, data_parallel_size=2)
    cards = [Card(0, "cuda:0", 4 * GIB), Card(1, "cuda:1", 4 * GIB)]
    placements, _ = place(s, cards, [], max_loaded_models=2)
    assert sorted(p.cards for p in placements) == [(0,), (1,)]
    need = placements[0].need
    assert need.total_bytes <= 2 * GIB and need.overhead_bytes >= 512 * MIB
    # a second model shares a card with the first: each engine keeps its own absolute budget
    other = ModelSpec("o", str(llama_dir), {"max_model_len": 256, "enforce_eager": True})
    holders = [Holder("m", {0: need.total_bytes, 1: need.total_bytes}, idle=False)]
    placed, evict = place(other, cards, holders, max_loaded_models=2)
    assert evict == [] and placed[0].need.kv_bytes > 0


def test_cpu_replicas_get_their_own_cores(llama_dir, monkeypatch):
    import os
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    placements, _ = place(spec(llama_dir, dp=2), [Card(HOST, "CPU", 64 * GIB)], [], None)
    assert [p.cpu_cores for p in placements] == [(0, 1), (2, 3)]


def test_replica_choice_least_loaded_then_prefix():
    loads = [ReplicaLoad(), ReplicaLoad()]
    conversation = prefix_chain(prompt_text({"messages": [{"role": "system", "content": "x" * 400}]}))
    assert len(conversation) == 3
    assert choose_replica(loads, conversation) == 0
    loads[0].remember(conversation)
    loads[0].num_requests = 1
    assert choose_replica(loads, prefix_chain("y" * 400)) == 1  # idle replicas take turns
    loads[0].outstanding_tokens = 100
    assert choose_replica(loads, conversation) == 0  # its prefix is cached there
    loads[0].outstanding_tokens = BALANCE_TOKENS + 1
    assert choose_replica(loads, conversation) == 1  # but not at any imbalance


def test_metrics_merge_labels_every_engine():
    text = ('# HELP pagedesk:generation_tokens_total Tokens generated\n# TYPE pagedesk:generation_tokens_total '
            'counter\npagedesk:generation_tokens_total{model_name="m"} 5.0\n')
    merged = merge_metrics([("0", "m", text), ("1", "m", text)]).decode()
    assert merged.count("# TYPE pagedesk:generation_tokens_total counter") == 1
    assert 'pagedesk:generation_tokens_total{engine="0",model_name="m"} 5.0' in merged
    assert 'pagedesk:generation_tokens_total{engine="1",model_name="m"} 5.0' in merged


def test_absolute_kv_budget_ignores_a_sibling_engine(llama_dir):
    """Two engines on one 24 GiB card: the second starts with 10 GiB held by the first. With
    --gpu-memory-utilization that is "other programs"; with --kv-cache-memory the budget stands."""
    from engine.worker.kv_cache_sizing import smallest_plan
    cfg = ModelConfig.from_folder(llama_dir).with_max_model_len(256)
    profile = MemoryProfile("cuda:0", 24 * GIB, 14 * GIB, GIB // 2, GIB // 4, GIB // 4)
    shared = smallest_plan(EngineConfig(model=str(llama_dir), gpu_memory_utilization=0.5), cfg, [profile], 1024)
    assert shared.kv_budget_bytes < 2 * GIB  # 12 GiB share − 10 GiB "other programs" − the rest
    absolute = smallest_plan(EngineConfig(model=str(llama_dir), kv_cache_memory=8.0), cfg, [profile], 1024)
    assert absolute.kv_budget_bytes == 8 * GIB and absolute.num_blocks == 8 * GIB // (1024 * 16)
    with pytest.raises(ValueError, match="GiB is missing"):
        smallest_plan(EngineConfig(model=str(llama_dir), kv_cache_memory=14.0), cfg, [profile], 1024)


def test_the_router_imports_no_torch():
    import os
    import subprocess
    import sys
    from pathlib import Path
    code = ("import sys, engine.entrypoints.router.app, engine.entrypoints.router.main, engine.entrypoints.serve; "
            "assert 'torch' not in sys.modules, 'the router imported torch'")
    root = str(Path(__file__).resolve().parents[1])
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root,
                            env={**os.environ, "PYTHONPATH": root})
    assert result.returncode == 0, result.stderr


def test_a_window_models_most_useful_cache_counts_every_group(tiny_model_dir):
    """A sliding-window model's sequence holds blocks in its window group as well as its full group: the
    placement's "most useful" KV cache counts them all, as the engine's pool does (it once counted one group)."""
    from engine.kv.kv_cache_interface import model_kv_layout

    folder = tiny_model_dir("gemma2")
    s = ModelSpec("g", str(folder), {"max_model_len": 256, "enforce_eager": True, "max_num_seqs": 2})
    need = replica_need(s, Card(0, "cuda:0", 64 * GIB), None)
    config = s.engine_config()
    from engine.config.model import DTYPE_BYTES
    from engine.planning.units import resolve_dtype
    cfg = ModelConfig.from_folder(folder).with_max_model_len(256)
    layout = model_kv_layout(cfg, config.block_size, DTYPE_BYTES[resolve_dtype(config.dtype, cfg.torch_dtype, True)])
    assert layout.has_sliding_window
    blocks = layout.blocks_per_seq(256, config.resolve_max_num_batched_tokens(256))
    assert blocks > -(-256 // config.block_size)  # more than the full group alone
    assert need.kv_bytes == 2 * blocks * layout.bytes_per_block


def test_placement_counts_the_graphs_of_the_cuda_graph_mode(llama_dir):
    """On a card the overhead holds the decode graphs, and with full_and_piecewise (the default) the piecewise
    pieces up to the step budget too, as the engine's sizing counts them; --enforce-eager: neither."""
    from engine.entrypoints.router.placement import CUDA_CONTEXT_BYTES
    from engine.planning.graphs import estimate_piecewise_graph_bytes
    card = Card(0, "cuda:0", 64 * GIB)
    flags = {"max_model_len": 256, "max_num_seqs": 2}
    both = replica_need(ModelSpec("a", str(llama_dir), flags), card, None)
    decode = replica_need(ModelSpec("d", str(llama_dir), {**flags, "cuda_graph_mode": "full_decode_only"}), card, None)
    eager = replica_need(ModelSpec("e", str(llama_dir), {**flags, "enforce_eager": True}), card, None)
    config = ModelSpec("a", str(llama_dir), flags).engine_config()
    cfg = ModelConfig.from_folder(llama_dir).with_max_model_len(256)
    pieces = estimate_piecewise_graph_bytes(cfg, config.resolve_max_num_batched_tokens(256), 2)
    assert eager.overhead_bytes == CUDA_CONTEXT_BYTES < decode.overhead_bytes
    assert both.overhead_bytes == decode.overhead_bytes + pieces


def test_placement_counts_the_draft_model_and_the_verify_graphs(llama_dir):
    """A replica speculating with a draft model holds the draft's weights beside its own and the verify steps'
    graphs beside the decode graphs; n-gram only the graphs."""
    import json

    from engine.planning.speculation import draft_footprint
    from engine.planning.graphs import estimate_verify_graph_bytes
    card = Card(0, "cuda:0", 64 * GIB)
    flags = {"max_model_len": 256, "max_num_seqs": 2}
    plain = replica_need(ModelSpec("a", str(llama_dir), flags), card, None)
    draft = {"model": str(llama_dir), "num_speculative_tokens": 3}
    drafted = replica_need(ModelSpec("d", str(llama_dir), {**flags, "speculative_config": json.dumps(draft)}),
                           card, None)
    ngram = replica_need(ModelSpec("n", str(llama_dir), {**flags, "speculative_config": json.dumps(
        {"method": "ngram", "num_speculative_tokens": 3})}), card, None)
    cfg = ModelConfig.from_folder(llama_dir).with_max_model_len(256)
    verify = estimate_verify_graph_bytes(cfg, 2, 2, 1, 3)
    assert drafted.weights_bytes == plain.weights_bytes + draft_footprint(cfg, 2, 2, 16)[0]
    assert ngram.weights_bytes == plain.weights_bytes and verify > 0
    assert ngram.overhead_bytes == drafted.overhead_bytes == plain.overhead_bytes + verify


def test_response_directory_is_bounded_and_reads_ids_from_replies():
    import asyncio

    from engine.entrypoints.router.app import chained_replica
    from engine.entrypoints.router.response_directory import ResponseDirectory, ResponseOwner
    from engine.entrypoints.openai.errors import OpenAIError

    directory = ResponseDirectory(capacity=2)
    a0, dp1 = ResponseOwner("a", 0), ResponseOwner("dp", 1)
    directory.remember_body(b'{"id": "resp_1", "object": "response"}', a0)
    directory.remember_body(b'{"error": {"message": "no"}}', a0)  # no id: nothing noted
    directory.remember_body(b"not json", a0)

    async def stream():
        # The id of the first event split across two chunks, as a relay may cut it.
        for chunk in (b'event: response.created\ndata: {"type":"response.created","response":{"id":"re',
                      b'sp_2","object":"response"}}\n\n', b'data: {"id": "resp_3"}\n\n'):
            yield chunk

    async def relay_all():
        return [c async for c in directory.remember_stream(stream(), dp1)]

    chunks = asyncio.run(relay_all())
    assert b"".join(chunks).count(b"resp_") == 2  # passed through unchanged
    assert directory.owner("resp_1") == a0 and directory.owner("resp_2") == dp1 and len(directory) == 2
    assert directory.owner("resp_3") is None  # only the first id of a stream is its response's
    assert chained_replica(directory, {"previous_response_id": "resp_2"}, "dp") == 1
    assert chained_replica(directory, {"previous_response_id": "resp_9"}, "dp") is None
    with pytest.raises(OpenAIError, match="created by model `dp`"):
        chained_replica(directory, {"previous_response_id": "resp_2"}, "a")
    directory.remember("resp_4", a0)  # over capacity: the least recently used (resp_1) goes
    assert directory.owner("resp_1") is None and directory.owner("resp_2") == dp1
    directory.forget("resp_2")
    assert directory.owner("resp_2") is None


def test_a_hybrid_replicas_budget_holds_its_seats_and_its_state_pool(tmp_path):
    """The engine's absolute KV budget holds a hybrid model's state pool beside its blocks (plan_from_budget), so
    the budget placement hands it must too: max_num_seqs full-length sequences and their state slots. Speculating,
    its verify scratch is in the weights, as the planner counts it."""
    import json

    from engine.bench.hybrid import QWEN3_6_27B
    from engine.kv.kv_cache_interface import model_kv_layout
    from engine.planning.capacity import plan_from_budget
    from engine.planning.kv import verify_scratch_bytes
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_6_27B))
    flags = {"max_model_len": 4096, "max_num_seqs": 8, "enforce_eager": True}
    card = Card(0, "cuda:0", 80 * GIB)
    need = replica_need(ModelSpec("h", str(tmp_path), flags), card, None)
    cfg = ModelConfig.from_folder(tmp_path).with_max_model_len(4096)
    layout = model_kv_layout(cfg, 16, 2, act_dtype_bytes=2)
    assert need.kv_bytes == 8 * 256 * layout.bytes_per_block + layout.state_pool_bytes(8, True)
    engine = plan_from_budget(MemoryProfile("cuda:0", 80 * GIB, 80 * GIB, 0, 0, 0), need.kv_bytes,
                              layout.bytes_per_block // 16, 16, 4096, 1, layout, 2048, 8)
    assert engine.num_full_seqs == 8
    ngram = {**flags, "speculative_config": json.dumps({"method": "ngram", "num_speculative_tokens": 3})}
    speculating = replica_need(ModelSpec("n", str(tmp_path), ngram), card, None)
    assert speculating.weights_bytes - need.weights_bytes == verify_scratch_bytes(layout, 8, 3, 2048) > 0


def test_a_drafting_replicas_budget_holds_the_drafts_pages(llama_dir):
    """A draft model's KV page at every block id shares the budget (blocks_with_draft): the most useful budget
    holds max_num_seqs full sequences of both; with the target as its own draft, twice the target's."""
    import json
    card = Card(0, "cuda:0", 64 * GIB)
    flags = {"max_model_len": 256, "max_num_seqs": 2, "enforce_eager": True}
    plain = replica_need(ModelSpec("a", str(llama_dir), flags), card, None)
    draft = {"model": str(llama_dir), "num_speculative_tokens": 3}
    drafted = replica_need(ModelSpec("d", str(llama_dir), {**flags, "speculative_config": json.dumps(draft)}),
                           card, None)
    assert drafted.kv_bytes == 2 * plain.kv_bytes > 0


def test_no_kv_budget_when_the_state_pool_leaves_no_block(tmp_path):
    """256 seats of Qwen3.6-27B's state (147 MiB each, 37 GiB with the snapshots) do not fit beside its AWQ
    weights on a 40 GiB card, though ~19 GiB of blocks would: no budget (the replica is not placed) rather than
    one the engine would refuse at load."""
    import json

    from engine.bench.hybrid import AWQ_G128, QWEN3_6_27B
    (tmp_path / "config.json").write_text(json.dumps({**QWEN3_6_27B, "quantization_config": AWQ_G128}))
    flags = {"max_model_len": 4096, "enforce_eager": True}
    assert replica_need(ModelSpec("h", str(tmp_path), flags), Card(0, "cuda:0", 40 * GIB), None).kv_bytes == 0
    few = replica_need(ModelSpec("h", str(tmp_path), {**flags, "max_num_seqs": 16}), Card(0, "cuda:0", 40 * GIB), None)
    assert few.kv_bytes > 0


def test_generated_values_are_never_read_as_options(llama_dir, monkeypatch):
    """A key from secrets.token_urlsafe starts with '-' one time in 64: it reaches the engine as `--api-key=KEY`
    (argparse once read `--api-key -abc` as an unknown option and the engine exited 2), and so do the router's
    other values and any flag value that starts with '-'."""
    from engine.config.flags import flags_to_argv
    from engine.entrypoints import router_engine
    from engine.entrypoints.router.backend import EngineProcess
    from engine.entrypoints.router.placement import ReplicaNeed, ReplicaPlacement
    from engine.entrypoints.serving_process import ENGINE_API_KEY_ENV

    parser = serve.build_parser()
    seen = {}
    monkeypatch.setattr(router_engine, "serve_main", lambda argv: seen.setdefault("argv", argv) and 0)
    monkeypatch.setenv(ENGINE_API_KEY_ENV, "-abc_DEF")
    router_engine.main(["--model", str(llama_dir), "--port", "1"])
    models, rest = serve.split_model_flags(seen["argv"])
    assert vars(parser.parse_args(rest))["api_key"] == "-abc_DEF" and models == [str(llama_dir)]

    engine = EngineProcess(ModelSpec("-chat", "-models/m", {"tokenizer": "-tok"}), 0,
                           ReplicaPlacement((HOST,), ReplicaNeed(0, 0, 0, 1)))
    engine.port = 8123
    models, rest = serve.split_model_flags(engine.argv()[3:])
    from engine.distributed.parent_watch import split_parent_flag
    parent, rest = split_parent_flag(rest)
    args = vars(parser.parse_args(rest))
    assert models == ["-models/m"] and parent is not None
    assert (args["served_model_name"], args["tokenizer"], args["port"]) == ("-chat", "-tok", 8123)
    assert vars(parser.parse_args(flags_to_argv({"api_key": "-k", "served_model_name": "-n"})))["api_key"] == "-k"


def test_a_cpu_replica_counts_its_process_baseline(llama_dir):
    """--memory-budget on CPU: each engine process holds Python, torch and the server before any tensor (five tiny
    engines once counted 704 MiB and used 2,884): placement counts a baseline per process, as the CUDA context
    is counted on a card; the manager replaces the default with what its engines measure."""
    from engine.entrypoints.router.placement import CPU_PROCESS_BYTES
    host = Card(HOST, "CPU", 0)
    need = replica_need(spec(llama_dir), host, None)
    assert need.overhead_bytes == CPU_PROCESS_BYTES > 0
    assert replica_need(spec(llama_dir), host, None, process_bytes=300 * MIB).overhead_bytes == 300 * MIB
    budget = Card(HOST, "CPU", int(2.5 * need.total_bytes))
    holders = [Holder(f"m{i}", {HOST: need.total_bytes}, idle=False) for i in range(2)]
    with pytest.raises(NoRoom):  # two engines fill 2.5 of them: a third does not fit
        place(spec(llama_dir), [budget], holders, None)
    assert place(spec(llama_dir), [budget], holders[:1], None)[0]


def test_a_failed_load_holds_until_the_folder_changes_or_the_backoff_expires(tmp_path):
    from engine.entrypoints.router.load_failures import RETRY_AFTER_S, LoadFailure, folder_fingerprint
    (tmp_path / "model.safetensors").write_bytes(b"x")
    before = folder_fingerprint(str(tmp_path))
    failure = LoadFailure.after(None, "corrupt", before, now=100.0)
    assert failure.holds(folder_fingerprint(str(tmp_path)), 100.0 + RETRY_AFTER_S[0] - 1)
    assert not failure.holds(before, 100.0 + RETRY_AFTER_S[0])  # the backoff expired
    (tmp_path / "model.safetensors").write_bytes(b"xy")  # rewritten: another size
    assert not failure.holds(folder_fingerprint(str(tmp_path)), 101.0)
    again = LoadFailure.after(failure, "corrupt", before, now=200.0)
    assert again.count == 2 and again.retry_at == 200.0 + RETRY_AFTER_S[1]
    assert folder_fingerprint(str(tmp_path / "nowhere")) is None  # a hub id: only the backoff retries it


def test_check_models_serves_a_broken_folder_as_failed_unless_none_is_left(tmp_path, llama_dir):
    import shutil

    from engine.entrypoints.router.main import check_models
    broken = shutil.copytree(llama_dir, tmp_path / "broken")
    (broken / "config.json").write_text('{"architectures": ')
    config = build_specs(*args_of("--model", f"ok={llama_dir}", "--model", f"bad={broken}", "--device", "cpu"))
    failures = check_models(config)
    assert list(failures) == ["bad"] and "model bad" in failures["bad"] and sorted(config.models) == ["bad", "ok"]
    alone = build_specs(*args_of("--model", f"bad={broken}", "--model", f"bad2={broken}", "--device", "cpu"))
    with pytest.raises(ValueError, match="model bad"):
        check_models(alone)


def test_a_cut_relay_stops_relaying_what_the_engine_had_already_sent():
    """A cut relay whose reader still finds the engine's bytes in its buffer (the engine went on streaming, then
    ended with its own shutdown error) relays none of them: the client reads the router's reason."""
    import asyncio
    import json

    from engine.entrypoints.router.proxy import Relay, _events

    handle, closed = Relay(True), []

    class Upstream:  # what httpx's response gives: raw chunks, then aclose
        async def aiter_raw(self):
            yield b'data: {"n": 1}\n\n'
            handle.cut("model a was unloaded", "model_unloaded")
            yield b'data: {"n": 2}\n\ndata: {"error": {"code": "engine_dead"}}\n\n'

        async def aclose(self):
            closed.append(True)

    async def relayed() -> bytes:
        return b"".join([chunk async for chunk in _events(Upstream(), "a", lambda: closed.append("done"), handle)])

    body = asyncio.run(relayed()).decode()
    events = [line[len("data: "):] for line in body.split("\n\n") if line]
    assert events[0] == '{"n": 1}' and events[-1] == "[DONE]" and len(events) == 3, events
    error = json.loads(events[1])["error"]
    assert error["code"] == "model_unloaded" and error["message"] == "model a was unloaded"
    assert "done" in closed
