"""FusedMoE: every expert's weights of one MoE layer stacked into a few tensors, and the routed computation.

Float experts: `w13_weight` [E, 2I, H] holds each expert's gate rows then up rows, `w2_weight` [E, H, I] its down
projection (optional `w13_bias` [E, 2I], `w2_bias` [E, H]); the layout of kernels/moe_torch.py and
kernels/triton_moe.py. AWQ/GPTQ experts keep the packed layout of kernels/quant_torch.py per expert
(`w13_qweight` [E, H/pack, 2I], `w13_scales`/`w13_qzeros` [E, groups, 2I], and the same for w2; named as the
checkpoint names them, so compressed-tensors' are `w13_weight_packed`, `w13_weight_scale`, `w13_weight_zero_point`),
converted from the checkpoint by the linear layers' own IntLinearMethod; under GPTQ act order (desc_act) each
expert's own `w13_g_idx` [E, H] / `w2_g_idx` [E, I] gives every input row's group (gate and up share one, as
GPTQ's shared input makes them), and scales/zeros keep every group on every rank. FP8 experts (`quant_method:
fp8`, Qwen3-*-FP8's block-wise [128, 128] scales `weight_scale_inv`; per-channel/per-tensor `weight_scale`, also
compressed-tensors float) keep `w13_weight` [E, 2I, H] float8_e4m3fn and float32 scales per output row and
column block, `w13_weight_scale_inv` [E, 2I, ceil(H/128)] (methods.expand_block_scales), dequantized in the
kernel as W8A16. MXFP4 experts (gpt-oss) keep their bytes:
`w13_blocks` [E, 2I, H/2] uint8 (two E2M1 codes each) and `w13_scales` [E, 2I, H/32] E8M0, the same for w2.
GGUF experts (llama.cpp's stacked ffn_{gate,up,down}_exps) keep the file's blocks, `w13_weight` [E, 2I, row bytes]
and `w2_weight` [E, H, row bytes], one ggml type per projection, learnt as the first expert loads (an F16 file's
experts stay float); under tensor parallel down's input split must fall between blocks.
Packed experts stay packed in memory: the Triton kernel dequantizes them tile by tile (CUDA), the torch loop one
routed expert at a time (CPU), both through kernels/moe_torch.py's PackedExperts.
Tensor parallel splits each expert's intermediate dim: gate/up outputs (column-parallel) and down inputs
(row-parallel), so every rank computes a partial sum and the MoE block all-reduces it once; a down bias is
added on rank 0 only. `weight_loader(param, tensor, shard_id, expert_id)` takes one checkpoint tensor per
expert and projection (shard "w1" gate, "w3" up, "w2" down; expert_id None: stacked over all experts); each
parameter's `shard_ids` lists the (expert, shard) pairs the loader (engine/models/weights.py) must see.
The forward runs the Triton grouped GEMMs on CUDA and the torch loop otherwise.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.distributed.parallel_state import get_tp_rank, get_tp_size
from engine.quantization.config import QuantConfig
from engine.quantization.gguf.weight import GgufWeight
from engine.quantization.methods import IntLinearMethod, expand_block_scales, fp8_scale_name
from kernels.gguf_torch import block_format
from kernels.moe_torch import ACTIVATIONS, PackedExperts, fused_moe_torch
from kernels.quant_torch import MXFP4_BLOCK

SHARDS = ("w1", "w3", "w2")  # gate, up, down: the names vLLM and Mixtral's checkpoints use


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, activation: str = "silu",
                 bias: bool = False, prefix: str = "", quant: QuantConfig | None = None) -> None:
        super().__init__()
        tp = get_tp_size()
        if intermediate_size % tp:
            raise ValueError(f"{prefix}: the experts' intermediate size ({intermediate_size}, "
                             f"moe_intermediate_size) is not divisible by tensor_parallel_size ({tp}); "
                             "use another --tensor-parallel-size")
        if activation not in ACTIVATIONS:
            raise ValueError(f"{prefix}: MoE activation {activation!r} is not supported "
                             f"({', '.join(ACTIVATIONS)})")
        self.prefix, self.activation, self.quant = prefix, activation, quant
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.intermediate_size = i = intermediate_size // tp  # per rank
        if quant is None:
            self.w13_weight = self._param(torch.empty(num_experts, 2 * i, hidden_size), "w13", 0, 1)
            self.w2_weight = self._param(torch.empty(num_experts, hidden_size, i), "w2", 0, 1)
        else:
            self._packed_params(quant)
        self.w13_bias = self._param(torch.empty(num_experts, 2 * i), "w13", 0, None) if bias else None
        self.w2_bias = self._param(torch.empty(num_experts, hidden_size), "w2", 0, None) if bias else None

    def _packed_params(self, quant: QuantConfig) -> None:
        if quant.weight_type == "mxfp4":
            return self._mxfp4_params()
        if quant.weight_type == "gguf":
            return self._gguf_params()
        if quant.weight_type == "float":
            return self._fp8_params(quant)
        if quant.weight_type != "int":
            raise ValueError(f"{self.prefix}: {quant.describe()} experts are not supported")
        self.method = IntLinearMethod(quant)
        names = self.method.names
        e, h, i, pack = self.num_experts, self.hidden_size, self.intermediate_size, quant.pack_factor
        for proj, k, n in (("w13", h, 2 * i), ("w2", i, h)):
            full_k = k * (get_tp_size() if proj == "w2" else 1)
            group = full_k if quant.group_size == -1 else quant.group_size
            # act order: g_idx picks any group for any row, so every rank keeps every group of the full K
            groups = -(-full_k // group) if quant.act_order else k // group
            if k % pack or (k % group and not quant.act_order and quant.group_size != -1):
                raise ValueError(f"{self.prefix}: {proj} has {k} input features per rank, not whole words of {pack} "
                                 f"and groups of {group} (group_size); use another --tensor-parallel-size")
            setattr(self, f"{proj}_group_size", group if quant.group_size != -1 else k)
            if quant.act_order:
                p = self._param(torch.empty(e, k, dtype=torch.int32), proj, None, 0)
                p.role = "g_idx"
                setattr(self, f"{proj}_{names['g_idx']}", p)
            for role, rows, dtype in (("qweight", k // pack, torch.int32),
                                      ("scales", max(groups, 1), self.method.scale_dtype),
                                      ("zeros", max(groups, 1), self.method.zero_dtype)):
                name = f"{proj}_{names[role]}"
                data = torch.empty(e, rows, n, dtype=dtype)
                if role == "zeros" and quant.method == "compressed-tensors" and quant.symmetric:
                    # nothing stored: symmetric codes are offset by half their range
                    self.register_buffer(name, data.fill_(1 << (quant.bits - 1)), persistent=False)
                    continue
                # act order's scales and zeros are not split along K: every rank holds all groups
                whole = role != "qweight" and (quant.act_order or quant.group_size == -1)
                p = self._param(data, proj, 1, None if whole else 0)
                p.role = role
                setattr(self, name, p)

    def _fp8_params(self, quant: QuantConfig) -> None:
        self.method = None
        self.fp8_scale = fp8_scale_name(quant)
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        cols = quant.weight_block[1] if quant.weight_block else None
        for proj, k, n in (("w13", h, 2 * i), ("w2", i, h)):
            if cols is not None and proj == "w2" and get_tp_size() > 1 and k % cols:
                raise ValueError(f"{self.prefix}: w2 has {k} input features per rank, not whole FP8 blocks of "
                                 f"{cols} (weight_block_size {list(quant.weight_block)}); use another "
                                 "--tensor-parallel-size")
            setattr(self, f"{proj}_weight", self._param(torch.empty(e, n, k, dtype=torch.float8_e4m3fn), proj, 0, 1))
            setattr(self, f"{proj}_group_size", cols or k)
            scales = self._param(torch.empty(e, n, -(-k // cols) if cols else 1, dtype=torch.float32), proj, 0,
                                 1 if cols else None)
            scales.role = "fp8_scales"
            setattr(self, f"{proj}_{self.fp8_scale}", scales)

    def _mxfp4_params(self) -> None:
        self.method = None
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        for proj, k, n in (("w13", h, 2 * i), ("w2", i, h)):
            if k % MXFP4_BLOCK:
                raise ValueError(f"{self.prefix}: {proj} has {k} input features per rank, not whole MXFP4 blocks of "
                                 f"{MXFP4_BLOCK}; use another --tensor-parallel-size")
            for leaf, cols in (("blocks", k // 2), ("scales", k // MXFP4_BLOCK)):
                p = self._param(torch.empty(e, n, cols, dtype=torch.uint8), proj, 0, 1)
                p.role = f"mxfp4_{leaf}"
                setattr(self, f"{proj}_{leaf}", p)

    def _gguf_params(self) -> None:
        """GGUF experts: `w13_weight` [E, 2I, row bytes] / `w2_weight` [E, H, row bytes] in the file's blocks, one
        ggml type per projection (or floats for an F16/BF16/F32 file), learnt from the first expert loaded."""
        self.method = None
        self.float_dtype = torch.get_default_dtype()  # the model's dtype, set while it is built
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        for proj, n in (("w13", 2 * i), ("w2", h)):
            p = self._param(torch.empty(e, n, 0, dtype=torch.uint8), proj, 0, 1)
            p.role, p.gguf, p.gguf_type = "gguf", True, None  # gguf: the loader hands over GgufWeights as they are
            setattr(self, f"{proj}_weight", p)

    def _copy_gguf(self, param: nn.Parameter, loaded, shard_id: str, expert_id: int) -> None:
        """One expert's gate, up (this rank's rows) or down (this rank's input columns, whole blocks) as stored."""
        i, rank = self.intermediate_size, get_tp_rank()
        where = f"{self.prefix} expert {expert_id} {shard_id}"
        if isinstance(loaded, GgufWeight):
            piece = loaded.columns_slice(rank * i, i, where) if shard_id == "w2" else loaded.narrow(0, rank * i, i)
            kind, data = piece.type_id, piece.data
        else:
            data = loaded.narrow(1, rank * i, i) if shard_id == "w2" else loaded.narrow(0, rank * i, i)
            kind, data = "float", data.to(self.float_dtype)
        if param.gguf_type is None:  # the first expert decides the projection's layout
            param.gguf_type = kind
            param.data = torch.empty(self.num_experts, param.shape[1], data.shape[-1], dtype=data.dtype,
                                     device=param.device)
        elif param.gguf_type != kind:
            raise ValueError(f"{where} is stored as {_type_name(kind)}, the layer's other {param.proj} experts as "
                             f"{_type_name(param.gguf_type)}; GGUF experts of one projection must share a type")
        dst = param.data[expert_id]
        if shard_id != "w2":
            dst = dst.narrow(0, 0 if shard_id == "w1" else i, i)
        if dst.shape != data.shape:
            raise ValueError(f"{where}: GGUF rows of shape {tuple(data.shape)} do not fit {tuple(dst.shape)}")
        dst.copy_(data)

    def packed_experts(self, proj: str, dtype: torch.dtype) -> PackedExperts | torch.Tensor:
        """One projection's packed experts as the kernels take them (dequantized to `dtype`)."""
        if self.quant.weight_type == "gguf":
            w = getattr(self, f"{proj}_weight")
            return w if w.gguf_type == "float" else PackedExperts("gguf", w.data, ggml_type=w.gguf_type, dtype=dtype)
        if self.quant.weight_type == "mxfp4":
            return PackedExperts("mxfp4", getattr(self, f"{proj}_blocks"), getattr(self, f"{proj}_scales"),
                                 dtype=dtype)
        group = getattr(self, f"{proj}_group_size")
        if self.quant.weight_type == "float":
            return PackedExperts("fp8", getattr(self, f"{proj}_weight"), getattr(self, f"{proj}_{self.fp8_scale}"),
                                 bits=8, group_size=group, dtype=dtype)
        names = self.method.names
        qweight, scales, zeros = (getattr(self, f"{proj}_{names[role]}") for role in ("qweight", "scales", "zeros"))
        g_idx = getattr(self, f"{proj}_{names['g_idx']}") if self.quant.act_order else None
        return PackedExperts("int", qweight, scales, zeros, self.quant.bits, group, dtype, g_idx)

    def _param(self, data: torch.Tensor, proj: str, out_dim: int, in_dim: int | None) -> nn.Parameter:
        p = nn.Parameter(data, requires_grad=False)
        p.weight_loader = self.weight_loader
        p.proj, p.out_dim, p.in_dim, p.role = proj, out_dim, in_dim, "weight"  # dims of one expert's tensor
        shards = ("w1", "w3") if proj == "w13" else ("w2",)
        # What the loader (engine/models/weights.py) must see exactly once: every expert's gate and up, or down.
        p.shard_ids = {(e, s) for e in range(self.num_experts) for s in shards}
        return p

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str,
                      expert_id: int | None = None) -> None:
        if shard_id not in SHARDS:
            raise ValueError(f"{self.prefix}: expert shard {shard_id!r} is not one of {', '.join(SHARDS)}")
        if expert_id is None:  # stacked over experts, e.g. gpt-oss's [E, ...] tensors
            if loaded.shape[0] != self.num_experts:
                raise ValueError(f"{self.prefix}: a stacked expert tensor of shape {tuple(loaded.shape)} has "
                                 f"{loaded.shape[0]} experts, the config says {self.num_experts}")
            for e in range(self.num_experts):
                self.weight_loader(param, loaded[e], shard_id, e)
            return
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"{self.prefix}: expert {expert_id} is out of range (num_experts {self.num_experts})")
        if (param.proj == "w13") != (shard_id != "w2"):
            raise ValueError(f"{self.prefix}: shard {shard_id!r} does not belong in {param.proj}")
        if param.role == "gguf":
            return self._copy_gguf(param, loaded, shard_id, expert_id)
        if param.role.startswith("mxfp4_"):
            if loaded.dtype != torch.uint8:
                raise ValueError(f"{self.prefix}: MXFP4 expert {param.role[6:]} {shard_id} has dtype {loaded.dtype}, "
                                 "expected uint8")
        elif param.role == "fp8_scales":
            loaded = self._fp8_scales(param, loaded, shard_id)
        elif param.role == "weight" and param.dtype == torch.float8_e4m3fn and loaded.dtype != param.dtype:
            raise ValueError(f"{self.prefix}: FP8 expert weight {shard_id} has dtype {loaded.dtype}, expected "
                             "float8_e4m3fn")
        elif param.role == "g_idx":
            return self._copy_g_idx(param, param.data[expert_id], self.method.convert(param, loaded), shard_id,
                                    expert_id)
        elif param.role != "weight":
            loaded = self.method.convert(param, loaded)
        self._copy(param, param.data[expert_id], loaded, shard_id)

    def _fp8_scales(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> torch.Tensor:
        """A checkpoint scale in this layer's form: block scales repeated over their rows, a per-tensor scale
        over every row, per-channel [N] / [N, 1] as [N, 1]."""
        block = self.quant.weight_block
        if block is not None:
            return expand_block_scales(loaded, block[0])
        rows = param.shape[1] // (2 if shard_id != "w2" else 1) * (get_tp_size() if shard_id != "w2" else 1)
        loaded = loaded.to(torch.float32).reshape(-1, 1)
        return loaded.expand(rows, 1) if loaded.shape[0] == 1 else loaded

    def _copy_g_idx(self, param: nn.Parameter, dst: torch.Tensor, loaded: torch.Tensor, shard_id: str,
                    expert_id: int) -> None:
        """One expert's g_idx: down's is this rank's rows of I; gate's and up's (both over all of H) must agree,
        since the experts' w13 keeps one (GPTQ gives them one: they see the same input)."""
        if shard_id == "w2":
            return self._copy(param, dst, loaded, shard_id)
        if loaded.shape != dst.shape:
            raise ValueError(f"{self.prefix}: expert {expert_id} {shard_id} g_idx has shape {tuple(loaded.shape)}, "
                             f"expected {tuple(dst.shape)}")
        seen = param.__dict__.setdefault("loaded_g_idx", set())
        if expert_id in seen and not torch.equal(dst, loaded.to(dst.device)):
            raise ValueError(f"{self.prefix}: expert {expert_id} has different g_idx for gate_proj and up_proj; "
                             "such checkpoints are not supported")
        seen.add(expert_id)
        dst.copy_(loaded)

    def _copy(self, param: nn.Parameter, dst: torch.Tensor, loaded: torch.Tensor, shard_id: str) -> None:
        rank = get_tp_rank()
        if param is self.w2_bias:  # the down bias, summed by the all-reduce: rank 0 only
            src = loaded if rank == 0 else torch.zeros_like(loaded)
        elif shard_id == "w2" and param.in_dim is None:  # not split along K (act order's groups): replicated
            src = loaded
        elif shard_id == "w2":
            size = dst.shape[param.in_dim]
            src = _narrow(loaded, param.in_dim, rank * size, size, self.prefix)
        else:
            size = dst.shape[param.out_dim] // 2
            dst = dst.narrow(param.out_dim, 0 if shard_id == "w1" else size, size)
            src = _narrow(loaded, param.out_dim, rank * size, size, self.prefix)
        if src.shape != dst.shape:
            raise ValueError(f"{self.prefix}: expert tensor {shard_id} of shape {tuple(loaded.shape)} does not fit "
                             f"the parameter slice {tuple(dst.shape)} (per rank)")
        dst.copy_(src)

    @property
    def graph_safe(self) -> bool:
        """Whether a CUDA graph can hold this layer's forward: on a card every weight format (float, AWQ/GPTQ,
        FP8, MXFP4) runs the Triton grouped GEMMs, which route and sort on the device; the torch loop (off a
        card) reads each expert's token count on the host."""
        return next(self.parameters()).device.type == "cuda"

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum of the routed experts' outputs, [T, H] (the block all-reduces it)."""
        if self.quant is not None:  # packed: dequantized inside the kernel, or one routed expert at a time
            w13, w2 = self.packed_experts("w13", x.dtype), self.packed_experts("w2", x.dtype)
        else:
            w13, w2 = self.w13_weight, self.w2_weight
        if x.is_cuda:
            from kernels.triton_moe import fused_moe_triton
            return fused_moe_triton(x, w13, w2, topk_weights, topk_ids, self.activation, self.w13_bias,
                                    self.w2_bias)
        return fused_moe_torch(x, w13, w2, topk_weights.to(x.dtype), topk_ids, self.activation, self.w13_bias,
                               self.w2_bias)


def _type_name(kind) -> str:
    return kind if kind == "float" else block_format(kind).name


def _narrow(t: torch.Tensor, dim: int, start: int, size: int, prefix: str) -> torch.Tensor:
    if t.dim() <= dim or t.shape[dim] < start + size:
        raise ValueError(f"{prefix}: expert tensor of shape {tuple(t.shape)} has no [{start}, {start + size}) "
                         f"along dim {dim}")
    return t.narrow(dim, start, size)
