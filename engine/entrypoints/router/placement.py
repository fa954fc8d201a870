"""Where an engine goes and how much it may take: the capacity planner's arithmetic over each card's free memory.

A card's budget is `--memory-budget` GiB, or what the engine itself would use (total × gpu_memory_utilization
minus what other programs held at start); on CPU the host is one "card" whose budget is `--memory-budget` or
the available RAM. A replica needs, per card, its weights, its activation peak and overhead (engine/planning/sizing.py,
the planner's estimates; a speculative draft model or MTP head in its weights, verify graphs in its overhead;
on a card the CUDA context, on the host each process's own baseline: the interpreter, torch and the server,
measured by the manager from the engines it runs, CPU_PROCESS_BYTES until it has one) plus an absolute KV budget: the model's `kv-cache-memory` if given, else on CUDA the
card's budget divided by `--max-loaded-models` (all of it when unset), capped at max_num_seqs full sequences,
and on CPU the engine's own default. `place` picks cards for every replica of a model (replicas of one model
on different cards where it can), evicting idle models least recently used first, or says in GiB what is
missing. Pure arithmetic: the manager owns the state.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from engine.config.flags import DEFAULT_CPU_KV_CACHE_GIB
from engine.kv.kv_cache_interface import model_kv_layout
from engine.config.model import DTYPE_BYTES, ModelConfig
from engine.entrypoints.router.specs import ModelSpec
from engine.planning.model_footprint import draft_footprint, mtp_footprint, rope_table_bytes, weights_bytes_per_card
from engine.planning.sizing import GIB, MIB, estimate_activation_bytes, estimate_cuda_graph_bytes, estimate_verify_graph_bytes, \
    kv_bytes_per_token, plan_cpu, resolve_dtype
from engine.config.speculative import parse_speculative_config

CUDA_CONTEXT_BYTES = 512 * MIB  # CUDA context, cuBLAS workspace: memory no estimate of tensors counts
# An engine process on the host before any tensor: Python, torch, transformers, the HTTP server (a tiny
# model's engine holds about 550 MiB resident). The manager replaces it with what its engines measure.
CPU_PROCESS_BYTES = 512 * MIB
HOST = -1  # the "card" index of the host on CPU


@dataclass(frozen=True)
class Card:
    index: int  # CUDA device index, or HOST
    name: str
    budget_bytes: int


@dataclass(frozen=True)
class ReplicaNeed:
    """What one replica takes on each of its cards."""

    weights_bytes: int
    activation_bytes: int
    overhead_bytes: int
    kv_bytes: int
    tensor_parallel_size: int = 1

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.activation_bytes + self.overhead_bytes + self.kv_bytes

    def describe(self) -> str:
        return (f"{self.total_bytes / GIB:.2f} GiB per card (weights {self.weights_bytes / GIB:.2f}, activations "
                f"{self.activation_bytes / GIB:.2f}, overhead {self.overhead_bytes / GIB:.2f}, KV cache "
                f"{self.kv_bytes / GIB:.2f})")


@dataclass(frozen=True)
class ReplicaPlacement:
    cards: tuple[int, ...]  # CUDA indices (CUDA_VISIBLE_DEVICES), or (HOST,)
    need: ReplicaNeed
    cpu_cores: tuple[int, ...] | None = None  # CPU data parallel: this replica's cores

    @property
    def kv_cache_gib(self) -> float:
        return self.need.kv_bytes / GIB


@dataclass
class NoRoom(Exception):
    message: str

    def __str__(self) -> str:
        return self.message


@dataclass
class Holder:
    """A loaded model as placement sees it: what it holds on which card, and whether it may be evicted."""

    name: str
    held: dict[int, int] = field(default_factory=dict)  # card index -> bytes
    idle: bool = True
    last_used: float = 0.0


def detect_cards(device: str, memory_budget_gib: float | None, gpu_memory_utilization: float) -> list[Card]:
    """The cards engines may be placed on: NVIDIA cards through NVML, else the host."""
    if device != "cpu":
        cards = _nvml_cards(memory_budget_gib, gpu_memory_utilization)
        if cards:
            return cards
        if device == "cuda":
            raise ValueError("--device cuda: no NVIDIA GPU is visible to NVML")
    if memory_budget_gib is not None:
        return [Card(HOST, "CPU", int(memory_budget_gib * GIB))]
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return [Card(HOST, "CPU", int(available))]


def _nvml_cards(memory_budget_gib: float | None, utilization: float) -> list[Card]:
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception:  # no driver, no library: no cards
        return []
    try:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        indices = [int(i) for i in visible.split(",") if i.strip().isdigit()] if visible else \
            list(range(pynvml.nvmlDeviceGetCount()))
        cards = []
        for index in indices:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            info = pynvml.nvmlDeviceGetMemoryInfo(handle)
            name = pynvml.nvmlDeviceGetName(handle)
            name = name.decode() if isinstance(name, bytes) else name
            budget = int(memory_budget_gib * GIB) if memory_budget_gib is not None else \
                int(info.total * utilization) - (info.total - info.free)
            cards.append(Card(index, f"cuda:{index} ({name})", max(0, budget)))
        return cards
    finally:
        pynvml.nvmlShutdown()


def model_folder(spec: ModelSpec) -> Path:
    """The folder with the model's config.json: the path itself, or (a hub repo id) the cached config's folder,
    fetched alone when it is not cached (the engine downloads the weights when it loads)."""
    return config_folder(spec.path, spec.engine_flags.get("revision"), f"model {spec.name}")


def config_folder(path_or_repo: str, revision: str | None, what: str) -> Path:
    path = Path(path_or_repo)
    if path.is_dir():
        return path
    try:
        from huggingface_hub import hf_hub_download
        return Path(hf_hub_download(path_or_repo, "config.json", revision=revision)).parent
    except Exception as exc:  # noqa: BLE001 - not a folder, not a repo, or offline: one sentence
        raise ValueError(f"{what}: {path_or_repo} is not a model folder, and its config.json could not "
                         f"be read from the Hugging Face hub ({type(exc).__name__})") from None


def speculation_weights_bytes(config, cfg: ModelConfig, dtype_bytes: int, kv_dtype_bytes: int) -> int:
    """A replica's speculative draft model or MTP head (on its first card; their KV pages share the replica's KV
    budget, as in the engine); 0 without one or for n-gram."""
    spec = parse_speculative_config(config.speculative_config)
    if spec is None or spec.method == "ngram":
        return 0
    if spec.method == "mtp":
        return mtp_footprint(cfg, dtype_bytes, kv_dtype_bytes, config.block_size, config.tensor_parallel_size)[0]
    draft = ModelConfig.from_folder(config_folder(spec.model, None, "speculative_config.model"))
    return draft_footprint(draft, dtype_bytes, kv_dtype_bytes, config.block_size)[0]


def replica_need(spec: ModelSpec, card: Card, max_loaded_models: int | None,
                 process_bytes: int = CPU_PROCESS_BYTES) -> ReplicaNeed:
    """One replica's bytes per card, from the model's config.json and its flags (no weights read);
    `process_bytes`: one engine process's baseline on the host (each tensor-parallel rank is a process)."""
    config = spec.engine_config()
    on_gpu = card.index != HOST
    cfg = ModelConfig.from_folder(model_folder(spec), config.quantization).with_max_model_len(config.max_model_len)
    dtype = resolve_dtype(config.dtype, cfg.torch_dtype, on_gpu)
    dtype_bytes = DTYPE_BYTES[dtype]
    kv_dtype_bytes = dtype_bytes if config.kv_cache_dtype == "auto" else DTYPE_BYTES[config.kv_cache_dtype]
    tp = config.tensor_parallel_size
    per_token = kv_bytes_per_token(cfg, kv_dtype_bytes, tp)
    weights = weights_bytes_per_card(cfg, dtype_bytes, tp) + rope_table_bytes(cfg) + \
        speculation_weights_bytes(config, cfg, dtype_bytes, kv_dtype_bytes)
    step_tokens = config.resolve_max_num_batched_tokens(cfg.max_model_len)
    activations = estimate_activation_bytes(cfg, step_tokens, dtype_bytes, tp, config.max_num_seqs)
    overhead = 0 if on_gpu else process_bytes * tp
    if on_gpu:
        k = getattr(parse_speculative_config(config.speculative_config), "num_speculative_tokens", 0)
        overhead = CUDA_CONTEXT_BYTES + (0 if config.enforce_eager else estimate_cuda_graph_bytes(
            cfg, config.max_num_seqs, step_tokens, dtype_bytes, tp, config.cuda_graph_mode)
            + estimate_verify_graph_bytes(cfg, config.max_num_seqs, dtype_bytes, tp, k))
    fixed = weights + activations + overhead
    # Blocks a full-length sequence holds over every KV cache group (a window group's too), as the pool counts them.
    layout = model_kv_layout(cfg, config.block_size, kv_dtype_bytes, tp)
    blocks_per_seq = layout.blocks_per_seq(cfg.max_model_len, step_tokens) if layout.has_sliding_window else \
        -(-cfg.max_model_len // config.block_size)
    most_useful = config.max_num_seqs * blocks_per_seq * config.block_size * per_token
    if config.num_gpu_blocks_override is not None:
        kv = config.num_gpu_blocks_override * config.block_size * per_token
    elif config.kv_cache_memory is not None:
        kv = int(config.kv_cache_memory * GIB)
    elif not on_gpu:
        plan = plan_cpu(cfg, DEFAULT_CPU_KV_CACHE_GIB, dtype=dtype, kv_cache_dtype=config.kv_cache_dtype,
                        max_num_seqs=config.max_num_seqs, block_size=config.block_size,
                        max_num_batched_tokens=step_tokens)
        kv = plan.num_blocks * config.block_size * per_token
    else:
        kv = min(most_useful, card.budget_bytes // (max_loaded_models or 1) - fixed)
    return ReplicaNeed(weights, activations, overhead, max(0, kv), tp)


def place(spec: ModelSpec, cards: list[Card], holders: list[Holder], max_loaded_models: int | None,
          process_bytes: int = CPU_PROCESS_BYTES) -> tuple[list[ReplicaPlacement], list[str]]:
    """Cards for each of the model's replicas and the idle models to unload first (LRU), or NoRoom saying
    what is missing. `holders`: every loaded model but this one; `process_bytes`: see replica_need."""
    evictable = sorted((h for h in holders if h.idle), key=lambda h: h.last_used)
    evict: list[str] = []
    loaded = len(holders)
    while True:
        free = {c.index: c.budget_bytes - sum(h.held.get(c.index, 0) for h in holders if h.name not in evict)
                for c in cards}
        over_count = max_loaded_models is not None and loaded - len(evict) >= max_loaded_models
        placements = None if over_count else _fit(spec, cards, free, max_loaded_models, process_bytes)
        if placements is not None:
            return placements, evict
        if len(evict) == len(evictable):
            raise NoRoom(_no_room_message(spec, cards, free, holders, evict, max_loaded_models, over_count,
                                          process_bytes))
        evict.append(evictable[len(evict)].name)


def _fit(spec: ModelSpec, cards: list[Card], free: dict[int, int], max_loaded: int | None, process_bytes: int
         ) -> list[ReplicaPlacement] | None:
    """Every replica placed on the cards with the most room (replicas apart where possible), or None."""
    free = dict(free)
    by_index = {c.index: c for c in cards}
    placements: list[ReplicaPlacement] = []
    used: set[int] = set()
    cores = _core_groups(spec.data_parallel_size) if cards[0].index == HOST else None
    for replica in range(spec.data_parallel_size):
        need = replica_need(spec, cards[0], max_loaded, process_bytes)
        tp = need.tensor_parallel_size
        if cards[0].index == HOST:
            chosen = [HOST] if free[HOST] >= need.total_bytes else None
        else:
            roomy = [i for i in free if free[i] >= need.total_bytes]
            roomy.sort(key=lambda i: (i in used, -free[i]))  # a card without a sibling replica first
            chosen = roomy[:tp] if len(roomy) >= tp else None
            if chosen:
                need = replica_need(spec, by_index[chosen[0]], max_loaded)
        if not chosen or need.kv_bytes <= 0:
            return None
        for i in chosen:
            free[i] -= need.total_bytes
            used.add(i)
        placements.append(ReplicaPlacement(tuple(sorted(chosen)), need, cores[replica] if cores else None))
    return placements


def _core_groups(num_replicas: int) -> list[tuple[int, ...]] | None:
    """CPU data parallel: the cores this process may use, split into one contiguous group per replica (the CPU
    stand-in for one card each), or None with fewer cores than replicas."""
    if num_replicas < 2 or not hasattr(os, "sched_getaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < num_replicas:
        return None
    size = len(cores) // num_replicas
    return [tuple(cores[r * size:(r + 1) * size]) for r in range(num_replicas)]


def _no_room_message(spec: ModelSpec, cards: list[Card], free: dict[int, int], holders: list[Holder],
                     evicted: list[str], max_loaded: int | None, over_count: bool, process_bytes: int) -> str:
    busy = sorted(h.name for h in holders if not h.idle)
    busy_text = f"; busy, so not unloaded: {', '.join(busy)}" if busy else ""
    if over_count:
        return (f"cannot load {spec.name}: --max-loaded-models {max_loaded} models are loaded and none is idle"
                f"{busy_text}; wait for them to finish or unload one (POST /v1/models/NAME/unload)")
    need = replica_need(spec, cards[0], max_loaded, process_bytes)
    most = max(free.values())
    total_need = need.total_bytes * spec.data_parallel_size
    replicas = f" × {spec.data_parallel_size} replicas" if spec.data_parallel_size > 1 else ""
    where = "the host" if cards[0].index == HOST else "any card"
    missing = max(need.total_bytes - most, total_need - sum(free.values()), 0)
    return (f"cannot load {spec.name}: it needs {need.describe()}{replicas}; the most free on {where} is "
            f"{max(0, most) / GIB:.2f} GiB even after unloading every idle model, so {missing / GIB:.2f} GiB is "
            f"missing{busy_text}. Lower its kv-cache-memory or max-model-len, or raise --memory-budget")
