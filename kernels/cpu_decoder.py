"""A Llama-style decoder's float32 decode step on the CPU, every layer in one native call (kernels/decoder_layers.c).

The layer modules already run each piece natively (the row GEMMs, the norms, RoPE, the KV write inside the paged
attention), but a layer still makes ~25 Python calls between them, and after each GEMM has streamed its weights
through the cache every one of those frames, dispatch tables and tensor headers comes back from memory: on the
2-core AMD machine the glue of a batch-1 step cost ~2 ms on the tiny model and 5-6 ms beside 15-16 ms of GEMMs on
the wide one (BENCHMARKS.md). Here the layers' tensors are turned into pointers once (`DecoderLayers`), and a step
is one call with the step's rows, each RoPE table's cos/sin and each KV cache group's attention layout. The C side
calls the same functions as the modules with the same settings (the GEMMs' and the attention's thread rules are
shared: `cpu_linear`'s work threshold, `cpu_rows_gemm`'s chunking, `attention_cpu.decode_plan`), so its outputs
equal the modules' bit for bit (tests/test_cpu_decoder.py; per-head q/k norms to float32 rounding: the modules
leave those to torch). The engine decides when a model and a step qualify (engine/layers/fused_decode.py).
Imports nothing of ours outside kernels/.
"""
from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, NamedTuple, Sequence

import torch

from kernels import cpu_linear
from kernels.gguf_cpu import decodes
from kernels.gguf_torch import row_bytes
from kernels.native_kernels import CHUNKS_PER_THREAD, library

if TYPE_CHECKING:
    from kernels.attention_cpu import StepLayout

_P, _N, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_float
# decoder_layers.c's: KV cache groups (Gemma 3 27B has 5), RoPE tables, GGUF runs of one linear
MAX_GROUPS, MAX_ROPES, MAX_RUNS = 16, 4, 4
LINEARS = ("qkv", "o", "gate_up", "down")
# A GGUF linear's weight as its file holds it: per run of output features, (ggml type, blocks [rows, row bytes])
GgufRuns = tuple[tuple[int, torch.Tensor], ...]


class _Run(ctypes.Structure):
    _fields_ = [("type", _N), ("w", _P), ("rows", _N), ("row_bytes", _N)]


class _Weight(ctypes.Structure):
    _fields_ = [("runs", _N), ("run", _Run * MAX_RUNS)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("qkv", _Weight), ("o", _Weight), ("post_norm", _P), ("gate_up", _Weight),
                ("down", _Weight),
                *((name, _P) for name in ("qkv_bias", "o_bias", "gate_up_bias", "down_bias", "q_norm", "k_norm",
                                          "pre_ff_norm", "post_ff_norm", "k_cache", "v_cache")),
                ("group", _N), ("rope", _N)]


def _weight(w: torch.Tensor | GgufRuns, name: str, shape: tuple[int, int]) -> _Weight:
    """A linear's weight as the kernel takes it: a float32 [out, in] matrix (one run), or GGUF runs of the block
    formats kernels/gguf_gemm.c decodes; ValueError for anything else."""
    rows, depth = shape
    if isinstance(w, torch.Tensor):
        if tuple(w.shape) != shape or w.dtype != torch.float32 or not w.is_cpu or not w.is_contiguous():
            raise ValueError(f"{name}: {tuple(w.shape)} {w.dtype} is not a contiguous float32 {shape}")
        return _Weight(1, (_Run * MAX_RUNS)(_Run(-1, w.data_ptr(), rows, 4 * depth)))
    runs = []
    for ggml_type, blocks in w:
        if not decodes(ggml_type, depth) or blocks.dtype != torch.uint8 or not blocks.is_cpu \
                or not blocks.is_contiguous() or blocks.dim() != 2 or blocks.shape[1] != row_bytes(ggml_type, depth):
            raise ValueError(f"{name}: a GGUF run of type {ggml_type}, {tuple(blocks.shape)} is not one it decodes")
        runs.append(_Run(ggml_type, blocks.data_ptr(), blocks.shape[0], blocks.shape[1]))
    if not 0 < len(runs) <= MAX_RUNS or sum(run.rows for run in runs) != rows:
        raise ValueError(f"{name}: {len(runs)} GGUF runs of {sum(run.rows for run in runs)} rows for {rows}")
    return _Weight(len(runs), (_Run * MAX_RUNS)(*runs))


class _Spec(ctypes.Structure):
    _fields_ = [*((name, _N) for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate",
                                          "block_size", "block_stride", "token_stride", "head_stride")),
                ("eps", _F), ("norm_offset", _F), ("scale", _F), ("soft_cap", _F), ("gelu", _N),
                ("linear_min_work", _N), ("chunks_per_thread", _N), ("rotary_dim", _N * MAX_ROPES),
                ("layer", ctypes.POINTER(_Layer))]


class _Group(ctypes.Structure):
    _fields_ = [("tables", _P), ("table_width", _N), ("slots", _P), ("window", _N), ("attention_threads", _N),
                ("heads_per_item", _N)]


class _Step(ctypes.Structure):
    _fields_ = [("seq_lens", _P), ("rows", _P), ("num_seqs", _N), ("group", _Group * MAX_GROUPS),
                ("cos", _P * MAX_ROPES), ("sin", _P * MAX_ROPES)]


class LayerTensors(NamedTuple):
    """One layer's weights: the linears' float32 [out, in] (QKV stacked q | k | v, gate/up stacked gate | up) or a
    GGUF file's runs of blocks, the norms' float32, the linears' biases, the per-head q/k norms' and Gemma's pre- and
    post-MLP norms' weights (None: none), and its KV caches [blocks, block_size, kv_heads, head_dim]."""
    input_norm: torch.Tensor
    qkv: torch.Tensor | GgufRuns
    o: torch.Tensor | GgufRuns
    post_norm: torch.Tensor
    gate_up: torch.Tensor | GgufRuns
    down: torch.Tensor | GgufRuns
    qkv_bias: torch.Tensor | None
    o_bias: torch.Tensor | None
    gate_up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    pre_ff_norm: torch.Tensor | None
    post_ff_norm: torch.Tensor | None
    k_cache: torch.Tensor
    v_cache: torch.Tensor


class DecoderLayers:
    def __init__(self, layers: Sequence[LayerTensors], *, groups: Sequence[int], ropes: Sequence[int], heads: int,
                 kv_heads: int, head_dim: int, rotary_dims: Sequence[int], windows: Sequence[int | None],
                 eps: float, norm_offset: float, scale: float, soft_cap: float | None, gelu: bool) -> None:
        """`groups[i]` and `ropes[i]`: layer i's KV cache group and RoPE table (indices into `windows`, each group's
        sliding window or None, and `rotary_dims`, each table's rotated dims; -1: a layer without RoPE). Raises
        ValueError where a tensor is not what the kernel reads (the caller keeps the module path)."""
        native = library()
        if native is None or not layers:
            raise ValueError("no native build of the decoder kernel")
        if not (len(windows) <= MAX_GROUPS and len(rotary_dims) <= MAX_ROPES and len(groups) == len(ropes)
                == len(layers) and set(groups) <= set(range(len(windows)))
                and set(ropes) <= set(range(-1, len(rotary_dims)))):
            raise ValueError(f"{len(windows)} KV cache groups, {len(rotary_dims)} RoPE tables")
        # numba's modules, imported here, not above: a GPU machine's bare environment has no numba and never gets here
        from kernels import attention_cpu
        self._run = native.pagedesk_decoder_layers
        self._decode_plan, self._heads_per_item = attention_cpu.decode_plan, attention_cpu.heads_per_item
        self._pool_threads = attention_cpu.pool_threads
        hidden = layers[0].input_norm.shape[0]
        gate_up = layers[0].gate_up
        gate_up_rows = gate_up.shape[0] if isinstance(gate_up, torch.Tensor) else sum(b.shape[0] for _, b in gate_up)
        intermediate = gate_up_rows // 2
        linears = {"qkv": ((heads + 2 * kv_heads) * head_dim, hidden), "o": (hidden, heads * head_dim),
                   "gate_up": (2 * intermediate, hidden), "down": (hidden, intermediate)}
        vectors = {"input_norm": hidden, "post_norm": hidden, **{f"{name}_bias": linears[name][0] for name in LINEARS},
                   "q_norm": head_dim, "k_norm": head_dim, "pre_ff_norm": hidden, "post_ff_norm": hidden}
        cache = layers[0].k_cache
        weights = []
        for layer in layers:
            weights.append({name: _weight(getattr(layer, name), name, shape) for name, shape in linears.items()})
            for name, size in vectors.items():
                t = getattr(layer, name)
                if t is None and name not in ("input_norm", "post_norm"):
                    continue
                if tuple(t.shape) != (size,) or t.dtype != torch.float32 or not t.is_cpu or not t.is_contiguous():
                    raise ValueError(f"{name}: {tuple(t.shape)} {t.dtype} is not a contiguous float32 ({size},)")
            for c in (layer.k_cache, layer.v_cache):
                if c.dtype != torch.float32 or not c.is_cpu or c.dim() != 4 or c.stride() != cache.stride() \
                        or c.stride(3) != 1 or tuple(c.shape[1:]) != (cache.shape[1], kv_heads, head_dim):
                    raise ValueError(f"KV cache {tuple(c.shape)} {c.dtype} is not one the kernel reads")
            if (layer.q_norm is None) != (layer.k_norm is None) or \
                    (layer.pre_ff_norm is None) != (layer.post_ff_norm is None):
                raise ValueError("q without k norms, or one of the sandwich norms without the other")
        if any(d % 2 or not 0 < d <= head_dim for d in rotary_dims) or heads % kv_heads:
            raise ValueError(f"rotary dims {list(rotary_dims)}, {heads} heads over {kv_heads} KV heads")
        # The weights are kept (the kernel reads them), the caches not: a released pool (sleep mode) must leave the
        # process; the caller makes another of these for caches bound anew.
        self.weights = tuple(layer[:-2] for layer in layers)
        self.heads, self.kv_heads, self.head_dim, self.windows = heads, kv_heads, head_dim, tuple(windows)
        self.row_floats = hidden + (2 * heads + 2 * kv_heads) * head_dim + 3 * intermediate  # scratch per row
        pointer = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        self._layers = (_Layer * len(layers))(*(
            _Layer(**weight, **{name: pointer(getattr(layer, name)) for name in vectors},
                   k_cache=pointer(layer.k_cache), v_cache=pointer(layer.v_cache), group=group, rope=rope)
            for layer, weight, group, rope in zip(layers, weights, groups, ropes)))
        self._spec = _Spec(len(layers), hidden, heads, kv_heads, head_dim, intermediate, cache.shape[1],
                           *cache.stride()[:3], eps, norm_offset, scale, soft_cap or 0.0, int(gelu),
                           cpu_linear.PARALLEL_MIN_WORK, CHUNKS_PER_THREAD, (_N * MAX_ROPES)(*rotary_dims),
                           self._layers)
        self._spec_address = ctypes.addressof(self._spec)
        self._step = _Step()
        self._step_address = ctypes.addressof(self._step)
        self._scratch = torch.empty(0)

    def __call__(self, x: torch.Tensor, cos_sin: Sequence[tuple[torch.Tensor, torch.Tensor]],
                 layouts: Sequence[StepLayout]) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer over x [rows, hidden] (contiguous float32, overwritten: the caller's own), a step of one decode
        per row: each RoPE table's cos and sin [rows, 1, rotary_dim] as engine/layers/rotary.py lays them out, and
        each KV cache group's `layout` (with its slots). Returns (the last layer's output, the residual) as the layer
        modules do."""
        rows = x.shape[0]
        if self._scratch.numel() < rows * self.row_floats:
            self._scratch = torch.empty(rows * self.row_floats, dtype=torch.float32)
        residual = torch.empty_like(x)
        step = self._step
        for i, layout in enumerate(layouts):
            window, threads = self._decode_plan(layout, self.heads, self.head_dim, self.windows[i])
            tables, lens, seq_rows = layout.native_addresses()
            step.group[i] = _Group(tables, layout.decode_tables.shape[1], layout.slots.data_ptr(), window, threads,
                                   self._heads_per_item(self.kv_heads, layout.decode.size, threads))
        step.seq_lens, step.rows, step.num_seqs = lens, seq_rows, layouts[0].decode.size
        for i, (cos, sin) in enumerate(cos_sin):
            step.cos[i], step.sin[i] = cos.data_ptr(), sin.data_ptr()
        self._run(self._spec_address, rows, x.data_ptr(), residual.data_ptr(), self._scratch.data_ptr(),
                  self._step_address, self._pool_threads())
        return x, residual
