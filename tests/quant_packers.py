"""Test-only packers: turn a tiny float model folder into an AWQ, GPTQ, compressed-tensors or FP8 checkpoint.

Written from each format's public description, independently of the engine's loader: AWQ gemm packs eight
4-bit codes per int32 along the output dim in the interleaved order 0,2,4,6,1,3,5,7 (qweight [K, N/8], qzeros
[G, N/8], scales [G, N]); GPTQ packs codes along the input dim (qweight [K*bits/32, N]) and zero points along
the output dim, and its v1 format stores zero - 1 (readers add one back after masking the bits; AutoRound's
`auto_round:auto_gptq` packing is the same, with its own quantization_config); act order
stores g_idx, the group of every input row. compressed-tensors pack-quantized stores weight_packed [N, K*bits/32]
with signed codes offset by 2**(bits-1), weight_scale [N, G], weight_zero_point packed along N. FP8 stores e4m3
weights [N, K] with a per-channel/per-tensor `weight_scale`, or with `weight_block_size` [rows, cols] (Qwen3-*-FP8,
DeepSeek) one float32 `weight_scale_inv` per block, [ceil(N/rows), ceil(K/cols)], the weight being value * scale
(compressed-tensors' block strategy names it `weight_scale`). `dequantized_folder`
reads a packed folder back (again independently) into a plain float checkpoint for HF transformers: the oracle.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def pack(codes: torch.Tensor, bits: int, dim: int, order: list[int] | None = None) -> torch.Tensor:
    """Pack unsigned codes along `dim` into int32 words, word slot i taking element order[i] of each run."""
    per = 32 // bits
    c = codes.movedim(dim, -1).to(torch.int64)
    c = c.reshape(*c.shape[:-1], c.shape[-1] // per, per)
    words = torch.zeros(c.shape[:-1], dtype=torch.int64)
    for slot in range(per):
        words |= (c[..., (order or range(per))[slot]] & ((1 << bits) - 1)) << (bits * slot)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)
    return words.to(torch.int32).movedim(-1, dim).contiguous()


def unpack(words: torch.Tensor, bits: int, dim: int, order: list[int] | None = None) -> torch.Tensor:
    per = 32 // bits
    w = words.movedim(dim, -1).to(torch.int64) & 0xFFFFFFFF
    slots = torch.stack([(w >> (bits * s)) & ((1 << bits) - 1) for s in range(per)], -1)
    if order:  # element j of a run sits in slot order.index(j)
        slots = slots[..., [order.index(j) for j in range(per)]]
    return slots.reshape(*w.shape[:-1], -1).movedim(-1, dim)


def quantize(w: torch.Tensor, bits: int, group: int, sym: bool, g_idx: torch.Tensor, scale_dtype):
    """Round-to-nearest codes [N, K], scales [G, N] and unsigned zero points [G, N] for groups given by g_idx."""
    n, k = w.shape
    maxq = (1 << bits) - 1
    num_groups = int(g_idx.max()) + 1
    scales, zeros = torch.empty(num_groups, n), torch.empty(num_groups, n, dtype=torch.int64)
    for g in range(num_groups):
        cols = w[:, g_idx == g]
        lo, hi = cols.min(1).values.clamp(max=0), cols.max(1).values.clamp(min=0)
        if sym:
            scales[g] = torch.maximum(-lo, hi).clamp(min=1e-5) / ((maxq + 1) // 2)
            zeros[g] = (maxq + 1) // 2
        else:
            scales[g] = (hi - lo).clamp(min=1e-5) / maxq
            zeros[g] = torch.round(-lo / scales[g]).clamp(0, maxq)
    scales = scales.to(scale_dtype)
    s, z = scales.float()[g_idx].t(), zeros[g_idx].t()
    codes = torch.clamp(torch.round(w / s) + z, 0, maxq).to(torch.int64)
    return codes, scales, zeros


def make_g_idx(k: int, group: int, act_order: bool, seed: int) -> torch.Tensor:
    size = k if group == -1 else group
    if not act_order:
        return torch.arange(k) // size
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))  # the order GPTQ visits rows in
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[perm] = torch.arange(k) // size
    return g_idx


def quantization_config(fmt: str, bits: int, group: int, sym: bool, act_order: bool, ignore: list[str],
                        strategy: str = "channel", block: tuple[int, int] | None = None) -> dict:
    if fmt == "awq":
        return {"quant_method": "awq", "version": "gemm", "bits": bits, "group_size": group, "zero_point": True,
                "modules_to_not_convert": ignore or None}
    if fmt == "auto-round":  # AutoRound's own format, GPTQ v1 packing; the routers listed as kept in 16 bits
        return {"quant_method": "auto-round", "packing_format": "auto_round:auto_gptq", "bits": bits,
                "group_size": group, "sym": sym, "data_type": "int", "autoround_version": "0.6.0",
                "extra_config": {f"model.layers.{i}.mlp.gate": {"bits": 16, "data_type": "float"} for i in range(2)}}
    if fmt in ("gptq", "gptq_v2"):
        return {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym, "desc_act": act_order,
                "checkpoint_format": fmt, "static_groups": False, "true_sequential": True,
                "modules_to_not_convert": ignore or None}
    if fmt == "ct":
        weights = {"num_bits": bits, "type": "int", "symmetric": sym, "dynamic": False,
                   "strategy": "channel" if group == -1 else "group", "group_size": None if group == -1 else group,
                   "actorder": "group" if act_order else None}
        return {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head", *ignore],
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
                "quantization_status": "compressed"}
    if fmt == "ct-fp8":
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": strategy,
                   "block_structure": list(block) if strategy == "block" else None}
        acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "token"}
        return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head", *ignore],
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}}}
    assert fmt == "fp8"
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "modules_to_not_convert": ignore or None}
    if block:  # Qwen3-30B-A3B-FP8's config: fmt e4m3, weight_block_size [128, 128]
        qc |= {"fmt": "e4m3", "weight_block_size": list(block)}
    return qc


def fp8_block_quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 values [N, K] and float32 scales [ceil(N/rows), ceil(K/cols)]: each block's amax maps to 448."""
    rows, cols = block
    n, k = w.shape
    nb, kb = -(-n // rows), -(-k // cols)
    padded = torch.zeros(nb * rows, kb * cols)
    padded[:n, :k] = w.float()
    amax = padded.view(nb, rows, kb, cols).abs().amax(dim=(1, 3))
    scale = amax.clamp(min=1e-6) / 448.0
    full = scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)[:n, :k]
    return (w.float() / full).to(torch.float8_e4m3fn), scale


def pack_linear(w: torch.Tensor, fmt: str, bits: int, group: int, sym: bool, act_order: bool, seed: int,
                strategy: str = "channel", block: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
    """The checkpoint tensors (without the module prefix) of one float weight [N, K] in format `fmt`."""
    if fmt in ("fp8", "ct-fp8") and block:
        q, scale = fp8_block_quantize(w, block)
        return {"weight": q, "weight_scale_inv" if fmt == "fp8" else "weight_scale": scale}
    if fmt in ("fp8", "ct-fp8"):
        amax = w.abs().amax(1) if strategy == "channel" else w.abs().amax().reshape(1)
        scale = amax.clamp(min=1e-6) / 448.0
        q = (w / scale.view(-1, 1)).to(torch.float8_e4m3fn)
        if fmt == "ct-fp8":
            return {"weight": q, "weight_scale": scale.view(-1, 1) if strategy == "channel" else scale}
        return {"weight": q, "weight_scale": scale if strategy == "channel" else scale.reshape(()),
                "input_scale": torch.tensor(1.0)}
    g_idx = make_g_idx(w.shape[1], group, act_order, seed)
    codes, scales, zeros = quantize(w, bits, group, sym, g_idx, torch.bfloat16 if fmt == "ct" else torch.float16)
    mask = (1 << bits) - 1
    if fmt == "awq":
        return {"qweight": pack(codes.t(), 4, 1, AWQ_ORDER), "qzeros": pack(zeros, 4, 1, AWQ_ORDER), "scales": scales}
    if fmt in ("gptq", "gptq_v2", "auto-round"):
        stored = (zeros - 1) & mask if fmt != "gptq_v2" else zeros  # auto-round packs like auto-gptq: zero - 1
        return {"qweight": pack(codes.t(), bits, 0), "qzeros": pack(stored, bits, 1), "scales": scales,
                "g_idx": g_idx.to(torch.int32)}
    out = {"weight_packed": pack(codes, bits, 1), "weight_scale": scales.t().contiguous(),
           "weight_shape": torch.tensor(list(w.shape))}
    if not sym:
        out["weight_zero_point"] = pack(zeros.t(), bits, 0)  # signed zero + offset == the unsigned zero
    if act_order:
        out["weight_g_idx"] = g_idx.to(torch.int32)
    return out


def make_quantized(src: Path, dst: Path, fmt: str, bits: int = 4, group: int = 128, sym: bool = False,
                   act_order: bool = False, ignore: tuple[str, ...] = (), strategy: str = "channel",
                   block: tuple[int, int] | None = None) -> Path:
    """Copy the float folder `src` to `dst` with every decoder linear (except `ignore`d modules) packed; under
    act order every MoE expert gets its own g_idx (its own inputs), gate and up one between them."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = quantization_config(fmt, bits, group, sym, act_order, list(ignore), strategy,
                                                        block)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    tensors = load_file(str(dst / "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        module, leaf = name.rsplit(".", 1)
        quantized = leaf == "weight" and module.rsplit(".", 1)[-1] in LINEARS and \
            not any(module == i or module.endswith("." + i) for i in ignore) and "vision_tower." not in module
        if not quantized:
            out[name] = t
            continue
        layer = int(module.split("layers.")[1].split(".")[0])
        seed = layer * 10 + (0 if "self_attn" in module else 1) + (5 if module.endswith(("o_proj", "down_proj")) else 0)
        if ".experts." in module:
            seed += 1000 * (1 + int(module.split(".experts.")[1].split(".")[0]))
        for leaf_name, packed in pack_linear(t, fmt, bits, group, sym, act_order, seed, strategy, block).items():
            out[f"{module}.{leaf_name}"] = packed
    save_file(out, str(dst / "model.safetensors"))
    return dst


def dequantize_module(t: dict[str, torch.Tensor], qc: dict) -> torch.Tensor:
    """Float weight [N, K] straight from one module's packed tensors (the reference for the engine's loader)."""
    method = qc["quant_method"]
    if "weight" in t and t["weight"].dtype == torch.float8_e4m3fn:
        block = qc.get("weight_block_size") or \
            (qc.get("config_groups") or {}).get("group_0", {}).get("weights", {}).get("block_structure")
        if block:
            scale = t.get("weight_scale_inv", t.get("weight_scale")).float()
            n, k = t["weight"].shape
            full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:n, :k]
            return t["weight"].float() * full
        return t["weight"].float() * t["weight_scale"].float().reshape(-1, 1)
    if method == "awq":
        codes, zeros = unpack(t["qweight"], 4, 1, AWQ_ORDER).t(), unpack(t["qzeros"], 4, 1, AWQ_ORDER)
        scales, bits = t["scales"], 4
        g_idx = torch.arange(codes.shape[1]) // qc["group_size"]
    elif method in ("gptq", "auto-round"):
        bits = qc["bits"]
        codes = unpack(t["qweight"], bits, 0).t()
        zeros = unpack(t["qzeros"], bits, 1) + (1 if qc.get("checkpoint_format", "gptq") == "gptq" else 0)
        scales, g_idx = t["scales"], t["g_idx"].long()
    else:
        w = qc["config_groups"]["group_0"]["weights"]
        bits = w["num_bits"]
        codes = unpack(t["weight_packed"], bits, 1)  # offset codes: signed + 2**(bits-1)
        zeros = unpack(t["weight_zero_point"], bits, 0).t() if "weight_zero_point" in t else \
            torch.full((t["weight_scale"].shape[1], codes.shape[0]), 1 << (bits - 1))
        scales = t["weight_scale"].t()
        k = codes.shape[1]
        g_idx = t["weight_g_idx"].long() if "weight_g_idx" in t else \
            torch.arange(k) // (w["group_size"] or k)
    return (codes - zeros.t()[:, g_idx]).float() * scales.float().t()[:, g_idx]


def dequantized_folder(src: Path, dst: Path) -> Path:
    """A plain float checkpoint with the weights a packed folder encodes, for HF transformers."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    qc = config.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    tensors = load_file(str(dst / "model.safetensors"))
    modules: dict[str, dict[str, torch.Tensor]] = {}
    out = {}
    for name, t in tensors.items():
        module, leaf = name.rsplit(".", 1)
        packed = leaf not in ("weight", "bias") or t.dtype == torch.float8_e4m3fn
        if module.rsplit(".", 1)[-1] in LINEARS and packed:
            modules.setdefault(module, {})[leaf] = t
        else:
            out[name] = t
    for module, parts in modules.items():
        out[f"{module}.weight"] = dequantize_module(parts, qc).contiguous()
    save_file(out, str(dst / "model.safetensors"))
    return dst


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP MXFP4 of float rows [..., K]: blocks [..., K/32, 16] uint8 (value 2j in the low nibble of byte j) and
    E8M0 scales [..., K/32] uint8, the scale the smallest power of two that brings the block's largest magnitude
    within E2M1's 6.0, each value rounded to the nearest E2M1 code (the first of equals)."""
    groups = w.float().reshape(*w.shape[:-1], -1, 32)
    amax = groups.abs().amax(-1).clamp(min=2.0 ** -100)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    codes = (scaled.unsqueeze(-1) - E2M1).abs().argmin(-1)  # [..., G, 32]
    pairs = codes.reshape(*codes.shape[:-1], 16, 2)
    blocks = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
    return blocks, (exponent + 127).to(torch.uint8)


def make_mxfp4_gpt_oss(src: Path, dst: Path) -> Path:
    """gpt-oss's published MXFP4 form of a float gpt-oss folder: every expert projection as `*_blocks` and
    `*_scales` of its transposed [E, N, K] weight (output rows first, gate/up interleaved as in the float
    checkpoint); biases, attention, router, embeddings and head stay float, as the published config says."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    out = {}
    for name, t in load_file(str(dst / "model.safetensors")).items():
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):  # [E, K, N] float
            blocks, scales = mxfp4_quantize(t.transpose(1, 2).contiguous())
            out[f"{name}_blocks"], out[f"{name}_scales"] = blocks, scales
        else:
            out[name] = t
    save_file(out, str(dst / "model.safetensors"))
    return dst
