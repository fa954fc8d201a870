"""Where an engine goes and how much it may take: the capacity planner's arithmetic over each card's free memory.

A card's budget is `--memory-budget` GiB, or what the engine itself would use (total × gpu_memory_utilization
minus what other programs held at start); on CPU the host is one "card" whose budget is `--memory-budget` or
the available RAM. A replica needs, per card, its weights, its activation peak and overhead (the planner's
`estimate_profile`, engine/planning/planner.py; a speculative draft model or MTP head and a hybrid model's verify
scratch in its weights, verify graphs in its overhead; on a card the CUDA context, on the host each process's own
baseline: the interpreter, torch and the server, measured by the manager from the engines it runs,
CPU_PROCESS_BYTES until it has one) plus an absolute KV budget: the model's `kv-cache-memory` if given, else on
CUDA the card's budget divided by `--max-loaded-models` (all of it when unset), capped at max_num_seqs full
sequences, and on CPU the pool of the engine's own default; a budget that holds a pool holds its draft pages and
a hybrid model's state pool too (`kv_pool_budget_bytes`). `place` picks cards for every replica of a model
(replicas of one model on different cards where it can), evicting idle models least recently used first, or says
in GiB what is missing. Pure arithmetic: the manager owns the state.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from engine.config.flags import DEFAULT_CPU_KV_CACHE_GIB
from engine.config.gguf_file import is_gguf
from engine.config.model import DTYPE_BYTES, ModelConfig
from engine.config.speculative import SpeculativeConfig, parse_speculative_config
from engine.entrypoints.router.specs import ModelSpec
from engine.kv.kv_cache_interface import model_kv_layout
from engine.planning.kv import blocks_per_full_seq, kv_pool_budget_bytes, verify_scratch_bytes
from engine.planning.planner import CUDA_CONTEXT_BYTES, estimate_profile, plan_cpu
from engine.planning.speculation import speculation_footprint
from engine.planning.units import GIB, MIB, kv_dtype_bytes, resolve_dtype

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
    if path.is_dir() or (is_gguf(path) and path.is_file()):  # a GGUF file is its own config
        return path
    try:
        from huggingface_hub import hf_hub_download
        return Path(hf_hub_download(path_or_repo, "config.json", revision=revision)).parent
    except Exception as exc:  # noqa: BLE001 - not a folder, not a repo, or offline: one sentence
        raise ValueError(f"{what}: {path_or_repo} is not a model folder, and its config.json could not "
                         f"be read from the Hugging Face hub ({type(exc).__name__})") from None


def speculation_model(spec: SpeculativeConfig | None) -> tuple[ModelConfig | None, bool]:
    """A replica's speculative draft model (its config.json read) and whether it speculates with its MTP head;
    (None, False) without speculation or for n-gram."""
    if spec is None or spec.method in ("ngram", "mtp"):
        return None, spec is not None and spec.method == "mtp"
    return ModelConfig.from_folder(config_folder(spec.model, None, "speculative_config.model")), False


def replica_need(spec: ModelSpec, card: Card, max_loaded_models: int | None,
                 process_bytes: int = CPU_PROCESS_BYTES) -> ReplicaNeed:
    """One replica's bytes per card, from the model's config.json and its flags (no weights read);
    `process_bytes`: one engine process's baseline on the host (each tensor-parallel rank is a process)."""
    config = spec.engine_config()
    on_gpu = card.index != HOST
    cfg = ModelConfig.from_folder(model_folder(spec), config.quantization).with_max_model_len(
        config.max_model_len).with_image_limit(config.image_limit())
    dtype = resolve_dtype(config.dtype, cfg.torch_dtype, on_gpu)
    dtype_bytes = DTYPE_BYTES[dtype]
    kv_bytes = kv_dtype_bytes(config.kv_cache_dtype, dtype_bytes)
    tp, seats, block_size = config.tensor_parallel_size, config.max_num_seqs, config.block_size
    speculative = parse_speculative_config(config.speculative_config)
    k = speculative.k if speculative is not None else 0
    step_tokens = config.resolve_max_num_batched_tokens(cfg.max_model_len)
    profile = estimate_profile(cfg, card.budget_bytes, dtype_bytes=dtype_bytes, tensor_parallel_size=tp,
                               max_num_batched_tokens=step_tokens, max_num_seqs=seats,
                               cuda_graphs=on_gpu and not config.enforce_eager,
                               cuda_graph_mode=config.cuda_graph_mode, num_speculative_tokens=k,
                               max_image_pixels=config.max_image_pixels,
                               processor_kwargs=config.processor_kwargs())
    layout = model_kv_layout(cfg, block_size, kv_bytes, tp, act_dtype_bytes=dtype_bytes)
    draft, mtp = speculation_model(speculative)  # on the replica's first card; its KV pages share the budget
    draft_weights, draft_per_block = speculation_footprint(cfg, dtype_bytes, kv_bytes, block_size, tp, draft, mtp)
    weights = profile.weights_bytes + draft_weights + verify_scratch_bytes(layout, seats, k, step_tokens)
    # A VL model's encoder cache at its fullest is set aside on every card, as the engine's sizing does.
    overhead = profile.overhead_bytes + profile.encoder_cache_bytes + (CUDA_CONTEXT_BYTES if on_gpu else
                                                                      process_bytes * tp)
    fixed = weights + profile.activation_bytes + overhead
    caching = config.enable_prefix_caching
    if config.num_gpu_blocks_override is not None:
        kv = kv_pool_budget_bytes(layout, config.num_gpu_blocks_override, seats, caching, draft_per_block)
    elif config.kv_cache_memory is not None:
        kv = int(config.kv_cache_memory * GIB)
    elif not on_gpu:
        plan = plan_cpu(cfg, DEFAULT_CPU_KV_CACHE_GIB, dtype=dtype, kv_cache_dtype=config.kv_cache_dtype,
                        max_num_seqs=seats, block_size=block_size, max_num_batched_tokens=step_tokens,
                        enable_prefix_caching=caching, draft=draft, num_speculative_tokens=k, mtp=mtp)
        kv = kv_pool_budget_bytes(layout, plan.num_blocks, seats, caching, draft_per_block) if plan.num_blocks else 0
    else:  # every seat's full-length sequence, and not more
        most_useful = seats * blocks_per_full_seq(layout, cfg.max_model_len, block_size, step_tokens)
        kv = min(kv_pool_budget_bytes(layout, most_useful, seats, caching, draft_per_block),
                 card.budget_bytes // (max_loaded_models or 1) - fixed)
        if kv < kv_pool_budget_bytes(layout, 1, seats, caching, draft_per_block):
            kv = 0  # not even one block beside a hybrid model's state pool
    return ReplicaNeed(weights, profile.activation_bytes, overhead, max(0, kv), tp)


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
